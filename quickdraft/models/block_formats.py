"""GGML block formats read by the qmatmul kernel at the file's own size: the repacking of a GGUF tensor's rows into
the kernel's blocks (``qformats.h`` describes the layout) and the float32 values they stand for.

A file's block stores a few integers and fp16 numbers per 32 (or 16, 64, 128, 256) weights; the kernel wants the
same numbers arranged so that one int32 lane of a dot product is one group of 32: values in the order of the
quantized activations, one scale and one shift per group. Repacking moves bits and copies the fp16 numbers as
they are, so the kernel computes the file's own weights (``dequantize`` gives them, for checks).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from quickdraft.models import grid_formats
from quickdraft.models.format_table import FORMATS
from quickdraft.models.grid_formats import GRID_FORMATS
from quickdraft.models.qmatmul import BLOCK, CHUNK_ORDER, GROUP

IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
MXFP4_VALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)  # e2m1, doubled (ggml's kvalues_mxfp4)
# MXFP4 exponent bytes above this scale weights past 2^120 (no model's): the kernel's shift, -128 scale, would overflow
MXFP4_MAX_EXPONENT = 248


# ---- the file's blocks -> per-element integers and per-group numbers ---------------------------------------------

@dataclass
class Decoded:
    """A tensor's rows as integers: ``low`` the 4-bit part of each value (or all of it), ``bit`` a fifth bit (Q5_*),
    Q1_0's bit or Q3_K's third, ``two`` two bits (Q6_K's top bits, Q2_0's and Q2_K's value, Q3_K's low bits),
    ``byte`` an 8-bit value (Q8_0: q + 128), each
    ``[N, K]`` uint8 in element order; the fp16 numbers as raw bits ``[N, ...]`` int16 (``d``, ``m`` per block of
    the file; ``dmin``; MXFP4's ``d``: its exponent bytes, uint8); ``sc``/``mn`` small per-sub-block integers."""

    low: torch.Tensor | None = None
    bit: torch.Tensor | None = None
    two: torch.Tensor | None = None
    byte: torch.Tensor | None = None
    d: torch.Tensor | None = None
    m: torch.Tensor | None = None
    dmin: torch.Tensor | None = None
    sc: torch.Tensor | None = None
    mn: torch.Tensor | None = None


def _fp16_bits(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.int16).reshape(b.shape[0], -1)


def e8m0_half(e: torch.Tensor) -> torch.Tensor:
    """MXFP4's exponent bytes as the float32 scale of its doubled values, 2^(e - 128) (ggml's e8m0_to_fp32_half:
    a subnormal for e < 2)."""
    e = e.to(torch.int32)
    return torch.where(e < 2, torch.tensor(0x00200000, dtype=torch.int32) << e, (e - 1) << 23).view(torch.float32)


def _nibbles(qs: torch.Tensor, span: int) -> torch.Tensor:
    """[n, c * span] bytes -> [n, 2 c span]: low nibbles of each ``span`` bytes, then their high nibbles."""
    q = qs.reshape(qs.shape[0], -1, 1, span)
    return torch.cat((q & 0x0F, q >> 4), dim=2).reshape(qs.shape[0], -1)


def _bits_le(b: torch.Tensor) -> torch.Tensor:
    """[n, k] bytes -> [n, 8 k] bits, bit j of byte i at 8 i + j."""
    return ((b.unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8)) & 1).reshape(b.shape[0], -1)


def _bit_planes(mask: torch.Tensor) -> torch.Tensor:
    """[nb, 32] bytes -> [nb, 256] bits: element 32 j + l is bit j of byte l (Q5_K's fifth bits, Q3_K's third)."""
    return ((mask.unsqueeze(1) >> torch.arange(8, dtype=torch.uint8).reshape(1, 8, 1)) & 1).reshape(mask.shape[0], -1)


def _two_bit_planes(q: torch.Tensor) -> torch.Tensor:
    """[nb, 64] bytes -> [nb, 256] two-bit values: element 128 h + 32 j + l is bits 2 j of byte 32 h + l (Q6_K's
    top bits, Q2_K's and Q3_K's values)."""
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(1, 1, 4, 1)
    return ((q.reshape(q.shape[0], 2, 1, 32) >> shifts) & 3).reshape(q.shape[0], -1)


