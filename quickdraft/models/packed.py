"""Dense float linear layers for CPU: quickdraft's bfloat16 kernel, or oneDNN's packed layout (float32 and
bfloat16).

* bfloat16 where quickdraft's kernels build (``native.linear_bf16``, in ``cpu_ops.c``; any AVX2 CPU): the weight
  is kept as is and streamed once per tile of up to 6 rows, with float32 sums in a fixed order per output element
  (of AVX512-BF16 pair products where the CPU has them, else of exact float32 products by AVX2 fma). Decode then
  runs near the memory-bandwidth limit, where oneDNN reaches well under half of it and has no bfloat16 at all on
  AVX2 CPUs, and verifying a few tokens costs little more than one step (figures: docs/MEASUREMENTS.md). oneDNN
  is faster for long prompt chunks (it is a tuned GEMM), but one kernel for every row keeps a token's result
  independent of what else is in the call.
* Otherwise oneDNN (facts checked on torch 2.13, 2-core AVX512-BF16 EPYC, see tests/test_packed.py):
  ``mkldnn._linear_pointwise`` computes each output row independently of the other rows of the call as long
  as the call has at least 2 rows; a 1-row call takes another path that rounds differently, and so does
  ``F.linear`` between 1 and several rows. Calls are therefore padded to ``MIN_ROWS`` rows (which the packed
  kernel also streams faster than 1-4 rows).

Either way a token's logits are bit-identical whether it is decoded alone, verified among k drafts or batched
beside other sequences (as with the int4/int8 kernels in ``quant.py``).
"""
from __future__ import annotations

import torch
from torch import nn

from quickdraft.models import native

MIN_ROWS = 5


def packing_supported(dtype: torch.dtype, device: torch.device | str) -> bool:
    """True where a PackedLinear runs: on CPU, bfloat16 with quickdraft's kernel (any AVX2 CPU) or with a oneDNN that
    supports bfloat16 on this CPU, float32 with oneDNN."""
    if torch.device(device).type != "cpu":
        return False
    if dtype == torch.bfloat16 and native.available():
        return True
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return dtype == torch.float32


class PackedLinear(nn.Module):
    """``y = x @ W.T + b`` with ``W`` in oneDNN's layout (the original weight is not kept), or, for bfloat16 where
    quickdraft's kernels build, ``W`` as is for ``native.linear_bf16``: that kernel streams
    a decode step's weights at close to the memory bandwidth (oneDNN's short calls reach about half of it) and
    computes each row on its own whatever the row count, so no padding is needed (``backend``: ``native`` or
    ``onednn``)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        if weight.dim() != 2 or not packing_supported(weight.dtype, weight.device):
            raise ValueError(f"PackedLinear needs a 2-D float32/bfloat16 CPU weight with oneDNN available, "
                             f"got {weight.dtype} {tuple(weight.shape)} on {weight.device}")
        self.out_features, self.in_features = weight.shape
        self.backend = "native" if weight.dtype == torch.bfloat16 and native.available() else "onednn"
        if self.backend == "native":
            self.register_buffer("weight_packed", weight.detach().contiguous())
            self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous())
        else:
            self.register_buffer("weight_packed",
                                 torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), 1))
            self.register_buffer("bias", None if bias is None else bias.detach().to(weight.dtype).contiguous())

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> PackedLinear:
        return cls(linear.weight, linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        rows = x2.shape[0]
        if self.backend == "native":
            return native.linear_bf16(x2.to(torch.bfloat16), self.weight_packed, self.bias).reshape(*lead, self.out_features)
        if rows < MIN_ROWS:
            x2 = torch.cat([x2, x2.new_zeros(MIN_ROWS - rows, self.in_features)])
        y = torch.ops.mkldnn._linear_pointwise(x2.contiguous(), self.weight_packed, self.bias, "none", [None], "")
        return y[:rows].reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"backend={self.backend}")


class WrappedLinear(nn.Module):
    """A float linear layer that runs its wrapped ``nn.Linear``'s weight and bias on another path; the weight stays
    the wrapped one's (a tied head still shares the embedding)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.linear = linear
        self.in_features, self.out_features = linear.in_features, linear.out_features

    @property
    def weight(self) -> torch.Tensor:
        return self.linear.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return self.linear.bias


class RowTiledLinear(WrappedLinear):
    """A float linear layer off CPU that computes every row with one GEMM shape: calls run in tiles of ``ROW_TILE``
    rows, the last one zero-padded. cuBLAS picks its float32 kernel by the row count (one row is a GEMV, 2-16 rows
    one GEMM kernel, more rows others; each rounds differently, seen on an H100), so without tiles a token's logits
    would depend on how many rows share its call, and verifying k drafts would not give the logits of k single steps
    (greedy speculation could flip a near-tie). A 16-row call computes each row on its own, whatever the other rows
    hold. Its bfloat16 kernels were row-independent at every row count tried (1-64), so bfloat16 keeps plain
    linears. The weight stays the wrapped linear's (a tied head still shares the embedding)."""

    ROW_TILE = 16

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        rows = x2.shape[0]
        pad = -rows % self.ROW_TILE
        if pad:
            x2 = torch.cat([x2, x2.new_zeros(pad, self.in_features)])
        w, b = self.linear.weight, self.linear.bias
        tiles = [torch.nn.functional.linear(t, w, b) for t in x2.split(self.ROW_TILE)]
        y = tiles[0] if len(tiles) == 1 else torch.cat(tiles)
        return y[:rows].reshape(*lead, self.out_features)

