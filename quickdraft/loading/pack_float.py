"""Float weights at load time: packed linear layers, with q/k/v and gate/up as one projection each.

Only the float formats of ``quantize_checkpoint`` come here; the quantized ones are grouped by ``quant_groups.py``.
"""
from __future__ import annotations

import torch

from quickdraft.loading.quant_convert import quantizable_linears
from quickdraft.models.packed import PackedLinear, packing_supported
from quickdraft.models.transformer import Transformer


def pack_float_linears(model: Transformer) -> list[str]:
    """Give every decoder-layer linear and the lm_head (a tied one gets its own copy) oneDNN's packed layout
    where it runs (CPU, float32/bfloat16): row-independent results and faster short calls (see
    models/packed.py); q/k/v and gate/up become one packed projection each. Returns the HF names of the
    replaced linears (none where packing does not run or the model is already packed)."""
    weight = model.model.embed_tokens.weight
    if not packing_supported(weight.dtype, weight.device) or isinstance(model.lm_head, PackedLinear):
        return []
    names = list(quantizable_linears(model, lm_head=True))
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        parts = [attn.q_proj, attn.k_proj, attn.v_proj]
        bias = None if parts[0].bias is None else torch.cat([p.bias for p in parts])
        attn.fuse(PackedLinear(torch.cat([p.weight for p in parts]), bias))
        attn.o_proj = PackedLinear.from_linear(attn.o_proj)
        mlp.fuse(PackedLinear(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])))
        mlp.down_proj = PackedLinear.from_linear(mlp.down_proj)
    model.lm_head = PackedLinear.from_linear(model.lm_head)
    return names
