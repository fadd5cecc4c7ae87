"""Weight-only int8 and int4 matmuls on a GPU: one Triton kernel that reads the quantized weights in place.

A decode step at batch 1 reads every weight once, so its time is the weights' bytes over the memory bandwidth: int8
halves a bfloat16 model's bytes, int4 (with a bfloat16 scale and zero per 32 weights) takes a little over a quarter.
That only pays if nothing reads or writes a float copy of the weight, which the ``reference`` backend does (it
dequantizes the whole weight every call). This kernel widens a tile of weights in registers and multiplies it there.

The layouts are the ``reference`` backend's (``quant.py``): int8 ``qweight [N, K]`` with a bfloat16 scale per row;
int4 nibbles ``qweight [N, K // 2]`` (even column in the low nibble) with ``scales_and_zeros [K // G, N, 2]``
bfloat16, ``w = (q - 8) * scale + zero``. A GGUF's Q4_0 / Q4_1 / Q4_K blocks map exactly onto that int4 form
(``loading/gguf_int4.py``).

On a GPU the products run in bfloat16 with float32 sums (tensor cores); under Triton's interpreter (CPU tests, with
``TRITON_INTERPRET=1`` and ``KERNEL_ON_CPU``) they run in float32, whose ``tl.dot`` the interpreter gets right.
Each output row is computed from its own input row only, so a row's result does not depend on the batch.
"""
from __future__ import annotations

import functools
import importlib.util
import os

import torch

triton = tl = None  # optional (pip install triton): imported by _kernel, on first use

# Run the kernel on CPU tensors too, under Triton's interpreter (tests set it; see kv/paged_attention.py).
KERNEL_ON_CPU = False


@functools.cache
def triton_available() -> bool:
    """Triton is installed (asked once: the GPU's layers ask on every call)."""
    return importlib.util.find_spec("triton") is not None


def runs_on(device: torch.device) -> bool:
    """Whether the kernel can run on ``device``: a CUDA device with Triton, or the CPU under the interpreter."""
    if not triton_available():
        return False
    if device.type == "cuda":
        return True
    return device.type == "cpu" and KERNEL_ON_CPU and os.environ.get("TRITON_INTERPRET") == "1"


# One tile for every row count (16 rows: tl.dot's smallest; a decode step's weight rows spread over many programs):
# a row's products and sums then run through the same instructions in the same order whatever its batch, which
# greedy speculation's equality with plain decoding relies on. Prompt chunks pay for it in re-read weight tiles.
BLOCK_M, BLOCK_N, BLOCK_K = 16, 32, 64


def int8_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``x [M, K] @ (qweight * scales[:, None]).T`` as float32 ``[M, N]``."""
    return _matmul(x, qweight, scales, bits=8, group=1)


def int4_matmul(x: torch.Tensor, qweight: torch.Tensor, scales_and_zeros: torch.Tensor, group: int) -> torch.Tensor:
    """``x [M, K] @ W.T`` with ``W[n, k] = (q - 8) * s + z`` from nibbles ``qweight [N, K // 2]`` and
    ``scales_and_zeros [K // group, N, 2]``; float32 ``[M, N]``."""
    return _matmul(x, qweight, scales_and_zeros, bits=4, group=group)


def _matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    x = x.contiguous()
    rows, k = x.shape
    n = qweight.shape[0]
    out = torch.empty(rows, n, dtype=torch.float32, device=x.device)
    if rows == 0:
        return out
    grid = (-(-n // BLOCK_N), -(-rows // BLOCK_M))
    _kernel()[grid](x, qweight, scales.contiguous(), out, rows, n, k, x.stride(0), out.stride(0),
                    BITS=bits, GROUP=group, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
                    DOT_BF16=x.is_cuda)
    return out


@functools.cache
def _kernel():
    """Triton imported and the kernel defined on first use (see kv/paged_attention.py's ``_kernel``)."""
    global triton, tl
    import triton
    import triton.language as tl

    @triton.jit
    def weight_only_matmul(x_ptr, w_ptr, s_ptr, out_ptr, M, N, K, stride_xm, stride_om,
                           BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_K: tl.constexpr, DOT_BF16: tl.constexpr):
        # int64 offsets: a weight of more than 2^31 values (a 256k vocabulary's head) must not wrap
        rm = (tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        rn = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        k0 = 0
        while k0 < K:  # (a while loop: the interpreter cannot take range() over a runtime bound)
            rk = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < K),
                        other=0.0)
            inside = (rk[:, None] < K) & (rn[None, :] < N)  # the weight tile [BLOCK_K, BLOCK_N], transposed
            if BITS == 8:
                w = tl.load(w_ptr + rn[None, :] * K + rk[:, None], mask=inside, other=0).to(tl.float32)
            else:
                packed = tl.load(w_ptr + rn[None, :] * (K // 2) + rk[:, None] // 2, mask=inside, other=0)
                q = (packed.to(tl.int32) >> ((rk[:, None] % 2) * 4)) & 0xF
                at = ((rk[:, None] // GROUP) * N + rn[None, :]) * 2
                scale = tl.load(s_ptr + at, mask=inside, other=0.0).to(tl.float32)
                zero = tl.load(s_ptr + at + 1, mask=inside, other=0.0).to(tl.float32)
                w = (q.to(tl.float32) - 8.0) * scale + zero
            if DOT_BF16:
                acc += tl.dot(x.to(tl.bfloat16), w.to(tl.bfloat16))
            else:
                acc += tl.dot(x.to(tl.float32), w, input_precision="ieee")
            k0 += BLOCK_K
        if BITS == 8:
            acc = acc * tl.load(s_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], acc, mask=(rm[:, None] < M) & (rn[None, :] < N))

    return weight_only_matmul
