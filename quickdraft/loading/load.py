"""``load_checkpoint``: a packaged model name, a GGUF file or a Hugging Face directory -> a ``Checkpoint``."""
from __future__ import annotations

import os

import torch

from quickdraft.errors import ModelLoadError
from quickdraft.loading import cache_budget
from quickdraft.loading.checkpoint import Checkpoint
from quickdraft.loading.gguf import load_gguf
from quickdraft.loading.hf import load_hf_dir
from quickdraft.loading.registry import resolve_model


def load_checkpoint(
    name_or_path: str | os.PathLike,
    dtype: torch.dtype = torch.float32,
    *,
    use_cache: bool = True,
) -> Checkpoint:
    """Load a packaged model name, a ``.gguf`` file, or a Hugging Face model directory: its header and config now,
    its tensors when a model is built from them (``Checkpoint.tensors``).

    Raises ModelLoadError (naming the path and what is allowed) when the model is
    missing, corrupt or unsupported.
    """
    cache_budget.limit_bytes()  # a bad bound is refused before any model work, not once an entry is written
    path = resolve_model(name_or_path)
    if path.is_dir():
        return _marked(load_hf_dir(path, dtype))
    if not path.is_file():
        raise ModelLoadError(f"{path} is neither a file nor a directory")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic == b"GGUF" or path.suffix.lower() == ".gguf":
        return _marked(load_gguf(path, dtype, use_cache=use_cache))
    hint = " (pass the model directory that holds config.json)" if path.suffix in (".safetensors", ".json", ".bin") else ""
    raise ModelLoadError(
        f"{path} is not a GGUF file (magic {magic!r}, expected b'GGUF'){hint}; "
        "supported: a .gguf file, a Hugging Face directory with config.json and *.safetensors, or a packaged model name"
    )


def _marked(checkpoint: Checkpoint) -> Checkpoint:
    """The checkpoint, its cache entries marked used now: the model built from it opens them later."""
    cache_budget.mark_source_used(checkpoint.fingerprint)
    return checkpoint
