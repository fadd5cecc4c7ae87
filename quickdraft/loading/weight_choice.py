"""What ``weights='auto'`` runs a checkpoint in, and a one-line account of the kernels a loaded model runs.

``'auto'`` follows the file, judged by the GGML types of the decoder layers' linear weights
(``Checkpoint.tensor_types``, kept with the checkpoint, so nothing is read again):

* any stored in a type the qmatmul kernel reads (``block_formats.FORMATS``: Q4_0 .. Q8_0, the K-quants Q2_K .. Q6_K,
  IQ4_NL, IQ4_XS, the lattice IQ2_XXS .. IQ1_M, TQ1_0, TQ2_0, Q1_0, Q2_0, MXFP4) -> ``'gguf'``: every tensor runs
  in its own type, lm_head included, so a decode step reads the file's bytes (a tensor stored in a float type runs
  int8);
* without the kernel (no compiler, not x86-64): Q4_0 / Q4_1 / Q4_K -> ``'int4'`` (those blocks map exactly onto
  torch's int4 kernel, wider layers int8), any other quantized type -> ``'int8'``;
* else (F32 / F16 / BF16 GGUFs, HF directories) -> float weights in the model dtype.
"""
from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Iterable, Mapping

import torch

from quickdraft.config import ModelConfig
from quickdraft.loading.tensor_set import expected_shapes
from quickdraft.loading.quant_convert import INT4_TYPES, LAYER_LINEARS, layer_kernel
from quickdraft.models import qmatmul
from quickdraft.models.block_formats import FORMATS
from quickdraft.models.transformer import Transformer

FLOAT_TYPES = ("F32", "F16", "BF16", "F64")
# q/k/v/o, and gate/up/down of a dense MLP or of any expert of a mixture
_LAYER_LINEAR = re.compile(r"model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(experts\.\d+\.)?(gate|up|down)_proj)"
                           r"\.weight")


def layer_linear_types(tensor_types: Mapping[str, str] | None) -> Counter:
    """How many decoder-layer linear weights (q/k/v/o, gate/up/down) the file stores in each GGML type."""
    return Counter(t for name, t in (tensor_types or {}).items() if _LAYER_LINEAR.fullmatch(name))


def auto_format(tensor_types: Mapping[str, str] | None, kernels: bool | None = None) -> str | None:
    """The format ``'auto'`` runs a checkpoint with these tensor types in on CPU (see the module doc): ``'gguf'``,
    ``'int4'``, ``'int8'``, or None for float weights in the model dtype (also for None: no GGUF types).
    ``kernels``: whether quickdraft's quantized CPU kernel runs here; None builds it if need be, and sees."""
    types = layer_linear_types(tensor_types)
    if (qmatmul.available() if kernels is None else kernels) and any(t in FORMATS for t in types):
        return "gguf"
    if any(t in INT4_TYPES for t in types):
        return "int4"
    if any(t not in FLOAT_TYPES for t in types):
        return "int8"
    return None


def head_kernel(fmt: str | None, head_fmt: str | None, tensor_types: Mapping[str, str] | None) -> str | None:
    """The kernel of the lm_head of a model in ``fmt`` (None: float weights): ``head_fmt``, or with ``'gguf'`` the
    type the file stores it in (a tied head: the embedding's)."""
    if fmt is None or head_fmt is None:
        return None
    return layer_kernel("gguf", (tensor_types or {}).get("lm_head.weight")) if head_fmt == "gguf" else head_fmt


def planned_kernels(tensor_types: Mapping[str, str] | None, head_fmt: str | None, kernels: bool | None = None
                    ) -> dict[str, int] | None:
    """Linear layers per kernel that ``'auto'`` runs a file with these types on, read from the types alone (the
    rule of ``quantize_model`` with ``wide_sources='int8'``), the lm_head in ``head_fmt`` (``'gguf'`` in a ``'gguf'``
    model) included; None: float weights. ``kernels``: as ``auto_format``'s."""
    fmt = auto_format(tensor_types, kernels)
    if fmt is None:
        return None
    counts: Counter = Counter()
    for t, n in layer_linear_types(tensor_types).items():
        counts[layer_kernel(fmt, t)] += n
    head = head_kernel(fmt, "gguf" if fmt == "gguf" else head_fmt, tensor_types)
    if head is not None:
        counts[head] += 1
    return dict(counts.most_common())


