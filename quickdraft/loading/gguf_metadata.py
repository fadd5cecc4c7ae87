"""Read a GGUF header: key/value metadata into plain Python values, and where each tensor lies.

``read_header`` walks the whole header itself (bounds-checked reads from a read-only memory map) rather than
through gguf's ``GGUFReader``, which trusts every count, length and offset in the file (a hostile or damaged header
could make it loop over 2**64 items, allocate without bound, or fail with an IndexError deep inside) and is slow on
large vocabularies. Every field is checked against the file's size and the limits below, and each failure is a
ModelLoadError naming the field, its value and what is allowed.
"""
from __future__ import annotations

import math
import mmap
import reprlib
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFValueType

from quickdraft.errors import ModelLoadError
from quickdraft.loading.dequant import supported_type_names
from quickdraft.loading.ggml_types import ggml_type, type_name

SUPPORTED_VERSIONS = (2, 3)  # v1 used 32-bit counts
# Limits far above any real model's header, so a hostile count is refused before anything is read:
# a 70B llama has ~720 tensors, a vocabulary holds at most ~262k tokens (Gemma), merges as many.
MAX_TENSORS = 1 << 16
MAX_KV = 1 << 16
MAX_ARRAY_LEN = 1 << 20  # items in one array (~4x the largest vocabulary)
MAX_ARRAY_ITEMS = 1 << 21  # items in all arrays together (each string item becomes a Python object)
MAX_KEY_LEN = 1 << 16  # the GGUF spec's limit on a key
MAX_NAME_LEN = 1 << 12  # llama.cpp allows 64 bytes in a tensor name
MAX_DIMS = 4  # GGML_MAX_DIMS
DEFAULT_ALIGNMENT = 32

_SCALAR_SIZES = {
    GGUFValueType.UINT8: 1, GGUFValueType.INT8: 1, GGUFValueType.BOOL: 1,
    GGUFValueType.UINT16: 2, GGUFValueType.INT16: 2,
    GGUFValueType.UINT32: 4, GGUFValueType.INT32: 4, GGUFValueType.FLOAT32: 4,
    GGUFValueType.UINT64: 8, GGUFValueType.INT64: 8, GGUFValueType.FLOAT64: 8,
}
_VALUE_TYPES = frozenset(int(t) for t in GGUFValueType)
_MIN_KV_BYTES = 8 + 4 + 1  # key length, value type, the smallest value
_MIN_TENSOR_BYTES = 8 + 4 + 8 + 4 + 8  # name length, n_dims, one dimension, type, offset


def _value_types() -> str:
    return ", ".join(f"{t.name}={int(t)}" for t in GGUFValueType)


_FORMATS = {  # struct format and numpy dtype of each scalar type
    GGUFValueType.UINT8: ("<B", "<u1"), GGUFValueType.INT8: ("<b", "<i1"), GGUFValueType.BOOL: ("<?", "?"),
    GGUFValueType.UINT16: ("<H", "<u2"), GGUFValueType.INT16: ("<h", "<i2"),
    GGUFValueType.UINT32: ("<I", "<u4"), GGUFValueType.INT32: ("<i", "<i4"), GGUFValueType.FLOAT32: ("<f", "<f4"),
    GGUFValueType.UINT64: ("<Q", "<u8"), GGUFValueType.INT64: ("<q", "<i8"), GGUFValueType.FLOAT64: ("<d", "<f8"),
}


