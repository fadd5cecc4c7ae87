"""Suffix decoding (SuffixDecoding, arXiv 2411.04975): draft what most often followed the longest earlier match of
the text's end, in the request's own prompt and output and in the outputs of earlier requests.

Agent loops and edit-and-resend workloads repeat earlier *outputs* (file contents, diffs, tool calls), which prompt
lookup cannot see. The match is searched in two token streams:

- the request's own tokens (prompt and output so far);
- a cache of the outputs of earlier requests (``scope="global"``), bounded in tokens, least recently used first out.

Each stream is an implicit suffix tree: the occurrences of the longest suffix of the context (up to ``max_match``
tokens) are found by narrowing the positions of its last token one token back at a time, and the draft walks the
tree's most frequent branch from there, counting the following tokens of every occurrence that still matches.
It stops where the walk's estimated probability (the product of each step's share of occurrences) falls below
``min_prob`` or past ``spec_factor`` tokens per matched token, so a long, unanimous match drafts many tokens and a
short or ambiguous one few. A stream costs 4 bytes a token, where an explicit tree of Python nodes costs hundreds
of bytes per token and depth; the search reads the cache once per round (vectorised).

Drafts from other requests' outputs change only how fast a request runs, never its tokens (verification is
exact), but the speed is observable: see docs/SPECULATION.md, "Suffix decoding", for the timing side channel and
``scope="request"``.
"""
from __future__ import annotations

import weakref
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import Sequence

import numpy as np

from quickdraft.errors import InvalidParameterError
from quickdraft.speculative.controller import AcceptanceCounts
from quickdraft.speculative.drafters import DraftableSequence, Drafter, ModelDrafter, Proposal

SCOPES = ("request", "global")
DEFAULT_CACHE_TOKENS = 1 << 18  # 2 MiB (8 bytes a token: the outputs and their stream), a few hundred answers
MAX_CACHE_TOKENS = 1 << 24
MIN_OUTPUT_TOKENS = 8  # shorter outputs draft nothing worth their place (and a flood of them would crowd the cache)
# occurrences a match keeps after its first narrowing step (the latest): a text of one repeated token matches
# everywhere, and every round of every sequence would pay for all of them
MAX_OCCURRENCES = 4096
_GAP = -1  # between two outputs in the cache stream: never equal to a token, so no match crosses it


@dataclass
class SuffixDraft:
    """What a match proposes, and how much it is worth."""

    tokens: list[int]
    score: float  # expected accepted tokens under the match's empirical distribution (sum of running products)
    ends: np.ndarray | None = None  # stream positions where the occurrences that agree with the whole draft end
    length: int = 0  # tokens matched


def suffix_matches(stream: np.ndarray, context: np.ndarray, max_match: int) -> tuple[np.ndarray, int]:
    """Positions in ``stream`` where the longest suffix of ``context`` (at most ``max_match`` tokens) ends, among
    occurrences followed by at least one token, and that suffix's length (0: not even the last token occurs)."""
    if not len(context) or len(stream) < 2:
        return np.empty(0, dtype=np.int64), 0
    ends = np.flatnonzero(stream[:-1] == context[-1])
    length = 1 if len(ends) else 0
    while len(ends) and length < min(max_match, len(context)):
        reach = ends[ends >= length]  # occurrences with room for one more token before them
        narrower = reach[stream[reach - length] == context[-1 - length]]
        if not len(narrower):
            break
        ends, length = narrower[-MAX_OCCURRENCES:], length + 1
    return ends, length


def most_frequent_walk(stream: np.ndarray, ends: np.ndarray, limit: int, min_prob: float) -> SuffixDraft:
    """Follow the most frequent continuation of the occurrences ending at ``ends`` for up to ``limit`` tokens (ties:
    the continuation seen last, as prompt lookup prefers the latest occurrence)."""
    tokens: list[int] = []
    prob, score = 1.0, 0.0
    follow = ends[-MAX_OCCURRENCES:] + 1
    while len(tokens) < limit:
        follow = follow[follow < len(stream)]
        if not len(follow):
            break
        nxt = stream[follow]
        values, first_from_end, counts = np.unique(nxt[::-1], return_index=True, return_counts=True)
        best = np.lexsort((-first_from_end, counts))[-1]
        prob *= counts[best] / len(nxt)
        if values[best] == _GAP or prob < min_prob:
            break
        tokens.append(int(values[best]))
        score += prob
        follow = follow[nxt == values[best]] + 1
    return SuffixDraft(tokens, score, follow - 1 if tokens else follow[:0])


