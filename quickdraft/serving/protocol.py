"""Request and error bodies of the OpenAI-compatible API (pydantic).

Integer and boolean fields are strict (``"5"``, ``5.0`` and ``true`` are not accepted as ints), so a
wrongly typed field is reported as such instead of being coerced. Fields whose shape is a union
(``prompt``, ``messages``, ``stop``, ``logit_bias``) are checked by hand so the error names the field in
plain words. Unknown fields are ignored, as vLLM does. Ranges are checked by
:class:`quickdraft.sampling.SamplingParams`, whose messages name the parameter and the allowed range.
"""
from __future__ import annotations

import re
import reprlib
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, field_validator

from quickdraft.sampling.params import MAX_LOGPROBS
from quickdraft.sampling.structured import StructuredOutputs

from quickdraft.errors import InvalidParameterError


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: StrictBool | None = False
    # quickdraft's: each streamed choice also says which of its text came from accepted draft tokens ("draft_info")
    include_draft_info: StrictBool | None = False


class LlamaSamplerFields(BaseModel):
    """vLLM's allowed_token_ids and bad_words and llama.cpp's samplers, by their names, on every route that samples
    (each checked by SamplingParams)."""

    model_config = ConfigDict(extra="ignore")

    allowed_token_ids: Any = None
    bad_words: Any = None
    typical_p: Any = None
    top_n_sigma: Any = None
    xtc_probability: Any = None
    xtc_threshold: Any = None
    dry_multiplier: Any = None
    dry_base: Any = None
    dry_allowed_length: Any = None
    dry_penalty_last_n: Any = None
    dry_sequence_breakers: Any = None
    mirostat: Any = None
    mirostat_tau: Any = None
    mirostat_eta: Any = None
    temperature_last: Any = None
    repeat_last_n: Any = None
    lora: Any = None  # llama-server's LoRA adapters for this request: [{"id": 0, "scale": 0.5}] (see request_scales)

    LLAMA_SAMPLERS: ClassVar[tuple[str, ...]] = (
        "allowed_token_ids", "bad_words", "typical_p", "top_n_sigma", "xtc_probability", "xtc_threshold",
        "dry_multiplier", "dry_base", "dry_allowed_length", "dry_penalty_last_n", "dry_sequence_breakers",
        "mirostat", "mirostat_tau", "mirostat_eta", "temperature_last", "repeat_last_n")
    LLAMA_FIELDS: ClassVar[tuple[str, ...]] = (*LLAMA_SAMPLERS, "lora")  # what a translated request carries over


def request_scales(value: Any, adapters: list[str]) -> dict[str, float]:
    """llama-server's per-request ``lora``, ``[{"id": i, "scale": s}]`` (ids as GET /lora-adapters lists them), as
    ``SamplingParams.lora``'s ``{name: scale}``: the adapters listed, at their scales (the scales checked there)."""
    allowed = (f'a list of {{"id": an adapter\'s id (0 to {len(adapters) - 1}), "scale": a number}} objects, each id '
               f"once" if adapters else "absent: this server has no LoRA adapter")
    if not isinstance(value, list) or len(value) > len(adapters):
        raise InvalidParameterError(f"lora must be {allowed}, got {reprlib.repr(value)}")
    scales: dict[str, float] = {}
    for item in value:
        if not (isinstance(item, dict) and set(item) == {"id", "scale"} and isinstance(item["id"], int)
                and not isinstance(item["id"], bool) and 0 <= item["id"] < len(adapters)
                and adapters[item["id"]] not in scales):
            raise InvalidParameterError(f"lora must be {allowed}, got {reprlib.repr(item)}")
        scales[adapters[item["id"]]] = item["scale"]
    return scales