def _k_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 12 bytes of Q4_K / Q5_K 6-bit scales and mins -> two [n, 8] uint8."""
    s = s.reshape(s.shape[0], 3, 4)
    a, b, c = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat((a & 0x3F, (c & 0x0F) | ((a >> 2) & 0x30)), dim=-1)
    mn = torch.cat((b & 0x3F, (c >> 4) | ((b >> 2) & 0x30)), dim=-1)
    return sc, mn


def _q3_k_scales(s: torch.Tensor) -> torch.Tensor:
    """The 12 bytes of Q3_K's 6-bit scales -> [n, 16] uint8 (0..63; the weight's scale is d (sc - 32)): scale i has
    its low 4 bits in byte i % 8 (low nibble for i < 8), its top 2 in bits 2 (i // 4 % 2) .. of byte 8 + i % 4."""
    i = torch.arange(16)
    low = (s[:, i % 8] >> (4 * (i // 8)).to(torch.uint8)) & 0x0F
    top = (s[:, 8 + i % 4] >> (2 * (i // 4)).to(torch.uint8)) & 3
    return low | (top << 4)


def _base3_trits(b: torch.Tensor) -> torch.Tensor:
    """TQ1_0's 48 bytes of 5 base-3 digits and 4 of 4 -> [nb, 256] values 0..2: digit i of byte x is
    ((x 3^i mod 256) 3) >> 8 (ggml's reading); bytes 0..31 give elements 32 i + m, bytes 32..47 160 + 16 i + m, the
    last 4 240 + 4 i + j."""
    def digits(x: torch.Tensor, count: int) -> torch.Tensor:  # [nb, c] -> [nb, count, c]
        powers = torch.tensor([3 ** i for i in range(count)], dtype=torch.int32).reshape(1, count, 1)
        return ((x.to(torch.int32).unsqueeze(1) * powers & 0xFF) * 3 >> 8).to(torch.uint8)

    nb = b.shape[0]
    return torch.cat([digits(b[:, :32], 5).reshape(nb, -1), digits(b[:, 32:48], 5).reshape(nb, -1),
                      digits(b[:, 48:52], 4).reshape(nb, -1)], dim=1)


def decode(name: str, data: torch.Tensor, n: int, k: int) -> Decoded:
    """The file's blocks of ``n`` rows of ``k`` columns (``data``: their bytes, uint8) as integers (``Decoded``)."""
    fmt = FORMATS[name]
    nb = n * k // fmt.block
    b = data.reshape(nb, fmt.block_bytes)
    rows = lambda t: t.reshape(n, -1)  # noqa: E731
    out = Decoded()
    if name in ("Q4_0", "IQ4_NL"):
        out.d, out.low = rows(_fp16_bits(b[:, :2])), rows(_nibbles(b[:, 2:], 16))
    elif name == "MXFP4":  # an exponent byte (kept as it is) instead of IQ4_NL's fp16 d, the same nibbles
        if bool((b[:, 0] > MXFP4_MAX_EXPONENT).any()):
            raise ValueError(f"an MXFP4 block's exponent byte is {int(b[:, 0].max())}: a scale of 2^"
                             f"{int(b[:, 0].max()) - 128}, past any weight's (at most {MXFP4_MAX_EXPONENT} is read)")
        out.d, out.low = rows(b[:, :1]), rows(_nibbles(b[:, 1:], 16))
    elif name == "Q4_1":
        out.d, out.m, out.low = rows(_fp16_bits(b[:, :2])), rows(_fp16_bits(b[:, 2:4])), rows(_nibbles(b[:, 4:], 16))
    elif name == "Q5_0":
        out.d, out.bit, out.low = rows(_fp16_bits(b[:, :2])), rows(_bits_le(b[:, 2:6])), rows(_nibbles(b[:, 6:], 16))
    elif name == "Q5_1":
        out.d, out.m = rows(_fp16_bits(b[:, :2])), rows(_fp16_bits(b[:, 2:4]))
        out.bit, out.low = rows(_bits_le(b[:, 4:8])), rows(_nibbles(b[:, 8:], 16))
    elif name == "Q8_0":
        out.d = rows(_fp16_bits(b[:, :2]))
        out.byte = rows((b[:, 2:].contiguous().view(torch.int8).to(torch.int16) + 128).to(torch.uint8))
    elif name in ("Q4_K", "Q5_K"):
        out.d, out.dmin = rows(_fp16_bits(b[:, :2])), rows(_fp16_bits(b[:, 2:4]))
        sc, mn = _k_scales(b[:, 4:16])
        out.sc, out.mn = rows(sc), rows(mn)
        out.low = rows(_nibbles(b[:, 16 if name == "Q4_K" else 48:], 32))
        if name == "Q5_K":  # sub-block j takes bit j of each of the 32 qh bytes
            out.bit = rows(_bit_planes(b[:, 16:48]))
    elif name == "Q6_K":
        out.low = rows(_nibbles(b[:, :128], 64))
        out.two = rows(_two_bit_planes(b[:, 128:192]))
        out.sc = rows(b[:, 192:208].contiguous().view(torch.int8))
        out.d = rows(_fp16_bits(b[:, 208:210]))
    elif name == "IQ4_XS":
        out.d = rows(_fp16_bits(b[:, :2]))
        high = b[:, 2:4].contiguous().view(torch.int16).to(torch.int32)
        high = (high >> torch.arange(0, 16, 2, dtype=torch.int32)) & 3
        low = (b[:, 4:8].unsqueeze(-1) >> torch.tensor([0, 4], dtype=torch.uint8)).reshape(nb, 8) & 0x0F
        out.sc = rows((low.to(torch.int32) | (high << 4)) - 32).to(torch.int8)
        out.low = rows(_nibbles(b[:, 8:], 16))
    elif name in ("Q2_K", "Q3_K"):
        out.two = rows(_two_bit_planes(b[:, 16:80] if name == "Q2_K" else b[:, 32:96]))
        if name == "Q2_K":  # per 16: the scale in the low nibble, the min in the high one
            out.sc, out.mn = rows(b[:, :16] & 0x0F), rows(b[:, :16] >> 4)
            out.d, out.dmin = rows(_fp16_bits(b[:, 80:82])), rows(_fp16_bits(b[:, 82:84]))
        else:
            out.bit = rows(_bit_planes(b[:, :32]))
            out.sc = rows(_q3_k_scales(b[:, 96:108]))
            out.d = rows(_fp16_bits(b[:, 108:110]))
    elif name == "TQ2_0":  # values 0..3 standing for q - 1, as Q2_K's planes; one d per 256
        out.two, out.d = rows(_two_bit_planes(b[:, :64])), rows(_fp16_bits(b[:, 64:66]))
    elif name == "TQ1_0":
        out.two, out.d = rows(_base3_trits(b[:, :52])), rows(_fp16_bits(b[:, 52:54]))
    elif name == "Q1_0":
        out.d, out.bit = rows(_fp16_bits(b[:, :2])), rows(_bits_le(b[:, 2:]))
    else:  # Q2_0
        out.d = rows(_fp16_bits(b[:, :2]))
        out.two = rows((b[:, 2:].unsqueeze(-1) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8)) & 3)
    return out


# ---- integers -> the kernel's blocks ------------------------------------------------------------------------------

def _stored(v: torch.Tensor) -> torch.Tensor:
    """[n, nb, 256] values in element order -> [n, nb, 8, 32]: chunk t's bytes (4 j + i) at stored position
    CHUNK_ORDER[t], i.e. stored byte s = 32 p + 4 j + i."""
    n, nb = v.shape[:2]
    natural = v.reshape(n, nb, 8, 8, 4).permute(0, 1, 3, 2, 4).reshape(n, nb, 8, 32)
    return natural[:, :, list(CHUNK_ORDER)]


def _nib(v: torch.Tensor) -> torch.Tensor:
    """4-bit values [n, nb, 256] -> [n, nb, 128]: chunk 2 s in the low nibbles of bytes 32 s .., chunk 2 s + 1 high."""
    n, nb = v.shape[:2]
    natural = v.reshape(n, nb, 8, 8, 4).permute(0, 1, 3, 2, 4).reshape(n, nb, 8, 32)
    return (natural[:, :, 0::2] | (natural[:, :, 1::2] << 4)).reshape(n, nb, 128)


def _pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """[..., 8 k] bits -> [..., k] bytes, bit j of byte i from 8 i + j."""
    shape = bits.shape
    b = bits.reshape(*shape[:-1], shape[-1] // 8, 8).to(torch.uint8) << torch.arange(8, dtype=torch.uint8)
    return b.sum(dim=-1, dtype=torch.uint8)


def _bits1(v: torch.Tensor) -> torch.Tensor:
    """One bit per value [n, nb, 256] -> [n, nb, 32]: stored byte 32 p + k at bit p of byte k."""
    s = _stored(v).to(torch.uint8)  # [n, nb, 8 (p), 32 (k)]
    return (s << torch.arange(8, dtype=torch.uint8).reshape(1, 1, 8, 1)).sum(dim=2, dtype=torch.uint8)


def _bits2(v: torch.Tensor) -> torch.Tensor:
    """Two bits per value [n, nb, 256] -> [n, nb, 64]: stored byte 64 u + k at bits 2 u of byte k."""
    s = _stored(v).reshape(v.shape[0], v.shape[1], 4, 64).to(torch.uint8)
    return s[:, :, 0] | (s[:, :, 1] << 2) | (s[:, :, 2] << 4) | (s[:, :, 3] << 6)


def _base3(v: torch.Tensor) -> torch.Tensor:
    """Values 0..2 [n, nb, 256] -> [n, nb, 52] TQ1_0 bytes in the kernel's lanes (qformats.h): byte 13 L + i holds,
    from its most significant digit, stored bytes 64 u + 16 L + i (u = 0..3) and, for i < 12, 64 (i // 3) + 16 L +
    13 + i % 3; written as ggml writes a byte, ceil(256 q / 243), whose digits read back exactly."""
    n, nb = v.shape[:2]
    s = _stored(v).reshape(n, nb, 4, 4, 16).transpose(2, 3).to(torch.int32)  # [n, nb, L, u, lane byte]
    i = torch.arange(12)
    fifth = torch.zeros(n, nb, 4, 13, dtype=torch.int32)
    fifth[..., :12] = s[..., i // 3, 13 + i % 3]  # [n, nb, L, i]
    digits = torch.cat((s[..., :13].transpose(3, 4), fifth.unsqueeze(-1)), dim=-1)  # [n, nb, L, i, 5]
    q = (digits * torch.tensor([81, 27, 9, 3, 1], dtype=torch.int32)).sum(-1)
    return ((q * 256 + 242) // 243).to(torch.uint8).reshape(n, nb, 52)


def _per_group(t: torch.Tensor, n: int, nb: int, per_block: int) -> torch.Tensor:
    """[n, groups...] numbers of the first nb kernel blocks as [n, nb, per_block * itemsize] bytes."""
    return t[:, :nb * per_block].contiguous().reshape(n, nb, per_block).view(torch.uint8).reshape(n, nb, -1)


def _tail_nib(v: torch.Tensor) -> torch.Tensor:
    """[n, g, 32] 4-bit values -> [n, g, 16]: element i low, element i + 16 high."""
    return v[..., :16] | (v[..., 16:] << 4)


def pack(name: str, dec: Decoded, n: int, k: int) -> torch.Tensor:
    """``[n, row_bytes]`` uint8: the rows in the kernel's layout (qformats.h)."""
    fmt = FORMATS[name]
    if not fmt.takes(k):
        raise ValueError(f"{name} rows of {k} columns do not fit the kernel's blocks")
    nb, rest = divmod(k, BLOCK)
    full = k - rest
    rows = [_blocks(name, dec, n, nb)] if nb else []
    if rest:
        rows.append(_tail(name, dec, n, full, rest))
    out = torch.cat(rows, dim=1).contiguous()
    assert out.shape == (n, fmt.row_bytes(k)), (name, out.shape, fmt.row_bytes(k))
    return out


def _blocks(name: str, dec: Decoded, n: int, nb: int) -> torch.Tensor:
    """The first ``nb`` blocks of 256 columns of each row, [n, nb * kernel_bytes]."""
    parts: list[torch.Tensor] = []

    def block(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t[:, :nb * BLOCK].reshape(n, nb, BLOCK)

    low, bit, two, byte = block(dec.low), block(dec.bit), block(dec.two), block(dec.byte)
    if low is not None:
        parts.append(_nib(low))
    if two is not None:
        parts.append(_base3(two) if name == "TQ1_0" else _bits2(two))
    if bit is not None:
        parts.append(_bits1(bit))
    if byte is not None:
        parts.append(_stored(byte).reshape(n, nb, BLOCK))
    if name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL", "MXFP4"):
        parts.append(_per_group(dec.d, n, nb, 8))
        if dec.m is not None:
            parts.append(_per_group(dec.m, n, nb, 8))
    elif name in ("Q4_K", "Q5_K"):
        parts += [_per_group(dec.d, n, nb, 1), _per_group(dec.dmin, n, nb, 1), _per_group(dec.sc, n, nb, 8),
                  _per_group(dec.mn, n, nb, 8)]
    elif name == "Q6_K":  # scales per 16: each group's first halves, then its second halves
        sc = dec.sc.reshape(n, nb, 8, 2)
        parts += [sc[..., 0].contiguous().view(torch.uint8), sc[..., 1].contiguous().view(torch.uint8),
                  _per_group(dec.d, n, nb, 1)]
    elif name == "Q2_K":  # per 16, as Q6_K's: each group's first halves, then its second halves; mn in high nibbles
        nibbles = (dec.sc | (dec.mn << 4)).reshape(n, nb, 8, 2)
        parts += [nibbles[..., 0], nibbles[..., 1], _per_group(dec.d, n, nb, 1), _per_group(dec.dmin, n, nb, 1)]
    elif name == "Q3_K":  # 6-bit scales per 16: low nibbles (first halves low, second halves high), then the top
        # bits, bits 2 i of a 32-bit word for first half i, 16 + 2 i for second half i
        sc = dec.sc.reshape(n, nb, 8, 2).to(torch.int32)
        low = ((sc[..., 0] & 0x0F) | ((sc[..., 1] & 0x0F) << 4)).to(torch.uint8)
        shifts = 2 * torch.arange(8, dtype=torch.int32)
        top = ((sc[..., 0] >> 4) << shifts).sum(-1) | ((sc[..., 1] >> 4) << (shifts + 16)).sum(-1)
        parts += [low, top.to(torch.int32).unsqueeze(-1).view(torch.uint8), _per_group(dec.d, n, nb, 1)]
    elif name == "IQ4_XS":
        parts += [_per_group(dec.d, n, nb, 1), _per_group(dec.sc, n, nb, 8)]
    elif name in ("TQ1_0", "TQ2_0"):
        parts.append(_per_group(dec.d, n, nb, 1))
    elif name == "Q1_0":
        parts.append(_per_group(dec.d, n, nb, 2))
    else:  # Q2_0
        parts.append(_per_group(dec.d, n, nb, 4))
    return torch.cat(parts, dim=-1).reshape(n, -1)


def _tail(name: str, dec: Decoded, n: int, full: int, rest: int) -> torch.Tensor:
    """The columns past the last whole block as tail records (qformats.h), [n, bytes]."""
    g = rest // GROUP
    first_group = full // GROUP

    def values(t: torch.Tensor) -> torch.Tensor:
        return t[:, full:].reshape(n, g, GROUP)

    def numbers(t: torch.Tensor, per: int) -> torch.Tensor:  # one fp16 per ``per`` groups of the tail
        return t[:, first_group // per:].contiguous().view(torch.uint8).reshape(n, g // per, -1)

    if name == "Q1_0":  # records of 4 groups: 16 bytes of bits, d
        bits = _pack_bits(dec.bit[:, full:].reshape(n, g // 4, 128))
        return torch.cat((bits, numbers(dec.d, 4)), dim=-1).reshape(n, -1)
    if name == "Q2_0":  # records of 2 groups: per group 8 bytes, element 8 q + k at bits 2 q of byte k; d
        v = dec.two[:, full:].reshape(n, g // 2, 2, 4, 8)
        packed = v[:, :, :, 0] | (v[:, :, :, 1] << 2) | (v[:, :, :, 2] << 4) | (v[:, :, :, 3] << 6)
        return torch.cat((packed.reshape(n, g // 2, 16), numbers(dec.d, 2)), dim=-1).reshape(n, -1)
    parts = []
    if dec.byte is not None:
        parts.append(values(dec.byte))
    else:
        parts.append(_tail_nib(values(dec.low)))
        if dec.bit is not None:
            parts.append(_pack_bits(values(dec.bit)))
    parts.append(numbers(dec.d, 1))
    if dec.m is not None:
        parts.append(numbers(dec.m, 1))
    return torch.cat(parts, dim=-1).reshape(n, -1)


def repack(name: str, data: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The file's blocks of ``n`` rows of ``k`` columns (uint8 bytes) -> ``[n, row_bytes]`` in the kernel's layout."""
    if name in GRID_FORMATS:
        return grid_formats.repack(name, data, n, k)
    return pack(name, decode(name, data, n, k), n, k)


# ---- the float32 weights a format's integers stand for (checks and float copies) ----------------------------------

def _f16(bits: torch.Tensor) -> torch.Tensor:
    return bits.contiguous().view(torch.float16).float()


def dequantize(name: str, data: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """``[n, k]`` float32 weights of the file's blocks (what the kernel multiplies with), from ``decode``."""
    if name in GRID_FORMATS:
        return grid_formats.dequantize(name, data, n, k)
    dec = decode(name, data, n, k)
    per = lambda t, size: t.float().repeat_interleave(size, dim=1)  # noqa: E731
    if name in ("Q4_0", "Q5_0"):
        q = dec.low.float() + (16 * dec.bit.float() if dec.bit is not None else 0)
        return (q - (8 if name == "Q4_0" else 16)) * per(_f16(dec.d), 32)
    if name in ("Q4_1", "Q5_1"):
        q = dec.low.float() + (16 * dec.bit.float() if dec.bit is not None else 0)
        return q * per(_f16(dec.d), 32) + per(_f16(dec.m), 32)
    if name == "Q8_0":
        return (dec.byte.float() - 128) * per(_f16(dec.d), 32)
    if name in ("Q4_K", "Q5_K"):
        q = dec.low.float() + (16 * dec.bit.float() if dec.bit is not None else 0)
        d, dmin = per(_f16(dec.d), 8), per(_f16(dec.dmin), 8)
        return q * per(d * dec.sc.float(), 32) - per(dmin * dec.mn.float(), 32)
    if name == "Q6_K":
        q = dec.low.float() + 16 * dec.two.float()
        return (q - 32) * per(per(_f16(dec.d), 16) * dec.sc.float(), 16)
    table = torch.tensor(IQ4_VALUES, dtype=torch.float32)
    if name == "IQ4_NL":
        return table[dec.low.long()] * per(_f16(dec.d), 32)
    if name == "MXFP4":
        return torch.tensor(MXFP4_VALUES, dtype=torch.float32)[dec.low.long()] * per(e8m0_half(dec.d), 32)
    if name == "IQ4_XS":
        return table[dec.low.long()] * per(per(_f16(dec.d), 8) * dec.sc.float(), 32)
    if name == "Q2_K":
        d, dmin = per(_f16(dec.d), 16), per(_f16(dec.dmin), 16)
        return dec.two.float() * per(d * dec.sc.float(), 16) - per(dmin * dec.mn.float(), 16)
    if name == "Q3_K":
        q = dec.two.float() + 4 * dec.bit.float()
        return (q - 4) * per(per(_f16(dec.d), 16) * (dec.sc.float() - 32), 16)
    if name == "Q1_0":
        return (2 * dec.bit.float() - 1) * per(_f16(dec.d), 128)
    if name in ("TQ1_0", "TQ2_0"):
        return (dec.two.float() - 1) * per(_f16(dec.d), 256)
    return (dec.two.float() - 1) * per(_f16(dec.d), 64)  # Q2_0
