"""The bytes each token id writes into the text: what lets two different vocabularies be compared.

A draft model of another family (see ``speculative/vocab.py``) drafts over the tokens both vocabularies spell with
the same bytes, and reads the target's text re-encoded. Both need every token as bytes, without the tokenizer's
own markers: byte-level BPE (GPT-2, Llama 3, Qwen, SmolLM2) spells bytes as printable characters, SentencePiece
(Llama 2, Gemma) spells a space as U+2581 and unknown bytes as ``<0xNN>``.
"""
from __future__ import annotations

import json
import re
from collections.abc import Sequence

from tokenizers import Tokenizer as BackendTokenizer

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def byte_level_alphabet() -> dict[int, str]:
    """GPT-2's printable character for each byte (``bytes_to_unicode``): bytes that print as themselves keep their
    character, the rest take the characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    alphabet, extra = {}, 0
    for b in range(256):
        if b in printable:
            alphabet[b] = chr(b)
        else:
            alphabet[b] = chr(256 + extra)
            extra += 1
    return alphabet


# str.translate table: a byte-level character -> the code point of its byte, so latin-1 encoding yields the bytes
_FROM_BYTE_LEVEL = {ord(c): b for b, c in byte_level_alphabet().items()}


def spelling(backend: BackendTokenizer) -> str:
    """How the vocabulary spells bytes: "byte_level", "sentencepiece", or "other" (no byte spelling known)."""
    decoder = json.loads(backend.decoder.__getstate__()) if backend.decoder is not None else {}
    kinds = [decoder.get("type")] + [d.get("type") for d in decoder.get("decoders", [])]
    if "ByteLevel" in kinds:
        return "byte_level"
    replaces_marker = any(d.get("type") == "Replace" and d.get("pattern", {}).get("String") == "\u2581"
                          for d in decoder.get("decoders", []))
    return "sentencepiece" if replaces_marker or "Metaspace" in kinds else "other"


def vocabulary_bytes(backend: BackendTokenizer, vocab_size: int, kind: str | None = None) -> list[bytes | None]:
    """For each id below ``vocab_size``: the bytes it writes, b"" for an id with no token, None where the spelling
    is unknown. Added tokens (special or not) write their text as it stands."""
    kind = kind or spelling(backend)
    out: list[bytes | None] = [b""] * vocab_size
    for token, i in backend.get_vocab(with_added_tokens=False).items():
        if i < vocab_size:
            out[i] = _model_token_bytes(token, kind)
    for i, added in backend.get_added_tokens_decoder().items():
        if i < vocab_size:
            out[i] = added.content.encode("utf-8", "surrogatepass")
    return out


def _model_token_bytes(token: str, kind: str) -> bytes | None:
    if kind == "byte_level":
        try:
            return token.translate(_FROM_BYTE_LEVEL).encode("latin-1")
        except UnicodeEncodeError:  # a character outside the byte alphabet
            return None
    if kind == "sentencepiece":
        fallback = _BYTE_FALLBACK.fullmatch(token)
        if fallback:
            return bytes([int(fallback.group(1), 16)])
        return token.replace("\u2581", " ").encode("utf-8", "surrogatepass")
    return None


def is_byte_fallback(backend: BackendTokenizer, ids: Sequence[int]) -> list[bool]:
    """Whether each id is a SentencePiece byte-fallback token (``<0xNN>``)."""
    return [bool(_BYTE_FALLBACK.fullmatch(backend.id_to_token(int(i)) or "")) for i in ids]
