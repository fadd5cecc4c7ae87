"""Weight-only quantized linear layers: int8 per output channel, int4 per group of input columns.

Weights stay quantized in memory. Each layer has one backend, chosen when it is built:

* ``"qmatmul"`` (CPU, default where it builds): quickdraft's own kernel (``qmatmul.py``/``qmatmul.c``; AVX2, VNNI where present):
  activations quantized to int8 per group of 32, int8 dot products; 2-3x faster decode steps than torch's
  kernels and a verify pass of 5 rows that costs far less than 5 steps.
* ``"torch"`` (CPU without the kernel): torch's packed kernels ``aten._weight_int8pack_mm`` and
  ``aten._weight_int4pack_mm_for_cpu``.
* ``"reference"`` (other devices): dequantize, then matmul; only meant to be correct.

Every backend computes each output row independently of the other rows of the call.

Facts about torch's kernels (checked on torch 2.13 CPU, see tests/test_quant.py):

* Both kernels need the scales in the activation dtype; float32, bfloat16 and float16
  activations are accepted. With float32 activations both kernels are 15-40x slower
  than with bfloat16 (no vectorized float32 path), so float32 inputs are rounded to
  bfloat16 for the matmul and the result is returned as float32.
* int4: ``w[n, k] = (q[n, k] - 8) * scale[k // G, n] + zero[k // G, n]`` with ``q`` in
  0..15 and ``scales_and_zeros`` of shape ``[K // G, N, 2]`` (``[..., 0]`` scale,
  ``[..., 1]`` zero). The packed layout made by ``_convert_weight_to_int4pack_for_cpu``
  depends on the CPU ISA torch dispatches to (AVX512 vs AVX2 vs default), so packed
  weights are only valid on the machine type that packed them.
* int8: ``w[n, k] = q[n, k] * scale[n]`` with ``q`` int8.
* ``_convert_weight_to_int4pack_for_cpu`` needs N % 16 == 0: other row counts are padded.
* ``_weight_int8pack_mm`` segfaults when its activation or weight is not 64-byte aligned (a weight
  memory-mapped from safetensors, a sliced activation); such operands are copied (``_aligned``).
  The int4 kernel takes unaligned operands.
* Both kernels compute every output row independently of the other rows: a row's result is bit-identical
  whether the batch has 1 or 200 rows (dense bfloat16 ``F.linear`` differs between 1 row and several).
* Speed (one 8960x1536 projection, 1 thread, busy 2-core AVX512 machine, ms for 1 / 5 / 128 rows):
  bfloat16 dense 4.1 / 3.1 / 21, int8 2.6 / 5.2 / 113, int4 0.9 / 2.3 / 53. int4 wins for decode
  and short verify steps, dense bfloat16 for long prefills.
"""
from __future__ import annotations

import torch
from torch import nn
import torch.nn.functional as F

from quickdraft.models import qmatmul

INT4_GROUP_SIZES = (32, 64, 128)
# Scales/zeros are kept in this dtype: the CPU kernels run fast with bfloat16 activations only.
SCALE_DTYPE = torch.bfloat16
_ALIGN = 64
_N_MULTIPLE = 16  # _convert_weight_to_int4pack_for_cpu: "expect N to be dividable by 16"
_BF16_ROUND_UP = 1.0 + 2.0 ** -7  # v * this, rounded to nearest bfloat16, is >= v


def cpu_capability() -> str:
    """The ISA torch's CPU kernels dispatch to (e.g. 'AVX512', 'AVX2', 'DEFAULT'): packed int4 layouts depend on it."""
    try:
        return str(torch.backends.cpu.get_cpu_capability())
    except Exception:  # pragma: no cover - very old torch
        return "unknown"


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """``t`` contiguous and 64-byte aligned. ``_weight_int8pack_mm`` crashes (SIGSEGV, torch 2.13, AVX512) when its
    activation or weight is not 64-byte aligned, e.g. a weight memory-mapped from a safetensors file or a
    sliced activation; torch's CPU allocator aligns new tensors to 64 bytes, so a copy fixes it."""
    t = t.contiguous()
    return t if t.data_ptr() % _ALIGN == 0 else t.clone()


