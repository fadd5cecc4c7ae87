"""Drafters propose tokens the target then verifies in one forward pass.

Every drafter answers the same question: given running sequences and a length
k for each, propose up to k tokens per sequence, plus the draft's probability
rows q when the drafter samples (a draft model at temperature > 0).
Deterministic drafters return no q; the verifier treats them as one-hot.
"""
from __future__ import annotations

import contextlib
import hashlib
import struct
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

from quickdraft.kv import ForwardItem, ModelRunner, OutOfBlocks, SequenceKV
from quickdraft.models import weight_bytes
from quickdraft.sampling import LogitsProcessor, SamplingParams
from quickdraft.sampling.sampler import NOT_A_DISTRIBUTION, draw, greedy, to_device
from quickdraft.speculative.vocab import CrossVocabulary, SharedVocabulary


class DraftableSequence(Protocol):
    """What a drafter reads from a sequence (the engine's Sequence satisfies it)."""

    token_ids: list[int]
    prompt_ids: list[int]
    max_model_len: int
    kv: dict[str, SequenceKV]
    params: SamplingParams
    processor: LogitsProcessor
    generator: torch.Generator
    draft_nonce: int  # keys the draft's uniforms: the seed for seeded requests, else random per request
    finished: bool


@dataclass
class Proposal:
    tokens: list[int]
    q: torch.Tensor | None = None  # [len(tokens), target_vocab] draft probabilities, None when deterministic
    reused: int = 0  # leading tokens that were drafted ahead, during the previous round's target pass
    forced: int = 0  # trailing tokens the request's grammar forces (not drafted: counted apart from acceptance)

    @property
    def drafted(self) -> int:
        return len(self.tokens) - self.forced


_DRAFT_KEY = b"quickdraft.draft"


def draft_uniform(seed: int, position: int) -> float:
    """The uniform in [0, 1) a model drafter samples the draft token at ``position`` with.

    Draft randomness is keyed by (the sequence's nonce, position) instead of drawn from the verifier's
    generator: a draft is then the same function of its prefix whichever thread computes it, in which round,
    and however far the run-ahead got, so seeded requests give the same tokens with and without run-ahead and
    whatever the timing. It stays exact: the uniform of a position only ever decides the draft at that
    position, which is verified (and committed) at most once, independently of the target's own generator.
    """
    digest = hashlib.blake2b(struct.pack("<QQ", seed % 2**64, position), digest_size=8, key=_DRAFT_KEY).digest()
    return (int.from_bytes(digest, "little") >> 11) * 2.0**-53


def draft_tokens(logits: torch.Tensor, uniforms: Sequence[float | None]) -> tuple[list[int | None],
                                                                                   list[torch.Tensor | None]]:
    """One draft step's tokens for processed logits ``[n, V]``: row i greedy where ``uniforms[i]`` is None, else
    drawn from its softmax with that uniform (its q row returned too). None for a row with no finite logit. On a GPU
    the whole step's decisions come back in one copy (was two waits per sequence); on the CPU greedy rows use
    quickdraft's argmax kernel. A sampled row that is no distribution raises, as ``sample_with_uniforms`` does."""
    n = logits.shape[0]
    finite = torch.isfinite(logits).any(dim=-1)
    picked = torch.zeros(n, dtype=torch.int64, device=logits.device)
    valid = torch.ones(n, dtype=torch.bool, device=logits.device)
    q_rows: list[torch.Tensor | None] = [None] * n
    sampled = [j for j, u in enumerate(uniforms) if u is not None]
    if sampled:
        index = to_device(torch.tensor(sampled), logits.device)  # (a list index would be a waiting copy on a GPU)
        q = torch.softmax(logits[index], dim=-1)
        drawn, ok = draw(q, to_device(torch.tensor([uniforms[j] for j in sampled], dtype=torch.float64), logits.device))
        picked[index], valid[index] = drawn, ok
        for j, row in zip(sampled, q.unbind(0)):
            q_rows[j] = row
    greedy_rows = [j for j, u in enumerate(uniforms) if u is None]
    on_host = logits.device.type == "cpu"
    if greedy_rows and not on_host:
        rows = to_device(torch.tensor(greedy_rows), logits.device)
        picked[rows] = logits[rows].argmax(dim=-1)
    finite_l, picked_l, valid_l = torch.stack([finite.long(), picked, valid.long()]).tolist()
    if greedy_rows and on_host:
        for j, token in zip(greedy_rows, greedy(logits[greedy_rows])):
            picked_l[j] = token
    if any(f and not v for f, v in zip(finite_l, valid_l)):
        raise ValueError(NOT_A_DISTRIBUTION)
    return [t if f else None for t, f in zip(picked_l, finite_l)], q_rows


