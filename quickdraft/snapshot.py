"""Session snapshot files: their format, the identity of the models they were made with, and every check a
snapshot read from disk must pass before a single KV block is taken (format: docs/SESSIONS.md).

A snapshot comes from outside: its checksum only shows it is whole, not that it is sane, so every value is
validated and every problem is a ``SessionError`` naming the field.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from quickdraft.engine.build import LoadedEngine
from quickdraft.engine.sequence import SpeculationState
from quickdraft.errors import SessionError
from quickdraft.kv import ModelRunner
from quickdraft.sampling import SamplingParams
from quickdraft.sampling.mirostat import checked_mu
from quickdraft.snapshot_checks import (GENERATOR_BYTES, MAX_COUNT, Message, bounded_int, check_keys,
                                        checked_generator, checked_messages, short, show, speculation_state)

FORMAT = "quickdraft-session"
FORMAT_VERSION = 1
_MAX_HEADER = 100 << 20  # safetensors' own limit on the JSON header
FILE_MODE = 0o600  # a snapshot holds the conversation: readable by its owner only
# the session record's fields (version 1); a snapshot with more or fewer is not one this release wrote
FIELDS = frozenset({"format", "version", "identity", "history", "cached", "turns", "interrupted", "spec", "messages"})
TURN_FIELDS = frozenset({"params", "start", "chat", "delivered_chars"})
TURN_OPTIONAL = frozenset({"mirostat_mu"})  # written by releases that run mirostat



@dataclass
class Turn:
    """A turn that was interrupted (its stream closed early): how to continue it."""

    params: SamplingParams
    start: int  # index in the history where the turn's output starts
    chat: bool  # a chat reply (appended to the messages when it completes)
    delivered_chars: int = 0  # characters of its text the caller already received
    mirostat_mu: float | None = None  # where it samples with mirostat: its state, which its tokens alone do not give

    def to_json(self) -> dict:
        return {"params": dataclasses.asdict(self.params), "start": self.start, "chat": self.chat,
                "delivered_chars": self.delivered_chars, "mirostat_mu": self.mirostat_mu}

    @classmethod
    def from_json(cls, d: Any, history_len: int, vocab_size: int) -> "Turn":
        """The interrupted turn of a snapshot's record, every value checked; raises ValueError saying what is wrong."""
        if not isinstance(d, dict):
            raise ValueError(f"interrupted is {show(d)}; it must be null or an object with "
                             f"{', '.join(sorted(TURN_FIELDS))}")
        check_keys(d, TURN_FIELDS, "interrupted", optional=TURN_OPTIONAL)
        params = d["params"]
        if not isinstance(params, dict):
            raise ValueError(f"interrupted.params is {show(params)}; it must be an object of sampling parameters")
        try:
            sampling = SamplingParams(**params)
            sampling.check_vocab(vocab_size)
        except (TypeError, ValueError) as exc:  # an unknown name, a value that fails validation
            raise ValueError(f"interrupted.params are invalid ({exc})") from None
        if sampling.n != 1:
            raise ValueError(f"interrupted.params has n={sampling.n}; a session turn has n=1")
        start = bounded_int(d["start"], "interrupted.start", 1, history_len)
        if not isinstance(d["chat"], bool):
            raise ValueError(f"interrupted.chat is {show(d['chat'])}; it must be true or false")
        mu = d.get("mirostat_mu")
        mu = None if mu is None else checked_mu(mu, "interrupted.mirostat_mu")
        delivered = bounded_int(d["delivered_chars"], "interrupted.delivered_chars", 0, MAX_COUNT)
        return cls(sampling, start, d["chat"], delivered, mu)


@dataclass
class Restored:
    """The host-side state of a resumed session."""

    history: list[int]
    spec: SpeculationState
    generator: torch.Generator
    interrupted: Turn | None
    messages: list[Message]
    turns: int


PLANE_NAMES = {"k": "keys", "v": "values", "k_scale": "key scales", "v_scale": "value scales"}  # KVPool.planes


