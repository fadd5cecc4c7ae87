"""Quantized execution: swap a built Transformer's linear layers for Int4Linear / Int8Linear.

Entry points:

* ``resolve_weights(weights, device)``: ``'auto' | 'int4' | 'int8' | 'bfloat16' | 'float32'`` -> the format to run.
* ``quantize_checkpoint(model, checkpoint, fmt)``: what ``LLM`` calls after ``build_model``; uses the
  GGUF's own int4 blocks where they map exactly, caches the result on disk, returns the model.
* ``quantize_model(model, fmt, source_tensors, gguf_types)``: the in-memory conversion itself.

What is quantized: q/k/v/o and gate/up/down of every decoder layer, and ``lm_head`` when asked for
(by default int8). A tied ``lm_head`` gets its own int8 copy and the embedding table stays in the model
dtype: besides halving the bytes a decode step reads for the head, the packed kernels compute each row
independently of how many rows are in the batch, while dense bfloat16 ``F.linear`` with a 1536-wide input
does not, so a dense head would give a k-token verify pass other logits than k single steps and flip
greedy near-ties. Embeddings, norms and biases stay in the model dtype (biases are added after the
quantized matmul).

int4 from a GGUF: Q4_0, Q4_1 and Q4_K tensors are already affine int4 over 32-element (sub-)blocks
along the input dimension, exactly the kernel's ``(q - 8) * scale + zero`` with group size 32:

* Q4_0 ``d * (q - 8)``                -> scale ``d``,      zero ``0``
* Q4_1 ``d * q + m``                  -> scale ``d``,      zero ``m + 8 d``
* Q4_K ``d sc_j * q - dmin m_j``      -> scale ``d sc_j``, zero ``8 d sc_j - dmin m_j``

so their 4-bit values are taken as they are and only scale/zero are rounded to bfloat16 (the kernel's
scale dtype). Tensors the GGUF stores with more bits (Q5_*, Q6_K, Q8_0, F16, ...) become int8 by default
(``wide_sources='int8'``; ``'int4'`` requantizes them), as does the lm_head (``lm_head='int8'``).
Requantization (those, int8, other group sizes, HF checkpoints) starts from the float32-dequantized GGUF
weights, not from the possibly bfloat16 model weights: round to nearest, per-channel absmax (int8) or
per-group min/max (int4).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from quickdraft.errors import InvalidParameterError
from quickdraft.models.quant import (
    INT4_GROUP_SIZES,
    Int4Linear,
    Int8Linear,
    QuantGroup,
    QuantLinear,
    cpu_capability,
    default_backend,
    quantize_int4,
    quantize_int8,
)
from quickdraft.models.packed import PackedLinear, packing_supported
from quickdraft.models.transformer import Transformer
from quickdraft.loading.gguf import single_thread
from quickdraft.loading.weight_cache import write_atomic

log = logging.getLogger(__name__)

WEIGHT_FORMATS = ("auto", "int4", "int8", "bfloat16", "float32")
QUANT_FORMATS = ("int4", "int8")
FLOAT_FORMATS = {"bfloat16": torch.bfloat16, "float32": torch.float32}
LAYER_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                 "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
# Bump when the quantization (rounding, mapping, stored layout) changes.
QUANT_CACHE_VERSION = "5"
# lm_head (tied or not) in quantize_checkpoint: int8 (see bench/quant_accuracy.py for the trade-off).
DEFAULT_LM_HEAD: bool | str = "int8"


def resolve_weights(weights: str, device: str = "cpu") -> str:
    """The weight format to run: ``'int4'``, ``'int8'``, ``'bfloat16'`` or ``'float32'``.

    ``'auto'``: ``'int4'`` on CPU (the fastest 1-token decode step measured, see bench/quant_accuracy.py),
    ``'bfloat16'`` elsewhere (the quantized layers only have a slow dequantize fallback off CPU)."""
    if not isinstance(weights, str) or weights not in WEIGHT_FORMATS:
        raise InvalidParameterError(f"weights must be one of {', '.join(WEIGHT_FORMATS)}, got {weights!r}")
    if weights == "auto":
        return "int4" if str(device).startswith("cpu") else "bfloat16"
    return weights


def resolve_draft_weights(draft_weights: str, target_format: str, cfg, device: str = "cpu") -> str:
    """The weight format of a draft model. A draft only has to be cheap: the target verifies every token it
    proposes, so its precision never changes the output, only the acceptance rate.

    ``'auto'``: ``'int4'`` on CPU when every linear's input width is a multiple of the int4 group (a 1-token
    int4 step of Qwen2.5-Coder-0.5B took 35-40 ms on a 2-core AVX512-BF16 EPYC against 85-90 ms in bfloat16;
    bench/speculative.py compares the two drafts end to end), else the target's format."""
    if draft_weights == "auto":
        widths = (cfg.hidden_size, cfg.intermediate_size, cfg.num_heads * cfg.head_dim)
        fits = all(w % INT4_GROUP_SIZES[0] == 0 for w in widths)
        return "int4" if str(device).startswith("cpu") and fits else target_format
    return resolve_weights(draft_weights, device)


