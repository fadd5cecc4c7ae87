"""Continuous batching: which sequences run in the next step, and with how many new tokens.

Running sequences go first (one decode token each, or the next chunk of a long
prompt); waiting ones are admitted while the step's token budget, the running
limit and the free KV blocks allow. When blocks run out, the lowest-ranked
running sequence is preempted: its KV is dropped and it waits to be recomputed,
keeping every token it has committed, so its output does not change.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from quickdraft.engine.sequence import Sequence, Status
from quickdraft.errors import InvalidParameterError
from quickdraft.kv import ModelRunner, SequenceKV, prefill_chunk
from quickdraft.kv.attention import PREFILL_CELL

POLICIES = ("fcfs", "sjf", "priority", "deadline")


def policy_key(policy: str) -> Callable[[Sequence], tuple]:
    """Smaller key runs first and is preempted last."""
    if policy == "fcfs":
        return lambda s: (s.arrival_s,)
    if policy == "sjf":
        return lambda s: (len(s.prompt_ids) + s.params.max_tokens, s.arrival_s)
    if policy == "priority":
        return lambda s: (s.params.priority, s.arrival_s)
    if policy == "deadline":
        return lambda s: (s.params.deadline_s if s.params.deadline_s is not None else math.inf, s.arrival_s)
    raise InvalidParameterError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 512  # per-step token budget; long prompts are prefilled in chunks of this size
    policy: str = "fcfs"
    preemption: str = "recompute"  # or "swap": keep the preempted KV in host memory
    # prompt tokens a step takes while other sequences decode: each of their tokens waits for the whole step, so a
    # long prompt is taken in smaller chunks while anyone is streaming (None: max_num_batched_tokens)
    prefill_tokens_while_decoding: int | None = None

    def __post_init__(self) -> None:
        policy_key(self.policy)
        if self.max_num_seqs < 1:
            raise InvalidParameterError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.preemption not in ("recompute", "swap"):
            raise InvalidParameterError(f"preemption must be 'recompute' or 'swap', got {self.preemption!r}")
        if self.max_num_batched_tokens < 1:
            raise InvalidParameterError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        limit = self.prefill_tokens_while_decoding
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < PREFILL_CELL):
            # below one cell a prompt that starts at a cell boundary could never be given a chunk
            raise InvalidParameterError(f"prefill_tokens_while_decoding must be an int >= {PREFILL_CELL} or None, "
                                        f"got {limit!r}")


class Scheduler:
    def __init__(self, config: SchedulerConfig, target: ModelRunner, on_preempt: Callable[[Sequence], None]) -> None:
        self.config = config
        self.target = target
        self.key = policy_key(config.policy)
        self.on_preempt = on_preempt
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        for queue in (self.waiting, self.running):
            if seq in queue:
                queue.remove(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, draft_room: int) -> list[tuple[Sequence, int]]:
        """Pick (sequence, new tokens) pairs for one step; ``draft_room`` extra slots are kept for drafts."""
        budget = self.config.max_num_batched_tokens
        free = self.target.allocator.num_free
        scheduled: list[tuple[Sequence, int]] = []
        self.running.sort(key=self.key)
        decoding = any(s.num_tokens - s.kv["target"].num_cached <= 1 for s in self.running)
        prompt_budget = self.config.prefill_tokens_while_decoding if decoding else None
        prompt_budget = budget if prompt_budget is None else min(budget, prompt_budget)
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            kv = seq.kv["target"]
            pending = seq.num_tokens - kv.num_cached
            chunk = self._chunk(kv.num_cached, pending, budget if pending <= 1 else min(budget, prompt_budget))
            if chunk == 0:  # its next prompt piece does not fit in what is left of this step
                i += 1
                continue
            need = self.target.blocks_for(kv, kv.num_cached + chunk + draft_room)
            while need > free and self.running[-1] is not seq:
                free += self._preempt(self.running[-1])
            if need > free:  # even alone it does not fit now; it waits for blocks
                free += self._preempt(seq)
                continue
            free -= need
            budget -= chunk
            prompt_budget -= chunk if pending > 1 else 0
            scheduled.append((seq, chunk))
            i += 1
        self.waiting.sort(key=self.key)
        retried = False
        while self.waiting and min(budget, prompt_budget) > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            kv = seq.kv.setdefault("target", SequenceKV())
            cached = seq.swapped[1] if seq.swapped is not None else kv.num_cached
            if cached == 0 and not seq.scores_prompt:  # cached prefix blocks leave the free list as they are taken
                before = self.target.allocator.num_free
                cached = self.target.match_prefix(kv, seq.token_ids)
                free -= before - self.target.allocator.num_free
            if seq.metrics.cached_tokens is None:  # a preempted sequence's recompute is not a cache hit
                seq.metrics.cached_tokens = min(cached, len(seq.prompt_ids))
            chunk = self._chunk(cached, seq.num_tokens - cached, min(budget, prompt_budget))
            if chunk == 0:
                break
            need = self.target.blocks_for(kv, cached + chunk + draft_room) if seq.swapped is None else \
                -(-(cached + chunk + draft_room) // self.target.block_size)
            if need > free:
                # blocks a waiting sequence holds may be promised to running ones: give them all back;
                # its prefix stays cached and is matched again on the one retry
                released = self._release_waiting()
                if retried or not released:
                    break
                free += released
                retried = True
                continue
            if seq.swapped is not None:
                self.target.swap_in(kv, seq.swapped)
                seq.swapped = None
            free -= need
            budget -= chunk
            prompt_budget -= chunk
            self.waiting.pop(0)
            seq.status = Status.RUNNING
            self.running.append(seq)
            scheduled.append((seq, chunk))
        return scheduled

    def _chunk(self, cached: int, pending: int, budget: int) -> int:
        """Prompt chunks end at cell boundaries so each token is computed the same way in any batch
        (see quickdraft.kv.attention.PREFILL_CELL); a step with its whole budget free always makes progress."""
        chunk = prefill_chunk(cached, pending, budget)
        full = budget in (self.config.max_num_batched_tokens, self.config.prefill_tokens_while_decoding)
        return chunk or (min(pending, budget) if full else 0)

    def _release_waiting(self) -> int:
        """Waiting sequences give back blocks they hold (matched prefixes, forked samples), so they can
        never keep the running ones from progressing; returns the blocks freed."""
        before = self.target.allocator.num_free
        for seq in self.waiting:
            kv = seq.kv.get("target")
            if kv is not None and kv.block_table:
                self.target.free(kv)
        return self.target.allocator.num_free - before

    def _preempt(self, seq: Sequence) -> int:
        """Drop a running sequence's KV (recompute later); returns the blocks freed."""
        before = self.target.allocator.num_free
        self.running.remove(seq)
        if self.config.preemption == "swap":
            seq.swapped = self.target.swap_out(seq.kv["target"])
        self.on_preempt(seq)
        seq.status = Status.WAITING
        self.waiting.append(seq)
        self.num_preemptions += 1
        return self.target.allocator.num_free - before

