"""OpenAI tool calling for /v1/chat/completions, without the HTTP: ``parse_tools`` checks the request's fields
(``ToolSpec.constraint`` forces a demanded call; ``tool_prompts.prepare_messages`` fits tools and past calls to a chat
template), ``parse_tool_calls`` and ``ToolCallStream`` read the calls from the output: never raising, in linear time."""
from __future__ import annotations

import json
import re
import reprlib
import secrets
from dataclasses import dataclass, field
from typing import Any

from quickdraft.errors import InvalidParameterError, require_unicode
from quickdraft.serving.tagged_calls import JSON, tagged_call

MAX_TOOLS = 128
MAX_CALLS = 128  # calls read from one output; past them the text stays content
MAX_PARAMETERS_DEPTH = 56  # structured outputs allow 64 levels; the "required" constraint adds 5 around each schema
NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
CHOICE_FORMS = '"none", "auto", "required" or {"type": "function", "function": {"name": ...}}'
OPEN, CLOSE, PYTHON_TAG = "<tool_call>", "</tool_call>", "<|python_tag|>"
MISTRAL_TAG, MISTRAL_ARGS = "[TOOL_CALLS]", "[ARGS]"
# a Mistral call after [TOOL_CALLS] in the newer format (Mistral Small 3.2, Devstral, Ministral 3): NAME[ARGS]{...},
# a [CALL_ID]... between them in some
_MISTRAL_HEAD = re.compile(r"\s*([A-Za-z0-9_.-]{1,64})(?:\[CALL_ID\][A-Za-z0-9]{0,64})?" + re.escape(MISTRAL_ARGS))
HEAD_LIMIT = 64  # a stream decides from this many leading characters whether its whole text may be a call
_DECODER = JSON
_BETWEEN = re.compile(r"[\s;]*")  # what may separate the JSON values of one output (one class: no backtracking)


def must_be(where: str, allowed: str, got: Any) -> InvalidParameterError:
    """The 400 of a field that is not what it must be: where, what is allowed, what came (shortened)."""
    return InvalidParameterError(f"{where} must be {allowed}, got {reprlib.repr(got)}")


def _check_tool(i: int, tool: Any) -> dict:
    """One entry of ``tools`` in its normal form: {"type": "function", "function": {name, description?, ...}}."""
    where = f"tools[{i}]"
    fn = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
        raise must_be(where, 'an object {"type": "function", "function": {"name": ...}}', tool)
    if not isinstance(fn.get("name"), str) or not NAME.fullmatch(fn["name"]):
        raise must_be(f"{where}.function.name", "1 to 64 characters of A-Z, a-z, 0-9, '_', '.' and '-'", fn.get("name"))
    out: dict[str, Any] = {"name": fn["name"]}
    for key, kind, allowed in (("description", str, "a string"), ("strict", bool, "true or false")):
        if fn.get(key) is not None:
            if not isinstance(fn[key], kind):
                raise must_be(f"{where}.function.{key}", allowed, fn[key])
            out[key] = fn[key]
    params = fn.get("parameters")
    if params is not None:
        if not isinstance(params, dict) or params.get("type", "object") != "object":
            raise must_be(f"{where}.function.parameters", 'a JSON schema of an object ("type": "object")', params)
        stack = [(params, 1)]  # its depth, without recursing: a hostile schema is a deep one
        while stack:
            node, depth = stack.pop()
            if depth > MAX_PARAMETERS_DEPTH:
                raise InvalidParameterError(f"{where}.function.parameters is nested over {MAX_PARAMETERS_DEPTH} levels")
            children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
            stack.extend((v, depth + 1) for v in children)
    out["parameters"] = {"type": "object", **params} if params is not None else {"type": "object", "properties": {}}
    try:
        text = json.dumps(out, ensure_ascii=False, allow_nan=False)  # NaN and Infinity are not JSON
    except (TypeError, ValueError, RecursionError) as exc:
        raise InvalidParameterError(f"{where}.function is not JSON: {exc}") from None
    require_unicode(f"{where}.function", text)
    return {"type": "function", "function": out}


def _check_choice(tool_choice: Any, names: list[str]) -> tuple[str, bool]:
    """(choice, forced): forced when tool_choice names one function, choice then being its name."""
    if tool_choice is None:
        return ("auto" if names else "none"), False
    if isinstance(tool_choice, str) and tool_choice in ("none", "auto", "required"):
        if tool_choice == "required" and not names:
            raise InvalidParameterError('tool_choice "required" needs tools, and the request lists none')
        return tool_choice, False
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    if not isinstance(fn, dict) or tool_choice.get("type") != "function":
        raise must_be("tool_choice", CHOICE_FORMS, tool_choice)
    if not isinstance(fn.get("name"), str) or fn["name"] not in names:
        listed = ", ".join(names[:8]) + (", ..." if len(names) > 8 else "") if names else "the request lists none"
        raise must_be("tool_choice.function.name", f"the name of a listed tool ({listed})", fn.get("name"))
    return fn["name"], True


