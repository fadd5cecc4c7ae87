"""DRY ("don't repeat yourself", koboldcpp's sampler as llama.cpp runs it): a penalty on each token that would
extend a repeat of the context.

For the context c (prompt and output, the last ``dry_penalty_last_n`` tokens), every earlier position j whose
tokens c[.. j] end the way c ends, over L tokens, makes c[j + 1] the token that would repeat L + 1 tokens; where
L >= ``dry_allowed_length`` that token loses ``dry_multiplier * dry_base ** (L - dry_allowed_length)`` of its logit
(the largest L of its positions). A repeat never reaches back across a sequence breaker: a token whose text holds a
breaker string, or one whose text ends with a breaker's beginning followed by the tokens of its rest; a token that
holds a whole breaker is never penalized itself. The breakers' tokens are found once per tokenizer and set of
strings (``sequence_breakers``).
"""
from __future__ import annotations

import math
import weakref
from collections import OrderedDict, defaultdict
from dataclasses import dataclass

import numpy as np

from quickdraft.models import native
from quickdraft.sampling.params import SamplingParams
from quickdraft.tokenizer import Tokenizer

MAX_TAIL_TOKENS = 20  # llama.cpp's: a breaker's rest after a token is matched over at most this many tokens
# the logit a penalty takes away at most: float32 logits stay finite, so a row never loses every token
PENALTY_CAP = 1e30
_LOG_FLOAT_MAX = 88.7228391  # log(float32 max): llama.cpp's bound on the exponent
_CACHED_SETS = 32  # sets of breaker strings kept per tokenizer


@dataclass(frozen=True)
class SequenceBreakers:
    """``whole[t]``: token t's text holds a whole breaker; ``tails[t]``: the token sequences that, after token t
    (whose text ends with a breaker's beginning), complete a breaker; ``heads``: tokens that are either."""

    whole: np.ndarray
    heads: np.ndarray
    tails: dict[int, tuple[tuple[int, ...], ...]]

    @classmethod
    def none(cls) -> "SequenceBreakers":
        return cls(np.zeros(0, dtype=bool), np.zeros(0, dtype=bool), {})


class _TokenTexts:
    """A vocabulary's token bytes arranged for finding breakers, built once per tokenizer: all of them joined (where
    bytes.find finds every token holding a string) and each one's last bytes right-aligned in a matrix, its tokens
    grouped by their last byte (where the tokens ending with a string are compared at once)."""

    ENDING = 16  # last bytes kept per token; a longer ending is compared on the candidates' own bytes

    def __init__(self, texts: list[bytes]) -> None:
        self.texts = texts
        self.lengths = np.array([len(t) for t in texts], dtype=np.int64)
        self.starts = np.concatenate(([0], np.cumsum(self.lengths + 1)[:-1])).astype(np.int64)
        self.blob = b"\0".join(texts)  # a match across the separator is dropped (it ends past its token)
        joined = np.frombuffer(self.blob, dtype=np.uint8)
        at = self.starts[:, None] + self.lengths[:, None] - self.ENDING + np.arange(self.ENDING)
        self.ending = np.where(at >= self.starts[:, None], joined[np.clip(at, 0, None)], 0).astype(np.uint8)
        last = np.where(self.lengths > 0, self.ending[:, -1].astype(np.int64), -1)
        order = np.argsort(last, kind="stable")
        bounds = np.searchsorted(last[order], np.arange(257))
        self.by_last = {b: order[bounds[b]:bounds[b + 1]] for b in range(256)}
        self.sets: OrderedDict[tuple[str, ...], SequenceBreakers] = OrderedDict()

    def holding(self, b: bytes) -> np.ndarray:
        """The ids of the tokens whose bytes hold ``b``."""
        at, i = [], self.blob.find(b)
        while i >= 0:
            at.append(i)
            i = self.blob.find(b, i + 1)
        found = np.array(at, dtype=np.int64)
        if not found.size:
            return found
        ids = np.searchsorted(self.starts, found, side="right") - 1
        return np.unique(ids[found + len(b) <= self.starts[ids] + self.lengths[ids]])

    def ending_with(self, b: bytes) -> np.ndarray:
        """The ids of the tokens whose bytes end with ``b`` (not empty)."""
        ids = self.by_last[b[-1]]
        tail = np.frombuffer(b[-self.ENDING:], dtype=np.uint8)
        ids = ids[(self.lengths[ids] >= len(b)) & (self.ending[ids, self.ENDING - len(tail):] == tail).all(axis=1)]
        if len(b) > self.ENDING:
            ids = np.array([t for t in ids.tolist() if self.texts[t].endswith(b)], dtype=np.int64)
        return ids

    def breakers(self, tokenizer: Tokenizer, strings: tuple[str, ...]) -> SequenceBreakers:
        found = self.sets.get(strings)
        if found is None:
            found = self.sets[strings] = self._build(tokenizer, strings)
            if len(self.sets) > _CACHED_SETS:
                self.sets.popitem(last=False)
        return found

    def _build(self, tokenizer: Tokenizer, strings: tuple[str, ...]) -> SequenceBreakers:
        """As llama.cpp: per string, a token holding it is a whole breaker, a token ending with its first characters
        (cut at a character) a head whose tail is the rest's tokens."""
        whole = np.zeros(len(self.texts), dtype=bool)
        tails: dict[int, set[tuple[int, ...]]] = defaultdict(set)
        for s in strings:
            holding = self.holding(s.encode())
            whole[holding] = True
            for cut in range(1, len(s)):
                tail = tuple(tokenizer.encode(s[cut:], add_special_tokens=False)[:MAX_TAIL_TOKENS])
                if tail:
                    for tid in np.setdiff1d(self.ending_with(s[:cut].encode()), holding).tolist():
                        tails[tid].add(tail)
        heads = whole.copy()
        heads[list(tails)] = True
        return SequenceBreakers(whole, heads, {t: tuple(sorted(v)) for t, v in tails.items()})


