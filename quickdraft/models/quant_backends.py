"""Which kernel a quantized linear layer runs on, and what torch's kernels need of their operands.

Each layer has one backend, chosen when it is built:

* ``"qmatmul"`` (CPU, default where it builds): quickdraft's own kernel (``qmatmul.py``/``qmatmul.c``; AVX2, VNNI
  where present): activations quantized to int8 per group of 32, int8 dot products; faster decode steps than
  torch's kernels and a verify pass of 5 rows that costs far less than 5 steps.
* ``"torch"`` (CPU without the kernel): torch's packed kernels ``aten._weight_int8pack_mm`` and
  ``aten._weight_int4pack_mm_for_cpu``.
* ``"triton"`` (CUDA, default where Triton is installed): ``triton_linear.py``, a kernel that widens tiles of the
  quantized weight in registers (the CPU runs it under Triton's interpreter in tests).
* ``"reference"`` (other devices): dequantize, then matmul; only meant to be correct.

Every backend computes each output row independently of the other rows of the call.

Facts about torch's kernels (checked on torch 2.13 CPU, see tests/test_quant.py):

* Both kernels need the scales in the activation dtype; float32, bfloat16 and float16
  activations are accepted. With float32 activations both kernels are far slower
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
  memory-mapped from safetensors, a sliced activation); such operands are copied (``aligned``).
  The int4 kernel takes unaligned operands.
* Both kernels compute every output row independently of the other rows: a row's result is bit-identical
  whether the batch has 1 or 200 rows (dense bfloat16 ``F.linear`` differs between 1 row and several).
* Against dense bfloat16, int4 is the faster for decode and short verify steps, dense bfloat16 for long
  prefills (docs/MEASUREMENTS.md).
"""
from __future__ import annotations

import torch

from quickdraft.models import qmatmul, triton_linear

BACKENDS = ("qmatmul", "torch", "triton", "reference")
_N_MULTIPLE = 16  # _convert_weight_to_int4pack_for_cpu: "expect N to be dividable by 16"
_ALIGN = 64


def cpu_capability() -> str:
    """The ISA torch's CPU kernels dispatch to (e.g. 'AVX512', 'AVX2', 'DEFAULT'): packed int4 layouts depend on it."""
    try:
        return str(torch.backends.cpu.get_cpu_capability())
    except Exception:  # pragma: no cover - very old torch
        return "unknown"


def aligned(t: torch.Tensor) -> torch.Tensor:
    """``t`` contiguous and 64-byte aligned. ``_weight_int8pack_mm`` crashes (SIGSEGV, torch 2.13, AVX512) when its
    activation or weight is not 64-byte aligned, e.g. a weight memory-mapped from a safetensors file or a
    sliced activation; torch's CPU allocator aligns new tensors to 64 bytes, so a copy fixes it."""
    t = t.contiguous()
    return t if t.data_ptr() % _ALIGN == 0 else t.clone()


def kernel_dtype(x: torch.Tensor) -> torch.dtype:
    """The activation dtype torch's kernels run in for ``x``: float16 stays, anything else becomes bfloat16."""
    return torch.float16 if x.dtype == torch.float16 else torch.bfloat16


def padded_rows(n: int) -> int:
    """``n`` rounded up to the row multiple ``_convert_weight_to_int4pack_for_cpu`` needs."""
    return -(-n // _N_MULTIPLE) * _N_MULTIPLE


def int4pack_for_cpu(q: torch.Tensor) -> torch.Tensor:
    """Pack ``[N, K]`` 0..15 values into the CPU kernel's (ISA-dependent) ``[N, K // 2]`` uint8 layout."""
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)


def default_backend(device: torch.device | str) -> str:
    """``qmatmul`` on CPU where the kernel builds, else torch's kernels on CPU; Triton's kernel on CUDA; else the
    reference path."""
    device = torch.device(device)
    if device.type != "cpu":
        return "triton" if device.type == "cuda" and triton_linear.runs_on(device) else "reference"
    return "qmatmul" if qmatmul.available() else "torch"


def resolve_backend(kernel: bool | str | None, device: torch.device) -> str:
    """``kernel``: None or True = the device's default kernel, False = ``reference``, or a name of ``BACKENDS``."""
    if kernel is None or kernel is True:
        return default_backend(device)
    backend = "reference" if kernel is False else kernel
    if backend not in BACKENDS:
        raise ValueError(f"quantized layer backend must be one of {BACKENDS}, got {kernel!r}")
    if backend == "triton":
        if not triton_linear.runs_on(device):
            raise ValueError(f"the triton backend needs Triton and a CUDA device (or its interpreter), got {device}")
        return backend
    if backend != "reference" and device.type != "cpu":
        raise ValueError(f"the {backend} backend needs CPU tensors")
    if backend == "qmatmul" and not qmatmul.available():
        raise ValueError(f"the qmatmul kernel is unavailable here: {qmatmul.unavailable_reason()}")
    return backend


def check_kernel_tensors(kweight: torch.Tensor, kscales: torch.Tensor, bits: int, in_features: int) -> None:
    """Reject qmatmul tensors (e.g. read from the cache) whose dtype, shape or device the kernel cannot take."""
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
