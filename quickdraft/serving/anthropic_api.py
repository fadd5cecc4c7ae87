"""Anthropic's Messages API (``POST /v1/messages``, ``POST /v1/messages/count_tokens``): the request translated
into a chat request, run by the one chat path (``routes.start_chat``), its output told as content blocks
(``text``, ``tool_use``) and Anthropic's stream events. Errors on these routes take Anthropic's shape
(``guard.anthropic_error_body``), and the API key may come as ``x-api-key`` as well as a Bearer token."""
from __future__ import annotations

import json
from typing import Any, ClassVar

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationError

from quickdraft.errors import InvalidParameterError
from quickdraft.serving.anthropic_format import MessageEvents, content_blocks, message_body, message_events
from quickdraft.serving.chat_stream import chat_pieces, whole_chat
from quickdraft.serving.jobs import ClientGone
from quickdraft.serving.openai_format import describe_validation
from quickdraft.serving.protocol import ChatCompletionRequest, LlamaSamplerFields
from quickdraft.serving.responses_format import new_id
from quickdraft.serving.sse import event_stream
from quickdraft.serving.routes import chat_prompt_ids, context_of, start_chat
from quickdraft.serving.tools import must_be, parse_tools

MAX_MESSAGES = 4096
_ERRORS = {status: {"description": what} for status, what in (
    (400, "invalid_request_error"), (401, "authentication_error"), (404, "not_found_error"),
    (413, "request_too_large"), (429, "rate_limit_error"), (500, "api_error"), (503, "overloaded_error"))}
router = APIRouter()


class CountTokensRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: StrictStr
    messages: Any = Field(..., description="[{'role': 'user' | 'assistant', 'content': str | [blocks]}]")
    system: Any = None  # a string or a list of text blocks
    tools: Any = None  # [{"name", "description", "input_schema"}]
    tool_choice: Any = None  # {"type": "auto" | "any" | "tool" | "none", "name", "disable_parallel_tool_use"}


class MessagesRequest(CountTokensRequest, LlamaSamplerFields):
    max_tokens: StrictInt
    stop_sequences: list[StrictStr] | None = None
    temperature: StrictFloat | None = None
    top_p: StrictFloat | None = None
    top_k: StrictInt | None = None
    stream: StrictBool | None = False
    metadata: Any = None  # accepted and ignored
    output_config: Any = None  # {"format": {"type": "json_schema", "schema": {...}}}: the output follows the schema
    # extensions (vLLM names, as on chat completions)
    min_p: StrictFloat | None = None
    seed: StrictInt | None = None
    repetition_penalty: StrictFloat | None = None
    priority: StrictInt | None = None
    speculative: Any = None
    structured_outputs: Any = None  # as on chat completions: json, regex, choice or grammar

    SAMPLING: ClassVar[tuple[str, ...]] = ("temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty",
                                           "priority", "speculative", "structured_outputs",
                                           *LlamaSamplerFields.LLAMA_FIELDS)


