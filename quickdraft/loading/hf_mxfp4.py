"""gpt-oss's released Hugging Face checkpoints store the experts in MXFP4: ``mlp.experts.gate_up_proj_blocks``
``[E, 2I, H/32, 16]`` and ``..._scales`` ``[E, 2I, H/32]`` (gate and up in alternate rows), ``down_proj_blocks``
``[E, H, I/32, 16]`` and its scales. Each group of 32 weights is 16 bytes of e2m1 nibbles (weight 2j in the low
nibble of byte j, 2j+1 in the high one) and one exponent byte, the weight being ``e2m1 * 2^(exponent - 127)``.

That is GGUF's MXFP4 block with the nibbles in another order (GGUF: weight j low, j+16 high, after the exponent
byte), the same exponent byte: each expert's rows are repacked into GGUF blocks when read, so the experts run at
their own size on the same kernel as a GGUF's (``weights="auto"``), or dequantized by the same code as float."""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from quickdraft.config import ModelConfig
from quickdraft.errors import ModelLoadError
from quickdraft.loading.ggml_types import BY_NAME
from quickdraft.models.block_formats import MXFP4_MAX_EXPONENT as MAX_EXPONENT

MXFP4 = BY_NAME["MXFP4"]
GROUP = 32
_STACKS = ("gate_up_proj", "down_proj")


def gguf_blocks(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``[rows, groups, 16]`` HF nibbles and ``[rows, groups]`` exponents -> ``[rows, groups * 17]`` GGUF MXFP4."""
    values = torch.stack((blocks & 15, blocks >> 4), dim=-1).reshape(*blocks.shape[:-1], GROUP)
    packed = values[..., :16] | (values[..., 16:] << 4)
    return torch.cat((scales.unsqueeze(-1), packed), dim=-1).reshape(blocks.shape[0], -1)


def take_mxfp4_experts(tensors: dict[str, Any], cfg: ModelConfig) -> dict[str, tuple[Callable[[], torch.Tensor],
                                                                                     tuple[int, int]]]:
    """Remove a gpt-oss checkpoint's MXFP4 expert stacks from ``tensors``; return each expert's gate/up/down weight
    by HF name as (maker of its GGUF MXFP4 blocks, its [out, in] shape). A stack or its scales of the wrong shape, one
    without the other, or an exponent byte the kernel cannot scale by, is refused by name before any weight is read;
    so is a stack the directory also holds unpacked."""
    out: dict[str, tuple[Callable[[], torch.Tensor], tuple[int, int]]] = {}
    packed = sorted(n for n in tensors if n.endswith(tuple(f"mlp.experts.{s}_{k}" for s in _STACKS
                                                             for k in ("blocks", "scales"))))
    if packed and cfg.architecture != "gpt_oss":
        raise ModelLoadError(f"{packed[0]}: MXFP4-packed experts are read for gpt-oss only, this is "
                             f"{cfg.architecture}")
    width, hidden, experts = cfg.expert_width, cfg.hidden_size, cfg.num_experts
    for name in packed:
        if not name.endswith("_blocks"):
            continue
        stack = name[:-len("_blocks")]
        rows, cols = (2 * width, hidden) if stack.endswith("gate_up_proj") else (hidden, width)
        blocks, scales = tensors.pop(name), tensors.pop(stack + "_scales", None)
        if scales is None:
            raise ModelLoadError(f"{name} has no {stack.rpartition('.')[2]}_scales beside it")
        want = (experts, rows, cols // GROUP, 16)
        if cols % GROUP or tuple(blocks.shape) != want or blocks.dtype != torch.uint8:
            raise ModelLoadError(f"{name} is {blocks.dtype} {list(blocks.shape)}; the config needs uint8 {list(want)}")
        if tuple(scales.shape) != want[:3] or scales.dtype != torch.uint8:
            raise ModelLoadError(f"{stack}_scales is {scales.dtype} {list(scales.shape)}; the config needs uint8 "
                                 f"{list(want[:3])}")
        top = int(scales.max()) if scales.numel() else 0  # (the scales alone: 1/17 of the experts' bytes)
        if top > MAX_EXPONENT:
            raise ModelLoadError(f"{stack}_scales holds the exponent byte {top}; MXFP4 scales 2^(e - 127) are read "
                                 f"for e in 0..{MAX_EXPONENT} (past that, scales of 2^120 that no model has, which the kernel's scale would "
                                 f"overflow)")
        prefix = stack.rpartition(".")[0]
        for e in range(experts):
            if stack.endswith("gate_up_proj"):  # gate rows even, up rows odd
                for leaf, half in (("gate_proj", 0), ("up_proj", 1)):
                    out[f"{prefix}.{e}.{leaf}.weight"] = (
                        functools.partial(_repacked, blocks, scales, e, half, 2), (width, hidden))
            else:
                out[f"{prefix}.{e}.down_proj.weight"] = (
                    functools.partial(_repacked, blocks, scales, e, 0, 1), (hidden, width))
    leftover = [n for n in tensors if n.endswith(("_blocks", "_scales")) and ".mlp.experts." in n]
    if leftover:
        raise ModelLoadError(f"{leftover[0]} has no blocks beside it")
    twice = sorted(n for n in tensors if n + "_blocks" in packed or n in out)
    if twice:
        raise ModelLoadError(f"{twice[0]} is stored twice: unpacked and as MXFP4 blocks")
    return out


def _repacked(blocks: torch.Tensor, scales: torch.Tensor, expert: int, first: int, step: int) -> torch.Tensor:
    return gguf_blocks(blocks[expert, first::step], scales[expert, first::step])