def planned_kernel_bytes(shape: tuple[int, ...], kernel: str) -> int:
    """Bytes of an ``[N, K]`` linear on ``kernel`` (a GGML type, ``int4`` or ``int8``) in the qmatmul layout."""
    if kernel in FORMATS:
        return shape[0] * FORMATS[kernel].row_bytes(shape[1])
    bits = {"int4": 4, "int8": 8}.get(kernel)
    if bits is None:
        raise ValueError(f"no kernel named {kernel!r}")
    return qmatmul.packed_bytes(shape[0], shape[1], bits)


def planned_weight_bytes(cfg: ModelConfig, tensor_types: Mapping[str, str] | None, fmt: str | None,
                         head: str | None, dtype: torch.dtype, wide_sources: str = "int8", table: bool = True) -> int:
    """Bytes the weights of a model built in ``fmt`` (None: float weights in ``dtype``) will hold, from its config and
    the file's tensor types alone (before loading): linears in the qmatmul layout or in ``dtype``, the lm_head on
    the kernel ``head`` (a tied one as its own copy), the embedding table (unless ``table`` is False: its rows read
    from the file's blocks, ``quantize.embeds_from_blocks``), norms and biases in ``dtype``."""
    types = tensor_types or {}

    total = 0
    for name, shape in expected_shapes(cfg).items():
        if name == "model.embed_tokens.weight" and not table:
            continue
        if fmt is not None and _LAYER_LINEAR.fullmatch(name):
            total += planned_kernel_bytes(shape, layer_kernel(fmt, types.get(name), wide_sources))
        elif fmt is not None and head is not None and name == "lm_head.weight":
            total += planned_kernel_bytes(shape, head)
        else:
            total += math.prod(shape) * dtype.itemsize
    head_shape = (cfg.vocab_size, cfg.hidden_size)
    if cfg.tie_word_embeddings and fmt is None:  # packed float layers give the head its own copy
        total += math.prod(head_shape) * dtype.itemsize
    elif cfg.tie_word_embeddings and head is not None:
        total += planned_kernel_bytes(head_shape, head)
    return total


def kernel_sources(model: Transformer, names: Iterable[str], tensor_types: Mapping[str, str] | None,
                   fallback: str) -> dict[str, dict[str, int]]:
    """Kernel -> {how the file stores the tensor: count} over the quantized linears ``names`` (HF module names) of
    ``model``, read before they are grouped; the lm_head's entry says so. ``fallback`` names the source of a
    tensor the GGUF types do not cover (an HF checkpoint)."""
    out: dict[str, dict[str, int]] = {}
    for name in names:
        kernel = getattr(model.get_submodule(name), "kernel_name", None)  # quantized layers name their kernel
        if kernel is None:
            continue
        label = (tensor_types or {}).get(name + ".weight", fallback) + (" lm_head" if name == "lm_head" else "")
        sources = out.setdefault(kernel, {})
        sources[label] = sources.get(label, 0) + 1
    return dict(sorted(out.items()))


def describe_kernels(kernels: Mapping[str, Mapping[str, int]], note: str = "") -> str:
    """``'weights: int4 kernels for 210 tensors (Q4_1), int8 for 1 (Q8_0 lm_head)'`` from ``kernel_sources``."""
    parts = []
    for kernel, sources in kernels.items():
        total = sum(sources.values())
        shown = next(iter(sources)) if len(sources) == 1 else ", ".join(
            f"{n} {label}" if n > 1 else label for label, n in sorted(sources.items(), key=lambda kv: -kv[1]))
        count = f"{kernel} kernels for {total} tensor{'s' if total != 1 else ''}" if not parts else f"{kernel} for {total}"
        parts.append(f"{count} ({shown}{note})")
    return "weights: " + ", ".join(parts)


def describe_float(tensor_types: Mapping[str, str] | None, num_layers: int, dtype_name: str, source: str) -> str:
    """The account of float weights: the kernels' dtype, over how the file stores the linears (``source`` for an
    HF checkpoint), marked when they were dequantized."""
    layers = layer_linear_types(tensor_types)
    head = (tensor_types or {}).get("lm_head.weight")
    if not layers:  # no GGUF types: every linear, the lm_head included, comes from ``source``
        return describe_kernels({dtype_name: {source: len(LAYER_LINEARS) * num_layers + 1}})
    sources: dict[str, int] = dict(layers)
    if head is not None:
        sources[head + " lm_head"] = 1
    quantized = any(t not in FLOAT_TYPES for t in (*layers, head) if t is not None)
    return describe_kernels({dtype_name: sources}, "; dequantized" if quantized else "")
