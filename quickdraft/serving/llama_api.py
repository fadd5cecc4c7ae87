"""llama-server's own endpoints, its request and response shapes: ``/completion`` (what llama.cpp's scripts and
chat front ends such as SillyTavern send) and ``/infill`` (fill in the middle of code: what editor plugins such as
llama.vscode send).

Both take ``n_predict`` (-1: until the end; it wins over ``max_tokens``, as in llama-server), ``n_indent`` (stop at a
line indented less) and ``t_max_predict_ms`` (stop at a new line once this time has passed), ``return_tokens``,
``stream``, and the sampling fields by llama-server's names, with its defaults (temperature 0.8, top_k 40, top_p
0.95, min_p 0.05). ``/completion``'s ``prompt`` is a string (read with special tokens, BOS added where the model
asks) or token ids; ``/infill``'s are ``input_prefix`` and ``input_suffix`` (the text before and after the cursor),
``prompt`` (text typed after the prefix) and ``input_extra`` (other files, ``[{"filename", "text"}]``), built into
the prompt llama-server builds (``tokenizer/fim.py``). The response: ``content``, ``stop``, ``stop_type``,
``tokens_predicted``, ``tokens_evaluated``, ``truncated``, ``timings`` and the rest of llama-server's fields that the
engine knows; streamed, a ``data:`` event a chunk, the last with ``stop: true`` and no content.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any, ClassVar

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import StrictBool, StrictInt, StrictStr, field_validator

from quickdraft.engine.outputs import RequestMetrics, StreamChunk
from quickdraft.errors import require_unicode
from quickdraft.serving.errors import invalid_parameter
from quickdraft.serving.jobs import ClientGone, Job
from quickdraft.sampling.params import MAX_LOGPROBS
from quickdraft.serving.openai_format import ERROR_RESPONSES, Choice, clean_logprob
from quickdraft.serving.protocol import CompletionRequest
from quickdraft.sampling import StructuredOutputs
from quickdraft.serving.routes import context_of, dry_breakers, output_constraint, sampling_params
from quickdraft.serving.sse import error_event, event_stream, sse
from quickdraft.serving.streams import merge_streams
from quickdraft.tokenizer.fim import FimTokens, Infill, describe_missing, infill_ids

router = APIRouter()
MAX_EXTRA_FILES = 256
# llama-server's defaults: the temperature after the cuts as its default chain applies it, its penalties' window
LLAMA_DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "temperature_last": True,
                  "repeat_last_n": 64}


class LlamaRequest(CompletionRequest):
    """llama-server's native body; the completions fields (``max_tokens``, ``stop``, llama.cpp's samplers) too."""

    n_predict: StrictInt | None = None
    n_indent: StrictInt = 0
    t_max_predict_ms: StrictInt = 0
    repeat_penalty: Any = None
    return_tokens: StrictBool | None = False
    n_probs: StrictInt = 0  # each token's logprob and the top n at its position (the model's own, as llama-server's)
    post_sampling_probs: StrictBool | None = None
    max_completion_tokens: StrictInt | None = None
    json_schema: Any = None  # llama-server's constraints: a JSON schema, or a GBNF grammar
    grammar: Any = None

    # completions fields that have no meaning here: refused rather than ignored
    NOT_HERE: ClassVar[tuple[str, ...]] = ("suffix", "echo", "logprobs", "best_of", "prompt_logprobs")
    UNSET_SEEDS: ClassVar[tuple[int, ...]] = (-1, 0xFFFFFFFF)  # llama-server's "a random seed"
    ROUTE: ClassVar[str] = "/completion"

    def checked(self) -> "LlamaRequest":
        """The body with llama-server's names and defaults made ours, every field llama-server checks checked."""
        for name in self.NOT_HERE:
            if getattr(self, name) is not None and getattr(self, name) is not False:  # (0 is a value)
                raise invalid_parameter(f"{name} is not supported on {self.ROUTE}", name)
        if not 0 <= self.n_probs <= MAX_LOGPROBS:
            raise invalid_parameter(f"n_probs must be an int in [0, {MAX_LOGPROBS}] (0: none), got {self.n_probs}",
                                    "n_probs")
        if self.post_sampling_probs:
            raise invalid_parameter("post_sampling_probs is not supported: n_probs gives the model's own "
                                    "probabilities, before the samplers (llama-server's post_sampling_probs false)",
                                    "post_sampling_probs")
        if (self.n or 1) != 1:
            raise invalid_parameter(f"n must be 1 on {self.ROUTE}", "n")
        if self.n_predict is not None and self.n_predict == 0 or (self.n_predict or 0) < -1:
            raise invalid_parameter(f"n_predict must be -1 (until the end) or >= 1, got {self.n_predict}", "n_predict")
        for name in ("n_indent", "t_max_predict_ms"):
            if getattr(self, name) < 0:
                raise invalid_parameter(f"{name} must be >= 0 (0: off), got {getattr(self, name)}", name)
        update: dict[str, Any] = {k: v for k, v in LLAMA_DEFAULTS.items() if getattr(self, k) is None}
        if self.repeat_penalty is not None:
            update["repetition_penalty"] = self.repeat_penalty
        if self.seed in self.UNSET_SEEDS:
            update["seed"] = None
        most = next((v for v in (self.n_predict, self.max_completion_tokens) if v is not None), None)
        if most is not None:  # llama-server reads n_predict, then max_completion_tokens, then max_tokens
            update["max_tokens"] = None if most == -1 else most
        if isinstance(self.stop, list) or self.stop == "":  # (it drops empty stop strings)
            update["stop"] = [s for s in self.stop or [] if s != ""]
        update["logit_bias"] = self._bias_map()
        return self.model_copy(update=update)

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, value: Any) -> Any:
        return value  # an object or llama-server's list of pairs: read by _bias_map, checked by SamplingParams

    def _bias_map(self) -> Any:
        """llama-server's forms too: ``[[id, bias], ...]``, and ``false`` for a token never to be written (here the
        strongest bias allowed, -100). The values are checked by SamplingParams."""
        given = self.logit_bias
        if isinstance(given, list):
            if not all(isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], int) for pair in given):
                raise invalid_parameter("logit_bias must be an object {token id: bias} or a list of [token id, "
                                        "bias] pairs (token ids, not strings)", "logit_bias")
            given = {token: bias for token, bias in given}
        if isinstance(given, dict):
            return {k: -100.0 if v is False else v for k, v in given.items()}
        return given

    def constraints(self) -> tuple[tuple[str, StructuredOutputs | None], ...]:
        """llama-server's ``json_schema`` and ``grammar`` as output constraints."""
        return (("json_schema", StructuredOutputs.of(None if self.json_schema is None else {"json": self.json_schema},
                                                     "json_schema")),
                ("grammar", StructuredOutputs.of(None if self.grammar is None else {"grammar": self.grammar},
                                                 "grammar")))


