"""The converted-weight caches held under a disk budget: the least recently used entries go first.

An entry of ``weights/`` or ``quantized/`` is a whole converted model (hundreds of MB to tens of GB), keyed by its
source's path, size and mtime (``checkpoint.fingerprint``): a model that is moved, copied or rewritten gets a new
entry and leaves the old one behind, so without a bound these folders only grow. After an entry is written,
``trim`` deletes the least recently used others until the folders fit ``$QUICKDRAFT_CACHE_MAX_GB`` (default
``DEFAULT_LIMIT_GB``; ``none`` for no bound). Opening an entry marks it used (its access time, set explicitly: a
mount may not keep them; its mtime stays when it was written). Every entry can be rebuilt from its source, which is
what the next load of a dropped one does.
"""
from __future__ import annotations

import logging
import math
import os
import re
import stat
import time
from dataclasses import dataclass
from pathlib import Path

from quickdraft.errors import InvalidParameterError
from quickdraft.paths import cache_root

log = logging.getLogger(__name__)

LIMIT_ENV = "QUICKDRAFT_CACHE_MAX_GB"
DEFAULT_LIMIT_GB = 64.0
# The folders of entries derived from model files; models/ (assembled packages) and kernels/ (built code) are not
# rebuilt from the user's own files and stay.
BUDGETED = ("weights", "quantized")
# What quickdraft names its entries (a 32-digit fingerprint first; a file being written adds ``.<random>.tmp``): only
# these are ever deleted, whatever else a folder named by $QUICKDRAFT_CACHE_DIR holds.
ENTRY_NAME = re.compile(r"[0-9a-f]{32}-[\w.-]+\.(safetensors|json)(\.\w+\.tmp)?")
# A cache file is written a tensor at a time: one untouched this long was left by a process that died writing it.
ABANDONED_S = 3600.0


@dataclass(frozen=True)
class CacheEntry:
    path: Path
    size: int
    last_used_ns: int  # the file's access time


def limit_bytes() -> int | None:
    """The budget ``$QUICKDRAFT_CACHE_MAX_GB`` sets, in bytes (None: no bound). Raises InvalidParameterError for a
    value that is not a number of GB >= 0 or ``none``."""
    raw = os.environ.get(LIMIT_ENV, "").strip()
    if not raw:
        return int(DEFAULT_LIMIT_GB * 1e9)
    if raw.lower() == "none":
        return None
    try:
        gb = float(raw)
    except ValueError:
        gb = math.nan
    if not (math.isfinite(gb * 1e9) and gb >= 0):  # 1e300 GB: no count of bytes
        raise InvalidParameterError(f"{LIMIT_ENV}={raw[:40]!r}: give the converted-weight caches' bound as a number "
                                    f"of GB >= 0 (0 keeps only the entry in use), or 'none' for no bound")
    return int(gb * 1e9)


def entries(root: Path | None = None) -> list[CacheEntry]:
    """The budgeted folders' files, least recently used first. A file being written (``*.tmp``, renamed into place
    when whole) is another process's, left alone unless nothing was written to it for ``ABANDONED_S``."""
    found = []
    for folder in BUDGETED:
        for path in ((root or cache_root()) / folder).glob("*"):
            try:
                st = path.stat()
            except OSError:  # removed meanwhile by another process
                continue
            if not (ENTRY_NAME.fullmatch(path.name) and stat.S_ISREG(st.st_mode)) or (
                    path.suffix == ".tmp" and time.time() - st.st_mtime < ABANDONED_S):
                continue
            found.append(CacheEntry(path, st.st_size, max(st.st_atime_ns, st.st_mtime_ns)))
    return sorted(found, key=lambda e: e.last_used_ns)


def mark_used(path: Path) -> None:
    """Record that ``path`` was read now, so that ``trim`` keeps it over entries read longer ago."""
    try:
        os.utime(path, ns=(time.time_ns(), path.stat().st_mtime_ns))
    except OSError:  # a read-only cache still serves
        pass


def mark_source_used(fingerprint: str) -> None:
    """Mark every entry of one source used: a load that opens them only later (a target whose draft is read
    first) must not see them dropped for the entries written meanwhile."""
    for entry in entries():
        if entry.path.name.startswith(fingerprint + "-"):
            mark_used(entry.path)


def trim(keep: Path) -> list[Path]:
    """Delete the least recently used entries other than ``keep`` (just written or opened) until the budgeted
    folders fit the limit; the removed files are returned. A model mapped from a removed file keeps running: the
    file's pages stay until it is unmapped."""
    limit = limit_bytes()
    if limit is None:
        return []
    found = entries()
    total = sum(e.size for e in found)
    removed, freed = [], 0
    for entry in found:
        if total <= limit:
            break
        if entry.path == keep or not _remove(entry.path):
            continue
        total -= entry.size
        freed += entry.size
        removed.append(entry.path)
    if removed:
        log.info("removed %d least recently used cache entries (%.1f GB) to keep %s under %.1f GB",
                 len(removed), freed / 1e9, cache_root(), limit / 1e9)
    return removed


def usage(root: Path | None = None) -> dict[str, tuple[int, int]]:
    """Each folder of the cache root: (files, bytes)."""
    root = root or cache_root()
    folders = sorted(p for p in root.glob("*") if p.is_dir()) if root.is_dir() else []
    sizes = {}
    for folder in folders:
        files = [size for p in folder.rglob("*") if (size := _file_size(p)) is not None]
        sizes[folder.name] = (len(files), sum(files))
    return sizes


def _file_size(path: Path) -> int | None:
    """The size of a plain file; None for anything else, or a file another process removed or renamed meanwhile."""
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_size if stat.S_ISREG(st.st_mode) else None


def clear() -> tuple[int, int]:
    """Delete every entry of the budgeted folders: (files, bytes) removed."""
    removed = [entry for entry in entries() if _remove(entry.path)]
    return len(removed), sum(entry.size for entry in removed)


def _remove(path: Path) -> bool:
    """Delete one entry; False (with a warning) when it cannot be, True when it is gone (another process may have
    removed it first)."""
    try:
        path.unlink(missing_ok=True)
        return True
    except OSError as exc:
        log.warning("could not remove cache entry %s: %s", path, exc)
        return False
