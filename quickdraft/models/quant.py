"""Weight-only quantized linear layers: int8 per output channel, int4 per group of input columns.

Weights stay quantized in memory and are multiplied with torch's packed CPU kernels
(``aten._weight_int8pack_mm`` and ``aten._weight_int4pack_mm_for_cpu``). On other
devices a plain dequantize-then-matmul fallback gives the same numbers (it is only
meant to be correct, not fast).

Kernel facts (checked on torch 2.13 CPU, see tests/test_quant.py):

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


class _QuantLinearBase(nn.Module):
    in_features: int
    out_features: int

    def _init_bias(self, bias: torch.Tensor | None) -> None:
        if bias is not None:
            self.register_buffer("bias", bias.detach())
        else:
            self.bias = None

    def _finish(self, y: torch.Tensor, x: torch.Tensor, lead: tuple[int, ...]) -> torch.Tensor:
        y = y.to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class Int8Linear(_QuantLinearBase):
    """``y = x @ (q * scale[:, None]).T + bias`` with int8 ``q`` per output channel."""

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None, *,
                 kernel: bool | None = None) -> None:
        """``kernel``: use torch's int8pack kernel (default: on CPU); False: the dequantize fallback."""
        super().__init__()
        if qweight.dtype != torch.int8 or qweight.dim() != 2:
            raise ValueError(f"Int8Linear needs an int8 [out, in] weight, got {qweight.dtype} {tuple(qweight.shape)}")
        self.out_features, self.in_features = qweight.shape
        if scales.shape != (self.out_features,):
            raise ValueError(f"Int8Linear scales must have shape ({self.out_features},), got {tuple(scales.shape)}")
        self.register_buffer("qweight", _aligned(qweight))
        self.register_buffer("scales", _aligned(scales.to(SCALE_DTYPE)))
        self._init_bias(bias)
        self.use_kernel = qweight.device.type == "cpu" if kernel is None else bool(kernel)
        self._scales_f16: torch.Tensor | None = None

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None, **kw) -> Int8Linear:
        q, s = quantize_int8(weight)
        return cls(q.to(weight.device), s.to(weight.device), bias, **kw)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Int8Linear:
        return cls.from_float(linear.weight.detach(), None if linear.bias is None else linear.bias.detach())

    def dequantize(self) -> torch.Tensor:
        """The float32 weight ``[out, in]`` this layer multiplies with."""
        return self.qweight.float() * self.scales.float()[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if self.use_kernel and x2.device.type == "cpu":
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


class Int4Linear(_QuantLinearBase):
    """``y = x @ W.T + bias`` with ``W[n, k] = (q[n, k] - 8) * scale[n, k // G] + zero[n, k // G]``, ``q`` in 0..15.

    On CPU the weight is held in the int4pack kernel's packed layout (``packed``, ISA
    dependent) with ``scales_and_zeros`` ``[K // G, N, 2]`` bfloat16; elsewhere as
    portable nibbles (``qweight`` ``[N, K // 2]``, even column in the low nibble).
    Build the layer on the device it will run on (moving a CPU-packed layer to a GPU is not supported)."""

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int = 32,
                 bias: torch.Tensor | None = None, *, kernel: bool | None = None) -> None:
        """``q``: ``[N, K]`` values 0..15 (any integer dtype); ``scales``/``zeros``: ``[N, K // G]`` (rounded to
        bfloat16); ``kernel``: use the int4pack CPU kernel (default: on CPU); False: portable nibbles and the
        dequantize fallback."""
        super().__init__()
        n, k = q.shape
        self._init_shape(n, k, group_size)
        if scales.shape != (n, k // group_size) or zeros.shape != scales.shape:
            raise ValueError(f"Int4Linear scales/zeros must have shape ({n}, {k // group_size}), "
                             f"got {tuple(scales.shape)} / {tuple(zeros.shape)}")
        device = q.device
        self.use_kernel = device.type == "cpu" if kernel is None else bool(kernel)
        if self.use_kernel and device.type != "cpu":
            raise ValueError("the int4pack kernel path needs CPU tensors")
        sz = torch.stack((scales.to(SCALE_DTYPE), zeros.to(SCALE_DTYPE)), dim=-1).transpose(0, 1)  # [K // G, N, 2]
        if self.use_kernel:
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
        """A CPU layer from the kernel's own tensors (``packed`` ``[N16, K // 2]`` uint8 from
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
        self.use_kernel = True
        # the int4pack kernel takes unaligned operands (unlike int8pack, see tests/test_quant.py), so an mmap is fine
        self.register_buffer("packed", packed.contiguous())
        self.register_buffer("scales_and_zeros", scales_and_zeros.contiguous())
        self.qweight = None
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

    @property
    def scales(self) -> torch.Tensor:
        """``[N, K // G]`` bfloat16."""
        return self.scales_and_zeros[:, :self.out_features, 0].t()

    @property
    def zeros(self) -> torch.Tensor:
        return self.scales_and_zeros[:, :self.out_features, 1].t()

    def int_weight(self) -> torch.Tensor:
        """The ``[N, K]`` uint8 values 0..15 (on CPU recovered from the packed layout through the kernel)."""
        if not self.use_kernel:
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
        if self.use_kernel and x2.device.type == "cpu":
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
