"""Incremental detokenization for streaming: text comes out as soon as it is complete.

A token can end in the middle of a multi-byte UTF-8 character (byte-level BPE splits emoji and
CJK characters across tokens). Decoding such a prefix gives U+FFFD, so text is only emitted
once the decoded window no longer ends in U+FFFD; the held-back tail comes out with the next
token that completes it, or on `flush()`.

The window technique (as in vLLM / TGI): decode ids[prefix:] and ids[prefix:read] and emit the
difference. `prefix` and `read` only ever move to positions where the text decoded cleanly, so
decoding from `prefix` gives the same characters as decoding the whole sequence, and keeping a
few tokens of left context keeps decoders that treat the first token specially (SentencePiece's
leading-space strip) correct.
"""
from __future__ import annotations

from quickdraft.tokenizer.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"


class StreamingDetokenizer:
    """Feed token ids one at a time with `add`; each call returns the newly completed text."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0  # start of the decode window (left context)
        self._read = 0  # ids before this were emitted
        self._chunks: list[str] = []
        self._text_cache: str | None = ""

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        if self._text_cache is None:
            self._text_cache = "".join(self._chunks)
        return self._text_cache

    @property
    def token_ids(self) -> list[int]:
        return list(self._ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _emit(self, chunk: str) -> str:
        if chunk:
            self._chunks.append(chunk)
            self._text_cache = None
        return chunk

    def add(self, token_id: int) -> str:
        """Add one token; return the text it completes ('' while a character is still partial)."""
        token_id = int(token_id)
        if not 0 <= token_id < self.tokenizer.vocab_size:
            raise ValueError(
                f"token id {token_id} is out of range: this tokenizer knows ids 0..{self.tokenizer.vocab_size - 1}"
            )
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        new_text = self._decode(self._ids[self._prefix :])
        if len(new_text) > len(prefix_text) and not new_text.endswith(_REPLACEMENT):
            chunk = new_text[len(prefix_text) :]
            self._prefix = self._read
            self._read = len(self._ids)
            return self._emit(chunk)
        return ""

    def flush(self) -> str:
        """Emit whatever is held back (at the end of generation, or when it is aborted).

        A character that is still incomplete comes out as U+FFFD, as a full decode would give.
        """
        if self._read >= len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        new_text = self._decode(self._ids[self._prefix :])
        self._prefix = self._read = len(self._ids)
        return self._emit(new_text[len(prefix_text) :])
