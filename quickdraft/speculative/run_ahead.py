"""Run-ahead drafting: the draft model drafts round t+1 while the target verifies round t (see RunAheadDrafter)."""
from __future__ import annotations

import contextlib
import logging
import threading
import weakref
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Sequence

import torch

from quickdraft.kv import ModelRunner
from quickdraft.speculative.drafters import DraftableSequence, ModelDrafter, Proposal
from quickdraft.speculative.vocab import CrossVocabulary, SharedVocabulary

log = logging.getLogger(__name__)


@dataclass
class _Ahead:
    """What the draft computed ahead, during the target pass of a round that drafted ``drafted`` tokens after
    ``base`` tokens: ``tokens[0]`` is its guess of the target's next (bonus) token, the rest would be the next
    round's drafts; the draft cache then holds ``cached`` tokens."""

    base: int
    drafted: int
    tokens: list[int]
    q: torch.Tensor | None
    cached: int


class RunAheadDrafter(ModelDrafter):
    """A model drafter that drafts round t+1 while the target verifies round t.

    The engine wraps its target forward in :meth:`running`: a background thread continues every drafting
    sequence's draft past the proposal being verified, assuming all of it is accepted. Its first token guesses
    the target's bonus token; the following ones are the next round's drafts. At the commit (:meth:`rewind`),
    a sequence that accepted every draft and whose new token equals the guess keeps the rest as the leading
    tokens of its next proposal, with the draft cache already holding them; any other outcome drops the
    speculative work and the draft cache rewinds to the committed prefix, as without run-ahead.

    Exactness: kept drafts are the ones plain drafting would produce from the same committed prefix (same
    draft model, same transforms, same position-keyed randomness, see :func:`draft_uniform`), and their q rows
    come along. Thread safety: the worker only touches the draft cache, the draft pool and the sequences'
    processors, and only between ``start`` and ``wait``, while the engine thread runs the target forward;
    :meth:`running` always waits for it before the engine commits, rewinds or releases anything.
    The worker stops before its next draft forward once the target pass is done (after ``min_steps``), so
    the engine waits at most about one draft step, and it skips cancelled requests.
    """

    def __init__(self, runner: ModelRunner, target_vocab: int, name: str = "draft", min_steps: int = 2,
                 vocab: SharedVocabulary | CrossVocabulary | None = None) -> None:
        super().__init__(runner, target_vocab, name, vocab)
        self.min_steps = min_steps  # the guess plus one draft, even if the target pass finished first
        self._executor: ThreadPoolExecutor | None = None
        self._job: Future | None = None
        self._target_done = threading.Event()
        self._ahead: dict[int, tuple[DraftableSequence, _Ahead]] = {}  # by id(seq), until its round commits
        # kept run-ahead, by sequence, until its next proposal (weak: an abandoned sequence leaves nothing)
        self._ready: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.last_depth: int | None = None  # tokens past the guess the last run-ahead drafted (None: none ran)
        self.rounds_ahead = self.rounds_kept = self.tokens_reused = 0

    def run_ahead_depth(self) -> int | None:
        return self.last_depth

    # ---- the overlap -------------------------------------------------------------------------------
    @contextlib.contextmanager
    def running(self, seqs: Sequence[DraftableSequence], proposals: Sequence[Proposal]) -> Iterator[None]:
        """Draft ahead in the background while the body (the target forward) runs; waits for it on exit."""
        self.start(seqs, proposals)
        try:
            yield
        except BaseException:
            self.wait(discard=True)
            raise
        self.wait()

    def start(self, seqs: Sequence[DraftableSequence], proposals: Sequence[Proposal]) -> None:
        self._ahead.clear()
        self.last_depth = None
        jobs, ks = [], []
        for seq, p in zip(seqs, proposals):
            k = len(p.tokens)
            if not k or self.cancelled(seq):
                continue
            # if all k are accepted the sequence has n + k + 1 tokens and the next round may draft up to k again
            n = len(seq.token_ids) + k + 1
            room = min(seq.max_model_len - n - 1, seq.params.max_tokens - (n - len(seq.prompt_ids)) - 1)
            if room > 0:
                jobs.append((seq, p))
                ks.append(k + 1 + min(k, room))
        if not jobs:
            return
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"quickdraft-{self.name}-ahead")
        self._target_done.clear()
        self._job = self._executor.submit(self._run_ahead, [s for s, _ in jobs], ks, [p for _, p in jobs])

    def _run_ahead(self, seqs, ks, proposals) -> tuple[list, int]:
        out, steps = self._draft(seqs, ks, proposals,
                                 stop=lambda done: done >= self.min_steps and self._target_done.is_set())
        return [(seq, _Ahead(len(seq.token_ids), len(p.tokens), o.tokens[len(p.tokens):],
                             None if o.q is None else o.q[len(p.tokens):], self._kv(seq).num_cached))
                for seq, p, o in zip(seqs, proposals, out)], steps

    def wait(self, discard: bool = False) -> None:
        """Tell the worker the target pass is done and wait for its current draft step."""
        job, self._job = self._job, None
        if job is None:
            return
        self._target_done.set()
        try:
            results, steps = job.result()
        except Exception as exc:  # run-ahead is only ever ahead of need: drop it, never the step or its requests
            if not discard:
                log.warning("run-ahead drafting failed, dropped for this round: %s", exc)
            return
        if discard:
            return
        self.rounds_ahead += 1
        self.last_depth = max(0, steps - 1)
        self._ahead = {id(seq): (seq, ahead) for seq, ahead in results}

    # ---- the drafter protocol ------------------------------------------------------------------------
    def propose(self, seqs: Sequence[DraftableSequence], ks: Sequence[int]) -> list[Proposal]:
        starts = []
        for seq, k in zip(seqs, ks):
            ready = self._ready.pop(seq, None)
            kv = seq.kv.get(self.key)
            committed = len(seq.token_ids)
            held = len(self.vocab.view(seq))  # the draft cache's length for the committed tokens, in draft ids
            start, length = Proposal([]), max(0, held - 1)
            if (ready is not None and k > 0 and kv is not None and ready.base == committed
                    and kv.num_cached == held - 1 and len(kv.block_table) * self.runner.block_size >= ready.cached):
                n = min(k, len(ready.tokens))
                start = Proposal(ready.tokens[:n], None if ready.q is None else ready.q[:n], reused=n)
                length = min(ready.cached, held + n - 1)
                kv.reveal(length, self.runner.block_size)  # the run-ahead tokens, hidden since the commit
                self.rounds_kept += 1
                self.tokens_reused += n
            if kv is not None:  # give back what is not used (run-ahead beyond the proposal, or all of it)
                self.runner.truncate(kv, min(kv.num_cached, length))
            starts.append(start)
        self.last_forward_costs = []
        proposals, _ = self._draft(seqs, ks, starts, timings=self.last_forward_costs)
        return proposals

    def rewind(self, seq: DraftableSequence) -> None:
        """After the commit: keep the run-ahead if the round went as it assumed, else drop it and rewind."""
        self._ready.pop(seq, None)
        _, ahead = self._ahead.pop(id(seq), (None, None))
        kv = seq.kv.get(self.key)
        committed = len(seq.token_ids)
        view = self.vocab.view(seq)
        if (ahead is not None and kv is not None and not seq.finished and len(ahead.tokens) > 1
                and committed == ahead.base + ahead.drafted + 1 and seq.token_ids[-1] == ahead.tokens[0]
                and kv.num_cached == ahead.cached and self.vocab.can_draft(seq)
                and self.vocab.agree(kv, view) >= len(view)):
            # everything drafted was accepted and the target's token is the guess: keep the rest. Until the
            # next proposal takes them, the cache reports only the committed prefix (its blocks stay), so
            # whoever looks at it meanwhile (a session snapshot, the prefix cache) sees committed tokens only.
            self._ready[seq] = _Ahead(committed, 0, ahead.tokens[1:], None if ahead.q is None else ahead.q[1:],
                                      ahead.cached)
            kv.hide(len(view) - 1)
            self.runner.publish(kv, view)
            return
        super().rewind(seq)

    def release(self, seq: DraftableSequence) -> None:
        self._ready.pop(seq, None)
        self._ahead.pop(id(seq), None)
        super().release(seq)