class _Header:
    """A bounds-checked cursor over a GGUF header (little-endian); with ``decode`` it also returns each value as a
    plain Python value (str / int / float / bool / list), else None."""

    def __init__(self, buf: mmap.mmap | bytes, path: Path, decode: bool = False) -> None:
        self.buf, self.path, self.size, self.pos = buf, path, len(buf), 0
        self.array_items = 0
        self.decode = decode

    def error(self, what: str) -> ModelLoadError:
        return ModelLoadError(f"{self.path} is a corrupt or truncated GGUF file: {what}")

    def take(self, n: int, what: str) -> int:
        """Skip ``n`` bytes holding ``what``; returns where they start."""
        start, end = self.pos, self.pos + n
        if end > self.size:
            raise self.error(f"{what} at byte {start:,} needs bytes up to {end:,} but the file has {self.size:,} bytes")
        self.pos = end
        return start

    def unpack(self, fmt: str, what: str) -> int | float:
        return struct.unpack_from(fmt, self.buf, self.take(struct.calcsize(fmt), what))[0]

    def string(self, what: str, limit: int | None = None) -> tuple[int, int]:
        """Skip a length-prefixed string (of at most ``limit`` bytes); returns where it starts and its length."""
        n = self.unpack("<Q", f"the length of {what}")
        if limit is not None and n > limit:
            raise self.error(f"{what} has length {n:,}, more than the {limit:,} bytes allowed")
        return self.take(n, what), n

    def text(self, what: str, limit: int) -> str:
        start, n = self.string(what, limit)
        raw = bytes(self.buf[start:start + n])
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self.error(f"{what} is not valid UTF-8 ({raw[:40]!r})") from None

    def value(self, raw_type: int, key: str, in_array: bool = False) -> Any:
        """Read (``decode``) or skip one value of type ``raw_type``, checking its type, lengths and item counts."""
        try:
            vtype = GGUFValueType(raw_type)
        except ValueError:
            raise self.error(f"the value type of key {key!r} is {raw_type}, not a GGUF value type "
                             f"({_value_types()})") from None
        size = _SCALAR_SIZES.get(vtype)
        if size is not None:
            start = self.take(size, f"the value of {key!r}")
            return struct.unpack_from(_FORMATS[vtype][0], self.buf, start)[0] if self.decode else None
        if vtype == GGUFValueType.STRING:
            start, n = self.string(f"the string value of {key!r}")
            return bytes(self.buf[start:start + n]).decode("utf-8", errors="replace") if self.decode else None
        if in_array:
            raise self.error(f"key {key!r} is an array of arrays; nested arrays are not supported")
        item_type = self.unpack("<I", f"the item type of {key!r}")
        if item_type not in _VALUE_TYPES:
            raise self.error(f"the item type of array {key!r} is {item_type}, not a GGUF value type "
                             f"({_value_types()})")
        n = self.unpack("<Q", f"the length of {key!r}")
        if n > MAX_ARRAY_LEN:
            raise self.error(f"array {key!r} has {n:,} items, more than the {MAX_ARRAY_LEN:,} allowed")
        self.array_items += n
        if self.array_items > MAX_ARRAY_ITEMS:
            raise self.error(f"the arrays up to {key!r} hold {self.array_items:,} items together, more than "
                             f"the {MAX_ARRAY_ITEMS:,} allowed")
        item_size = _SCALAR_SIZES.get(GGUFValueType(item_type))
        if item_size is not None:
            start = self.take(n * item_size, f"the {n:,} items of {key!r}")
            if not self.decode:
                return None
            return np.frombuffer(self.buf, dtype=_FORMATS[GGUFValueType(item_type)][1], count=n, offset=start).tolist()
        if n * 8 > self.size - self.pos:  # each item is at least its 8-byte length
            raise self.error(f"array {key!r} has {n:,} items, more than the {self.size - self.pos:,} bytes "
                             f"left can hold (the file has {self.size:,} bytes)")
        items = [self.value(item_type, key, in_array=True) for _ in range(n)]
        return items if self.decode else None


@dataclass
class GGUFHeader:
    """A checked GGUF header: the metadata as plain Python values and where each tensor's data lies."""

    metadata: dict[str, Any]
    # name, dims (GGUF order: the row length first), GGML type id, absolute byte offset in the file, bytes
    tensors: list[tuple[str, list[int], int, int, int]]


