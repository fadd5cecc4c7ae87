"""OpenAI's Responses API (``POST /v1/responses``): the request translated into a chat request, run by the one
chat path (``routes.start_chat``), and its output told as Responses output items and events
(``responses_format.py``).

``previous_response_id`` continues a conversation the server kept (``response_store.ResponseStore``: the last
responses, in memory, bounded by count and size); a response evicted from it, or sent with ``store: false``, cannot
be continued: 404 ``previous_response_not_found``, and the client sends the whole conversation as ``input`` instead.
"""
from __future__ import annotations

import json
import reprlib
from typing import Any, ClassVar

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationError

from quickdraft.errors import InvalidParameterError, require_unicode
from quickdraft.serving.chat_stream import chat_pieces, whole_chat
from quickdraft.serving.jobs import ClientGone
from quickdraft.serving.openai_format import ERROR_RESPONSES, Choice, describe_validation
from quickdraft.serving.protocol import ChatCompletionRequest, LlamaSamplerFields
from quickdraft.serving.responses_format import (ResponseEvents, ResponseShell, new_id, output_items, response_events,
                                                 status_of)
from quickdraft.serving.sse import event_stream
from quickdraft.serving.routes import context_of, start_chat

MAX_INPUT_ITEMS = 4096
TEXT_PARTS = ("input_text", "output_text", "text")
router = APIRouter()


class ResponsesRequest(LlamaSamplerFields):
    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = None
    input: Any = Field(..., description="a string, or a list of items: messages, function_call, "
                                        "function_call_output")
    instructions: StrictStr | None = None
    tools: Any = None  # [{"type": "function", "name", "description", "parameters", "strict"}]
    tool_choice: Any = None  # "none" | "auto" | "required" | {"type": "function", "name"}
    parallel_tool_calls: StrictBool | None = None
    text: Any = None  # {"format": {"type": "text" | "json_object" | "json_schema", "name", "schema", "strict"}}
    max_output_tokens: StrictInt | None = None
    temperature: StrictFloat | None = None
    top_p: StrictFloat | None = None
    stream: StrictBool | None = False
    store: StrictBool | None = True
    previous_response_id: StrictStr | None = None
    user: StrictStr | None = None
    metadata: Any = None  # accepted and returned
    # extensions (vLLM names, as on chat completions)
    top_k: StrictInt | None = None
    min_p: StrictFloat | None = None
    seed: StrictInt | None = None
    presence_penalty: StrictFloat | None = None
    frequency_penalty: StrictFloat | None = None
    repetition_penalty: StrictFloat | None = None
    priority: StrictInt | None = None
    speculative: Any = None
    structured_outputs: Any = None  # as on chat completions: json, regex, choice or grammar
    reasoning: Any = None  # {"effort": "low" | "medium" | "high"}: the template's reasoning_effort

    SAMPLING: ClassVar[tuple[str, ...]] = ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
                "repetition_penalty", "priority", "speculative", "parallel_tool_calls", "model",
                "structured_outputs", *LlamaSamplerFields.LLAMA_FIELDS)


def _text(content: Any, where: str) -> str:
    """A message's content as text: a string, or a list of text parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") not in TEXT_PARTS or not isinstance(part.get("text"), str):
                raise InvalidParameterError(f"{where}[{j}] must be a text part {{'type': 'input_text', 'text': ...}} "
                                            f"(only text is supported), got {reprlib.repr(part)}")
            texts.append(part["text"])
        return "".join(texts)
    raise InvalidParameterError(f"{where} must be a string or a list of text parts, got {reprlib.repr(content)}")


def input_messages(value: Any, known_calls: set[str]) -> list[dict]:
    """``input`` as chat messages; consecutive function calls join one assistant message. A function_call_output
    must answer a call made earlier (in this input or the conversation it continues: ``known_calls``)."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value or len(value) > MAX_INPUT_ITEMS:
        raise InvalidParameterError(f"input must be a string or a list of 1 to {MAX_INPUT_ITEMS} items, got "
                                    f"{reprlib.repr(value)}")
    out: list[dict] = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message" and item.get("role") in ("user", "assistant", "system", "developer"):
            out.append({"role": item["role"], "content": _text(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            call_id, name, arguments = item.get("call_id"), item.get("name"), item.get("arguments")
            if not all(isinstance(x, str) and x for x in (call_id, name)) or not isinstance(arguments, str):
                raise InvalidParameterError(f"{where} must be a function call {{'type': 'function_call', 'call_id', "
                                            f"'name', 'arguments': '<JSON text>'}}, got {reprlib.repr(item)}")
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            if out and out[-1]["role"] == "assistant":  # the text before the calls, or the calls before
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
            known_calls.add(call_id)
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if not isinstance(call_id, str) or call_id not in known_calls:
                raise InvalidParameterError(f"{where}.call_id must name a function_call made earlier in the "
                                            f"conversation, got {reprlib.repr(call_id)}")
            out.append({"role": "tool", "tool_call_id": call_id, "content": _text(item.get("output"),
                                                                                  f"{where}.output")})
        elif kind == "reasoning":
            continue  # thinking sent back: chat templates drop an earlier turn's thinking, nothing to render
        else:
            raise InvalidParameterError(f"{where} must be a message (role user, assistant, system or developer), a "
                                        f"function_call or a function_call_output, got {reprlib.repr(item)}")
    return out


def chat_tools(tools: Any, tool_choice: Any) -> tuple[Any, Any]:
    """Responses' flat function tools and tool choice in chat completions' nested form (checked there)."""
    if tools is not None:
        if not isinstance(tools, list):
            raise InvalidParameterError(f"tools must be a list of function tools, got {reprlib.repr(tools)}")
        for i, t in enumerate(tools):
            if not isinstance(t, dict) or t.get("type") != "function":
                raise InvalidParameterError(f"tools[{i}] must be a function tool {{'type': 'function', 'name', "
                                            f"'parameters'}} (no built-in tools here), got {reprlib.repr(t)}")
        tools = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in tools]
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function" and "name" in tool_choice:
        tool_choice = {"type": "function", "function": {"name": tool_choice["name"]}}
    return tools, tool_choice


def response_format(text: Any) -> Any:
    """``text.format`` as chat completions' ``response_format``."""
    if text is None:
        return None
    fmt = text.get("format") if isinstance(text, dict) else None
    if fmt is None and isinstance(text, dict):
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise InvalidParameterError(f"text.format must be an object whose type is 'text', 'json_object' or "
                                    f"'json_schema', got {reprlib.repr(fmt)}")
    if fmt["type"] != "json_schema":
        return {"type": fmt["type"]}
    return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}}