class InfillRequest(LlamaRequest):
    """llama-server's /infill body."""

    prompt: Any = ""
    input_prefix: StrictStr = ""
    input_suffix: StrictStr = ""
    input_extra: Any = None

    ROUTE: ClassVar[str] = "/infill"

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
        """As llama-server checks them: a list of objects, each with a string ``text``, a ``filename`` optional."""
        given = [] if self.input_extra is None else self.input_extra
        if not isinstance(given, list) or len(given) > MAX_EXTRA_FILES:
            raise invalid_parameter(f'input_extra must be a list of at most {MAX_EXTRA_FILES} objects {{"filename": '
                                    f'string, "text": string}}', "input_extra")
        files = []
        for i, chunk in enumerate(given):
            if not isinstance(chunk, dict) or not isinstance(chunk.get("text"), str) \
                    or not isinstance(chunk.get("filename", "tmp"), str):
                raise invalid_parameter(f'input_extra[{i}] must be an object {{"filename": string (optional), '
                                        f'"text": string}}', "input_extra")
            files.append((chunk.get("filename", "tmp"), chunk["text"]))
            require_unicode(f"input_extra[{i}].filename", files[-1][0])
            require_unicode(f"input_extra[{i}].text", files[-1][1])
        return files


@router.post("/completion", responses=ERROR_RESPONSES)
async def completion(body: LlamaRequest, request: Request) -> Response:
    ctx = context_of(request)
    ctx.check_model(body.model)
    body = body.checked()
    prompt = body.prompt
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):  # one prompt, listed
        prompt = prompt[0]
    if isinstance(prompt, str):
        require_unicode("prompt", prompt)
        ids = await asyncio.to_thread(ctx.llm.tokenizer.encode, prompt)
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        ids = list(prompt)
    else:
        raise invalid_parameter("prompt must be a string or a list of token ids (one prompt on /completion)",
                                "prompt")
    if not ids:
        raise invalid_parameter("prompt must not be empty", "prompt")
    return await _answer(ctx, request, body, ids, "prompt")