@dataclass(frozen=True)
class ToolSpec:
    """Checked tools and choice: "none", "auto", "required", or the demanded function's name when ``forced``."""

    tools: list[dict]
    choice: str
    forced: bool = False

    @property
    def named(self) -> str | None:
        return self.choice if self.forced else None

    def template_tools(self) -> list[dict]:
        """The tools as a chat template gets them: OpenAI's form, without the API-only "strict"."""
        return [{"type": "function", "function": {k: v for k, v in t["function"].items() if k != "strict"}}
                for t in self.tools]

    def constraint(self, parallel: bool = True) -> dict | None:
        """The structured output forcing a demanded call: the named function's arguments, or a non-empty array of
        calls, at most one per listed tool (one when ``parallel`` is False), so that a small model repeating itself
        still ends its array before max_tokens."""
        fns = [{**t["function"], "parameters": _closed(t["function"]["parameters"])} for t in self.tools]
        if self.forced:
            return {"json": next(fn["parameters"] for fn in fns if fn["name"] == self.choice)}
        if self.choice != "required":
            return None
        calls = [{"type": "object", "properties": {"name": {"const": fn["name"]}, "arguments": fn["parameters"]},
                  "required": ["name", "arguments"], "additionalProperties": False} for fn in fns]
        return {"json": {"type": "array", "minItems": 1, "maxItems": len(calls) if parallel else 1,
                         "items": {"anyOf": calls}}}


def _closed(parameters: dict) -> dict:
    """A forced call's arguments take the listed parameters only (as OpenAI's strict mode): an object schema that
    does not say otherwise gets additionalProperties false, so a small model cannot invent arguments forever."""
    if parameters.get("type") != "object" or "additionalProperties" in parameters:
        return parameters
    return {**parameters, "additionalProperties": False}


def parse_tools(tools: Any, tool_choice: Any) -> ToolSpec | None:
    """The request's ``tools`` and ``tool_choice`` checked; None when no tool is listed (and none demanded)."""
    if tools is not None and not isinstance(tools, list):
        raise must_be("tools", 'a list of {"type": "function", "function": {...}}', tools)
    if len(tools or ()) > MAX_TOOLS:
        raise InvalidParameterError(f"tools must hold at most {MAX_TOOLS} functions, got {len(tools)}")
    checked = [_check_tool(i, t) for i, t in enumerate(tools or ())]
    names = [t["function"]["name"] for t in checked]
    dup = next((i for i, name in enumerate(names) if name in names[:i]), None)
    if dup is not None:
        raise InvalidParameterError(f"tools[{dup}].function.name {names[dup]!r} is taken by an earlier tool")
    choice, forced = _check_choice(tool_choice, names)
    return ToolSpec(checked, choice, forced) if checked else None


def tool_call_style(template: str | None) -> str:
    """How the model writes calls, read off its template: "qwen" (<tool_call>), "llama3" (JSON), "mistral"
    ([TOOL_CALLS]) or "generic"."""
    if template and OPEN in template:
        return "qwen"
    if template and MISTRAL_TAG in template:
        return "mistral"
    if template and (PYTHON_TAG in template or ('"parameters"' in template and "ipython" in template)):
        return "llama3"
    return "generic"


def loads_object(text: str) -> dict | None:
    """The JSON object ``text`` holds; None where it is not one (or nests past what the decoder takes)."""
    try:
        value = _DECODER.decode(text)
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


@dataclass(frozen=True)
class ToolCall:
    """One call the model made; ``arguments`` is the compact JSON text of an object, as OpenAI sends it."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: "call_" + secrets.token_hex(12))

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def arguments_valid(call: "ToolCall") -> bool:
    """The call's arguments are a JSON object (a demanded call cut by max_tokens or a stop string is not)."""
    return loads_object(call.arguments) is not None


