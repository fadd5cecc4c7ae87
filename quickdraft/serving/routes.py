"""The HTTP routes: each checks its request, turns it into engine requests (a :class:`Job`) and answers with
one JSON body or a stream of events. A bad request is rejected here, before it reaches the engine."""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import jinja2
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from quickdraft.errors import require_unicode
from quickdraft.sampling import SamplingParams, StructuredOutputs, sequence_breakers
from quickdraft.sampling.grammar import compiler_for
from quickdraft.sampling.params import MAX_LOGPROBS
from quickdraft.serving.async_engine import AsyncEngine
from quickdraft.serving.errors import invalid_parameter
from quickdraft.serving.guard import ServerLimits
from quickdraft.serving.jobs import ClientGone, Job
from quickdraft.serving.metrics import CONTENT_TYPE, ServerMetrics
from quickdraft.serving.openai_format import (ERROR_RESPONSES, ChatReading, Choice, CompletionChunkFields,
                                              TokenTexts, ToolParsing, chat_choice, chat_chunk_fields, chat_opening, completion_choice,
                                              error_response, response_head, usage)
from quickdraft.serving.prompt_logprobs import PromptLogprobs, check_size, vllm_prompt_logprobs
from quickdraft.serving.response_store import ResponseStore
from quickdraft.serving.reasoning import MESSAGE, markers_are_special, reasoning_format
from quickdraft.serving.protocol import (ChatCompletionRequest, CompletionRequest, LlamaSamplerFields,
                                         ModelNotFoundError, in_call_order, _SamplingFields, request_scales,
                                         response_format_constraint)
from quickdraft.serving.sse import stream_response
from quickdraft.serving.tool_prompts import prepare_messages
from quickdraft.serving.tools import ToolSpec, parse_tools, tool_call_style
from quickdraft.tokenizer.fim import FimTokens, Infill, describe_missing, infill_ids

if TYPE_CHECKING:
    from quickdraft.llm import LLM


@dataclass
class ServerContext:
    """What the routes and error handlers need of the server (``app.state.context``)."""

    engine: AsyncEngine
    llm: LLM
    model_name: str
    limits: ServerLimits
    token_text: TokenTexts
    created: int = field(default_factory=lambda: int(time.time()))
    responses: ResponseStore = field(default_factory=ResponseStore)  # what /v1/responses can continue
    # one /v1/embeddings request runs at a time, so the engine steps between its batches (extra_routes._embed)
    embedding_turn: asyncio.Lock = field(default_factory=asyncio.Lock)
    # llama-server's --lora: the adapters a request runs unless it says otherwise, by name, and their scales (changed by
    # POST /lora-adapters); an adapter of vLLM's --lora-modules runs where a request's model names it
    lora_scales: dict[str, float] = field(default_factory=dict)

    @property
    def metrics(self) -> ServerMetrics:
        return self.engine.metrics

    @staticmethod
    def check_adapters(llm: LLM, model_name: str, lora_scales: dict[str, float]) -> None:
        """Before a server starts: the default scales name adapters the model serves, and no adapter takes the
        served model's name (a request naming the base would run it)."""
        adapters = llm.model.lora.names if llm.model.lora is not None else []
        unknown = sorted(set(lora_scales) - set(adapters))
        if unknown:
            raise ValueError(f"lora_scales names {unknown[0]!r}, which is not one of the model's LoRA adapters")
        if model_name in adapters:
            raise ValueError(f"a LoRA adapter is named {model_name!r}, the served model's name")

    @property
    def adapters(self) -> list[str]:
        """The LoRA adapters' names, their ids' order (GET /lora-adapters)."""
        lora = self.llm.model.lora
        return lora.names if lora is not None else []

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name and name not in self.adapters:
            served = ", ".join(f"`{n}`" for n in [self.model_name, *self.adapters])
            raise ModelNotFoundError(f"The model `{name}` does not exist. This server serves {served}.")

    def lora_choice(self, req: LlamaSamplerFields) -> str | dict[str, float] | None:
        """The adapters a request runs (``SamplingParams.lora``): those its ``lora`` field lists (llama-server's), else
        the adapter its ``model`` names (vLLM's), else the server's defaults (llama-server's ``--lora``)."""
        model = getattr(req, "model", None)
        if req.lora is not None:
            if model in self.adapters:
                raise invalid_parameter(f"lora: the model {model!r} is a LoRA adapter already; give either an "
                                        f"adapter's name as model or the adapters as lora", "lora")
            return request_scales(req.lora, self.adapters)
        if model is not None and model in self.adapters:
            return model
        return {name: scale for name, scale in self.lora_scales.items() if scale} or None

    def answering(self, model: str | None) -> str:
        """The model a response names: the adapter a request named (as vLLM answers), else the served model."""
        return model if model is not None and model in self.adapters else self.model_name

    def model_cards(self) -> list[dict]:
        """The base model's card and each adapter's (vLLM's shape: ``parent`` the base, ``root`` the adapter's
        path)."""
        base = {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "quickdraft",
                "max_model_len": self.llm.max_model_len}
        lora = self.llm.model.lora
        return [base] + [{**base, "id": name, "root": source, "parent": self.model_name}
                         for name, source in zip(self.adapters, lora.sources if lora is not None else [])]


