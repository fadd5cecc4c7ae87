"""GGML's lattice formats (the i-quants IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M) for the qmatmul
kernel: a file's blocks read into their fields (``fields``), rearranged into the kernel's blocks at the file's size
(``repack``; qformats.h describes them) and the float32 weights they stand for (``dequantize``).

Each entry of 8 weights (IQ3: 4) is an entry of the format's grid (``iq_grids.py``) named by an index, each weight
with a sign bit (IQ1: the grid's -1, 0, 1 shifted by 1/8 either way an entry instead), times a scale per 32 (or 16)
weights of d times a small odd number: the kernel's bytes are the file's own, moved.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from quickdraft.models import iq_grids
from quickdraft.models.qmatmul import CHUNK_ORDER

# bytes of a file's block of 256 weights, which the kernel's block keeps
BLOCK_BYTES = {"IQ2_XXS": 66, "IQ2_XS": 74, "IQ2_S": 82, "IQ3_XXS": 98, "IQ3_S": 110, "IQ1_S": 50, "IQ1_M": 56}
GRID_FORMATS = tuple(BLOCK_BYTES)


@dataclass
class GridFields:
    """A lattice format's blocks: ``idx`` the grid index of each entry ``[nb, 8 groups, entries]`` (4 entries of 8
    weights a group, IQ3's 8 of 4), ``signs`` a byte per 8 weights ``[nb, 8, 4]`` (bit i: weight i negative; IQ1:
    1 where the entry's shift is -1/8, 0 for +1/8), ``sc`` the scale codes ``[nb, 8]`` (per 16 weights:
    ``[nb, 16]``), ``d`` the fp16 bits ``[nb]``."""

    idx: torch.Tensor
    signs: torch.Tensor
    sc: torch.Tensor
    d: torch.Tensor


def _le(b: torch.Tensor) -> torch.Tensor:
    """[..., w] little-endian bytes -> [...] int64 words."""
    return (b.to(torch.int64) << (8 * torch.arange(b.shape[-1]))).sum(-1)


def _full_signs(seven: torch.Tensor) -> torch.Tensor:
    """7 sign bits -> the byte of 8 (ggml's ksigns): the eighth set where the seven hold an odd count."""
    parity = ((seven.unsqueeze(-1) >> torch.arange(7)) & 1).sum(-1) & 1
    return (seven | (parity << 7)).to(torch.uint8)


def _nibble_pairs(b: torch.Tensor) -> torch.Tensor:
    """[nb, c] bytes -> [nb, 2 c] nibbles: byte i's low one at 2 i, its high one at 2 i + 1."""
    return torch.stack((b & 0x0F, b >> 4), dim=-1).reshape(b.shape[0], -1).to(torch.int64)


def fields(name: str, b: torch.Tensor) -> GridFields:
    """The file's blocks ``[nb, block_bytes]`` of a lattice format as ``GridFields``."""
    nb = b.shape[0]
    if name == "IQ1_M":  # low index bytes, a nibble an entry (3 high index bits, the shift's sign), 3-bit scales per
        # 16 in 4 16-bit words whose top nibbles hold d
        nibbles = _nibble_pairs(b[:, 32:48]).reshape(nb, 8, 4)
        words = _le(b[:, 48:56].reshape(nb, 4, 2))
        sc = ((words.unsqueeze(-1) >> (3 * torch.arange(4))) & 7).reshape(nb, 16)
        d = ((words >> 12) << (4 * torch.arange(4))).sum(-1).to(torch.int16)
        return GridFields(b[:, :32].reshape(nb, 8, 4).to(torch.int64) | ((nibbles & 7) << 8), nibbles >> 3, sc, d)
    d = b[:, :2].contiguous().view(torch.int16).reshape(nb)
    if name == "IQ1_S":  # low index bytes, per group 16 bits: 4 x 3 high index bits, a 3-bit scale, the shift's sign
        words = _le(b[:, 34:50].reshape(nb, 8, 2))
        idx = b[:, 2:34].reshape(nb, 8, 4).to(torch.int64) | (((words.unsqueeze(-1) >> (3 * torch.arange(4))) & 7) << 8)
        return GridFields(idx, (words >> 15).unsqueeze(-1).expand(nb, 8, 4), (words >> 12) & 7, d)
    if name in ("IQ2_XXS", "IQ3_XXS"):  # indices, then per group a word of 4 x 7 sign bits and the scale in bits 28..
        idx_bytes = 32 if name == "IQ2_XXS" else 64
        if name == "IQ2_XXS":  # per group 8 bytes: 4 indices, then the word
            groups = b[:, 2:].reshape(nb, 8, 8)
            idx, words = groups[:, :, :4].to(torch.int64), _le(groups[:, :, 4:])
        else:
            idx = b[:, 2:2 + idx_bytes].reshape(nb, 8, 8).to(torch.int64)
            words = _le(b[:, 2 + idx_bytes:].reshape(nb, 8, 4))
        signs = _full_signs((words.unsqueeze(-1) >> (7 * torch.arange(4))) & 0x7F)
        return GridFields(idx, signs, words >> 28, d)
    if name == "IQ2_XS":  # per 8 weights 16 bits: a 9-bit index, 7 sign bits; scales per 16 as nibbles
        units = _le(b[:, 2:66].reshape(nb, 8, 4, 2))
        return GridFields(units & 511, _full_signs(units >> 9), _nibble_pairs(b[:, 66:74]), d)
    if name == "IQ2_S":  # low index bytes, sign bytes, 2 high index bits per entry, scales per 16
        high = (b[:, 66:74].to(torch.int64).unsqueeze(-1) >> (2 * torch.arange(4))) & 3
        idx = b[:, 2:34].reshape(nb, 8, 4).to(torch.int64) | (high << 8)
        return GridFields(idx, b[:, 34:66].reshape(nb, 8, 4), _nibble_pairs(b[:, 74:82]), d)
    # IQ3_S: low index bytes, a high bit per index, sign bytes, scales per 32 as nibbles
    high = (b[:, 66:74].to(torch.int64).unsqueeze(-1) >> torch.arange(8)) & 1
    idx = b[:, 2:66].reshape(nb, 8, 8).to(torch.int64) | (high << 8)
    return GridFields(idx, b[:, 74:106].reshape(nb, 8, 4), _nibble_pairs(b[:, 106:110]), d)


def _stored_entries(t: torch.Tensor) -> torch.Tensor:
    """[nb, 8 groups, 8 chunks] -> [nb, 64]: chunk t of group j at 8 CHUNK_ORDER[t] + j (stored position, group)."""
    return t[:, :, list(CHUNK_ORDER)].transpose(1, 2).reshape(t.shape[0], 64)


def _by_entry(t: torch.Tensor) -> torch.Tensor:
    """[nb, 8 groups, 4 entries] -> [nb, 32]: entry e of group j at 8 e + j."""
    return t.transpose(1, 2).reshape(t.shape[0], 32)


def _bytes_of(words: torch.Tensor, width: int) -> torch.Tensor:
    """[nb, c] int64 -> [nb, c * width] little-endian bytes."""
    return ((words.unsqueeze(-1) >> (8 * torch.arange(width))) & 0xFF).to(torch.uint8).reshape(words.shape[0], -1)


def _pack(name: str, f: GridFields) -> torch.Tensor:
    """``[nb, kernel_bytes]``: the blocks in the kernel's layout (qformats.h), the file's bytes rearranged."""
    nb = f.idx.shape[0]
    d = f.d.contiguous().view(torch.uint8).reshape(nb, 2)
    signs = _by_entry(f.signs).to(torch.int64)
    scale_pairs = lambda: _bytes_of(f.sc[:, 0::2] | (f.sc[:, 1::2] << 4), 1)  # noqa: E731 (as the file)
    if name in ("IQ2_XXS", "IQ3_XXS"):  # 7 sign bits, bit 7 of entry e's byte = bit e of its group's scale
        idx = _by_entry(f.idx) if name == "IQ2_XXS" else _stored_entries(f.idx)
        scale_bits = _by_entry((f.sc.unsqueeze(-1) >> torch.arange(4)) & 1)
        parts = [idx.to(torch.uint8), ((signs & 0x7F) | (scale_bits << 7)).to(torch.uint8)]
    elif name == "IQ2_XS":  # 16 bits an entry: the index, then the 7 sign bits
        parts = [_bytes_of(_by_entry(f.idx) | ((signs & 0x7F) << 9), 2), scale_pairs()]
    elif name == "IQ2_S":  # the indices' low bytes, the sign bytes, a 64-bit word of high bits (2 k: entry k), scales
        idx = _by_entry(f.idx)
        high = ((idx >> 8) << (2 * torch.arange(32))).sum(-1, keepdim=True)
        parts = [(idx & 0xFF).to(torch.uint8), signs.to(torch.uint8), _bytes_of(high, 8), scale_pairs()]
    elif name == "IQ3_S":  # the indices' low bytes, a 64-bit word of their high bits (bit k: entry k), sign bytes,
        # scales
        idx = _stored_entries(f.idx)
        high = ((idx >> 8) << torch.arange(64)).sum(-1, keepdim=True)
        parts = [(idx & 0xFF).to(torch.uint8), _bytes_of(high, 8), signs.to(torch.uint8), scale_pairs()]
    elif name == "IQ1_S":  # the indices' low bytes, then per group the file's 16 bits (high index bits, scale, sign)
        high = ((f.idx >> 8) << (3 * torch.arange(4))).sum(-1)
        words = high | (f.sc << 12) | (f.signs[:, :, 0].to(torch.int64) << 15)
        parts = [(_by_entry(f.idx) & 0xFF).to(torch.uint8), _bytes_of(words, 2)]
    else:  # IQ1_M: the indices' low bytes, then a nibble an entry (entry 16 v + i: byte 8 v + i, low nibble for i < 8,
        # high for the next 8), then the file's scale words (d in their top nibbles)
        nib = (_by_entry(f.idx) >> 8) | (signs << 3)
        pairs = nib.reshape(nb, 2, 2, 8)
        d_bits = f.d.to(torch.int64) & 0xFFFF
        words = ((f.sc.reshape(nb, 4, 4) << (3 * torch.arange(4))).sum(-1)
                 | (((d_bits.unsqueeze(-1) >> (4 * torch.arange(4))) & 0xF) << 12))
        parts = [(_by_entry(f.idx) & 0xFF).to(torch.uint8), (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(nb, 16)
                 .to(torch.uint8), _bytes_of(words, 2)]
    return torch.cat([*parts, d] if name != "IQ1_M" else parts, dim=1)


GRID_SCALE = {  # the weight scale of scale code s, as (a + b s) c times d
    "IQ2_XXS": (0.5, 1.0, 0.25), "IQ2_XS": (0.5, 1.0, 0.25), "IQ2_S": (0.5, 1.0, 0.25),
    "IQ3_XXS": (0.5, 1.0, 0.5), "IQ3_S": (1.0, 2.0, 1.0), "IQ1_S": (1.0, 2.0, 1.0), "IQ1_M": (1.0, 2.0, 1.0),
}
IQ1_SHIFT = 0.125  # IQ1's values are the grid's -1, 0, 1 shifted by this, either way


def _blocks(name: str, data: torch.Tensor, k: int) -> torch.Tensor:
    if k % 256:
        raise ValueError(f"{name} rows cannot have {k} columns (blocks of 256)")
    return data.reshape(-1, BLOCK_BYTES[name])


def repack(name: str, data: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The file's bytes of ``n`` rows of ``k`` columns -> ``[n, row bytes]`` in the kernel's layout (the same size)."""
    return _pack(name, fields(name, _blocks(name, data, k))).reshape(n, k // 256 * BLOCK_BYTES[name])


def dequantize(name: str, data: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The file's bytes of ``n`` rows of ``k`` columns -> ``[n, k]`` float32 weights: d (a + b sc) c, times each
    weight's signed grid value (gguf-py's products)."""
    f = fields(name, _blocks(name, data, k))
    nb = f.idx.shape[0]
    a, b, c = GRID_SCALE[name]
    scale = f.d.contiguous().view(torch.float16).float().unsqueeze(-1) * (a + b * f.sc.float()) * c
    values = iq_grids.values(name)[f.idx].reshape(nb, 8, 32).float()
    if name in ("IQ1_S", "IQ1_M"):
        signed = values + torch.where(f.signs.bool(), -IQ1_SHIFT, IQ1_SHIFT).repeat_interleave(8, dim=-1)
    else:
        negative = ((f.signs.unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8)) & 1).reshape(nb, 8, 32)
        signed = torch.where(negative.bool(), -values, values)
    return (scale.repeat_interleave(256 // scale.shape[1], dim=1).reshape(nb, 8, 32) * signed).reshape(n, k)