class OutputCache:
    """The outputs of earlier requests as one stream, at most ``capacity`` tokens; when full, the outputs used
    least recently (added, or drafted from) go first."""

    def __init__(self, capacity: int = DEFAULT_CACHE_TOKENS, min_tokens: int = MIN_OUTPUT_TOKENS) -> None:
        self.capacity, self.min_tokens = capacity, min_tokens
        self._outputs: OrderedDict[int, np.ndarray] = OrderedDict()
        self._ids = 0
        self.tokens = 0
        self._stream: np.ndarray | None = None
        self._starts: np.ndarray = np.empty(0, dtype=np.int64)  # stream offset of each output, in _order
        self._order: list[int] = []

    def __len__(self) -> int:
        return len(self._outputs)

    def add(self, tokens: Sequence[int]) -> None:
        """Keep an output (its last ``capacity`` tokens, each output charged one token more for its gap)."""
        keep = self.capacity - 1
        if len(tokens) < self.min_tokens or keep < self.min_tokens:
            return
        out = np.append(np.asarray(tokens[-keep:], dtype=np.int32), np.int32(_GAP))
        self._outputs[self._ids] = out
        self._ids += 1
        self.tokens += len(out)
        while self.tokens > self.capacity:
            _, dropped = self._outputs.popitem(last=False)
            self.tokens -= len(dropped)
        self._stream = None

    def stream(self) -> np.ndarray:
        """Every output, each followed by a gap (rebuilt after a change: outputs come far less often than rounds)."""
        if self._stream is None:
            self._order = list(self._outputs)
            parts = list(self._outputs.values())
            self._stream = np.concatenate(parts) if parts else np.empty(0, dtype=np.int32)
            sizes = np.fromiter((len(o) for o in parts), dtype=np.int64, count=len(parts))
            self._starts = np.cumsum(sizes) - sizes
        return self._stream

    def touch(self, positions: np.ndarray) -> None:
        """The outputs holding ``positions`` (of the current stream) were drafted from: they are kept longest."""
        if self._stream is None:  # an output came since: the positions no longer say which output they are in
            return
        for index in np.unique(np.searchsorted(self._starts, positions, side="right") - 1):
            key = self._order[index]
            if key in self._outputs:
                self._outputs.move_to_end(key)

    @property
    def nbytes(self) -> int:
        stream = self._stream.nbytes if self._stream is not None else 0
        return stream + sum(o.nbytes for o in self._outputs.values())


class _TokenArray:
    """A sequence's tokens as a growing int32 array (a round appends a few tokens: no full copy per round)."""

    def __init__(self) -> None:
        self.array = np.empty(256, dtype=np.int32)
        self.length = 0

    def update(self, tokens: list[int]) -> np.ndarray:
        n = len(tokens)
        if n < self.length or (self.length and self.array[self.length - 1] != tokens[self.length - 1]):
            self.length = 0  # not an extension of what we saw: read it again
        if n > len(self.array):
            grown = np.empty(max(n, 2 * len(self.array)), dtype=np.int32)
            grown[:self.length] = self.array[:self.length]
            self.array = grown
        self.array[self.length:n] = tokens[self.length:n]
        self.length = n
        return self.array[:n]


@dataclass
class _SequenceState:
    tokens: _TokenArray = field(default_factory=_TokenArray)
    planned: SuffixDraft | None = None  # this step's suffix draft, found by forecast() and proposed by propose()
    use_model: bool = False  # the draft model drafts this round (the suffix match expects too little)
    proposed: tuple[int, list[int], int] | None = None  # (band, tokens, position) of this round's suffix draft
    learned: bool = False  # its output went into the cache
    bands: dict[int, AcceptanceCounts] = field(default_factory=dict)  # band -> counts of its own rounds


