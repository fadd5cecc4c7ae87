"""Which vocabulary a draft model speaks: the target's own, or another one bridged over the tokens both share.

A draft of another family (SmolLM2 or Gemma 3 drafting for Qwen) stays exact by Token-Level Intersection (Timor
et al., ICML 2025): it proposes only tokens both vocabularies spell with the same bytes, its distribution
restricted to them and renormalised, and that restricted distribution is the q of the rejection test (any q
keeps the target's distribution; a better one only accepts more). The draft reads the target's text re-encoded
with its own tokenizer (``TextView``), so it sees the text as it was trained to.
"""
from __future__ import annotations

import hashlib
import itertools
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from quickdraft.errors import InvalidParameterError, ModelLoadError
from quickdraft.kv import SequenceKV
from quickdraft.tokenizer import Tokenizer
from quickdraft.tokenizer.token_bytes import is_byte_fallback

# draft tokens re-encoded after each commit: appended bytes can merge with the last tokens of the text
REENCODE_TOKENS = 4
# a view whose byte offsets stopped adding up (invalid UTF-8 in the text, a tokenizer that adds a prefix space) is
# re-encoded whole after each commit, up to this many bytes of text; past it, that sequence stops drafting
MAX_WHOLE_REENCODE_BYTES = 8192
# a pair sharing fewer tokens than this (or than half the draft's vocabulary) is refused: it could never draft well
MIN_SHARED_TOKENS = 1000