def _text(content: Any, where: str) -> str:
    """A string, or a list of text blocks, as text."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        for j, block in enumerate(content):
            if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
                raise must_be(f"{where}[{j}]", "a text block {'type': 'text', 'text': ...}", block)
        return "".join(block["text"] for block in content)
    raise must_be(where, "a string or a list of text blocks", content)


def _assistant(content: Any, where: str) -> tuple[dict, set[str]]:
    """An assistant turn as a chat message (text and tool_use blocks) and the ids of its calls."""
    if isinstance(content, str):
        return {"role": "assistant", "content": content}, set()
    if not isinstance(content, list):
        raise must_be(where, "a string or a list of content blocks", content)
    texts, calls = [], []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_use":
            if not isinstance(block.get("id"), str) or not block["id"] or not isinstance(block.get("name"), str) \
                    or not isinstance(block.get("input"), dict):
                raise must_be(f"{where}[{j}]", "a tool_use block {'type': 'tool_use', 'id', 'name', 'input': {...}}",
                            block)
            arguments = json.dumps(block["input"], ensure_ascii=False)
            calls.append({"id": block["id"], "type": "function", "function": {"name": block["name"],
                                                                             "arguments": arguments}})
        elif kind not in ("thinking", "redacted_thinking"):  # a thinking model's blocks: nothing here renders them
            raise must_be(f"{where}[{j}]", "a text or tool_use block", block)
    message = {"role": "assistant", "content": "".join(texts) or None}
    return ({**message, "tool_calls": calls} if calls else message), {c["id"] for c in calls}


def _user(content: Any, where: str, open_calls: set[str]) -> list[dict]:
    """A user turn as chat messages: one tool message per tool_result (each answering a tool_use of the assistant
    turn just before), then its text."""
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    if not isinstance(content, list):
        raise must_be(where, "a string or a list of content blocks", content)
    results, texts = [], []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_result":
            call_id = block.get("tool_use_id")
            if not isinstance(call_id, str) or call_id not in open_calls:
                raise must_be(f"{where}[{j}].tool_use_id", "the id of a tool_use block in the assistant message just "
                            "before", call_id)
            text = _text(block.get("content", ""), f"{where}[{j}].content")
            if block.get("is_error") is True:
                text = f"Error: {text}"
            results.append({"role": "tool", "tool_call_id": call_id, "content": text})
        else:
            raise must_be(f"{where}[{j}]", "a text or tool_result block (only text is supported)", block)
    return results + ([{"role": "user", "content": "".join(texts)}] if texts or not results else [])


def chat_messages(body: CountTokensRequest) -> list[dict]:
    """system and messages as chat messages; a tool_result must answer a tool_use of the turn before it."""
    if not isinstance(body.messages, list) or not 1 <= len(body.messages) <= MAX_MESSAGES:
        raise must_be("messages", f"a list of 1 to {MAX_MESSAGES} messages", body.messages)
    out = [{"role": "system", "content": _text(body.system, "system")}] if body.system else []
    open_calls: set[str] = set()
    for i, message in enumerate(body.messages):
        role = message.get("role") if isinstance(message, dict) else None
        if role not in ("user", "assistant"):
            raise must_be(f"messages[{i}]", "{'role': 'user' | 'assistant', 'content': ...}", message)
        if role == "assistant":
            chat, open_calls = _assistant(message.get("content"), f"messages[{i}].content")
            out.append(chat)
        else:
            out.extend(_user(message.get("content"), f"messages[{i}].content", open_calls))
            open_calls = set()
    if out[-1]["role"] == "assistant":
        raise InvalidParameterError("messages must end with a user message (continuing a partial assistant "
                                    "message is not supported)")
    return out


def chat_tools(tools: Any, tool_choice: Any) -> tuple[Any, Any, bool | None]:
    """Anthropic's tools and tool_choice in chat completions' form, and whether parallel calls are allowed."""
    if tools is not None:
        if not isinstance(tools, list):
            raise must_be("tools", "a list of tools {'name', 'description', 'input_schema'}", tools)
        for i, t in enumerate(tools):
            if not isinstance(t, dict) or t.get("type", "custom") != "custom":
                raise must_be(f"tools[{i}]", "a client tool {'name', 'description', 'input_schema'} (no server tools "
                            "here)", t)
        tools = [{"type": "function", "function": {
            "name": t.get("name"), **({"description": t["description"]} if "description" in t else {}),
            **({"parameters": t["input_schema"]} if "input_schema" in t else {})}} for t in tools]
    if tool_choice is None:
        return tools, None, None
    kind = tool_choice.get("type") if isinstance(tool_choice, dict) else None
    if kind not in ("auto", "any", "tool", "none"):
        raise must_be("tool_choice", "{'type': 'auto' | 'any' | 'tool' | 'none'}", tool_choice)
    choice = {"auto": "auto", "any": "required", "none": "none"}.get(kind) or \
        {"type": "function", "function": {"name": tool_choice.get("name")}}
    parallel = tool_choice.get("disable_parallel_tool_use")
    return tools, choice, (not parallel) if isinstance(parallel, bool) else None


def _output_format(config: Any) -> dict | None:
    """``output_config.format`` (a JSON schema the answer must follow) as chat's ``response_format``."""
    fmt = config.get("format") if isinstance(config, dict) else None
    if config is not None and not isinstance(config, dict):
        raise must_be("output_config", "an object", config)
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise must_be("output_config.format", "{'type': 'json_schema', 'schema': {...}}", fmt)
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}


def chat_request(body: CountTokensRequest) -> ChatCompletionRequest:
    tools, tool_choice, parallel = chat_tools(body.tools, body.tool_choice)
    fields = {"model": body.model, "messages": chat_messages(body), "tools": tools, "tool_choice": tool_choice,
              "parallel_tool_calls": parallel}
    if isinstance(body, MessagesRequest):
        fields.update({k: getattr(body, k) for k in MessagesRequest.SAMPLING if getattr(body, k) is not None},
                      max_tokens=body.max_tokens, stop=body.stop_sequences,
                      response_format=_output_format(body.output_config))
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as exc:
        message = describe_validation(list(exc.errors()))[0].replace("stop", "stop_sequences", 1)
        raise InvalidParameterError(message) from None


@router.post("/v1/messages", responses=_ERRORS)
async def create_message(body: MessagesRequest, request: Request) -> Response:
    ctx = context_of(request)
    run = await start_chat(ctx, chat_request(body))
    message_id = new_id("msg")
    if body.stream:
        events = MessageEvents(message_id, ctx.answering(body.model), run.job.prompt_tokens)
        stream = message_events(events, chat_pieces(run.job, run.reading, ctx.token_text))
        return event_stream(stream, run.job)
    try:
        whole = await whole_chat(run.job, run.reading, ctx.token_text, request)
    except ClientGone:
        return Response(status_code=499)
    blocks = content_blocks(whole.reasoning, whole.text, whole.calls)
    model = ctx.answering(body.model)
    return JSONResponse(message_body(message_id, model, blocks, whole.choice, run.job.prompt_tokens))


@router.post("/v1/messages/count_tokens", responses=_ERRORS)
async def count_tokens(body: CountTokensRequest, request: Request) -> dict:
    """The prompt's tokens as ``/v1/messages`` would render it (system, tools and messages in the chat template)."""
    ctx = context_of(request)
    chat = chat_request(body)
    ctx.check_model(chat.model)
    ids = await chat_prompt_ids(ctx, chat, parse_tools(chat.tools, chat.tool_choice))
    return {"input_tokens": len(ids)}

