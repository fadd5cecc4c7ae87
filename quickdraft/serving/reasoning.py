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
CHANNEL, MESSAGE, START, TO = "<|channel|>", "<|message|>", "<|start|>", "to="
HARMONY_ENDS = ("<|end|>", "<|return|>", "<|call|>")
MAX_HEADER = 256  # characters a harmony header may take before <|message|>; past them it is read as content
# trailing blanks of a thought (Qwen3 writes "\n</think>") that are dropped; a stream holds them until text follows,
# and at most this many, so that a run of blanks costs linear time
MAX_TRAILING_BLANKS = 64
_RECIPIENT = re.compile(r"to=([^\s<]+)")
_CHANNEL_NAME = re.compile(re.escape(CHANNEL) + r"\s*(\w+)")
_BODY_ENDS = {"think": (THINK_CLOSE,), "harmony": HARMONY_ENDS + (START, CHANNEL)}
_BODY_END = {style: re.compile("|".join(map(re.escape, ends))) for style, ends in _BODY_ENDS.items()}
_OPENS = {"think": (THINK_OPEN,), "harmony": (CHANNEL, START, TO)}  # a recipient may come before the channel

Piece = tuple[str, str]  # ("reasoning" | "content", text)


def reasoning_style(template: str | None) -> str | None:
    """"harmony", "think" or None (the model writes no separate thinking), from its chat template."""
    if template and CHANNEL in template and MESSAGE in template:
        return "harmony"
    if template and THINK_CLOSE in template:
        return "think"
    return None


def _trailing_blanks(text: str, start: int, end: int) -> int:
    """How many of the blanks ending text[start:end] are dropped from a thought's end (at most MAX_TRAILING_BLANKS)."""
    tail = text[max(start, end - MAX_TRAILING_BLANKS):end]
    return len(tail) - len(tail.rstrip())


def _held(text: str, markers: tuple[str, ...]) -> int:
    """How many trailing characters of ``text`` may begin one of ``markers`` (held back until more text comes)."""
    return max((k for m in markers for k in range(min(len(m) - 1, len(text)), 0, -1) if text.endswith(m[:k])),
               default=0)


