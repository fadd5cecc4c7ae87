"""llama-server's ``/infill``: fill in the middle of code, the request and the response in llama-server's own shape
(what editor plugins such as llama.vscode send and read).

The request: ``input_prefix`` and ``input_suffix`` (the text before and after the cursor), ``prompt`` (text typed
after the prefix), ``input_extra`` (other files, ``[{"filename", "text"}]``), ``n_predict`` (-1: until the end), and
the sampling fields by llama-server's names, with its defaults (temperature 0.8, top_k 40, top_p 0.95, min_p 0.05).
The prompt is built as llama-server builds it (``tokenizer/fim.py``). The response: ``content``, ``stop``,
``stop_type``, ``tokens_predicted``, ``tokens_evaluated``, ``truncated``, ``timings`` and the rest of llama-server's
fields that the engine knows; streamed, one ``data:`` event a chunk, the last with ``stop: true``.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any, ClassVar

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import StrictBool, StrictInt, StrictStr, field_validator

from quickdraft.engine.outputs import RequestMetrics, StreamChunk
from quickdraft.errors import require_unicode
from quickdraft.serving.errors import invalid_parameter
from quickdraft.serving.jobs import ClientGone, Job
from quickdraft.serving.openai_format import ERROR_RESPONSES, Choice
from quickdraft.serving.protocol import CompletionRequest
from quickdraft.serving.routes import context_of, dry_breakers, sampling_params
from quickdraft.serving.sse import sse
from quickdraft.serving.streams import merge_streams
from quickdraft.tokenizer.fim import FimTokens, Infill, describe_missing, infill_ids

router = APIRouter()
MAX_EXTRA_FILES = 256
LLAMA_DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}  # llama-server's


class InfillRequest(CompletionRequest):
    """llama-server's /infill body; the completions fields (``max_tokens``, ``stop``, llama.cpp's samplers) too."""

    prompt: Any = ""
    input_prefix: StrictStr = ""
    input_suffix: StrictStr = ""
    input_extra: Any = None
    n_predict: StrictInt | None = None
    repeat_penalty: Any = None
    return_tokens: StrictBool | None = False

    NAMES: ClassVar[dict[str, str]] = {"repeat_penalty": "repetition_penalty"}

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, value: Any) -> Any:
        if not isinstance(value, str):
            raise ValueError("prompt must be a string (text typed after the prefix)")
        return value

    def infill(self) -> Infill:
        for name in ("input_prefix", "input_suffix", "prompt"):
            require_unicode(name, getattr(self, name))
        return Infill(self.input_prefix, self.input_suffix, self.prompt, self._extra_files())

    def _extra_files(self) -> list[tuple[str, str]]:
        given = self.input_extra or []
        allowed = f'a list of at most {MAX_EXTRA_FILES} objects {{"filename": string, "text": string}}'
        if not isinstance(given, list) or len(given) > MAX_EXTRA_FILES:
            raise invalid_parameter(f"input_extra must be {allowed}", "input_extra")
        files = []
        for i, chunk in enumerate(given):
            if not isinstance(chunk, dict) or not isinstance(chunk.get("text", ""), str) \
                    or not isinstance(chunk.get("filename", "tmp"), str):
                raise invalid_parameter(f"input_extra[{i}] must be an object {{\"filename\": string, \"text\": "
                                        f"string}}", "input_extra")
            files.append((chunk.get("filename", "tmp"), chunk.get("text", "")))
            require_unicode(f"input_extra[{i}]", files[-1][0] + files[-1][1])
        return files

    def with_llama_defaults(self) -> "InfillRequest":
        """The body with llama-server's names mapped to ours and its defaults where a field is not given."""
        update = {ours: getattr(self, theirs) for theirs, ours in self.NAMES.items() if getattr(self, theirs) is not None}
        update |= {k: v for k, v in LLAMA_DEFAULTS.items() if getattr(self, k) is None}
        if self.max_tokens is None and self.n_predict is not None and self.n_predict >= 0:
            update["max_tokens"] = self.n_predict
        return self.model_copy(update=update)


