"""Tool calls written as tags rather than JSON, inside a ``<tool_call>`` block (``tools.py`` finds the blocks):

- Qwen3-Coder's and Qwen3.5's: ``<function=NAME><parameter=KEY>VALUE</parameter>...</function>``, each part on its
  own line (a missing ``</parameter>`` ends at the next parameter, as vLLM reads it);
- GLM-4.5/4.6/4.7's (also Ling's and Laguna's): ``NAME<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>...``.

A value is text, typed by the tool's schema for that parameter the way these templates write it: a string as it is,
anything else as JSON (Python's ``True``/``False`` for a boolean, which a template's ``| string`` prints). Every
search moves forward, so a hostile block costs linear time."""
from __future__ import annotations

import json
from typing import Any

# JSON as OpenAI's arguments are: no NaN or Infinity (int() refuses them)
JSON = json.JSONDecoder(parse_constant=int)
FUNCTION, FUNCTION_END, PARAMETER, PARAMETER_END = "<function=", "</function>", "<parameter=", "</parameter>"
KEY, KEY_END, VALUE, VALUE_END = "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"
MAX_KEY = 256  # characters of a parameter's name
MAX_PAIRS = 1024  # parameters of one call; a block with more is no call
Pairs = list[tuple[str, str]]


def tagged_call(body: str, schemas: dict[str, Any]) -> tuple[str, dict[str, Any]] | None:
    """(name, arguments) of a block's body in either form, naming one of ``schemas`` (a tool's name -> its
    ``parameters`` schema); None where it is neither, or names no listed tool."""
    body = body.strip()
    found = _function_form(body) if body.startswith(FUNCTION) else _key_value_form(body) if KEY in body else None
    if found is None or found[0] not in schemas:
        return None
    name, pairs = found
    schema = schemas[name]
    properties = schema.get("properties") if isinstance(schema, dict) else None
    properties = properties if isinstance(properties, dict) else {}
    return name, {key: typed(value, properties.get(key)) for key, value in pairs}


def _kinds(schema: Any) -> set[str]:
    kind = schema.get("type") if isinstance(schema, dict) else None
    return {k for k in kind if isinstance(k, str)} if isinstance(kind, list) else {kind} if isinstance(kind, str) \
        else set()


def _string_only(schema: Any) -> bool:
    """Whether every value ``schema`` allows is a string: its type, or an enum/const of strings, or alternatives
    (anyOf/oneOf) that all are (``parse_tools`` bounds the schema's depth)."""
    if not isinstance(schema, dict):
        return False
    if _kinds(schema):
        return _kinds(schema) == {"string"}
    values = schema.get("enum") if isinstance(schema.get("enum"), list) else [schema["const"]] if "const" in schema \
        else None
    if values:
        return all(isinstance(v, str) for v in values)
    options = schema.get("anyOf", schema.get("oneOf"))
    return isinstance(options, list) and bool(options) and all(_string_only(o) for o in options)


def typed(value: str, schema: Any) -> Any:
    """A parameter's text as the value its schema says: a string as written, else JSON; text that is no JSON stays a
    string."""
    if _string_only(schema):
        return value
    text = value.strip()
    if "boolean" in _kinds(schema) and text in ("True", "False"):
        return text == "True"
    try:
        return JSON.decode(text)
    except (ValueError, RecursionError):
        return value


def _key(text: str) -> str | None:
    key = text.strip()
    return key if 0 < len(key) <= MAX_KEY and "<" not in key and "\n" not in key else None


def _one_newline_off(value: str) -> str:
    """The value between its tags, less the line breaks the template puts around it."""
    return value.removeprefix("\n").removesuffix("\n")


def _function_form(body: str) -> tuple[str, Pairs] | None:
    head_end = body.find(">")
    name = _key(body[len(FUNCTION):head_end]) if head_end > 0 else None
    end = body.rfind(FUNCTION_END)
    end = end if end > head_end else len(body)
    if name is None or body[end + len(FUNCTION_END):].strip():
        return None
    pairs: Pairs = []
    at, close = head_end + 1, -1  # close: the next </parameter> found (searched again only once passed)
    while True:
        start = body.find(PARAMETER, at, end)
        if body[at:start if start >= 0 else end].strip():
            return None  # text that is no parameter
        if start < 0:
            return name, pairs
        key_end = body.find(">", start, end)
        key = _key(body[start + len(PARAMETER):key_end]) if key_end >= 0 else None
        if key is None:
            return None
        if close < key_end:
            close = body.find(PARAMETER_END, key_end, end)
            close = close if close >= 0 else end
        following = body.find(PARAMETER, key_end, close)
        value_end = following if following >= 0 else close
        pairs.append((key, _one_newline_off(body[key_end + 1:value_end])))
        if len(pairs) > MAX_PAIRS:
            return None
        at = value_end + (len(PARAMETER_END) if value_end == close < end else 0)


def _key_value_form(body: str) -> tuple[str, Pairs] | None:
    first = body.find(KEY)
    name = _key(body[:first])
    pairs: Pairs = []
    at = first
    while name is not None and at < len(body):
        key_end = body.find(KEY_END, at)
        value_start = body.find(VALUE, key_end) if key_end >= 0 else -1
        value_end = body.find(VALUE_END, value_start) if value_start >= 0 else -1
        if value_end < 0 or not body.startswith(KEY, at) or body[key_end + len(KEY_END):value_start].strip():
            return None
        key = _key(body[at + len(KEY):key_end])
        if key is None:
            return None
        pairs.append((key, body[value_start + len(VALUE):value_end]))
        if len(pairs) > MAX_PAIRS:
            return None
        at = value_end + len(VALUE_END)
        at += len(body[at:at + 64]) - len(body[at:at + 64].lstrip())  # the blanks between pairs
        if at < len(body) and not body.startswith(KEY, at):
            return None
    return (name, pairs) if name is not None else None