class SuffixDrafter(Drafter):
    """Drafts by suffix match (see the module docstring); with ``model``, a draft model drafts wherever the suffix
    match expects fewer than ``model_below`` accepted tokens (a new text, nothing repeated yet).

    How many tokens a match is worth drafting is the controller's choice, from a per-token acceptance this drafter
    forecasts for the round (``forecast``): the acceptance drafts from matches of about that length (a power-of-two
    band of match length) met so far, in this sequence and, as a prior worth ``PRIOR_WEIGHT`` rounds, in every
    sequence. A sequence's plain acceptance history would mislead here: a text is repeated or it is not, and the
    match says which, round by round. A seeded request's forecast is its draft's own empirical probability instead
    (its plan may not depend on earlier requests)."""

    PRIOR = AcceptanceCounts(accepted=1.0, rejected=1.0)  # each band starts from acceptance 0.5 until measured
    PRIOR_WEIGHT = 4.0

    def __init__(self, scope: str = "global", cache_tokens: int = DEFAULT_CACHE_TOKENS, max_match: int = 32,
                 spec_factor: float = 2.0, min_prob: float = 0.1, model: ModelDrafter | None = None,
                 model_below: float = 1.0, max_k: int = 32) -> None:
        check_suffix_options(scope, cache_tokens)
        self.max_match, self.spec_factor, self.min_prob = max_match, spec_factor, min_prob
        self.cache = OutputCache(cache_tokens) if scope == "global" else None
        self.model, self.model_below, self.max_k = model, model_below, max_k
        self.name = "suffix" if model is None else f"suffix+{model.name}"
        if model is not None:
            self.runner, self.key = model.runner, model.key
        self._state: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # sequence -> _SequenceState
        self.bands = [replace(self.PRIOR) for _ in range(max_match.bit_length())]

    def _of(self, seq: DraftableSequence) -> "_SequenceState":
        state = self._state.get(seq)
        if state is None:
            state = self._state[seq] = _SequenceState()
        return state

    def suffix_draft(self, seq: DraftableSequence, k: int) -> SuffixDraft:
        """The better-scored of the request's own match and the cache's."""
        context = self._of(seq).tokens.update(seq.token_ids)
        best = self._walk(context, context, k)
        # a seeded request drafts from its own tokens only: its sampled tokens then never depend on earlier requests
        if self.cache is not None and len(self.cache) and seq.params.seed is None:
            stream = self.cache.stream()
            shared = self._walk(stream, context, k)
            if shared.score > best.score:
                self.cache.touch(shared.ends)
                best = shared
        return best

    def _walk(self, stream: np.ndarray, context: np.ndarray, k: int) -> SuffixDraft:
        ends, length = suffix_matches(stream, context, self.max_match)
        if not length:
            return SuffixDraft([], 0.0)
        draft = most_frequent_walk(stream, ends, min(k, max(1, int(self.spec_factor * length))), self.min_prob)
        draft.length = length
        return draft

    def _band(self, length: int) -> int:
        return max(0, min(length.bit_length(), len(self.bands)) - 1)

    def _acceptance(self, seq: DraftableSequence, state: "_SequenceState", draft: SuffixDraft) -> float:
        if not draft.tokens:
            return 0.0
        if seq.params.seed is not None:
            return draft.score / len(draft.tokens)
        band = self._band(draft.length)
        prior = self.bands[band].as_prior(self.PRIOR_WEIGHT)
        own = state.bands.get(band, AcceptanceCounts(accepted=0.0, rejected=0.0))
        return (prior.accepted + own.accepted) / (prior.accepted + prior.rejected + own.accepted + own.rejected)

    def _plan(self, seq: DraftableSequence) -> tuple["_SequenceState", float]:
        """This round's suffix draft for ``seq``, whether the draft model drafts instead, and the per-token
        acceptance forecast for it (``_acceptance``)."""
        state = self._of(seq)
        draft = state.planned = self.suffix_draft(seq, self.max_k)
        a = self._acceptance(seq, state, draft)
        expected = sum(a ** i for i in range(1, len(draft.tokens) + 1))
        state.use_model = self.model is not None and expected < self.model_below
        # what the match would draft is scored against what the round commits, whoever drafts it (the draft model,
        # or nobody when the controller chose k = 0): a band then learns even while it is not trusted
        state.proposed = (self._band(draft.length), draft.tokens, len(seq.token_ids)) if draft.tokens else None
        return state, a

    def forecast(self, seqs: Sequence[DraftableSequence]) -> list[float | None]:
        out: list[float | None] = []
        for seq in seqs:
            state, a = self._plan(seq)
            out.append(None if state.use_model else a)
        return out

    def lag(self, seq: DraftableSequence) -> int:
        state = self._state.get(seq)
        if self.model is None or (state is not None and not state.use_model):
            return 0
        return self.model.lag(seq)

    def propose(self, seqs: Sequence[DraftableSequence], ks: Sequence[int]) -> list[Proposal]:
        proposals, by_model = [], []
        for i, (seq, k) in enumerate(zip(seqs, ks)):
            state = self._of(seq)
            if state.planned is None:  # not planned this step (the engine's calibration proposes directly)
                state, _ = self._plan(seq)
            draft, state.planned = state.planned, None
            if state.use_model and k:
                by_model.append(i)
            proposals.append(Proposal(draft.tokens[:k]))
        if self.model is not None:
            self.model.last_forward_costs = []
            if by_model:
                drafted = self.model.propose([seqs[i] for i in by_model], [ks[i] for i in by_model])
                for i, proposal in zip(by_model, drafted):
                    proposals[i] = proposal
        return proposals

    def rewind(self, seq: DraftableSequence) -> None:
        """After a commit: learn how far the round's suffix draft agreed with the committed tokens (a draft longer
        than what was committed counts only what can be judged), and take a finished output."""
        if self.model is not None:
            self.model.rewind(seq)
        state = self._of(seq)
        if state.proposed is not None:
            band, tokens, base = state.proposed
            state.proposed = None
            committed = seq.token_ids[base:base + len(tokens)]
            if committed:  # nothing committed (a failed batch's retry): nothing to judge
                accepted = next((i for i, (a, b) in enumerate(zip(tokens, committed)) if a != b), len(committed))
                self.bands[band].record(len(committed), accepted, decay=0.99)
                state.bands.setdefault(band, AcceptanceCounts(accepted=0.0, rejected=0.0)).record(
                    len(committed), accepted)
        if seq.finished and self.cache is not None and not state.learned:
            self.cache.add(seq.token_ids[len(seq.prompt_ids):])
            state.learned = True

    def release(self, seq: DraftableSequence) -> None:
        self._state.pop(seq, None)
        if self.model is not None:
            self.model.release(seq)

    # a draft model beside the suffix match: its costs are what the controller prices
    def step_bytes(self) -> int:
        return self.model.step_bytes() if self.model is not None else 0

    def forward_costs(self) -> list[tuple[int, int, float]]:
        return self.model.forward_costs() if self.model is not None else []

    def bind_cancelled(self, cancelled) -> None:
        if self.model is not None:
            self.model.bind_cancelled(cancelled)


def check_suffix_options(scope: str, cache_tokens: int) -> None:
    """Refuse bad suffix options by name, before anything is loaded."""
    if scope not in SCOPES:
        raise InvalidParameterError(f"suffix_scope must be one of {', '.join(SCOPES)}, got {scope!r}")
    if isinstance(cache_tokens, bool) or not isinstance(cache_tokens, int) or not 1 <= cache_tokens <= MAX_CACHE_TOKENS:
        raise InvalidParameterError(f"suffix_cache_tokens must be an int in 1..{MAX_CACHE_TOKENS}, got {cache_tokens!r}")
