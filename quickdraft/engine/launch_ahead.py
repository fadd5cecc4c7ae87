"""Launch-ahead decoding: on a GPU, the next decode step is queued before this step's tokens reach the host.

A plain decode step (no drafts) of sequences whose tokens are decided on the device (greedy on the raw logits, or
sampled, with no grammar and no logprobs) takes its token ids from the previous step's decisions where they are, on
the device. While the host reads step t's tokens, commits, detokenizes and streams them, the device already runs
step t+1: the host's work between steps hides behind the device's, as in vLLM's async scheduling and SGLang's overlap
scheduler. The tokens are the same as without it: step t+1 is the step the host would have launched.

A sequence that step t ends (a stop token or string, a cancel, an abort) had step t+1 computed for nothing. That step
wrote the key of the sequence's last committed token, one position past what the engine otherwise keeps, so the
cache is never wrong; the blocks go back as usual. Whenever anything else must happen first (a waiting prompt the
scheduler could start now, a sequence that needs drafts, a grammar, logprobs or its last token, or KV blocks running short) the step in flight
lands: it is read and committed without launching another, and the engine's usual step runs next.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from quickdraft.engine.outputs import StreamChunk
from quickdraft.engine.sequence import Sequence
from quickdraft.engine.verify_step import launch
from quickdraft.errors import InvalidParameterError
from quickdraft.kv import ForwardItem
from quickdraft.speculative.drafters import Proposal

if TYPE_CHECKING:
    from quickdraft.engine.engine import LLMEngine

LAUNCH_AHEAD_MODES = ("auto", "on", "off")


def check_launch_ahead(mode: str) -> None:
    if mode not in LAUNCH_AHEAD_MODES:
        raise InvalidParameterError(f"launch_ahead must be one of {', '.join(LAUNCH_AHEAD_MODES)}, got {mode!r}")


class LaunchAhead:
    """The engine's launch-ahead state: the forward in flight (its sequences and their logits rows, unread)."""

    def __init__(self, engine: LLMEngine, mode: str) -> None:
        check_launch_ahead(mode)
        static = engine.target.static
        if mode == "on" and static is None:
            raise InvalidParameterError("launch_ahead='on' needs the target's static step (static_step='graphs' or "
                                        "'eager')")
        self.engine = engine
        # auto: where the device runs behind the host (replayed graphs); elsewhere a step's work is done by the time
        # its launch returns, and there is nothing to hide
        self.enabled = mode == "on" or (mode == "auto" and static is not None and static.graphs)
        self.in_flight: tuple[list[Sequence], list[torch.Tensor]] | None = None
        self.launches = 0  # forwards queued ahead of the previous step's read

    def starts(self, scheduled: list[tuple[Sequence, int]]) -> bool:
        """Whether this step (scheduled by the engine, nothing in flight) runs launching ahead."""
        if not self.enabled:  # the CPU's step (auto) asks nothing more
            return False
        seqs = [seq for seq, _ in scheduled]
        return (all(chunk == 1 and seq.kv["target"].num_cached + 1 == seq.num_tokens for seq, chunk in scheduled)
                and self._may_launch(seqs, positions=2))

    def start(self, seqs: list[Sequence]) -> list[StreamChunk]:
        """A decode step from the host's tokens, whose successor is launched before its own tokens are read."""
        items = [ForwardItem(seq.kv["target"], seq.token_ids[-1:], 1) for seq in seqs]
        return self._step(seqs, self.engine.target.forward(items, wait=False))

    def advance(self) -> list[StreamChunk] | None:
        """Decide the step in flight, launch its successor where nothing stands in the way, commit; None when no
        live sequence is in flight (the engine's usual step runs)."""
        if self.in_flight is None:
            return None
        seqs, rows = self.in_flight
        self.in_flight = None
        live = [(seq, row) for seq, row in zip(seqs, rows) if not seq.finished]  # cancelled or aborted meanwhile
        if not live:
            return None
        return self._step([seq for seq, _ in live], [row for _, row in live])

    def _step(self, seqs: list[Sequence], rows: list[torch.Tensor]) -> list[StreamChunk]:
        engine = self.engine
        no_drafts = Proposal([])
        decisions = launch([(seq, row, no_drafts) for seq, row in zip(seqs, rows)], engine._isolated,
                           host_greedy=False)
        launched, tokens = decisions.next_tokens()
        if tokens is not None and self._may_launch(launched, positions=1):
            decisions.start_copy()  # queued before the next forward: reading it does not wait for that forward
            items = [ForwardItem(seq.kv["target"], [0], 1) for seq in launched]  # ids come from ``tokens``
            self.in_flight = (launched, engine.target.forward(items, device_tokens=tokens, wait=False))
            self.launches += 1
        decided = decisions.read(engine._isolated)
        ahead = {id(seq) for seq in self.in_flight[0]} if self.in_flight is not None else set()
        for seq in seqs:
            if id(seq) in decided:
                engine._isolated(seq, engine._commit, seq, None, no_drafts, *decided[id(seq)], int(id(seq) in ahead))
        if self.in_flight is not None and all(seq.finished for seq in self.in_flight[0]):
            self.in_flight = None
        return engine._deliver(seqs)

    def _may_launch(self, seqs: list[Sequence], positions: int) -> bool:
        """Every sequence may have its next step queued before its current token is read, the static step has the
        bucket, and the free KV blocks hold ``positions`` more positions of each (the forwards not yet queued)."""
        engine, target = self.engine, self.engine.target
        if not (self.enabled and seqs and engine.drafter is None and not self._admits_waiting()
                and target.launches_ahead(len(seqs)) and all(self._takes(seq) for seq in seqs)):
            return False
        need = sum(target.blocks_for(seq.kv["target"], seq.kv["target"].num_cached + positions) for seq in seqs)
        return need <= target.allocator.num_free

    def _admits_waiting(self) -> bool:
        """A request waits and the scheduler could take it now (a free running slot): the step in flight lands so the
        next one schedules it. While every slot is taken a waiting request cannot start anyway, and launching ahead
        goes on."""
        scheduler = self.engine.scheduler
        return bool(scheduler.waiting) and len(scheduler.running) < scheduler.config.max_num_seqs

    def _takes(self, seq: Sequence) -> bool:
        """Its token is decided on the device from the raw step alone, it has room for one more after it, and it
        runs the base model (an adapter's step is not on the static step)."""
        params, processor = seq.params, seq.processor
        room = min(seq.max_model_len - seq.num_tokens - 1, params.max_tokens - seq.num_output_tokens - 1)
        return (processor.grammar is None and params.logprobs is None and not seq.keep_kv and room >= 1
                and not seq.kv["target"].adapter
                and (not params.greedy or processor.greedy_on_raw_logits)
                and seq.request_id not in self.engine._forks)