def context_of(request: Request) -> ServerContext:
    return request.app.state.context


router = APIRouter()


@router.get("/health")
async def health(request: Request) -> Response:
    engine = context_of(request).engine
    if not engine.alive:
        return error_response(503, engine.failure or "the server is shutting down", type_="service_unavailable_error")
    return JSONResponse({"status": "ok"})


@router.get("/metrics")
async def prometheus(request: Request) -> Response:
    ctx = context_of(request)
    stats = await ctx.engine.stats_async() if ctx.engine.alive else ctx.engine.stats()
    return PlainTextResponse(ctx.metrics.render(stats), media_type=CONTENT_TYPE)


@router.post("/reset_prefix_cache")
async def reset_prefix_cache(request: Request) -> Response:
    """Forget cached prompt prefixes (vLLM's endpoint of the same name): benchmarks call it so that a prompt sent
    again is computed again."""
    await context_of(request).engine.reset_prefix_cache()
    return JSONResponse({"status": "ok"})


@router.get("/v1/models")
async def models(request: Request) -> dict:
    return {"object": "list", "data": context_of(request).model_cards()}


@router.get("/v1/models/{name:path}")
async def model(name: str, request: Request) -> dict:
    ctx = context_of(request)
    ctx.check_model(name)
    return next(card for card in ctx.model_cards() if card["id"] == name)


