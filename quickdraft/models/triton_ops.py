"""A decoder layer's small operations on a GPU, one Triton kernel each: RMSNorm (alone, or with the residual add
before it), the rotation of q and k, the gated activation, the new keys' and values' write to the cache (alone, or
with the rotation: ``rope_kv_write``).

A decode step of a model at batch 1 on a GPU is bound by how many kernels it runs as much as by the bytes it reads:
a kernel inside a CUDA graph costs a few microseconds however little it does. In torch, a bfloat16 RMSNorm is
about five kernels (widen x, widen the weight, the norm, the product, the rounding back), the rotation of q and k
about ten, SiLU-times-up three, the cache write two. One kernel each takes a Qwen2 layer from about thirty kernels
to about ten.

Each computes in float32 and rounds once to the input's dtype, as the CPU's C kernels do (``native.py``). They run
on CUDA tensors, and on CPU tensors under Triton's interpreter where a test asks (``KERNEL_ON_CPU``), which is how
CI checks them against torch's operations without a GPU.
"""
from __future__ import annotations

import functools
import os

import torch

from quickdraft.models import triton_linear
from quickdraft.models.triton_linear import ACTIVATIONS, triton_available

triton = tl = None  # optional (pip install triton): imported by _kernels, on first use

# Run the kernels on CPU tensors too, under Triton's interpreter (tests set it; see kv/paged_attention.py).
KERNEL_ON_CPU = False



def _runs(x: torch.Tensor) -> bool:
    """A float tensor where the kernels run (the device checked first: the CPU asks on every layer)."""
    interpreted = KERNEL_ON_CPU and x.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"
    return ((x.is_cuda or interpreted) and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and triton_available())


def _block(n: int) -> int:
    return max(16, 1 << (n - 1).bit_length())


