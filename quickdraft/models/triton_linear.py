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
import math
import os
from dataclasses import dataclass

import torch
from torch import nn

from quickdraft.models.packed import WrappedLinear
from quickdraft.models.triton_linear_kernels import kernels


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


@dataclass(frozen=True)
class Tiles:
    """How a layer's calls of up to ``BLOCK_M`` rows (a decode step's, a few sequences') run: output columns per
    program, warps per program, and whether K's chunks run in programs of their own (None: the shape's rule,
    ``splits``; a call with a norm never splits). Longer calls take the defaults. The device decides which pays
    (``triton_tuning``), and keeps a choice only where a forward with it gives the defaults' bits."""

    block_n: int = BLOCK_N
    warps: int = 4
    split: bool | None = None

    def __post_init__(self) -> None:
        if self.split not in (None, False, True):
            raise ValueError(f"a tile's split is None (the shape's rule), False or True, got {self.split!r}")
        if self.block_n not in (16, 32, 64, 128) or self.warps not in (1, 2, 4, 8):
            raise ValueError(f"tiles take 16, 32, 64 or 128 output columns and 1, 2, 4 or 8 warps a program, got "
                             f"{self.block_n} and {self.warps}")


DEFAULT_TILES = Tiles()


class TiledLayer:
    """A layer whose calls may run on Triton's linear kernel, and how (``tiles``; see ``triton_tuning``)."""

    tiles: Tiles = DEFAULT_TILES

    def tile_key(self) -> tuple | None:
        """What decides how fast a choice of ``tiles`` runs this layer's calls (layers of one key are tuned as one);
        None where its calls do not run on Triton's kernel."""
        raise NotImplementedError


# The gated activations the kernels apply to a gate/up projection's output, ``act(gate) * up`` (``GatedProjection``,
# and ``triton_ops.gated`` after a projection that does not); gpt-oss's clamped SwiGLU stays in torch.
ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}


@dataclass(frozen=True)
class AddNorm:
    """A projection's input given as ``rms_norm(x + residual)`` (a decoder layer's residual add and the norm before
    its q/k/v or gate/up): computed in the matmul kernel itself, one launch fewer (``triton_linear_kernels``).
    ``residual`` is x's shape and dtype, ``weight`` the norm's ``[K]``."""

    residual: torch.Tensor
    weight: torch.Tensor
    eps: float

    def check(self, x: torch.Tensor) -> None:
        r, w = self.residual, self.weight
        if not math.isfinite(self.eps) or self.eps < 0:
            raise ValueError(f"the norm's eps must be a finite number >= 0, got {self.eps!r}")
        if r.shape != x.shape or r.dtype != x.dtype or r.device != x.device:
            raise ValueError(f"the residual must be x's {tuple(x.shape)} {x.dtype} on {x.device}, got "
                             f"{tuple(r.shape)} {r.dtype} on {r.device}")
        if w.shape != (x.shape[-1],) or w.device != x.device or not w.is_floating_point():
            raise ValueError(f"the norm's weight must be a float [{x.shape[-1]}] on {x.device}, got {w.dtype} "
                             f"{tuple(w.shape)} on {w.device}")