def _walk(path: Path, buf: mmap.mmap | bytes, decode: bool) -> GGUFHeader:
    """Walk a GGUF header and check every count, length, type, dimension and offset (see the module doc); with
    ``decode`` keep the metadata's values."""
    h = _Header(buf, path, decode)
    h.take(4, "the magic")
    version = h.unpack("<I", "the version")
    if version and not version & 0xFFFF:  # read in the wrong byte order
        raise ModelLoadError(f"{path} is a big-endian GGUF; only little-endian files are supported")
    if version not in SUPPORTED_VERSIONS:
        raise h.error(f"version {version}, this reader supports versions "
                      f"{', '.join(map(str, SUPPORTED_VERSIONS))}")
    n_tensors = h.unpack("<Q", "the tensor count")
    n_kv = h.unpack("<Q", "the key/value count")
    for count, what, limit in ((n_tensors, "tensor count", MAX_TENSORS), (n_kv, "key/value count", MAX_KV)):
        if count > limit:
            raise h.error(f"{what} {count:,} is more than the {limit:,} allowed")
    if n_tensors * _MIN_TENSOR_BYTES + n_kv * _MIN_KV_BYTES > h.size - h.pos:
        raise h.error(f"{n_tensors:,} tensors and {n_kv:,} key/values cannot fit in the {h.size - h.pos:,} bytes "
                      f"after the header's counts (the file has {h.size:,} bytes)")

    alignment = DEFAULT_ALIGNMENT
    keys: set[str] = set()
    metadata: dict[str, Any] = {}
    for i in range(n_kv):
        key = h.text(f"key {i}", MAX_KEY_LEN)
        if key.startswith("GGUF."):
            raise h.error(f"key {key!r}: names starting with 'GGUF.' are reserved for the header's own fields")
        if key in keys:
            raise h.error(f"key {key!r} appears twice")
        keys.add(key)
        raw_type = h.unpack("<I", f"the value type of {key!r}")
        start = h.pos
        metadata[key] = h.value(raw_type, key)
        if key == "general.alignment":
            if raw_type != GGUFValueType.UINT32:
                raise h.error(f"general.alignment has value type {raw_type}, it must be UINT32 "
                              f"({int(GGUFValueType.UINT32)})")
            alignment = struct.unpack_from("<I", buf, start)[0]
            if alignment == 0 or alignment & (alignment - 1):
                raise h.error(f"general.alignment is {alignment}; it must be a power of two (1, 2, 4, ..., 32, ...)")

    infos, names = [], set()
    for i in range(n_tensors):
        name = h.text(f"the name of tensor {i}", MAX_NAME_LEN)
        if name in names:
            raise h.error(f"tensor {name!r} appears twice")
        names.add(name)
        n_dims = h.unpack("<I", f"the number of dimensions of tensor {name!r}")
        if not 1 <= n_dims <= MAX_DIMS:
            raise h.error(f"tensor {name!r} has {n_dims:,} dimensions; 1 to {MAX_DIMS} are allowed")
        dims = [h.unpack("<Q", f"dimension {d} of tensor {name!r}") for d in range(n_dims)]
        raw_type = h.unpack("<I", f"the type of tensor {name!r}")
        offset = h.unpack("<Q", f"the data offset of tensor {name!r}")
        infos.append((name, dims, raw_type, offset))

    data_start = -(-h.pos // alignment) * alignment
    tensors = []
    for name, dims, raw_type, offset in infos:
        known = ggml_type(raw_type)
        if known is None:  # a type newer than this reader: its blocks' size is unknown, so nothing after it can be read
            raise ModelLoadError(f"{path}: tensor {name!r} has GGML type id {raw_type}, a type quickdraft does not "
                                 f"support; supported: {supported_type_names()}")
        block, type_size = known.block, known.type_size
        if 0 in dims:
            raise h.error(f"tensor {name!r} has shape {dims}; every dimension must be at least 1")
        if dims[0] % block:
            raise h.error(f"tensor {name!r} has shape {dims} of type {known.name}, whose "
                          f"row length (the first dimension) must be a multiple of its block size {block}")
        n_bytes = math.prod(dims) // block * type_size
        if offset % alignment:
            raise h.error(f"tensor {name!r} has data offset {offset:,}, not a multiple of the alignment {alignment}")
        end = data_start + offset + n_bytes
        if end > h.size:
            raise h.error(f"tensor {name!r} (shape {dims}, {n_bytes:,} bytes at offset {offset:,}) needs bytes up "
                          f"to {end:,} but the file has {h.size:,} bytes")
        tensors.append((name, dims, raw_type, data_start + offset, n_bytes))
    _check_no_overlap(h, tensors)
    return GGUFHeader(metadata if decode else {}, tensors)


def _check_no_overlap(h: _Header, tensors: list) -> None:
    """Tensors' bytes must not overlap: a type whose block size this reader gets wrong (a Q2_0 written by a fork with
    128-weight blocks under the same id) would otherwise read one tensor's bytes into the next one's weights."""
    placed = sorted((start, start + n_bytes, name, raw) for name, _, raw, start, n_bytes in tensors)
    for (start, end, name, raw), (next_start, _, next_name, _) in zip(placed, placed[1:]):
        if end > next_start:
            hint = (f"; its type {type_name(raw)} may be another layout under the same id (mainline llama.cpp's "
                    f"Q2_0 has 64-weight blocks of 18 bytes)") if type_name(raw) == "Q2_0" else ""
            raise h.error(f"tensor {name!r} (bytes {start:,} to {end:,}) overlaps tensor {next_name!r}, which starts "
                          f"at {next_start:,}{hint}")


def _checked_header(path: Path, decode: bool = False) -> GGUFHeader:
    """The checked header of the GGUF file at ``path`` (``_walk``), after its existence and magic."""
    if not path.is_file():
        raise ModelLoadError(f"GGUF file not found: {path}")
    with open(path, "rb") as f:
        magic = f.read(4)
        if magic != b"GGUF":
            raise ModelLoadError(f"{path} is not a GGUF file (magic {magic!r}, expected b'GGUF')")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return _walk(path, buf, decode)


def read_header(path: str | Path) -> GGUFHeader:
    """The metadata (plain Python values, strings decoded as UTF-8 with replacement) and every tensor's place, from
    one checked walk of the header. gguf-py's reader is not used to load: on a 150k-token vocabulary it takes
    seconds and leaves hundreds of MiB of small objects behind."""
    return _checked_header(Path(path), decode=True)


def tensor_shapes(path: str | Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """(GGML type name, shape in torch order) of every tensor by GGUF name, from the checked header alone."""
    return {name: (type_name(raw), tuple(reversed(dims))) for name, dims, raw, _, _ in _checked_header(Path(path)).tensors}


def tensor_types(path: str | Path) -> dict[str, str]:
    """GGML type name (``'Q4_1'``, ``'F32'``, ...) of every tensor by GGUF name, from the checked header alone:
    cheap enough to describe a file without reading its tensors or its metadata into Python values."""
    return {name: type_name(raw) for name, _, raw, _, _ in _checked_header(Path(path)).tensors}




# ---- checked metadata values (each failure a ModelLoadError naming the key, its value and what is allowed) ----
def show(value: Any) -> str:
    return f"{type(value).__name__} {reprlib.repr(value)}"


def required(metadata: dict[str, Any], key: str, path: Path) -> Any:
    value = metadata.get(key)
    if value is None:
        raise ModelLoadError(f"{path}: GGUF metadata is missing {key!r} (corrupt or incomplete file?)")
    return value


def int_value(metadata: dict[str, Any], key: str, path: Path, low: int, high: int, default: int | None = None) -> int:
    """An integer metadata value in ``[low, high]`` (required unless it has a default)."""
    value = required(metadata, key, path) if default is None else metadata.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ModelLoadError(f"{path}: GGUF metadata {key!r} is {show(value)}; it must be an integer")
    if not low <= value <= high:
        raise ModelLoadError(f"{path}: GGUF metadata {key!r} is {value:,}; allowed: {low:,} to {high:,}")
    return value


def positive_float(metadata: dict[str, Any], key: str, path: Path, default: float | None) -> float | None:
    """A positive finite number (an int is taken too), or ``default`` when the key is absent."""
    value = metadata.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ModelLoadError(f"{path}: GGUF metadata {key!r} is {show(value)}; it must be a positive finite number")
    return float(value)
