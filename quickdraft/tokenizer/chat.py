"""Chat templates: render a conversation into the prompt string a chat model expects.

Templates are Jinja2, rendered the way transformers' `apply_chat_template(tokenize=False)` does:
a sandboxed environment with trim_blocks/lstrip_blocks, the `raise_exception`, `strftime_now`,
`tojson` helpers, the special tokens as variables (`bos_token`, `eos_token`, ...) and
`add_generation_prompt`.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Used when a model ships no template of its own.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Gemma's turn format (its vocabulary has no ChatML tokens): as Google's template, the assistant is "model" and a
# system message opens the first user turn.
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% set first = namespace(prefix='') %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{% set first.prefix = message['content'] + '\n\n' %}"
    "{% else %}{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + first.prefix + message['content'] | trim + '<end_of_turn>\n' }}"
    "{% set first.prefix = '' %}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)


def default_template(has_token: Callable[[str], bool]) -> str:
    """The template for a model that ships none: its family's turn format where its vocabulary shows one."""
    return GEMMA_TEMPLATE if has_token("<start_of_turn>") else CHATML_TEMPLATE


class ChatTemplateError(ValueError):
    """The template failed to render (syntax error, or it called raise_exception)."""


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys: bool = False) -> str:
    # Jinja's own tojson HTML-escapes; chat templates want plain JSON.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class GenerationBlock(Extension):
    """``{% generation %}...{% endgeneration %}``, which templates trained with assistant masks put around an
    assistant's text (transformers' AssistantTracker): rendering it is rendering its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


@lru_cache(maxsize=32)
def compile_template(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols, GenerationBlock])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(template)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"chat template has a syntax error (line {exc.lineno}): {exc.message}") from exc


def validate_messages(messages: Any) -> list[dict[str, Any]]:
    """Check `messages` is a non-empty list of dicts with string 'role' and 'content' (an assistant message that
    calls tools may have a null content, as OpenAI's clients send it: a template that takes it gets it, see
    ``takes_null_content``, any other an empty string).

    Returns shallow copies, without the other keys whose value is None, so a template cannot mutate the caller's
    dicts.
    """
    if isinstance(messages, (str, bytes)) or not isinstance(messages, (list, tuple)):
        raise ValueError(f"messages must be a list of dicts with 'role' and 'content', got {type(messages).__name__}")
    if not messages:
        raise ValueError("messages is empty: a conversation needs at least one message")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content', got {type(message).__name__}")
        calls = message.get("role") == "assistant" and isinstance(message.get("tool_calls"), list) and bool(
            message["tool_calls"])
        for key in ("role", "content"):
            if key not in message:
                raise ValueError(f"messages[{i}] has no {key!r} key (each message needs 'role' and 'content')")
            if not isinstance(message[key], str) and not (key == "content" and calls and message[key] is None):
                raise ValueError(
                    f"messages[{i}][{key!r}] must be a string, got {type(message[key]).__name__}"
                )
        if not message["role"]:
            raise ValueError(f"messages[{i}]['role'] is an empty string")
        out.append({k: v for k, v in message.items() if v is not None or k == "content"})
    return out


PROBE_CALL = "quickdraft_probe_call"  # the function the probes' call calls
PROBE_ARGUMENT = "quickdraft_probe_argument"  # the one argument of the arguments probe's call
_PROBE_ERRORS = (ValueError, TypeError, KeyError, AttributeError, ArithmeticError, RecursionError, jinja2.TemplateError)


PROBE_ID = "probecall"  # 9 letters: an id every template takes (Mistral's want 9 letters and digits)
OPENAI_CALL_ID = "call_" + "0" * 24  # the form of the ids this server gives calls


def _probe_turns(shape: int, arguments: Any, content: str | None, call_id: str) -> list[dict[str, Any]]:
    """A conversation with an assistant turn calling PROBE_CALL, as history (some templates read a last turn
    differently): followed by its result, or by a user turn, or (shape 2) last."""
    call = {"id": call_id, "type": "function", "function": {"name": PROBE_CALL, "arguments": arguments}}
    turns = [{"role": "user", "content": "x"}, {"role": "assistant", "content": content, "tool_calls": [call]}]
    follow = ({"role": "tool", "tool_call_id": call_id, "content": "z"}, {"role": "user", "content": "y"}, None)
    return turns + [follow[shape]] if follow[shape] else turns


@lru_cache(maxsize=32)
def _probe_shape(template: str) -> int | None:
    """The first of ``_probe_turns``' shapes the template renders (None: none)."""
    for shape in range(3):
        for arguments in ({}, "{}"):
            if _render(template, _probe_turns(shape, arguments, "", PROBE_ID)) is not None:
                return shape
    return None