def _compact(arguments: dict) -> str | None:
    """The arguments text OpenAI sends: compact JSON, a lone surrogate (from a "\\ud800" escape) made "?"; None for
    what JSON cannot write (a number past float's range, read as infinity; nesting past what the encoder takes)."""
    try:
        text = json.dumps(arguments, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    except (ValueError, RecursionError):
        return None
    return text.encode(errors="replace").decode()


def _call(value: Any, names: dict[str, Any]) -> ToolCall | None:
    """A call from a decoded {"name", "arguments"|"parameters"} naming a listed tool, with an object of arguments."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or value["name"] not in names:
        return None
    arguments = value.get("arguments", value.get("parameters"))
    arguments = loads_object(arguments) if isinstance(arguments, str) else arguments
    text = _compact(arguments) if isinstance(arguments, dict) else None
    return ToolCall(value["name"], text) if text is not None else None


def _json_values(text: str) -> list[Any] | None:
    """The JSON values (lists flattened) `text` is made of, ';' or blanks between; None if it is anything else."""
    values: list[Any] = []
    i = 0
    while i < len(text) and len(values) <= MAX_CALLS:
        try:
            value, i = _DECODER.raw_decode(text, i)
        except (ValueError, RecursionError):
            return None
        values.extend(value if isinstance(value, list) else [value])
        i = _BETWEEN.match(text, i).end()
    return values if 0 < len(values) <= MAX_CALLS else None


def _whole_calls(text: str, names: dict[str, Any], fenced: bool) -> list[ToolCall]:
    """The calls when the whole text (inside a ```json fence if `fenced`) is JSON calls and nothing else."""
    text = text.strip()
    nl = text.find("\n")
    if fenced and text.startswith("```") and nl >= 0 and text[3:nl].strip().lower() in ("", "json"):
        text = text[nl + 1:len(text) - 3 if text.endswith("```") and len(text) >= nl + 4 else len(text)].strip()
    calls = [_call(v, names) for v in _json_values(text) or []]
    return [c for c in calls if c] if calls and all(calls) else []


def _mistral_calls(text: str, names: dict[str, Any]) -> list[ToolCall]:
    """What follows Mistral's [TOOL_CALLS]: a JSON list of calls (Mistral Nemo's format), or NAME[ARGS]{...} with
    [TOOL_CALLS] before each further call (the newer one). All valid, or none: the text stays content."""
    if text.lstrip().startswith("["):
        return _whole_calls(text, names, fenced=False)
    parts, calls = text.split(MISTRAL_TAG, MAX_CALLS), []
    if len(parts) > MAX_CALLS:  # more calls than are read: the text stays content
        return []
    for part in parts:
        head = _MISTRAL_HEAD.match(part)
        values = _json_values(part[head.end():].strip()) if head else None
        arguments = values[0] if values and len(values) == 1 else None
        call = _call({"name": head.group(1), "arguments": arguments}, names) if head else None
        if call is None:
            return []
        calls.append(call)
    return calls


def _block_calls(text: str, names: dict[str, Any]) -> tuple[str | None, list[ToolCall]]:
    """<tool_call> blocks (the last may lack its </tool_call>), each a JSON call or a tagged one (``tagged_calls``,
    typed by ``names``' schemas): the text outside the valid ones, and their calls."""
    start = text.find(OPEN)
    pieces, calls = [text[:start] if start >= 0 else text], []
    while start >= 0 and len(calls) < MAX_CALLS:  # every search goes forward from the last: linear
        body = start + len(OPEN)
        end = text.find(CLOSE, body)
        end, stop = (end, end + len(CLOSE)) if end >= 0 else (len(text), len(text))
        values = _json_values(text[body:end].strip())
        call = _call(values[0], names) if values and len(values) == 1 else None
        tagged = tagged_call(text[body:end], names) if call is None else None
        call = _call({"name": tagged[0], "arguments": tagged[1]}, names) if tagged else call
        (calls if call else pieces).append(call or text[start:stop])  # an invalid block stays text
        start = text.find(OPEN, stop)
        pieces.append(text[stop:start if start >= 0 else len(text)])
    content = pieces[0] + "".join(p for p in pieces[1:] if p.strip()) + (text[start:] if start >= 0 else "")
    return (content if content.strip() else None, calls) if calls else (text, [])


def parse_tool_calls(text: str, spec: ToolSpec | None, style: str) -> tuple[str | None, list[ToolCall]]:
    """(content left over, None if blank; calls) of a whole output. Never raises: what is not a call is content."""
    if spec is None or spec.choice == "none":
        return text, []
    names = {t["function"]["name"]: t["function"].get("parameters") for t in spec.tools}  # and their schemas
    if spec.forced:  # the whole text is the call's arguments, as generated (as a stream sends them)
        calls = [ToolCall(spec.choice, text)] if text else []
    elif spec.choice == "required":
        calls = _whole_calls(text, names, fenced=True)
    elif style == "llama3":  # the whole text, else what follows <|python_tag|> (content before it)
        tag = text.find(PYTHON_TAG)
        calls = _whole_calls(text, names, fenced=False)
        if not calls and tag >= 0:
            calls = _whole_calls(text[tag + len(PYTHON_TAG):], names, fenced=False)
            if calls and text[:tag].strip():
                return text[:tag], calls
    elif style == "mistral":  # content before the tag, the calls after it; without it, the generic fallback
        tag = text.find(MISTRAL_TAG)
        calls = _mistral_calls(text[tag + len(MISTRAL_TAG):], names) if tag >= 0 else \
            _whole_calls(text, names, fenced=True)
        if calls and tag >= 0:
            return (text[:tag] if text[:tag].strip() else None), calls
    else:
        content, calls = _block_calls(text, names)
        if calls:
            return content, calls
        calls = _whole_calls(text, names, fenced=True)  # the generic fallback: small models often skip the tags
    return (None, calls) if calls else (text, [])


class ToolCallStream:
    """A streamed output's ``choices[].delta`` dicts: content goes out as soon as it cannot be part of a call, and
    all sent equals ``parse_tool_calls`` of the whole text. A demanded function streams its arguments as written."""

    def __init__(self, spec: ToolSpec | None, style: str) -> None:
        self.spec, self.style = spec, style
        self.calls: list[ToolCall] = []
        self._tag = {"llama3": PYTHON_TAG, "mistral": MISTRAL_TAG}.get(style, OPEN)  # the tag a call starts with
        self._chunks: list[str] = []  # the output
        # undecided: the output from its first non-blank (to HEAD_LIMIT); streaming: the text not sent yet, the sent
        self._head, self._tail, self._sent = "", "", 0
        self._id, self._announced, self._done = "call_" + secrets.token_hex(12), False, False  # a demanded call's
        none = spec is None or spec.choice == "none"
        self._mode = "plain" if none else "named" if spec.forced else "hold" if spec.choice == "required" else "new"

    @staticmethod
    def _whole_start(head: str, style: str) -> bool | None:
        """Whether an output whose first non-blanks are `head` may be calls as a whole (None: too little known yet)."""
        if not head or head[0] in "{[":
            return None if not head else True
        if style == "llama3" or not "```".startswith(head[:3]):
            return False
        nl = head.find("\n")
        if len(head) < 3 or nl < 0:
            return None if len(head) < 3 or "json".startswith(head[3:].strip().lower()) else False
        rest = head[nl + 1:].lstrip()
        return False if head[3:nl].strip().lower() not in ("", "json") else (rest[0] in "{[" if rest else None)


    def feed(self, delta: str) -> list[dict]:
        if not delta or self._done:
            return []
        if self._mode == "plain":
            return [{"content": delta}]
        self._chunks.append(delta)
        if self._mode == "named":
            first, self._announced = not self._announced, True
            call = dict(index=0, id=self._id, type="function", function=dict(name=self.spec.choice, arguments=""))
            return [{"tool_calls": [call]}] * first + [{"tool_calls": [{"index": 0, "function": {"arguments": delta}}]}]
        if self._mode == "new":
            self._head += (delta if self._head else delta.lstrip())[:HEAD_LIMIT - len(self._head)]
            state = self._whole_start(self._head, self.style)
            if state is None and len(self._head) < HEAD_LIMIT:
                return []
            self._mode, delta = ("stream" if state is False else "hold"), "".join(self._chunks)
        return self._release(delta) if self._mode == "stream" else []

    def _release(self, delta: str) -> list[dict]:
        """Send the text before any possible start of a call's tag; leading blanks wait (a call may follow)."""
        buf, tag = self._tail + delta, self._tag
        at = buf.find(tag)
        if at >= 0:
            cut, self._mode = at, "hold"
        else:
            cut = len(buf) - next((k for k in range(min(len(tag) - 1, len(buf)), 0, -1) if buf.endswith(tag[:k])), 0)
        if cut == 0 or (not self._sent and not buf[:cut].strip()):
            self._tail = buf
            return []
        self._tail, self._sent = buf[cut:], self._sent + cut
        return [{"content": buf[:cut]}]

    def finish(self) -> list[dict]:
        """The deltas still owed at the end: held-back content, then one delta a call (id, name, all arguments)."""
        done, self._done, text = self._done, True, "".join(self._chunks)
        if done or self._mode == "plain":
            return []
        content, self.calls = parse_tool_calls(text, self.spec, self.style)
        if self._mode == "named":  # the call went out as it came: only its record is left
            self.calls = [ToolCall(c.name, c.arguments, self._id) for c in self.calls]
            return []
        out = [{"content": content[self._sent:]}] if content and len(content) > self._sent else []
        return out + [{"tool_calls": [{"index": i, **call.to_openai()}]} for i, call in enumerate(self.calls)]
