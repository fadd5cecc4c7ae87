"""On-disk cache of dequantized GGUF weights as safetensors files.

Dequantizing a GGUF costs seconds; reading the cached safetensors back is a
memory map. Entries are keyed by the source file's fingerprint and the dtype,
written atomically (temporary file + ``os.replace``), and a damaged entry is
ignored and rebuilt. Tied embeddings are stored once.

Layout: ``$QUICKDRAFT_CACHE_DIR`` (or ``platformdirs.user_cache_dir('quickdraft')``)
holds ``weights/`` (this cache) and ``models/`` (assembled packaged models).
"""
from __future__ import annotations

import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from quickdraft.paths import CACHE_ENV, cache_root  # noqa: F401  (re-exported)

log = logging.getLogger(__name__)

# Bump when the conversion (dequantization, name mapping, permutation) changes.
CACHE_FORMAT_VERSION = "1"
TIED_KEY = "lm_head.weight"
EMBED_KEY = "model.embed_tokens.weight"


def weights_dir() -> Path:
    return cache_root() / "weights"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def cache_path(fingerprint: str, dtype: torch.dtype) -> Path:
    return weights_dir() / f"{fingerprint}-{_dtype_name(dtype)}-v{CACHE_FORMAT_VERSION}.safetensors"


def load_cached(fingerprint: str, dtype: torch.dtype) -> tuple[dict[str, torch.Tensor], dict[str, Any]] | None:
    """``(tensors, info)`` from the cache, tensors memory-mapped, or None on a miss or a
    damaged entry (which is removed). ``info`` is the JSON-able dict given to ``store``."""
    path = cache_path(fingerprint, dtype)
    if not path.is_file():
        return None
    try:
        from safetensors import safe_open
        from safetensors.torch import load_file

        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
        if meta.get("fingerprint") != fingerprint or meta.get("dtype") != _dtype_name(dtype):
            raise ValueError("metadata does not match the source")
        info = json.loads(meta["info"])
        tensors = load_file(str(path))
        if meta.get("tied") == "1":
            tensors[TIED_KEY] = tensors[EMBED_KEY]
        if sorted(tensors) != sorted(info["tensor_names"]):
            raise ValueError("tensor names do not match the recorded list")
        if any(t.dtype != dtype for t in tensors.values()):
            raise ValueError("tensor dtype does not match")
        return tensors, info
    except Exception as exc:  # any damage: rebuild from the source
        log.warning("ignoring damaged weight cache entry %s (%s: %s); rebuilding", path, type(exc).__name__, exc)
        try:
            path.unlink()
        except OSError:
            pass
        return None


def store(
    fingerprint: str, dtype: torch.dtype, tensors: dict[str, torch.Tensor], tied: bool, info: dict[str, Any]
) -> Path | None:
    """Write the tensors and a JSON-able ``info`` dict atomically; returns the path,
    or None when the cache cannot be written (loading still works, uncached)."""
    path = cache_path(fingerprint, dtype)
    to_save = {k: v.contiguous() for k, v in tensors.items() if not (tied and k == TIED_KEY)}
    meta = {
        "fingerprint": fingerprint,
        "dtype": _dtype_name(dtype),
        "tied": "1" if tied else "0",
        "quickdraft_cache_version": CACHE_FORMAT_VERSION,
        "info": json.dumps({**info, "tensor_names": sorted(tensors)}),
    }
    return write_atomic(path, to_save, meta, "weight cache")


def write_atomic(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str], what: str,
                 *, strict: bool = False, mode: int = 0o644) -> Path | None:
    """Write a safetensors file via a temporary file and rename, so a reader never sees half a file.

    The temporary file is fsynced before ``os.replace`` and the directory after it, so after a crash
    (even a power loss) the path holds the old file or the new one, whole. A temporary file left by a
    killed writer is named ``<name>.<random>.tmp`` and is never read as ``path``.
    ``strict=False`` (caches): a read-only or full disk is not an error, loading still works, just
    uncached (None). ``strict=True`` (session snapshots): any failure raises (OSError and friends).
    ``mode``: the file's permissions (0o600 for session snapshots, which hold a conversation)."""
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
        os.close(fd)
        save_file(tensors, tmp, metadata=metadata)
        os.chmod(tmp, mode)  # mkstemp makes it private
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        tmp = None
        _fsync_dir(path.parent)
        return path
    except Exception as exc:
        if strict:
            raise
        log.warning("could not write %s %s: %s", what, path, exc)
        return None
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass


def _fsync_dir(directory: Path) -> None:
    """Make a rename in ``directory`` durable (no-op where directories cannot be opened, e.g. Windows)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