@router.post("/infill", responses=ERROR_RESPONSES)
async def infill(body: InfillRequest, request: Request) -> Response:
    ctx = context_of(request)
    ctx.check_model(body.model)
    if (body.n or 1) != 1:
        raise invalid_parameter("n must be 1 on /infill", "n")
    fim = FimTokens.of(ctx.llm.tokenizer)
    if fim is None:
        raise invalid_parameter(describe_missing(), "input_prefix")
    body = body.with_llama_defaults()
    ids, truncated = await asyncio.to_thread(infill_ids, ctx.llm.tokenizer, fim, body.infill(), ctx.llm.max_model_len,
                                             body.max_tokens or 0)
    params = sampling_params(ctx, body, len(ids), body.max_tokens, None, "input_prefix")
    params.stop_token_ids = sorted(set(params.stop_token_ids) | set(fim.ends))
    await dry_breakers(ctx, params)
    job = Job.new("infill", [(ids, None)], [params])
    started = time.perf_counter()
    await job.start(ctx.engine)
    result = _Result(ctx.model_name, len(ids), truncated, bool(body.return_tokens))
    if body.stream:
        return StreamingResponse(_events(job, result), media_type="text/event-stream")
    try:
        await _collect(job, result, request)
    except ClientGone:
        return Response(status_code=499)
    result.wall_s = time.perf_counter() - started
    return JSONResponse(result.final())


class _Result:
    """What llama-server's result says, as the chunks come."""

    def __init__(self, model: str, prompt_n: int, truncated: bool, return_tokens: bool) -> None:
        self.model, self.prompt_n, self.truncated, self.return_tokens = model, prompt_n, truncated, return_tokens
        self.choice = Choice(0)
        self.tokens: list[int] = []
        self.metrics: RequestMetrics | None = None
        self.wall_s = 0.0

    def add(self, chunk: StreamChunk) -> dict:
        """Note a chunk; returns its partial result."""
        self.choice.text.append(chunk.text)
        self.choice.count(chunk)
        self.tokens += chunk.token_ids
        self.metrics = chunk.metrics or self.metrics
        return {"index": 0, "content": chunk.text, "tokens": chunk.token_ids if self.return_tokens else [],
                "stop": False, "tokens_predicted": len(self.tokens), "tokens_evaluated": self.prompt_n}

    def final(self, content: str | None = None) -> dict:
        c, m = self.choice, self.metrics or RequestMetrics()
        text = "".join(c.text) if content is None else content
        stop_type = {"stop": "word" if c.stop_string else "eos", "length": "limit"}.get(c.finish_reason or "", "none")
        prompt_ms = 1e3 * (m.ttft_s or 0.0)
        predicted_ms = 1e3 * max(0.0, m.total_s - (m.ttft_s or 0.0))
        return {"index": 0, "content": text, "tokens": self.tokens if self.return_tokens else [], "stop": True,
                "model": self.model, "tokens_predicted": len(self.tokens), "tokens_evaluated": self.prompt_n,
                "tokens_cached": self.choice.cached_tokens, "truncated": self.truncated, "has_new_line": "\n" in text,
                "stop_type": stop_type, "stopping_word": c.stop_string or "",
                "timings": {"prompt_n": self.prompt_n - self.choice.cached_tokens, "prompt_ms": prompt_ms,
                            "predicted_n": len(self.tokens), "predicted_ms": predicted_ms,
                            "predicted_per_second": m.tokens_per_s},
                "speculative": c.spec.usage()}


async def _collect(job: Job, result: _Result, request: Request) -> None:
    """The whole fill into ``result``; ClientGone (and the job aborted) if the client leaves first."""
    async def read() -> None:
        async for _, chunk in merge_streams(job.streams):
            result.add(chunk)

    await job.wait_or_abort(read(), request)


async def _events(job: Job, result: _Result) -> AsyncIterator[str]:
    """A partial result a chunk with text, then the final one (its content streamed already, as llama-server)."""
    try:
        async for _, chunk in merge_streams(job.streams):
            event = result.add(chunk)
            if chunk.text or chunk.token_ids:
                yield sse(event)
            if chunk.finished:
                yield sse(result.final(content=""))
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001 - reported in the stream, as llama-server does
        yield sse({"error": {"code": 500, "message": str(exc), "type": "server_error"}})
    finally:  # closed early (the client left): abort what is unfinished
        job.close()
