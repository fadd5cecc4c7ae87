"""Quantized layers that read the same input run as one call: applied after the quantized layers are in place,
whether just converted or loaded from the cache."""
from __future__ import annotations

import torch
from torch import nn

from quickdraft.models import triton_linear
from quickdraft.models.feed_forward import MLP
from quickdraft.models.quant import Int4Linear, Int8Linear
from quickdraft.models.quant_group import QuantGroup, QuantLinear
from quickdraft.models.transformer import Transformer


def fuse_quant_linears(model: Transformer) -> int:
    """Make q/k/v one call per decoder layer and gate/up one call: where every layer runs on the qmatmul kernel, a
    ``QuantGroup`` (whose gate/up call also applies SwiGLU where the MLP uses it; the layers' tensors are shared, not
    copied); where every layer runs on Triton's kernel in one format, one layer of their weights stacked
    (``stacked``), gate/up's applying the activation too (``fuse_gated``). Fewer kernel calls and torch ops per
    token. Returns the number of decoder layers fused."""
    fused = 0
    for layer in model.model.layers:
        attn = layer.self_attn
        if attn.qkv_proj is not None:
            continue
        qkv = [attn.q_proj, attn.k_proj, attn.v_proj]
        mlps = [mlp for _, mlp in layer.feed_forwards()]  # the dense MLP, or each expert of a mixture
        gate_ups = [[mlp.gate_proj, mlp.up_proj] for mlp in mlps]
        if all(isinstance(m, QuantLinear) and m.backend == "qmatmul" for m in qkv + sum(gate_ups, [])):
            attn.fuse(QuantGroup(qkv))
            for mlp, gate_up in zip(mlps, gate_ups):
                swiglu = mlp.act == "silu"  # the kernel applies silu only; a GeGLU MLP takes [gate | up]
                mlp.fuse(QuantGroup(gate_up, swiglu=swiglu), activation="silu" if swiglu else None)
            fused += 1
            continue
        stacks = [stacked(qkv)] + [stacked(gate_up) for gate_up in gate_ups]
        if any(s is None for s in stacks):
            continue
        attn.fuse(stacks[0])
        for mlp, gate_up in zip(mlps, stacks[1:]):
            fuse_gated(mlp, gate_up)
        fused += 1
    return fused


def fuse_gated(mlp: MLP, gate_up: nn.Module) -> None:
    """``mlp``'s gate/up as ``gate_up`` (on Triton's kernel), which applies the activation in its last step where the
    kernel has it (``GatedProjection``: one launch a layer fewer); else ``triton_ops.gated`` runs after it."""
    if mlp.act in triton_linear.ACTIVATIONS:
        mlp.fuse(triton_linear.GatedProjection(gate_up, mlp.act), activation=mlp.act)
    else:
        mlp.fuse(gate_up)


def stacked(layers: list[nn.Module]) -> Int8Linear | Int4Linear | None:
    """One layer on Triton's kernel whose output is ``layers``' outputs side by side (their weights, scales and
    biases stacked), where all of them run there in one format (int8, or int4 of one group size); else None. On a
    GPU each call is one or two kernel launches, and a decode step is bound by its launches as much as by its
    bytes: q/k/v and gate/up as one call each save five calls a layer."""
    first = layers[0]
    if not all(type(m) is type(first) and getattr(m, "backend", None) == "triton"
               and m.float_output == first.float_output for m in layers):
        return None
    if isinstance(first, Int4Linear) and len({m.group_size for m in layers}) != 1:
        return None
    if not isinstance(first, (Int8Linear, Int4Linear)):
        return None
    bias = None
    if any(m.bias is not None for m in layers):
        dtype = next(m.bias.dtype for m in layers if m.bias is not None)
        bias = torch.cat([m.bias.to(dtype) if m.bias is not None else
                          torch.zeros(m.out_features, dtype=dtype, device=m.qweight.device) for m in layers])
    if isinstance(first, Int8Linear):
        out = Int8Linear(torch.cat([m.qweight for m in layers]), torch.cat([m.scales for m in layers]), bias,
                         kernel="triton")
    else:
        out = Int4Linear(torch.cat([m.int_weight() for m in layers]), torch.cat([m.scales for m in layers]),
                         torch.cat([m.zeros for m in layers]), first.group_size, bias, kernel="triton")
    out.float_output = first.float_output
    return out