class _SamplingFields(LlamaSamplerFields):
    """Fields shared by /v1/completions and /v1/chat/completions (OpenAI's plus vLLM-style extensions)."""

    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = None
    n: StrictInt | None = 1
    max_tokens: StrictInt | None = None  # None: until the context window is full
    temperature: StrictFloat | None = None  # None: 1.0
    top_p: StrictFloat | None = None
    stop: Any = None  # str | list[str]
    seed: StrictInt | None = None
    presence_penalty: StrictFloat | None = None
    frequency_penalty: StrictFloat | None = None
    logit_bias: Any = None  # {"token id": bias}
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    user: StrictStr | None = None  # accepted and ignored
    # extensions (vLLM names)
    top_k: StrictInt | None = None
    min_p: StrictFloat | None = None
    min_tokens: StrictInt | None = None
    repetition_penalty: StrictFloat | None = None
    priority: StrictInt | None = None
    deadline_s: StrictFloat | None = None
    ignore_eos: StrictBool | None = None
    stop_token_ids: list[StrictInt] | None = None
    include_stop_str_in_output: StrictBool | None = None
    skip_special_tokens: StrictBool | None = None
    prompt_logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    speculative: Any = None  # false, true or {"max_draft_tokens": n}: checked (and shown bounded) by SamplingParams
    structured_outputs: Any = None  # {"json" | "regex" | "choice" | "grammar" | "json_object": ...}: StructuredOutputs

    @field_validator("stop")
    @classmethod
    def _stop(cls, value: Any) -> Any:
        if value is None or isinstance(value, str):
            return value
        if isinstance(value, list) and all(isinstance(s, str) for s in value):
            return value
        raise ValueError("stop must be a string or a list of strings")

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, value: Any) -> Any:
        if value is None or isinstance(value, dict):
            return value  # keys and values are range-checked by SamplingParams
        raise ValueError("logit_bias must be an object mapping token ids to biases in [-100, 100]")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def include_draft_info(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_draft_info)


TokenIds = list[int]


class CompletionRequest(_SamplingFields):
    prompt: Any = Field(..., description="a string, a list of strings, a list of token ids, or a list of those")
    logprobs: StrictInt | None = None
    echo: StrictBool | None = False
    best_of: StrictInt | None = None
    suffix: StrictStr | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, value: Any) -> Any:
        def token_list(x: Any) -> bool:
            return isinstance(x, list) and bool(x) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)

        if isinstance(value, str):
            return value
        if isinstance(value, list) and value:
            if token_list(value) or all(isinstance(p, str) for p in value) or all(token_list(p) for p in value):
                return value
        raise ValueError("prompt must be a string, a non-empty list of strings, a non-empty list of token ids, "
                         "or a non-empty list of non-empty token id lists")

    def prompts(self) -> list[str | TokenIds]:
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Any = None  # str | [{"type": "text", "text": ...}] | None
    name: StrictStr | None = None

    @field_validator("content")
    @classmethod
    def _content(cls, value: Any) -> Any:
        if value is None or isinstance(value, str):
            return value
        if isinstance(value, list):
            for part in value:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ValueError("content parts must be {'type': 'text', 'text': '...'} (only text is supported)")
            return value
        raise ValueError("content must be a string or a list of text parts")

    def for_template(self) -> dict:
        content = self.content
        if isinstance(content, list):
            content = "".join(part["text"] for part in content)
        out = {k: v for k, v in (self.model_extra or {}).items()}
        out.update(role=self.role, content=content if content is not None else "")
        if self.name is not None:
            out["name"] = self.name
        # an earlier turn's thinking, under the names templates read it by (Qwen3's, gpt-oss's)
        thought = next((out[k] for k in ("reasoning_content", "reasoning", "thinking") if isinstance(out.get(k), str)),
                       None)
        if thought is not None:
            out.setdefault("reasoning_content", thought)
            out.setdefault("thinking", thought)
        return out


def in_call_order(messages: list[dict]) -> list[dict]:
    """Each run of tool results in the order of the calls of the assistant message before it: a template that
    renders results without their ids (Qwen's) pairs them with calls by position."""
    out, order = list(messages), {}
    i = 0
    while i < len(out):
        m = out[i]
        if m.get("role") == "assistant":
            calls = m.get("tool_calls") if isinstance(m.get("tool_calls"), list) else []
            order = {c.get("id"): k for k, c in enumerate(calls) if isinstance(c, dict) and isinstance(c.get("id"), str)}
        elif m.get("role") == "tool" and order:
            end = i
            while end < len(out) and out[end].get("role") == "tool":
                end += 1
            out[i:end] = sorted(out[i:end], key=lambda r: order.get(r.get("tool_call_id"), len(order)))
            i = end
            continue
        i += 1
    return out


