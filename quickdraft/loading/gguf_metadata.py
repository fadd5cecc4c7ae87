"""Read GGUF key/value metadata into plain Python values."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader, GGUFValueType

from quickdraft.errors import ModelLoadError


def open_gguf(path: str | Path) -> GGUFReader:
    """Open a GGUF file, turning the reader's low-level failures into a clear error."""
    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"GGUF file not found: {path}")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ModelLoadError(f"{path} is not a GGUF file (magic {magic!r}, expected b'GGUF')")
    try:
        return GGUFReader(path, "r")
    except Exception as exc:  # the reader raises ValueError/IndexError/... on damaged files
        raise ModelLoadError(f"{path} is a corrupt or truncated GGUF file: {type(exc).__name__}: {exc}") from exc


def field_value(field: Any) -> Any:
    """Decode one ReaderField into str / int / float / bool / list."""
    types = field.types
    if not types:
        return None
    if types[0] == GGUFValueType.ARRAY:
        item_type = types[-1]
        if item_type == GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]
        return np.concatenate([field.parts[i] for i in field.data]).tolist() if field.data else []
    part = field.parts[field.data[0]]
    if types[0] == GGUFValueType.STRING:
        return bytes(part).decode("utf-8", errors="replace")
    value = part.tolist()[0]
    return bool(value) if types[0] == GGUFValueType.BOOL else value


def read_metadata(reader: GGUFReader) -> dict[str, Any]:
    return {name: field_value(field) for name, field in reader.fields.items() if not name.startswith("GGUF.")}
