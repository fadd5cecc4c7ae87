"""A linear layer whose weight stays in a GGUF file's own quantization (Q5_0, Q6_K, IQ4_XS, Q1_0, ...), read by the
qmatmul kernel at the file's size: a decode step reads the bytes the file holds, not a wider requantized copy."""
from __future__ import annotations

import torch

from quickdraft.models import qmatmul
from quickdraft.models.block_formats import FORMATS
from quickdraft.models.quant import _QuantLinearBase


class BlockLinear(_QuantLinearBase):
    """``y = x @ W.T + bias`` with ``W`` the weights of a GGML block format (``block_formats.dequantize`` gives them).

    Buffer: ``kweight`` uint8 ``[N, row_bytes]``, the file's rows repacked for the kernel (``block_formats.repack``);
    CPU and the qmatmul kernel only (no other backend reads these layouts)."""

    kscales = None  # the scales are inside each row's blocks

    def __init__(self, kweight: torch.Tensor, kernel_name: str, in_features: int,
                 bias: torch.Tensor | None = None) -> None:
        super().__init__()
        fmt = FORMATS.get(kernel_name)
        if fmt is None:
            raise ValueError(f"BlockLinear format must be one of {', '.join(FORMATS)}, got {kernel_name!r}")
        if not fmt.takes(in_features):
            raise ValueError(f"{kernel_name} rows cannot have {in_features} columns (blocks of {fmt.block})")
        if kweight.device.type != "cpu" or not qmatmul.available():
            raise ValueError(f"{kernel_name} weights need CPU tensors and the qmatmul kernel "
                             f"({qmatmul.unavailable_reason() or 'not on CPU'})")
        row = qmatmul.row_bytes(fmt.code, in_features)
        if kweight.dtype != torch.uint8 or kweight.dim() != 2 or kweight.shape[1] != row:
            raise ValueError(f"{kernel_name} weight must be uint8 [N, {row}], got {kweight.dtype} {tuple(kweight.shape)}")
        self.out_features, self.in_features = int(kweight.shape[0]), int(in_features)
        self.kernel_name, self.format_code, self.backend = kernel_name, fmt.code, "qmatmul"
        self.register_buffer("kweight", kweight.contiguous())
        self._init_bias(bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        return self._qmatmul(x.reshape(-1, self.in_features)).reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, format={self.kernel_name}"
