"""Weight-only quantized linear layers of every format, and several of them that read one input as one call."""
from __future__ import annotations

import torch
from torch import nn

from quickdraft.models import qmatmul
from quickdraft.models.block_linear import BlockLinear
from quickdraft.models.quant import Int4Linear, Int8Linear

QuantLinear = (Int8Linear, Int4Linear, BlockLinear)


class QuantGroup(nn.Module):
    """Quantized layers that read the same input (q/k/v, gate/up) run as one qmatmul call: the input is
    quantized once and one parallel loop covers all the weights. The output is the layers' outputs side by side,
    or with ``swiglu`` (gate, up) ``silu(gate) * up`` computed in the kernel. Each layer keeps its own format
    (a Q4_K_M GGUF stores some v projections with more bits than q and k) and its own tensors (no copy)."""

    def __init__(self, layers: list[nn.Module], swiglu: bool = False) -> None:
        super().__init__()
        if not all(isinstance(m, QuantLinear) and m.backend == "qmatmul" for m in layers):
            raise ValueError("QuantGroup needs quantized layers (Int4Linear, Int8Linear, BlockLinear) on the qmatmul "
                             "backend")
        if len({m.in_features for m in layers}) != 1:
            raise ValueError(f"QuantGroup layers must share in_features, got {[m.in_features for m in layers]}")
        self.layers = nn.ModuleList(layers)
        self.in_features = layers[0].in_features
        self.call = qmatmul.PartsCall([m.kernel_part() for m in layers], self.in_features, swiglu)
        self.out_features = self.call.out_features
        self._unactivated: qmatmul.PartsCall | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        return self.call(x.reshape(-1, self.in_features)).reshape(*lead, self.out_features)

    def unactivated(self, x: torch.Tensor) -> torch.Tensor:
        """Where the call applies SwiGLU: gate and up side by side before it (a LoRA adapter adds to them), in
        float32 as the kernel applies it, so ``act(gate) * up`` rounded to ``x``'s dtype are the call's own bits."""
        if self._unactivated is None:
            self._unactivated = qmatmul.PartsCall([m.kernel_part() for m in self.layers], self.in_features)
        out = self._unactivated(x.reshape(-1, self.in_features), out_dtype=torch.float32)
        return out.reshape(*x.shape[:-1], -1)
