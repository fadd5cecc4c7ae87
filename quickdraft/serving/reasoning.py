"""A reasoning model's thinking, read apart from its answer: a chat response carries it as ``reasoning_content``
(the field vLLM's and llama.cpp's servers fill) and the answer as ``content``. The form is read off the chat
template:

- "think": the thinking between ``<think>`` and ``</think>`` (Qwen3, DeepSeek-R1, QwQ). A template that ends the
  prompt inside an open ``<think>`` leaves the output starting in the thinking.
- "harmony" (gpt-oss): messages ``<|channel|>NAME[ to=RECIPIENT][ <|constrain|>TYPE]<|message|>BODY<|end|>``, each
  after the first opened by ``<|start|>assistant``. The analysis channel is reasoning; final (and commentary to
  nobody, a preamble) is content; a message to ``functions.NAME`` is a tool call, handed on to ``tools.py`` as the
  ``<tool_call>`` block it reads. The markers are special tokens, so these requests keep special tokens in the text.

``ReasoningReader`` reads a stream: a piece goes out as soon as it cannot be the start of a marker, and the whole
output's reading (``split``) is the stream's, fed at once. Each search starts past what was already sent, so a
hostile output costs linear time; an output that does not open with the form's marker is all content.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

from quickdraft.serving.tools import CLOSE, OPEN

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CHANNEL, MESSAGE, START = "<|channel|>", "<|message|>", "<|start|>"
HARMONY_ENDS = ("<|end|>", "<|return|>", "<|call|>")
MAX_HEADER = 256  # characters a harmony header may take before <|message|>; past them it is read as content
_RECIPIENT = re.compile(r"to=([^\s<]+)")
_CHANNEL_NAME = re.compile(re.escape(CHANNEL) + r"\s*(\w+)")

Piece = tuple[str, str]  # ("reasoning" | "content", text)


def reasoning_style(template: str | None) -> str | None:
    """"harmony", "think" or None (the model writes no separate thinking), from its chat template."""
    if template and CHANNEL in template and MESSAGE in template:
        return "harmony"
    if template and THINK_CLOSE in template:
        return "think"
    return None


def _held(text: str, markers: tuple[str, ...]) -> int:
    """How many trailing characters of ``text`` may begin one of ``markers`` (held back until more text comes)."""
    return max((k for m in markers for k in range(min(len(m) - 1, len(text)), 0, -1) if text.endswith(m[:k])),
               default=0)


class ReasoningReader:
    """One output's text in, ("reasoning" | "content", text) pieces out, in order."""

    def __init__(self, style: str, opened: bool = False) -> None:
        if style not in ("think", "harmony"):
            raise ValueError(f"reasoning style must be 'think' or 'harmony', got {style!r}")
        self.style = style
        self._buf = ""
        self._state = "body" if opened else "start"  # start | header (harmony) | body | plain
        self._kind = "reasoning"  # what the body being read is: reasoning | content | call
        self._fresh = True  # the body has sent nothing yet: its leading blanks are dropped
        self._out: list[Piece] = []

    def feed(self, text: str) -> list[Piece]:
        self._buf += text
        while self._step():
            pass
        out, self._out = self._out, []
        return out

    def finish(self) -> list[Piece]:
        """The pieces still held at the end of the output. A call cut by the end of generation (``<|call|>`` is a
        stop token, so a whole call ends here too) is closed: ``tools.py`` then judges its arguments."""
        out = self.feed("")
        rest, self._buf = self._buf, ""
        if self._state in ("start", "plain"):
            self._kind = "content"
            out += self._send(rest)
        elif self._state == "body":
            out += self._send(rest)
            if self._kind == "call":
                out.append(("content", "}" + CLOSE))
        self._state = "done"
        return out

    def _send(self, text: str) -> list[Piece]:
        if self._fresh:
            text = text.lstrip()
        if not text:
            return []
        self._fresh = False
        return [("reasoning" if self._kind == "reasoning" else "content", text)]

    def _step(self) -> bool:
        """Read what the buffer allows; True when the state changed and the buffer should be read again."""
        buf = self._buf
        if self._state == "start":
            lead = buf.lstrip()
            opens = (THINK_OPEN,) if self.style == "think" else (CHANNEL, START)
            for marker in opens:
                if lead.startswith(marker):
                    self._buf = lead if self.style == "harmony" else lead[len(marker):]
                    self._state = "header" if self.style == "harmony" else "body"
                    return True
            if any(m.startswith(lead) for m in opens):
                self._buf = lead  # blanks (dropped: content drops its leading blanks) or a marker's start: wait
                return False
            self._state, self._kind = "plain", "content"
            return True
        if self._state == "plain":
            self._out += self._send(buf)
            self._buf = ""
            return False
        if self._state == "header":
            return self._header(buf)
        if self._state == "body":
            return self._body(buf)
        return False

    def _header(self, buf: str) -> bool:
        at = buf.find(MESSAGE)
        if at < 0:
            if len(buf) > MAX_HEADER:  # no message follows: this is not harmony, send it as it is
                self._state, self._kind = "plain", "content"
                return True
            return False
        header, self._buf = buf[:at], buf[at + len(MESSAGE):]
        recipient, channel = _RECIPIENT.search(header), _CHANNEL_NAME.search(header)
        self._state, self._fresh = "body", True
        if recipient and recipient.group(1).startswith("functions."):
            self._kind = "call"
            name = recipient.group(1)[len("functions."):]
            self._out.append(("content", OPEN + '{"name": ' + json.dumps(name) + ', "arguments": '))
            self._fresh = False
        else:
            self._kind = "reasoning" if channel and channel.group(1) == "analysis" else "content"
        return True

    def _body(self, buf: str) -> bool:
        ends = (THINK_CLOSE,) if self.style == "think" else HARMONY_ENDS + (START, CHANNEL)
        found = [(at, m) for m in ends if (at := buf.find(m)) >= 0]
        if not found:
            cut = len(buf) - _held(buf, ends)
            self._out += self._send(buf[:cut])
            self._buf = buf[cut:]
            return False
        at, marker = min(found)
        self._out += self._send(buf[:at])
        if self._kind == "call":
            self._out.append(("content", "}" + CLOSE))
        if self.style == "think":  # the rest is the answer, whatever it says
            self._buf, self._state, self._kind, self._fresh = buf[at + len(marker):], "plain", "content", True
            return True
        self._buf = buf[at + len(marker):] if marker in HARMONY_ENDS else buf[at:]
        self._state = "header"
        return True


@dataclass(frozen=True)
class ReasoningFormat:
    """How one request's output is read for thinking: the model's style, and whether its prompt opened it."""

    style: str
    opened: bool = False

    def reader(self) -> ReasoningReader:
        return ReasoningReader(self.style, self.opened)

    def split(self, text: str) -> tuple[str | None, str]:
        """(the reasoning, None when there is none; the content) of a whole output."""
        reader = self.reader()
        pieces = reader.feed(text) + reader.finish()
        reasoning = "".join(t for kind, t in pieces if kind == "reasoning")
        return (reasoning or None), "".join(t for kind, t in pieces if kind == "content")


def reasoning_format(template: str | None, prompt_tail: str) -> ReasoningFormat | None:
    """The request's reading, from the model's template and the last characters of its rendered prompt."""
    style = reasoning_style(template)
    if style is None:
        return None
    return ReasoningFormat(style, opened=style == "think" and prompt_tail.rstrip().endswith(THINK_OPEN))