def _kernel_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float16 if x.dtype == torch.float16 else torch.bfloat16


# ---- quantizers (pure functions, float32 in) ---------------------------------------------------------------


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: ``(q int8 [N, K], scale bfloat16 [N])`` with ``w ~= q * scale``.

    The scale is rounded *up* to bfloat16, so ``|w / scale| <= 127`` and the error is at most
    ``scale / 2`` per element (no clipping)."""
    w = w.float()
    amax = w.abs().amax(dim=1)
    scale = (amax / 127.0 * _BF16_ROUND_UP).clamp(min=1e-30).to(SCALE_DTYPE)
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
    scale = ((hi - lo) / 15.0 * _BF16_ROUND_UP).to(SCALE_DTYPE)
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
    n, half = p.shape
    out = torch.empty(n, half, 2, dtype=torch.uint8, device=p.device)
    out[..., 0] = p & 0x0F
    out[..., 1] = p >> 4
    return out.reshape(n, 2 * half)


def int4pack_for_cpu(q: torch.Tensor) -> torch.Tensor:
    """Pack ``[N, K]`` 0..15 values into the CPU kernel's (ISA-dependent) ``[N, K // 2]`` uint8 layout."""
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)


# ---- modules -----------------------------------------------------------------------------------------------

BACKENDS = ("qmatmul", "torch", "reference")


def default_backend(device: torch.device | str) -> str:
    """``qmatmul`` on CPU where the kernel builds, else torch's kernels on CPU, else the reference path."""
    if torch.device(device).type != "cpu":
        return "reference"
    return "qmatmul" if qmatmul.available() else "torch"


def _resolve_backend(kernel: bool | str | None, device: torch.device) -> str:
    """``kernel``: None or True = the device's default kernel, False = ``reference``, or a name of ``BACKENDS``."""
    if kernel is None or kernel is True:
        return default_backend(device)
    backend = "reference" if kernel is False else kernel
    if backend not in BACKENDS:
        raise ValueError(f"quantized layer backend must be one of {BACKENDS}, got {kernel!r}")
    if backend != "reference" and device.type != "cpu":
        raise ValueError(f"the {backend} backend needs CPU tensors")
    if backend == "qmatmul" and not qmatmul.available():
        raise ValueError(f"the qmatmul kernel is unavailable here: {qmatmul.unavailable_reason()}")
    return backend


class _QuantLinearBase(nn.Module):
    in_features: int
    out_features: int
    backend: str
    bits: int

    def _init_bias(self, bias: torch.Tensor | None) -> None:
        if bias is not None:
            self.register_buffer("bias", bias.detach())
        else:
            self.bias = None
        self._call: qmatmul.PartsCall | None = None

    def kernel_part(self) -> qmatmul.Part:
        """This layer as one part of a qmatmul call (``qmatmul`` backend only)."""
        bias = None if self.bias is None else self.bias.float().contiguous()
        return qmatmul.Part(self.kweight, self.kscales, self.bits, self.out_features, bias)

    def _qmatmul(self, x2: torch.Tensor) -> torch.Tensor:
        call = self._call
        if call is None or call.parts[0].weight.data_ptr() != self.kweight.data_ptr():  # built once per weight
            call = self._call = qmatmul.PartsCall([self.kernel_part()], self.in_features)
        return call(x2)

    def _finish(self, y: torch.Tensor, x: torch.Tensor, lead: tuple[int, ...]) -> torch.Tensor:
        y = y.to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"backend={self.backend}")


