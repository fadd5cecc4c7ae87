"""Vectorized dequantization of GGUF (ggml) tensor data to float32 with torch.

Every function takes the raw little-endian block bytes of a whole tensor and
works on all blocks at once with tensor ops, matching ``gguf.quants.dequantize``
bit for bit (same float32 operations in the same order); the types newer than gguf-py (Q1_0, Q2_0) as llama.cpp's
reference code computes them. Large tensors are
processed in chunks of blocks only to bound the memory of the intermediates.
"""
from __future__ import annotations

import math
import warnings
from typing import Callable, Sequence

import numpy as np
import torch
from quickdraft.errors import ModelLoadError
from quickdraft.loading.ggml_types import BY_NAME, TYPES, type_name
from quickdraft.models import block_formats

QK_K = 256
# Elements decoded per chunk: keeps the small uint8 temporaries cache-friendly and bounded.
_CHUNK_ELEMENTS = 1 << 19


def _f16(b: torch.Tensor) -> torch.Tensor:
    """[n, 2] uint8 -> [n, 1] float32 read as little-endian IEEE half."""
    return b.contiguous().view(torch.float16).float()


def _put_nibbles(out: torch.Tensor, qs: torch.Tensor, group: int) -> None:
    """Write low then high nibbles of each ``group`` bytes as floats: [n, k*group] -> out [n, 2*k*group]."""
    n = qs.shape[0]
    q = qs.reshape(n, -1, 1, group)
    o = out.view(n, -1, 2, group)
    o[:, :, 0:1].copy_(q & 0x0F)
    o[:, :, 1:2].copy_(q >> 4)


def _nibbles(qs: torch.Tensor, group: int) -> torch.Tensor:
    """Split bytes into low then high nibbles per ``group`` bytes: [n, k*group] -> [n, k, 2, group] uint8."""
    n = qs.shape[0]
    q = qs.reshape(n, -1, 1, group)
    return torch.cat((q & 0x0F, q >> 4), dim=2)


def _bits(b: torch.Tensor) -> torch.Tensor:
    """[n, k] uint8 -> [n, 8k] bits, bit j of byte i at 8i + j (little-endian bit order)."""
    shifts = torch.arange(8, dtype=torch.uint8)
    return ((b.unsqueeze(-1) >> shifts) & 1).reshape(b.shape[0], -1)


# Each block function writes float32 values into ``out`` ([n_blocks, block_size], contiguous)
# with in-place ops: the same float32 operations in the same order as gguf-py
# (so results are bit-identical), without allocating float temporaries.


def _q4_0(blocks: torch.Tensor, out: torch.Tensor) -> None:
    _put_nibbles(out, blocks[:, 2:], 16)
    out.sub_(8).mul_(_f16(blocks[:, :2]))  # d * (q - 8); q - 8 is exact in float32


def _q4_1(blocks: torch.Tensor, out: torch.Tensor) -> None:
    _put_nibbles(out, blocks[:, 4:], 16)
    out.mul_(_f16(blocks[:, :2])).add_(_f16(blocks[:, 2:4]))  # d * q + m


def _q5_0(blocks: torch.Tensor, out: torch.Tensor) -> None:
    n = blocks.shape[0]
    ql = _nibbles(blocks[:, 6:], 16).reshape(n, 32)
    out.copy_(ql | (_bits(blocks[:, 2:6]) << 4))
    out.sub_(16).mul_(_f16(blocks[:, :2]))


def _q5_1(blocks: torch.Tensor, out: torch.Tensor) -> None:
    n = blocks.shape[0]
    ql = _nibbles(blocks[:, 8:], 16).reshape(n, 32)
    out.copy_(ql | (_bits(blocks[:, 4:8]) << 4))
    out.mul_(_f16(blocks[:, :2])).add_(_f16(blocks[:, 2:4]))


