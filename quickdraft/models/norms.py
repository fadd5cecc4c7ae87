"""RMSNorm, and a decoder layer's residual add with the norm after it, in as few kernels as the device allows.

On the CPU a norm is one call into quickdraft's C kernels; on a GPU, one Triton kernel, which also does the residual
add before it (``add_norm``); where the projection after the norm runs on Triton's linear kernel, the add and the
norm run inside that projection's kernel (``add_norm_project``): a decode step at batch 1 on a GPU is bound by its
kernel launches as much as by its bytes.
"""
from __future__ import annotations

import torch
from torch import nn
import torch.nn.functional as F

from quickdraft.models import native, triton_ops
from quickdraft.models.triton_linear import AddNorm

# The add and the norm inside the projection after them wherever it can take them (``add_norm_project``); a benchmark
# turns it off before loading a model to time the norm's own kernel against it (bench/cuda_decode.py --norm-apart).
IN_PROJECTIONS = True


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if native.runs_rms_norm(x, self.weight):  # one call instead of ~8 small torch ops
            return native.rms_norm(x, self.weight, self.eps)
        if triton_ops.runs_rms_norm(x, self.weight):  # one kernel on a GPU
            return triton_ops.rms_norm(x, self.weight, self.eps)
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps).to(x.dtype)


def normed(norm: RMSNorm | None, x: torch.Tensor) -> torch.Tensor:
    """``norm(x)``, or x itself where a layer has no norm there (OLMo 2 has none before attention or the MLP)."""
    return x if norm is None else norm(x)


def add_norm(x: torch.Tensor, pending: torch.Tensor | None, norm: RMSNorm | None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(s, norm(s))`` for ``s = x + pending`` (``x`` where nothing is pending), the add and the norm in one kernel;
    ``(s, s)`` where ``norm`` is None."""
    if pending is None or norm is None:
        x = x if pending is None else x + pending
        return x, normed(norm, x)
    if not triton_ops.runs_rms_norm(x, norm.weight):
        x = x + pending
        return x, norm(x)
    return triton_ops.add_rms_norm(x, pending, norm.weight, norm.eps)


def add_norm_project(x: torch.Tensor, pending: torch.Tensor | None, norm: RMSNorm | None, projection: nn.Module
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(s, projection(norm(s)))`` for ``s = x + pending``: the add and the norm inside the projection's kernel
    where it takes them for these rows (``fuses_norm``: Triton's linear kernel; two launches a layer fewer), else
    ``add_norm`` then the projection."""
    fuses = getattr(projection, "fuses_norm", None)  # (torch's nn.Linear, cuBLAS's, has no such method)
    if pending is None or norm is None or not IN_PROJECTIONS or fuses is None or not fuses(x):
        x, h = add_norm(x, pending, norm)
        return x, projection(h)
    return projection.forward_normed(x, AddNorm(pending, norm.weight, norm.eps))
