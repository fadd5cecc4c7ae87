"""GGML tensor types by id: name and block geometry. gguf-py's table, plus the types llama.cpp writes that an older
gguf-py does not know (Q1_0, the 1-bit Bonsai format; Q2_0, 2 bits with one fp16 scale per 64, mainline llama.cpp's
layout), so a file of those is read, not called damaged."""
from __future__ import annotations

from dataclasses import dataclass

from gguf import GGML_QUANT_SIZES


@dataclass(frozen=True)
class GGMLType:
    name: str
    block: int  # elements per block
    type_size: int  # bytes per block


# llama.cpp's ggml.h ids of types newer than gguf-py's table (gguf-py's own entry wins where it has one)
_NEWER = {41: GGMLType("Q1_0", 128, 18), 42: GGMLType("Q2_0", 64, 18)}

TYPES: dict[int, GGMLType] = {**_NEWER, **{int(t): GGMLType(t.name, b, s) for t, (b, s) in GGML_QUANT_SIZES.items()}}
BY_NAME: dict[str, int] = {t.name: i for i, t in TYPES.items()}


def type_name(type_id: int) -> str:
    """``'Q4_K'``, or ``'unknown type id N'``."""
    t = TYPES.get(int(type_id))
    return t.name if t is not None else f"unknown type id {int(type_id)}"


def ggml_type(type_id: int) -> GGMLType | None:
    return TYPES.get(int(type_id))