class Drafter:
    """Everything the engine asks of a drafter, with the answers of one that runs no model (n-gram lookup).

    The engine never asks what kind of drafter it holds: a new drafter overrides ``propose`` and whichever of
    these it needs, and the engine, controller and sessions work with it unchanged."""

    name = "drafter"
    runner: ModelRunner | None = None  # the draft model's runner and KV pool; None: drafting runs no model
    key: str | None = None  # the drafter's entry in ``Sequence.kv`` when it keeps a cache per sequence

    def propose(self, seqs: Sequence[DraftableSequence], ks: Sequence[int]) -> list[Proposal]:
        """Up to ``ks[i]`` tokens for ``seqs[i]`` (one proposal per sequence)."""
        raise NotImplementedError

    def rewind(self, seq: DraftableSequence) -> None:
        """After a commit: drop what the drafter holds beyond the committed tokens."""

    def release(self, seq: DraftableSequence) -> None:
        """The sequence is done (or decodes without drafts from now on): free what the drafter holds for it."""

    def lag(self, seq: DraftableSequence) -> int:
        """Tokens the drafter must take in before it can draft for ``seq`` (its catch-up)."""
        return 0

    def forecast(self, seqs: Sequence[DraftableSequence]) -> list[float | None]:
        """Per-token acceptance this drafter expects of each sequence's next round, asked once per step before
        ``lag`` and ``propose``; None: the controller goes by the sequence's own history."""
        return [None] * len(seqs)

    @property
    def is_free(self) -> bool:
        """Drafting costs no model pass, so only verification is priced."""
        return self.runner is None

    def step_bytes(self) -> int:
        """Weight bytes one draft step reads: what a draft costs beside a target step, by bytes."""
        return 0

    def forward_costs(self) -> list[tuple[int, int, float]]:
        """(sequences, tokens fed, seconds) of each model forward of the last ``propose``, for the cost model."""
        return []

    def bind_cancelled(self, cancelled: Callable[[DraftableSequence], bool]) -> None:
        """Learn which sequences were cancelled (from any thread), so no more draft work is spent on them."""

    @contextlib.contextmanager
    def running(self, seqs: Sequence[DraftableSequence], proposals: Sequence[Proposal]) -> Iterator[None]:
        """Wraps the target pass: a drafter that can work during it (run-ahead) does so here."""
        yield

    def run_ahead_depth(self) -> int | None:
        """Tokens past the bonus guess the last ``running`` drafted, if it ran."""
        return None


class NgramIndex:
    """Where each n-gram of a growing token list last occurred: the index that followed it, per n-gram size.

    Each token is taken in once, as the list grows, so a lookup costs the same at any context length, where a scan of
    the whole context every step grows with it (a sequence's step, every step). The lookup is the scan's: the latest
    earlier occurrence of the list's last n tokens, largest n first. A list replaced or cut is read again from its
    start; a token changed in place is not noticed (a sequence's tokens only grow), and a stale entry could only make
    a worse draft, never a wrong token (drafts are verified). Token ids are ints in [0, 2^32): a key packs n of them
    into one int, 32 bits each.
    It holds a few hundred bytes a token, beside the tens of kilobytes a token of even a small model's KV cache."""

    def __init__(self, min_ngram: int, max_ngram: int) -> None:
        self.min_ngram, self.max_ngram = min_ngram, max_ngram
        self.follow: list[dict[int, int]] = [{} for _ in range(max_ngram + 1)]  # [n]: key of n tokens -> index after
        self.tokens: list[int] | None = None
        self.seen, self.last = 0, -1

    def update(self, tokens: list[int]) -> None:
        if tokens is not self.tokens or len(tokens) < self.seen or (self.seen and tokens[self.seen - 1] != self.last):
            self.follow = [{} for _ in range(self.max_ngram + 1)]
            self.tokens, self.seen = tokens, 0
        for i in range(max(self.seen, 1), len(tokens)):  # i follows the n-grams that end at i - 1
            key = 0
            for n in range(1, min(self.max_ngram, i) + 1):
                key |= tokens[i - n] << (32 * (n - 1))
                if n >= self.min_ngram:
                    self.follow[n][key] = i
        self.seen, self.last = len(tokens), tokens[-1] if tokens else -1

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        """What followed the latest earlier occurrence of ``tokens``' last n tokens (up to k of them)."""
        self.update(tokens)
        if k <= 0:
            return []
        end = len(tokens)
        key = 0
        found = None
        for n in range(1, min(self.max_ngram, end - 1) + 1):  # smallest n first: each key extends the last
            key |= tokens[end - n] << (32 * (n - 1))
            if n >= self.min_ngram:
                follow = self.follow[n].get(key)
                if follow is None:
                    break  # no longer n-gram can occur where this one did not
                found = follow
        return [] if found is None else tokens[found:found + k]


