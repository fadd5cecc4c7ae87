"""A chat output told as OpenAI's Responses API tells it: output items (reasoning, messages, function calls), the response
object, and the stream's typed events (``response.created`` ... ``response.completed``)."""
from __future__ import annotations

import json
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from quickdraft.serving.chat_stream import (CallArguments, CallStart, ChatPiece, Finished, ReasoningPiece,
                                           TextPiece)
from quickdraft.serving.openai_format import Choice, describe_error, usage
from quickdraft.serving.tools import ToolCall


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


def message_item(item_id: str, text: str, status: str = "completed") -> dict:
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def reasoning_item(item_id: str, text: str, status: str = "completed") -> dict:
    """The model's thinking, as the Responses API gives an open-weight model's (``reasoning_text`` content)."""
    return {"type": "reasoning", "id": item_id, "status": status, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}


def call_item(item_id: str, call: ToolCall, status: str = "completed") -> dict:
    return {"type": "function_call", "id": item_id, "call_id": call.id, "name": call.name,
            "arguments": call.arguments, "status": status}


def response_usage(prompt_tokens: int, choice: Choice) -> dict:
    """Responses' usage (input/output tokens, cached input), with chat's ``speculative`` figures."""
    u = usage(prompt_tokens, [choice])
    return {"input_tokens": u["prompt_tokens"], "input_tokens_details": u["prompt_tokens_details"],
            "output_tokens": u["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u["total_tokens"], "speculative": u["speculative"]}


@dataclass
class ResponseShell:
    """Everything of a response object but its output, status and usage (echoed request settings)."""

    id: str
    created_at: int
    model: str
    settings: dict

    def body(self, status: str, output: list[dict], choice: Choice | None = None, prompt_tokens: int = 0) -> dict:
        incomplete = status == "incomplete"
        return {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
                "error": None, "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
                "model": self.model, "output": output,
                "usage": response_usage(prompt_tokens, choice) if choice is not None else None, **self.settings}


def status_of(choice: Choice) -> str:
    return "incomplete" if choice.finish_reason == "length" else "completed"


def output_items(reasoning: str | None, text: str | None, calls: list[ToolCall]) -> list[dict]:
    """A whole output's items: its thinking (if any), its text as one message (if any), then one function_call
    item a call."""
    items = [reasoning_item(new_id("rs"), reasoning)] if reasoning else []
    items += [message_item(new_id("msg"), text)] if text else []
    return items + [call_item(new_id("fc"), call) for call in calls]


@dataclass
class ResponseEvents:
    """Turns an output's pieces into Responses stream events, each with its ``sequence_number``."""

    shell: ResponseShell
    prompt_tokens: int
    output: list[dict] = field(default_factory=list)
    _sequence: int = 0
    _open: dict | None = None  # the item being written (its "text" or "arguments" growing)

    def event(self, type_: str, **fields) -> str:
        payload = {"type": type_, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return f"event: {type_}\ndata: {json.dumps(payload, separators=(',', ':'))}\n\n"

    def opening(self) -> list[str]:
        body = self.shell.body("in_progress", [])
        return [self.event("response.created", response=body), self.event("response.in_progress", response=body)]

    def piece(self, piece: ChatPiece) -> list[str]:
        if isinstance(piece, (ReasoningPiece, TextPiece)):
            kind, item, type_ = ("reasoning", reasoning_item, "response.reasoning_text.delta") \
                if isinstance(piece, ReasoningPiece) else ("message", message_item, "response.output_text.delta")
            out = [] if self._open is not None and self._open["type"] == kind else self._close() + self._start(
                item(new_id("rs" if kind == "reasoning" else "msg"), "", "in_progress"))
            return out + [self._delta(type_, piece.text)]
        if isinstance(piece, CallStart):
            item = call_item(new_id("fc"), ToolCall(piece.name, "", piece.call_id), "in_progress")
            out = self._close() + self._start(item)
            return out + ([self._delta("response.function_call_arguments.delta", piece.arguments)]
                          if piece.arguments else [])
        if isinstance(piece, CallArguments):
            return [self._delta("response.function_call_arguments.delta", piece.arguments)]
        return []

    def finish(self, choice: Choice) -> list[str]:
        out = self._close()
        status = status_of(choice)
        body = self.shell.body(status, self.output, choice, self.prompt_tokens)
        return out + [self.event(f"response.{status}", response=body)]

    def _start(self, item: dict) -> list[str]:
        self._open = item
        out = [self.event("response.output_item.added", output_index=len(self.output), item=item)]
        if item["type"] != "function_call":
            out.append(self.event("response.content_part.added", item_id=item["id"], output_index=len(self.output),
                                  content_index=0, part=dict(item["content"][0])))
        return out

    def _delta(self, type_: str, text: str) -> str:
        item = self._open
        if item["type"] != "function_call":
            item["content"][0]["text"] += text
            extra = {"logprobs": []} if item["type"] == "message" else {}
            return self.event(type_, item_id=item["id"], output_index=len(self.output), content_index=0, delta=text,
                              **extra)
        item["arguments"] += text
        return self.event(type_, item_id=item["id"], output_index=len(self.output), delta=text)

    def _close(self) -> list[str]:
        item, self._open = self._open, None
        if item is None:
            return []
        index = len(self.output)
        item["status"] = "completed"
        self.output.append(item)
        if item["type"] != "function_call":
            part = item["content"][0]
            done, extra = ("response.output_text.done", {"logprobs": []}) if item["type"] == "message" else \
                ("response.reasoning_text.done", {})
            return [self.event(done, item_id=item["id"], output_index=index, content_index=0, text=part["text"],
                               **extra),
                    self.event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                               part=part),
                    self.event("response.output_item.done", output_index=index, item=item)]
        return [self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                           arguments=item["arguments"]),
                self.event("response.output_item.done", output_index=index, item=item)]

    def failure(self, exc: BaseException) -> str:
        """An error after the 200 went out: Responses' ``error`` event with the OpenAI error's fields."""
        _, body = describe_error(exc)
        return self.event("error", code=body["error"]["code"] or body["error"]["type"],
                          message=body["error"]["message"], param=body["error"]["param"])


async def response_events(events: ResponseEvents, pieces: AsyncIterator[ChatPiece],
                          on_done=None) -> AsyncIterator[str]:
    """The whole event stream of one response; ``on_done(output, choice)`` runs once it completed."""
    for e in events.opening():
        yield e
    try:
        async for piece in pieces:
            if isinstance(piece, Finished):
                for e in events.finish(piece.choice):
                    yield e
                if on_done is not None:
                    on_done(events.output, piece.choice)
            else:
                for e in events.piece(piece):
                    yield e
    except Exception as exc:  # noqa: BLE001 - told in the stream
        yield events.failure(exc)