# Options quantize_checkpoint gets for an int4 draft: every layer int4, the lm_head included (a draft
# needs speed, not the last 0.1% of perplexity; see resolve_draft_weights)
DRAFT_INT4_OPTIONS = {"wide_sources": "int4", "lm_head": "int4"}


# ---- GGUF int4 blocks -> (q, scale, zero) ------------------------------------------------------------------


def _as_bytes(raw: np.ndarray | torch.Tensor) -> torch.Tensor:
    if isinstance(raw, torch.Tensor):
        return raw.detach().contiguous().reshape(-1).view(torch.uint8)
    arr = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only memmap: never written through
        return torch.from_numpy(arr)


def _f16(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.float16).float()


def _low_high(qs: torch.Tensor, group: int) -> torch.Tensor:
    """[n, c*group] bytes -> [n, c, 2, group]: low nibbles then high nibbles of each ``group`` bytes."""
    q = qs.reshape(qs.shape[0], -1, 1, group)
    return torch.cat((q & 0x0F, q >> 4), dim=2)


def gguf_int4_types() -> tuple:
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


def _set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, attr, module)


def _unpermute(name: str, cfg) -> int | None:
    """Heads to unpermute rows with when the GGUF stores this tensor in llama.cpp's q/k order."""
    from quickdraft.loading.gguf import PERMUTED_ARCHITECTURES

    if cfg.architecture not in PERMUTED_ARCHITECTURES:
        return None
    if name.endswith("self_attn.q_proj"):
        return cfg.num_heads
    if name.endswith("self_attn.k_proj"):
        return cfg.num_kv_heads
    return None


