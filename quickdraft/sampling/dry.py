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
    """A tokenizer's token bytes and, per last byte, the tokens ending with it (built once per tokenizer)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.texts = [b or b"" for b in tokenizer.token_bytes()]
        self.by_last: dict[int, list[int]] = defaultdict(list)
        for tid, text in enumerate(self.texts):
            if text:
                self.by_last[text[-1]].append(tid)
        self.sets: OrderedDict[tuple[str, ...], SequenceBreakers] = OrderedDict()

    def breakers(self, strings: tuple[str, ...]) -> SequenceBreakers:
        found = self.sets.get(strings)
        if found is None:
            found = self.sets[strings] = self._build(strings)
            if len(self.sets) > _CACHED_SETS:
                self.sets.popitem(last=False)
        return found

    def _build(self, strings: tuple[str, ...]) -> SequenceBreakers:
        size = len(self.texts)
        whole = np.zeros(size, dtype=bool)
        tails: dict[int, set[tuple[int, ...]]] = defaultdict(set)
        for s in strings:
            b = s.encode()
            whole[[tid for tid, text in enumerate(self.texts) if b in text]] = True
            for cut in range(1, len(s)):  # a token ending with s[:cut]: the rest s[cut:] must follow
                prefix = s[:cut].encode()
                tail = tuple(self.tokenizer.encode(s[cut:], add_special_tokens=False)[:MAX_TAIL_TOKENS])
                for tid in self.by_last.get(prefix[-1], ()):
                    if not whole[tid] and self.texts[tid].endswith(prefix) and tail:
                        tails[tid].add(tail)
        heads = whole.copy()
        heads[list(tails)] = True
        return SequenceBreakers(whole, heads, {t: tuple(sorted(v)) for t, v in tails.items()})


_TEXTS: "weakref.WeakKeyDictionary[Tokenizer, _TokenTexts]" = weakref.WeakKeyDictionary()


def sequence_breakers(tokenizer: Tokenizer, strings: list[str] | tuple[str, ...]) -> SequenceBreakers:
    """The breakers of ``strings`` in ``tokenizer``'s vocabulary (cached)."""
    texts = _TEXTS.get(tokenizer)
    if texts is None:
        texts = _TEXTS.setdefault(tokenizer, _TokenTexts(tokenizer))
    return texts.breakers(tuple(strings))


def _repeat_limit(window: np.ndarray, breakers: SequenceBreakers) -> int:
    """How many of the window's last tokens a repeat may span: those after its last breaker."""
    n = len(window)
    known = window < len(breakers.heads)
    at = np.flatnonzero(known & breakers.heads[np.where(known, window, 0)]) if breakers.heads.size else ()
    for pos in reversed(at):
        back = n - 1 - int(pos)  # tokens after the head
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
    ``limit``)."""
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
    limit = _repeat_limit(window, breakers)
    if limit < allowed:
        return empty
    ends, lengths = repeat_lengths(window, limit)
    repeating = lengths >= allowed
    if not repeating.any():
        return empty
    tokens, lengths = window[ends[repeating] + 1], lengths[repeating]
    known = tokens < len(breakers.whole)
    if breakers.whole.size:
        keep = ~(known & breakers.whole[np.where(known, tokens, 0)])
        tokens, lengths = tokens[keep], lengths[keep]
    if not tokens.size:
        return empty
    order = np.lexsort((-lengths, tokens))  # per token, its longest repeat first
    tokens, lengths = tokens[order], lengths[order]
    first = np.ones(len(tokens), dtype=bool)
    first[1:] = tokens[1:] != tokens[:-1]
    tokens, exponent = tokens[first], (lengths[first] - allowed).astype(np.float64)
    if p.dry_base > 1.000001:
        exponent = np.minimum(exponent, math.floor(_LOG_FLOAT_MAX / math.log(p.dry_base)))
    penalties = np.minimum(p.dry_multiplier * np.power(p.dry_base, exponent), PENALTY_CAP)
    return tokens, penalties
