"""Quantized layers that read the same input run as one qmatmul call: applied after the quantized layers are
in place, whether just converted or loaded from the cache."""
from __future__ import annotations

from quickdraft.models.quant_group import QuantGroup, QuantLinear
from quickdraft.models.transformer import Transformer


def fuse_quant_linears(model: Transformer) -> int:
    """Where every layer runs on the qmatmul kernel, make q/k/v one ``QuantGroup`` call per decoder layer and
    gate/up one call that also applies SwiGLU where the MLP uses it (fewer kernel calls and torch ops per token; the layers' tensors
    are shared, not copied). Returns the number of decoder layers fused."""
    fused = 0
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if attn.qkv_proj is not None:
            continue
        qkv, gate_up = [attn.q_proj, attn.k_proj, attn.v_proj], [mlp.gate_proj, mlp.up_proj]
        if not all(isinstance(m, QuantLinear) and m.backend == "qmatmul" for m in qkv + gate_up):
            continue
        attn.fuse(QuantGroup(qkv))
        swiglu = mlp.act == "silu"  # the kernel applies silu only; a GeGLU MLP takes [gate | up]
        mlp.fuse(QuantGroup(gate_up, swiglu=swiglu), activated=swiglu)
        fused += 1
    return fused
