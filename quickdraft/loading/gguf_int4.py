"""GGUF Q4_0 / Q4_1 / Q4_K blocks as quickdraft's int4 (group 32), exactly:

* Q4_0 ``d * (q - 8)``                -> scale ``d``,      zero ``0``
* Q4_1 ``d * q + m``                  -> scale ``d``,      zero ``m + 8 d``
* Q4_K ``d sc_j * q - dmin m_j``      -> scale ``d sc_j``, zero ``8 d sc_j - dmin m_j``

so their 4-bit values are taken as they are and only scale/zero are rounded to bfloat16 (the kernel's scale dtype).
"""
from __future__ import annotations

import numpy as np
import torch

from quickdraft.loading.dequant import as_bytes


def _f16(b: torch.Tensor) -> torch.Tensor:
    """Pairs of bytes read as float16, widened to float32."""
    return b.contiguous().view(torch.float16).float()


def _low_high(qs: torch.Tensor, group: int) -> torch.Tensor:
    """[n, c*group] bytes -> [n, c, 2, group]: low nibbles then high nibbles of each ``group`` bytes."""
    q = qs.reshape(qs.shape[0], -1, 1, group)
    return torch.cat((q & 0x0F, q >> 4), dim=2)


def gguf_int4_types() -> tuple:
    """The GGUF types that map exactly to int4 with group 32."""
    from gguf import GGMLQuantizationType as T

    return (T.Q4_0, T.Q4_1, T.Q4_K)


INT4_TYPES = tuple(t.name for t in gguf_int4_types())  # Q4_0, Q4_1, Q4_K: mapped exactly to int4 (group 32)


def gguf_int4_params(raw: np.ndarray | torch.Tensor, qtype: int, shape: tuple[int, int]
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Exact group-32 affine form of a Q4_0 / Q4_1 / Q4_K tensor: ``(q uint8 [N, K], scale, zero)`` with
    float32 ``[N, K // 32]`` scale/zero such that ``(q - 8) * scale + zero`` equals the GGUF dequantization
    (up to one float32 rounding in ``zero``). None for any other type."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

    try:
        qt = T(int(qtype))
    except ValueError:
        return None
    if qt not in gguf_int4_types():
        return None
    n, k = (int(s) for s in shape)
    block, type_size = GGML_QUANT_SIZES[qt]
    data = as_bytes(raw)
    if k % block or data.numel() != n * k // block * type_size:
        raise ValueError(f"{qt.name} data of {data.numel()} bytes does not fit shape {(n, k)}")
    blocks = data.reshape(-1, type_size)
    nb = blocks.shape[0]
    if qt == T.Q4_0:
        q = _low_high(blocks[:, 2:], 16).reshape(nb, 32)
        scale = _f16(blocks[:, :2])
        zero = torch.zeros_like(scale)
    elif qt == T.Q4_1:
        q = _low_high(blocks[:, 4:], 16).reshape(nb, 32)
        scale = _f16(blocks[:, :2])
        zero = _f16(blocks[:, 2:4]) + 8.0 * scale
    else:  # Q4_K: 8 sub-blocks of 32 with 6-bit scales and mins
        d, dmin = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
        s = blocks[:, 4:16].reshape(nb, 3, 4)
        s0, s1, s2 = s[:, 0], s[:, 1], s[:, 2]
        sc = torch.cat((s0 & 0x3F, (s2 & 0x0F) | ((s0 >> 2) & 0x30)), dim=-1).float()
        mn = torch.cat((s1 & 0x3F, (s2 >> 4) | ((s1 >> 2) & 0x30)), dim=-1).float()
        q = _low_high(blocks[:, 16:], 32).reshape(nb * 8, 32)
        scale = (d * sc).reshape(-1, 1)
        zero = (8.0 * scale - (dmin * mn).reshape(-1, 1))
    return q.reshape(n, k), scale.reshape(n, k // 32), zero.reshape(n, k // 32)
