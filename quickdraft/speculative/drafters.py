"""Drafters propose tokens the target then verifies in one forward pass.

Every drafter answers the same question: given running sequences and a length
k for each, propose up to k tokens per sequence, plus the draft's probability
rows q when the drafter samples (a draft model at temperature > 0).
Deterministic drafters return no q; the verifier treats them as one-hot.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import numpy as np
import torch

from quickdraft.kv import ForwardItem, ModelRunner, OutOfBlocks, SequenceKV
from quickdraft.sampling import LogitsProcessor, SamplingParams
from quickdraft.sampling.sampler import sample


class DraftableSequence(Protocol):
    """What a drafter reads from a sequence (the engine's Sequence satisfies it)."""

    token_ids: list[int]
    kv: dict[str, SequenceKV]
    params: SamplingParams
    processor: LogitsProcessor
    generator: torch.Generator


@dataclass
class Proposal:
    tokens: list[int]
    q: torch.Tensor | None = None  # [len(tokens), target_vocab] draft probabilities, None when deterministic


class Drafter(Protocol):
    name: str

    def propose(self, seqs: Sequence[DraftableSequence], ks: Sequence[int]) -> list[Proposal]: ...

    def rewind(self, seq: DraftableSequence) -> None: ...

    def release(self, seq: DraftableSequence) -> None: ...


class NgramDrafter:
    """Prompt lookup: find the latest earlier occurrence of the last n tokens and propose what followed."""

    name = "ngram"

    def __init__(self, max_ngram: int = 4, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def lookup(self, tokens: Sequence[int], k: int) -> list[int]:
        if k <= 0:
            return []
        arr = np.asarray(tokens, dtype=np.int64)
        for n in range(min(self.max_ngram, len(arr) - 1), self.min_ngram - 1, -1):
            pattern = arr[-n:]
            windows = np.lib.stride_tricks.sliding_window_view(arr[:-1], n)
            starts = np.flatnonzero((windows == pattern).all(axis=1))
            if len(starts):
                follow = starts[-1] + n
                return arr[follow:follow + k].tolist()
        return []

    def propose(self, seqs: Sequence[DraftableSequence], ks: Sequence[int]) -> list[Proposal]:
        return [Proposal(self.lookup(s.token_ids, k)) for s, k in zip(seqs, ks)]

    def rewind(self, seq: DraftableSequence) -> None:
        pass

    def release(self, seq: DraftableSequence) -> None:
        pass


class ModelDrafter:
    """A smaller model (or the target's first layers) with its own paged KV cache.

    The draft cache keeps every committed token it has seen; after a round it is
    truncated to the committed prefix and only the tokens it has not seen are fed
    next time, so nothing is ever re-prefilled.
    """

    def __init__(self, runner: ModelRunner, target_vocab: int, name: str = "draft") -> None:
        self.runner, self.target_vocab, self.name = runner, target_vocab, name
        self.key = f"draft:{runner.name}"

    def _kv(self, seq: DraftableSequence) -> SequenceKV:
        return seq.kv.setdefault(self.key, SequenceKV())

    def _widen(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft logits over the target's vocabulary (padding rows differ between checkpoints)."""
        width = logits.shape[-1]
        if width == self.target_vocab:
            return logits
        if width > self.target_vocab:
            return logits[..., : self.target_vocab]
        pad = logits.new_full((*logits.shape[:-1], self.target_vocab - width), float("-inf"))
        return torch.cat([logits, pad], dim=-1)

    def propose(self, seqs: Sequence[DraftableSequence], ks: Sequence[int]) -> list[Proposal]:
        drafts: list[list[int]] = [[] for _ in seqs]
        qs: list[list[torch.Tensor]] = [[] for _ in seqs]
        active = [i for i, k in enumerate(ks) if k > 0]
        for step in range(max(ks, default=0)):
            active = [i for i in active if ks[i] > step]
            items, owners = [], []
            for i in active:
                kv = self._kv(seqs[i])
                context = seqs[i].token_ids + drafts[i]
                if not kv.block_table:
                    self.runner.match_prefix(kv, context)
                items.append(ForwardItem(kv, context[kv.num_cached:], 1))
                owners.append(i)
            if not items:
                break
            try:
                rows = self.runner.forward(items)
            except OutOfBlocks:  # no room in the draft pool: verify what we have
                break
            for i, row in zip(owners, rows):
                seq = seqs[i]
                logits = seq.processor.process(self._widen(row), drafted=drafts[i], offset=len(drafts[i]))
                if seq.params.greedy:
                    token = int(logits[0].argmax())
                else:
                    q = torch.softmax(logits, dim=-1)
                    token = int(sample(q, seq.generator)[0])
                    qs[i].append(q[0])
                drafts[i].append(token)
        return [Proposal(d, torch.stack(q) if q else None) for d, q in zip(drafts, qs)]

    def rewind(self, seq: DraftableSequence) -> None:
        kv = seq.kv.get(self.key)
        if kv is not None:
            self.runner.truncate(kv, min(kv.num_cached, len(seq.token_ids) - 1))
            self.runner.publish(kv, seq.token_ids)

    def release(self, seq: DraftableSequence) -> None:
        kv = seq.kv.pop(self.key, None)
        if kv is not None:
            self.runner.free(kv)
