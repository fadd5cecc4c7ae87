"""The Tokenizer: text <-> token ids, special tokens and the chat template of one model."""
from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer as BackendTokenizer

from quickdraft.errors import ModelLoadError, require_unicode
from quickdraft.tokenizer.chat import default_template, render_chat_template
from quickdraft.tokenizer.gguf_vocab import build_from_gguf_metadata
from quickdraft.tokenizer.spm_vocab import CONTROL_LOOKING
from quickdraft.tokenizer.token_bytes import vocabulary_bytes

# Tokens that end a chat turn or a document in common chat vocabularies. When one of them is a
# special token of the vocabulary it stops generation along with the eos token.
# (llama.cpp's end-of-generation list, see llama-vocab.cpp.)
END_OF_TURN_TOKENS = (
    "<|im_end|>",
    "<|endoftext|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end|>",
    "<end_of_turn>",
    "<|end_of_text|>",
    "<EOT>",
    "<｜end▁of▁sentence｜>",
    "<end_of_utterance>",
)
# gpt-oss's harmony ends a turn with <|return|> (an answer) or <|call|> (a tool call); its <|end|> only closes one
# message of the turn (the reasoning, before the answer), so there it does not stop generation (as in llama.cpp).
HARMONY_TURN_ENDS = ("<|return|>", "<|call|>")


