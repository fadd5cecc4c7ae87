"""Weight-only int8 and int4 matmuls on a GPU: a Triton kernel that reads the quantized weights in place (and the
same kernel on bfloat16 weights).

A decode step at batch 1 reads every weight once, so its time is the weights' bytes over the memory bandwidth: int8
halves a bfloat16 model's bytes, int4 (with a bfloat16 scale and zero per 32 weights) takes a little over a quarter.
That only pays if nothing reads or writes a float copy of the weight, which the ``reference`` backend does (it
dequantizes the whole weight every call). This kernel widens a tile of weights in registers and multiplies it there;
an int4 tile's bytes and its groups' scales are each read once.

The layouts are the ``reference`` backend's (``quant.py``): int8 ``qweight [N, K]`` with a bfloat16 scale per row;
int4 nibbles ``qweight [N, K // 2]`` (even column in the low nibble) with ``scales_and_zeros [K // G, N, 2]``
bfloat16, ``w = (q - 8) * scale + zero``. A GGUF's Q4_0 / Q4_1 / Q4_K blocks map exactly onto that int4 form
(``loading/gguf_int4.py``).

On a GPU the products run in bfloat16 with float32 sums (tensor cores); under Triton's interpreter (CPU tests, with
``TRITON_INTERPRET=1`` and ``KERNEL_ON_CPU``) they run in float32, whose ``tl.dot`` the interpreter gets right.
Each output row is computed from its own input row only, so a row's result does not depend on the batch.

Bfloat16 weights run through the same tiles (``float_matmul``): cuBLAS picks its kernel by the row count, so a row's
bits under it may differ between a decode step and a verify pass, and at a decode step's single row it reads some
mid-sized weights (a 1.5B's q/k/v and o) at well under the copy bandwidth.
"""
from __future__ import annotations

import functools
import importlib.util
import os

import torch
from torch import nn

from quickdraft.models.packed import WrappedLinear

triton = tl = None  # optional (pip install triton): imported by _kernels, on first use
_sums = _int4_tile = _dot = _finished = _gated = _chunk_total = None  # the kernels' helpers (_helpers)

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


# One tile for every row count (16 rows: tl.dot's smallest): a row's products and sums then run through the same
# instructions in the same order whatever its batch, which greedy speculation's equality with plain decoding relies
# on. Prompt chunks pay for it in re-read weight tiles.
BLOCK_M, BLOCK_N, BLOCK_K = 16, 64, 128
# K is summed in chunks of CHUNK_K columns, each chunk's sum from zero, the chunks' sums then added in order. Where
# the output's tiles are few (a decode step of a 7B: 56-72 tiles for three of its four projections, each looping
# over all of K, so its loads wait on one another), every chunk runs in a program of its own and a second kernel adds
# the sums; elsewhere each program adds them as it goes. Both give the same bits, so the choice may follow the shape.
# More than one tl.dot a chunk: Triton folds ``total + dot(a, b, 0)`` into ``dot(a, b, total)``, which would sum a
# one-dot chunk into ``total`` inside the dot in one program, and apart from it in the split.
CHUNK_TILES = 4
CHUNK_K = CHUNK_TILES * BLOCK_K
SPLIT_BELOW = 1024  # split K over programs while the output has fewer tiles than this (a few per multiprocessor)
# ... and K has at least this many chunks: a tile of two or three chunks (a 135M's or a 1.5B's projections but down)
# is read in about the time the split's second launch costs inside a graph (bench/gpu_linear.py times both)
SPLIT_FROM_CHUNKS = 4

# The gated activations the kernels apply to a gate/up projection's output, ``act(gate) * up`` (``GatedProjection``,
# and ``triton_ops.gated`` after a projection that does not); gpt-oss's clamped SwiGLU stays in torch.
ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}


def int8_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None,
                out_dtype: torch.dtype = torch.float32, split: bool | None = None, gate: str | None = None
                ) -> torch.Tensor:
    """``x [M, K] @ (qweight * scales[:, None]).T + bias`` as ``[M, N]`` of ``out_dtype``, summed and biased in
    float32 and rounded once; ``split`` forces K's chunks into programs of their own (True) or not (False) where None
    lets the shape choose: the result is the same either way. ``gate`` (one of ``ACTIVATIONS``): the output's two
    halves are a gate and an up projection, and the result ``[M, N // 2]`` is ``gate(first) * second``: the bits of
    ``triton_ops.gated`` after the call without it."""
    return _matmul(x, qweight, scales, bias, out_dtype, bits=8, group=1, split=split, gate=gate)