@router.post("/v1/completions", responses=ERROR_RESPONSES)
async def completions(body: CompletionRequest, request: Request) -> Response:
    ctx = context_of(request)
    ctx.check_model(body.model)
    prompts = await _completion_prompts(ctx, body)
    constraint = await output_constraint(ctx, body)
    scoring = PromptLogprobs(lambda p: prompts[p][0], ctx.token_text,
                             echo_top=body.logprobs if body.echo else None, field_top=body.prompt_logprobs)
    # OpenAI's echo with max_tokens 0: the prompt back (scored, with logprobs), nothing generated; the engine
    # computes one token past it, which is not shown
    echo_only = body.max_tokens == 0 and body.echo
    max_tokens = 1 if echo_only else body.max_tokens
    params = [sampling_params(ctx, body, len(ids), max_tokens, body.logprobs, "prompt", constraint, scoring.top)
              for ids, _ in prompts]
    if scoring.top is not None:
        scoring.check_size(sum(len(ids) for ids, _ in prompts), params[0].n, ctx.limits.max_prompt_logprobs)
    if body.suffix:  # a fill ends at the end of the sequence or at its marks that close a file
        for p in params:
            p.stop_token_ids = sorted(set(p.stop_token_ids) | set(FimTokens.of(ctx.llm.tokenizer).ends))
    await dry_breakers(ctx, params[0])
    job = Job.new("cmpl", prompts, params, shows_output=not echo_only)
    await job.start(ctx.engine)
    echo = (lambda p: job.prompt_text(p, ctx.llm.tokenizer)) if body.echo else None
    logprobs = body.logprobs is not None
    scored = scoring if scoring.top is not None else None
    head = response_head(job.id, "text_completion", job.created, ctx.answering(body.model))
    if body.stream:
        return stream_response(job, head, body.include_usage,
                               CompletionChunkFields(echo, logprobs, ctx.token_text, scored),
                               draft_info=body.include_draft_info)

    def whole_choice(c: Choice) -> dict:
        prefix = echo(c.index // job.n) if echo else ""
        return completion_choice(c, prefix, logprobs, ctx.token_text, scored, c.index // job.n)

    return await _whole_response(request, job, head, whole_choice)


@dataclass
class ChatRun:
    """A chat request queued in the engine: its job and how its output is read (thinking, tool calls)."""

    job: Job
    reading: ChatReading


async def start_chat(ctx: ServerContext, body: ChatCompletionRequest, top_logprobs: int | None = None) -> ChatRun:
    """Check a chat request, render its prompt and queue it: the one way into the engine for every chat-shaped API
    (chat completions, Responses, Anthropic Messages each translate their body into a ``ChatCompletionRequest``)."""
    ctx.check_model(body.model)
    tool_spec = parse_tools(body.tools, body.tool_choice)
    forced_call = tool_spec.constraint(body.parallel_tool_calls is not False) if tool_spec is not None else None
    constraint = await output_constraint(ctx, body,
                                         ("response_format", response_format_constraint(body.response_format)),
                                         ("tool_choice", StructuredOutputs.of(forced_call, "tool_choice")))
    ids = await chat_prompt_ids(ctx, body, tool_spec)
    tokenizer = ctx.llm.tokenizer
    tools = None if tool_spec is None or tool_spec.choice == "none" else \
        ToolParsing(tool_spec, tool_call_style(tokenizer.chat_template))
    reasoning = reasoning_format(tokenizer.chat_template, tokenizer.decode(ids[-16:]), constraint is not None,
                                 tools is not None)
    params = sampling_params(ctx, body, len(ids), body.requested_max_tokens, top_logprobs, "messages", constraint,
                             body.prompt_logprobs)
    if body.prompt_logprobs is not None:  # (one list beside the choices)
        check_size(len(ids), [body.prompt_logprobs], 1, ctx.limits.max_prompt_logprobs)
    await dry_breakers(ctx, params)
    if reasoning is not None and body.skip_special_tokens is None and markers_are_special(
            reasoning.style, lambda text: tokenizer.token_to_id(text) in tokenizer.special_token_ids):
        params.skip_special_tokens = False  # (harmony's always are)
        if reasoning.style == "harmony":  # a stop string ends what a message says, never matches its markup
            params.stop_strings_after_token = tokenizer.token_to_id(MESSAGE)
    job = Job.new("chatcmpl", [(ids, None)], [params])
    await job.start(ctx.engine)
    return ChatRun(job, ChatReading(tools, reasoning))


async def chat_prompt_ids(ctx: ServerContext, body: ChatCompletionRequest, tool_spec: ToolSpec | None) -> list[int]:
    """The conversation rendered with the model's chat template (tools fitted to it), as token ids."""
    variables = body.template_variables()
    messages = in_call_order([m.for_template() for m in body.messages])
    messages, template_tools = await asyncio.to_thread(prepare_messages, messages, tool_spec,
                                                      ctx.llm.tokenizer.chat_template)
    try:
        return await asyncio.to_thread(ctx.llm.chat_prompt, messages, template_tools, **variables)
    except (ValueError, TypeError, KeyError, RecursionError, jinja2.TemplateError) as exc:
        raise invalid_parameter(f"messages could not be rendered with the model's chat template: {exc}",
                                "messages") from exc


@router.post("/v1/chat/completions", responses=ERROR_RESPONSES)
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    ctx = context_of(request)
    if body.stream and body.prompt_logprobs is not None:
        raise invalid_parameter("prompt_logprobs is not available with stream on /v1/chat/completions (send the "
                                "request without stream, or use /v1/completions, which streams them)", "prompt_logprobs")
    run = await start_chat(ctx, body, _chat_top_logprobs(body))
    job, logprobs = run.job, bool(body.logprobs)
    if body.stream:
        head = response_head(job.id, "chat.completion.chunk", job.created, ctx.answering(body.model))
        return stream_response(job, head, body.include_usage, chat_chunk_fields(logprobs, ctx.token_text, run.reading),
                               chat_opening(job.n), body.include_draft_info)
    head = response_head(job.id, "chat.completion", job.created, ctx.answering(body.model))
    return await _whole_response(request, job, head, lambda c: chat_choice(c, logprobs, ctx.token_text, run.reading),
                                 body.prompt_logprobs)


async def _whole_response(request: Request, job: Job, head: dict, choice_json: Callable[[Choice], dict],
                          prompt_logprobs: int | None = None) -> Response:
    """The response of a request that did not ask to stream; 499 (nobody reads it) when the client left.
    ``prompt_logprobs``: the prompt's, vLLM's field beside the choices (a chat request's one prompt)."""
    try:
        choices = await job.gather_or_abort(request)
    except ClientGone:
        return Response(status_code=499)
    extra = {"prompt_logprobs": vllm_prompt_logprobs(choices[0].prompt_logprobs, context_of(request).token_text,
                                                     prompt_logprobs)} if prompt_logprobs is not None and choices else {}
    return JSONResponse({**head, "choices": [choice_json(c) for c in choices], **extra,
                         "usage": usage(job.prompt_tokens, choices, job.n)})


async def _completion_prompts(ctx: ServerContext, body: CompletionRequest) -> list[tuple[list[int], str | None]]:
    """The request's prompts as token ids (with their text when sent as text), once its options are checked; with a
    ``suffix``, each prompt is the text before the cursor of a fill-in-the-middle prompt (``tokenizer/fim.py``)."""
    fim = None
    if body.suffix:  # (an empty one is no suffix, as before the field was read)
        require_unicode("suffix", body.suffix)
        fim = FimTokens.of(ctx.llm.tokenizer)
        if fim is None:
            raise invalid_parameter(f"suffix: {describe_missing()}", "suffix")
        if len(body.prompts()) != 1 or not isinstance(body.prompts()[0], str):
            raise invalid_parameter("suffix needs one prompt, as text (the code before the cursor)", "suffix")
    if body.echo and body.suffix:
        raise invalid_parameter("echo together with suffix is not supported (the prompt is the text around the "
                                "cursor, not one text to echo)", "echo")
    if body.max_tokens == 0 and not body.echo:
        raise invalid_parameter("max_tokens must be at least 1, or 0 with echo (the prompt back, with its logprobs "
                                "where logprobs is set, nothing generated)", "max_tokens")
    if body.max_tokens == 0 and body.min_tokens:
        raise invalid_parameter(f"min_tokens must be 0 when max_tokens is 0, got {body.min_tokens}", "min_tokens")
    if body.best_of is not None and body.best_of != (body.n or 1):
        raise invalid_parameter(f"best_of is not supported (it must equal n), got {body.best_of}", "best_of")
    limit = ctx.limits.max_prompts_per_request
    if len(body.prompts()) > limit:
        raise invalid_parameter(f"prompt must be a list of at most {limit} prompts per request, got "
                                f"{len(body.prompts())}", "prompt")
    prompts = []
    for p in body.prompts():
        if isinstance(p, str):
            require_unicode("prompt", p)
            if fim is not None:
                ids, _ = await asyncio.to_thread(infill_ids, ctx.llm.tokenizer, fim, Infill(p, body.suffix),
                                                 ctx.llm.max_model_len, body.max_tokens)
            else:  # (off the event loop: a long prompt must not stall other streams)
                ids = await asyncio.to_thread(ctx.llm.tokenizer.encode, p)
            if not ids:
                raise invalid_parameter("prompt must not be empty", "prompt")
            prompts.append((ids, p))
        else:
            prompts.append((list(p), None))
    return prompts


def _chat_top_logprobs(body: ChatCompletionRequest) -> int | None:
    """How many top logprobs each token gets (None: no logprobs), once the two fields are checked together."""
    if body.top_logprobs is not None:
        if not body.logprobs:
            raise invalid_parameter("top_logprobs requires logprobs to be true", "top_logprobs")
        if not 0 <= body.top_logprobs <= MAX_LOGPROBS:
            raise invalid_parameter(f"top_logprobs must be an int in [0, {MAX_LOGPROBS}], got {body.top_logprobs}",
                                    "top_logprobs")
    return (body.top_logprobs or 0) if body.logprobs else None


async def output_constraint(ctx: ServerContext, body: _SamplingFields,
                      *others: tuple[str, StructuredOutputs | None]) -> StructuredOutputs | None:
    """The request's one output constraint (``structured_outputs``, or ``response_format`` / a forced tool call on
    chat), compiled here off the event loop: a bad one is a 400 before anything is queued, and the engine then finds
    it compiled."""
    given = [(name, spec) for name, spec in (("structured_outputs", StructuredOutputs.of(body.structured_outputs)),
                                             *others) if spec is not None]
    if len(given) > 1:
        raise invalid_parameter(f"{given[0][0]} and {given[1][0]} both constrain the output: set only one",
                                given[1][0])
    if not given:
        return None
    await asyncio.to_thread(compiler_for(ctx.llm.tokenizer).compile, given[0][1])
    return given[0][1]


async def dry_breakers(ctx: ServerContext, params: SamplingParams) -> None:
    """DRY's sequence breakers found in the vocabulary off the event loop, as a constraint is compiled: the engine
    then finds them cached."""
    if params.uses_dry:
        await asyncio.to_thread(sequence_breakers, ctx.llm.tokenizer, params.dry_sequence_breakers)


def sampling_params(ctx: ServerContext, req: _SamplingFields, prompt_len: int, max_tokens: int | None,
                    logprobs: int | None, prompt_param: str, constraint: StructuredOutputs | None = None,
                    prompt_logprobs: int | None = None) -> SamplingParams:
    """The engine's parameters for one prompt; the prompt and the completion must fit the context together."""
    limit = ctx.llm.max_model_len
    if prompt_len >= limit:
        raise invalid_parameter(
            f"the prompt has {prompt_len} tokens but this model's maximum context length is {limit} tokens, and at "
            f"least one token must be left for the completion; shorten the {prompt_param}", prompt_param,
            "context_length_exceeded")
    fields = dict(
        n=req.n, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p,
        min_tokens=req.min_tokens, repetition_penalty=req.repetition_penalty, presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty, logit_bias=req.logit_bias, seed=req.seed, stop=req.stop,
        stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos, priority=req.priority,
        deadline_s=req.deadline_s, include_stop_str_in_output=req.include_stop_str_in_output,
        skip_special_tokens=req.skip_special_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
        speculative=req.speculative,
        structured_outputs=constraint, **{name: getattr(req, name) for name in req.LLAMA_SAMPLERS},
        lora=ctx.lora_choice(req),
        max_tokens=limit - prompt_len if max_tokens is None else max_tokens)
    params = SamplingParams(**{k: v for k, v in fields.items() if v is not None})
    if prompt_len + params.max_tokens > limit:
        raise invalid_parameter(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{prompt_len + params.max_tokens} tokens ({prompt_len} in the {prompt_param}, {params.max_tokens} in "
            f"the completion). Please reduce the length of the {prompt_param} or completion.", "max_tokens",
            "context_length_exceeded")
    return params  # token ids (logit bias, stop ids) are checked by LLMEngine.add_request, before any model work
