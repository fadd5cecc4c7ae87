"""Float weights at load time: packed linear layers, with q/k/v and gate/up as one projection each.

Only the float formats of ``load_model`` come here; the quantized ones are grouped by ``quant_groups.py``.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from quickdraft.errors import InvalidParameterError
from quickdraft.loading.quant_convert import layer_linears, quantizable_linears
from quickdraft.loading.quant_groups import fuse_gated
from quickdraft.models import triton_linear
from quickdraft.models.packed import PackedLinear, RowTiledLinear, packing_supported
from quickdraft.models.transformer import Transformer

GPU_LINEARS = ("cublas", "triton")  # what a GPU's bfloat16 decoder-layer linears run on


def pack_float_linears(model: Transformer, tensors: Mapping[str, torch.Tensor] | None = None) -> list[str]:
    """Give every decoder-layer linear and the lm_head (a tied one gets its own copy) oneDNN's packed layout
    where it runs (CPU, float32/bfloat16): row-independent results and faster short calls (see
    models/packed.py); q/k/v and gate/up become one packed projection each. Returns the HF names of the
    replaced linears (none where packing does not run or the model is already packed).

    ``tensors``: where the weights of linears left on the meta device (``build_model``'s ``skip``) come from, read a
    layer at a time just before that layer is packed, so the float weights never exist whole beside packed ones."""
    weight = model.model.embed_tokens.weight
    names = list(quantizable_linears(model, lm_head=True))
    if not packing_supported(weight.dtype, weight.device) or isinstance(model.lm_head, PackedLinear):
        _fill(model, tensors, [n for n in names if n != "lm_head"])  # plain float weights, all of them
        if weight.device.type != "cpu" and not isinstance(model.lm_head, PackedLinear):
            _concatenate(model, tiled=weight.dtype == torch.float32)
        return []
    for i, layer in enumerate(model.model.layers):
        _fill(model, tensors, [f"model.layers.{i}.{path}" for path in layer_linears(layer)])
        attn = layer.self_attn
        parts = [attn.q_proj, attn.k_proj, attn.v_proj]
        bias = None if parts[0].bias is None else torch.cat([p.bias for p in parts])
        attn.fuse(PackedLinear(torch.cat([p.weight for p in parts]), bias))
        attn.o_proj = PackedLinear.from_linear(attn.o_proj)
        for _, mlp in layer.feed_forwards():
            bias = None if mlp.gate_proj.bias is None else torch.cat([mlp.gate_proj.bias, mlp.up_proj.bias])
            mlp.fuse(PackedLinear(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]), bias))
            mlp.down_proj = PackedLinear.from_linear(mlp.down_proj)
    model.lm_head = PackedLinear.from_linear(model.lm_head)
    return names


def check_gpu_linears(choice: str, device: str) -> None:
    """``gpu_linears``: one of ``GPU_LINEARS``; ``'triton'`` needs a CUDA device with Triton."""
    if choice not in GPU_LINEARS:
        raise InvalidParameterError(f"gpu_linears must be one of {', '.join(GPU_LINEARS)}, got {choice!r}")
    if choice == "triton" and not (str(device).startswith("cuda") and triton_linear.triton_available()):
        raise InvalidParameterError(f"gpu_linears='triton' needs device='cuda' and Triton (pip install triton), got "
                                    f"device={device!r}")


def triton_float_linears(model: Transformer, max_rows: int) -> int:
    """Every decoder layer's bfloat16 linears (q/k/v, o, gate/up, down) on Triton's kernel (``TritonLinear``, for
    calls of up to ``max_rows`` rows) instead of cuBLAS, which reads some mid-sized weights at a decode step's one
    row well under the copy bandwidth; gate/up applies the MLP's activation in the kernel where it can
    (``fuse_gated``); the head stays on cuBLAS. Returns how many linears were wrapped."""
    wrapped = 0
    for layer in model.model.layers:
        attn = layer.self_attn
        for owner, name in [(attn, "qkv_proj"), (attn, "o_proj")] + [
                (mlp, part) for _, mlp in layer.feed_forwards() for part in ("gate_up_proj", "down_proj")]:
            linear = getattr(owner, name, None)
            if type(linear) is nn.Linear and linear.weight.dtype == torch.bfloat16:
                on_kernel = triton_linear.TritonLinear(linear, max_rows)
                if name == "gate_up_proj" and not owner.activated:
                    fuse_gated(owner, on_kernel)
                else:
                    setattr(owner, name, on_kernel)
                wrapped += 1
    return wrapped


def _concatenate(model: Transformer, tiled: bool) -> None:
    """Off CPU (plain torch linears): q/k/v and gate/up as one linear each, whose weight is the concatenation of theirs.
    A GPU decode step of a small model is bound by kernel launches, not by reading weights: three GEMMs and their
    bias adds become one call, two GEMMs one. ``tiled`` (float32): every linear runs in fixed row tiles, so a row's
    result does not depend on the rows beside it (``RowTiledLinear``)."""
    wrap = RowTiledLinear if tiled else (lambda linear: linear)
    for layer in model.model.layers:
        attn = layer.self_attn
        attn.fuse(wrap(_concatenated([attn.q_proj, attn.k_proj, attn.v_proj])))
        attn.o_proj = wrap(attn.o_proj)
        for _, mlp in layer.feed_forwards():
            mlp.fuse(wrap(_concatenated([mlp.gate_proj, mlp.up_proj])))
            mlp.down_proj = wrap(mlp.down_proj)
    model.lm_head = wrap(model.lm_head)


def _concatenated(parts: list[nn.Linear]) -> nn.Linear:
    weight = torch.cat([p.weight for p in parts])
    has_bias = parts[0].bias is not None
    out = nn.Linear(weight.shape[1], weight.shape[0], bias=has_bias, device="meta")
    out.weight = nn.Parameter(weight, requires_grad=False)
    if has_bias:
        out.bias = nn.Parameter(torch.cat([p.bias for p in parts]), requires_grad=False)
    return out


def _fill(model: Transformer, tensors: Mapping[str, torch.Tensor] | None, names: list[str]) -> None:
    """Give the linears ``names`` that are still meta placeholders their weights from ``tensors``."""
    device = model.model.embed_tokens.weight.device
    for name in names:
        linear = model.get_submodule(name)
        if linear.weight.is_meta:
            linear.weight = nn.Parameter(tensors[name + ".weight"].to(device), requires_grad=False)
