"""Routes beside generation: ``/tokenize`` and ``/detokenize`` (as llama.cpp's server has them) and
``/v1/embeddings`` (OpenAI's shape; the model's pooled hidden states, see ``engine/embedding.py``)."""
from __future__ import annotations

import asyncio
import base64
import json
import reprlib
import time
from typing import Any

import torch
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from quickdraft.engine.embedding import EmbeddingOptions, batch_calls, check_inputs
from quickdraft.errors import InvalidParameterError, require_unicode
from quickdraft.kv.blocks import OutOfBlocks
from quickdraft.serving.errors import QueueFullError, RequestTimeoutError
from quickdraft.serving.jobs import ClientGone
from quickdraft.serving.openai_format import ERROR_RESPONSES
from quickdraft.serving.routes import ServerContext, context_of

MAX_DETOKENIZE = 1 << 20  # ids in one /detokenize
MAX_TOKENIZE = 1 << 20  # tokens one /tokenize answers with
MAX_EMBEDDING_INPUTS = 2048  # as OpenAI's embeddings endpoint
router = APIRouter()


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    content: StrictStr = Field(..., description="the text to tokenize")
    add_special: StrictBool | None = False  # the BOS (and EOS) the model's tokenizer adds to a prompt
    with_pieces: StrictBool | None = False  # each id with the text it writes


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    tokens: list[StrictInt] = Field(..., max_length=MAX_DETOKENIZE)


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    input: Any = Field(..., description="a string, a list of strings, a list of token ids, or a list of those")
    model: StrictStr | None = None
    encoding_format: StrictStr | None = "float"  # "float" or "base64" (little-endian float32)
    dimensions: StrictInt | None = None  # only the model's own hidden size
    user: StrictStr | None = None
    pooling: StrictStr | None = "last"  # extension: "last" or "mean"
    normalize: StrictBool | None = True  # extension: unit length (a dot product is the cosine)


def _piece(data: bytes | None, fallback: str) -> str | list[int]:
    """A token's text as llama.cpp's /tokenize gives it: a string, or its bytes when they are not whole UTF-8."""
    if data is None:
        return fallback
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return list(data)


@router.post("/tokenize", responses=ERROR_RESPONSES)
async def tokenize(body: TokenizeRequest, request: Request) -> Response:
    ctx = context_of(request)
    require_unicode("content", body.content)
    tokenizer = ctx.llm.tokenizer

    def answer() -> bytes:  # off the event loop: a long text is seconds of work, its JSON too
        ids = tokenizer.encode(body.content, bool(body.add_special))
        if len(ids) > MAX_TOKENIZE:
            raise InvalidParameterError(f"content has {len(ids):,} tokens; /tokenize answers at most "
                                        f"{MAX_TOKENIZE:,} at once")
        tokens: list = ids
        if body.with_pieces:
            spelled = tokenizer.token_bytes()
            tokens = [{"id": t, "piece": _piece(spelled[t] if t < len(spelled) else None, tokenizer.decode([t]))}
                      for t in ids]
        return json.dumps({"tokens": tokens, "count": len(ids), "max_model_len": ctx.llm.max_model_len},
                          ensure_ascii=False).encode()
    return Response(await asyncio.to_thread(answer), media_type="application/json")


@router.post("/detokenize", responses=ERROR_RESPONSES)
async def detokenize(body: DetokenizeRequest, request: Request) -> dict:
    tokenizer = context_of(request).llm.tokenizer
    bad = next((t for t in body.tokens if not 0 <= t < tokenizer.vocab_size), None)
    if bad is not None:
        raise InvalidParameterError(f"tokens holds the id {bad}, outside this model's vocabulary "
                                    f"0..{tokenizer.vocab_size - 1}")
    return {"content": await asyncio.to_thread(tokenizer.decode, body.tokens)}