class ReasoningReader:
    """One output's text in, ("reasoning" | "content", text) pieces out, in order. ``calls``: a harmony message to a
    function becomes a ``<tool_call>`` block (the request has tools), else its text is content."""

    def __init__(self, style: str, opened: bool = False, calls: bool = True) -> None:
        if style not in _OPENS:
            raise ValueError(f"reasoning style must be 'think' or 'harmony', got {style!r}")
        self.style, self.calls = style, calls
        self._buf, self._at = "", 0  # the text not read yet is _buf[_at:]
        self._state = "body" if opened else "start"  # start | header (harmony) | body | plain
        self._kind = "reasoning"  # what the body being read is: reasoning | content | call
        self._fresh = True  # the body has sent nothing yet: its leading blanks are dropped
        self._out: list[Piece] = []

    def feed(self, text: str) -> list[Piece]:
        self._buf = self._buf[self._at:] + text  # what is kept is short: a marker's start, a header, blanks
        self._at = 0
        while self._step():
            pass
        out, self._out = self._out, []
        return out

    def finish(self) -> list[Piece]:
        """The pieces still held at the end of the output. A call cut by the end of generation (``<|call|>`` is a
        stop token, so a whole call ends here too) is closed: ``tools.py`` then judges its arguments. A header that
        never reached its message is dropped, text that is no header kept."""
        out = self.feed("")
        rest, self._buf, self._at = self._buf[self._at:], "", 0
        if self._state in ("start", "plain") or (self._state == "header" and not rest.lstrip().startswith(
                _OPENS["harmony"])):
            self._kind = "content"
            out += self._send(rest)
        elif self._state == "body":
            out += self._send(rest[:len(rest) - _trailing_blanks(rest, 0, len(rest))] if self._kind == "reasoning"
                              else rest)
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
        if self._kind == "call":  # "<" as JSON's escape of it: the same arguments, and no tag the body can close
            text = text.replace("<", "\\u003c")
        return [("reasoning" if self._kind == "reasoning" else "content", text)]

    def _step(self) -> bool:
        """Read what the buffer allows; True when the state changed and the buffer should be read again."""
        if self._state == "start":
            lead = self._buf[self._at:].lstrip()
            opens = _OPENS[self.style]
            for marker in opens:
                if lead.startswith(marker):
                    self._buf, self._at = (lead, 0) if self.style == "harmony" else (lead, len(marker))
                    self._state = "header" if self.style == "harmony" else "body"
                    return True
            if any(m.startswith(lead) for m in opens):
                self._buf, self._at = lead, 0  # blanks (content drops its leading ones) or a marker's start: wait
                return False
            self._state, self._kind = "plain", "content"
            return True
        if self._state == "plain":
            self._out += self._send(self._buf[self._at:])
            self._at = len(self._buf)
            return False
        if self._state == "header":
            return self._header()
        if self._state == "body":
            return self._body()
        return False

    def _header(self) -> bool:
        buf, start = self._buf, self._at
        at = buf.find(MESSAGE, start, start + MAX_HEADER + len(MESSAGE))
        if at < 0:
            if len(buf) - start >= MAX_HEADER + len(MESSAGE):  # no message follows: not harmony, sent as it is
                self._state, self._kind = "plain", "content"
                return True
            return False
        header, self._at = buf[start:at], at + len(MESSAGE)
        recipients, channels = _RECIPIENT.findall(header), _CHANNEL_NAME.findall(header)  # the last ones count
        self._state, self._fresh = "body", True
        if self.calls and recipients and recipients[-1].startswith("functions."):
            self._kind = "call"
            name = recipients[-1][len("functions."):]
            self._out.append(("content", OPEN + '{"name": ' + json.dumps(name) + ', "arguments": '))
            self._fresh = False
        else:
            self._kind = "reasoning" if channels and channels[-1] == "analysis" else "content"
        return True

    def _body(self) -> bool:
        buf, start = self._buf, self._at
        found = _BODY_END[self.style].search(buf, start)
        thought = self._kind == "reasoning"
        if found is None:
            cut = len(buf) - _held(buf[max(start, len(buf) - 16):], _BODY_ENDS[self.style])
            cut -= _trailing_blanks(buf, start, cut) if thought else 0
            self._out += self._send(buf[start:cut])
            self._at = cut
            return False
        end = found.start() - (_trailing_blanks(buf, start, found.start()) if thought else 0)
        self._out += self._send(buf[start:end])
        if self._kind == "call":
            self._out.append(("content", "}" + CLOSE))
        if self.style == "think":  # the rest is the answer, whatever it says
            self._at, self._state, self._kind, self._fresh = found.end(), "plain", "content", True
            return True
        self._at = found.end() if found.group() in HARMONY_ENDS else found.start()
        self._state = "header"
        return True


@dataclass(frozen=True)
class ReasoningFormat:
    """How one request's output is read for thinking: the model's style, whether its prompt opened the thinking,
    whether harmony's function messages are tool calls (the request has tools)."""

    style: str
    opened: bool = False
    calls: bool = True

    def reader(self) -> ReasoningReader:
        return ReasoningReader(self.style, self.opened, self.calls)

    def split(self, text: str) -> tuple[str | None, str]:
        """(the reasoning, None when there is none; the content) of a whole output."""
        reader = self.reader()
        pieces = reader.feed(text) + reader.finish()
        reasoning = "".join(t for kind, t in pieces if kind == "reasoning")
        return (reasoning or None), "".join(t for kind, t in pieces if kind == "content")


def reasoning_format(template: str | None, prompt_tail: str, constrained: bool = False,
                     calls: bool = True) -> ReasoningFormat | None:
    """The request's reading, from the model's template and the last characters of its rendered prompt. A
    ``constrained`` output (a schema, a demanded call) is what its grammar says from its first token: it starts in
    no thinking even where the prompt opened one."""
    style = reasoning_style(template)
    if style is None:
        return None
    opened = style == "think" and not constrained and prompt_tail.rstrip().endswith(THINK_OPEN)
    return ReasoningFormat(style, opened, calls)


def markers_are_special(style: str, is_special) -> bool:
    """Whether the style's markers are special tokens of the vocabulary (``is_special(text)``): then the request
    keeps special tokens in its text, or the reader would never see them."""
    return any(is_special(m) for m in ((THINK_CLOSE,) if style == "think" else (CHANNEL, MESSAGE)))
