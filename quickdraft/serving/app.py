"""OpenAI-compatible HTTP server: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics.

Errors use OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``: 400 for bad parameters,
malformed JSON, wrong types and prompts that do not fit the context; 404 for an unknown model; 500 only
for internal bugs. A bad request is rejected before it reaches the engine and never affects the others.
A client that disconnects (streaming or not) has its request aborted, which frees its KV blocks.
"""
from __future__ import annotations

import asyncio
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import jinja2
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from quickdraft.engine.outputs import SpecMetrics, StreamChunk
from quickdraft.errors import InvalidParameterError, PromptTooLongError, QuickdraftError, require_unicode
from quickdraft.sampling import SamplingParams
from quickdraft.sampling.params import MAX_LOGPROBS
from quickdraft.serving.async_engine import (AsyncEngine, EngineError, EngineStoppedError, QueueFullError,
                                             RequestStream, RequestTimeoutError)
from quickdraft.serving.guard import GuardMiddleware, ServerLimits, error_body
from quickdraft.serving.metrics import CONTENT_TYPE, ServerMetrics
from quickdraft.serving.protocol import (ChatCompletionRequest, CompletionRequest, ErrorResponse,
                                         ModelNotFoundError, _SamplingFields, param_of)

log = logging.getLogger("quickdraft.serving")


class ClientGone(Exception):
    """The client disconnected before its (non-streaming) response was ready."""


def _bad(message: str, param: str | None = None, code: str | None = None) -> InvalidParameterError:
    err = InvalidParameterError(message)
    err.param, err.code = param, code
    return err


def error_response(status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                   code: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(status_code=status, content=error_body(message, type_, param, code), headers=headers)


def describe_validation(errors: list[dict]) -> tuple[str, str | None]:
    """One clear sentence (and the field) from pydantic's error list."""
    if not errors:
        return "invalid request body", None
    e = errors[0]
    loc = [str(x) for x in e.get("loc", ()) if x != "body"]
    if e.get("type") == "json_invalid":
        detail = (e.get("ctx") or {}).get("error") or e.get("msg", "")
        where = f" at position {loc[0]}" if loc else ""
        return f"malformed JSON in the request body: {detail}{where}", None
    if not loc:
        return "the request body must be a JSON object", None
    name = ".".join(loc)
    msg = e.get("msg", "invalid value")
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    if e.get("type") == "missing":
        message = f"{name} is required"
    elif msg.startswith(loc[0]):
        message = msg
    else:
        got = repr(e.get("input"))
        message = f"{name}: {msg[:1].lower() + msg[1:]}, got {got[:100]}"
    if len(errors) > 1:
        message += f" ({len(errors) - 1} more error{'s' if len(errors) > 2 else ''} in the request)"
    return message, loc[0]


_ERROR = {"model": ErrorResponse}
ERROR_RESPONSES = {
    400: {**_ERROR, "description": "a bad parameter, malformed JSON, or a prompt that does not fit the context"},
    401: {**_ERROR, "description": "missing or wrong API key (when the server requires one)"},
    404: {**_ERROR, "description": "unknown model"},
    413: {**_ERROR, "description": "the request body is larger than the server accepts"},
    429: {**_ERROR, "description": "the queue of waiting requests is full: retry after Retry-After seconds"},
    500: {**_ERROR, "description": "this request failed inside the engine (the others were not affected)"},
    503: {**_ERROR, "description": "the server is shutting down, or its engine failed"},
    504: {**_ERROR, "description": "the request ran longer than the server's per-request timeout"},
}


def describe_error(exc: BaseException) -> tuple[int, dict]:
    """The HTTP status and OpenAI-shaped body of an error, for a response or a stream's error event."""
    if isinstance(exc, ModelNotFoundError):
        return 404, error_body(str(exc), param="model", code="model_not_found")
    if isinstance(exc, EngineStoppedError):
        return 503, error_body(str(exc), type_="service_unavailable_error")
    if isinstance(exc, QueueFullError):
        return 429, error_body(str(exc), type_="rate_limit_error", code="queue_full")
    if isinstance(exc, RequestTimeoutError):
        return 504, error_body(str(exc), type_="timeout_error", code="request_timeout")
    if isinstance(exc, QuickdraftError) and not isinstance(exc, EngineError):
        param = getattr(exc, "param", None) or param_of(str(exc))
        code = getattr(exc, "code", None) or (
            "context_length_exceeded" if isinstance(exc, PromptTooLongError) else None)
        return 400, error_body(str(exc), param=param, code=code)
    return 500, error_body(str(exc) or type(exc).__name__, type_="internal_server_error")


def _clean(lp: float) -> float:
    return lp if math.isfinite(lp) else -9999.0


@dataclass
class _Choice:
    index: int
    text: list[str] = field(default_factory=list)
    num_tokens: int = 0
    logprobs: list[dict] = field(default_factory=list)
    finish_reason: str | None = None
    spec: SpecMetrics = field(default_factory=SpecMetrics)


@dataclass
class _Job:
    """One HTTP generation request: its engine requests (one per prompt) and output bookkeeping."""

    id: str
    created: int
    prompts: list[tuple[list[int], str | None]]
    params: list[SamplingParams]
    n: int
    streams: list[RequestStream] = field(default_factory=list)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(ids) for ids, _ in self.prompts)


