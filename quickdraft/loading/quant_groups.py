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
        attn = layer.self_attn
        if attn.qkv_proj is not None:
            continue
        qkv = [attn.q_proj, attn.k_proj, attn.v_proj]
        mlps = [mlp for _, mlp in layer.feed_forwards()]  # the dense MLP, or each expert of a mixture
        gate_ups = [[mlp.gate_proj, mlp.up_proj] for mlp in mlps]
        if not all(isinstance(m, QuantLinear) and m.backend == "qmatmul" for m in qkv + sum(gate_ups, [])):
            continue
        attn.fuse(QuantGroup(qkv))
        for mlp, gate_up in zip(mlps, gate_ups):
            swiglu = mlp.act == "silu"  # the kernel applies silu only; a GeGLU MLP takes [gate | up]
            mlp.fuse(QuantGroup(gate_up, swiglu=swiglu), activated=swiglu)
        fused += 1
    return fused