def _render(template: str, turns: list[dict[str, Any]]) -> str | None:
    try:
        return compile_template(template).render(messages=turns, add_generation_prompt=False, tools=None,
                                                 documents=None, bos_token="<s>", eos_token="</s>")
    except _PROBE_ERRORS:
        return None


def _render_probe_call(template: str, arguments: Any, content: str | None = "", call_id: str = PROBE_ID) -> str | None:
    """The template's rendering of a conversation calling PROBE_CALL (``_probe_turns``); None where it fails."""
    shape = _probe_shape(template)
    return None if shape is None else _render(template, _probe_turns(shape, arguments, content, call_id))


@lru_cache(maxsize=32)
def takes_object_arguments(template: str) -> bool:
    """Whether ``template`` wants a call's arguments as an object, not OpenAI's JSON text: given the text it fails,
    or shows the argument's name only inside an escaped string, where given the object it shows the name (as
    llama.cpp probes a template's wants). Templates that iterate ``arguments.items()`` are such (GLM, MiniMax)."""
    as_text = _render_probe_call(template, json.dumps({PROBE_ARGUMENT: 1}))
    as_object = _render_probe_call(template, {PROBE_ARGUMENT: 1})

    def shows_name(rendered: str | None) -> bool:
        return rendered is not None and rendered.replace(f'\\"{PROBE_ARGUMENT}\\"', "").count(PROBE_ARGUMENT) > 0
    return shows_name(as_object) and not shows_name(as_text)


@lru_cache(maxsize=32)
def wants_short_call_ids(template: str) -> bool:
    """Whether ``template`` refuses call ids of OpenAI's form where it takes 9 letters and digits (Mistral's raise
    "Tool call IDs should be alphanumeric strings with length 9")."""
    for arguments in ({}, "{}"):
        if _render_probe_call(template, arguments) is not None:
            return _render_probe_call(template, arguments, call_id=OPENAI_CALL_ID) is None
    return False


@lru_cache(maxsize=32)
def takes_null_content(template: str, object_arguments: bool) -> bool:
    """Whether ``template`` renders an assistant message that only calls tools with a null content (what OpenAI's
    clients send, and what llama.cpp passes to a template that takes it): DeepSeek-R1's renders the calls only then.
    A template that fails on null, prints "None", or drops the call under null does not; it gets "" instead.
    ``object_arguments``: the calls' arguments are objects (else JSON text), as the template will get them."""
    arguments = {} if object_arguments else "{}"
    with_null, with_empty = _render_probe_call(template, arguments, None), _render_probe_call(template, arguments)
    if with_null is None or with_empty is None:
        return False
    return (with_null.count("None") <= with_empty.count("None")
            and with_null.count(PROBE_CALL) >= max(1, with_empty.count(PROBE_CALL)))


def _fit_null_contents(template: str, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A calling message's null content as the template takes it: null where it does (``takes_null_content``), else
    an empty string."""
    nulls = [m for m in messages if m.get("content") is None]
    if not nulls:
        return messages
    fn = nulls[0]["tool_calls"][0].get("function") if isinstance(nulls[0]["tool_calls"][0], dict) else None
    if takes_null_content(template, isinstance(fn, dict) and isinstance(fn.get("arguments"), dict)):
        return messages
    return [{**m, "content": ""} if m.get("content") is None else m for m in messages]


def render_chat_template(
    template: str | None,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    special_tokens: dict[str, str | None] | None = None,
    **kwargs: Any,
) -> str:
    """Render `messages` with `template` (ChatML when None). Extra kwargs (tools, ...) reach the template."""
    source = template if template is not None else CHATML_TEMPLATE
    checked = _fit_null_contents(source, validate_messages(messages))
    compiled = compile_template(source)
    variables: dict[str, Any] = {k: v for k, v in (special_tokens or {}).items() if v is not None}
    variables.update(kwargs)
    variables.setdefault("tools", None)
    variables.setdefault("documents", None)
    try:
        return compiled.render(messages=checked, add_generation_prompt=add_generation_prompt, **variables)
    except jinja2.exceptions.TemplateError as exc:
        raise ChatTemplateError(f"chat template failed to render: {exc}") from exc