class Tokenizer:
    """A model's tokenizer, backed by a HF `tokenizers.Tokenizer`.

    Build one with `Tokenizer.from_gguf_metadata(...)` or `Tokenizer.from_hf_dir(...)`.
    """

    def __init__(
        self,
        backend: BackendTokenizer,
        *,
        bos_token_id: int | None = None,
        eos_token_id: int | None = None,
        extra_eos_token_ids: Sequence[int] = (),
        unk_token_id: int | None = None,
        pad_token_id: int | None = None,
        add_bos: bool = False,
        chat_template: str | None = None,
        vocab_size: int | None = None,
        prepend_bos: bool = False,
    ) -> None:
        self._backend = backend
        self.vocab_size: int = max(vocab_size or 0, backend.get_vocab_size(with_added_tokens=True))
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.unk_token_id = unk_token_id
        self.pad_token_id = pad_token_id
        self.add_bos = bool(add_bos)
        self.chat_template = chat_template
        # the backend's post-processor adds BOS itself unless told otherwise
        self._prepend_bos = bool(prepend_bos) and bos_token_id is not None

        added = backend.get_added_tokens_decoder()
        self.special_token_ids: frozenset[int] = frozenset(i for i, t in added.items() if t.special)
        eos: list[int] = []
        if eos_token_id is not None:
            eos.append(eos_token_id)
        for tid in extra_eos_token_ids:
            if tid is not None and tid not in eos:
                eos.append(tid)
        harmony = all(backend.token_to_id(t) in self.special_token_ids for t in HARMONY_TURN_ENDS)
        for text in HARMONY_TURN_ENDS + END_OF_TURN_TOKENS if harmony else END_OF_TURN_TOKENS:
            tid = backend.token_to_id(text)
            if tid is not None and tid in self.special_token_ids and tid not in eos:
                eos.append(tid)
        if harmony:  # even where a file declares it (an eot id), as llama.cpp drops it
            eos = [tid for tid in eos if tid != backend.token_to_id("<|end|>")]
        self.eos_token_ids: tuple[int, ...] = tuple(eos)
        self._token_bytes: list[bytes | None] | None = None
        self._plain: BackendTokenizer | None = None  # the backend that reads special tokens' texts as text
        self._plain_lock = threading.Lock()

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_gguf_metadata(cls, metadata: dict[str, Any], chat_template: str | None = None) -> "Tokenizer":
        """Rebuild the tokenizer described by a GGUF file's metadata (a plain dict of its fields).

        `chat_template`, when given, replaces the file's `tokenizer.chat_template`.
        """
        vocab = build_from_gguf_metadata(metadata)
        template = chat_template if chat_template is not None else metadata.get("tokenizer.chat_template")
        if template is not None and not isinstance(template, str):
            raise ModelLoadError(f"GGUF field tokenizer.chat_template must be a string, got {type(template).__name__}")
        return cls(
            vocab.backend,
            bos_token_id=vocab.bos_token_id,
            eos_token_id=vocab.eos_token_id,
            extra_eos_token_ids=vocab.extra_eos_token_ids,
            unk_token_id=vocab.unk_token_id,
            pad_token_id=vocab.pad_token_id,
            add_bos=vocab.add_bos,
            chat_template=template or None,
            vocab_size=len(vocab.tokens),
        )

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> "Tokenizer":
        """Load tokenizer.json + tokenizer_config.json (+ chat_template.jinja) from a HF model directory."""
        path = Path(path)
        tokenizer_file = path / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ModelLoadError(f"{path} has no tokenizer.json (a HF model directory needs one)")
        try:
            backend = BackendTokenizer.from_file(str(tokenizer_file))
        except Exception as exc:
            raise ModelLoadError(f"{tokenizer_file} cannot be loaded: {type(exc).__name__}: {exc}") from exc

        config: dict[str, Any] = {}
        config_file = path / "tokenizer_config.json"
        if config_file.is_file():
            try:
                config = json.loads(config_file.read_text(encoding="utf-8"))
            except (OSError, ValueError) as exc:
                raise ModelLoadError(f"{config_file} is not valid JSON: {exc}") from exc
            if not isinstance(config, dict):
                raise ModelLoadError(f"{config_file} must hold a JSON object")

        # special tokens: tokenizer_config.json, then generation_config.json / config.json for eos ids
        def token_id(name: str) -> int | None:
            value = config.get(name)
            if isinstance(value, dict):
                value = value.get("content")
            if not isinstance(value, str):
                return None
            return backend.token_to_id(value)

        bos_id, eos_id = token_id("bos_token"), token_id("eos_token")
        extra_eos: list[int] = []
        for extra_file in ("generation_config.json", "config.json"):
            f = path / extra_file
            if not f.is_file():
                continue
            try:
                data = json.loads(f.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                continue
            ids = data.get("eos_token_id") if isinstance(data, dict) else None
            ids = [ids] if isinstance(ids, int) else ids if isinstance(ids, list) else []
            extra_eos.extend(i for i in ids if isinstance(i, int))
            if bos_id is None and isinstance(data, dict) and isinstance(data.get("bos_token_id"), int):
                bos_id = data["bos_token_id"]
        if eos_id is None and extra_eos:
            eos_id = extra_eos[0]

        # does the tokenizer.json post-processor add BOS? tokenizer_config may ask for it on top
        probe = backend.encode("", add_special_tokens=True).ids
        adds_bos = bos_id is not None and bool(probe) and probe[0] == bos_id
        prepend = bool(config.get("add_bos_token")) and bos_id is not None and not adds_bos

        template = config.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": "..."}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default") or next(iter(named.values()), None)
        jinja_file = path / "chat_template.jinja"
        if jinja_file.is_file():
            template = jinja_file.read_text(encoding="utf-8")
        if template is not None and not isinstance(template, str):
            template = None

        return cls(
            backend,
            bos_token_id=bos_id,
            eos_token_id=eos_id,
            extra_eos_token_ids=extra_eos,
            unk_token_id=token_id("unk_token"),
            pad_token_id=token_id("pad_token"),
            add_bos=adds_bos or prepend,
            chat_template=template or None,
            prepend_bos=prepend,
        )

    # ------------------------------------------------------------------ text <-> ids

    @property
    def backend(self) -> BackendTokenizer:
        """The underlying `tokenizers.Tokenizer`."""
        return self._backend

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids for `text`. Special tokens written in the text (e.g. '<|im_start|>') become
        their ids, as in HF. `add_special_tokens` adds BOS (and EOS) when the model asks for it."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        require_unicode("text to tokenize", text)
        ids = self._backend.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self._prepend_bos and (not ids or ids[0] != self.bos_token_id):
            ids = [self.bos_token_id, *ids]
        return ids

    def encode_plain(self, text: str) -> list[int]:
        """Token ids for ``text`` as plain text: a special token's spelling in it (a '<|fim_middle|>' in someone's
        code) stays text, as llama.cpp's tokenizer without parse_special reads it (the tokens llama.cpp makes
        control tokens too, where a tokenizer.json leaves them plain added tokens); no BOS or EOS. The first call
        copies the vocabulary (about a second for a 150k one): call it off an event loop; the encoding itself lets
        other Python threads run."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        require_unicode("text to tokenize", text)
        with self._plain_lock:
            if self._plain is None:  # a copy: the flag is the backend's, and other threads encode with this one
                plain = BackendTokenizer.from_str(self._backend.to_str())
                added = {t.content for t in plain.get_added_tokens_decoder().values()}
                plain.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in CONTROL_LOOKING
                                          if t in added])
                plain.encode_special_tokens = True
                self._plain = plain
        return self._plain.encode_batch([text], add_special_tokens=False)[0].ids  # (the batch call frees the GIL)

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = True) -> list[list[int]]:
        return [self.encode(t, add_special_tokens) for t in texts]

    def _check_ids(self, ids: Sequence[int]) -> list[int]:
        out = []
        for tid in ids:
            tid = int(tid)
            if not 0 <= tid < self.vocab_size:
                raise ValueError(f"token id {tid} is out of range: this tokenizer knows ids 0..{self.vocab_size - 1}")
            out.append(tid)
        return out

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text for `ids`. Invalid UTF-8 (e.g. a cut multi-byte character) decodes to U+FFFD."""
        return self._backend.decode(self._check_ids(ids), skip_special_tokens=skip_special_tokens)

    def token_bytes(self) -> list[bytes | None]:
        """The bytes each id writes into the text (an added token: its text; None: a spelling this tokenizer's
        decoder does not say), computed once (see token_bytes.py)."""
        if self._token_bytes is None:
            self._token_bytes = vocabulary_bytes(self._backend, self.vocab_size)
        return self._token_bytes

    def token_to_id(self, token: str) -> int | None:
        """Id of a vocabulary entry spelled as the vocabulary spells it (e.g. 'Ġworld', '<|im_end|>')."""
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(int(token_id))

    def is_special(self, token_id: int) -> bool:
        return token_id in self.special_token_ids

    @property
    def bos_token(self) -> str | None:
        return None if self.bos_token_id is None else self._backend.id_to_token(self.bos_token_id)

    @property
    def eos_token(self) -> str | None:
        return None if self.eos_token_id is None else self._backend.id_to_token(self.eos_token_id)

    # ------------------------------------------------------------------ chat

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """Render a conversation with the model's chat template (ChatML when the model has none).

        Bad messages raise ValueError. Extra keyword arguments (e.g. tools) reach the template.
        """
        specials = {
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "unk_token": None if self.unk_token_id is None else self._backend.id_to_token(self.unk_token_id),
            "pad_token": None if self.pad_token_id is None else self._backend.id_to_token(self.pad_token_id),
        }
        template = self.chat_template or default_template(lambda t: self.token_to_id(t) is not None)
        return render_chat_template(template, messages, add_generation_prompt, specials, **kwargs)

    def __repr__(self) -> str:
        return (
            f"Tokenizer(vocab_size={self.vocab_size}, bos_token_id={self.bos_token_id}, "
            f"eos_token_ids={self.eos_token_ids}, add_bos={self.add_bos})"
        )
