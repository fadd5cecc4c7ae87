"""Weight-only quantized linear layers: int8 per output channel, int4 per group of input columns.

Weights stay quantized in memory, in the layout of the backend each layer runs on (``quant_backends.py``:
quickdraft's ``qmatmul`` kernel, torch's packed CPU kernels, or dequantize-then-matmul elsewhere); the number
formats themselves are in ``quant_formats.py``. Every backend computes each output row independently of the
other rows of the call. A GGUF's own block formats are ``block_linear.BlockLinear``, on the same base.
"""
from __future__ import annotations

import torch
from torch import nn
import torch.nn.functional as F

from quickdraft.models import qmatmul, triton_linear
from quickdraft.models.quant_backends import (
    aligned,
    check_kernel_tensors,
    int4pack_for_cpu,
    kernel_dtype,
    padded_rows,
    resolve_backend,
)
from quickdraft.models.quant_formats import (
    INT4_GROUP_SIZES,
    SCALE_DTYPE,
    dequantize_int4,
    pack_nibbles,
    quantize_int4,
    quantize_int8,
    unpack_nibbles,
)


class _QuantLinearBase(nn.Module, triton_linear.TiledLayer):
    """What the quantized layers (Int8Linear, Int4Linear, BlockLinear) share: the bias (added after the matmul),
    the qmatmul call, the output."""

    in_features: int
    out_features: int
    backend: str
    # the kernel's format: a code of qformats.h and a name (``int4``, ``int8``, or the GGML type of a BlockLinear)
    format_code: int
    kernel_name: str
    # float32 output whatever the input's dtype: an lm_head's logits rounded to bfloat16 lose ties (at a logit of
    # 64-128 a bfloat16 step is 0.5), so greedy choices would hinge on the rounding (set by the loader)
    float_output: bool = False

    def tile_key(self) -> tuple | None:
        if self.backend != "triton":
            return None
        return self.kernel_name, self.out_features, self.in_features, self.bias is not None, self.float_output

    def _init_bias(self, bias: torch.Tensor | None) -> None:
        if bias is not None:
            self.register_buffer("bias", bias.detach())
        else:
            self.bias = None
        self._call: qmatmul.PartsCall | None = None

    def kernel_part(self) -> qmatmul.Part:
        """This layer as one part of a qmatmul call (``qmatmul`` backend only)."""
        bias = None if self.bias is None else self.bias.float().contiguous()
        return qmatmul.Part(self.kweight, self.kscales, self.format_code, self.out_features, bias)

    def _qmatmul(self, x2: torch.Tensor) -> torch.Tensor:
        call = self._call
        if call is None or call.parts[0].weight.data_ptr() != self.kweight.data_ptr():  # built once per weight
            call = self._call = qmatmul.PartsCall([self.kernel_part()], self.in_features)
        return call(x2, torch.float32 if self.float_output else None)

    def _out_dtype(self, x: torch.Tensor) -> torch.dtype:
        return torch.float32 if self.float_output else x.dtype

    def forward_gated(self, x: torch.Tensor, activation: str) -> torch.Tensor:
        """``act(gate) * up`` of this layer's two halves of output, in Triton's kernel (the ``triton`` backend only;
        see ``triton_linear.GatedProjection``)."""
        if self.backend != "triton":
            raise ValueError(f"a gated call runs on the triton backend, this layer's is {self.backend}")
        y = self._triton(x.reshape(-1, self.in_features), self._out_dtype(x), activation)
        return y.reshape(*x.shape[:-1], self.out_features // 2)

    def fuses_norm(self, x: torch.Tensor, gate: str | None = None) -> bool:
        """Whether calls run Triton's kernel and this shape takes a residual add and a norm in it (``forward_normed``,
        ``triton_linear.takes_norm``: never a question of the rows)."""
        width = self.out_features // 2 if gate else self.out_features
        return self.backend == "triton" and triton_linear.takes_norm(width, self.in_features)

    def forward_normed(self, x: torch.Tensor, norm: triton_linear.AddNorm, gate: str | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(s, self(rms_norm(s)))`` for ``s = x + norm.residual`` in Triton's kernel (the ``triton`` backend)."""
        if self.backend != "triton":
            raise ValueError(f"a call with its norm runs on the triton backend, this layer's is {self.backend}")
        x2 = x.reshape(-1, self.in_features)
        norm = triton_linear.AddNorm(norm.residual.reshape(x2.shape), norm.weight, norm.eps)
        total, y = self._triton(x2, self._out_dtype(x), gate, norm)
        return total.reshape(x.shape), y.reshape(*x.shape[:-1], y.shape[-1])

    def _finish(self, y: torch.Tensor, x: torch.Tensor, lead: tuple[int, ...]) -> torch.Tensor:
        dtype = self._out_dtype(x)
        y = y.to(dtype)
        if self.bias is not None:
            y = y + self.bias.to(dtype)
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"backend={self.backend}")


class Int8Linear(_QuantLinearBase):
    """``y = x @ (q * scale[:, None]).T + bias`` with int8 ``q`` per output channel.

    Buffers: ``qweight`` int8 ``[N, K]`` and ``scales`` bfloat16 ``[N]`` (``torch``/``triton``/``reference`` backends), or the
    qmatmul layout ``kweight``/``kscales`` (``q + 128`` as 8-bit values, the row's scale in every group, zero 0)."""

    format_code, kernel_name = 8, "int8"

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None, *,
                 kernel: bool | str | None = None) -> None:
        """``kernel``: see ``resolve_backend`` (default: the device's fastest kernel)."""
        super().__init__()
        if qweight.dtype != torch.int8 or qweight.dim() != 2:
            raise ValueError(f"Int8Linear needs an int8 [out, in] weight, got {qweight.dtype} {tuple(qweight.shape)}")
        self.out_features, self.in_features = qweight.shape
        if scales.shape != (self.out_features,):
            raise ValueError(f"Int8Linear scales must have shape ({self.out_features},), got {tuple(scales.shape)}")
        self.backend = resolve_backend(kernel, qweight.device)
        if self.backend == "qmatmul" and self.in_features % qmatmul.GROUP:
            self.backend = "torch"  # the kernel works on groups of 32 input columns
        if self.backend == "qmatmul":
            groups = self.in_features // qmatmul.GROUP
            s = scales.to(SCALE_DTYPE)[:, None].expand(-1, groups)
            kw, ks = qmatmul.pack((qweight.to(torch.int16) + 128).to(torch.uint8), s, torch.zeros_like(s), 8)
            self.register_buffer("kweight", kw)
            self.register_buffer("kscales", ks)
        else:
            self.register_buffer("qweight", aligned(qweight))
            self.register_buffer("scales", aligned(scales.to(SCALE_DTYPE)))
        self._init_bias(bias)
        self._scales_f16: torch.Tensor | None = None

    @classmethod
    def from_kernel_tensors(cls, kweight: torch.Tensor, kscales: torch.Tensor, in_features: int,
                            bias: torch.Tensor | None = None) -> Int8Linear:
        """A qmatmul layer from its own tensors (e.g. memory-mapped from the cache): no copy is made."""
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self.out_features, self.in_features, self.backend = kweight.shape[0], int(in_features), "qmatmul"
        check_kernel_tensors(kweight, kscales, 8, in_features)
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

    def _triton(self, x2: torch.Tensor, out_dtype: torch.dtype, gate: str | None = None,
                norm: triton_linear.AddNorm | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """On Triton's kernel, the bias added and the output rounded (and gated, and its input normed) in it."""
        return triton_linear.int8_matmul(x2, self.qweight, self.scales, self.bias, out_dtype, gate=gate, norm=norm,
                                         tiles=self.tiles)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if self.backend == "qmatmul":
            return self._qmatmul(x2).reshape(*lead, self.out_features)
        if self.backend == "torch":
            kd = kernel_dtype(x2)
            scales = self.scales
            if kd == torch.float16:
                if self._scales_f16 is None:
                    self._scales_f16 = self.scales.to(torch.float16)
                scales = self._scales_f16
            y = torch.ops.aten._weight_int8pack_mm(aligned(x2.to(kd)), self.qweight, scales)
        elif self.backend == "triton":  # the bias added and the output rounded in the kernel: no launches after
            return self._triton(x2, self._out_dtype(x)).reshape(*lead, self.out_features)
        else:
            w = self.qweight.to(x2.dtype) * self.scales.to(x2.dtype)[:, None]
            y = F.linear(x2, w)
        return self._finish(y, x, lead)


class Int4Linear(_QuantLinearBase):
    """``y = x @ W.T + bias`` with ``W[n, k] = (q[n, k] - 8) * scale[n, k // G] + zero[n, k // G]``, ``q`` in 0..15.

    Storage by backend: ``qmatmul``: ``kweight``/``kscales`` (the kernel's layout, scales repeated per 32
    columns for G > 32); ``torch``: ``packed`` (the int4pack kernel's ISA-dependent layout) with
    ``scales_and_zeros`` ``[K // G, N, 2]`` bfloat16; ``triton`` and ``reference``: nibbles ``qweight`` ``[N, K // 2]``
    (even column in the low nibble) with ``scales_and_zeros``. Build the layer on the device it will run on."""

    format_code, kernel_name = 4, "int4"

    def tile_key(self) -> tuple | None:
        key = super().tile_key()
        return None if key is None else (*key, self.group_size)

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int = 32,
                 bias: torch.Tensor | None = None, *, kernel: bool | str | None = None) -> None:
        """``q``: ``[N, K]`` values 0..15 (any integer dtype); ``scales``/``zeros``: ``[N, K // G]`` (rounded to
        bfloat16); ``kernel``: see ``resolve_backend`` (default: the device's fastest kernel)."""
        super().__init__()
        n, k = q.shape
        self._init_shape(n, k, group_size)
        if scales.shape != (n, k // group_size) or zeros.shape != scales.shape:
            raise ValueError(f"Int4Linear scales/zeros must have shape ({n}, {k // group_size}), "
                             f"got {tuple(scales.shape)} / {tuple(zeros.shape)}")
        device = q.device
        self.backend = resolve_backend(kernel, device)
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
            self.padded_out = padded_rows(n)
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
        self.padded_out = padded_rows(self.out_features)
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
        check_kernel_tensors(kweight, kscales, 4, in_features)
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
        if self.backend in ("reference", "triton"):
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

    def _triton(self, x2: torch.Tensor, out_dtype: torch.dtype, gate: str | None = None,
                norm: triton_linear.AddNorm | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """On Triton's kernel, the bias added and the output rounded (and gated, and its input normed) in it."""
        return triton_linear.int4_matmul(x2, self.qweight, self.scales_and_zeros, self.group_size, self.bias,
                                         out_dtype, gate=gate, norm=norm, tiles=self.tiles)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if self.backend == "qmatmul":
            return self._qmatmul(x2).reshape(*lead, self.out_features)
        if self.backend == "torch":
            kd = kernel_dtype(x2)
            sz = self.scales_and_zeros
            if kd == torch.float16:
                if self._sz_f16 is None:
                    self._sz_f16 = sz.to(torch.float16)
                sz = self._sz_f16
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(aligned(x2.to(kd)), self.packed, self.group_size, sz)
            if self.padded_out != self.out_features:
                y = y[:, :self.out_features]
        elif self.backend == "triton":  # (as Int8Linear's)
            return self._triton(x2, self._out_dtype(x)).reshape(*lead, self.out_features)
        else:
            n, k, g = self.out_features, self.in_features, self.group_size
            q = unpack_nibbles(self.qweight).to(x2.dtype).reshape(n, k // g, g)
            sz = self.scales_and_zeros[:, :n].to(x2.dtype)
            w = ((q - 8) * sz[..., 0].t()[..., None] + sz[..., 1].t()[..., None]).reshape(n, k)
            y = F.linear(x2, w)
        return self._finish(y, x, lead)