def int8_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None,
                out_dtype: torch.dtype = torch.float32, split: bool | None = None, gate: str | None = None,
                norm: AddNorm | None = None, tiles: Tiles = DEFAULT_TILES
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K] @ (qweight * scales[:, None]).T + bias`` as ``[M, N]`` of ``out_dtype``, summed and biased in
    float32 and rounded once; ``split`` forces K's chunks into programs of their own (True) or not (False) where None
    lets the shape choose: the result is the same either way. ``gate`` (one of ``ACTIVATIONS``): the output's two
    halves are a gate and an up projection, and the result ``[M, N // 2]`` is ``gate(first) * second``: the bits of
    ``triton_ops.gated`` after the call without it. ``norm``: the input is ``rms_norm(x + norm.residual)``, and the
    result is ``(x + norm.residual, out)``, the sum rounded to x's dtype. ``tiles``: see ``Tiles``."""
    return _matmul(x, qweight, scales, bias, out_dtype, bits=8, group=1, split=split, gate=gate, norm=norm,
                   tiles=tiles)


def int4_matmul(x: torch.Tensor, qweight: torch.Tensor, scales_and_zeros: torch.Tensor, group: int,
                bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.float32, split: bool | None = None,
                gate: str | None = None, norm: AddNorm | None = None, tiles: Tiles = DEFAULT_TILES
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K] @ W.T + bias`` with ``W[n, k] = (q - 8) * s + z`` from nibbles ``qweight [N, K // 2]`` and
    ``scales_and_zeros [K // group, N, 2]``; the rest as in ``int8_matmul``."""
    if BLOCK_K % group:
        raise ValueError(f"the triton int4 kernel takes groups dividing {BLOCK_K} columns, got {group}")
    return _matmul(x, qweight, scales_and_zeros, bias, out_dtype, bits=4, group=group, split=split, gate=gate,
                   norm=norm, tiles=tiles)


def float_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 out_dtype: torch.dtype = torch.float32, split: bool | None = None, gate: str | None = None,
                 norm: AddNorm | None = None, tiles: Tiles = DEFAULT_TILES
                 ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K] @ weight.T + bias`` for a bfloat16 ``weight [N, K]`` (on a GPU the products are bfloat16 either
    way); the rest as in ``int8_matmul``."""
    if weight.dtype != torch.bfloat16 or weight.dim() != 2 or not weight.is_contiguous():
        raise ValueError(f"float_matmul takes a contiguous bfloat16 [N, K] weight, got {weight.dtype} "
                         f"{tuple(weight.shape)} with strides {weight.stride()}")
    return _matmul(x, weight, weight, bias, out_dtype, bits=16, group=1, split=split, gate=gate, norm=norm,
                   tiles=tiles)  # (the weight stands in for scales, unread)


class TritonLinear(WrappedLinear, TiledLayer):
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

    def tile_key(self) -> tuple:
        return "bfloat16", self.out_features, self.in_features, self.linear.bias is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._call(x, None)

    def forward_gated(self, x: torch.Tensor, activation: str) -> torch.Tensor:
        """``act(gate) * up`` of this layer's output halves (``GatedProjection``); a long call's after cuBLAS."""
        return self._call(x, activation)

    def fuses_norm(self, x: torch.Tensor, gate: str | None = None) -> bool:
        """Whether a call on ``x`` runs the kernel and its shape takes a residual add and a norm (``takes_norm``;
        ``forward_normed``). Every decode and verify forward is within ``max_rows``, so they all decide alike."""
        width = self.out_features // 2 if gate else self.out_features
        return x.numel() // self.in_features <= self.max_rows and takes_norm(width, self.in_features)

    def forward_normed(self, x: torch.Tensor, norm: AddNorm, gate: str | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(s, self(rms_norm(s)))`` for ``s = x + norm.residual``, in one kernel (``fuses_norm`` calls only)."""
        x2 = x.reshape(-1, self.in_features)
        norm = AddNorm(norm.residual.reshape(x2.shape), norm.weight, norm.eps)
        total, y = float_matmul(x2, self.linear.weight, self.linear.bias, out_dtype=x.dtype, gate=gate, norm=norm,
                                tiles=self.tiles)
        return total.reshape(x.shape), y.reshape(*x.shape[:-1], y.shape[-1])

    def _call(self, x: torch.Tensor, gate: str | None) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        if x2.shape[0] > self.max_rows:
            y = self.linear(x2)
            y = y if gate is None else gate_rows(y, gate)
        else:
            y = float_matmul(x2, self.linear.weight, self.linear.bias, out_dtype=x.dtype, gate=gate, tiles=self.tiles)
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

    def unactivated(self, x: torch.Tensor) -> torch.Tensor:
        """``[gate | up]`` before the activation (a LoRA adapter adds to them), in float32 as the kernel applies it
        (rounded to ``x``'s dtype first: the call's own bits are not kept here)."""
        return self.projection(x).float()

    def fuses_norm(self, x: torch.Tensor) -> bool:
        return self.projection.fuses_norm(x, self.activation)

    def forward_normed(self, x: torch.Tensor, norm: AddNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """``(s, self(rms_norm(s)))`` for ``s = x + norm.residual``, in one kernel."""
        return self.projection.forward_normed(x, norm, self.activation)

    def extra_repr(self) -> str:
        return f"activation={self.activation}"


def splits(rows: int, out_features: int, in_features: int) -> bool:
    """Whether a call of ``rows`` rows sums K's chunks in programs of their own (``out_features``: the kernel's
    output columns, a gated projection's half)."""
    tiles = -(-out_features // BLOCK_N) * -(-rows // BLOCK_M)
    return -(-in_features // CHUNK_K) >= SPLIT_FROM_CHUNKS and tiles < SPLIT_BELOW


def takes_norm(out_features: int, in_features: int) -> bool:
    """Whether calls of this shape take a residual add and norm (``AddNorm``): where no row count splits K (a single
    row splits where any does). A property of the shape, never of the rows: the norm inside the kernel gives other
    bits than its own kernel before it, so a row's bits would otherwise depend on its batch."""
    return out_features > 0 and not splits(1, out_features, in_features)


def _matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
            out_dtype: torch.dtype, bits: int, group: int, split: bool | None, gate: str | None = None,
            norm: AddNorm | None = None, tiles: Tiles = DEFAULT_TILES
            ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    x = x.contiguous()
    rows, k = x.shape
    if rows > BLOCK_M:
        tiles = DEFAULT_TILES  # (the tiles are chosen for a decode step's few rows)
    n = qweight.shape[0]
    if gate is not None and (gate not in ACTIVATIONS or n % 2):
        raise ValueError(f"gate must be one of {', '.join(ACTIVATIONS)} on an even number of output columns, got "
                         f"{gate!r} on {n}")
    width = n if gate is None else n // 2
    if norm is not None:
        norm.check(x)
        if split or not takes_norm(width, k):
            raise ValueError(f"a norm runs in unsplit calls of a shape no row count splits (triton_linear.takes_norm), "
                             f"got {k} columns to {width}{' split' if split else ''}")
    out = torch.empty(rows, width, dtype=out_dtype, device=x.device)
    total = None if norm is None else torch.empty_like(x)  # x + residual, the residual stream's next value
    if rows == 0:
        return out if norm is None else (total, out)
    if bias is not None and (bias.shape != (n,) or bias.device != x.device):
        raise ValueError(f"bias must be [{n}] on {x.device}, got {tuple(bias.shape)} on {bias.device}")
    block_n, chunks = tiles.block_n, -(-k // CHUNK_K)
    if split is None:
        split = (splits(rows, width, k) if tiles.split is None else tiles.split) and norm is None
    # the chunks' sums [chunks, M, N] where they run apart (a decode step's: a few KiB to a MiB)
    sums = torch.empty(chunks, rows, n, dtype=torch.float32, device=x.device) if split else out
    scales = scales.contiguous()
    bias_or_any = scales if bias is None else bias.contiguous()  # (unread without a bias)
    gate_code = -1 if gate is None else ACTIVATIONS[gate]
    residual, norm_weight = (x, x) if norm is None else (norm.residual.contiguous(), norm.weight.contiguous())
    # enable_fp_fusion=False: every product and sum rounds on its own, as the docstrings say (int8's scale, then the
    # bias; int4's (q - 8) * scale + zero) and as the interpreter does; a fused multiply-add rounds once
    row_tiles = -(-rows // BLOCK_M)
    kernels()[0][(-(-n // block_n), row_tiles, chunks) if split else (-(-width // block_n), row_tiles, 1)](
        x, qweight, scales, bias_or_any, sums, rows, n, k, x.stride(0), 1 if split else chunks, residual,
        norm_weight, x if total is None else total, 0.0 if norm is None else float(norm.eps),
        BITS=bits, GROUP=group, BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=BLOCK_K, CHUNK_TILES=CHUNK_TILES,
        EVEN_K=k % CHUNK_K == 0, FINAL=not split, HAS_BIAS=bias is not None, DOT_BF16=x.is_cuda, GATE=-1 if split else gate_code,
        NORM=0 if norm is None else 1, num_warps=tiles.warps, enable_fp_fusion=False)
    if split:
        _add_chunks(sums, scales, bias_or_any, out, bits, bias is not None, gate_code)
    return out if norm is None else (total, out)


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
    """``out`` from the chunks' sums ``[chunks, M, N]``: added, scaled, biased, gated and rounded."""
    block = 1024
    kernels()[1][(-(-out.numel() // block),)](sums, scales, bias_or_any, out, out.numel(), sums[0].numel(),
                                              sums.shape[2], sums.shape[0], BITS=bits, HAS_BIAS=has_bias,
                                              GATE=gate_code, BLOCK=block, enable_fp_fusion=False)
