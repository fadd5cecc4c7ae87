"""vLLM's ``bad_words``: words the output never spells, as token sequences.

Each word is tokenized alone and after a space (vLLM's rule: the spaced form is kept where it is a different first
token of the same length), so it is banned at the start of the text and inside it. A one-token sequence is never
sampled; for a longer one, its last token is masked wherever the output (the committed tokens and, row by row, the
drafted ones) ends with the rest.
"""
from __future__ import annotations

from collections.abc import Sequence

from quickdraft.tokenizer import Tokenizer


def bad_word_ids(tokenizer: Tokenizer, words: Sequence[str]) -> tuple[tuple[int, ...], ...]:
    """The token sequences of ``words``, with and without a leading space."""
    sequences: list[tuple[int, ...]] = []
    for word in words:
        bare = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        if bare:
            sequences.append(bare)
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        if spaced and (not bare or (spaced[0] != bare[0] and len(spaced) == len(bare))):
            sequences.append(spaced)
    return tuple(dict.fromkeys(sequences))


def banned_next(output: Sequence[int], sequences: Sequence[tuple[int, ...]]) -> list[int]:
    """The tokens that would complete a bad word after ``output``."""
    n = len(output)
    return [s[-1] for s in sequences if len(s) <= n + 1 and tuple(output[n - len(s) + 1:]) == s[:-1]]