@router.post("/infill", responses=ERROR_RESPONSES)
async def infill(body: InfillRequest, request: Request) -> Response:
    ctx = context_of(request)
    ctx.check_model(body.model)
    fim = FimTokens.of(ctx.llm.tokenizer)
    if fim is None:
        raise invalid_parameter(describe_missing(), "input_prefix")
    body = body.checked()
    ids, truncated = await asyncio.to_thread(infill_ids, ctx.llm.tokenizer, fim, body.infill(), ctx.llm.max_model_len,
                                             body.max_tokens)
    return await _answer(ctx, request, body, ids, "input_prefix", truncated, fim.ends)


async def _answer(ctx, request: Request, body: LlamaRequest, ids: list[int], prompt_param: str,
                  truncated: bool = False, ends: tuple[int, ...] = ()) -> Response:
    """Run ``ids`` with the body's sampling and answer in llama-server's shape; ``ends``: more ids that end it. An
    ``n_predict`` past the context stops where the context is full, as llama-server's does."""
    constraint = await output_constraint(ctx, body, *body.constraints())
    room = ctx.llm.max_model_len - len(ids)
    most = min(body.max_tokens, room) if body.max_tokens is not None and room > 0 else body.max_tokens
    params = sampling_params(ctx, body, len(ids), most, body.n_probs or None, prompt_param, constraint)
    params.stop_token_ids = sorted(set(params.stop_token_ids) | set(ends))
    await dry_breakers(ctx, params)
    job = Job.new("llama", [(ids, None)], [params])
    await job.start(ctx.engine)
    result = _Result(ctx.answering(body.model), len(ids), truncated, bool(body.return_tokens), body.n_indent,
                     body.t_max_predict_ms, _TokenProbabilities(
                         ctx.token_text, await asyncio.to_thread(ctx.llm.tokenizer.token_bytes),
                         lambda text: len(ctx.llm.tokenizer.encode_plain(text))) if body.n_probs else None)
    if body.stream:
        return event_stream(_events(job, result), job)
    try:
        await job.wait_or_abort(_collect(job, result), request)
    except ClientGone:
        return Response(status_code=499)
    return JSONResponse(result.final())


class _Result:
    """What llama-server's result says, as the chunks come; where its editor limits stop the fill early (a line
    indented less than ``n_indent``: cut where that line's indentation ends; ``t_max_predict_ms`` passed once the
    fill has a new line), ``add`` says so."""

    def __init__(self, model: str, prompt_n: int, truncated: bool, return_tokens: bool, n_indent: int,
                 t_max_ms: int, probabilities: _TokenProbabilities | None = None) -> None:
        self.model, self.prompt_n, self.truncated, self.return_tokens = model, prompt_n, truncated, return_tokens
        self.n_indent, self.t_max_ms, self.probabilities = n_indent, t_max_ms, probabilities
        self.token_probabilities: list[dict] = []  # with n_probs: each token's, as llama-server writes them
        self.choice = Choice(0)
        self.text, self.tokens = "", []
        self.metrics: RequestMetrics | None = None
        self.limited = False
        self._first_s: float | None = None
        self._line_at = 0  # where the next line to check for its indentation may start

    def add(self, chunk: StreamChunk) -> dict:
        """Note a chunk; returns its partial result (its content cut where a limit stopped the fill)."""
        before = len(self.text)
        self.text += chunk.text
        self.choice.count(chunk)
        self.tokens += chunk.token_ids
        self.metrics = chunk.metrics or self.metrics
        self._first_s = self._first_s if self._first_s is not None else time.perf_counter()
        cut = self._limit()
        kept = len(chunk.token_ids)
        if cut is not None:
            self.text, self.limited = self.text[:cut], True
            kept = _tokens_before(chunk, before, cut)
            del self.tokens[len(self.tokens) - len(chunk.token_ids) + kept:]
        event = {"index": 0, "content": self.text[before:], "tokens": chunk.token_ids[:kept] if self.return_tokens
                 else [], "stop": False, "tokens_predicted": len(self.tokens), "tokens_evaluated": self.prompt_n}
        if self.probabilities is not None and chunk.logprobs:
            event["completion_probabilities"] = [self.probabilities.entry(e) for e in chunk.logprobs[:kept]]
            self.token_probabilities += event["completion_probabilities"]
        return event

    def _limit(self) -> int | None:
        """Where llama-server's n_indent or t_max_predict_ms would end the text (None: not yet)."""
        while self.n_indent > 0:
            newline = self.text.find("\n", self._line_at)
            if newline < 0:
                break
            start = end = newline + 1
            while end < len(self.text) and self.text[end] in " \t":
                end += 1
            if end == len(self.text):  # the line's indentation may go on
                break
            if end - start < self.n_indent:
                return end
            self._line_at = start
        elapsed_ms = 1e3 * (time.perf_counter() - self._first_s)
        if self.t_max_ms > 0 and "\n" in self.text and elapsed_ms > self.t_max_ms:
            return self.text.rindex("\n") + 1  # the fill ends at a line break
        return None

    def final(self, streamed: bool = False) -> dict:
        c, m = self.choice, self.metrics or RequestMetrics()
        stop_type = "limit" if self.limited else {"stop": "word" if c.stop_string else "eos",
                                                  "length": "limit"}.get(c.finish_reason or "", "none")
        ttft = m.ttft_s or 0.0
        return {"index": 0, "content": "" if streamed else self.text,
                "tokens": self.tokens if self.return_tokens and not streamed else [], "stop": True,
                "model": self.model, "tokens_predicted": len(self.tokens), "tokens_evaluated": self.prompt_n,
                "tokens_cached": c.cached_tokens, "truncated": self.truncated, "has_new_line": "\n" in self.text,
                "stop_type": stop_type, "stopping_word": c.stop_string or "",
                "timings": {"prompt_n": self.prompt_n - c.cached_tokens, "prompt_ms": 1e3 * ttft,
                            "predicted_n": len(self.tokens), "predicted_ms": 1e3 * max(0.0, m.total_s - ttft),
                            "predicted_per_second": m.tokens_per_s},
                "speculative": c.spec.usage(),
                **({"completion_probabilities": self.probabilities.without_stop_word(self.token_probabilities,
                                                                                      c.stop_string)}
                   if self.probabilities is not None and not streamed else {})}


