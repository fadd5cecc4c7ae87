"""Model loading: GGUF files, Hugging Face directories and packaged model names."""
from quickdraft.loading.checkpoint import Checkpoint
from quickdraft.loading.load import load_checkpoint
from quickdraft.loading.registry import PackagedModel, list_models, resolve_model

__all__ = ["Checkpoint", "PackagedModel", "list_models", "load_checkpoint", "resolve_model"]