async def _embedding_inputs(ctx: ServerContext, value: Any) -> list[list[int]]:
    """``input`` as token id lists (strings tokenized without special tokens, as a prompt's text would be)."""
    def is_ids(x: Any) -> bool:
        return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)

    if isinstance(value, str) or (is_ids(value) and value):
        value = [value]
    if not isinstance(value, list) or not 1 <= len(value) <= MAX_EMBEDDING_INPUTS or not all(
            isinstance(v, str) or is_ids(v) for v in value):
        raise InvalidParameterError(f"input must be a string, a list of token ids, or a list of 1 to "
                                    f"{MAX_EMBEDDING_INPUTS} of those, got {reprlib.repr(value)}")
    out = []
    for i, v in enumerate(value):
        if isinstance(v, str):
            require_unicode(f"input[{i}]", v)
            v = await asyncio.to_thread(ctx.llm.tokenizer.encode, v, False) if v else []
        out.append(list(v))
    return out


@router.post("/v1/embeddings", responses=ERROR_RESPONSES)
async def embeddings(body: EmbeddingRequest, request: Request) -> Response:
    ctx = context_of(request)
    ctx.check_model(body.model)
    if body.model in ctx.adapters:
        raise InvalidParameterError(f"model: embeddings are the base model's hidden states; {body.model!r} is a LoRA "
                                    f"adapter, pass {ctx.model_name!r}")
    if body.encoding_format not in ("float", "base64"):
        raise InvalidParameterError(f"encoding_format must be 'float' or 'base64', got {body.encoding_format!r}")
    hidden = ctx.llm.model.config.hidden_size
    if body.dimensions is not None and body.dimensions != hidden:
        raise InvalidParameterError(f"dimensions must be this model's hidden size {hidden} (embeddings are not "
                                    f"shortened), got {body.dimensions}")
    options = EmbeddingOptions(body.pooling, body.normalize is not False)
    token_lists = await _embedding_inputs(ctx, body.input)
    check_inputs(token_lists, ctx.llm.engine.vocab_size, ctx.llm.max_model_len)
    try:
        vectors = await _embed(ctx, request, token_lists, options)
    except ClientGone:
        return Response(status_code=499)
    data = [{"object": "embedding", "index": i, "embedding": _encoded(v, body.encoding_format)}
            for i, v in enumerate(vectors)]
    tokens = sum(map(len, token_lists))
    ctx.metrics.count_request("ok")
    return JSONResponse({"object": "list", "data": data, "model": ctx.model_name,
                         "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})


async def _embed(ctx: ServerContext, request: Request, token_lists: list[list[int]],
                 options: EmbeddingOptions) -> list[torch.Tensor]:
    """Each batch of the engine's token budget read between two engine steps, one embedding request at a time
    (``ServerContext.embedding_turn``): running streams wait for one batch at most, never for a whole request. A
    client that left, or a request past the server's timeout, stops at the next batch."""
    budget = ctx.llm.engine.config.scheduler.max_num_batched_tokens
    out: list[torch.Tensor] = [None] * len(token_lists)  # type: ignore[list-item]
    deadline = time.monotonic() + (ctx.limits.request_timeout_s or float("inf"))
    async with ctx.embedding_turn:
        for batch, read in batch_calls(ctx.llm.target, token_lists, options, budget):
            if await request.is_disconnected():
                raise ClientGone()
            if time.monotonic() > deadline:
                raise RequestTimeoutError(f"the embeddings took longer than this server's request timeout "
                                          f"({ctx.limits.request_timeout_s:g} s)")
            try:
                vectors = await ctx.engine.call_between_steps(read)
            except OutOfBlocks as exc:
                raise QueueFullError(f"the KV cache has no room for these inputs now ({exc}); retry later") from None
            for i, vector in zip(batch, vectors):
                out[i] = vector
            await asyncio.sleep(0)  # let the engine take its step before the next batch
    return out


def _encoded(vector: torch.Tensor, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(vector.to(torch.float32).numpy().astype("<f4").tobytes()).decode()
    return vector.tolist()