def _q8_0(blocks: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(blocks[:, 2:].contiguous().view(torch.int8))
    out.mul_(_f16(blocks[:, :2]))


def _k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unpack the 12-byte 6-bit scales/mins of Q4_K and Q5_K into two [n, 8] uint8 tensors."""
    n = scales.shape[0]
    s = scales.reshape(n, 3, 4)
    d, m, m_d = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat((d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)), dim=-1)
    mn = torch.cat((m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)), dim=-1)
    return sc, mn


def _k_scales(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sub-block scale d*sc and offset dmin*m of Q4_K / Q5_K, each [n, 8, 1]."""
    n = blocks.shape[0]
    d, dmin = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
    sc, mn = _k_scale_min(blocks[:, 4:16])
    return (d * sc.float()).reshape(n, 8, 1), (dmin * mn.float()).reshape(n, 8, 1)


def _q4_k(blocks: torch.Tensor, out: torch.Tensor) -> None:
    n = blocks.shape[0]
    dl, ml = _k_scales(blocks)
    _put_nibbles(out, blocks[:, 16:], 32)
    out.view(n, 8, 32).mul_(dl).sub_(ml)


def _q5_k(blocks: torch.Tensor, out: torch.Tensor) -> None:
    n = blocks.shape[0]
    dl, ml = _k_scales(blocks)
    qh = blocks[:, 16:48]
    ql = _nibbles(blocks[:, 48:], 32).reshape(n, 8, 32)
    # sub-block j takes bit j of each of the 32 qh bytes
    hb = (qh.unsqueeze(1) >> torch.arange(8, dtype=torch.uint8).reshape(1, 8, 1)) & 1
    o = out.view(n, 8, 32)
    o.copy_(ql | (hb << 4))
    o.mul_(dl).sub_(ml)


def _q6_k(blocks: torch.Tensor, out: torch.Tensor) -> None:
    n = blocks.shape[0]
    ql = blocks[:, :128]
    qh = blocks[:, 128:192]
    scales = blocks[:, 192:208].contiguous().view(torch.int8).float()
    dl = (_f16(blocks[:, 208:210]) * scales).reshape(n, 16, 1)
    low = _nibbles(ql, 64).reshape(n, 8, 32)
    high = (qh.reshape(n, 2, 1, 32) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(1, 1, 4, 1)) & 3
    o = out.view(n, 16, 16)
    o.copy_((low | (high.reshape(n, 8, 32) << 4)).reshape(n, 16, 16))
    o.sub_(32).mul_(dl)


def _kernel_format(name: str) -> Callable[[torch.Tensor, torch.Tensor], None]:
    """A type the kernel reads whose float32 weights ``block_formats.dequantize`` gives (IQ4_NL, IQ4_XS, Q1_0, Q2_0,
    MXFP4, Q2_K, Q3_K, TQ1_0, TQ2_0, the lattice formats IQ2_XXS .. IQ1_M:
    the same products as gguf-py's and llama.cpp's reference code, one rounding each)."""
    def func(blocks: torch.Tensor, out: torch.Tensor) -> None:
        out.copy_(block_formats.dequantize(name, blocks.reshape(-1), 1, out.numel()).reshape(out.shape))

    return func


_BLOCK_FUNCS: dict[str, Callable[[torch.Tensor, torch.Tensor], None]] = {
    "Q4_0": _q4_0,
    "Q4_1": _q4_1,
    "Q5_0": _q5_0,
    "Q5_1": _q5_1,
    "Q8_0": _q8_0,
    "Q4_K": _q4_k,
    "Q5_K": _q5_k,
    "Q6_K": _q6_k,
    **{name: _kernel_format(name) for name in ("IQ4_NL", "IQ4_XS", "Q1_0", "Q2_0", "MXFP4", "Q2_K", "Q3_K",
                                               "TQ1_0", "TQ2_0", *block_formats.GRID_FORMATS)},
}

SUPPORTED_TYPES: tuple[str, ...] = ("F32", "F16", "BF16", *_BLOCK_FUNCS)
SUPPORTED_IDS: frozenset[int] = frozenset(BY_NAME[name] for name in SUPPORTED_TYPES)


def supported_type_names() -> str:
    return ", ".join(SUPPORTED_TYPES)


def qtype_name(qtype: int) -> str:
    return type_name(qtype)


def check_supported(qtype: int, what: str = "tensor") -> str:
    """The type's name, or raise ModelLoadError naming the type and the supported list."""
    name = type_name(qtype)
    if name not in SUPPORTED_TYPES:
        raise ModelLoadError(f"{what} uses unsupported GGUF quantization type {name}; supported: {supported_type_names()}")
    return name


def as_bytes(raw: np.ndarray | torch.Tensor) -> torch.Tensor:
    """Flat uint8 view of the raw data (no copy for numpy arrays and memmaps)."""
    if isinstance(raw, torch.Tensor):
        t = raw.detach().contiguous().reshape(-1)
        return t.view(torch.uint8)
    arr = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
    with warnings.catch_warnings():
        # read-only memmaps: we never write through this tensor
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(arr)


def dequantize(raw: np.ndarray | torch.Tensor, qtype: int, shape: Sequence[int]) -> torch.Tensor:
    """Decode a whole GGUF tensor to a new float32 tensor of ``shape``.

    ``raw`` is the tensor's data as stored in the file (uint8 block bytes, or
    typed float32/float16 arrays as ``GGUFReader`` returns for F32/F16); ``shape``
    is the logical shape in numpy/torch order (the GGUF dims reversed).
    """
    qt = check_supported(qtype)
    shape = tuple(int(s) for s in shape)
    n_elements = math.prod(shape)
    geometry = TYPES[BY_NAME[qt]]
    block_size, type_size = geometry.block, geometry.type_size
    if n_elements % block_size:
        raise ModelLoadError(f"{qt} tensor of shape {shape} is not a whole number of {block_size}-element blocks")
    data = as_bytes(raw)
    expected = n_elements // block_size * type_size
    if data.numel() != expected:
        raise ModelLoadError(
            f"{qt} tensor of shape {shape} needs {expected} bytes but {data.numel()} were given "
            "(corrupt or truncated file?)"
        )

    if qt == "F32":
        return data.view(torch.float32).clone().reshape(shape)
    if qt == "F16":
        return data.view(torch.float16).float().reshape(shape)
    if qt == "BF16":
        return (data.view(torch.int16).to(torch.int32) << 16).view(torch.float32).reshape(shape)

    func = _BLOCK_FUNCS[qt]
    n_blocks = n_elements // block_size
    blocks = data.reshape(n_blocks, type_size)
    out = torch.empty(n_blocks, block_size, dtype=torch.float32)
    step = max(1, _CHUNK_ELEMENTS // block_size)
    for start in range(0, n_blocks, step):  # chunks of many blocks, not single blocks
        func(blocks[start : start + step], out[start : start + step])
    return out.reshape(shape)
