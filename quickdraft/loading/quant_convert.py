"""Checkpoint tensors -> Int4Linear / Int8Linear layers in a built Transformer (``quantize_model``).

int4 from a GGUF: Q4_0, Q4_1 and Q4_K tensors are already affine int4 over 32-element (sub-)blocks
along the input dimension, exactly the kernel's ``(q - 8) * scale + zero`` with group size 32:

* Q4_0 ``d * (q - 8)``                -> scale ``d``,      zero ``0``
* Q4_1 ``d * q + m``                  -> scale ``d``,      zero ``m + 8 d``
* Q4_K ``d sc_j * q - dmin m_j``      -> scale ``d sc_j``, zero ``8 d sc_j - dmin m_j``

so their 4-bit values are taken as they are and only scale/zero are rounded to bfloat16 (the kernel's
scale dtype). Tensors the GGUF stores with more bits (Q5_*, Q6_K, Q8_0, F16, ...) become int8 by default
(``wide_sources='int8'``; ``'int4'`` requantizes them). Requantization (those, int8, other group sizes, HF
checkpoints) starts from the float32-dequantized GGUF weights, not from the possibly bfloat16 model weights:
round to nearest, per-channel absmax (int8) or per-group min/max (int4).
"""
from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

from quickdraft.config import ModelConfig
from quickdraft.errors import InvalidParameterError
from quickdraft.loading.gguf import single_thread
from quickdraft.models.quant import Int4Linear, Int8Linear
from quickdraft.models.quant_formats import INT4_GROUP_SIZES, quantize_int4, quantize_int8
from quickdraft.models.transformer import Transformer

log = logging.getLogger(__name__)

QUANT_FORMATS = ("int4", "int8")
LAYER_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                 "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def quantizable_linears(model: Transformer, lm_head: bool = False) -> dict[str, nn.Linear]:
    """HF-prefixed name (``model.layers.0.self_attn.q_proj``) -> nn.Linear to replace."""
    out: dict[str, nn.Linear] = {}
    for i, layer in enumerate(model.model.layers):
        for path in LAYER_LINEARS:
            mod = layer.get_submodule(path)
            if isinstance(mod, nn.Linear):
                out[f"model.layers.{i}.{path}"] = mod
    if lm_head and isinstance(model.lm_head, nn.Linear):  # a tied head gets its own copy; the embedding stays
        out["lm_head"] = model.lm_head
    return out


def set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    """Put ``module`` at the dotted ``name`` in ``model``, in place of what was there."""
    parent, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, attr, module)


# ---- GGUF int4 blocks -> (q, scale, zero) ------------------------------------------------------------------


def _as_bytes(raw: np.ndarray | torch.Tensor) -> torch.Tensor:
    """A tensor's raw block data as flat uint8, without a copy."""
    if isinstance(raw, torch.Tensor):
        return raw.detach().contiguous().reshape(-1).view(torch.uint8)
    arr = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only memmap: never written through
        return torch.from_numpy(arr)


def _f16(b: torch.Tensor) -> torch.Tensor:
    """Pairs of bytes read as float16, widened to float32."""
    return b.contiguous().view(torch.float16).float()


def _low_high(qs: torch.Tensor, group: int) -> torch.Tensor:
    """[n, c*group] bytes -> [n, c, 2, group]: low nibbles then high nibbles of each ``group`` bytes."""
    q = qs.reshape(qs.shape[0], -1, 1, group)
    return torch.cat((q & 0x0F, q >> 4), dim=2)


def gguf_int4_types() -> tuple:
    """The GGUF types that map exactly to int4 with group 32."""
    from gguf import GGMLQuantizationType as T

    return (T.Q4_0, T.Q4_1, T.Q4_K)