async def _merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, StreamChunk]]:
    """Chunks of several engine requests as ``(prompt index, chunk)``; closing it aborts what is unfinished."""
    if len(streams) == 1:
        try:
            async for chunk in streams[0]:
                yield 0, chunk
        finally:
            streams[0].close()
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(p: int, stream: RequestStream) -> None:
        try:
            async for chunk in stream:
                queue.put_nowait((p, chunk))
            queue.put_nowait((p, None))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            queue.put_nowait((p, exc))

    tasks = [asyncio.ensure_future(pump(p, s)) for p, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            p, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield p, item
    finally:  # no awaits here: this may run inside a cancelled scope
        for task in tasks:
            task.cancel()
        for s in streams:
            s.close()


def create_app(llm, model_name: str, *, metrics: ServerMetrics | None = None,
               limits: ServerLimits | None = None) -> FastAPI:
    """The app serving ``llm`` as ``model_name``; its engine thread runs until the app shuts down."""
    limits = limits or ServerLimits()
    aengine = AsyncEngine(llm, metrics=metrics, max_waiting_requests=limits.max_waiting_requests,
                          request_timeout_s=limits.request_timeout_s,
                          max_queued_chunks=limits.max_queued_chunks).start()
    metrics = aengine.metrics
    tokenizer = llm.tokenizer
    ctx = llm.max_model_len
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        aengine.shutdown()

    app = FastAPI(title="quickdraft", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible server for quickdraft (exact speculative decoding)")
    app.state.engine = aengine
    app.state.llm = llm
    app.state.model_name = model_name
    app.state.limits = limits
    app.add_middleware(GuardMiddleware, limits=limits, on_refused=lambda status: metrics.count_request("error"))

    # ---- errors ------------------------------------------------------------------------------------
    @app.exception_handler(RequestValidationError)
    async def _on_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        metrics.count_request("error")
        message, param = describe_validation(list(exc.errors()))
        return error_response(400, message, param=param)

    @app.exception_handler(QuickdraftError)
    async def _on_quickdraft(request: Request, exc: QuickdraftError) -> JSONResponse:
        if not getattr(exc, "counted", False):
            metrics.count_request("error")
        status, body = describe_error(exc)
        headers = {"Retry-After": str(limits.retry_after_s)} if status == 429 else None
        return JSONResponse(status_code=status, content=body, headers=headers)

    @app.exception_handler(StarletteHTTPException)
    async def _on_http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(exc.status_code, str(exc.detail), type_=type_)

    @app.exception_handler(Exception)
    async def _on_bug(request: Request, exc: Exception) -> JSONResponse:
        log.exception("internal error serving %s", request.url.path)
        return error_response(500, f"internal server error: {type(exc).__name__}: {exc}",
                              type_="internal_server_error")

    # ---- helpers -------------------------------------------------------------------------------------
    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise ModelNotFoundError(f"The model `{name}` does not exist. This server serves `{model_name}`.")

    def sampling_params(req: _SamplingFields, prompt_len: int, max_tokens: int | None, logprobs: int | None,
                        prompt_param: str) -> SamplingParams:
        if prompt_len >= ctx:
            raise _bad(f"the prompt has {prompt_len} tokens but this model's maximum context length is {ctx} "
                       f"tokens, and at least one token must be left for the completion; shorten the "
                       f"{prompt_param}", prompt_param, "context_length_exceeded")
        fields = dict(
            n=req.n, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p,
            repetition_penalty=req.repetition_penalty, presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty, logit_bias=req.logit_bias, seed=req.seed, stop=req.stop,
            stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos, priority=req.priority,
            deadline_s=req.deadline_s, include_stop_str_in_output=req.include_stop_str_in_output,
            skip_special_tokens=req.skip_special_tokens, logprobs=logprobs,
            max_tokens=ctx - prompt_len if max_tokens is None else max_tokens)
        params = SamplingParams(**{k: v for k, v in fields.items() if v is not None})
        if prompt_len + params.max_tokens > ctx:
            raise _bad(f"This model's maximum context length is {ctx} tokens. However, you requested "
                       f"{prompt_len + params.max_tokens} tokens ({prompt_len} in the {prompt_param}, "
                       f"{params.max_tokens} in the completion). Please reduce the length of the {prompt_param} "
                       f"or completion.", "max_tokens", "context_length_exceeded")
        params.check_vocab(llm.engine.vocab_size)
        return params

    async def start(job: _Job) -> None:
        try:
            for p, ((ids, text), params) in enumerate(zip(job.prompts, job.params)):
                job.streams.append(await aengine.generate(ids, params, text, request_id=f"{job.id}-{p}"))
        except QuickdraftError as exc:
            exc.counted = True
            for s in job.streams:
                s.close()
            raise
        except BaseException:
            for s in job.streams:
                s.close()
            raise

    async def gather(job: _Job) -> list[_Choice]:
        choices = {}
        async for p, chunk in _merged(job.streams):
            idx = p * job.n + chunk.index
            c = choices.setdefault(idx, _Choice(idx))
            c.text.append(chunk.text)
            c.num_tokens += len(chunk.token_ids)
            if chunk.logprobs:
                c.logprobs.extend(chunk.logprobs)
            if chunk.finished:
                c.finish_reason = chunk.finish_reason
                if chunk.metrics is not None:
                    c.spec = chunk.metrics.spec
        return [choices[i] for i in sorted(choices)]

    async def until_disconnect(request: Request) -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    async def gather_or_abort(request: Request, job: _Job) -> list[_Choice]:
        """Wait for the outputs, aborting the engine requests if the client goes away first."""
        work = asyncio.ensure_future(gather(job))
        watcher = asyncio.ensure_future(until_disconnect(request))
        try:
            await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not work.done():
                work.cancel()
                for s in job.streams:
                    s.close()
            watcher.cancel()
        if not work.done() or work.cancelled():
            raise ClientGone()
        return work.result()

    def usage(prompt_tokens: int, choices: list[_Choice]) -> dict:
        spec = SpecMetrics()
        for c in choices:
            spec.add(c.spec)
        completion = sum(c.num_tokens for c in choices)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                "total_tokens": prompt_tokens + completion,
                "speculative": {"rounds": spec.rounds, "draft_tokens": spec.draft_tokens,
                                "accepted_tokens": spec.accepted_tokens,
                                "acceptance_rate": round(spec.acceptance_rate, 4)}}

    token_text_cache: dict[int, str] = {}

    def token_text(token_id: int) -> str:
        text = token_text_cache.get(token_id)
        if text is None:
            text = tokenizer.decode([token_id])
            if len(token_text_cache) < 200_000:
                token_text_cache[token_id] = text
        return text

    def completion_logprobs(entries: list[dict], offset: int) -> dict:
        tokens, token_lps, tops, offsets = [], [], [], []
        for e in entries:
            tok = token_text(e["token_id"])
            tokens.append(tok)
            token_lps.append(_clean(e["logprob"]))
            top = {}
            for tid, lp in e["top"]:
                top.setdefault(token_text(tid), _clean(lp))
            top.setdefault(tok, _clean(e["logprob"]))
            tops.append(top)
            offsets.append(offset)
            offset += len(tok)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    def chat_logprobs(entries: list[dict]) -> dict:
        def item(tid: int, lp: float) -> dict:
            tok = token_text(tid)
            return {"token": tok, "logprob": _clean(lp), "bytes": list(tok.encode("utf-8"))}

        return {"content": [{**item(e["token_id"], e["logprob"]),
                             "top_logprobs": [item(tid, lp) for tid, lp in e["top"]]} for e in entries]}

    def sse(obj: dict | str) -> str:
        return f"data: {obj if isinstance(obj, str) else json.dumps(obj, separators=(',', ':'))}\n\n"

    def stream_error(exc: BaseException) -> str:
        status, body = describe_error(exc)
        if status >= 500:
            log.error("request failed mid-stream: %s", exc)
        return sse(body)

    # ---- routes ----------------------------------------------------------------------------------------
    @app.get("/health")
    async def health() -> Response:
        if not aengine.alive:
            return error_response(503, aengine.failure or "the server is shutting down",
                                  type_="service_unavailable_error")
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus() -> Response:
        stats = await aengine.stats_async() if aengine.alive else aengine.stats()
        return PlainTextResponse(metrics.render(stats), media_type=CONTENT_TYPE)

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> Response:
        """Forget cached prompt prefixes (vLLM's endpoint of the same name): benchmarks call it so that a prompt sent
        again is computed again."""
        await aengine.reset_prefix_cache()
        return JSONResponse({"status": "ok"})

    def model_card() -> dict:
        return {"id": model_name, "object": "model", "created": created, "owned_by": "quickdraft",
                "max_model_len": ctx}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str) -> dict:
        check_model(name)
        return model_card()

    @app.post("/v1/completions", responses=ERROR_RESPONSES)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        check_model(body.model)
        if body.suffix:
            raise _bad("suffix is not supported", "suffix")
        if body.best_of is not None and body.best_of != (body.n or 1):
            raise _bad(f"best_of is not supported (it must equal n), got {body.best_of}", "best_of")
        if body.echo and body.logprobs is not None:
            raise _bad("echo together with logprobs is not supported (prompt logprobs are not computed)", "echo")
        if len(body.prompts()) > limits.max_prompts_per_request:
            raise _bad(f"prompt must be a list of at most {limits.max_prompts_per_request} prompts per request, got "
                       f"{len(body.prompts())}", "prompt")
        prompts = []
        for p in body.prompts():
            if isinstance(p, str):
                require_unicode("prompt", p)
                ids = await asyncio.to_thread(tokenizer.encode, p)  # a long prompt must not stall other streams
                if not ids:
                    raise _bad("prompt must not be empty", "prompt")
                prompts.append((ids, p))
            else:
                prompts.append((list(p), None))
        params = [sampling_params(body, len(ids), body.max_tokens, body.logprobs, "prompt") for ids, _ in prompts]
        job = _Job(f"cmpl-{uuid.uuid4().hex}", int(time.time()), prompts, params, params[0].n)
        await start(job)

        def echo_text(p: int) -> str:
            ids, text = job.prompts[p]
            return text if text is not None else tokenizer.decode(ids)

        if not body.stream:
            try:
                choices = await gather_or_abort(request, job)
            except ClientGone:
                return Response(status_code=499)
            out = []
            for c in choices:
                text = "".join(c.text)
                if body.echo:
                    text = echo_text(c.index // job.n) + text
                lp = completion_logprobs(c.logprobs, 0) if body.logprobs is not None else None
                out.append({"index": c.index, "text": text, "logprobs": lp, "finish_reason": c.finish_reason})
            return JSONResponse({"id": job.id, "object": "text_completion", "created": job.created,
                                 "model": model_name, "choices": out, "usage": usage(job.prompt_tokens, choices)})

        async def events() -> AsyncIterator[str]:
            include_usage = body.include_usage
            choices: dict[int, _Choice] = {}
            offsets: dict[int, int] = {}
            base = {"id": job.id, "object": "text_completion", "created": job.created, "model": model_name}
            try:
                async for p, chunk in _merged(job.streams):
                    idx = p * job.n + chunk.index
                    c = choices.setdefault(idx, _Choice(idx))
                    c.num_tokens += len(chunk.token_ids)
                    text = chunk.text
                    if body.echo and idx not in offsets:
                        text = echo_text(p) + text
                    lp = None
                    if body.logprobs is not None:
                        lp = completion_logprobs(chunk.logprobs or [], offsets.get(idx, 0))
                    offsets[idx] = offsets.get(idx, 0) + len(text)
                    if chunk.finished:
                        c.finish_reason = chunk.finish_reason
                        if chunk.metrics is not None:
                            c.spec = chunk.metrics.spec
                    if not text and not chunk.finished and not (lp and lp["tokens"]):
                        continue
                    event = {**base, "choices": [{"index": idx, "text": text, "logprobs": lp,
                                                  "finish_reason": c.finish_reason}]}
                    if include_usage:
                        event["usage"] = None
                    yield sse(event)
                if include_usage:
                    yield sse({**base, "choices": [], "usage": usage(job.prompt_tokens, list(choices.values()))})
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - reported in the stream
                yield stream_error(exc)
            finally:  # closed or cancelled early (client gone): abort what is unfinished
                for s in job.streams:
                    s.close()
            yield sse("[DONE]")

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.post("/v1/chat/completions", responses=ERROR_RESPONSES)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        check_model(body.model)
        if body.response_format and body.response_format.get("type", "text") != "text":
            raise _bad(f"response_format {body.response_format.get('type')!r} is not supported (only 'text')",
                       "response_format")
        logprobs = None
        if body.top_logprobs is not None:
            if not body.logprobs:
                raise _bad("top_logprobs requires logprobs to be true", "top_logprobs")
            if not 0 <= body.top_logprobs <= MAX_LOGPROBS:
                raise _bad(f"top_logprobs must be an int in [0, {MAX_LOGPROBS}], got {body.top_logprobs}",
                           "top_logprobs")
        if body.logprobs:
            logprobs = body.top_logprobs or 0
        try:
            ids = await asyncio.to_thread(llm.chat_prompt, [m.for_template() for m in body.messages])
        except (ValueError, TypeError, KeyError, jinja2.TemplateError) as exc:
            raise _bad(f"messages could not be rendered with the model's chat template: {exc}", "messages") from exc
        params = sampling_params(body, len(ids), body.requested_max_tokens, logprobs, "messages")
        job = _Job(f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), [(ids, None)], [params], params.n)
        await start(job)

        if not body.stream:
            try:
                choices = await gather_or_abort(request, job)
            except ClientGone:
                return Response(status_code=499)
            out = [{"index": c.index, "message": {"role": "assistant", "content": "".join(c.text)},
                    "logprobs": chat_logprobs(c.logprobs) if body.logprobs else None,
                    "finish_reason": c.finish_reason} for c in choices]
            return JSONResponse({"id": job.id, "object": "chat.completion", "created": job.created,
                                 "model": model_name, "choices": out, "usage": usage(job.prompt_tokens, choices)})

        async def events() -> AsyncIterator[str]:
            include_usage = body.include_usage
            base = {"id": job.id, "object": "chat.completion.chunk", "created": job.created, "model": model_name}
            extra = {"usage": None} if include_usage else {}
            choices: dict[int, _Choice] = {}
            try:
                for i in range(job.n):
                    yield sse({**base, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                    "logprobs": None, "finish_reason": None}], **extra})
                async for _, chunk in _merged(job.streams):
                    c = choices.setdefault(chunk.index, _Choice(chunk.index))
                    c.num_tokens += len(chunk.token_ids)
                    lp = chat_logprobs(chunk.logprobs or []) if body.logprobs else None
                    if chunk.finished:
                        c.finish_reason = chunk.finish_reason
                        if chunk.metrics is not None:
                            c.spec = chunk.metrics.spec
                    if not chunk.text and not chunk.finished and not (lp and lp["content"]):
                        continue
                    delta = {"content": chunk.text} if chunk.text else {}
                    yield sse({**base, "choices": [{"index": chunk.index, "delta": delta, "logprobs": lp,
                                                    "finish_reason": c.finish_reason}], **extra})
                if include_usage:
                    yield sse({**base, "choices": [], "usage": usage(job.prompt_tokens, list(choices.values()))})
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - reported in the stream
                yield stream_error(exc)
            finally:  # closed or cancelled early (client gone): abort what is unfinished
                for s in job.streams:
                    s.close()
            yield sse("[DONE]")

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    app.openapi = lambda: openapi_without_422(app)
    return app


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