def runs_rms_norm(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (_runs(x) and weight.device == x.device and weight.is_contiguous() and weight.numel() == x.shape[-1]
            and x.numel() > 0)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x**2) + eps) * weight`` over the last dimension, in float32, rounded once to x's dtype."""
    x = x.contiguous()
    d = x.shape[-1]
    y = torch.empty_like(x)
    _kernels()[0][(x.numel() // d,)](x, weight, y, d, eps, BLOCK=_block(d))
    return y


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(s, rms_norm(s))`` for ``s = x + residual`` (rounded to x's dtype, as torch's add rounds it): a layer's
    residual add and the norm after it in one kernel."""
    x, residual = x.contiguous(), residual.contiguous()
    d = x.shape[-1]
    total, y = torch.empty_like(x), torch.empty_like(x)
    _kernels()[2][(x.numel() // d,)](x, residual, weight, total, y, d, eps, BLOCK=_block(d))
    return total, y


def runs_kv_write(k: torch.Tensor, cache: torch.Tensor) -> bool:
    """k: ``[T, kv_heads, D]`` with each row's heads contiguous, the cache ``[slots, kv_heads, D]`` of its dtype."""
    return (_runs(k) and k.dtype == cache.dtype and k.dim() == 3 and k.shape[0] > 0 and k.stride(2) == 1
            and k.stride(1) == k.shape[2] and cache.is_contiguous() and cache.shape[1:] == k.shape[1:])


def kv_write(k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor
             ) -> None:
    """``cache_k[slots] = k`` and ``cache_v[slots] = v`` in one kernel (``runs_kv_write`` holds for both)."""
    width = k.shape[1] * k.shape[2]
    _kernels()[3][(k.shape[0],)](k, v, slots, cache_k, cache_v, k.stride(0), v.stride(0), width,
                                 BLOCK=_block(width))


def runs_rope(x: torch.Tensor) -> bool:
    """x: ``[T, heads, D]`` with contiguous heads (a view of a fused q/k/v output is fine)."""
    return (_runs(x) and x.dim() == 3 and x.shape[0] > 0 and x.stride(2) == 1 and x.stride(1) == x.shape[2]
            and x.shape[2] % 2 == 0)


def rope_(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary embedding of ``x [T, heads, D]`` in place over the first ``2 * R`` dims of each head;
    ``cos``/``sin``: float32 ``[max_pos, R]`` (R = D / 2 but for partial rotary), ``positions``: int64 ``[T]`` (on
    x's device: nothing is read back, so a CUDA graph can hold it)."""
    t, heads, d = x.shape
    half = cos.shape[1]
    if 2 * half > d:
        raise ValueError(f"RoPE tables rotate {2 * half} dims of heads of {d}")
    if half:
        _kernels()[1][(t,)](x, positions, cos, sin, x.stride(0), heads, d, half, BLOCK_H=_block(heads),
                            BLOCK_D=_block(half))
    return x


def runs_rope_kv_write(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor) -> bool:
    """q ``[T, heads, D]``, k and v ``[T, kv_heads, D]`` with contiguous heads (views of a fused projection's
    output), a float cache ``[slots, kv_heads, D]`` of their dtype."""
    return (runs_rope(q) and runs_rope(k) and runs_kv_write(k, cache) and runs_kv_write(v, cache)
            and q.shape[0] == k.shape[0] == v.shape[0] and q.shape[2] == k.shape[2] and q.dtype == k.dtype)


def rope_kv_write(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor, slots: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor) -> None:
    """``rope_`` of q (in place) and of k, written with v to the cache at ``slots`` (k itself is left as it was), in
    one kernel: the bits of ``rope_`` then ``kv_write`` (``runs_rope_kv_write`` holds; tables that rotate whole
    heads: ``cos.shape[1] * 2 == D``)."""
    t, heads, d = q.shape
    kv_heads = k.shape[1]
    _rope_kv_write_kernel()[(t,)](q, k, v, positions, cos, sin, slots, cache_k, cache_v, q.stride(0), k.stride(0),
                                  v.stride(0), heads, kv_heads, d // 2, BLOCK_QH=_block(heads),
                                  BLOCK_KH=_block(kv_heads), BLOCK_D=_block(d // 2), BLOCK_W=_block(kv_heads * d))


def runs_gated(gate_up: torch.Tensor, act: str) -> bool:
    return _runs(gate_up) and act in ACTIVATIONS and gate_up.shape[-1] % 2 == 0 and gate_up.numel() > 0


def gated(gate_up: torch.Tensor, act: str) -> torch.Tensor:
    """``act(gate) * up`` of ``gate_up [..., 2N] = [gate | up]``, in float32 and rounded once; ``act``: ``silu`` or
    ``gelu_tanh`` (torch's ``gelu(approximate="tanh")``). The linear kernel's last step (``triton_linear.gate_rows``):
    the bits of a projection that applies its activation itself (``triton_linear.GatedProjection``)."""
    n = gate_up.shape[-1] // 2
    return triton_linear.gate_rows(gate_up.reshape(-1, 2 * n), act).reshape(*gate_up.shape[:-1], n)


@functools.cache
def _kernels():
    """Triton imported and the kernels defined on first use (see kv/paged_attention.py's ``_kernel``)."""
    global triton, tl
    import triton
    import triton.language as tl

    @triton.jit
    def rms_norm_kernel(x_ptr, w_ptr, y_ptr, D, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        inside = cols < D
        x = tl.load(x_ptr + row * D + cols, mask=inside, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=inside, other=0.0).to(tl.float32)
        inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
        tl.store(y_ptr + row * D + cols, (x * inv * w).to(y_ptr.dtype.element_ty), mask=inside)

    @triton.jit
    def rope_kernel(x_ptr, pos_ptr, cos_ptr, sin_ptr, stride_t, H, D, HALF, BLOCK_H: tl.constexpr,
                    BLOCK_D: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        heads = tl.arange(0, BLOCK_H)[:, None]
        cols = tl.arange(0, BLOCK_D)[None, :]
        inside = (heads < H) & (cols < HALF)
        position = tl.load(pos_ptr + t).to(tl.int64)
        cos = tl.load(cos_ptr + position * HALF + cols, mask=cols < HALF, other=0.0)
        sin = tl.load(sin_ptr + position * HALF + cols, mask=cols < HALF, other=0.0)
        first = x_ptr + t * stride_t + heads * D + cols
        x1 = tl.load(first, mask=inside, other=0.0).to(tl.float32)
        x2 = tl.load(first + HALF, mask=inside, other=0.0).to(tl.float32)
        tl.store(first, (x1 * cos - x2 * sin).to(x_ptr.dtype.element_ty), mask=inside)
        tl.store(first + HALF, (x2 * cos + x1 * sin).to(x_ptr.dtype.element_ty), mask=inside)

    @triton.jit
    def add_rms_norm_kernel(x_ptr, r_ptr, w_ptr, s_ptr, y_ptr, D, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        inside = cols < D
        x = tl.load(x_ptr + row * D + cols, mask=inside, other=0.0).to(tl.float32)
        r = tl.load(r_ptr + row * D + cols, mask=inside, other=0.0).to(tl.float32)
        total = (x + r).to(s_ptr.dtype.element_ty)
        tl.store(s_ptr + row * D + cols, total, mask=inside)
        t = total.to(tl.float32)
        w = tl.load(w_ptr + cols, mask=inside, other=0.0).to(tl.float32)
        inv = 1.0 / tl.sqrt(tl.sum(t * t, axis=0) / D + eps)
        tl.store(y_ptr + row * D + cols, (t * inv * w).to(y_ptr.dtype.element_ty), mask=inside)

    @triton.jit
    def kv_write_kernel(k_ptr, v_ptr, slot_ptr, ck_ptr, cv_ptr, stride_k, stride_v, W, BLOCK: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        slot = tl.load(slot_ptr + t).to(tl.int64)  # int32 slots too: slot * W must not wrap
        cols = tl.arange(0, BLOCK)
        inside = cols < W
        tl.store(ck_ptr + slot * W + cols, tl.load(k_ptr + t * stride_k + cols, mask=inside), mask=inside)
        tl.store(cv_ptr + slot * W + cols, tl.load(v_ptr + t * stride_v + cols, mask=inside), mask=inside)

    return rms_norm_kernel, rope_kernel, add_rms_norm_kernel, kv_write_kernel


@functools.cache
def _rope_kv_write_kernel():
    """``rope_kv_write``'s kernel (defined on first use, as ``_kernels``'s)."""
    _kernels()  # Triton imported, ``tl`` among the globals

    @triton.jit
    def rope_kv_write_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, cos_ptr, sin_ptr, slot_ptr, ck_ptr, cv_ptr, stride_q,
                             stride_k, stride_v, QH, KH, HALF, BLOCK_QH: tl.constexpr, BLOCK_KH: tl.constexpr,
                             BLOCK_D: tl.constexpr, BLOCK_W: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        position = tl.load(pos_ptr + t).to(tl.int64)
        cols = tl.arange(0, BLOCK_D)[None, :]
        cos = tl.load(cos_ptr + position * HALF + cols, mask=cols < HALF, other=0.0)
        sin = tl.load(sin_ptr + position * HALF + cols, mask=cols < HALF, other=0.0)
        q_heads = tl.arange(0, BLOCK_QH)[:, None]
        inside = (q_heads < QH) & (cols < HALF)
        first = q_ptr + t * stride_q + q_heads * (2 * HALF) + cols
        x1 = tl.load(first, mask=inside, other=0.0).to(tl.float32)
        x2 = tl.load(first + HALF, mask=inside, other=0.0).to(tl.float32)
        tl.store(first, (x1 * cos - x2 * sin).to(q_ptr.dtype.element_ty), mask=inside)
        tl.store(first + HALF, (x2 * cos + x1 * sin).to(q_ptr.dtype.element_ty), mask=inside)
        slot = tl.load(slot_ptr + t).to(tl.int64)  # int32 slots too: slot * width must not wrap
        k_heads = tl.arange(0, BLOCK_KH)[:, None]
        inside = (k_heads < KH) & (cols < HALF)
        first = k_ptr + t * stride_k + k_heads * (2 * HALF) + cols
        x1 = tl.load(first, mask=inside, other=0.0).to(tl.float32)
        x2 = tl.load(first + HALF, mask=inside, other=0.0).to(tl.float32)
        to = ck_ptr + slot * (KH * 2 * HALF) + k_heads * (2 * HALF) + cols
        tl.store(to, (x1 * cos - x2 * sin).to(ck_ptr.dtype.element_ty), mask=inside)
        tl.store(to + HALF, (x2 * cos + x1 * sin).to(ck_ptr.dtype.element_ty), mask=inside)
        width = tl.arange(0, BLOCK_W)
        inside = width < KH * 2 * HALF
        tl.store(cv_ptr + slot * (KH * 2 * HALF) + width, tl.load(v_ptr + t * stride_v + width, mask=inside),
                 mask=inside)

    return rope_kv_write_kernel