def _float_source(name: str, linear: nn.Linear, cfg, source_tensors: Mapping | None,
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


def _source_shape(name: str, linear: nn.Linear, cfg) -> tuple[int, int]:
    """Shape of the stored tensor; an lm_head cut to its first rows (``restrict_lm_head``) keeps the full one."""
    return (cfg.vocab_size, linear.in_features) if name == "lm_head" else tuple(linear.weight.shape)


def restrict_lm_head(model: Transformer, rows: int) -> None:
    """Keep only the first ``rows`` rows of the lm_head (an own copy when tied; the embedding stays whole).

    For a draft model (FR-Spec style): it then proposes only among the first ``rows`` token ids, which in a
    byte-level BPE vocabulary are the earliest, i.e. most frequent, merges, and its head reads that much less
    per step. The target still verifies over the full vocabulary, so the output does not change; a sampled
    draft's q is its distribution renormalised over those ids (0 elsewhere), which the verifier handles."""
    vocab = model.config.vocab_size
    if isinstance(rows, bool) or not isinstance(rows, int) or not 1 <= rows <= vocab:
        raise InvalidParameterError(f"draft_vocab must be an int in 1..{vocab} (the draft's vocabulary), got {rows!r}")
    if rows == model.lm_head.out_features:
        return
    head = model.lm_head
    cut = nn.Linear(head.in_features, rows, bias=head.bias is not None, device="meta")
    cut.weight = nn.Parameter(head.weight.detach()[:rows].clone(), requires_grad=False)
    if head.bias is not None:
        cut.bias = nn.Parameter(head.bias.detach()[:rows].clone(), requires_grad=False)
    model.lm_head = cut


def _int4_params(name: str, linear: nn.Linear, cfg, group_size: int, source_tensors: Mapping | None,
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
    F16, ...): ``'int8'`` (default) keeps them in int8, ``'int4'`` requantizes them to int4. On Qwen2.5-Coder-1.5B
    (Q4_K_M: ffn_down/attn_v of half the layers are Q6_K) int8 there took perplexity from +1.4% to +0.1% over
    bfloat16 at the same decode speed (bench/quant_accuracy.py).
    """
    if wide_sources not in QUANT_FORMATS:
        raise InvalidParameterError(f"wide_sources must be 'int4' or 'int8', got {wide_sources!r}")
    if fmt not in QUANT_FORMATS:
        raise InvalidParameterError(f"quantized weight format must be one of {', '.join(QUANT_FORMATS)}, got {fmt!r}")
    if fmt == "int4" and group_size not in INT4_GROUP_SIZES:
        raise InvalidParameterError(f"int4 group size must be one of {INT4_GROUP_SIZES}, got {group_size}")
    cfg = model.config
    exact = 0
    head_fmt = _lm_head_format(lm_head)
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


def _is_wide(name: str, gguf_types: Mapping | None) -> bool:
    """The GGUF stores this weight with more than 4 bits (not Q4_0/Q4_1/Q4_K)."""
    if gguf_types is None or name + ".weight" not in gguf_types:
        return False
    return int(gguf_types[name + ".weight"]) not in {int(t) for t in gguf_int4_types()}


def _lm_head_format(lm_head: bool | str | None) -> str | None:
    if lm_head is None or lm_head is False:
        return None
    if lm_head is True:
        return "int8"
    if lm_head in QUANT_FORMATS:
        return lm_head
    raise InvalidParameterError(f"lm_head must be False, True, 'int8' or 'int4', got {lm_head!r}")


def _replace_one(model: Transformer, name: str, linear: nn.Linear, fmt: str, cfg, group_size: int,
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
    _set_module(model, name, new)
    return is_exact


# ---- on-disk cache -----------------------------------------------------------------------------------------


def _layout(device: torch.device) -> str:
    """Storage layout tag of the quantized layers on ``device``: the qmatmul kernel's own layout, or torch's int4pack
    packing (which depends on the ISA and possibly the torch version), or portable nibbles off CPU."""
    backend = default_backend(device)
    if backend == "qmatmul":
        return "qmatmul-v2"
    if backend == "torch":
        return f"cpu-{cpu_capability()}-torch{torch.__version__.split('+')[0]}"
    return "nibbles"


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


def fuse_quant_linears(model: Transformer) -> int:
    """Where every layer runs on the qmatmul kernel, make q/k/v one ``QuantGroup`` call per decoder layer and
    gate/up one call that also applies SwiGLU (fewer kernel calls and torch ops per token; the layers' tensors
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
        mlp.fuse(QuantGroup(gate_up, swiglu=True), activated=True)
        fused += 1
    return fused


def _release(checkpoint, names: list[str]) -> None:
    """Drop replaced weights from ``checkpoint.tensors`` so they can be freed."""
    for name in names:
        checkpoint.tensors.pop(name + ".weight", None)


def quant_cache_path(fingerprint: str, fmt: str, group_size: int, lm_head: str | None, source: str,
                     device: torch.device | str = "cpu", *, wide_sources: str = "int8",
                     head_rows: int | None = None) -> Path:
    """Cache entry for one source + format: under ``cache_root()/quantized/``."""
    from quickdraft.loading.weight_cache import cache_root

    device = torch.device(device)
    layout = _layout(device)
    key = f"{fingerprint}|{fmt}|g{group_size}|lm-{lm_head}|wide-{wide_sources}|{source}|{layout}" \
          f"|v{QUANT_CACHE_VERSION}" + (f"|head-rows-{head_rows}" if head_rows is not None else "")
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    tag = f"{fmt}-g{group_size}" if fmt == "int4" else fmt
    return cache_root() / "quantized" / f"{fingerprint}-{tag}-{digest}.safetensors"


def _module_tensors(name: str, mod: nn.Module) -> dict[str, torch.Tensor]:
    """The tensors a quantized layer is cached as: each kernel's own layout, loaded back without conversion."""
    if mod.backend == "qmatmul":
        return {f"{name}.kweight": mod.kweight, f"{name}.kscales": mod.kscales}
    if isinstance(mod, Int8Linear):
        return {f"{name}.qweight": mod.qweight, f"{name}.scales": mod.scales}
    assert isinstance(mod, Int4Linear)
    if mod.backend == "torch":
        return {f"{name}.packed": mod.packed, f"{name}.scales_and_zeros": mod.scales_and_zeros}
    return {f"{name}.qweight": mod.qweight, f"{name}.scales": mod.scales.contiguous(),
            f"{name}.zeros": mod.zeros.contiguous()}


def store_quantized(path: Path, model: Transformer, meta: dict[str, str]) -> Path | None:
    """Write the quantized layers' tensors atomically; None when the cache cannot be written."""
    tensors: dict[str, torch.Tensor] = {}
    kinds: dict[str, str] = {}
    for name, mod in model.named_modules():
        if isinstance(mod, (Int4Linear, Int8Linear)):
            tensors.update({k: v.detach().cpu().contiguous() for k, v in _module_tensors(name, mod).items()})
            kinds[name] = "int4" if isinstance(mod, Int4Linear) else "int8"
    return write_atomic(path, tensors, {**meta, "modules": json.dumps(kinds)}, "quantized weight cache")


def load_quantized(path: Path, model: Transformer, meta: dict[str, str], group_size: int) -> bool:
    """Swap in the cached quantized layers; False (and the damaged entry removed) on a miss or mismatch."""
    if not path.is_file():
        return False
    try:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            stored = f.metadata() or {}
            if any(stored.get(k) != v for k, v in meta.items()):
                raise ValueError("metadata does not match the source")
            kinds: dict[str, str] = json.loads(stored["modules"])
            keys = set(f.keys())
            new: dict[str, nn.Module] = {}
            for name, kind in kinds.items():
                old = model.get_submodule(name)
                if not isinstance(old, nn.Linear):
                    raise ValueError(f"{name} is not an nn.Linear in the model")
                bias = None if old.bias is None else old.bias.detach()
                device = old.weight.device
                out_f, in_f = old.weight.shape
                if f"{name}.kweight" in keys and device.type == "cpu":
                    cls = Int8Linear if kind == "int8" else Int4Linear
                    mod: nn.Module = cls.from_kernel_tensors(f.get_tensor(f"{name}.kweight"),
                                                             f.get_tensor(f"{name}.kscales"), in_f, bias)
                elif kind == "int8":
                    mod = Int8Linear(f.get_tensor(f"{name}.qweight").to(device),
                                                f.get_tensor(f"{name}.scales").to(device), bias)
                elif f"{name}.packed" in keys and device.type == "cpu":
                    mod = Int4Linear.from_packed(f.get_tensor(f"{name}.packed"),
                                                 f.get_tensor(f"{name}.scales_and_zeros"), group_size, in_f, out_f,
                                                 bias)
                else:
                    from quickdraft.models.quant import unpack_nibbles

                    q = unpack_nibbles(f.get_tensor(f"{name}.qweight")).to(device)
                    s, z = f.get_tensor(f"{name}.scales").to(device), f.get_tensor(f"{name}.zeros").to(device)
                    mod = Int4Linear(q, s, z, group_size, bias)
                if (mod.out_features, mod.in_features) != (out_f, in_f):
                    raise ValueError(f"{name}: cached shape {(mod.out_features, mod.in_features)} != {(out_f, in_f)}")
                new[name] = mod
        for name, mod in new.items():
            _set_module(model, name, mod)
        model.quant_info = json.loads(stored.get("info", "{}"))
        return True
    except Exception as exc:
        log.warning("ignoring damaged quantized weight cache %s (%s: %s); rebuilding", path, type(exc).__name__, exc)
        try:
            path.unlink()
        except OSError:
            pass
        return False


def quantize_checkpoint(model: Transformer, checkpoint, fmt: str, *, group_size: int = 32,
                        lm_head: bool | str | None = None, wide_sources: str = "int8", use_cache: bool = True,
                        release: bool = True) -> Transformer:
    """Quantize a model built from ``checkpoint`` (``build_model(checkpoint.config, checkpoint.tensors, device)``)
    to ``fmt`` (``'int4'``/``'int8'``; ``'bfloat16'``/``'float32'``/``'float16'`` keep float weights, packed for
    oneDNN on CPU by ``pack_float_linears``)
    and return it.

    * GGUF sources: Q4_0/Q4_1/Q4_K tensors map exactly to int4 (group 32); with ``wide_sources='int8'``
      (default) tensors stored with more bits become int8, else they are requantized to int4, from the
      float32-dequantized GGUF data (not from the possibly bfloat16 model weights).
    * ``group_size``: int4 group (32, 64, 128); only 32 maps GGUF Q4 blocks exactly.
    * ``lm_head``: the lm_head's format: False (keep the model dtype), ``'int8'``/True or ``'int4'``;
      None: ``DEFAULT_LM_HEAD`` (see bench/quant_accuracy.py for the trade-off). A tied lm_head becomes a
      quantized copy; the embedding table keeps the model dtype.
    * ``use_cache``: keep the result under ``cache_root()/quantized/`` keyed by the checkpoint fingerprint,
      format and options, source precision and the layout of the backend the layers run on (``_layout``: the
      qmatmul kernel's, or torch's ISA-dependent int4pack layout with the torch version), so an entry is only
      reused where the same kernel runs.
    * On the qmatmul kernel, q/k/v and gate/up of each decoder layer become one ``QuantGroup`` call each
      (``fuse_quant_linears``).
    * ``release``: drop the replaced float weights from ``checkpoint.tensors`` so they can be freed.
    """
    if fmt in FLOAT_FORMATS or fmt == "float16":  # float weights (LLM passes its dtype name)
        packed = pack_float_linears(model)
        if release:
            _release(checkpoint, packed)
        return model
    if fmt not in QUANT_FORMATS:
        raise InvalidParameterError(f"weights format must be one of {', '.join(QUANT_FORMATS + tuple(FLOAT_FORMATS))}, "
                                    f"got {fmt!r}")
    head_fmt = _lm_head_format(DEFAULT_LM_HEAD if lm_head is None else lm_head)
    is_gguf = getattr(checkpoint, "gguf_metadata", None) is not None and Path(checkpoint.source).is_file()
    device = model.model.embed_tokens.weight.device
    source = "gguf" if is_gguf else str(model.model.embed_tokens.weight.dtype).removeprefix("torch.")
    names = list(quantizable_linears(model, head_fmt is not None))
    # an lm_head cut by restrict_lm_head (a draft's) is cached apart from the whole one
    head_rows = model.lm_head.out_features if model.lm_head.out_features != model.config.vocab_size else None
    path = quant_cache_path(checkpoint.fingerprint, fmt, group_size, head_fmt, source, device,
                            wide_sources=wide_sources, head_rows=head_rows)
    meta = {"fingerprint": checkpoint.fingerprint, "format": fmt, "group_size": str(group_size),
            "lm_head": str(head_fmt), "wide_sources": wide_sources, "source": source, "layout": _layout(device),
            "quickdraft_quant_cache_version": QUANT_CACHE_VERSION}
    if head_rows is not None:
        meta["head_rows"] = str(head_rows)
    with single_thread():
        hit = use_cache and load_quantized(path, model, meta, group_size)
    if not hit:
        sources, types = gguf_sources(checkpoint.source) if is_gguf else (None, None)
        quantize_model(model, fmt, sources, types, group_size=group_size, lm_head=head_fmt or False,
                       wide_sources=wide_sources)
        del sources, types
        if use_cache:
            store_quantized(path, model, {**meta, "info": json.dumps(model.quant_info)})
    if release:
        _release(checkpoint, names)
    fuse_quant_linears(model)
    return model
