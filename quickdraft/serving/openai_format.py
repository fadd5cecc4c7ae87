"""Engine output and errors in the shapes of OpenAI's API: usage, logprobs, choices, response bodies, errors.

Errors use OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``: 400 for bad parameters,
malformed JSON, wrong types and prompts that do not fit the context; 404 for an unknown model; 500 only
for internal bugs.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fastapi.responses import JSONResponse

from quickdraft.engine.outputs import SpecMetrics, StreamChunk
from quickdraft.errors import PromptTooLongError, QuickdraftError
from quickdraft.serving.errors import (EngineError, EngineStoppedError, NotFoundError, QueueFullError,
                                      RequestTimeoutError)
from quickdraft.serving.guard import error_body
from quickdraft.serving.protocol import ErrorResponse, ModelNotFoundError, param_of
from quickdraft.serving.reasoning import ReasoningFormat, ReasoningReader
from quickdraft.serving.tools import ToolCall, ToolCallStream, ToolSpec, arguments_valid, parse_tool_calls

if TYPE_CHECKING:  # prompt_logprobs.py renders with this module's pieces
    from quickdraft.serving.prompt_logprobs import PromptLogprobs

TokenText = Callable[[int], str]
ChoiceFields = Callable[[int, int, StreamChunk], dict | None]
"""(prompt index, choice index, chunk) -> the choice's fields between ``index`` and ``finish_reason`` in its stream
event, or None when the chunk has nothing to send."""

_ERROR = {"model": ErrorResponse}  # ERROR_RESPONSES: what the generation routes document in the OpenAPI schema
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


# ---- errors ----------------------------------------------------------------------------------------------
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


def describe_error(exc: BaseException) -> tuple[int, dict]:
    """The HTTP status and OpenAI-shaped body of an error, for a response or a stream's error event."""
    if isinstance(exc, ModelNotFoundError):
        return 404, error_body(str(exc), param="model", code="model_not_found")
    if isinstance(exc, NotFoundError):
        return 404, error_body(str(exc), type_="not_found_error", param=exc.param, code=exc.code)
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


# ---- choices and usage -----------------------------------------------------------------------------------
@dataclass
class Choice:
    """One sample's output as it accumulates (``text`` and ``logprobs`` only when the whole response is sent
    at once; a stream sends them as they come)."""

    index: int
    text: list[str] = field(default_factory=list)
    num_tokens: int = 0
    logprobs: list[dict] = field(default_factory=list)
    finish_reason: str | None = None
    spec: SpecMetrics = field(default_factory=SpecMetrics)
    cached_tokens: int = 0
    stop_string: str | None = None
    prompt_logprobs: list[dict | None] | None = None  # its prompt's (SamplingParams.prompt_logprobs)

    def count(self, chunk: StreamChunk) -> None:
        """Note the chunk's tokens and how the sample finished: what usage and finish_reason need."""
        self.num_tokens += len(chunk.token_ids)
        if chunk.finished:
            self.finish_reason, self.stop_string = chunk.finish_reason, chunk.stop_string
            if chunk.metrics is not None:
                self.spec = chunk.metrics.spec
                self.cached_tokens = chunk.metrics.cached_tokens or 0


def usage(prompt_tokens: int, choices: list[Choice], n: int = 1) -> dict:
    """OpenAI's usage; ``prompt_tokens_details.cached_tokens``: prompt tokens read from the KV cache (a cached
    prefix), counted once per prompt (its first sample; the others share its blocks)."""
    spec = SpecMetrics()
    for c in choices:
        spec.add(c.spec)
    completion = sum(c.num_tokens for c in choices)
    cached = sum(c.cached_tokens for c in choices if c.index % n == 0)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion, "prompt_tokens_details": {"cached_tokens": cached},
            "speculative": spec.usage()}


def response_head(id_: str, object_: str, created: int, model_name: str) -> dict:
    """The fields every response body and stream event starts with."""
    return {"id": id_, "object": object_, "created": created, "model": model_name}


# ---- logprobs --------------------------------------------------------------------------------------------
class TokenTexts:
    """Token id -> its text, cached: logprobs name every top token, and decoding each one again is slow."""

    MAX_CACHED = 200_000

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._tokenizer.decode([token_id])
            if len(self._cache) < self.MAX_CACHED:
                self._cache[token_id] = text
        return text


def clean_logprob(lp: float) -> float:
    """JSON has no -inf: a token the sampler excluded gets a very low finite logprob instead."""
    return lp if math.isfinite(lp) else -9999.0


