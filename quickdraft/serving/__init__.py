"""OpenAI-compatible serving: an asyncio front for the engine (``AsyncEngine``) and the HTTP app."""
from quickdraft.serving.async_engine import AsyncEngine
from quickdraft.serving.errors import EngineError
from quickdraft.serving.metrics import ServerMetrics
from quickdraft.serving.streams import RequestStream


def create_app(llm, model_name: str, **kwargs):
    """Build the FastAPI app (imported lazily so the engine API does not need FastAPI)."""
    from quickdraft.serving.app import create_app as _create_app
    return _create_app(llm, model_name, **kwargs)


__all__ = ["AsyncEngine", "EngineError", "RequestStream", "ServerMetrics", "create_app"]