class Int8Linear(_QuantLinearBase):
    """``y = x @ (q * scale[:, None]).T + bias`` with int8 ``q`` per output channel.

    Buffers: ``qweight`` int8 ``[N, K]`` and ``scales`` bfloat16 ``[N]`` (``torch``/``reference`` backends), or the
    qmatmul layout ``kweight``/``kscales`` (``q + 128`` as 8-bit values, the row's scale in every group, zero 0)."""

    bits = 8

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None, *,
                 kernel: bool | str | None = None) -> None:
        """``kernel``: see ``_resolve_backend`` (default: the device's fastest kernel)."""
        super().__init__()
        if qweight.dtype != torch.int8 or qweight.dim() != 2:
            raise ValueError(f"Int8Linear needs an int8 [out, in] weight, got {qweight.dtype} {tuple(qweight.shape)}")
        self.out_features, self.in_features = qweight.shape
        if scales.shape != (self.out_features,):
            raise ValueError(f"Int8Linear scales must have shape ({self.out_features},), got {tuple(scales.shape)}")
        self.backend = _resolve_backend(kernel, qweight.device)
        if self.backend == "qmatmul" and self.in_features % qmatmul.GROUP:
            self.backend = "torch"  # the kernel works on groups of 32 input columns
        if self.backend == "qmatmul":
            groups = self.in_features // qmatmul.GROUP
            s = scales.to(SCALE_DTYPE)[:, None].expand(-1, groups)
            kw, ks = qmatmul.pack((qweight.to(torch.int16) + 128).to(torch.uint8), s, torch.zeros_like(s), 8)
            self.register_buffer("kweight", kw)
            self.register_buffer("kscales", ks)
        else:
            self.register_buffer("qweight", _aligned(qweight))
            self.register_buffer("scales", _aligned(scales.to(SCALE_DTYPE)))
        self._init_bias(bias)
        self._scales_f16: torch.Tensor | None = None

    @classmethod
    def from_kernel_tensors(cls, kweight: torch.Tensor, kscales: torch.Tensor, in_features: int,
                            bias: torch.Tensor | None = None) -> Int8Linear:
        """A qmatmul layer from its own tensors (e.g. memory-mapped from the cache): no copy is made."""
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self.out_features, self.in_features, self.backend = kweight.shape[0], int(in_features), "qmatmul"
        _check_kernel_tensors(kweight, kscales, 8, in_features)
        self.register_buffer("kweight", kweight)
        self.register_buffer("kscales", kscales)
        self._init_bias(bias)
        self._scales_f16 = None
        return self

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None, **kw) -> Int8Linear:
        q, s = quantize_int8(weight)
        return cls(q.to(weight.device), s.to(weight.device), bias, **kw)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Int8Linear:
        return cls.from_float(linear.weight.detach(), None if linear.bias is None else linear.bias.detach())

    def int_weight(self) -> torch.Tensor:
        """The int8 ``[N, K]`` weight values."""
        if self.backend != "qmatmul":
            return self.qweight
        u, _, _ = qmatmul.unpack(self.kweight, self.kscales, 8, self.in_features)
        return (u.to(torch.int16) - 128).to(torch.int8)

    def channel_scales(self) -> torch.Tensor:
        """The bfloat16 ``[N]`` per-row scales."""
        if self.backend != "qmatmul":
            return self.scales
        return qmatmul.unpack(self.kweight, self.kscales, 8, self.in_features)[1][:, 0].contiguous()

    def dequantize(self) -> torch.Tensor:
        """The float32 weight ``[out, in]`` this layer multiplies with."""
        return self.int_weight().float() * self.channel_scales().float()[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if self.backend == "qmatmul":
            return self._qmatmul(x2).reshape(*lead, self.out_features)
        if self.backend == "torch":
            kd = _kernel_dtype(x2)
            scales = self.scales
            if kd == torch.float16:
                if self._scales_f16 is None:
                    self._scales_f16 = self.scales.to(torch.float16)
                scales = self._scales_f16
            y = torch.ops.aten._weight_int8pack_mm(_aligned(x2.to(kd)), self.qweight, scales)
        else:
            w = self.qweight.to(x2.dtype) * self.scales.to(x2.dtype)[:, None]
            y = F.linear(x2, w)
        return self._finish(y, x, lead)


def _check_kernel_tensors(kweight: torch.Tensor, kscales: torch.Tensor, bits: int, in_features: int) -> None:
    kpad = qmatmul.padded_width(in_features)
    n = kweight.shape[0]
    if kweight.dtype != torch.uint8 or tuple(kweight.shape) != (n, kpad * bits // 8):
        raise ValueError(f"qmatmul weight must be uint8 [{n}, {kpad * bits // 8}], "
                         f"got {kweight.dtype} {tuple(kweight.shape)}")
    if kscales.dtype != torch.bfloat16 or tuple(kscales.shape) != (n, kpad // qmatmul.BLOCK, 16):
        raise ValueError(f"qmatmul scales must be bfloat16 [{n}, {kpad // qmatmul.BLOCK}, 16], "
                         f"got {kscales.dtype} {tuple(kscales.shape)}")
    if kweight.device.type != "cpu" or not qmatmul.available():
        raise ValueError("qmatmul weights need CPU tensors and the qmatmul kernel")


class Int4Linear(_QuantLinearBase):
    """``y = x @ W.T + bias`` with ``W[n, k] = (q[n, k] - 8) * scale[n, k // G] + zero[n, k // G]``, ``q`` in 0..15.

    Storage by backend: ``qmatmul``: ``kweight``/``kscales`` (the kernel's layout, scales repeated per 32
    columns for G > 32); ``torch``: ``packed`` (the int4pack kernel's ISA-dependent layout) with
    ``scales_and_zeros`` ``[K // G, N, 2]`` bfloat16; ``reference``: nibbles ``qweight`` ``[N, K // 2]`` (even
    column in the low nibble) with ``scales_and_zeros``. Build the layer on the device it will run on."""

    bits = 4

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int = 32,
                 bias: torch.Tensor | None = None, *, kernel: bool | str | None = None) -> None:
        """``q``: ``[N, K]`` values 0..15 (any integer dtype); ``scales``/``zeros``: ``[N, K // G]`` (rounded to
        bfloat16); ``kernel``: see ``_resolve_backend`` (default: the device's fastest kernel)."""
        super().__init__()
        n, k = q.shape
        self._init_shape(n, k, group_size)
        if scales.shape != (n, k // group_size) or zeros.shape != scales.shape:
            raise ValueError(f"Int4Linear scales/zeros must have shape ({n}, {k // group_size}), "
                             f"got {tuple(scales.shape)} / {tuple(zeros.shape)}")
        device = q.device
        self.backend = _resolve_backend(kernel, device)
        if self.backend == "qmatmul":
            r = group_size // qmatmul.GROUP
            kw, ks = qmatmul.pack(q, scales.to(SCALE_DTYPE).repeat_interleave(r, 1),
                                  zeros.to(SCALE_DTYPE).repeat_interleave(r, 1), 4)
            self.register_buffer("kweight", kw)
            self.register_buffer("kscales", ks)
            self.packed = self.qweight = None
            self._init_bias(bias)
            return
        self.kweight = None
        sz = torch.stack((scales.to(SCALE_DTYPE), zeros.to(SCALE_DTYPE)), dim=-1).transpose(0, 1)  # [K // G, N, 2]
        if self.backend == "torch":
            # the CPU kernel needs N % 16 == 0: pad rows (q = 8, scale 0, zero 0: output 0) and slice the output
            self.padded_out = -(-n // _N_MULTIPLE) * _N_MULTIPLE
            pad = self.padded_out - n
            self.register_buffer("packed", int4pack_for_cpu(F.pad(q.to(torch.int32), (0, 0, 0, pad), value=8)))
            self.register_buffer("scales_and_zeros", F.pad(sz, (0, 0, 0, pad)).contiguous().to(device))
            self.qweight = None
        else:
            self.register_buffer("qweight", pack_nibbles(q))
            self.register_buffer("scales_and_zeros", sz.contiguous().to(device))
            self.packed = None
        self._init_bias(bias)

    def _init_shape(self, out_features: int, in_features: int, group_size: int) -> None:
        if group_size not in INT4_GROUP_SIZES:
            raise ValueError(f"int4 group size must be one of {INT4_GROUP_SIZES}, got {group_size}")
        if in_features % group_size:
            raise ValueError(f"in_features={in_features} is not a multiple of the group size {group_size}")
        self.out_features, self.in_features, self.group_size = int(out_features), int(in_features), group_size
        self.padded_out = self.out_features
        self._sz_f16: torch.Tensor | None = None

    @classmethod
    def from_packed(cls, packed: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int, in_features: int,
                    out_features: int, bias: torch.Tensor | None = None) -> Int4Linear:
        """A ``torch``-backend layer from the int4pack kernel's own tensors (``packed`` ``[N16, K // 2]`` uint8 from
        ``_convert_weight_to_int4pack_for_cpu`` on this CPU type, ``scales_and_zeros`` ``[K // G, N16, 2]`` bfloat16,
        rows padded to ``N16``, a multiple of 16), e.g. memory-mapped from the cache: no copy is made."""
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self._init_shape(out_features, in_features, group_size)
        self.padded_out = -(-self.out_features // _N_MULTIPLE) * _N_MULTIPLE
        groups = self.in_features // group_size
        if packed.dtype != torch.uint8 or tuple(packed.shape) != (self.padded_out, self.in_features // 2):
            raise ValueError(f"packed int4 weight must be uint8 [{self.padded_out}, {self.in_features // 2}], "
                             f"got {packed.dtype} {tuple(packed.shape)}")
        if scales_and_zeros.dtype != SCALE_DTYPE or tuple(scales_and_zeros.shape) != (groups, self.padded_out, 2):
            raise ValueError(f"scales_and_zeros must be {SCALE_DTYPE} [{groups}, {self.padded_out}, 2], "
                             f"got {scales_and_zeros.dtype} {tuple(scales_and_zeros.shape)}")
        if packed.device.type != "cpu":
            raise ValueError("packed int4 weights are for the CPU kernel only")
        self.backend = "torch"
        # the int4pack kernel takes unaligned operands (unlike int8pack, see tests/test_quant.py), so an mmap is fine
        self.register_buffer("packed", packed.contiguous())
        self.register_buffer("scales_and_zeros", scales_and_zeros.contiguous())
        self.qweight = self.kweight = None
        self._init_bias(bias)
        return self

    @classmethod
    def from_kernel_tensors(cls, kweight: torch.Tensor, kscales: torch.Tensor, in_features: int,
                            bias: torch.Tensor | None = None) -> Int4Linear:
        """A qmatmul layer (group 32) from its own tensors (e.g. memory-mapped from the cache): no copy is made."""
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self._init_shape(kweight.shape[0], in_features, qmatmul.GROUP)
        _check_kernel_tensors(kweight, kscales, 4, in_features)
        self.backend = "qmatmul"
        self.packed = self.qweight = None
        self.register_buffer("kweight", kweight)
        self.register_buffer("kscales", kscales)
        self._init_bias(bias)
        return self

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None, group_size: int = 32,
                   **kw) -> Int4Linear:
        q, s, z = quantize_int4(weight, group_size)
        return cls(q, s, z, group_size, bias, **kw)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group_size: int = 32) -> Int4Linear:
        return cls.from_float(linear.weight.detach(), None if linear.bias is None else linear.bias.detach(), group_size)

    def _kernel_scales_zeros(self) -> tuple[torch.Tensor, torch.Tensor]:
        _, s, z = qmatmul.unpack(self.kweight, self.kscales, 4, self.in_features)
        return s[:, ::self.group_size // qmatmul.GROUP], z[:, ::self.group_size // qmatmul.GROUP]

    @property
    def scales(self) -> torch.Tensor:
        """``[N, K // G]`` bfloat16."""
        if self.backend == "qmatmul":
            return self._kernel_scales_zeros()[0]
        return self.scales_and_zeros[:, :self.out_features, 0].t()

    @property
    def zeros(self) -> torch.Tensor:
        if self.backend == "qmatmul":
            return self._kernel_scales_zeros()[1]
        return self.scales_and_zeros[:, :self.out_features, 1].t()

    def int_weight(self) -> torch.Tensor:
        """The ``[N, K]`` uint8 values 0..15 (with torch's kernel recovered from its packed layout through it)."""
        if self.backend == "qmatmul":
            return qmatmul.unpack(self.kweight, self.kscales, 4, self.in_features)[0]
        if self.backend == "reference":
            return unpack_nibbles(self.qweight)
        n, k, g = self.padded_out, self.in_features, self.group_size
        ones = torch.tensor([1.0, 8.0], dtype=torch.bfloat16).expand(k // g, n, 2).contiguous()  # (q - 8) * 1 + 8
        rows = []
        for start in range(0, k, 1024):
            m = min(1024, k - start)
            eye = torch.zeros(m, k, dtype=torch.bfloat16)
            eye[torch.arange(m), torch.arange(start, start + m)] = 1.0
            rows.append(torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self.packed, g, ones))
        return torch.cat(rows)[:, :self.out_features].t().round().to(torch.uint8).contiguous()

    def dequantize(self) -> torch.Tensor:
        """The float32 weight ``[out, in]`` this layer multiplies with."""
        return dequantize_int4(self.int_weight(), self.scales, self.zeros, self.group_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if self.backend == "qmatmul":
            return self._qmatmul(x2).reshape(*lead, self.out_features)
        if self.backend == "torch":
            kd = _kernel_dtype(x2)
            sz = self.scales_and_zeros
            if kd == torch.float16:
                if self._sz_f16 is None:
                    self._sz_f16 = sz.to(torch.float16)
                sz = self._sz_f16
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(_aligned(x2.to(kd)), self.packed, self.group_size, sz)
            if self.padded_out != self.out_features:
                y = y[:, :self.out_features]
        else:
            n, k, g = self.out_features, self.in_features, self.group_size
            q = unpack_nibbles(self.qweight).to(x2.dtype).reshape(n, k // g, g)
            sz = self.scales_and_zeros[:, :n].to(x2.dtype)
            w = ((q - 8) * sz[..., 0].t()[..., None] + sz[..., 1].t()[..., None]).reshape(n, k)
            y = F.linear(x2, w)
        return self._finish(y, x, lead)


QuantLinear = (Int8Linear, Int4Linear)


class QuantGroup(nn.Module):
    """Quantized layers that read the same input (q/k/v, gate/up) run as one qmatmul call: the input is
    quantized once and one parallel loop covers all the weights. The output is the layers' outputs side by side,
    or with ``swiglu`` (gate, up) ``silu(gate) * up`` computed in the kernel. Each layer keeps its own format
    (a Q4_K_M GGUF stores some v projections with more bits than q and k) and its own tensors (no copy)."""

    def __init__(self, layers: list[nn.Module], swiglu: bool = False) -> None:
        super().__init__()
        if not all(isinstance(m, QuantLinear) and m.backend == "qmatmul" for m in layers):
            raise ValueError("QuantGroup needs Int4Linear/Int8Linear layers on the qmatmul backend")
        if len({m.in_features for m in layers}) != 1:
            raise ValueError(f"QuantGroup layers must share in_features, got {[m.in_features for m in layers]}")
        self.layers = nn.ModuleList(layers)
        self.in_features = layers[0].in_features
        self.call = qmatmul.PartsCall([m.kernel_part() for m in layers], self.in_features, swiglu)
        self.out_features = self.call.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        return self.call(x.reshape(-1, self.in_features)).reshape(*lead, self.out_features)
