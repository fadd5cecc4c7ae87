"""Tools and earlier calls in the prompt: ``prepare_messages`` fits a request's tool list, its assistant messages' calls
and the tools' results to the model's chat template, as the template can render them or else as text."""
from __future__ import annotations

import hashlib
import json
import re
import string
from typing import Any

from quickdraft.serving.tools import CLOSE, MAX_CALLS, OPEN, ToolSpec, loads_object, must_be
from quickdraft.tokenizer.chat import takes_object_arguments, wants_short_call_ids


def _client_calls(i: int, calls: Any) -> list[tuple[str | None, str, Any, str]]:
    """An assistant message's tool_calls as (id, name, arguments: a dict when its JSON is an object, their text)."""
    where = f"messages[{i}].tool_calls"
    if not isinstance(calls, list) or len(calls) > MAX_CALLS:
        raise must_be(where, f"a list of at most {MAX_CALLS} calls", calls)
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        arguments = fn.get("arguments", "{}") if isinstance(fn, dict) else None
        if (not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not isinstance(arguments, (str, dict))
                or not isinstance(call.get("id") or "", str)):
            raise must_be(f"{where}[{j}]", 'a call {"id", "type": "function", "function": {"name", "arguments"}}', call)
        parsed = loads_object(arguments) if isinstance(arguments, str) else arguments
        text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
        out.append((call.get("id") or None, fn["name"], arguments if parsed is None else parsed, text))
    return out


def short_call_id(call_id: str) -> str:
    """9 letters and digits standing for a call's id, the same for the call and its result, for the templates that
    take no other (Mistral's); an id of that form already is kept."""
    if re.fullmatch(r"[A-Za-z0-9]{9}", call_id):
        return call_id
    number = int.from_bytes(hashlib.sha256(call_id.encode(errors="replace")).digest()[:8], "big")
    digits = string.ascii_letters + string.digits
    return "".join(digits[number // len(digits) ** k % len(digits)] for k in range(9))


def _with_short_ids(message: dict) -> dict:
    """A message whose call ids (its calls', or the one its result answers) are ``short_call_id``'s."""
    if isinstance(message.get("tool_calls"), list):
        message = {**message, "tool_calls": [{**c, "id": short_call_id(c["id"])} for c in message["tool_calls"]]}
    if isinstance(message.get("tool_call_id"), str):
        message = {**message, "tool_call_id": short_call_id(message["tool_call_id"])}
    return message


def _instructions(spec: ToolSpec) -> str:
    """The system text that teaches a template without tools the <tool_call> form (or the demanded answer)."""
    listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in spec.template_tools())
    call = '{"name": <function-name>, "arguments": <arguments-object>}'
    how = (f"Call the function {spec.choice} now: answer only with its arguments, as one JSON object." if spec.forced
           else f"Call one or more of them now: answer only with a JSON array of calls, [{call}]."
           if spec.choice == "required" else "To call one, answer with a JSON object within <tool_call></tool_call> "
           f'tags, one block a call:\n<tool_call>\n{call}\n</tool_call>\nFunction results come back in messages '
           'that start with "Tool result".')
    return f"# Tools\n\nYou can call these functions:\n<tools>\n{listing}\n</tools>\n\n{how}"


def prepare_messages(messages: list[dict], spec: ToolSpec | None,
                     template: str | None) -> tuple[list[dict], list[dict] | None]:
    """The messages to render and the ``tools`` to pass to ``template`` (None: none); what the template cannot
    render itself (tool list, earlier calls, their results) becomes text."""
    t = template or ""  # what it renders itself: the tool list, assistant tool_calls, "tool" messages
    own_tools, own_calls, own_results = bool(re.search(r"\btools\b", t)), "tool_calls" in t, bool(re.search(
        r"""["']tool["']""", t))
    # arguments as a dict (transformers' convention: Qwen's template does ``arguments | tojson``, Qwen3-Coder's
    # ``arguments | items``), not JSON text
    mapping = "arguments" not in t or bool(re.search(
        r"arguments\s*(\|\s*(tojson|items|dictsort)|\.items\(\)|is\s+(mapping|string))", t)) or (
        bool(t) and takes_object_arguments(t))
    out: list[dict] = []
    names: dict[str, str] = {}  # call id -> function name, for the results that follow
    merge = False  # the last message is a result made user text: the next result joins it (turns may alternate)
    for i, message in enumerate(messages):
        m = {**message, "content": "" if message.get("content") is None else message["content"]}
        calls = _client_calls(i, m.pop("tool_calls")) if m.get("tool_calls") is not None else []
        names.update((c[0], c[1]) for c in calls if c[0])
        if calls and own_calls:
            m["tool_calls"] = [{"id": c[0] or f"call_{i}_{j}", "type": "function", "function": {
                "name": c[1], "arguments": c[2] if mapping else c[3]}} for j, c in enumerate(calls)]
            if not m["content"] and m["role"] == "assistant":
                m["content"] = None  # as OpenAI's clients send it: the render gives the template null or ""
        elif calls:
            blocks = [f"{OPEN}\n{json.dumps({'name': n, 'arguments': a}, ensure_ascii=False)}\n{CLOSE}"
                      for _, n, a, _ in calls]
            m["content"] = "\n".join(([m["content"]] if m["content"] else []) + blocks)
        if m.get("role") == "tool" and not own_results:
            call_id = m.get("tool_call_id") if isinstance(m.get("tool_call_id"), str) else None
            name = m.get("name") if isinstance(m.get("name"), str) else names.get(call_id or "")
            label = ", ".join(x for x in (call_id and f"call {call_id}", name) if x)
            text = f"Tool result ({label}): {m['content']}" if label else f"Tool result: {m['content']}"
            if merge:  # joined once at the end: a long run of results stays linear
                out[-1]["parts"].append(text)
                continue
            m = {"role": "user", "parts": [text]}
        merge = message.get("role") == "tool" and not own_results
        out.append(m)
    out = [{"role": m["role"], "content": "\n\n".join(m["parts"])} if "parts" in m else m for m in out]
    if t and (own_calls or own_results) and wants_short_call_ids(t):
        out = [_with_short_ids(m) for m in out]
    active = spec is not None and spec.choice != "none"
    if active and not own_tools:
        note = _instructions(spec)
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{note}" if out[0]["content"] else note}
        else:
            out.insert(0, {"role": "system", "content": note})
    return out, (spec.template_tools() if active and own_tools else None)
