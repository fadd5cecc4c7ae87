"""What a request's output must match: a JSON schema, any JSON object, a regex, one of a few strings, or a grammar.

``StructuredOutputs`` is the request's side (vLLM's ``structured_outputs`` field; OpenAI's ``response_format`` and
a forced tool call become one), bounded and checked before any model work like every other sampling parameter. It
turns into one grammar text for llguidance (``grammar_text``); ``sampling/grammar.py`` compiles it per tokenizer.
"""
from __future__ import annotations

import json
import reprlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from quickdraft.errors import InvalidParameterError, require_unicode

KINDS = ("json", "json_object", "regex", "choice", "grammar")
MAX_SPEC_CHARS = 64 * 1024  # a schema, regex or grammar, as text: the request body cap is larger, the compile is not
MAX_SCHEMA_DEPTH = 64
MAX_CHOICES = 1024
MAX_CHOICE_CHARS = 1024
# JSON may put whitespace between tokens; an unbounded run lets a small model fill max_tokens with newlines
JSON_WHITESPACE = r"[ \t\n]{0,16}"


def _fail(field: str, allowed: str, got: Any) -> InvalidParameterError:
    return InvalidParameterError(f"{field} must be {allowed}, got {reprlib.repr(got)}")


def _depth(value: Any, field: str) -> None:
    """Refuse a schema nested deeper than MAX_SCHEMA_DEPTH without recursing (a hostile schema is a deep one)."""
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_SCHEMA_DEPTH:
            raise InvalidParameterError(f"{field} is nested more than {MAX_SCHEMA_DEPTH} levels deep")
        if isinstance(node, Mapping):
            stack.extend((v, depth + 1) for v in node.values())
        elif isinstance(node, (list, tuple)):
            stack.extend((v, depth + 1) for v in node)


def _text(field: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise _fail(field, "a non-empty string", value)
    if len(value) > MAX_SPEC_CHARS:
        raise InvalidParameterError(f"{field} must be at most {MAX_SPEC_CHARS} characters, got {len(value)}")
    require_unicode(field, value)
    return value


@dataclass(frozen=True)
class StructuredOutputs:
    """Exactly one of: ``json`` (a JSON schema, a dict or its JSON text), ``json_object`` (True: any JSON object),
    ``regex``, ``choice`` (a list of strings), ``grammar`` (Lark, or GBNF/EBNF written with ``::=``)."""

    json: Mapping[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    source: str = field(default="structured_outputs", compare=False)  # the request field it came from (errors)

    @classmethod
    def of(cls, value: Any, field: str = "structured_outputs") -> "StructuredOutputs | None":
        """A checked instance from a dict (the request's JSON), an instance, or None."""
        if value is None:
            return None
        if isinstance(value, StructuredOutputs):
            value, field = {k: getattr(value, k) for k in KINDS if getattr(value, k) not in (None, False)}, \
                value.source.removesuffix("." + value.kind) if value.source.startswith("structured_outputs.") \
                else value.source
        if not isinstance(value, Mapping):
            raise _fail(field, f"an object with exactly one of {', '.join(KINDS)}", value)
        given = [k for k, v in value.items() if v is not None and v is not False]
        unknown = [k for k in value if k not in KINDS]
        if unknown:
            raise InvalidParameterError(f"{field} has unknown key {reprlib.repr(unknown[0])}; "
                                        f"allowed: {', '.join(KINDS)}")
        if len(given) != 1:
            raise InvalidParameterError(f"{field} must set exactly one of {', '.join(KINDS)}, got "
                                        f"{', '.join(given) or 'none'}")
        kind = given[0]
        source = f"{field}.{kind}" if field == "structured_outputs" else field
        return cls(**{kind: cls._checked(kind, value[kind], source)}, source=source)

    @staticmethod
    def _checked(kind: str, value: Any, field: str) -> Any:
        if kind == "json":
            if isinstance(value, str):
                _text(field, value)
                try:
                    value = json.loads(value)
                except (ValueError, RecursionError) as exc:
                    raise InvalidParameterError(f"{field} is not valid JSON: {exc}") from None
            if value is True:  # the schema that accepts any JSON value
                value = {}
            if value is False:
                raise InvalidParameterError(f"{field} is the schema false: no output can satisfy it")
            if not isinstance(value, Mapping):
                raise _fail(field, "a JSON schema (an object)", value)
            if isinstance(value, Mapping):
                _depth(value, field)
                try:
                    text = json.dumps(value, ensure_ascii=False)
                except (TypeError, ValueError) as exc:
                    raise InvalidParameterError(f"{field} is not JSON: {exc}") from None
                _text(field, text)
            return value
        if kind == "json_object":
            if value is not True:
                raise _fail(field, "true", value)
            return True
        if kind in ("regex", "grammar"):
            return _text(field, value)
        if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)) or not value:
            raise _fail(field, f"a non-empty list of at most {MAX_CHOICES} strings", value)
        if len(value) > MAX_CHOICES:
            raise InvalidParameterError(f"{field} must hold at most {MAX_CHOICES} strings, got {len(value)}")
        for item in value:
            if not isinstance(item, str) or len(item) > MAX_CHOICE_CHARS:
                raise _fail(field, f"made of strings of at most {MAX_CHOICE_CHARS} characters", item)
            require_unicode(field, item)
        return tuple(value)

    @property
    def kind(self) -> str:
        kind = next((k for k in KINDS if getattr(self, k) not in (None, False)), None)
        if kind is None:
            raise InvalidParameterError(f"{self.source} must set exactly one of {', '.join(KINDS)}, got none")
        return kind

    def grammar_text(self) -> str:
        """The llguidance grammar (its JSON form) this constraint compiles from."""
        import llguidance  # the constraint library is imported only by requests that use it

        kind = self.kind
        options = {"whitespace_flexible": True, "whitespace_pattern": JSON_WHITESPACE}
        if kind == "json":
            return llguidance.LLMatcher.grammar_from_json_schema(dict(self.json), defaults=options)
        if kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=options)
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(self.regex)
        if kind == "choice":
            lark = "start: " + " | ".join(json.dumps(c) for c in self.choice)
            return llguidance.LLMatcher.grammar_from_lark(lark)
        text = self.grammar
        if "::=" in text:
            from llguidance.gbnf_to_lark import gbnf_to_lark
            try:
                text = gbnf_to_lark(text)
            except Exception as exc:  # noqa: BLE001 - the converter's own message names the rule
                raise InvalidParameterError(f"structured_outputs.grammar is not valid GBNF: {exc}") from None
        return llguidance.LLMatcher.grammar_from_lark(text)

    def cache_key(self) -> str:
        # key order counts: llguidance writes an object's properties in the schema's order
        return self.kind + ":" + json.dumps(getattr(self, self.kind))