_TEXTS: "weakref.WeakKeyDictionary[Tokenizer, _TokenTexts]" = weakref.WeakKeyDictionary()


def sequence_breakers(tokenizer: Tokenizer, strings: list[str] | tuple[str, ...]) -> SequenceBreakers:
    """The breakers of ``strings`` in ``tokenizer``'s vocabulary (cached per tokenizer, which it does not keep)."""
    texts = _TEXTS.get(tokenizer)
    if texts is None:
        texts = _TEXTS.setdefault(tokenizer, _TokenTexts([b or b"" for b in tokenizer.token_bytes()]))
    return texts.breakers(tokenizer, tuple(strings))


def _marked(table: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """table[t] for each token t; False for ids past the table (the logits may be wider than the vocabulary)."""
    known = tokens < len(table)
    return known & table[np.where(known, tokens, 0)] if table.size else known


def _repeat_limit(window: np.ndarray, breakers: SequenceBreakers, cap: int) -> int:
    """How many of the window's last tokens a repeat may span: those after its last breaker (a breaker more than
    ``cap`` tokens back, where longer repeats cost no more, is not looked for)."""
    n = len(window)
    if not breakers.heads.size:
        return n
    first = max(0, n - 1 - cap - MAX_TAIL_TOKENS)
    recent = window[first:]
    wholes = np.flatnonzero(_marked(breakers.whole, recent))
    after = int(wholes[-1]) if wholes.size else -1  # a whole breaker ends the search there
    at = np.flatnonzero(_marked(breakers.heads, recent))
    for pos in reversed((first + at[at >= after]).tolist()):
        back = n - 1 - pos  # tokens after the head
        token = int(window[pos])
        longest = 0 if breakers.whole[token] else -1
        for tail in breakers.tails.get(token, ()):
            if longest < len(tail) <= back and tuple(window[pos + 1:pos + 1 + len(tail)].tolist()) == tail:
                longest = len(tail)
        if longest >= 0:
            return back - longest
    return n


def repeat_lengths(window: np.ndarray, limit: int) -> tuple[np.ndarray, np.ndarray]:
    """(positions j, L): each earlier position whose tokens end as the window ends, over L tokens (at most
    ``limit``): the native kernel's linear-time Z-algorithm, or (without it) matches extended a token at a time."""
    lengths = native.dry_repeats(window, limit)
    if lengths is not None:
        ends = np.flatnonzero(lengths)
        return ends, lengths[ends].astype(np.int64)
    n = len(window)
    ends = np.flatnonzero(window[:-1] == window[-1])
    lengths = np.zeros(len(ends), dtype=np.int64)
    alive = np.arange(len(ends))
    back = 0
    while alive.size and back < limit:
        pos = ends[alive] - back
        ok = pos >= 0
        ok[ok] = window[pos[ok]] == window[n - 1 - back]
        alive = alive[ok]
        lengths[alive] += 1
        back += 1
    return ends, lengths


def dry_penalties(context: np.ndarray, p: SamplingParams, breakers: SequenceBreakers) -> tuple[np.ndarray, np.ndarray]:
    """(token ids, penalties) DRY takes from the logits of the token after ``context``."""
    empty = np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float64)
    window = context[-p.dry_penalty_last_n:] if p.dry_penalty_last_n > 0 else context
    allowed = p.dry_allowed_length
    if len(window) <= allowed:
        return empty
    # llama.cpp's bound on the exponent (a float32 power stays finite): a repeat longer than allowed + it costs the same
    most = 0 if p.dry_base == 1 else math.floor(_LOG_FLOAT_MAX / math.log(p.dry_base))
    cap = min(len(window), allowed + most)
    limit = _repeat_limit(window, breakers, cap)
    if limit < allowed:
        return empty
    ends, lengths = repeat_lengths(window, min(limit, cap))
    repeating = lengths >= allowed
    if not repeating.any():
        return empty
    tokens, lengths = window[ends[repeating] + 1], lengths[repeating]
    keep = ~_marked(breakers.whole, tokens)
    tokens, lengths = tokens[keep], lengths[keep]
    if not tokens.size:
        return empty
    order = np.lexsort((-lengths, tokens))  # per token, its longest repeat first
    tokens, lengths = tokens[order], lengths[order]
    first = np.ones(len(tokens), dtype=bool)
    first[1:] = tokens[1:] != tokens[:-1]
    tokens, exponent = tokens[first], (lengths[first] - allowed).astype(np.float64)
    penalties = np.minimum(p.dry_multiplier * np.power(p.dry_base, exponent), PENALTY_CAP)
    return tokens, penalties