def restore_plan(loaded: LoadedEngine, meta: dict, tensors: dict[str, torch.Tensor], path: Path
                 ) -> tuple[Restored, dict[str, tuple[ModelRunner, dict[str, torch.Tensor], int]]]:
    """Check a snapshot's content against this LLM: the host-side state to restore and, per cache, the planes of
    the pool (keys, values, an int8 cache's scales) to put back; raises SessionError before anything is allocated."""

    def bad(what: str) -> SessionError:
        return SessionError(f"session snapshot {path} is inconsistent: {what}; it cannot be resumed")

    vocab = loaded.target.vocab_size
    history = meta["history"]
    if not isinstance(history, list):
        raise bad(f"history is {show(history)}; it must be a list of token ids")
    if len(history) >= loaded.max_model_len:
        raise SessionError(f"session snapshot {path} holds {len(history)} tokens but this LLM's context window is "
                           f"{loaded.max_model_len}; build the LLM with a larger max_model_len")
    for i, t in enumerate(history):
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
            raise bad(f"history[{i}] is {show(t)}: token ids are integers in [0, {vocab}), this model's "
                      f"vocabulary")
    try:
        cached = meta["cached"]
        if not isinstance(cached, dict):
            raise ValueError(f"cached is {show(cached)}; it must be an object {{cache: tokens cached}}")
        for key, n in cached.items():
            bounded_int(n, f"cached[{short(repr(key))}]", 0, max(0, len(history) - 1))
        turns = bounded_int(meta["turns"], "turns", 0, MAX_COUNT)
        spec = speculation_state(meta["spec"])
        turn = meta["interrupted"]
        interrupted = None if turn is None else Turn.from_json(turn, len(history), vocab)
        messages = checked_messages(meta["messages"])
    except ValueError as exc:
        raise bad(str(exc)) from None
    generator = checked_generator(tensors, bad)
    runners = runners_of(loaded)
    if set(cached) != set(runners):
        raise bad(f"caches for {short(sorted(cached))}, this LLM has {sorted(runners)}")
    expected = {"generator"} | {f"kv.{key}.{plane}" for key, n in cached.items() if n
                                for plane in runners[key].pool.planes}
    # a draft of another vocabulary also saves the ids its cache holds (its re-encoding of the history)
    expected |= {f"kv.{key}.tokens" for key, n in cached.items()
                 if n and key != "target" and f"kv.{key}.tokens" in tensors}
    if set(tensors) != expected:
        raise bad(f"tensors {short(sorted(tensors))}, expected {sorted(expected)}")
    plan = {}
    for key, runner in runners.items():
        n = cached[key]
        planes = {}
        for name, plane in runner.pool.planes.items() if n else ():
            t = planes[name] = tensors[f"kv.{key}.{name}"]
            shape = (runner.num_layers, n, *plane.shape[2:])
            what = f"{key} {PLANE_NAMES[name]}"
            if tuple(t.shape) != shape or t.dtype != plane.dtype:
                raise bad(f"{what} are {(tuple(t.shape), str(t.dtype))}, expected {shape} {plane.dtype}")
            if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                raise bad(f"{what} hold NaN or infinite numbers")
        ids = tensors.get(f"kv.{key}.tokens") if n else None
        if ids is not None and (tuple(ids.shape) != (n,) or ids.dtype != torch.int64
                                or (n and not 0 <= int(ids.min()) <= int(ids.max()) < runner.vocab_size)):
            raise bad(f"{key} token ids are {(tuple(ids.shape), str(ids.dtype))}, expected ({n},) int64 ids in "
                      f"[0, {runner.vocab_size})")
        plan[key] = (runner, planes, n, None if ids is None else ids.tolist())
    for key, (runner, _, n, _) in plan.items():
        need = -(-n // runner.block_size)
        if need > runner.allocator.num_free:
            raise SessionError(
                f"resuming {path} needs {need} free KV blocks in the {key} cache, {runner.allocator.num_free} "
                f"are free; close other sessions or raise kv_cache_memory")
    return Restored(history, spec, generator, interrupted, messages, turns), plan


# ---- identity, format -------------------------------------------------------------------------
def runners_of(loaded: LoadedEngine) -> dict[str, ModelRunner]:
    """The KV caches a session of ``loaded`` holds: the target's and the drafter's (draft model / self-draft), if any."""
    runners = {"target": loaded.target}
    drafter = loaded.drafter
    if drafter is not None and drafter.runner is not None:
        runners[drafter.key] = drafter.runner
    return runners


def max_snapshot_bytes(loaded: LoadedEngine) -> int:
    """The largest snapshot an LLM can have written: a header of at most ``_MAX_HEADER`` bytes (safetensors' limit),
    the generator state and, per cache, keys and values for a full context window. A larger file is refused before
    it is read."""
    total = 8 + _MAX_HEADER + GENERATOR_BYTES
    for runner in runners_of(loaded).values():
        total += runner.bytes_per_block * -(-loaded.max_model_len // runner.block_size)
    return total


def identity(loaded: LoadedEngine) -> dict:
    """What a snapshot must have been made with: models by content, drafter, weight format, dtypes, KV layout."""
    def model(ckpt) -> dict:
        return {"fingerprint": ckpt.content_fingerprint(), "name": ckpt.source.name}

    drafter = loaded.drafter
    runners = runners_of(loaded)
    return {
        "target": model(loaded.checkpoint),
        "draft": model(loaded.draft_checkpoint) if loaded.draft_checkpoint is not None else None,
        "drafter": None if drafter is None else drafter.name,
        "weights": loaded.weights,
        "draft_weights": loaded.draft_weights,
        "dtype": str(loaded.dtype).removeprefix("torch."),
        "kv": {key: {"dtype": str(r.pool.dtype).removeprefix("torch."), "layers": r.num_layers,
                     "kv_heads": r.pool.k.shape[2], "head_dim": r.pool.k.shape[3]} for key, r in runners.items()},
    }


# ---- reading the file ---------------------------------------------------------------------------------------
def read_snapshot(path: Path, cap: int) -> bytes:
    """The file's bytes, refused unread when it is not a regular file or larger than ``cap``."""
    try:
        st = path.stat()
        if not stat.S_ISREG(st.st_mode):
            raise SessionError(f"{path} is not a regular file, so not a quickdraft session snapshot")
        if st.st_size > cap:
            raise SessionError(f"session snapshot {path} is {st.st_size:,} bytes, more than the {cap:,} a snapshot of "
                               f"this LLM can hold (its header plus keys/values for a full context window); it is not "
                               f"a snapshot of this LLM's sessions")
        with open(path, "rb") as f:
            data = f.read(cap + 1)  # the file may have grown since stat
    except FileNotFoundError:
        raise SessionError(f"no session snapshot at {path}; check the path, or start a new session") from None
    except OSError as exc:
        raise SessionError(f"cannot read the session snapshot {path}: {exc}") from exc
    if len(data) > cap:
        raise SessionError(f"session snapshot {path} grew past {cap:,} bytes while it was read; it is not a snapshot "
                           f"of this LLM's sessions")
    return data


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def checksum(meta_json: str, tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.blake2b(digest_size=32)
    h.update(meta_json.encode())
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(f"\0{name}\0{t.dtype}\0{tuple(t.shape)}\0".encode())
        if t.numel():
            h.update(t.reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def parse_snapshot(data: bytes, path: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """Header, integrity and checksum checks; returns the session record (a dict with exactly ``FIELDS``, of a
    supported version) and the tensors. Values are checked by ``_restore_plan``: a hostile file can recompute the
    checksum, so the checksum only detects damage."""
    not_snapshot = SessionError(f"{path} is not a quickdraft session snapshot (saved with Session.save)")

    def corrupt(what: str) -> SessionError:
        return SessionError(f"session snapshot {path} is corrupt ({what})")

    if len(data) < 8:
        raise not_snapshot
    n = int.from_bytes(data[:8], "little")
    looks_like_header = data[8:10] == b'{"'
    if n > len(data) - 8:
        if looks_like_header and n <= _MAX_HEADER:
            raise SessionError(f"session snapshot {path} is truncated ({len(data)} bytes, its header alone needs "
                               f"{n + 8}); the last save did not complete: use an older copy or start a new session")
        raise not_snapshot
    if n > _MAX_HEADER:
        if looks_like_header:
            raise corrupt(f"a header of {n:,} bytes, more than the {_MAX_HEADER:,} allowed")
        raise not_snapshot
    try:
        header = json.loads(data[8:8 + n])
    except (ValueError, RecursionError):
        if looks_like_header:
            raise corrupt("unreadable header") from None
        raise not_snapshot from None
    meta_raw = header.get("__metadata__") if isinstance(header, dict) else None
    if not isinstance(meta_raw, dict) or meta_raw.get("format") != FORMAT:
        raise not_snapshot
    try:
        end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
    except (KeyError, TypeError, ValueError, IndexError):
        raise corrupt("bad tensor table") from None
    if 8 + n + end > len(data):
        raise SessionError(f"session snapshot {path} is truncated ({len(data)} of {8 + n + end} bytes); the save "
                           f"did not complete: use an older copy or start a new session")
    if 8 + n + end < len(data):
        raise corrupt(f"{len(data) - 8 - n - end} unexpected trailing bytes")
    record = meta_raw.get("session")
    try:
        if not isinstance(record, str):
            raise TypeError("no session record")
        meta = json.loads(record, parse_constant=_reject_constant)
    except (TypeError, ValueError, RecursionError) as exc:  # also numbers of thousands of digits, deep nesting
        raise corrupt(f"unreadable session record: {type(exc).__name__}: {short(exc)}") from None
    if not isinstance(meta, dict):
        raise corrupt(f"the session record is {show(meta)}, not an object")
    version = meta.get("version")
    if isinstance(version, bool) or not isinstance(version, int):
        raise corrupt(f"its format version is {show(version)}, not an integer")
    if version != FORMAT_VERSION:
        raise SessionError(f"session snapshot {path} has format version {version}; this quickdraft reads version "
                           f"{FORMAT_VERSION}; resume it with the quickdraft release that saved it")
    try:
        from safetensors.torch import load as load_tensors
        tensors = load_tensors(data)
    except Exception as exc:
        raise corrupt(f"{type(exc).__name__}: {short(exc)}") from None
    if checksum(record, tensors) != meta_raw.get("checksum"):
        raise SessionError(f"session snapshot {path} is corrupt (checksum mismatch: the file was changed or damaged "
                           f"after it was saved); use an older copy or start a new session")
    try:
        check_keys(meta, FIELDS, "the session record")
    except ValueError as exc:
        raise SessionError(f"session snapshot {path} is inconsistent: {exc}; it cannot be resumed") from None
    if meta["format"] != FORMAT:
        raise SessionError(f"session snapshot {path} is inconsistent: its record's format is {show(meta['format'])}, "
                           f"expected {FORMAT!r}; it cannot be resumed")
    return meta, tensors
