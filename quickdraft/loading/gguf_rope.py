"""How a GGUF file's RoPE is scaled and how many dims of each head it rotates, as llama.cpp reads them.

RoPE scaling (``rope_scaling``): ``{arch}.rope.scaling.type`` linear (or absent, with a factor: llama.cpp's default)
divides every frequency by the factor. Llama 3.1/3.2 files store the llama3 scaling as ``rope_freqs.weight``, a
divisor per frequency: the same arithmetic as longrope with equal short and long factors. Phi-3 files store longrope
as ``rope_factors_short``/``rope_factors_long`` with ``phi3.rope.scaling.original_context_length`` and
``phi3.rope.scaling.attn_factor``. gpt-oss files declare yarn over ``rope.scaling.original_context_length``, with the
released model's settings the file does not store. Anything else (yarn elsewhere) is refused rather than run as
something it is not.

Rotated dims (``rotary_dims``): ``{arch}.rope.dimension_count``, the whole head where absent; part of a head only for
phi3, whose llama.cpp RoPE is NeoX's over the first dims as transformers' ``partial_rotary_factor`` is.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from quickdraft.config import MAX_CONTEXT, MAX_WIDTH, RopeScaling
from quickdraft.errors import ModelLoadError
from quickdraft.loading.gguf_metadata import int_value, positive_float, show

FloatReader = Callable[[str], np.ndarray]  # a small tensor of the file by GGUF name, as float64 values
SUPPORTED_ROPE = ("none", "linear (rope.scaling.type)", "llama3 (rope_freqs.weight)",
                  "longrope (phi3 rope_factors_long/short.weight)")


def rotary_dims(arch: str, metadata: dict[str, Any], path: Path, head_dim: int) -> int:
    """How many dims of each head RoPE rotates: ``{arch}.rope.dimension_count`` (the head where absent); part of a
    head only where llama.cpp's RoPE of the family is NeoX's over the first dims as transformers' (phi3)."""
    rotary = int_value(metadata, f"{arch}.rope.dimension_count", path, 0, MAX_WIDTH, default=head_dim)
    if rotary == head_dim:
        return rotary
    if arch != "phi3":
        raise ModelLoadError(f"{path}: GGUF metadata '{arch}.rope.dimension_count' is {rotary:,} but the head "
                             f"dimension is {head_dim:,}; RoPE over part of a head is supported for phi3 only")
    if not 2 <= rotary < head_dim or rotary % 2:
        raise ModelLoadError(f"{path}: GGUF metadata 'phi3.rope.dimension_count' is {rotary:,}; allowed: an even "
                             f"number of dims in 2 to the head dimension {head_dim:,}")
    return rotary


def rope_scaling(arch: str, metadata: dict[str, Any], shapes: dict[str, tuple[int, ...]], path: Path,
                 rotary: int, context: int, read_floats: FloatReader) -> RopeScaling | None:
    """The RoPE scaling the file declares (see the module doc) over ``rotary`` dims of each head, or None; a kind
    this loader cannot run is refused."""
    kind = metadata.get(f"{arch}.rope.scaling.type")
    if arch == "gpt-oss" and kind == "yarn":
        return _yarn(arch, metadata, path)
    if kind not in (None, "none", "linear"):
        raise ModelLoadError(f"{path}: RoPE scaling {show(kind)} ({arch}.rope.scaling.type) is not supported; "
                             f"supported: {', '.join(SUPPORTED_ROPE)}")
    factor_key = f"{arch}.rope.scaling.factor"
    if factor_key not in metadata:
        factor_key = f"{arch}.rope.scale_linear"  # the older name
    factor = metadata.get(factor_key)
    if factor is not None and (isinstance(factor, bool) or not isinstance(factor, (int, float))
                               or not 0 <= factor < math.inf):
        raise ModelLoadError(f"{path}: GGUF metadata {factor_key!r} is {show(factor)}; it must be a positive "
                             f"finite number (or 0: none)")
    linear = kind != "none" and factor not in (None, 0, 1)  # llama.cpp scales by a factor unless the type is none
    n = rotary // 2
    if arch == "phi3":
        factors = _phi3_factors(metadata, shapes, path, n, context, read_floats)
    elif "rope_freqs.weight" in shapes:
        values = _factors("rope_freqs.weight", shapes, path, n, read_floats)
        factors = RopeScaling("longrope", short_factor=values, long_factor=values,
                              original_max_position_embeddings=context, attention_factor=1.0)
    else:
        factors = None
    if linear and factors is not None:
        raise ModelLoadError(f"{path}: GGUF declares both linear RoPE scaling ({factor_key}={factor}) and "
                             f"per-frequency factors; one of them is supported at a time")
    return RopeScaling("linear", factor=float(factor)) if linear else factors


def _yarn(arch: str, metadata: dict[str, Any], path: Path) -> RopeScaling:
    """gpt-oss's YaRN: the factor and original context from the file, its betas where the file has them (llama.cpp's
    ``rope.scaling.yarn_beta_fast/slow``), the rest as the released config has them."""
    factor = positive_float(metadata, f"{arch}.rope.scaling.factor", path, None)
    original = int_value(metadata, f"{arch}.rope.scaling.original_context_length", path, 2, MAX_CONTEXT)
    fast = positive_float(metadata, f"{arch}.rope.scaling.yarn_beta_fast", path, 32.0)
    slow = positive_float(metadata, f"{arch}.rope.scaling.yarn_beta_slow", path, 1.0)
    try:
        return RopeScaling("yarn", factor=factor, original_max_position_embeddings=original, truncate=False,
                           beta_fast=fast, beta_slow=slow)
    except (TypeError, ValueError) as exc:
        raise ModelLoadError(f"{path}: GGUF YaRN settings are not usable: {exc}") from exc


def _phi3_factors(metadata: dict[str, Any], shapes: dict[str, tuple[int, ...]], path: Path, n: int, context: int,
                  read_floats: FloatReader) -> RopeScaling | None:
    names = ("rope_factors_short.weight", "rope_factors_long.weight")
    present = [name for name in names if name in shapes]
    if not present:
        return None
    if len(present) == 1:
        raise ModelLoadError(f"{path}: GGUF has {present[0]} but not {(set(names) - set(present)).pop()}; "
                             f"longrope needs both")
    short, long = (_factors(name, shapes, path, n, read_floats) for name in names)
    original = int_value(metadata, "phi3.rope.scaling.original_context_length", path, 1, MAX_CONTEXT)
    attention = positive_float(metadata, "phi3.rope.scaling.attn_factor", path, None)  # None: transformers' default
    return RopeScaling("longrope", factor=max(1.0, context / original), short_factor=short, long_factor=long,
                       original_max_position_embeddings=original, attention_factor=attention)


def _factors(name: str, shapes: dict[str, tuple[int, ...]], path: Path, n: int,
             read_floats: FloatReader) -> tuple[float, ...]:
    """The values of a per-frequency RoPE factor tensor: one positive finite number per frequency."""
    if tuple(shapes[name]) != (n,):
        raise ModelLoadError(f"{path}: tensor {name} has shape {tuple(shapes[name])}; RoPE over {2 * n} dims of "
                             f"a head needs ({n},), one factor per frequency")
    values = np.asarray(read_floats(name), dtype=np.float64).reshape(-1)
    bad = np.flatnonzero(~(np.isfinite(values) & (values > 0)))
    if bad.size:
        raise ModelLoadError(f"{path}: tensor {name} holds {values[bad[0]]} at index {bad[0]}; RoPE frequency "
                             f"factors must be positive finite numbers")
    return tuple(float(x) for x in values)
