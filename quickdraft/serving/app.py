"""OpenAI-compatible HTTP server: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics.

This module assembles the app: the engine thread, the guard (API key, body cap), the error handlers that give
every failure OpenAI's error shape, and the routes (``routes.py``). A bad request is rejected before it reaches
the engine and never affects the others. A client that disconnects (streaming or not) has its request aborted,
which frees its KV blocks.
"""
from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from quickdraft.errors import QuickdraftError
from quickdraft.serving.async_engine import AsyncEngine
from quickdraft.serving.guard import OPEN_PATHS, GuardMiddleware, ServerLimits, error_body, shaped_error_body
from quickdraft.serving.metrics import ServerMetrics
from quickdraft.serving.openai_format import TokenTexts, describe_error, describe_validation
from quickdraft.serving.anthropic_api import router as anthropic_router
from quickdraft.serving.extra_routes import router as extra_router
from quickdraft.serving.llama_api import router as llama_router
from quickdraft.serving.lora_api import router as lora_router
from quickdraft.serving.response_store import ResponseStore
from quickdraft.serving.responses_api import router as responses_router
from quickdraft.serving.routes import ServerContext, context_of, router
from quickdraft.serving.web import PAGE_PATHS, router as web_router

log = logging.getLogger("quickdraft.serving")


def create_app(llm, model_name: str, *, metrics: ServerMetrics | None = None,
               limits: ServerLimits | None = None, web: bool = True,
               lora_scales: dict[str, float] | None = None) -> FastAPI:
    """The app serving ``llm`` as ``model_name``; its engine thread runs until the app shuts down. ``web``: the
    chat page at ``/``. ``lora_scales``: the LoRA adapters every request runs unless it names its own, and their
    scales (llama-server's ``--lora``; see ``lora_api.py``)."""
    limits = limits or ServerLimits()
    ServerContext.check_adapters(llm, model_name, lora_scales or {})
    engine = AsyncEngine(llm, metrics=metrics, max_waiting_requests=limits.max_waiting_requests,
                         request_timeout_s=limits.request_timeout_s,
                         max_queued_chunks=limits.max_queued_chunks).start()
    app = FastAPI(title="quickdraft", version="0.1.0", lifespan=_lifespan,
                  description="OpenAI-compatible server for quickdraft (exact speculative decoding)")
    app.state.context = ServerContext(engine, llm, model_name, limits, TokenTexts(llm.tokenizer),
                                      responses=ResponseStore(limits.max_stored_responses),
                                      lora_scales=dict(lora_scales or {}))
    app.state.engine = engine  # the attributes tests and tools read
    app.state.llm = llm
    app.state.model_name = model_name
    app.state.limits = limits
    app.add_middleware(GuardMiddleware, limits=limits, open_paths=OPEN_PATHS + (PAGE_PATHS if web else ()),
                       on_refused=lambda status: engine.metrics.count_request("error"))
    app.add_exception_handler(RequestValidationError, _on_validation)
    app.add_exception_handler(QuickdraftError, _on_quickdraft)
    app.add_exception_handler(StarletteHTTPException, _on_http)
    app.add_exception_handler(Exception, _on_bug)
    routers = (router, responses_router, anthropic_router, extra_router, llama_router, lora_router)
    for routes in routers + ((web_router,) if web else ()):
        app.include_router(routes)
    app.openapi = lambda: openapi_without_422(app)
    return app


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    yield
    app.state.context.engine.shutdown()


def _error(request: Request, status: int, body: dict, headers: dict[str, str] | None = None) -> JSONResponse:
    """An error response in the shape of the route's API (OpenAI's, or Anthropic's on /v1/messages)."""
    return JSONResponse(status_code=status, content=shaped_error_body(request.url.path, status, body),
                        headers=headers)


async def _on_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
    context_of(request).metrics.count_request("error")
    message, param = describe_validation(list(exc.errors()))
    return _error(request, 400, error_body(message, param=param))


async def _on_quickdraft(request: Request, exc: QuickdraftError) -> JSONResponse:
    ctx = context_of(request)
    if not getattr(exc, "counted", False):  # Job.start marks what AsyncEngine.generate counted already
        ctx.metrics.count_request("error")
    status, body = describe_error(exc)
    headers = {"Retry-After": str(ctx.limits.retry_after_s)} if status == 429 else None
    return _error(request, status, body, headers)


async def _on_http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return _error(request, exc.status_code, error_body(str(exc.detail), type_))


async def _on_bug(request: Request, exc: Exception) -> JSONResponse:
    log.exception("internal error serving %s", request.url.path)
    body = error_body(f"internal server error: {type(exc).__name__}: {exc}", "internal_server_error")
    return _error(request, 500, body)


def openapi_without_422(app: FastAPI) -> dict:
    """The schema as clients see the server: bad requests are 400 with OpenAI's error body, never FastAPI's 422."""
    if app.openapi_schema is None:
        schema = FastAPI.openapi(app)
        for operations in schema.get("paths", {}).values():
            for operation in operations.values():
                operation.get("responses", {}).pop("422", None)
        for name in ("HTTPValidationError", "ValidationError"):
            schema.get("components", {}).get("schemas", {}).pop(name, None)
        app.openapi_schema = schema
    return app.openapi_schema