def gguf_int4_params(raw: np.ndarray | torch.Tensor, qtype: int, shape: tuple[int, int]
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Exact group-32 affine form of a Q4_0 / Q4_1 / Q4_K tensor: ``(q uint8 [N, K], scale, zero)`` with
    float32 ``[N, K // 32]`` scale/zero such that ``(q - 8) * scale + zero`` equals the GGUF dequantization
    (up to one float32 rounding in ``zero``). None for any other type."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

    try:
        qt = T(int(qtype))
    except ValueError:
        return None
    if qt not in gguf_int4_types():
        return None
    n, k = (int(s) for s in shape)
    block, type_size = GGML_QUANT_SIZES[qt]
    data = _as_bytes(raw)
    if k % block or data.numel() != n * k // block * type_size:
        raise ValueError(f"{qt.name} data of {data.numel()} bytes does not fit shape {(n, k)}")
    blocks = data.reshape(-1, type_size)
    nb = blocks.shape[0]
    if qt == T.Q4_0:
        q = _low_high(blocks[:, 2:], 16).reshape(nb, 32)
        scale = _f16(blocks[:, :2])
        zero = torch.zeros_like(scale)
    elif qt == T.Q4_1:
        q = _low_high(blocks[:, 4:], 16).reshape(nb, 32)
        scale = _f16(blocks[:, :2])
        zero = _f16(blocks[:, 2:4]) + 8.0 * scale
    else:  # Q4_K: 8 sub-blocks of 32 with 6-bit scales and mins
        d, dmin = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
        s = blocks[:, 4:16].reshape(nb, 3, 4)
        s0, s1, s2 = s[:, 0], s[:, 1], s[:, 2]
        sc = torch.cat((s0 & 0x3F, (s2 & 0x0F) | ((s0 >> 2) & 0x30)), dim=-1).float()
        mn = torch.cat((s1 & 0x3F, (s2 >> 4) | ((s1 >> 2) & 0x30)), dim=-1).float()
        q = _low_high(blocks[:, 16:], 32).reshape(nb * 8, 32)
        scale = (d * sc).reshape(-1, 1)
        zero = (8.0 * scale - (dmin * mn).reshape(-1, 1))
    return q.reshape(n, k), scale.reshape(n, k // 32), zero.reshape(n, k // 32)


def gguf_sources(path: str | os.PathLike) -> tuple[dict[str, Any], dict[str, int]]:
    """Raw block data (memory-mapped) and GGUF type of every tensor of a GGUF file, keyed by HF name,
    as stored in the file (llama/mistral q/k rows still in llama.cpp's permuted order)."""
    from quickdraft.loading.gguf import hf_name
    from quickdraft.loading.gguf_metadata import open_gguf

    reader = open_gguf(path)
    tensors, types = {}, {}
    for t in reader.tensors:
        name = hf_name(t.name)
        if name is not None:
            tensors[name], types[name] = t.data, int(t.tensor_type)
    return tensors, types


# ---- model conversion --------------------------------------------------------------------------------------


def _unpermute(name: str, cfg: ModelConfig) -> int | None:
    """Heads to unpermute rows with when the GGUF stores this tensor in llama.cpp's q/k order."""
    from quickdraft.loading.gguf import PERMUTED_ARCHITECTURES

    if cfg.architecture not in PERMUTED_ARCHITECTURES:
        return None
    if name.endswith("self_attn.q_proj"):
        return cfg.num_heads
    if name.endswith("self_attn.k_proj"):
        return cfg.num_kv_heads
    return None


def _float_source(name: str, linear: nn.Linear, cfg: ModelConfig, source_tensors: Mapping | None,
                  gguf_types: Mapping | None) -> torch.Tensor:
    """float32 weight in HF layout: dequantized GGUF data when given, else the float source, else the module's."""
    key = name + ".weight"
    if source_tensors is not None and key in source_tensors:
        src = source_tensors[key]
        if gguf_types is not None and key in gguf_types:
            from quickdraft.loading.dequant import dequantize
            from quickdraft.loading.gguf import unpermute_rows

            w = dequantize(src, gguf_types[key], _source_shape(name, linear, cfg))
            heads = _unpermute(name, cfg)
            return (unpermute_rows(w, heads) if heads else w)[:linear.out_features]
        return src.float()[:linear.out_features]
    return linear.weight.detach().float()


def _source_shape(name: str, linear: nn.Linear, cfg: ModelConfig) -> tuple[int, int]:
    """Shape of the stored tensor; an lm_head cut to its first rows (``restrict_lm_head``) keeps the full one."""
    return (cfg.vocab_size, linear.in_features) if name == "lm_head" else tuple(linear.weight.shape)


def _int4_params(name: str, linear: nn.Linear, cfg: ModelConfig, group_size: int, source_tensors: Mapping | None,
                 gguf_types: Mapping | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]:
    """(q, scale, zero, exact): exact when taken from the GGUF's own int4 blocks."""
    key = name + ".weight"
    if group_size == 32 and source_tensors is not None and gguf_types is not None and key in gguf_types:
        mapped = gguf_int4_params(source_tensors[key], gguf_types[key], _source_shape(name, linear, cfg))
        if mapped is not None:
            mapped = tuple(t[:linear.out_features] for t in mapped)
            heads = _unpermute(name, cfg)
            if heads:
                from quickdraft.loading.gguf import unpermute_rows

                mapped = tuple(unpermute_rows(t, heads) for t in mapped)
            return (*mapped, True)
    w = _float_source(name, linear, cfg, source_tensors, gguf_types)
    return (*quantize_int4(w, group_size), False)


def quantize_model(model: Transformer, fmt: str, source_tensors: dict | None = None, gguf_types: dict | None = None,
                   *, group_size: int = 32, lm_head: bool | str = False, wide_sources: str = "int8") -> Transformer:
    """Replace the decoder layers' nn.Linear (and ``lm_head`` when ``lm_head``) with
    Int4Linear / Int8Linear, in place; returns ``model``.

    ``source_tensors`` (HF names, ``...q_proj.weight``): with ``gguf_types`` (HF name -> GGML type id)
    the raw GGUF block data as stored in the file (see ``gguf_sources``), used for the exact Q4 mapping
    and otherwise dequantized to float32 for requantization; without ``gguf_types``, float tensors in
    HF layout to quantize from. Tensors not found there are quantized from the module's own weight.
    ``lm_head``: False keeps it; True or ``'int8'`` quantizes the lm_head to int8, ``'int4'`` to int4.
    ``wide_sources`` (int4 only): format for layers whose GGUF type has more than 4 bits (Q5_*, Q6_K, Q8_0,
    F16, ...): ``'int8'`` (default) keeps them in int8, ``'int4'`` requantizes them to int4. A Q4_K_M GGUF stores
    some layers as Q6_K: int8 there brings the perplexity close to bfloat16's at the same decode speed
    (docs/MEASUREMENTS.md, bench/quant_accuracy.py).
    """
    if wide_sources not in QUANT_FORMATS:
        raise InvalidParameterError(f"wide_sources must be 'int4' or 'int8', got {wide_sources!r}")
    if fmt not in QUANT_FORMATS:
        raise InvalidParameterError(f"quantized weight format must be one of {', '.join(QUANT_FORMATS)}, got {fmt!r}")
    if fmt == "int4" and group_size not in INT4_GROUP_SIZES:
        raise InvalidParameterError(f"int4 group size must be one of {INT4_GROUP_SIZES}, got {group_size}")
    cfg = model.config
    exact = 0
    head_fmt = lm_head_format(lm_head)
    linears = quantizable_linears(model, head_fmt is not None)
    for name, linear in linears.items():
        f = head_fmt if name == "lm_head" else fmt
        if f == "int4" and linear.in_features % group_size:
            raise InvalidParameterError(f"int4 group size {group_size} does not divide {name}'s in_features "
                                        f"{linear.in_features}; use one of {INT4_GROUP_SIZES} that does")
    counts = {"int4": 0, "int8": 0}
    with single_thread():
        for name, linear in linears.items():
            f = head_fmt if name == "lm_head" else fmt
            if f == "int4" and wide_sources == "int8" and name != "lm_head" and _is_wide(name, gguf_types):
                f = "int8"
            counts[f] += 1
            exact += _replace_one(model, name, linear, f, cfg, group_size, source_tensors, gguf_types)
    if fmt == "int4":
        log.info("int4: %d of %d linear layers mapped exactly from GGUF Q4 blocks, the rest requantized",
                 exact, len(linears))
    model.quant_info = {"format": fmt, "group_size": group_size if fmt == "int4" else None,
                        "exact_gguf_int4": exact, "layers": counts, "wide_sources": wide_sources,
                        "lm_head": head_fmt if "lm_head" in linears else None}
    return model


def lm_head_format(lm_head: bool | str | None) -> str | None:
    """The lm_head's quantized format from the ``lm_head`` option; None keeps it in the model dtype."""
    if lm_head is None or lm_head is False:
        return None
    if lm_head is True:
        return "int8"
    if lm_head in QUANT_FORMATS:
        return lm_head
    raise InvalidParameterError(f"lm_head must be False, True, 'int8' or 'int4', got {lm_head!r}")


def _is_wide(name: str, gguf_types: Mapping | None) -> bool:
    """The GGUF stores this weight with more than 4 bits (not Q4_0/Q4_1/Q4_K)."""
    if gguf_types is None or name + ".weight" not in gguf_types:
        return False
    return int(gguf_types[name + ".weight"]) not in {int(t) for t in gguf_int4_types()}


def _replace_one(model: Transformer, name: str, linear: nn.Linear, fmt: str, cfg: ModelConfig, group_size: int,
                 source_tensors: Mapping | None, gguf_types: Mapping | None) -> bool:
    """Swap one nn.Linear; True when its int4 values came exactly from GGUF Q4 blocks."""
    bias = None if linear.bias is None else linear.bias.detach()
    device = linear.weight.device
    is_exact = False
    if fmt == "int8":
        q, s = quantize_int8(_float_source(name, linear, cfg, source_tensors, gguf_types))
        new: nn.Module = Int8Linear(q.to(device), s.to(device), bias)
    else:
        q, s, z, is_exact = _int4_params(name, linear, cfg, group_size, source_tensors, gguf_types)
        new = Int4Linear(q.to(device), s.to(device), z.to(device), group_size, bias)
    set_module(model, name, new)
    return is_exact
