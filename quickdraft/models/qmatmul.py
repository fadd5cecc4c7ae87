"""Weight-only quantized linear layers on CPU with quickdraft's own kernel (``qmatmul.c``): layout and call.

The kernel reads quickdraft's own int4/int8 (``pack``) and the GGML block formats at the file's own size
(``block_formats.py``, ``qformats.h``); each weight of a call names its format.

Why a kernel of our own: torch's packed CPU kernels (``_weight_int4pack_mm_for_cpu``,
``_weight_int8pack_mm``) stream a decode step's weights far below the memory bandwidth, and their cost
grows steeply from 1 to 5 rows (docs/MEASUREMENTS.md), which is what makes speculative verification
expensive with quantized weights. ``qmatmul.c`` quantizes the activations to int8 per group of
32 and multiplies with int8 dot products (as llama.cpp does: VNNI where the CPU has it, else AVX2
vpmaddubsw on 4-bit values, with the same exact integer sums), one weight block unpacked once for up to
8 rows, and computes every row independently of the others (bit-identical whatever the batch). Several
weights that read the same input (q/k/v, gate/up) run as one call (``linear_parts``), gate/up with the SwiGLU
activation applied in the kernel.

The kernel is built with the other CPU kernels (see ``native.py``); where it cannot be built the layers use
torch's kernels.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from quickdraft.models import native

BLOCK = 256  # input columns per block (8 groups)
GROUP = 32
CHUNK_ORDER = [0, 2, 1, 3, 4, 6, 5, 7]  # stored order of a block's 32-byte chunks (8-bit weights, see qmatmul.c)


def available() -> bool:
    """True when the kernel is built (or was just built) and loaded for this CPU."""
    return native.available()


def can_build() -> bool:
    """``native.can_build``: the kernel loaded, or buildable here (without building it)."""
    return native.can_build()


def unavailable_reason() -> str | None:
    return native.unavailable_reason()


def padded_width(in_features: int) -> int:
    return -(-in_features // BLOCK) * BLOCK


def packed_bytes(out_features: int, in_features: int, bits: int) -> int:
    """Bytes of one layer in the kernel's layout (``pack``): the padded weight and its bfloat16 scales and zeros."""
    kpad = padded_width(in_features)
    return out_features * (kpad * bits // 8 + kpad // GROUP * 4)


def pack(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's layout of ``w[n, k] = scales[n, k // 32] * (q[n, k] - off) + zeros[n, k // 32]``.

    ``q``: ``[N, K]`` unsigned values (0..15 for ``bits=4`` with off 8, 0..255 for ``bits=8`` with off 128);
    ``scales``/``zeros``: ``[N, K // 32]`` (rounded to bfloat16). Returns ``(weight uint8 [N, Kpad * bits / 8],
    scales_zeros bfloat16 [N, Kpad / 256, 16])``; padded columns have scale and zero 0."""
    n, k = q.shape
    if bits not in (4, 8) or k % GROUP or scales.shape != (n, k // GROUP) or zeros.shape != scales.shape:
        raise ValueError(f"qmatmul.pack: need bits 4/8, K % {GROUP} == 0 and [N, K/{GROUP}] scales; got bits={bits}, "
                         f"q {tuple(q.shape)}, scales {tuple(scales.shape)}, zeros {tuple(zeros.shape)}")
    kpad = padded_width(k)
    nblk = kpad // BLOCK
    qp = torch.zeros(n, kpad, dtype=torch.uint8)
    qp[:, :k] = q.to(torch.uint8)
    # element 32 j + 4 t + i of a block -> byte 4 j + i of chunk t
    arranged = qp.reshape(n, nblk, 8, 8, 4).permute(0, 1, 3, 2, 4).reshape(n, nblk, 8, 32)
    if bits == 4:  # chunk 2 s in the low nibbles of packed chunk s, chunk 2 s + 1 in the high ones
        weight = (arranged[:, :, 0::2] | (arranged[:, :, 1::2] << 4)).reshape(n, kpad // 2)
    else:  # chunks stored in the order CHUNK_ORDER
        weight = arranged[:, :, CHUNK_ORDER].reshape(n, kpad)
    sz = torch.zeros(n, kpad // GROUP, 2, dtype=torch.bfloat16)
    sz[:, :k // GROUP, 0] = scales.to(torch.bfloat16)
    sz[:, :k // GROUP, 1] = zeros.to(torch.bfloat16)
    sz = sz.reshape(n, nblk, 8, 2).transpose(2, 3).reshape(n, nblk, 16)
    return weight.contiguous(), sz.contiguous()


def unpack(weight: torch.Tensor, scales_zeros: torch.Tensor, bits: int, in_features: int
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of ``pack``: ``(q uint8 [N, K], scales, zeros bfloat16 [N, K // 32])``."""
    n = weight.shape[0]
    kpad = padded_width(in_features)
    nblk = kpad // BLOCK
    if bits == 4:
        packed = weight.reshape(n, nblk, 4, 32)
        arranged = torch.stack((packed & 0x0F, packed >> 4), dim=3).reshape(n, nblk, 8, 32)
    else:
        arranged = weight.reshape(n, nblk, 8, 32)[:, :, CHUNK_ORDER]  # the order is its own inverse
    q = arranged.reshape(n, nblk, 8, 8, 4).permute(0, 1, 3, 2, 4).reshape(n, kpad)[:, :in_features]
    sz = scales_zeros.reshape(n, nblk, 2, 8).transpose(2, 3).reshape(n, kpad // GROUP, 2)[:, :in_features // GROUP]
    return q.contiguous(), sz[..., 0].contiguous(), sz[..., 1].contiguous()


def row_bytes(code: int, in_features: int) -> int:
    """Bytes of one weight row of format ``code`` in the kernel's layout, as the kernel computes it (0: the format
    cannot take rows of ``in_features`` columns)."""
    n = int(native.lib().qd_row_bytes(code, in_features))
    if n < 0:
        raise ValueError(f"unknown qmatmul format code {code}")
    return n


@dataclass
class Part:
    """One weight of a ``linear_parts`` call, in the kernel's layout: ``fmt`` a format code of qformats.h; int4/int8
    (``pack``) with their ``scales_zeros``, a GGML format (``block_formats.repack``) with None."""

    weight: torch.Tensor
    scales_zeros: torch.Tensor | None
    fmt: int
    out_features: int
    bias: torch.Tensor | None = None  # float32 [out_features]


class PartsCall:
    """The kernel's argument arrays for a fixed list of parts, built once (a call then only passes x and y)."""

    def __init__(self, parts: list[Part], in_features: int, swiglu: bool = False) -> None:
        if not 1 <= len(parts) <= 8 or (swiglu and (len(parts) != 2 or parts[0].out_features != parts[1].out_features)):
            raise ValueError(f"qmatmul takes 1-8 parts (swiglu: 2 of equal size), got {len(parts)}")
        if any(p.fmt in (4, 8) and p.scales_zeros is None for p in parts):  # int4/int8 keep their scales apart
            raise ValueError("qmatmul's int4/int8 parts need their scales_zeros")
        self.parts, self.in_features, self.swiglu = parts, in_features, swiglu
        self.kpad = padded_width(in_features)
        n = len(parts)
        self._w = (ctypes.c_void_p * n)(*[p.weight.data_ptr() for p in parts])
        self._sz = (ctypes.c_void_p * n)(*[None if p.scales_zeros is None else p.scales_zeros.data_ptr() for p in parts])
        self._fmt = (ctypes.c_int * n)(*[p.fmt for p in parts])
        self._n = (ctypes.c_int * n)(*[p.out_features for p in parts])
        self._bias = (ctypes.c_void_p * n)(*[None if p.bias is None else p.bias.data_ptr() for p in parts])
        self.out_features = parts[0].out_features if swiglu else sum(p.out_features for p in parts)

    def __call__(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """``x [M, K]`` (float32 or bfloat16) -> ``[M, out_features]`` in ``out_dtype`` (float32 or bfloat16; default
        ``x``'s dtype)."""
        if x.dtype not in (torch.float32, torch.bfloat16):
            x = x.float()
        x = x.contiguous()
        m = x.shape[0]
        y = torch.empty(m, self.out_features, dtype=out_dtype or x.dtype)
        rc = native.lib().qd_linear(x.data_ptr(), int(x.dtype == torch.bfloat16), m, self.in_features, self.kpad,
                                    len(self.parts), self._w, self._sz, self._fmt, self._n, self._bias,
                                    int(self.swiglu), y.data_ptr(), int(y.dtype == torch.bfloat16))
        if rc != 0:
            raise RuntimeError(f"qd_linear failed ({'out of memory' if rc == -1 else 'bad arguments'}, code {rc})")
        return y