def _tokens_before(chunk: StreamChunk, start: int, cut: int) -> int:
    """How many of ``chunk``'s tokens (its text starting at ``start``) begin before ``cut``: the fill's, up to the
    token that crossed an editor limit, where llama-server stops."""
    kept, at = 0, start
    for chars, _ in chunk.spans[:len(chunk.token_ids)]:
        if at >= cut and kept:
            break
        kept, at = kept + 1, at + chars
    return kept


def _valid_utf8_prefix(raw: bytes) -> str:
    """A token's text as llama-server writes it: its bytes up to the last whole UTF-8 character (a token that ends
    inside a character gives the characters before it)."""
    for end in range(len(raw), max(-1, len(raw) - 4), -1):
        try:
            return raw[:end].decode("utf-8")
        except UnicodeDecodeError:
            continue
    return raw.decode("utf-8", "replace")


class _TokenProbabilities:
    """llama-server's ``completion_probabilities`` entries (its ``post_sampling_probs`` false): a token's id, text,
    bytes and logprob, and the top ones at its position in the same form."""

    def __init__(self, token_text, token_bytes: list[bytes | None], count_tokens) -> None:
        self._text, self._bytes, self._count_tokens = token_text, token_bytes, count_tokens

    def _token(self, token_id: int, logprob: float) -> dict:
        raw = self._bytes[token_id] if token_id < len(self._bytes) else None
        if raw is None:
            raw = self._text(token_id).encode()
        return {"id": token_id, "token": _valid_utf8_prefix(raw), "bytes": list(raw), "logprob": clean_logprob(logprob)}

    def without_stop_word(self, entries: list[dict], stop_word: str | None) -> list[dict]:
        """A whole answer's entries as llama-server gives them: those of a stop word's tokens left out."""
        return entries[:len(entries) - min(len(entries), self._count_tokens(stop_word))] if stop_word else entries

    def entry(self, e: dict) -> dict:
        return {**self._token(e["token_id"], e["logprob"]),
                "top_logprobs": [self._token(tid, lp) for tid, lp in e["top"]]}


async def _collect(job: Job, result: _Result) -> None:
    async for _, chunk in merge_streams(job.streams):
        result.add(chunk)
        if result.limited:
            job.close()  # the rest is not wanted: its KV blocks go back now
            return


async def _events(job: Job, result: _Result) -> AsyncIterator[str]:
    """A partial result a chunk with text, then the final one (its content streamed already, as llama-server)."""
    try:
        async for _, chunk in merge_streams(job.streams):
            event = result.add(chunk)
            if event["content"] or chunk.token_ids:
                yield sse(event)
            if chunk.finished or result.limited:
                yield sse(result.final(streamed=True))
                return
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001 - reported in the stream
        yield error_event(exc)