def completion_logprobs(entries: list[dict], offset: int, token_text: TokenText) -> dict:
    """/v1/completions' logprobs; ``offset`` is where the entries' text starts in the choice's text. An entry
    whose logprob is None (an echoed prompt's first token) has None for its logprob and its top ones, as OpenAI's."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for e in entries:
        tok = token_text(e["token_id"])
        tokens.append(tok)
        if e["logprob"] is None:
            token_lps.append(None)
            tops.append(None)
            offsets.append(offset)
            offset += len(tok)
            continue
        token_lps.append(clean_logprob(e["logprob"]))
        top = {}
        for tid, lp in e["top"]:
            top.setdefault(token_text(tid), clean_logprob(lp))
        top.setdefault(tok, clean_logprob(e["logprob"]))
        tops.append(top)
        offsets.append(offset)
        offset += len(tok)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def joined(echo: dict, own: dict) -> dict:
    """The echoed prompt's logprobs followed by a choice's own (whose offsets count from the prompt's end)."""
    return {key: echo[key] + own[key] for key in echo}


def echo_end(logprobs: dict) -> int:
    """Where the text of some logprobs' tokens ends (an echoed prompt's: the offset a choice's own logprobs start
    at)."""
    return logprobs["text_offset"][-1] + len(logprobs["tokens"][-1]) if logprobs["tokens"] else 0


def chat_logprobs(entries: list[dict], token_text: TokenText) -> dict:
    """/v1/chat/completions' logprobs."""
    def item(tid: int, lp: float) -> dict:
        tok = token_text(tid)
        return {"token": tok, "logprob": clean_logprob(lp), "bytes": list(tok.encode("utf-8"))}

    return {"content": [{**item(e["token_id"], e["logprob"]),
                         "top_logprobs": [item(tid, lp) for tid, lp in e["top"]]} for e in entries]}


# ---- choices in responses and stream events ---------------------------------------------------------------
def completion_choice(c: Choice, prefix: str, logprobs: bool, token_text: TokenText,
                      scoring: PromptLogprobs | None = None, prompt_index: int = 0) -> dict:
    """A whole /v1/completions choice; ``prefix``: the echoed prompt, or ""; ``scoring``: what it carries of its
    prompt's logprobs (its tokens leading ``logprobs`` where echoed, vLLM's ``prompt_logprobs``)."""
    echo, field_ = scoring.rendered(prompt_index, c.prompt_logprobs) if scoring is not None else (None, None)
    lp = None
    if logprobs:
        lp = completion_logprobs(c.logprobs, echo_end(echo) if echo else 0, token_text)
        lp = joined(echo, lp) if echo else lp
    out = {"index": c.index, "text": prefix + "".join(c.text), "logprobs": lp, "finish_reason": c.finish_reason}
    if scoring is not None and scoring.field_top is not None:
        out["prompt_logprobs"] = field_
    return out


@dataclass(frozen=True)
class ToolParsing:
    """How a chat request's output is read for tool calls: its checked tools and its model's call style."""

    spec: ToolSpec
    style: str

    def finish_reason(self, calls: list[ToolCall], reason: str | None) -> str | None:
        """OpenAI's "tool_calls" for an output that ended normally in calls whose arguments are whole (a demanded
        call cut by max_tokens keeps "length")."""
        return "tool_calls" if calls and reason == "stop" and all(map(arguments_valid, calls)) else reason


@dataclass(frozen=True)
class ChatReading:
    """How a chat request's output is read: its thinking apart (None: the model writes none separately) and its
    tool calls (None: the request has no tools)."""

    tools: ToolParsing | None = None
    reasoning: ReasoningFormat | None = None


def chat_choice(c: Choice, logprobs: bool, token_text: TokenText, reading: ChatReading = ChatReading()) -> dict:
    """A whole /v1/chat/completions choice: thinking as ``message.reasoning_content``, calls in the rest of the text
    as ``message.tool_calls``."""
    thought, text = (None, "".join(c.text)) if reading.reasoning is None else reading.reasoning.split("".join(c.text))
    message: dict = {"role": "assistant", "content": text}
    finish_reason, tools = c.finish_reason, reading.tools
    if tools is not None:
        content, calls = parse_tool_calls(text, tools.spec, tools.style)
        if calls:
            message = {"role": "assistant", "content": content, "tool_calls": [call.to_openai() for call in calls]}
            finish_reason = tools.finish_reason(calls, finish_reason)
    if thought is not None:
        message["reasoning_content"] = thought
    return {"index": c.index, "message": message,
            "logprobs": chat_logprobs(c.logprobs, token_text) if logprobs else None,
            "finish_reason": finish_reason}


class CompletionChunkFields:
    """What a chunk becomes in a /v1/completions stream event: its text (the prompt before a choice's first
    text when echoing) and logprobs whose offsets count on from that choice's earlier events."""

    def __init__(self, echo: Callable[[int], str] | None, logprobs: bool, token_text: TokenText,
                 scoring: PromptLogprobs | None = None) -> None:
        """``scoring``: what a choice's first event carries of its prompt's logprobs (``completion_choice``)."""
        self._echo, self._logprobs, self._token_text, self._scoring = echo, logprobs, token_text, scoring
        self._offsets: dict[int, int] = {}  # per choice that started: where its next token's text starts

    def __call__(self, prompt_index: int, idx: int, chunk: StreamChunk) -> dict | None:
        first = idx not in self._offsets
        echo, field_ = (None, None)
        if first and self._scoring is not None:  # (a prompt's first sample's first chunk carries its entries)
            echo, field_ = self._scoring.rendered(prompt_index, chunk.prompt_logprobs)
        text = chunk.text
        if self._echo is not None and first:
            text = self._echo(prompt_index) + text
        # where this chunk's tokens start as the logprobs count offsets (by their tokens' texts, as the whole answer
        # counts them): after an echoed prompt's tokens, then after each earlier token
        offset = self._offsets.get(idx, echo_end(echo) if echo else 0)
        own = completion_logprobs(chunk.logprobs or [], offset, self._token_text) if self._logprobs else None
        lp = joined(echo, own) if echo and own is not None else own
        asks_field = first and self._scoring is not None and self._scoring.field_top is not None
        if not text and not chunk.finished and not (lp and lp["tokens"]) and not asks_field:
            return None
        self._offsets[idx] = echo_end(own) if own is not None and own["tokens"] else offset
        out = {"text": text, "logprobs": lp}
        if asks_field:
            out["prompt_logprobs"] = field_
        return out


def chat_opening(n: int) -> list[dict]:
    """The first event of each chat choice: the assistant's role, before any content."""
    return [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            for i in range(n)]


def chat_chunk_fields(logprobs: bool, token_text: TokenText, reading: ChatReading = ChatReading()) -> ChoiceFields:
    """What a chunk becomes in a /v1/chat/completions stream event: content and ``reasoning_content`` deltas and chat
    logprobs; with tools, a call's text becomes ``tool_calls`` deltas (``ToolCallStream``) and the finish reason
    "tool_calls"."""
    readers: dict[int, tuple[ReasoningReader | None, ToolCallStream | None]] = {}
    tools = reading.tools

    def fields(prompt_index: int, idx: int, chunk: StreamChunk) -> dict | None:
        lp = chat_logprobs(chunk.logprobs or [], token_text) if logprobs else None
        if idx not in readers:
            readers[idx] = (reading.reasoning.reader() if reading.reasoning is not None else None,
                            ToolCallStream(tools.spec, tools.style) if tools is not None else None)
        thinking, calls = readers[idx]
        pieces = [("content", chunk.text)] if thinking is None else \
            thinking.feed(chunk.text) + (thinking.finish() if chunk.finished else [])
        deltas = [{"reasoning_content": text} for kind, text in pieces if kind == "reasoning"]
        content = "".join(text for kind, text in pieces if kind == "content")
        extra = {}
        if calls is None:
            deltas += [{"content": content}] if content else []
        else:
            deltas += calls.feed(content) + (calls.finish() if chunk.finished else [])
            if chunk.finished:
                extra["finish_reason"] = tools.finish_reason(calls.calls, chunk.finish_reason)
        delta = _merged(deltas)
        if not delta and not chunk.finished and not (lp and lp["content"]):
            return None
        return {"delta": delta, "logprobs": lp, **extra}

    return fields


def _merged(deltas: list[dict]) -> dict:
    """One event's delta from several: reasoning and content joined, tool-call pieces in order."""
    out: dict = {}
    for d in deltas:
        if "reasoning_content" in d:
            out["reasoning_content"] = out.get("reasoning_content", "") + d["reasoning_content"]
        if "content" in d:
            out["content"] = out.get("content", "") + d["content"]
        if "tool_calls" in d:
            out.setdefault("tool_calls", []).extend(d["tool_calls"])
    return out
