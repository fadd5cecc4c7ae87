"""safetensors files written one tensor at a time and read back memory-mapped, without a copy.

The caches (converted weights) go through here, so that neither writing nor reading one ever holds a whole model:
``TensorFileWriter`` writes each tensor as it is produced and the header last, into space reserved at the start (the
format allows a header padded with spaces); ``map_tensors`` maps the file and hands out tensors that point into the
mapping, so pages are read from disk when first touched (an embedding table costs only the rows used) and shared
with the page cache. The files stay valid safetensors files.
"""
from __future__ import annotations

import contextlib
import json
import logging
import math
import mmap
import os
import struct
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file

log = logging.getLogger(__name__)

ALIGN = 64  # every tensor starts on a cache line, as an allocated one would
HEADER_RESERVE = 1 << 20  # header space (the 8-byte length included): room for ~5000 entries
ENTRY_RESERVE = 512  # more room per tensor beyond those: a mixture of experts has thousands of tensors


def header_room(tensors: int) -> int:
    """Header space for a file of about ``tensors`` tensors (each entry and its share of the metadata)."""
    return HEADER_RESERVE + ENTRY_RESERVE * tensors
MAX_HEADER = 100 << 20  # safetensors' own limit
PAD_PREFIX = "__pad"  # filler entries that keep the data section without holes while aligning the next tensor
COPY_CHUNK = 8 << 20  # bytes TensorFile.copy moves between letting go of mapped pages

DTYPE_NAMES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
               torch.int8: "I8", torch.uint8: "U8", torch.int16: "I16", torch.int32: "I32", torch.int64: "I64",
               torch.bool: "BOOL"}
DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items()}


class TensorFileWriter:
    """Write a safetensors file tensor by tensor; ``finish`` renames it into place atomically (after an fsync), so a
    reader sees the old file or the whole new one. ``abort`` (or an exception inside ``with``) removes the partial file.
    """

    def __init__(self, path: Path, reserve: int = HEADER_RESERVE) -> None:
        self.path, self.reserve = Path(path), reserve
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, self.tmp = tempfile.mkstemp(prefix=self.path.name + ".", suffix=".tmp", dir=self.path.parent)
        self.file = os.fdopen(fd, "wb")
        self.file.seek(reserve)
        self.entries: dict[str, dict] = {}
        self.offset = 0
        self.finished = False

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self.entries or name.startswith(PAD_PREFIX):
            raise ValueError(f"tensor name {name!r} is taken or reserved")
        t = tensor.detach().to("cpu").contiguous()
        if t.dtype not in DTYPE_NAMES:
            raise ValueError(f"{name}: dtype {t.dtype} cannot be stored")
        pad = -self.offset % ALIGN
        if pad:
            self._entry(f"{PAD_PREFIX}{len(self.entries)}", "U8", [pad], pad)
            self.file.write(bytes(pad))
        nbytes = t.numel() * t.element_size()
        self._entry(name, DTYPE_NAMES[t.dtype], list(t.shape), nbytes)
        if nbytes:
            self.file.write(t.reshape(-1).view(torch.uint8).numpy().data)

    def _entry(self, name: str, dtype: str, shape: list[int], nbytes: int) -> None:
        self.entries[name] = {"dtype": dtype, "shape": shape, "data_offsets": [self.offset, self.offset + nbytes]}
        self.offset += nbytes

    def finish(self, metadata: dict[str, str]) -> Path:
        header = json.dumps({"__metadata__": metadata, **self.entries}, separators=(",", ":")).encode()
        room = self.reserve - 8
        if len(header) > room:
            raise ValueError(f"{self.path.name}: header of {len(header):,} bytes does not fit the {room:,} reserved")
        self.file.seek(0)
        self.file.write(struct.pack("<Q", room) + header + b" " * (room - len(header)))
        self.file.close()
        _commit(self.tmp, self.path, 0o644)
        self.finished = True
        return self.path

    def abort(self) -> None:
        self.file.close()
        try:
            os.unlink(self.tmp)
        except OSError:
            pass

    def __enter__(self) -> TensorFileWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if not self.finished:  # an exception, or finish failed before the rename: no partial file stays
            self.abort()


