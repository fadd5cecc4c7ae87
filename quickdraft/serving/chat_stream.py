"""A chat request's output as the APIs built on chat see it (Responses, Anthropic Messages): thinking and text
pieces and tool calls as they stream, then the finished choice. Both read the same ``ToolCallStream`` the chat-completions stream
reads, so every API sends the same calls for the same output."""
from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

from quickdraft.serving.openai_format import ChatReading, Choice, TokenText, chat_choice, chat_chunk_fields
from quickdraft.serving.streams import merge_streams
from quickdraft.serving.tools import ToolCall


@dataclass
class TextPiece:
    text: str


@dataclass
class ReasoningPiece:
    """Thinking the model wrote before (or between) its answer's pieces."""

    text: str


@dataclass
class CallStart:
    """A tool call begins: its id and name, and the first of its arguments' text (maybe all of it)."""

    index: int
    call_id: str
    name: str
    arguments: str


@dataclass
class CallArguments:
    index: int
    arguments: str


@dataclass
class Finished:
    """The end of the output: the choice (tokens, finish reason after tool parsing, usage figures)."""

    choice: Choice


ChatPiece = ReasoningPiece | TextPiece | CallStart | CallArguments | Finished


async def chat_pieces(job, reading: ChatReading, token_text: TokenText) -> AsyncIterator[ChatPiece]:
    """The pieces of a one-choice chat job's output, in order; ``Finished`` last. A failed request raises."""
    fields_of = chat_chunk_fields(False, token_text, reading)
    choice = Choice(0)
    async for _, chunk in merge_streams(job.streams):
        choice.count(chunk)
        fields = fields_of(0, 0, chunk)
        if fields is None:
            continue
        delta = fields["delta"]
        if delta.get("reasoning_content"):
            yield ReasoningPiece(delta["reasoning_content"])
        if delta.get("content"):
            yield TextPiece(delta["content"])
        for call in delta.get("tool_calls", ()):
            fn = call.get("function", {})
            if "id" in call:
                yield CallStart(call["index"], call["id"], fn.get("name", ""), fn.get("arguments", ""))
            elif fn.get("arguments"):
                yield CallArguments(call["index"], fn["arguments"])
        if "finish_reason" in fields:  # a choice that ended in tool calls says so
            choice.finish_reason = fields["finish_reason"]
    yield Finished(choice)


@dataclass
class WholeChat:
    """A one-choice chat job's whole output as ``openai_format.chat_choice`` reads it: the choice (its finish
    reason after tool parsing), the thinking and the text (None if blank) and the calls."""

    choice: Choice
    reasoning: str | None
    text: str | None
    calls: list[ToolCall]


async def whole_chat(job, reading: ChatReading, token_text: TokenText, request) -> WholeChat:
    """The whole output, once generated; ClientGone if the client left first."""
    choice = (await job.gather_or_abort(request))[0]
    whole = chat_choice(choice, False, token_text, reading)
    choice.finish_reason = whole["finish_reason"]
    message = whole["message"]
    calls = [ToolCall(c["function"]["name"], c["function"]["arguments"], c["id"])
             for c in message.get("tool_calls") or ()]
    return WholeChat(choice, message.get("reasoning_content") or None, message.get("content") or None, calls)
