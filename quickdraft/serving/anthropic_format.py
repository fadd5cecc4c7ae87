"""A chat output told as Anthropic's Messages API tells it: content blocks, ``stop_reason``, usage, and the
stream's events (``message_start``, ``content_block_start/delta/stop``, ``message_delta``, ``message_stop``)."""
from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

from quickdraft.serving.chat_stream import (CallArguments, CallStart, ChatPiece, Finished, ReasoningPiece,
                                           TextPiece)
from quickdraft.serving.guard import anthropic_error_body
from quickdraft.serving.openai_format import Choice, describe_error, usage
from quickdraft.serving.tools import ToolCall, arguments_valid


def stop_reason(choice: Choice) -> tuple[str, str | None]:
    """Anthropic's stop_reason and stop_sequence for how the chat choice finished."""
    if choice.finish_reason == "tool_calls":
        return "tool_use", None
    if choice.finish_reason == "length":
        return "max_tokens", None
    if choice.stop_string is not None:
        return "stop_sequence", choice.stop_string
    return "end_turn", None


def message_usage(prompt_tokens: int, choice: Choice) -> dict:
    """Anthropic's usage: ``input_tokens`` counts the prompt tokens not read from the cache, which
    ``cache_read_input_tokens`` counts; with chat's ``speculative`` figures."""
    u = usage(prompt_tokens, [choice])
    cached = u["prompt_tokens_details"]["cached_tokens"]
    return {"input_tokens": prompt_tokens - cached, "cache_read_input_tokens": cached,
            "cache_creation_input_tokens": 0, "output_tokens": u["completion_tokens"],
            "speculative": u["speculative"]}


def content_blocks(thinking: str | None, text: str | None, calls: list[ToolCall]) -> list[dict]:
    """The thinking (a thinking block, unsigned: this server signs nothing), the text, then one tool_use block a
    call; a call whose arguments are not a whole object (cut by max_tokens) stays text."""
    blocks = [{"type": "thinking", "thinking": thinking, "signature": ""}] if thinking else []
    blocks += [{"type": "text", "text": text}] if text else []
    for call in calls:
        if arguments_valid(call):
            blocks.append({"type": "tool_use", "id": call.id, "name": call.name, "input": json.loads(call.arguments)})
        else:
            blocks.append({"type": "text", "text": call.arguments})
    return blocks


def message_body(message_id: str, model: str, blocks: list[dict], choice: Choice, prompt_tokens: int) -> dict:
    reason, sequence = stop_reason(choice)
    return {"id": message_id, "type": "message", "role": "assistant", "model": model, "content": blocks,
            "stop_reason": reason, "stop_sequence": sequence, "usage": message_usage(prompt_tokens, choice)}


def event(type_: str, **fields) -> str:
    return f"event: {type_}\ndata: {json.dumps({'type': type_, **fields}, separators=(',', ':'))}\n\n"


@dataclass
class MessageEvents:
    """Turns an output's pieces into Anthropic stream events: one content block per run of thinking or text, or
    per tool call."""

    message_id: str
    model: str
    prompt_tokens: int
    _index: int = -1
    _open: str | None = None  # the type of the block being written

    def opening(self) -> list[str]:
        message = {"id": self.message_id, "type": "message", "role": "assistant", "model": self.model,
                   "content": [], "stop_reason": None, "stop_sequence": None,
                   "usage": {"input_tokens": self.prompt_tokens, "output_tokens": 0}}
        return [event("message_start", message=message), event("ping")]

    def piece(self, piece: ChatPiece) -> list[str]:
        if isinstance(piece, ReasoningPiece):
            out = [] if self._open == "thinking" else self._start({"type": "thinking", "thinking": "", "signature": ""})
            return out + [event("content_block_delta", index=self._index,
                                delta={"type": "thinking_delta", "thinking": piece.text})]
        if isinstance(piece, TextPiece):
            out = [] if self._open == "text" else self._start({"type": "text", "text": ""})
            return out + [event("content_block_delta", index=self._index,
                                delta={"type": "text_delta", "text": piece.text})]
        if isinstance(piece, CallStart):
            out = self._start({"type": "tool_use", "id": piece.call_id, "name": piece.name, "input": {}})
            return out + self._arguments_delta(piece.arguments)
        if isinstance(piece, CallArguments):
            return self._arguments_delta(piece.arguments)
        return []

    def finish(self, choice: Choice) -> list[str]:
        reason, sequence = stop_reason(choice)
        return self._close() + [
            event("message_delta", delta={"stop_reason": reason, "stop_sequence": sequence},
                  usage=message_usage(self.prompt_tokens, choice)),
            event("message_stop")]

    def _start(self, block: dict) -> list[str]:
        out = self._close()
        self._index += 1
        self._open = block["type"]
        return out + [event("content_block_start", index=self._index, content_block=block)]

    def _arguments_delta(self, text: str) -> list[str]:
        return [event("content_block_delta", index=self._index,
                      delta={"type": "input_json_delta", "partial_json": text})] if text else []

    def _close(self) -> list[str]:
        if self._open is None:
            return []
        self._open = None
        return [event("content_block_stop", index=self._index)]


async def message_events(events: MessageEvents, pieces: AsyncIterator[ChatPiece]) -> AsyncIterator[str]:
    for e in events.opening():
        yield e
    try:
        async for piece in pieces:
            for e in events.finish(piece.choice) if isinstance(piece, Finished) else events.piece(piece):
                yield e
    except Exception as exc:  # noqa: BLE001 - told in the stream
        status, body = describe_error(exc)
        error = anthropic_error_body(status, body["error"]["message"])
        yield event("error", error=error["error"])