class TensorFile:
    """A mapped safetensors file: its tensors point into one private memory map of it."""

    def __init__(self, tensors: dict[str, torch.Tensor], metadata: dict[str, str], mapping: mmap.mmap | None) -> None:
        self.tensors, self.metadata, self._mapping = tensors, metadata, mapping
        self._base = torch.frombuffer(mapping, dtype=torch.uint8, count=1).data_ptr() if mapping is not None else 0

    def copy(self, name: str) -> torch.Tensor:
        """An own copy of a tensor, made a few MiB at a time, each part's mapped pages let go as soon as it is copied
        (so the copy never holds a tensor twice). For weights a decode step reads whole every time: anonymous memory
        gets huge pages where the kernel gives them (transparent huge pages), a file mapping 4 KiB pages, whose TLB
        misses cost a step several percent (docs/MEASUREMENTS.md, *Memory*)."""
        t = self.tensors[name]
        if self._mapping is None or t.dim() == 0 or not t.numel():
            return t.clone()
        out = torch.empty_like(t)
        row_bytes = max(1, t[0].numel() * t.element_size())
        step = max(1, COPY_CHUNK // row_bytes)
        for r0 in range(0, t.shape[0], step):
            out[r0:r0 + step] = t[r0:r0 + step]
            self._let_go(t[r0:r0 + step])
        return out

    def _let_go(self, t: torch.Tensor) -> None:
        """Drop this process's mapping of the whole pages under a contiguous part of a mapped tensor."""
        start = t.data_ptr() - self._base
        drop_pages(self._mapping, start, start + t.numel() * t.element_size())

    def release_pages(self) -> None:
        """Drop this process's hold on the pages read so far (they stay in the page cache and come back on the next
        read): after a load that copied most tensors elsewhere (packing), only what is still used counts as ours."""
        if self._mapping is not None:
            self._mapping.madvise(mmap.MADV_DONTNEED)


def drop_pages(mapping: mmap.mmap, start: int, end: int) -> None:
    """Let go of the whole pages inside bytes [start, end) of a mapping (a page also holding bytes outside the range
    stays): an anonymous page reads as zeros afterwards, a file page comes back from the file."""
    page = mmap.PAGESIZE
    first, last = -(-start // page) * page, end // page * page
    if last > first:
        mapping.madvise(mmap.MADV_DONTNEED, first, last - first)


def open_tensor_file(path: Path, expected: dict[str, str], what: str) -> TensorFile | None:
    """The mapped file at ``path`` when its metadata has every ``expected`` key/value; None when it is missing, and
    None (the file removed, with a warning) when it is damaged or stale."""
    if not Path(path).is_file():
        return None
    try:
        tensors, metadata, mapping = map_tensors(path)
        if any(metadata.get(k) != v for k, v in expected.items()):
            raise ValueError("metadata does not match the source")
        return TensorFile(tensors, metadata, mapping)
    except OSError as exc:  # cannot be mapped now (address space, map count): the file itself may be fine
        log.warning("cannot map %s %s (%s); loading without it", what, path, exc)
        return None
    except (ValueError, KeyError, TypeError, RecursionError) as exc:
        log.warning("ignoring damaged %s %s (%s: %s); rebuilding", what, path, type(exc).__name__, exc)
        try:
            Path(path).unlink()
        except OSError:
            pass
        return None


def map_tensors(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str], mmap.mmap | None]:
    """The tensors of a safetensors file, pointing into a private memory map of it (nothing is read until used),
    its metadata and the map. Raises ValueError for a file that is not a whole, consistent safetensors file."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{path}: too short for a safetensors header")
        (n,) = struct.unpack("<Q", head)
        if not 0 < n <= min(MAX_HEADER, size - 8):
            raise ValueError(f"{path}: header length {n:,} does not fit the file of {size:,} bytes")
        header = json.loads(f.read(n))
        # ACCESS_COPY: a writable view (torch wants one) whose pages are the page cache's until written, never written
        mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if size > 8 + n else None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: the header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise ValueError(f"{path}: __metadata__ is not a map of strings to strings")
    base, tensors, spans = 8 + n, {}, []
    for name, entry in header.items():
        dtype = DTYPES.get(entry.get("dtype")) if isinstance(entry, dict) else None
        if dtype is None:
            raise ValueError(f"{path}: tensor {name!r} has an unknown dtype")
        shape = [int(s) for s in entry["shape"]]
        start, end = (int(o) for o in entry["data_offsets"])
        count = math.prod(shape)
        if min(shape, default=0) < 0 or end - start != count * dtype.itemsize or start < 0 or base + end > size:
            raise ValueError(f"{path}: tensor {name!r} does not fit its offsets or the file")
        spans.append((start, end))
        if name.startswith(PAD_PREFIX):
            continue
        if count == 0:
            tensors[name] = torch.empty(shape, dtype=dtype)
        elif (base + start) % dtype.itemsize:  # a misaligned tensor (another writer's file) is copied, not mapped
            raw = torch.frombuffer(mapping, dtype=torch.uint8, count=end - start, offset=base + start)
            tensors[name] = raw.clone().view(dtype).view(shape)
        else:
            tensors[name] = torch.frombuffer(mapping, dtype=dtype, count=count, offset=base + start).view(shape)
    spans.sort()
    if any(prev_end > start for (_, prev_end), (start, _) in zip(spans, spans[1:])):
        raise ValueError(f"{path}: tensors overlap")
    return tensors, metadata, mapping


@contextlib.contextmanager
def atomic_path(path: Path, mode: int = 0o644) -> Iterator[str]:
    """A temporary file beside ``path`` to write whole. Leaving the block without an exception puts it in place
    (``_commit``); an exception removes it. A file left by a killed writer is named ``<name>.<random>.tmp`` and is
    never read as ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        yield tmp
        _commit(tmp, path, mode)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _commit(tmp: str, path: Path, mode: int) -> None:
    """Put a fully written temporary file in place: given ``mode`` (mkstemp makes it private), its data synced, renamed
    over ``path`` and the rename synced, so after a crash (even a power loss) ``path`` holds the old file or the new
    one, whole."""
    os.chmod(tmp, mode)
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def write_atomic(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str], what: str,
                 *, strict: bool = False, mode: int = 0o644) -> Path | None:
    """Write a safetensors file whole (``atomic_path``), so a reader never sees half a file.

    ``strict=False`` (caches): a read-only or full disk is not an error, loading still works, just
    uncached (None). ``strict=True`` (session snapshots): any failure raises (OSError and friends).
    ``mode``: the file's permissions (0o600 for session snapshots, which hold a conversation)."""
    try:
        with atomic_path(path, mode) as tmp:
            save_file(tensors, tmp, metadata=metadata)
        return path
    except Exception as exc:
        if strict:
            raise
        log.warning("could not write %s %s: %s", what, path, exc)
        return None


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
