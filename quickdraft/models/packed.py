"""Dense linear layers whose weight is reordered once into oneDNN's blocked layout (CPU, float32 and bfloat16).

Why not ``nn.Linear`` (facts checked on torch 2.13, 2-core AVX512-BF16 EPYC, see tests/test_packed.py):

* Exactness: the packed kernel (``mkldnn._linear_pointwise``) computes each output row independently of the
  other rows of the call as long as the call has at least 2 rows; a 1-row call takes another path that rounds
  differently, and so does ``F.linear`` between 1 and several rows. Calls are therefore padded to ``MIN_ROWS``
  rows, and a token's logits are bit-identical whether it is decoded alone, verified among k drafts or
  batched beside other sequences (as with the int4/int8 kernels in ``quant.py``).
* Speed: over the 28 layers of Qwen2.5-1.5B in bfloat16, ``F.linear`` with 1 row streams weights at
  14-17 GB/s; the packed kernel at 17-20 GB/s with 1-4 rows and 24-26 GB/s with 5 or 6 rows (the
  host's measured read bandwidth varied between 31 and 51 GB/s that day). So short calls are padded to 5 rows: the extra rows cost
  arithmetic, and a decode step is bound by reading the weights.
"""
from __future__ import annotations

import torch
from torch import nn

MIN_ROWS = 5


def packing_supported(dtype: torch.dtype, device: torch.device | str) -> bool:
    """True where the packed kernel runs: CPU with oneDNN, float32, or bfloat16 on a CPU oneDNN supports it on."""
    if torch.device(device).type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return dtype == torch.float32


class PackedLinear(nn.Module):
    """``y = x @ W.T + b`` with ``W`` in oneDNN's layout (the original weight is not kept)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        if weight.dim() != 2 or not packing_supported(weight.dtype, weight.device):
            raise ValueError(f"PackedLinear needs a 2-D float32/bfloat16 CPU weight with oneDNN available, "
                             f"got {weight.dtype} {tuple(weight.shape)} on {weight.device}")
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight_packed", torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), 1))
        self.register_buffer("bias", None if bias is None else bias.detach().to(weight.dtype).contiguous())

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> PackedLinear:
        return cls(linear.weight, linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        rows = x2.shape[0]
        if rows < MIN_ROWS:
            x2 = torch.cat([x2, x2.new_zeros(MIN_ROWS - rows, self.in_features)])
        y = torch.ops.mkldnn._linear_pointwise(x2.contiguous(), self.weight_packed, self.bias, "none", [None], "")
        return y[:rows].reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