def int4_matmul(x: torch.Tensor, qweight: torch.Tensor, scales_and_zeros: torch.Tensor, group: int,
                bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.float32, split: bool | None = None,
                gate: str | None = None) -> torch.Tensor:
    """``x [M, K] @ W.T + bias`` with ``W[n, k] = (q - 8) * s + z`` from nibbles ``qweight [N, K // 2]`` and
    ``scales_and_zeros [K // group, N, 2]``; the rest as in ``int8_matmul``."""
    if BLOCK_K % group:
        raise ValueError(f"the triton int4 kernel takes groups dividing {BLOCK_K} columns, got {group}")
    return _matmul(x, qweight, scales_and_zeros, bias, out_dtype, bits=4, group=group, split=split, gate=gate)


def float_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 out_dtype: torch.dtype = torch.float32, split: bool | None = None, gate: str | None = None
                 ) -> torch.Tensor:
    """``x [M, K] @ weight.T + bias`` for a bfloat16 ``weight [N, K]`` (on a GPU the products are bfloat16 either
    way); the rest as in ``int8_matmul``."""
    if weight.dtype != torch.bfloat16 or weight.dim() != 2 or not weight.is_contiguous():
        raise ValueError(f"float_matmul takes a contiguous bfloat16 [N, K] weight, got {weight.dtype} "
                         f"{tuple(weight.shape)} with strides {weight.stride()}")
    return _matmul(x, weight, weight, bias, out_dtype, bits=16, group=1, split=split, gate=gate)  # (the weight
    # stands in for scales, unread)


class TritonLinear(WrappedLinear):
    """A bfloat16 linear layer on a GPU whose calls of up to ``max_rows`` rows run ``float_matmul``, and longer ones
    cuBLAS (whose GEMMs a long prompt's chunk wants: the kernel's 16-row tiles read the weight once per 16 rows). The
    engine passes its largest decode or verify forward, so that a row's bits are alike in all of them (greedy
    speculation's equality with plain decoding). The weight and bias stay the wrapped linear's."""

    def __init__(self, linear: nn.Linear, max_rows: int) -> None:
        if linear.weight.dtype != torch.bfloat16 or not runs_on(linear.weight.device):
            raise ValueError(f"TritonLinear takes a bfloat16 linear where Triton's kernel runs, got "
                             f"{linear.weight.dtype} on {linear.weight.device}")
        super().__init__(linear)
        self.max_rows = max_rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._call(x, None)

    def forward_gated(self, x: torch.Tensor, activation: str) -> torch.Tensor:
        """``act(gate) * up`` of this layer's output halves (``GatedProjection``); a long call's after cuBLAS."""
        return self._call(x, activation)

    def _call(self, x: torch.Tensor, gate: str | None) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        if x2.shape[0] > self.max_rows:
            y = self.linear(x2)
            y = y if gate is None else gate_rows(y, gate)
        else:
            y = float_matmul(x2, self.linear.weight, self.linear.bias, out_dtype=x.dtype, gate=gate)
        return y.reshape(*x.shape[:-1], y.shape[-1])


class GatedProjection(nn.Module):
    """A gate/up projection on Triton's kernel (its output ``[gate | up]``) whose call returns ``act(gate) * up``,
    computed in the kernel's last step: the gated activation's own kernel and the ``[gate | up]`` round trip through
    memory are saved, one launch a layer. The bits of the projection followed by ``triton_ops.gated``.

    ``projection``: a layer with ``forward_gated(x, activation)``: a ``TritonLinear``, or an int8 / int4 layer on the
    ``triton`` backend."""

    def __init__(self, projection: nn.Module, activation: str) -> None:
        if activation not in ACTIVATIONS or projection.out_features % 2:
            raise ValueError(f"a gated projection applies one of {', '.join(ACTIVATIONS)} to an even number of "
                             f"outputs, got {activation!r} on {projection.out_features}")
        super().__init__()
        self.projection, self.activation = projection, activation
        self.in_features, self.out_features = projection.in_features, projection.out_features // 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.projection.forward_gated(x, self.activation)

    def extra_repr(self) -> str:
        return f"activation={self.activation}"