class NgramDrafter(Drafter):
    """Prompt lookup: find the latest earlier occurrence of the last n tokens and propose what followed."""

    name = "ngram"

    def __init__(self, max_ngram: int = 4, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self._indexes: dict[int, NgramIndex] = {}  # id(sequence) -> its index, dropped by release()

    def propose(self, seqs: Sequence[DraftableSequence], ks: Sequence[int]) -> list[Proposal]:
        return [Proposal(self._index(s).lookup(s.token_ids, k)) for s, k in zip(seqs, ks)]

    def _index(self, seq: DraftableSequence) -> NgramIndex:
        index = self._indexes.get(id(seq))
        if index is None:
            index = self._indexes[id(seq)] = NgramIndex(self.min_ngram, self.max_ngram)
            with contextlib.suppress(TypeError):  # gone with its sequence, if release() never comes
                weakref.finalize(seq, self._indexes.pop, id(seq), None)
        return index

    def release(self, seq: DraftableSequence) -> None:
        self._indexes.pop(id(seq), None)


class ModelDrafter(Drafter):
    """A smaller model (or the target's first layers) with its own paged KV cache.

    The draft cache keeps every committed token it has seen; after a round it is
    truncated to the committed prefix and only the tokens it has not seen are fed
    next time, so nothing is ever re-prefilled.
    """

    def __init__(self, runner: ModelRunner, target_vocab: int, name: str = "draft",
                 vocab: SharedVocabulary | CrossVocabulary | None = None) -> None:
        self.runner, self.target_vocab, self.name = runner, target_vocab, name
        # the target's own vocabulary, or another one bridged over the tokens both share (speculative/vocab.py)
        self.vocab = vocab or SharedVocabulary(target_vocab)
        self.key = f"draft:{runner.name}"
        # set by the engine: a sequence whose request was cancelled gets no further draft forwards (any thread)
        self.cancelled: Callable[[DraftableSequence], bool] = lambda seq: False
        # (sequences, tokens fed, seconds) of each draft forward of the last propose(): what the cost model learns
        # from, a forward that fed every sequence one token as a draft step, one that caught a cache up (its prompt,
        # or tokens generated while speculation was off) as the price of a catch-up
        self.last_forward_costs: list[tuple[int, int, float]] = []

    def bind_cancelled(self, cancelled: Callable[[DraftableSequence], bool]) -> None:
        self.cancelled = cancelled

    def forward_costs(self) -> list[tuple[int, int, float]]:
        return self.last_forward_costs

    def step_bytes(self) -> int:
        runner = self.runner
        return weight_bytes(runner.model.model.layers[0]) * runner.num_layers + weight_bytes(runner.model.lm_head)

    def _kv(self, seq: DraftableSequence) -> SequenceKV:
        return seq.kv.setdefault(self.key, SequenceKV())

    def lag(self, seq: DraftableSequence) -> int:
        """Tokens the draft cache must take in before it can draft for ``seq``."""
        kv = seq.kv.get(self.key)
        context = self.vocab.view(seq)
        return len(context) - 1 - (min(kv.num_cached, self.vocab.agree(kv, context)) if kv is not None else 0)

    def propose(self, seqs: Sequence[DraftableSequence], ks: Sequence[int]) -> list[Proposal]:
        self.last_forward_costs = []
        proposals, _ = self._draft(seqs, ks, timings=self.last_forward_costs)
        return proposals

    def _draft(self, seqs: Sequence[DraftableSequence], ks: Sequence[int], starts: Sequence[Proposal] | None = None,
               stop: Callable[[int], bool] | None = None, timings: list[tuple[int, int, float]] | None = None
               ) -> tuple[list[Proposal], int]:
        """Extend each sequence's draft (``starts``, default empty) to ``ks`` tokens with batched draft forwards,
        each feeding only the tokens the draft cache has not seen. ``stop(steps_done)`` ends drafting early;
        ``timings`` gets (sequences, tokens fed, seconds) of every forward.
        Returns the proposals (starts included) and the number of forwards run."""
        starts = starts or [Proposal([]) for _ in seqs]
        drafts: list[list[int]] = [list(p.tokens) for p in starts]
        qs: list[list[torch.Tensor]] = [list(p.q.unbind(0)) if p.q is not None else [] for p in starts]
        steps = 0
        ended: set[int] = set()  # sequences whose grammar allows nothing the draft can write
        while stop is None or not stop(steps):
            # a draft past the draft model's positions (its view can be longer than the target's tokens) stops
            limit = self.runner.model.max_positions
            active = [i for i, (seq, k) in enumerate(zip(seqs, ks))
                      if len(drafts[i]) < k and i not in ended and not self.cancelled(seq) and self.vocab.can_draft(seq)
                      and len(self.vocab.view(seq)) + len(drafts[i]) < limit]
            if not active:
                break
            t0 = time.perf_counter()
            items, contexts = [], []
            for i in active:
                kv = self._kv(seqs[i])
                context = self.vocab.view(seqs[i]) + self.vocab.to_draft(drafts[i])
                if not kv.block_table:
                    self.runner.match_prefix(kv, context)
                    self.vocab.record(kv, context)  # a prefix-cache hit holds these ids: its block hashes say so
                agreed = min(self.vocab.agree(kv, context), len(context) - 1)
                if agreed < kv.num_cached:  # the re-encoded text changed below what the cache holds
                    self.runner.truncate(kv, agreed)
                items.append(ForwardItem(kv, context[kv.num_cached:], 1))
                contexts.append(context)
            try:
                rows = self.runner.forward(items)
            except OutOfBlocks:  # no room in the draft pool: verify what we have
                break
            steps += 1
            for item, context in zip(items, contexts):
                self.vocab.record(item.kv, context)
            logits = torch.cat([seqs[i].processor.process(self.vocab.widen(row), drafted=drafts[i],
                                                          offset=len(drafts[i]), draft=True)[:1]
                                for i, row in zip(active, rows)])
            uniforms = [None if seqs[i].params.greedy else
                        draft_uniform(seqs[i].draft_nonce, len(seqs[i].token_ids) + len(drafts[i])) for i in active]
            tokens, q_rows = draft_tokens(logits, uniforms)
            for i, token, q in zip(active, tokens, q_rows):
                if token is None:  # no finite logit: e.g. the grammar wants a token outside a cross vocabulary
                    ended.add(i)
                    continue
                if q is not None:
                    qs[i].append(q)
                drafts[i].append(token)
            if timings is not None:
                timings.append((len(items), sum(len(item.tokens) for item in items), time.perf_counter() - t0))
        return [Proposal(d, torch.stack(q) if q else None, reused=start.reused)
                for d, q, start in zip(drafts, qs, starts)], steps

    def rewind(self, seq: DraftableSequence) -> None:
        kv = seq.kv.get(self.key)
        if kv is not None:
            context = self.vocab.view(seq)
            self.runner.truncate(kv, max(0, min(kv.num_cached, len(context) - 1, self.vocab.agree(kv, context))))
            self.runner.publish(kv, context)

    def release(self, seq: DraftableSequence) -> None:
        self.vocab.forget(seq)
        kv = seq.kv.pop(self.key, None)
        if kv is not None:
            self.runner.free(kv)