def chat_request(body: ResponsesRequest, history: list[dict], known_calls: set[str]) -> tuple[ChatCompletionRequest,
                                                                                               list[dict]]:
    """The chat request this body asks for, and the turn's own input messages (what the store keeps)."""
    turn = input_messages(body.input, known_calls)
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    tools, tool_choice = chat_tools(body.tools, body.tool_choice)
    fields = {k: getattr(body, k) for k in ResponsesRequest.SAMPLING if getattr(body, k) is not None}
    effort = body.reasoning.get("effort") if isinstance(body.reasoning, dict) else None
    if effort is not None:
        fields["reasoning_effort"] = "low" if effort == "minimal" else effort  # (harmony has no lower level)
    try:
        chat = ChatCompletionRequest.model_validate({
            **fields, "messages": system + history + turn, "tools": tools, "tool_choice": tool_choice,
            "response_format": response_format(body.text), "max_tokens": body.max_output_tokens})
    except ValidationError as exc:
        raise InvalidParameterError(describe_validation(list(exc.errors()))[0]) from None
    return chat, turn


def _settings(body: ResponsesRequest) -> dict:
    """The request's settings a response object repeats, each checked to be JSON a client can read back (no NaN,
    no lone surrogate) before any model work."""
    for name in ("instructions", "tools", "tool_choice", "text", "metadata", "user"):
        value = getattr(body, name)
        try:
            require_unicode(name, json.dumps(value, ensure_ascii=False, allow_nan=False))
        except (TypeError, ValueError, RecursionError) as exc:
            raise InvalidParameterError(f"{name} is not JSON this server can send back: {exc}") from None
    if body.metadata is not None and not isinstance(body.metadata, dict):
        raise InvalidParameterError(f"metadata must be an object of strings, got {reprlib.repr(body.metadata)}")
    return {"instructions": body.instructions, "tools": body.tools or [], "tool_choice": body.tool_choice or "auto",
            "text": body.text or {"format": {"type": "text"}}, "temperature": body.temperature, "top_p": body.top_p,
            "max_output_tokens": body.max_output_tokens, "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id, "store": body.store is not False,
            "metadata": body.metadata if isinstance(body.metadata, dict) else {}, "user": body.user}


def assistant_message(output: list[dict]) -> dict:
    """A response's output items as the chat message a later turn renders."""
    text = "".join(part["text"] for item in output if item["type"] == "message" for part in item["content"])
    calls = [{"id": item["call_id"], "type": "function", "function": {"name": item["name"],
                                                                      "arguments": item["arguments"]}}
             for item in output if item["type"] == "function_call"]
    return {"role": "assistant", "content": text or None, **({"tool_calls": calls} if calls else {})}


@router.post("/v1/responses", responses=ERROR_RESPONSES)
async def create_response(body: ResponsesRequest, request: Request) -> Response:
    ctx = context_of(request)
    history = ctx.responses.conversation(body.previous_response_id) if body.previous_response_id else []
    known_calls = {c["id"] for m in history for c in m.get("tool_calls") or ()}
    chat, turn = chat_request(body, history, known_calls)
    settings = _settings(body)
    run = await start_chat(ctx, chat)
    shell = ResponseShell(new_id("resp"), run.job.created, ctx.answering(body.model), settings)

    def remember(output: list[dict], choice: Choice) -> None:
        if body.store is not False:
            ctx.responses.put(shell.id, body.previous_response_id, turn + [assistant_message(output)])

    if body.stream:
        events = ResponseEvents(shell, run.job.prompt_tokens)
        stream = response_events(events, chat_pieces(run.job, run.reading, ctx.token_text), remember)
        return event_stream(stream, run.job)
    try:
        whole = await whole_chat(run.job, run.reading, ctx.token_text, request)
    except ClientGone:
        return Response(status_code=499)
    output = output_items(whole.reasoning, whole.text, whole.calls)
    remember(output, whole.choice)
    return JSONResponse(shell.body(status_of(whole.choice), output, whole.choice, run.job.prompt_tokens))