_TEMPLATE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
RESERVED_TEMPLATE_NAMES = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token",
                                     "unk_token", "pad_token", "raise_exception", "strftime_now", "namespace"})


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool | None = False
    top_logprobs: StrictInt | None = None
    response_format: Any = None  # {"type": "text" | "json_object" | "json_schema", "json_schema": {...}}
    tools: Any = None  # checked by serving/tools.py
    tool_choice: Any = None
    parallel_tool_calls: StrictBool | None = None  # accepted; the model decides how many calls it writes
    reasoning_effort: StrictStr | None = None  # "low" | "medium" | "high": the template's (gpt-oss's) variable
    chat_template_kwargs: dict[str, Any] | None = None  # more template variables (vLLM's): e.g. enable_thinking

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def template_variables(self) -> dict[str, Any]:
        """``chat_template_kwargs`` and ``reasoning_effort``, checked: names a template can use that do not stand
        for what the server itself passes (messages, tools, special tokens)."""
        out = dict(self.chat_template_kwargs or {})
        for name in out:
            if not _TEMPLATE_NAME.fullmatch(name) or name in RESERVED_TEMPLATE_NAMES:
                raise InvalidParameterError(
                    f"chat_template_kwargs may not set {name[:64]!r}: names are identifiers, and "
                    f"{', '.join(sorted(RESERVED_TEMPLATE_NAMES))} are the server's")
        if self.reasoning_effort is not None:
            if self.reasoning_effort not in ("low", "medium", "high"):
                raise InvalidParameterError(f"reasoning_effort must be 'low', 'medium' or 'high', got "
                                            f"{self.reasoning_effort[:64]!r}")
            out["reasoning_effort"] = self.reasoning_effort
        return out


# ---- errors ---------------------------------------------------------------------------------------------
class ErrorInfo(BaseModel):
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class ModelNotFoundError(InvalidParameterError):
    pass


_PARAM = re.compile(r"^([a-z_]+)\b")
KNOWN_PARAMS = {
    "n", "max_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
    "presence_penalty", "frequency_penalty", "logit_bias", "seed", "stop", "stop_token_ids", "ignore_eos", "logprobs",
    "include_stop_str_in_output", "skip_special_tokens", "prompt_logprobs", "priority", "deadline_s", "prompt", "messages",
    "top_logprobs", "max_completion_tokens", "model", "speculative", "structured_outputs", "response_format",
    "tools", "tool_choice", "reasoning_effort", "chat_template_kwargs", *LlamaSamplerFields.LLAMA_FIELDS,
}


def param_of(message: str) -> str | None:
    """The parameter an InvalidParameterError message starts with ('n must be ...' -> 'n')."""
    m = _PARAM.match(message)
    return m.group(1) if m and m.group(1) in KNOWN_PARAMS else None


def response_format_constraint(value: Any) -> StructuredOutputs | None:
    """OpenAI's ``response_format`` as a constraint: "text" none, "json_object" any JSON object, "json_schema" the
    schema in ``json_schema.schema`` (``name`` is required, as OpenAI requires it; ``strict`` is accepted: the
    output always follows the schema)."""
    if value is None:
        return None
    allowed = "an object whose type is 'text', 'json_object' or 'json_schema'"
    if not isinstance(value, dict) or value.get("type") not in ("text", "json_object", "json_schema"):
        raise InvalidParameterError(f"response_format must be {allowed}, got {str(value)[:200]}")
    if value["type"] == "text":
        return None
    if value["type"] == "json_object":
        return StructuredOutputs.of({"json_object": True}, "response_format")
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str) or not spec["name"]:
        raise InvalidParameterError("response_format.json_schema must be an object with a non-empty 'name' and a "
                                    "'schema'")
    if not isinstance(spec.get("strict", False), bool) and spec.get("strict") is not None:
        raise InvalidParameterError("response_format.json_schema.strict must be true or false")
    schema = spec.get("schema", {"type": "object"})
    return StructuredOutputs.of({"json": schema}, "response_format.json_schema.schema")