class SharedVocabulary:
    """Draft and target share a tokenizer: the draft reads the target's ids, and its logits differ from the
    target's only by the checkpoints' padding rows."""

    pairing = None  # nothing to say: the draft reads the target's own ids

    def __init__(self, target_vocab: int) -> None:
        self.target_vocab = target_vocab

    def view(self, seq) -> list[int]:
        """The draft's ids for the sequence's committed tokens."""
        return seq.token_ids

    def can_draft(self, seq) -> bool:
        """Whether the draft's view ends where the target's text does (not inside a character)."""
        return True

    def to_draft(self, tokens: Sequence[int]) -> list[int]:
        """Drafted target ids as draft ids."""
        return list(tokens)

    def agree(self, kv: SequenceKV, context: Sequence[int]) -> int:
        """How many of the cached draft tokens still agree with ``context``."""
        return kv.num_cached

    def record(self, kv: SequenceKV, context: Sequence[int]) -> None:
        """Remember which ids the draft cache holds, where they can differ from the view later."""

    def forget(self, seq) -> None:
        """The sequence is done: drop its view."""

    def head_rows(self, draft_vocab: int | None, model_rows: int) -> int | None:
        """The lm_head rows the draft model needs: the first ``draft_vocab`` (None: all)."""
        return draft_vocab

    def widen(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft logits over the target's vocabulary (padding rows differ between checkpoints)."""
        width = logits.shape[-1]
        if width == self.target_vocab:
            return logits
        if width > self.target_vocab:
            return logits[..., : self.target_vocab]
        pad = logits.new_full((*logits.shape[:-1], self.target_vocab - width), float("-inf"))
        return torch.cat([logits, pad], dim=-1)


@dataclass
class TextView:
    """One sequence's text as the draft tokenizer encodes it, kept up to date a few tokens at a time."""

    taken: int = 0  # target tokens taken in
    last: int = -1  # the last of them (a sequence whose tokens changed under the view starts a new one)
    text: bytearray = field(default_factory=bytearray)  # their bytes
    ids: list[int] = field(default_factory=list)  # draft ids of text[:complete] (a leading BOS included)
    ends: list[int] = field(default_factory=list)  # byte end of each draft id in text
    complete: int = 0  # bytes in ids: the text may end inside a UTF-8 character
    exact: bool = True  # ends add up (a normalizer or an unknown token can make them not)
    stalled: bool = False  # inexact and too long to re-encode whole each time: no more drafts


class CrossVocabulary:
    """A draft of another vocabulary: Token-Level Intersection over the tokens both spell the same."""

    def __init__(self, target: Tokenizer, draft: Tokenizer, target_name: str, draft_name: str,
                 target_vocab: int) -> None:
        self.target_vocab, self.draft_tokenizer = target_vocab, draft
        target_ids, draft_ids = shared_tokens(target, draft)
        inside = target_ids < target_vocab  # a tokenizer can name ids past its model's vocabulary
        target_ids, draft_ids = target_ids[inside], draft_ids[inside]
        self.shared = len(target_ids)
        least = min(MIN_SHARED_TOKENS, draft.vocab_size // 2)
        if self.shared < least:
            raise ModelLoadError(
                f"the draft model {draft_name} and the target {target_name} share {self.shared:,} tokens (of "
                f"{draft.vocab_size:,} and {target.vocab_size:,}); a draft of another vocabulary needs at least "
                f"{least:,} shared tokens to propose anything the target would accept")
        self.pairing = f"{draft_name} drafts for {target_name} over {self.shared:,} shared tokens"
        order = np.argsort(draft_ids, kind="stable")  # the draft's head keeps these rows, in this order
        self.target_ids = torch.from_numpy(target_ids[order].astype(np.int64))
        self.draft_ids = torch.from_numpy(draft_ids[order].astype(np.int64))
        self._draft_of = np.full(target_vocab, -1, dtype=np.int64)
        self._draft_of[target_ids] = draft_ids
        # what each target id writes into the text: special tokens their text (the draft tokenizer turns its own
        # specials back into ids), a BOS nothing (the draft has its own)
        self._pieces = [b if b is not None else b"" for b in target.token_bytes()]
        if target.bos_token_id is not None and target.bos_token_id < len(self._pieces):
            self._pieces[target.bos_token_id] = b""
        self._draft_lengths = [len(b) if b is not None else -1 for b in draft.token_bytes()]
        bos = draft.encode("", add_special_tokens=True)
        self._bos = bos if bos == [draft.bos_token_id] else []
        self._views: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._on_device = self.target_ids  # target_ids where the draft's logits are (see widen)

    # ---- the draft's view of the text -------------------------------------------------------------------
    def view(self, seq) -> list[int]:
        return self._update(seq).ids

    def can_draft(self, seq) -> bool:
        v = self._update(seq)
        return (not v.stalled and v.complete == len(v.text) and len(v.ids) > len(self._bos))

    def forget(self, seq) -> None:
        self._views.pop(seq, None)

    def _update(self, seq) -> TextView:
        tokens = seq.token_ids
        v = self._views.get(seq)
        if v is None or len(tokens) < v.taken or (v.taken and tokens[v.taken - 1] != v.last):
            v = self._views[seq] = TextView(ids=list(self._bos), ends=[0] * len(self._bos))
        if len(tokens) == v.taken or v.stalled:
            return v
        new = tokens[v.taken:]
        v.taken, v.last = len(tokens), tokens[-1]
        v.text += b"".join(self._pieces[t] for t in new)
        end = complete_utf8(v.text)
        if not v.exact and end > MAX_WHOLE_REENCODE_BYTES:
            v.stalled = True
            return v
        # re-encode the last few draft tokens with the new text: bytes appended to a word can merge with its end
        first = len(self._bos) if not v.exact else max(len(self._bos), len(v.ids) - REENCODE_TOKENS)
        start = v.ends[first - 1] if first else 0
        while first > len(self._bos) and start < len(v.text) and v.text[start] & 0xC0 == 0x80:
            first -= 1  # a draft token ended inside a character: start at the character
            start = v.ends[first - 1] if first else 0
        tail = v.text[start:end].decode("utf-8", "replace")
        ids = self.draft_tokenizer.backend.encode(tail, add_special_tokens=False).ids if tail else []
        lengths = [self._draft_lengths[i] if 0 <= i < len(self._draft_lengths) else -1 for i in ids]
        ends = list(itertools.accumulate(lengths, initial=start))[1:]
        v.exact = (ends[-1] if ends else start) == end and min(lengths, default=0) >= 0
        v.ids[first:], v.ends[first:] = ids, ends
        v.complete = end
        return v

    # ---- the draft cache --------------------------------------------------------------------------------
    def to_draft(self, tokens: Sequence[int]) -> list[int]:
        ids = [int(self._draft_of[t]) for t in tokens]
        if -1 in ids:  # only shared tokens are ever drafted
            raise ValueError(f"target token {tokens[ids.index(-1)]} is not shared with the draft's vocabulary")
        return ids

    def agree(self, kv: SequenceKV, context: Sequence[int]) -> int:
        held, n = kv.tokens, kv.num_cached
        if held is None or len(held) < n:
            return 0
        m = min(n, len(context))
        if held[:m] == list(context[:m]):
            return m
        return next(i for i, (a, b) in enumerate(zip(held, context)) if a != b)

    def record(self, kv: SequenceKV, context: Sequence[int]) -> None:
        kv.tokens = list(context[:kv.num_cached])

    # ---- the draft's distribution -------------------------------------------------------------------------
    def head_rows(self, draft_vocab: int | None, model_rows: int) -> list[int]:
        """The lm_head rows the draft model needs: the shared tokens (below ``draft_vocab`` if given), in draft-id
        order. A head cut to them computes only the logits the restricted distribution uses (Gemma 3's 262k-row
        head shrinks to the 96k rows it shares with Qwen), and ``widen`` places its columns. The draft model must be
        built with this head."""
        keep = self.draft_ids < min(model_rows, draft_vocab if draft_vocab is not None else model_rows)
        if not bool(keep.any()):
            raise InvalidParameterError(f"draft_vocab={draft_vocab} keeps none of the {self.shared:,} tokens the draft "
                                        f"shares with the target (the lowest shared draft id is "
                                        f"{int(self.draft_ids.min())})")
        self.target_ids, self.draft_ids = self.target_ids[keep], self.draft_ids[keep]
        self._on_device = self.target_ids
        return self.draft_ids.tolist()

    def widen(self, logits: torch.Tensor) -> torch.Tensor:
        """The draft's logits placed on the target ids of the shared tokens, -inf elsewhere: softmax then gives
        the draft's distribution restricted to the shared tokens and renormalised. Column j of ``logits`` is the
        draft's logit of ``draft_ids[j]`` (its head has the rows ``head_rows`` gave)."""
        if self._on_device.device != logits.device:
            self._on_device = self.target_ids.to(logits.device)
        out = logits.new_full((*logits.shape[:-1], self.target_vocab), float("-inf"))
        out[..., self._on_device] = logits
        return out


def complete_utf8(text: bytes | bytearray) -> int:
    """Length of ``text`` without a trailing, still incomplete UTF-8 character."""
    n = len(text)
    for back in range(1, min(4, n) + 1):
        b = text[n - back]
        if b & 0xC0 != 0x80:  # a lead byte (or ASCII): how long is its character?
            need = 1 if b < 0x80 else 2 if b >> 5 == 0b110 else 3 if b >> 4 == 0b1110 else 4 if b >> 3 == 0b11110 else 1
            return n - back if back < need else n
    return n


_SHARED_CACHE: dict[tuple[bytes, bytes], tuple[np.ndarray, np.ndarray]] = {}


def shared_tokens(target: Tokenizer, draft: Tokenizer) -> tuple[np.ndarray, np.ndarray]:
    """(target ids, draft ids) of the tokens both vocabularies spell with the same bytes, special tokens left out.
    Where one side spells the same bytes twice (a SentencePiece byte-fallback token beside an ordinary one), the
    ordinary token is kept. Cached per pair, keyed by both vocabularies' contents."""
    key = (vocabulary_hash(target), vocabulary_hash(draft))
    if key not in _SHARED_CACHE:
        t, d = _by_bytes(target), _by_bytes(draft)
        both = t.keys() & d.keys()
        order = sorted(both, key=t.__getitem__)
        _SHARED_CACHE[key] = (np.array([t[b] for b in order], dtype=np.int64),
                              np.array([d[b] for b in order], dtype=np.int64))
    return _SHARED_CACHE[key]


def vocabulary_hash(tok: Tokenizer) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    for b in tok.token_bytes():
        h.update(b"\xff" if b is None else len(b).to_bytes(4, "little") + b)
    h.update(repr(sorted(tok.special_token_ids)).encode())
    return h.digest()


def _by_bytes(tok: Tokenizer) -> dict[bytes, int]:
    """bytes -> the id that spells them (ordinary tokens before byte-fallback ones, then the lowest id)."""
    out: dict[bytes, int] = {}
    singles, spelled = [], tok.token_bytes()
    for i, b in enumerate(spelled):
        if not b or i in tok.special_token_ids:
            continue
        if len(b) == 1:
            singles.append(i)
        elif b not in out:
            out[b] = i
    fallback = is_byte_fallback(tok.backend, singles)
    for i, fb in sorted(zip(singles, fallback), key=lambda x: (x[1], x[0])):
        out.setdefault(spelled[i], i)
    return out