def _matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
            out_dtype: torch.dtype, bits: int, group: int, split: bool | None, gate: str | None = None
            ) -> torch.Tensor:
    x = x.contiguous()
    rows, k = x.shape
    n = qweight.shape[0]
    if gate is not None and (gate not in ACTIVATIONS or n % 2):
        raise ValueError(f"gate must be one of {', '.join(ACTIVATIONS)} on an even number of output columns, got "
                         f"{gate!r} on {n}")
    width = n if gate is None else n // 2
    out = torch.empty(rows, width, dtype=out_dtype, device=x.device)
    if rows == 0:
        return out
    if bias is not None and (bias.shape != (n,) or bias.device != x.device):
        raise ValueError(f"bias must be [{n}] on {x.device}, got {tuple(bias.shape)} on {bias.device}")
    tiles, chunks = (-(-width // BLOCK_N), -(-rows // BLOCK_M)), -(-k // CHUNK_K)
    if split is None:
        split = chunks >= SPLIT_FROM_CHUNKS and tiles[0] * tiles[1] < SPLIT_BELOW
    # the chunks' sums [chunks, M, N] where they run apart (a decode step's: a few KiB to a MiB)
    sums = torch.empty(chunks, rows, n, dtype=torch.float32, device=x.device) if split else out
    scales = scales.contiguous()
    bias_or_any = scales if bias is None else bias.contiguous()  # (unread without a bias)
    gate_code = -1 if gate is None else ACTIVATIONS[gate]
    matmul, add_chunks = _kernels()
    # enable_fp_fusion=False: every product and sum rounds on its own, as the docstrings say (int8's scale, then the
    # bias; int4's (q - 8) * scale + zero) and as the interpreter does; a fused multiply-add rounds once
    matmul[((-(-n // BLOCK_N), tiles[1], chunks) if split else tiles + (1,))](
        x, qweight, scales, bias_or_any, sums, rows, n, k, x.stride(0), 1 if split else chunks,
        BITS=bits, GROUP=group, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, CHUNK_TILES=CHUNK_TILES,
        FINAL=not split, HAS_BIAS=bias is not None, DOT_BF16=x.is_cuda, GATE=-1 if split else gate_code,
        enable_fp_fusion=False)
    if split:
        _add_chunks(sums, scales, bias_or_any, out, bits, bias is not None, gate_code)
    return out


def gate_rows(gate_up: torch.Tensor, gate: str) -> torch.Tensor:
    """``gate(first half) * second half`` of ``gate_up [M, 2N]`` (a projection's output, here cuBLAS's) as ``[M, N]``,
    with the arithmetic of the kernel's last step."""
    gate_up = gate_up.contiguous()
    out = gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)
    if out.numel():
        _add_chunks(gate_up[None], gate_up, gate_up, out, bits=16, has_bias=False, gate_code=ACTIVATIONS[gate])
    return out


def _add_chunks(sums: torch.Tensor, scales: torch.Tensor, bias_or_any: torch.Tensor, out: torch.Tensor, bits: int,
                has_bias: bool, gate_code: int) -> None:
    """``out`` from the chunks' sums ``[chunks, M, N]``: added, scaled, biased, gated and rounded (``_kernels``)."""
    block = 1024
    _kernels()[1][(-(-out.numel() // block),)](sums, scales, bias_or_any, out, out.numel(), sums[0].numel(),
                                               sums.shape[2], sums.shape[0], BITS=bits, HAS_BIAS=has_bias,
                                               GATE=gate_code, BLOCK=block, enable_fp_fusion=False)


@functools.cache
def _kernels():
    """Triton imported and the kernels defined on first use (see kv/paged_attention.py's ``_kernel``)."""
    _helpers()

    @triton.jit
    def weight_only_matmul(x_ptr, w_ptr, s_ptr, b_ptr, out_ptr, M, N, K, stride_xm, chunks_per_program,
                           BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_K: tl.constexpr, CHUNK_TILES: tl.constexpr, FINAL: tl.constexpr,
                           HAS_BIAS: tl.constexpr, DOT_BF16: tl.constexpr, GATE: tl.constexpr):
        """Rows ``rm`` by columns ``rn`` of the output, summed over ``chunks_per_program`` chunks of K from the
        program's third index on: the whole of K into ``out [M, N]`` (``FINAL``: int8's row scales and the bias
        applied, rounded to out's dtype; ``GATE`` >= 0, an activation of ``ACTIVATIONS``: ``out [M, N // 2]``, the
        gated product of the weight's two halves, each rounded first), or one chunk's float32 sum into its slice of
        ``out [chunks, M, N]``."""
        # int64 offsets: a weight of more than 2^31 values (a 256k vocabulary's head) must not wrap
        rm = (tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        rn = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
        chunk = tl.program_id(2) * chunks_per_program
        total = _sums(x_ptr, w_ptr, s_ptr, rm, rn, chunk, chunks_per_program, M, N, K, stride_xm, BITS, GROUP,
                      BLOCK_M, BLOCK_N, BLOCK_K, CHUNK_TILES, DOT_BF16)
        width = N
        if FINAL:
            total = _finished(total, s_ptr, b_ptr, rn[None, :], N, BITS, HAS_BIAS)
            if GATE >= 0:  # the up projection's rows are the weight's second half
                width = N // 2
                up = _sums(x_ptr, w_ptr, s_ptr, rm, rn + width, chunk, chunks_per_program, M, N, K, stride_xm,
                           BITS, GROUP, BLOCK_M, BLOCK_N, BLOCK_K, CHUNK_TILES, DOT_BF16)
                up = _finished(up, s_ptr, b_ptr, rn[None, :] + width, N, BITS, HAS_BIAS)
                total = _gated(total.to(out_ptr.dtype.element_ty).to(tl.float32),
                               up.to(out_ptr.dtype.element_ty).to(tl.float32), GATE)
        at = out_ptr + tl.program_id(2).to(tl.int64) * M * N  # this chunk's slice (the first, and only, where not split)
        tl.store(at + rm[:, None] * width + rn[None, :], total.to(out_ptr.dtype.element_ty),
                 mask=(rm[:, None] < M) & (rn[None, :] < width))

    @triton.jit
    def add_chunks(sums_ptr, s_ptr, b_ptr, out_ptr, size, chunk_size, N, chunks, BITS: tl.constexpr,
                   HAS_BIAS: tl.constexpr, GATE: tl.constexpr, BLOCK: tl.constexpr):
        """``out`` (``size`` values) from the chunks' sums ``[chunks, M, N]`` (``chunk_size`` = M N): each column's
        sums added in order (``_chunk_total``), as ``weight_only_matmul`` adds them in one program, then ``_finished``,
        then, for a ``GATE``, the gated product of the two halves' columns, each rounded to out's dtype first."""
        at = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        inside = at < size
        if GATE >= 0:
            half = N // 2
            first, col = at // half * N + at % half, at % half
            gate = _finished(_chunk_total(sums_ptr + first, inside, chunk_size, chunks, BLOCK), s_ptr, b_ptr, col, N,
                             BITS, HAS_BIAS)
            up = _finished(_chunk_total(sums_ptr + first + half, inside, chunk_size, chunks, BLOCK), s_ptr, b_ptr,
                           col + half, N, BITS, HAS_BIAS)
            total = _gated(gate.to(out_ptr.dtype.element_ty).to(tl.float32),
                           up.to(out_ptr.dtype.element_ty).to(tl.float32), GATE)
        else:
            total = _finished(_chunk_total(sums_ptr + at, inside, chunk_size, chunks, BLOCK), s_ptr, b_ptr, at % N,
                              N, BITS, HAS_BIAS)
        tl.store(out_ptr + at, total.to(out_ptr.dtype.element_ty), mask=inside)

    return weight_only_matmul, add_chunks


@functools.cache
def _helpers() -> None:
    """Triton imported and the functions the kernels call defined, as module globals: where Triton's interpreter
    looks for them."""
    global triton, tl, _sums, _int4_tile, _dot, _finished, _gated, _chunk_total
    import triton
    import triton.language as tl

    @triton.jit
    def _sums(x_ptr, w_ptr, s_ptr, rm, rn, chunk, chunks, M, N, K, stride_xm, BITS: tl.constexpr,
              GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              CHUNK_TILES: tl.constexpr, DOT_BF16: tl.constexpr):
        """The float32 sums of rows ``rm`` by weight rows ``rn`` over ``chunks`` chunks of K from ``chunk`` on,
        each chunk summed from zero and added in order."""
        total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        done = 0
        while done < chunks:  # (a while loop: the interpreter cannot take range() over a runtime bound)
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for tile in tl.static_range(CHUNK_TILES):
                k0 = (chunk + done) * CHUNK_TILES * BLOCK_K + tile * BLOCK_K
                if BITS >= 8:  # int8, or bfloat16 (BITS 16): a tile of the weight as it is stored
                    rk = k0 + tl.arange(0, BLOCK_K)
                    x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :],
                                mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)
                    w = tl.load(w_ptr + rn[None, :] * K + rk[:, None], mask=(rk[:, None] < K) & (rn[None, :] < N),
                                other=0)  # the tile [BLOCK_K, BLOCK_N], transposed
                    acc = _dot(x, w.to(tl.float32), acc, DOT_BF16)
                else:
                    acc = _int4_tile(x_ptr, w_ptr, s_ptr, acc, rm, rn, k0, M, N, K, stride_xm, GROUP, BLOCK_N,
                                     BLOCK_K, DOT_BF16)
            total += acc
            done += 1
        return total

    @triton.jit
    def _int4_tile(x_ptr, w_ptr, s_ptr, acc, rm, rn, k0, M, N, K, stride_xm, GROUP: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_BF16: tl.constexpr):
        """``acc`` plus the tile of K from ``k0``: each byte of the weight is read once, its low nibbles (even
        columns) and high ones (odd) widened apart and met with x's even and odd columns; the tile's groups' scales
        and zeros are read once each, as a [groups, 1, BLOCK_N] block."""
        g = tl.arange(0, BLOCK_K // GROUP)[:, None, None]
        pair = g * (GROUP // 2) + tl.arange(0, GROUP // 2)[None, :, None]  # the byte's place in the tile
        inside = (pair < (K - k0) // 2) & (rn[None, None, :] < N)  # (K even: the same bytes as k0 + 2 pair < K,
        # a mask of unit stride, which compiles to vector loads)
        packed = tl.load(w_ptr + rn[None, None, :] * (K // 2) + k0 // 2 + pair, mask=inside, other=0).to(tl.int32)
        at = ((k0 // GROUP + g) * N + rn[None, None, :]) * 2
        group_inside = (k0 + g * GROUP < K) & (rn[None, None, :] < N)
        scale = tl.load(s_ptr + at, mask=group_inside, other=0.0).to(tl.float32)
        zero = tl.load(s_ptr + at + 1, mask=group_inside, other=0.0).to(tl.float32)
        low = tl.reshape(((packed & 0xF).to(tl.float32) - 8.0) * scale + zero, (BLOCK_K // 2, BLOCK_N))
        high = tl.reshape(((packed >> 4).to(tl.float32) - 8.0) * scale + zero, (BLOCK_K // 2, BLOCK_N))
        even = k0 + 2 * tl.arange(0, BLOCK_K // 2)
        row_inside = rm[:, None] < M
        x_even = tl.load(x_ptr + rm[:, None] * stride_xm + even[None, :], mask=row_inside & (even[None, :] < K),
                         other=0.0)
        x_odd = tl.load(x_ptr + rm[:, None] * stride_xm + even[None, :] + 1,
                        mask=row_inside & (even[None, :] + 1 < K), other=0.0)
        acc = _dot(x_even, low, acc, DOT_BF16)
        return _dot(x_odd, high, acc, DOT_BF16)

    @triton.jit
    def _dot(x, w, acc, DOT_BF16: tl.constexpr):
        if DOT_BF16:  # tensor cores: bfloat16 products, float32 sums
            return tl.dot(x.to(tl.bfloat16), w.to(tl.bfloat16), acc)
        return tl.dot(x.to(tl.float32), w, acc, input_precision="ieee")  # what the interpreter gets right

    @triton.jit
    def _finished(total, s_ptr, b_ptr, cols, N, BITS: tl.constexpr, HAS_BIAS: tl.constexpr):
        """Float32 sums of output columns ``cols`` times int8's row scales, plus the bias."""
        if BITS == 8:
            total = total * tl.load(s_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
        if HAS_BIAS:
            total = total + tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
        return total

    @triton.jit
    def _gated(gate, up, ACT: tl.constexpr):
        """``act(gate) * up`` in float32: SiLU (``ACT`` 0) or GELU with tanh's approximation (1)."""
        if ACT == 0:  # silu: gate * sigmoid(gate)
            a = gate
        else:  # gelu with tanh's approximation, 0.5 gate (1 + tanh(z)) = gate * sigmoid(2z)
            a = 1.5957691216057308 * (gate + 0.044715 * gate * gate * gate)
        e = tl.exp(-tl.abs(a))  # sigmoid without overflow: exp of a value <= 0 only
        return gate * tl.where(a >= 0, 1.0 / (1.0 + e), e / (1.0 + e)) * up

    @triton.jit
    def _chunk_total(sums, inside, chunk_size, chunks, BLOCK: tl.constexpr):
        """The chunks' sums added in order, from the first (a sum of a chunk is never -0.0, as it starts from +0.0;
        a value of cuBLAS's, ``gate_rows``', may be, and keeps its sign)."""
        total = tl.load(sums, mask=inside, other=0.0).to(tl.float32)
        chunk = 1  # stepped a chunk at a time: chunks * chunk_size may pass 2^31 where a caller forces the split
        while chunk < chunks:
            sums += chunk_size
            total += tl.load(sums, mask=inside, other=0.0).to(tl.float32)
            chunk += 1
        return total
