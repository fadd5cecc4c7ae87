"""Sessions: a conversation whose KV caches stay in the pools between turns, saved to and resumed from disk.

A ``Session`` owns the token history of one conversation, the KV blocks that cache it (one
``SequenceKV`` per model: the target and the draft model / self-draft layers), the speculation
state, the sampling generator, the chat messages and, when a streamed turn was closed early, that
*interrupted turn*. Each turn is one request through ``LLMEngine.step`` (no second decode loop); the
engine is told to leave the session's KV blocks alone when the request ends (``keep_kv``).

``save`` writes one safetensors file (format: docs/SESSIONS.md); ``LLM.load_session`` checks it
completely (integrity, models, dtypes) before it takes a single KV block, then scatters the saved
keys/values into fresh blocks, so a resumed conversation recomputes nothing it had already computed
and an interrupted seeded turn continues with exactly the tokens it would have produced.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from quickdraft.engine.build import LoadedEngine
from quickdraft.engine.outputs import RequestOutput, StreamChunk
from quickdraft.engine.sequence import CarriedState, Sequence, SpeculationState
from quickdraft.errors import InvalidParameterError, PromptTooLongError, RequestFailedError, SessionError
from quickdraft.kv import ModelRunner, SequenceKV
from quickdraft.loading.weight_cache import write_atomic
from quickdraft.sampling import SamplingParams
from quickdraft.sampling.sampler import make_generator


FORMAT = "quickdraft-session"
FORMAT_VERSION = 1
_MAX_HEADER = 100 << 20  # safetensors' own limit on the JSON header
_GENERATOR_BYTES = torch.Generator(device="cpu").get_state().numel()  # the CPU generator's state, in bytes
_MAX_COUNT = (1 << 63) - 1  # counters (turns, delivered characters) fit an int64
_MAX_WEIGHT = 1e9  # speculation's decayed acceptance counts stay below ~1e3 (at most k tokens a round, decay 0.9)
FILE_MODE = 0o600  # a snapshot holds the conversation: readable by its owner only
# the session record's fields (version 1); a snapshot with more or fewer is not one this release wrote
FIELDS = frozenset({"format", "version", "identity", "history", "cached", "turns", "interrupted", "spec", "messages"})
TURN_FIELDS = frozenset({"params", "start", "chat", "delivered_chars"})

Message = dict[str, Any]


@dataclass
class Turn:
    """A turn that was interrupted (its stream closed early): how to continue it."""

    params: SamplingParams
    start: int  # index in the history where the turn's output starts
    chat: bool  # a chat reply (appended to the messages when it completes)
    delivered_chars: int = 0  # characters of its text the caller already received

    def to_json(self) -> dict:
        return {"params": dataclasses.asdict(self.params), "start": self.start, "chat": self.chat,
                "delivered_chars": self.delivered_chars}

    @classmethod
    def from_json(cls, d: Any, history_len: int, vocab_size: int) -> "Turn":
        """The interrupted turn of a snapshot's record, every value checked; raises ValueError saying what is wrong."""
        if not isinstance(d, dict):
            raise ValueError(f"interrupted is {_show(d)}; it must be null or an object with "
                             f"{', '.join(sorted(TURN_FIELDS))}")
        _check_keys(d, TURN_FIELDS, "interrupted")
        params = d["params"]
        if not isinstance(params, dict):
            raise ValueError(f"interrupted.params is {_show(params)}; it must be an object of sampling parameters")
        try:
            sampling = SamplingParams(**params)
            sampling.check_vocab(vocab_size)
        except (TypeError, ValueError) as exc:  # an unknown name, a value that fails validation
            raise ValueError(f"interrupted.params are invalid ({exc})") from None
        if sampling.n != 1:
            raise ValueError(f"interrupted.params has n={sampling.n}; a session turn has n=1")
        start = _int(d["start"], "interrupted.start", 1, history_len)
        if not isinstance(d["chat"], bool):
            raise ValueError(f"interrupted.chat is {_show(d['chat'])}; it must be true or false")
        return cls(sampling, start, d["chat"], _int(d["delivered_chars"], "interrupted.delivered_chars", 0, _MAX_COUNT))


