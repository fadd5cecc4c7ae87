"""A loaded checkpoint (config + HF-named tensors) and the entry point that loads one."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from quickdraft.config import ADDED_FIELDS, ModelConfig

_EDGE_BYTES = 1 << 20


class LazyTensors(Mapping[str, torch.Tensor]):
    """Tensors by name, each made when it is read (dequantized, converted to the dtype) and not kept here.

    A model is built from one of these a tensor at a time, so loading never holds the whole model in float: a
    quantized layer is converted straight from the file's blocks, and a float one is packed and its source dropped
    before the next is made."""

    def __init__(self, makers: dict[str, Callable[[], torch.Tensor]]) -> None:
        self._makers = makers

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._makers[name]()

    def __contains__(self, name: object) -> bool:  # Mapping's default would make the tensor to find out
        return name in self._makers

    def __iter__(self) -> Iterator[str]:
        return iter(self._makers)

    def __len__(self) -> int:
        return len(self._makers)


@dataclass
class Checkpoint:
    """Weights ready for ``quickdraft.models.transformer.Transformer``.

    ``tensors`` uses Hugging Face names (``model.layers.0.self_attn.q_proj.weight``) in the requested dtype and HF
    layout, made when read (``LazyTensors``). With ``config.tie_word_embeddings`` the entry ``lm_head.weight`` reads the
    embedding (a strict ``load_state_dict`` works; it is stored once).
    """

    config: ModelConfig
    tensors: Mapping[str, torch.Tensor]
    source: Path  # resolved GGUF file or HF directory
    fingerprint: str  # identifies the exact source file(s); changes when the model file changes
    chat_template: str | None
    gguf_metadata: dict[str, Any] | None  # all GGUF key/values (tokenizer.ggml.* etc.); None for HF dirs
    hf_dir: Path | None  # the HF directory (tokenizer.json lives there); None for GGUF
    quantization: str  # e.g. 'Q4_1', 'Q4_K_M' for GGUF, 'safetensors' for HF directories
    # GGUF: each tensor's GGML type as stored ('Q4_1', 'F32', ...) by HF name, a tied lm_head under its own name
    # too (what weights='auto' follows); None for HF directories
    tensor_types: dict[str, str] | None = None
    # GGUF: each tensor's blocks as the file stores them (uint8, memory-mapped when read, permuted q/k rows as they
    # are) and their GGML type id, by HF name (a tied lm_head has none); what int4 maps exactly. None for HF dirs.
    blocks: Mapping[str, Any] | None = None
    block_types: dict[str, int] | None = None
    dtype: torch.dtype = torch.float32  # of the float tensors ``tensors`` makes
    # mapped weight files the tensors point into (HF safetensors), whose pages a load lets go once it has copied them
    files: list[Any] = dataclasses.field(default_factory=list)

    def content_fingerprint(self) -> str:
        """Identity of the weights by content (see ``content_fingerprint``), computed once: unlike
        ``fingerprint`` it stays the same when the model file is copied, moved or touched."""
        cached = self.__dict__.get("_content_fingerprint")
        if cached is None:
            cached = self.__dict__["_content_fingerprint"] = content_fingerprint(self.source, self.config)
        return cached


def _hash_file(h: "hashlib._Hash", path: Path) -> None:
    st = path.stat()
    h.update(f"{path.resolve()}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
    with open(path, "rb") as f:
        h.update(f.read(_EDGE_BYTES))
        if st.st_size > 2 * _EDGE_BYTES:
            f.seek(st.st_size - _EDGE_BYTES)
            h.update(f.read(_EDGE_BYTES))


def fingerprint(path: str | os.PathLike) -> str:
    """Cheap identity of a model file or HF directory: resolved path, size, mtime_ns,
    plus a hash of the first and last MiB of each weight file (no full read)."""
    path = Path(path).resolve()
    h = hashlib.sha256(b"quickdraft-fingerprint-v1\0")
    if path.is_dir():
        files = sorted(
            p for p in path.iterdir()
            if p.is_file() and (p.suffix in (".safetensors", ".json", ".jinja", ".gguf"))
        )
        for p in files:
            _hash_file(h, p)
    else:
        _hash_file(h, path)
    return h.hexdigest()[:32]


def _hash_content(h: "hashlib._Hash", path: Path, name: str) -> None:
    size = path.stat().st_size
    h.update(f"{name}\0{size}\0".encode())
    with open(path, "rb") as f:
        h.update(f.read(_EDGE_BYTES))
        if size > 2 * _EDGE_BYTES:
            f.seek(size - _EDGE_BYTES)
            h.update(f.read(_EDGE_BYTES))


def content_fingerprint(path: str | os.PathLike, config: ModelConfig | None = None) -> str:
    """Identity of a model file or HF directory by content only: each weight/config file's size and a hash
    of its first and last MiB (names relative to the directory), plus the parsed ``ModelConfig``.
    Neither the path nor the mtime is part of it, so a copied model file has the same fingerprint."""
    path = Path(path).resolve()
    h = hashlib.sha256(b"quickdraft-content-fingerprint-v1\0")
    if path.is_dir():
        for p in sorted(p for p in path.iterdir()
                        if p.is_file() and p.suffix in (".safetensors", ".json", ".jinja", ".gguf")):
            _hash_content(h, p, p.name)
    else:
        _hash_content(h, path, "")
    if config is not None:
        defaults = ModelConfig.__dataclass_fields__
        fields = {name: value for name, value in dataclasses.asdict(config).items()
                  if name not in ADDED_FIELDS or value != defaults[name].default}
        h.update(json.dumps(fields, sort_keys=True, default=str).encode())
    return h.hexdigest()[:32]
