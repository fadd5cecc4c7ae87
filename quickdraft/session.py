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
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from quickdraft.engine.outputs import RequestOutput, StreamChunk
from quickdraft.engine.sequence import CarriedState, Sequence, SpeculationState
from quickdraft.errors import InvalidParameterError, PromptTooLongError, SessionError
from quickdraft.kv import ModelRunner, SequenceKV
from quickdraft.loading.weight_cache import write_atomic
from quickdraft.sampling import SamplingParams
from quickdraft.sampling.sampler import make_generator

if TYPE_CHECKING:  # llm.py imports this module; the LLM is only ever passed in
    from quickdraft.llm import LLM

FORMAT = "quickdraft-session"
FORMAT_VERSION = 1
_MAX_HEADER = 100 << 20  # safetensors' own limit on the JSON header

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
    def from_json(cls, d: dict) -> "Turn":
        return cls(SamplingParams(**d["params"]), int(d["start"]), bool(d["chat"]), int(d["delivered_chars"]))


class Session:
    """One conversation with its KV caches kept between turns; see ``LLM.session`` / ``LLM.load_session``."""

    def __init__(self, llm: "LLM") -> None:
        self.llm = llm
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
            write_atomic(path, tensors, metadata, "session snapshot", strict=True)
        except Exception as exc:
            raise SessionError(f"could not save the session to {path}: {type(exc).__name__}: {exc}") from exc
        return path

    @classmethod
    def load(cls, llm: "LLM", path: str | Path) -> "Session":
        """Read and check a snapshot completely, then allocate KV blocks and fill them with the saved keys/values."""
        path = Path(path)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise SessionError(f"no session snapshot at {path}; check the path, or start a new session") from None
        except OSError as exc:
            raise SessionError(f"cannot read the session snapshot {path}: {exc}") from exc
        meta, tensors = _parse(data, path)
        _check_identity(meta["identity"], identity(llm), path)
        session = cls(llm)
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
            self.llm.engine.abort(self._active)
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
        runners = {"target": self.llm.target}
        drafter = self.llm.drafter
        if getattr(drafter, "runner", None) is not None:
            runners[drafter.key] = drafter.runner
        return runners

    def _begin_text(self, prompt, params):
        params = self._check_params(params)
        if prompt is None and self.interrupted is not None:
            return self._start_resumed(params)
        if prompt is None:
            if not self.history:
                raise InvalidParameterError("the session is empty: pass a prompt for its first turn")
            return self._start(self.history, params, chat=False, keep=len(self.history))
        if isinstance(prompt, str):
            ids = self.llm.tokenizer.encode(prompt, add_special_tokens=not self.history)
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
            partial = self.llm.tokenizer.decode(self.history[self.interrupted.start:], skip_special_tokens=True)
            messages.append({"role": "assistant", "content": partial})
        messages += new
        tok = self.llm.tokenizer
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
        rid = self.llm.engine.add_request(list(prompt_ids), params, prompt=text, carried=carried)
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
        return self.llm.engine.sequences(rid)[0], rid, Turn(params, len(prompt_ids), chat)

    def _start_resumed(self, params: SamplingParams) -> tuple[Sequence, str, Turn]:
        turn = self.interrupted
        done = self.history[turn.start:]
        if len(done) >= params.max_tokens:
            raise InvalidParameterError(
                f"max_tokens={params.max_tokens} counts from the start of the interrupted turn, which already "
                f"generated {len(done)} tokens; pass a larger max_tokens to continue it")
        if len(self.history) >= self.llm.max_model_len:
            raise PromptTooLongError(f"the session holds {len(self.history)} tokens, the context window is "
                                     f"{self.llm.max_model_len}; nothing more can be generated")
        carried = CarriedState(self.kv, self.spec, self.generator, output_ids=list(done),
                               delivered_chars=turn.delivered_chars)
        rid = self.llm.engine.add_request(self.history[:turn.start], params, carried=carried)
        self.interrupted = None
        self._active = rid
        return self.llm.engine.sequences(rid)[0], rid, Turn(params, turn.start, turn.chat)

    def _drive(self, seq: Sequence, rid: str, turn: Turn) -> Iterator[StreamChunk]:
        try:
            while not seq.finished:
                for chunk in self.llm.engine.step():
                    if chunk.request_id == rid:
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
        completed = seq.finished and seq.finish_reason != "abort"
        if seq.finished:
            self.llm.engine.release(rid)
        else:
            self.llm.engine.abort(rid)  # keep_kv: the blocks stay with the session
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
            "identity": identity(self.llm),
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
        llm = self.llm

        def bad(what: str) -> SessionError:
            return SessionError(f"session snapshot {path} is inconsistent: {what}; it cannot be resumed")

        try:
            history = [int(t) for t in meta["history"]]
            cached = {str(k): int(v) for k, v in meta["cached"].items()}
            spec = SpeculationState(**meta["spec"])
            interrupted = None if meta["interrupted"] is None else Turn.from_json(meta["interrupted"])
            messages = list(meta["messages"])
            turns = int(meta["turns"])
        except (KeyError, TypeError, ValueError) as exc:
            raise bad(f"bad field ({type(exc).__name__}: {exc})") from exc
        vocab = llm.target.vocab_size
        if any(not 0 <= t < vocab for t in history):
            raise bad(f"token ids outside this model's vocabulary of {vocab}")
        if len(history) >= llm.max_model_len:
            raise SessionError(f"session snapshot {path} holds {len(history)} tokens but this LLM's context window is "
                               f"{llm.max_model_len}; build the LLM with a larger max_model_len")
        if interrupted is not None and not 0 < interrupted.start <= len(history):
            raise bad(f"interrupted turn starts at {interrupted.start} of {len(history)} tokens")
        generator = torch.Generator(device="cpu")
        try:
            generator.set_state(tensors["generator"])
        except (KeyError, RuntimeError, TypeError) as exc:
            raise bad(f"no valid generator state ({exc})") from exc
        runners = self._runners()
        if set(cached) != set(runners):
            raise bad(f"caches for {sorted(cached)}, this LLM has {sorted(runners)}")
        plan = {}
        for key, runner in runners.items():
            n = cached[key]
            if not 0 <= n <= max(0, len(history) - 1):
                raise bad(f"{n} cached {key} tokens for a history of {len(history)}")
            k = v = None
            if n:
                pool = runner.pool
                shape = (runner.num_layers, n, pool.k.shape[2], pool.k.shape[3])
                k, v = tensors.get(f"kv.{key}.k"), tensors.get(f"kv.{key}.v")
                for t in (k, v):
                    if t is None or tuple(t.shape) != shape or t.dtype != pool.k.dtype:
                        got = None if t is None else (tuple(t.shape), str(t.dtype))
                        raise bad(f"{key} keys/values are {got}, expected {shape} {pool.k.dtype}")
                need = -(-n // runner.block_size)
                if need > runner.allocator.num_free:
                    raise SessionError(
                        f"resuming {path} needs {need} free KV blocks in the {key} cache, {runner.allocator.num_free} "
                        f"are free; close other sessions or raise kv_cache_memory")
            plan[key] = (runner, k, v, n)
        self.history, self.spec, self.generator = history, spec, generator
        self.interrupted, self.messages, self.turns = interrupted, messages, turns
        return plan


# ---- identity, format -------------------------------------------------------------------------
def identity(llm: "LLM") -> dict:
    """What a snapshot must have been made with: models by content, drafter, weight format, dtypes, KV layout."""
    def model(ckpt) -> dict:
        return {"fingerprint": ckpt.content_fingerprint(), "name": ckpt.source.name}

    drafter = llm.drafter
    runners = {"target": llm.target}
    if getattr(drafter, "runner", None) is not None:
        runners[drafter.key] = drafter.runner
    return {
        "target": model(llm.checkpoint),
        "draft": model(llm.draft_checkpoint) if llm.draft_checkpoint is not None else None,
        "drafter": None if drafter is None else drafter.name,
        "weights": llm.weights,
        "draft_weights": llm.draft_weights,
        "dtype": str(llm.dtype).removeprefix("torch."),
        "kv": {key: {"dtype": str(r.pool.k.dtype).removeprefix("torch."), "layers": r.num_layers,
                     "kv_heads": r.pool.k.shape[2], "head_dim": r.pool.k.shape[3]} for key, r in runners.items()},
    }


def _describe(ident: dict, which: str) -> str:
    m = ident.get(which) or {}
    return f"{m.get('fingerprint')} ({m.get('name')}, {ident.get('weights')})"


def _check_identity(theirs: Any, ours: dict, path: Path) -> None:
    if not isinstance(theirs, dict):
        raise SessionError(f"session snapshot {path} does not record the models it was made with; it cannot be resumed")
    fix = "load it into an LLM built with the same model files (copies are fine) and options, or start a new session"
    if (theirs.get("target") or {}).get("fingerprint") != ours["target"]["fingerprint"]:
        raise SessionError(f"session snapshot {path} was made with target model fingerprint {_describe(theirs, 'target')}; "
                           f"this LLM has {_describe(ours, 'target')}; {fix}")
    if theirs.get("drafter") != ours["drafter"]:
        raise SessionError(f"session snapshot {path} was made with speculation={theirs.get('drafter') or 'off'}; "
                           f"this LLM has speculation={ours['drafter'] or 'off'} (draft= / speculative= must match); "
                           f"{fix}")
    if (theirs.get("draft") or {}).get("fingerprint") != (ours["draft"] or {}).get("fingerprint"):
        raise SessionError(f"session snapshot {path} was made with draft model fingerprint {_describe(theirs, 'draft')}; "
                           f"this LLM has {_describe(ours, 'draft')}; {fix}")
    for field, what in (("weights", "weight format"), ("draft_weights", "draft weight format"), ("dtype", "dtype"),
                        ("kv", "KV cache layout")):
        if theirs.get(field) != ours[field]:
            raise SessionError(f"session snapshot {path} was made with {what} {theirs.get(field)}; "
                               f"this LLM has {ours[field]}; {fix}")


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
    """Header, integrity and checksum checks; returns the session metadata and the tensors."""
    not_snapshot = SessionError(f"{path} is not a quickdraft session snapshot (saved with Session.save)")
    if len(data) < 8:
        raise not_snapshot
    n = int.from_bytes(data[:8], "little")
    looks_like_header = data[8:10] == b'{"'
    if n > len(data) - 8:
        if looks_like_header and n <= _MAX_HEADER:
            raise SessionError(f"session snapshot {path} is truncated ({len(data)} bytes, its header alone needs "
                               f"{n + 8}); the last save did not complete: use an older copy or start a new session")
        raise not_snapshot
    try:
        header = json.loads(data[8:8 + n])
        meta_raw = header.get("__metadata__") or {}
    except (ValueError, AttributeError):
        if looks_like_header:
            raise SessionError(f"session snapshot {path} is corrupt (unreadable header)") from None
        raise not_snapshot from None
    if meta_raw.get("format") != FORMAT:
        raise not_snapshot
    try:
        end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
    except (KeyError, TypeError, ValueError, IndexError):
        raise SessionError(f"session snapshot {path} is corrupt (bad tensor table)") from None
    if 8 + n + end > len(data):
        raise SessionError(f"session snapshot {path} is truncated ({len(data)} of {8 + n + end} bytes); the save "
                           f"did not complete: use an older copy or start a new session")
    if 8 + n + end < len(data):
        raise SessionError(f"session snapshot {path} is corrupt ({len(data) - 8 - n - end} unexpected trailing bytes)")
    try:
        meta = json.loads(meta_raw["session"])
        version = meta["version"]
    except (KeyError, TypeError, ValueError):
        raise SessionError(f"session snapshot {path} is corrupt (unreadable session record)") from None
    if version != FORMAT_VERSION:
        raise SessionError(f"session snapshot {path} has format version {version}; this quickdraft reads version "
                           f"{FORMAT_VERSION}; resume it with the quickdraft release that saved it")
    try:
        from safetensors.torch import load as load_tensors
        tensors = load_tensors(data)
    except Exception as exc:
        raise SessionError(f"session snapshot {path} is corrupt ({type(exc).__name__}: {exc})") from None
    if _checksum(meta_raw["session"], tensors) != meta_raw.get("checksum"):
        raise SessionError(f"session snapshot {path} is corrupt (checksum mismatch: the file was changed or damaged "
                           f"after it was saved); use an older copy or start a new session")
    return meta, tensors
