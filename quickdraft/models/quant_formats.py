"""The int4/int8 weight formats as pure functions (float32 in): quantizers, int4 dequantizer, nibble packing.

Kept apart from the layers so that converting a checkpoint and checking the rounding need no kernel: int8 is
symmetric per output channel (``w ~= q * scale``), int4 affine per group of input columns
(``w ~= (q - 8) * scale + zero``, ``q`` in 0..15), scales and zeros in ``SCALE_DTYPE``.
"""
from __future__ import annotations

import torch

INT4_GROUP_SIZES = (32, 64, 128)
# Scales/zeros are kept in this dtype: the CPU kernels run fast with bfloat16 activations only.
SCALE_DTYPE = torch.bfloat16
_BF16_ROUND_UP = 1.0 + 2.0 ** -7  # v * this, rounded to nearest bfloat16, is >= v


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: ``(q int8 [N, K], scale bfloat16 [N])`` with ``w ~= q * scale``.

    The scale is rounded *up* to bfloat16, so ``|w / scale| <= 127`` and the error is at most
    ``scale / 2`` per element (no clipping)."""
    w = w.float()
    amax = w.abs().amax(dim=1)
    # (divided by a tensor: CUDA divides by a Python number as a product with its reciprocal, which may round
    # otherwise than the CPU's division, and a GPU must give the bits the CPU gives)
    scale = (amax / amax.new_tensor(127.0) * _BF16_ROUND_UP).clamp(min=1e-30).to(SCALE_DTYPE)
    q = torch.round(w / scale.float()[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def quantize_int4(w: torch.Tensor, group_size: int = 32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric groupwise int4, round to nearest with each group's min/max:
    ``(q uint8 [N, K] in 0..15, scale [N, K // G], zero [N, K // G])`` (both bfloat16)
    with ``w ~= (q - 8) * scale + zero``.

    ``q`` is computed against the bfloat16-rounded scale and zero, so the error per element is
    at most ``scale / 2`` plus the bfloat16 rounding of ``zero`` (``<= |zero| * 2**-8``)."""
    n, k = w.shape
    if group_size not in INT4_GROUP_SIZES or k % group_size:
        raise ValueError(f"int4 group size must be one of {INT4_GROUP_SIZES} and divide in_features={k}, "
                         f"got {group_size}")
    g = w.float().reshape(n, k // group_size, group_size)
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    scale = ((hi - lo) / lo.new_tensor(15.0) * _BF16_ROUND_UP).to(SCALE_DTYPE)  # (a tensor: see quantize_int8)
    tiny = scale.float() <= 0  # constant group: any positive scale works, q becomes 8
    scale = torch.where(tiny, torch.ones_like(scale), scale)
    zero = (lo + 8.0 * scale.float()).to(SCALE_DTYPE)
    zero = torch.where(tiny, lo.to(SCALE_DTYPE), zero)
    q = torch.round((g - zero.float()[..., None]) / scale.float()[..., None] + 8.0).clamp_(0, 15)
    return q.to(torch.uint8).reshape(n, k), scale, zero


def dequantize_int4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int) -> torch.Tensor:
    """Float32 ``[N, K]`` from ``q`` (uint8 0..15) and per-group ``scale``/``zero`` ``[N, K // G]``."""
    n, k = q.shape
    g = q.float().reshape(n, k // group_size, group_size)
    return ((g - 8.0) * scale.float()[..., None] + zero.float()[..., None]).reshape(n, k)


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """Portable int4 storage: ``[N, K]`` values 0..15 -> ``[N, K // 2]`` uint8, even column in the low nibble."""
    q = q.to(torch.uint8)
    return q[:, 0::2] | (q[:, 1::2] << 4)


def unpack_nibbles(p: torch.Tensor) -> torch.Tensor:
    """Inverse of ``pack_nibbles``: ``[N, K // 2]`` uint8 -> ``[N, K]`` values 0..15."""
    n, half = p.shape
    out = torch.empty(n, half, 2, dtype=torch.uint8, device=p.device)
    out[..., 0] = p & 0x0F
    out[..., 1] = p >> 4
    return out.reshape(n, 2 * half)
