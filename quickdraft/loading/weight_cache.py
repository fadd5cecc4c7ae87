"""On-disk cache of what loading a GGUF derives from it: the parsed header, and dequantized float weights.

* ``load_index`` / ``store_index``: the header's config, metadata and tensor offsets as JSON (parsing a large
  vocabulary's header with gguf-py takes seconds; reading this back, a fraction of one).
* ``float_weights``: every tensor of a checkpoint in a float dtype, written one tensor at a time and read back
  memory-mapped (for float weight formats: dequantizing a GGUF costs seconds, mapping the result nothing).

Entries are keyed by the source file's fingerprint (and the dtype), written atomically, and a damaged entry is
ignored and rebuilt; ``cache_budget`` drops the least recently used ones past a bound. Layout:
``$QUICKDRAFT_CACHE_DIR`` (or ``platformdirs.user_cache_dir('quickdraft')``) holds ``weights/`` (this cache),
``quantized/`` (``quant_cache.py``) and ``models/`` (assembled packaged models).
"""
from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from quickdraft.loading import cache_budget
from quickdraft.loading.tensor_file import TensorFile, TensorFileWriter, atomic_path, header_room, open_tensor_file
from quickdraft.paths import CACHE_ENV, cache_root  # noqa: F401  (re-exported)

log = logging.getLogger(__name__)

# Bump when the conversion (dequantization, name mapping, permutation) or the header record changes.
CACHE_FORMAT_VERSION = "3"


def weights_dir() -> Path:
    return cache_root() / "weights"


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``'bfloat16'``, as cache keys and format names spell it."""
    return str(dtype).removeprefix("torch.")


def index_path(fingerprint: str) -> Path:
    return weights_dir() / f"{fingerprint}-header-v{CACHE_FORMAT_VERSION}.json"


def cache_path(fingerprint: str, dtype: torch.dtype) -> Path:
    return weights_dir() / f"{fingerprint}-{dtype_name(dtype)}-v{CACHE_FORMAT_VERSION}.safetensors"


def load_index(fingerprint: str) -> dict[str, Any] | None:
    """The header record stored for this fingerprint, or None (a damaged one is removed)."""
    path = index_path(fingerprint)
    try:
        record = json.loads(path.read_text())
        if record.get("fingerprint") != fingerprint:
            raise ValueError("fingerprint does not match")
        return record  # marked used with the source's other entries (``load_checkpoint``)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except (OSError, ValueError, AttributeError) as exc:
        log.warning("ignoring damaged weight cache record %s (%s); rebuilding", path, exc)
        _unlink(path)
        return None


def store_index(fingerprint: str, record: dict[str, Any]) -> None:
    """Write the header record atomically; a cache that cannot be written is not an error."""
    path = index_path(fingerprint)
    try:
        with atomic_path(path) as tmp:
            Path(tmp).write_text(json.dumps({**record, "fingerprint": fingerprint}))
    except OSError as exc:
        log.warning("could not write weight cache record %s: %s", path, exc)


def float_weights(fingerprint: str, dtype: torch.dtype, tensors: Mapping[str, torch.Tensor],
                  names: list[str]) -> TensorFile | None:
    """The ``names`` of ``tensors`` (a lazy mapping in ``dtype``) as a memory-mapped file: the cached one, or one
    written now a tensor at a time. None when the cache cannot be written (the caller reads ``tensors`` directly)."""
    path = cache_path(fingerprint, dtype)
    meta = {"fingerprint": fingerprint, "dtype": dtype_name(dtype), "quickdraft_cache_version": CACHE_FORMAT_VERSION}
    names = sorted(names)
    cached = open_tensor_file(path, meta, "weight cache")
    if cached is not None and sorted(cached.tensors) == names:
        cache_budget.mark_used(path)
        return cached
    try:
        with TensorFileWriter(path, header_room(len(names))) as writer:
            for name in names:
                writer.add(name, tensors[name])
            writer.finish(meta)
    except (OSError, ValueError) as exc:
        log.warning("could not write weight cache %s: %s", path, exc)
        return None
    cache_budget.trim(keep=path)
    return open_tensor_file(path, meta, "weight cache")


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass
