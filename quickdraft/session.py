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
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from quickdraft.engine.build import LoadedEngine
from quickdraft.engine.outputs import RequestOutput, StreamChunk
from quickdraft.engine.sequence import CarriedState, Sequence, SpeculationState
from quickdraft.errors import InvalidParameterError, PromptTooLongError, RequestFailedError, SessionError
from quickdraft.kv import ModelRunner, SequenceKV
from quickdraft.loading.tensor_file import write_atomic
from quickdraft.sampling import SamplingParams
from quickdraft.sampling.sampler import make_generator
from quickdraft.snapshot import (FILE_MODE, FORMAT, FORMAT_VERSION, Turn, checksum, identity, max_snapshot_bytes,
                                 parse_snapshot, read_snapshot, restore_plan, runners_of)
from quickdraft.snapshot_checks import check_identity

Message = dict[str, Any]


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
        if self.kv["target"].adapter:
            raise SessionError("a session that runs LoRA adapters cannot be saved yet: its snapshot would not say "
                               "which")
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
        data = read_snapshot(path, max_snapshot_bytes(loaded))
        meta, tensors = parse_snapshot(data, path)
        check_identity(meta["identity"], identity(loaded), path)
        session = cls(loaded)
        restored, plan = restore_plan(loaded, meta, tensors, path)  # everything checked; nothing allocated yet
        session.history, session.spec, session.generator = restored.history, restored.spec, restored.generator
        session.interrupted, session.messages, session.turns = restored.interrupted, restored.messages, restored.turns
        for key, (runner, planes, n, ids) in plan.items():
            kv = SequenceKV(tokens=ids)
            if n:
                runner.swap_in(kv, (planes, n))
                runner.publish(kv, ids if ids is not None else session.history)
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
        if params.prompt_logprobs is not None:
            raise InvalidParameterError("prompt_logprobs is not available in a session (its earlier turns are cached, "
                                        "not recomputed); use LLM.generate")
        kv = self.loaded.engine.target.new_kv(params.lora)  # (an unknown adapter is refused here)
        if kv.adapter != self.kv["target"].adapter:
            if self.history:  # the cache holds the earlier turns' keys and values, computed with their adapters
                raise InvalidParameterError("lora: a session keeps the LoRA adapters (and scales) of its first turn; "
                                            "start another session for other ones")
            self.kv["target"] = kv
        return params

    def _runners(self) -> dict[str, ModelRunner]:
        return runners_of(self.loaded)

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
                               delivered_chars=turn.delivered_chars, mirostat_mu=turn.mirostat_mu)
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
            turn.mirostat_mu = None if seq.processor.mirostat is None else seq.processor.mirostat.mu
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
                tensors |= {f"kv.{key}.{plane}": t for plane, t in runner.gather(kv).items()}
            if n and kv.tokens is not None and len(kv.tokens) >= n:  # a draft of another vocabulary: its cache's ids
                tensors[f"kv.{key}.tokens"] = torch.tensor(kv.tokens[:n], dtype=torch.int64)
        meta = {
            "format": FORMAT, "version": FORMAT_VERSION,
            "identity": identity(self.loaded),
            "history": self.history, "cached": cached, "turns": self.turns,
            "interrupted": None if self.interrupted is None else self.interrupted.to_json(),
            "spec": dataclasses.asdict(self.spec),
            "messages": self.messages,
        }
        meta_json = json.dumps(meta, sort_keys=True)
        return tensors, {"format": FORMAT, "session": meta_json, "checksum": checksum(meta_json, tensors)}