class Session:
    """One conversation with its KV caches kept between turns; see ``LLM.session`` / ``LLM.load_session``."""

    def __init__(self, loaded: LoadedEngine) -> None:
        self.loaded = loaded
        self.history: list[int] = []
        self.kv: dict[str, SequenceKV] = {"target": SequenceKV()}
        self.spec = SpeculationState()
        self.generator = make_generator(None)
        self.messages: list[Message] = []
        self.interrupted: Turn | None = None
        self.turns = 0  # completed turns
        self._active: str | None = None  # request id of the turn being generated
        self._closed = False

    # ---- public API -------------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return len(self.history)

    @property
    def num_cached(self) -> int:
        """Tokens of the history whose target keys/values are cached (at most all but the last)."""
        return self.kv["target"].num_cached

    def generate(self, prompt: str | list[int] | None, params: SamplingParams | None = None) -> RequestOutput:
        """Append ``prompt`` (text or token ids) and generate a reply; ``None`` continues an interrupted turn
        (``max_tokens`` counts from the turn's start) or, if none, starts a new turn continuing the text."""
        seq, rid, turn = self._begin_text(prompt, params)
        return self._complete(seq, rid, turn)

    def stream(self, prompt: str | list[int] | None, params: SamplingParams | None = None) -> Iterator[StreamChunk]:
        """As ``generate``, yielding chunks; closing the iterator early leaves the turn interrupted
        (``generate(None)`` / ``stream(None)`` continue it, also after ``save`` and ``load_session``)."""
        seq, rid, turn = self._begin_text(prompt, params)
        yield from self._drive(seq, rid, turn)

    def chat(self, message: Message | list[Message], params: SamplingParams | None = None) -> RequestOutput:
        """Add chat message(s), render the whole conversation with the chat template and reply; only the
        tokens beyond the common prefix with the history are computed. The reply joins the messages."""
        seq, rid, turn = self._begin_chat(message, params)
        return self._complete(seq, rid, turn)

    def chat_stream(self, message: Message | list[Message], params: SamplingParams | None = None
                    ) -> Iterator[StreamChunk]:
        """As ``chat``, yielding chunks; closing early leaves the reply interrupted (as ``stream``)."""
        seq, rid, turn = self._begin_chat(message, params)
        yield from self._drive(seq, rid, turn)

    def save(self, path: str | Path) -> Path:
        """Write the session to ``path`` atomically (a crash leaves the old file or the new one, whole)."""
        self._check_open()
        if self._active is not None:
            raise SessionError("a turn is being generated; finish or close its stream before saving the session")
        tensors, metadata = self._snapshot()
        path = Path(path)
        try:
            write_atomic(path, tensors, metadata, "session snapshot", strict=True, mode=FILE_MODE)
        except Exception as exc:
            raise SessionError(f"could not save the session to {path}: {type(exc).__name__}: {exc}") from exc
        return path

    @classmethod
    def load(cls, loaded: LoadedEngine, path: str | Path) -> "Session":
        """Read and check a snapshot completely, then allocate KV blocks and fill them with the saved keys/values."""
        path = Path(path)
        data = _read(path, max_snapshot_bytes(loaded))
        meta, tensors = _parse(data, path)
        _check_identity(meta["identity"], identity(loaded), path)
        session = cls(loaded)
        plan = session._restore_plan(meta, tensors, path)  # everything checked; nothing allocated yet
        for key, (runner, k, v, n) in plan.items():
            kv = SequenceKV()
            if n:
                runner.swap_in(kv, (k, v, n))
                runner.publish(kv, session.history)
            session.kv[key] = kv
        return session

    def close(self) -> None:
        """Give the session's KV blocks back (idempotent); the session cannot be used afterwards."""
        if self._closed:
            return
        if self._active is not None:
            self.loaded.engine.abort(self._active)
            self._active = None
        runners = self._runners()
        for key, kv in self.kv.items():
            if key in runners:
                runners[key].free(kv)
        self.kv = {}
        self._closed = True

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self.history)} tokens, {self.num_cached} cached"
        return f"Session({self.turns} turns, {state}{', interrupted' if self.interrupted else ''})"

    # ---- turns ------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise SessionError("this session is closed")

    def _check_params(self, params: SamplingParams | None) -> SamplingParams:
        self._check_open()
        if self._active is not None:
            raise SessionError("a turn is already being generated in this session; finish or close its stream first")
        params = params if params is not None else SamplingParams()
        params.validate()
        if params.n != 1:
            raise InvalidParameterError(f"a session generates one sample per turn (n=1), got n={params.n}")
        return params

    def _runners(self) -> dict[str, ModelRunner]:
        return _runners(self.loaded)

    def _begin_text(self, prompt, params):
        params = self._check_params(params)
        if prompt is None and self.interrupted is not None:
            return self._start_resumed(params)
        if prompt is None:
            if not self.history:
                raise InvalidParameterError("the session is empty: pass a prompt for its first turn")
            return self._start(self.history, params, chat=False, keep=len(self.history))
        if isinstance(prompt, str):
            ids = self.loaded.tokenizer.encode(prompt, add_special_tokens=not self.history)
        elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = list(prompt)
        else:
            raise InvalidParameterError(f"a prompt must be a string, a list of token ids or None, "
                                        f"got {type(prompt).__name__}")
        return self._start(self.history + ids, params, chat=False, keep=len(self.history),
                           text=prompt if isinstance(prompt, str) else None)

    def _begin_chat(self, message, params):
        params = self._check_params(params)
        new = [message] if isinstance(message, dict) else list(message)
        if not new or not all(isinstance(m, dict) and "role" in m for m in new):
            raise InvalidParameterError("chat takes a message {'role': ..., 'content': ...} or a list of them")
        messages = list(self.messages)
        if self.interrupted is not None and self.interrupted.chat:  # the partial reply stays in the conversation
            partial = self.loaded.tokenizer.decode(self.history[self.interrupted.start:], skip_special_tokens=True)
            messages.append({"role": "assistant", "content": partial})
        messages += new
        tok = self.loaded.tokenizer
        ids = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True), add_special_tokens=False)
        keep = 0
        for a, b in zip(self.history, ids):
            if a != b:
                break
            keep += 1
        seq, rid, turn = self._start(ids, params, chat=True, keep=keep)
        self.messages = messages
        return seq, rid, turn

    def _start(self, prompt_ids: list[int], params: SamplingParams, chat: bool, keep: int,
               text: str | None = None) -> tuple[Sequence, str, Turn]:
        """A new turn over ``prompt_ids``, of which the first ``keep`` tokens are the history's (their KV is kept)."""
        generator = make_generator(params.seed) if params.seed is not None else self.generator
        spec = SpeculationState()  # a new request's prior, so a seeded turn equals LLM.generate over the same ids
        carried = CarriedState(self.kv, spec, generator)
        rid = self.loaded.engine.add_request(list(prompt_ids), params, prompt=text, carried=carried)
        # accepted: from here on the session changes
        limit = min(keep, len(prompt_ids) - 1)
        for key, runner in self._runners().items():
            kv = self.kv.get(key)
            if kv is not None and kv.num_cached > limit:
                runner.truncate(kv, limit)
        self.history = list(prompt_ids)
        self.generator, self.spec = generator, spec
        self.interrupted = None
        self._active = rid
        return self.loaded.engine.sequences(rid)[0], rid, Turn(params, len(prompt_ids), chat)

    def _start_resumed(self, params: SamplingParams) -> tuple[Sequence, str, Turn]:
        turn = self.interrupted
        done = self.history[turn.start:]
        if len(done) >= params.max_tokens:
            raise InvalidParameterError(
                f"max_tokens={params.max_tokens} counts from the start of the interrupted turn, which already "
                f"generated {len(done)} tokens; pass a larger max_tokens to continue it")
        if len(self.history) >= self.loaded.max_model_len:
            raise PromptTooLongError(f"the session holds {len(self.history)} tokens, the context window is "
                                     f"{self.loaded.max_model_len}; nothing more can be generated")
        carried = CarriedState(self.kv, self.spec, self.generator, output_ids=list(done),
                               delivered_chars=turn.delivered_chars)
        rid = self.loaded.engine.add_request(self.history[:turn.start], params, carried=carried)
        self.interrupted = None
        self._active = rid
        return self.loaded.engine.sequences(rid)[0], rid, Turn(params, turn.start, turn.chat)

    def _drive(self, seq: Sequence, rid: str, turn: Turn) -> Iterator[StreamChunk]:
        try:
            while not seq.finished:
                for chunk in self.loaded.engine.step():
                    if chunk.request_id == rid:
                        if chunk.error is not None:
                            raise RequestFailedError(f"this turn failed: {chunk.error}; the session keeps what was "
                                                     f"delivered, and the next turn continues from there")
                        yield chunk
        finally:
            self._end(seq, rid, turn)

    def _complete(self, seq: Sequence, rid: str, turn: Turn) -> RequestOutput:
        with contextlib.closing(self._drive(seq, rid, turn)) as chunks:
            for _ in chunks:
                pass
        return RequestOutput(rid, seq.prompt, seq.prompt_ids, [seq.to_output()], True)

    def _end(self, seq: Sequence, rid: str, turn: Turn) -> None:
        if self._closed or self._active != rid:
            return
        self._active = None
        completed = seq.finished and seq.finish_reason not in ("abort", "error")
        if seq.finished:
            self.loaded.engine.release(rid)
        else:
            self.loaded.engine.abort(rid)  # keep_kv: the blocks stay with the session
        self.history = list(seq.token_ids)
        # the invariant snapshots rely on: every cache holds at most all but the last (pending) token; this
        # also gives back blocks a drafter holds beyond its committed tokens (run-ahead)
        for key, runner in self._runners().items():
            kv = self.kv.get(key)
            if kv is not None:
                runner.truncate(kv, min(kv.num_cached, len(self.history) - 1))
        if completed:
            self.interrupted = None
            self.turns += 1
            if turn.chat:
                self.messages.append({"role": "assistant", "content": seq.text})
        else:
            turn.delivered_chars = seq.delivered_chars
            self.interrupted = turn

    # ---- snapshots --------------------------------------------------------------------------
    def _snapshot(self) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        tensors: dict[str, torch.Tensor] = {"generator": self.generator.get_state().clone()}
        cached = {}
        for key, runner in self._runners().items():
            kv = self.kv.get(key)
            n = kv.num_cached if kv is not None else 0
            cached[key] = n
            if n:
                tensors[f"kv.{key}.k"], tensors[f"kv.{key}.v"] = runner.gather(kv)
        meta = {
            "format": FORMAT, "version": FORMAT_VERSION,
            "identity": identity(self.loaded),
            "history": self.history, "cached": cached, "turns": self.turns,
            "interrupted": None if self.interrupted is None else self.interrupted.to_json(),
            "spec": dataclasses.asdict(self.spec),
            "messages": self.messages,
        }
        meta_json = json.dumps(meta, sort_keys=True)
        return tensors, {"format": FORMAT, "session": meta_json, "checksum": _checksum(meta_json, tensors)}

    def _restore_plan(self, meta: dict, tensors: dict[str, torch.Tensor], path: Path
                      ) -> dict[str, tuple[ModelRunner, torch.Tensor | None, torch.Tensor | None, int]]:
        """Check the snapshot's content against this LLM and fill in the host-side state; raises
        SessionError before anything is allocated."""
        loaded = self.loaded

        def bad(what: str) -> SessionError:
            return SessionError(f"session snapshot {path} is inconsistent: {what}; it cannot be resumed")

        vocab = loaded.target.vocab_size
        history = meta["history"]
        if not isinstance(history, list):
            raise bad(f"history is {_show(history)}; it must be a list of token ids")
        if len(history) >= loaded.max_model_len:
            raise SessionError(f"session snapshot {path} holds {len(history)} tokens but this LLM's context window is "
                               f"{loaded.max_model_len}; build the LLM with a larger max_model_len")
        for i, t in enumerate(history):
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise bad(f"history[{i}] is {_show(t)}: token ids are integers in [0, {vocab}), this model's "
                          f"vocabulary")
        try:
            cached = meta["cached"]
            if not isinstance(cached, dict):
                raise ValueError(f"cached is {_show(cached)}; it must be an object {{cache: tokens cached}}")
            for key, n in cached.items():
                _int(n, f"cached[{_short(repr(key))}]", 0, max(0, len(history) - 1))
            turns = _int(meta["turns"], "turns", 0, _MAX_COUNT)
            spec = _speculation_state(meta["spec"])
            turn = meta["interrupted"]
            interrupted = None if turn is None else Turn.from_json(turn, len(history), vocab)
            messages = _messages(meta["messages"])
        except ValueError as exc:
            raise bad(str(exc)) from None
        generator = _generator(tensors, bad)
        runners = self._runners()
        if set(cached) != set(runners):
            raise bad(f"caches for {_short(sorted(cached))}, this LLM has {sorted(runners)}")
        expected = {"generator"} | {f"kv.{key}.{kv}" for key, n in cached.items() if n for kv in "kv"}
        if set(tensors) != expected:
            raise bad(f"tensors {_short(sorted(tensors))}, expected {sorted(expected)}")
        plan = {}
        for key, runner in runners.items():
            n = cached[key]
            k = v = None
            if n:
                pool = runner.pool
                shape = (runner.num_layers, n, pool.k.shape[2], pool.k.shape[3])
                k, v = tensors[f"kv.{key}.k"], tensors[f"kv.{key}.v"]
                for t in (k, v):
                    if tuple(t.shape) != shape or t.dtype != pool.k.dtype:
                        raise bad(f"{key} keys/values are {(tuple(t.shape), str(t.dtype))}, expected {shape} "
                                  f"{pool.k.dtype}")
                    if not bool(torch.isfinite(t).all()):
                        raise bad(f"{key} keys/values hold NaN or infinite numbers")
            plan[key] = (runner, k, v, n)
        for key, (runner, _, _, n) in plan.items():
            need = -(-n // runner.block_size)
            if need > runner.allocator.num_free:
                raise SessionError(
                    f"resuming {path} needs {need} free KV blocks in the {key} cache, {runner.allocator.num_free} "
                    f"are free; close other sessions or raise kv_cache_memory")
        self.history, self.spec, self.generator = history, spec, generator
        self.interrupted, self.messages, self.turns = interrupted, messages, turns
        return plan


# ---- identity, format -------------------------------------------------------------------------
def _runners(loaded: LoadedEngine) -> dict[str, ModelRunner]:
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
    total = 8 + _MAX_HEADER + _GENERATOR_BYTES
    for runner in _runners(loaded).values():
        k = runner.pool.k
        total += 2 * runner.num_layers * loaded.max_model_len * k.shape[2] * k.shape[3] * k.element_size()
    return total


def identity(loaded: LoadedEngine) -> dict:
    """What a snapshot must have been made with: models by content, drafter, weight format, dtypes, KV layout."""
    def model(ckpt) -> dict:
        return {"fingerprint": ckpt.content_fingerprint(), "name": ckpt.source.name}

    drafter = loaded.drafter
    runners = _runners(loaded)
    return {
        "target": model(loaded.checkpoint),
        "draft": model(loaded.draft_checkpoint) if loaded.draft_checkpoint is not None else None,
        "drafter": None if drafter is None else drafter.name,
        "weights": loaded.weights,
        "draft_weights": loaded.draft_weights,
        "dtype": str(loaded.dtype).removeprefix("torch."),
        "kv": {key: {"dtype": str(r.pool.k.dtype).removeprefix("torch."), "layers": r.num_layers,
                     "kv_heads": r.pool.k.shape[2], "head_dim": r.pool.k.shape[3]} for key, r in runners.items()},
    }


def _get(d: Any, *keys: str) -> Any:
    """``d[k1][k2]...`` where every level is a dict, else None (a damaged record never raises here)."""
    for key in keys:
        d = d.get(key) if isinstance(d, dict) else None
    return d


def _short(value: Any, limit: int = 100) -> str:
    text = str(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _show(value: Any) -> str:
    """A value from a damaged record for an error message: its JSON type and (the start of) its text."""
    if value is None:
        return "null"
    kind = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "an integer",
            float: "a number"}.get(type(value), type(value).__name__)
    try:
        text = repr(value) if isinstance(value, float) else json.dumps(value)
    except (TypeError, ValueError, RecursionError):
        text = repr(value)
    return f"{kind} ({_short(text, 60)})"


def _describe(ident: Any, which: str) -> str:
    return f"{_short(_get(ident, which, 'fingerprint'))} ({_short(_get(ident, which, 'name'))}, " \
           f"{_short(_get(ident, 'weights'))})"


def _check_identity(theirs: Any, ours: dict, path: Path) -> None:
    if not isinstance(theirs, dict):
        raise SessionError(f"session snapshot {path} does not record the models it was made with; it cannot be resumed")
    fix = "load it into an LLM built with the same model files (copies are fine) and options, or start a new session"
    if _get(theirs, "target", "fingerprint") != ours["target"]["fingerprint"]:
        raise SessionError(f"session snapshot {path} was made with target model fingerprint {_describe(theirs, 'target')}; "
                           f"this LLM has {_describe(ours, 'target')}; {fix}")
    if theirs.get("drafter") != ours["drafter"]:
        raise SessionError(f"session snapshot {path} was made with speculation="
                           f"{_short(theirs.get('drafter') or 'off')}; "
                           f"this LLM has speculation={ours['drafter'] or 'off'} (draft= / speculative= must match); "
                           f"{fix}")
    if _get(theirs, "draft", "fingerprint") != _get(ours, "draft", "fingerprint"):
        raise SessionError(f"session snapshot {path} was made with draft model fingerprint {_describe(theirs, 'draft')}; "
                           f"this LLM has {_describe(ours, 'draft')}; {fix}")
    for field, what in (("weights", "weight format"), ("draft_weights", "draft weight format"), ("dtype", "dtype"),
                        ("kv", "KV cache layout")):
        if theirs.get(field) != ours[field]:
            raise SessionError(f"session snapshot {path} was made with {what} {_short(theirs.get(field))}; "
                               f"this LLM has {ours[field]}; {fix}")


# ---- checking a snapshot's record ---------------------------------------------------------------------------
def _check_keys(d: dict, expected: frozenset[str], what: str) -> None:
    missing, extra = sorted(expected - set(d)), sorted(set(d) - expected)
    if missing:
        raise ValueError(f"{what} lacks {', '.join(missing)}")
    if extra:
        raise ValueError(f"{what} has unexpected {', '.join(map(_short, extra))} "
                         f"(it holds {', '.join(sorted(expected))})")


def _int(value: Any, what: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{what} is {_show(value)}; it must be an integer in [{low}, {high}]")
    return value


def _speculation_state(d: Any) -> SpeculationState:
    """The record's speculation state; fields it lacks keep their defaults (older snapshots lack newer fields)."""
    fields = {f.name: f.default for f in dataclasses.fields(SpeculationState)}
    if not isinstance(d, dict):
        raise ValueError(f"spec is {_show(d)}; it must be an object with {', '.join(fields)}")
    extra = sorted(set(d) - set(fields))
    if extra:
        raise ValueError(f"spec has unexpected {', '.join(map(_short, extra))} (it holds {', '.join(fields)})")
    for name, value in d.items():
        default = fields[name]
        if isinstance(default, bool):
            ok, allowed = isinstance(value, bool), "true or false"
        elif isinstance(default, int):
            ok, allowed = not isinstance(value, bool) and isinstance(value, int) and 0 <= value <= _MAX_COUNT, \
                f"an integer in [0, {_MAX_COUNT}]"
        else:
            ok, allowed = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value) \
                and 0 <= value <= _MAX_WEIGHT, f"a number in [0, {_MAX_WEIGHT:g}]"
        if not ok:
            raise ValueError(f"spec.{name} is {_show(value)}; it must be {allowed}")
    state = SpeculationState(**d)
    if not state.accepted + state.rejected > 0:
        raise ValueError(f"spec.accepted + spec.rejected is 0; the acceptance rate accepted / (accepted + rejected) "
                         f"needs a positive sum")
    return state


def _text(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{what} is {_show(value)}; it must be a string")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"{what} is not valid Unicode (a lone surrogate at character {exc.start})") from None
    return value


def _messages(messages: Any) -> list[Message]:
    """Chat messages: objects with a string ``role`` and (when present) string ``content``."""
    if not isinstance(messages, list):
        raise ValueError(f"messages is {_show(messages)}; it must be a list of chat messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"messages[{i}] is {_show(m)}; a chat message is an object {{role, content}}")
        if "role" not in m:
            raise ValueError(f"messages[{i}] has no role")
        _text(m["role"], f"messages[{i}].role")
        if "content" in m:
            _text(m["content"], f"messages[{i}].content")
    return list(messages)


def _generator(tensors: dict[str, torch.Tensor], bad) -> torch.Generator:
    state = tensors.get("generator")
    if state is None or state.dtype != torch.uint8 or tuple(state.shape) != (_GENERATOR_BYTES,):
        got = None if state is None else (tuple(state.shape), str(state.dtype))
        raise bad(f"the generator state is {got}, expected ({_GENERATOR_BYTES},) torch.uint8")
    generator = torch.Generator(device="cpu")
    try:
        generator.set_state(state)
    except (RuntimeError, TypeError, ValueError) as exc:
        raise bad(f"the generator state is invalid ({exc})") from exc
    return generator


# ---- reading the file ---------------------------------------------------------------------------------------
def _read(path: Path, cap: int) -> bytes:
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


def _checksum(meta_json: str, tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.blake2b(digest_size=32)
    h.update(meta_json.encode())
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(f"\0{name}\0{t.dtype}\0{tuple(t.shape)}\0".encode())
        if t.numel():
            h.update(t.reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def _parse(data: bytes, path: Path) -> tuple[dict, dict[str, torch.Tensor]]:
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
        raise corrupt(f"unreadable session record: {type(exc).__name__}: {_short(exc)}") from None
    if not isinstance(meta, dict):
        raise corrupt(f"the session record is {_show(meta)}, not an object")
    version = meta.get("version")
    if isinstance(version, bool) or not isinstance(version, int):
        raise corrupt(f"its format version is {_show(version)}, not an integer")
    if version != FORMAT_VERSION:
        raise SessionError(f"session snapshot {path} has format version {version}; this quickdraft reads version "
                           f"{FORMAT_VERSION}; resume it with the quickdraft release that saved it")
    try:
        from safetensors.torch import load as load_tensors
        tensors = load_tensors(data)
    except Exception as exc:
        raise corrupt(f"{type(exc).__name__}: {_short(exc)}") from None
    if _checksum(record, tensors) != meta_raw.get("checksum"):
        raise SessionError(f"session snapshot {path} is corrupt (checksum mismatch: the file was changed or damaged "
                           f"after it was saved); use an older copy or start a new session")
    try:
        _check_keys(meta, FIELDS, "the session record")
    except ValueError as exc:
        raise SessionError(f"session snapshot {path} is inconsistent: {exc}; it cannot be resumed") from None
    if meta["format"] != FORMAT:
        raise SessionError(f"session snapshot {path} is inconsistent: its record's format is {_show(meta['format'])}, "
                           f"expected {FORMAT!r}; it cannot be resumed")
    return meta, tensors
