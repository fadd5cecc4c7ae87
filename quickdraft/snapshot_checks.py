"""Checks of a snapshot's record, value by value: each problem raises ValueError (or SessionError, for the models'
identity) naming the field, what it holds and what is allowed."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch

from quickdraft.engine.sequence import SpeculationState
from quickdraft.errors import SessionError

GENERATOR_BYTES = torch.Generator(device="cpu").get_state().numel()  # the CPU generator's state, in bytes
MAX_COUNT = (1 << 63) - 1  # counters (turns, delivered characters) fit an int64
MAX_WEIGHT = 1e9  # speculation's decayed acceptance counts stay below ~1e3 (at most k tokens a round, decay 0.9)

Message = dict[str, Any]


def get_path(d: Any, *keys: str) -> Any:
    """``d[k1][k2]...`` where every level is a dict, else None (a damaged record never raises here)."""
    for key in keys:
        d = d.get(key) if isinstance(d, dict) else None
    return d


def short(value: Any, limit: int = 100) -> str:
    text = str(value)
    return text if len(text) <= limit else text[:limit] + "..."


def show(value: Any) -> str:
    """A value from a damaged record for an error message: its JSON type and (the start of) its text."""
    if value is None:
        return "null"
    kind = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "an integer",
            float: "a number"}.get(type(value), type(value).__name__)
    try:
        text = repr(value) if isinstance(value, float) else json.dumps(value)
    except (TypeError, ValueError, RecursionError):
        text = repr(value)
    return f"{kind} ({short(text, 60)})"


def describe_identity(ident: Any, which: str) -> str:
    return f"{short(get_path(ident, which, 'fingerprint'))} ({short(get_path(ident, which, 'name'))}, " \
           f"{short(get_path(ident, 'weights'))})"


def check_identity(theirs: Any, ours: dict, path: Path) -> None:
    if not isinstance(theirs, dict):
        raise SessionError(f"session snapshot {path} does not record the models it was made with; it cannot be resumed")
    fix = "load it into an LLM built with the same model files (copies are fine) and options, or start a new session"
    if get_path(theirs, "target", "fingerprint") != ours["target"]["fingerprint"]:
        raise SessionError(f"session snapshot {path} was made with target model fingerprint {describe_identity(theirs, 'target')}; "
                           f"this LLM has {describe_identity(ours, 'target')}; {fix}")
    if theirs.get("drafter") != ours["drafter"]:
        raise SessionError(f"session snapshot {path} was made with speculation="
                           f"{short(theirs.get('drafter') or 'off')}; "
                           f"this LLM has speculation={ours['drafter'] or 'off'} (draft= / speculative= must match); "
                           f"{fix}")
    if get_path(theirs, "draft", "fingerprint") != get_path(ours, "draft", "fingerprint"):
        raise SessionError(f"session snapshot {path} was made with draft model fingerprint {describe_identity(theirs, 'draft')}; "
                           f"this LLM has {describe_identity(ours, 'draft')}; {fix}")
    for field, what in (("weights", "weight format"), ("draft_weights", "draft weight format"), ("dtype", "dtype"),
                        ("kv", "KV cache layout")):
        if theirs.get(field) != ours[field]:
            raise SessionError(f"session snapshot {path} was made with {what} {short(theirs.get(field))}; "
                               f"this LLM has {ours[field]}; {fix}")


# ---- checking a snapshot's record ---------------------------------------------------------------------------
def check_keys(d: dict, expected: frozenset[str], what: str, optional: frozenset[str] = frozenset()) -> None:
    missing, extra = sorted(expected - set(d)), sorted(set(d) - expected - optional)
    if missing:
        raise ValueError(f"{what} lacks {', '.join(missing)}")
    if extra:
        raise ValueError(f"{what} has unexpected {', '.join(map(short, extra))} "
                         f"(it holds {', '.join(sorted(expected | optional))})")


def bounded_int(value: Any, what: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{what} is {show(value)}; it must be an integer in [{low}, {high}]")
    return value


def speculation_state(d: Any) -> SpeculationState:
    """The record's speculation state; fields it lacks keep their defaults (older snapshots lack newer fields)."""
    fields = {f.name: f.default for f in dataclasses.fields(SpeculationState)}
    if not isinstance(d, dict):
        raise ValueError(f"spec is {show(d)}; it must be an object with {', '.join(fields)}")
    extra = sorted(set(d) - set(fields))
    if extra:
        raise ValueError(f"spec has unexpected {', '.join(map(short, extra))} (it holds {', '.join(fields)})")
    for name, value in d.items():
        default = fields[name]
        if isinstance(default, bool):
            ok, allowed = isinstance(value, bool), "true or false"
        elif isinstance(default, int):
            ok, allowed = not isinstance(value, bool) and isinstance(value, int) and 0 <= value <= MAX_COUNT, \
                f"an integer in [0, {MAX_COUNT}]"
        else:
            # (NaN fails the comparison; a huge int compares without overflowing, where math.isfinite raises)
            ok, allowed = not isinstance(value, bool) and isinstance(value, (int, float)) \
                and 0 <= value <= MAX_WEIGHT, f"a number in [0, {MAX_WEIGHT:g}]"
        if not ok:
            raise ValueError(f"spec.{name} is {show(value)}; it must be {allowed}")
    state = SpeculationState(**d)
    if not state.accepted + state.rejected > 0:
        raise ValueError("spec.accepted + spec.rejected is 0; the acceptance rate accepted / (accepted + rejected) "
                         "needs a positive sum")
    return state


def checked_text(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{what} is {show(value)}; it must be a string")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"{what} is not valid Unicode (a lone surrogate at character {exc.start})") from None
    return value


def checked_messages(messages: Any) -> list[Message]:
    """Chat messages: objects with a string ``role`` and (when present) string ``content``."""
    if not isinstance(messages, list):
        raise ValueError(f"messages is {show(messages)}; it must be a list of chat messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"messages[{i}] is {show(m)}; a chat message is an object {{role, content}}")
        if "role" not in m:
            raise ValueError(f"messages[{i}] has no role")
        checked_text(m["role"], f"messages[{i}].role")
        if "content" in m:
            checked_text(m["content"], f"messages[{i}].content")
    return list(messages)


def checked_generator(tensors: dict[str, torch.Tensor], bad) -> torch.Generator:
    state = tensors.get("generator")
    if state is None or state.dtype != torch.uint8 or tuple(state.shape) != (GENERATOR_BYTES,):
        got = None if state is None else (tuple(state.shape), str(state.dtype))
        raise bad(f"the generator state is {got}, expected ({GENERATOR_BYTES},) torch.uint8")
    generator = torch.Generator(device="cpu")
    try:
        generator.set_state(state)
    except (RuntimeError, TypeError, ValueError) as exc:
        raise bad(f"the generator state is invalid ({exc})") from exc
    return generator
