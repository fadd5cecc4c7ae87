"""Quantized execution: the weight formats and what ``LLM`` calls to put a built Transformer in one.

Entry points:

* ``resolve_weights(weights, device, tensor_types)``: ``'auto' | 'gguf' | 'int4' | 'int8' | 'bfloat16' | 'float32'``
  -> the format to run (``'auto'`` follows the file, see ``weight_choice.py``).
* ``resolve_draft_weights(draft_weights, target_format, cfg, device)``: the same for a draft model.
* ``load_model(checkpoint, fmt, device)``: the model in that format, built a tensor at a time; uses the GGUF's own
  blocks (every type in ``'gguf'``, Q4 blocks as int4 in ``'int4'``; ``quant_convert.py``), converts into the
  on-disk cache and runs mapped from it (``quant_cache.py``). Float formats get packed linear layers instead
  (``pack_float.py``).
* ``restrict_lm_head(model, rows)``: a draft's lm_head cut to the most frequent tokens.
* ``weights_summary(model, checkpoint, weights)``: the one line that says which kernels a loaded model runs;
  ``file_defaults(path)``: what ``'auto'`` runs a GGUF file on, from its header alone.

What is quantized: q/k/v/o and gate/up/down of every decoder layer, and ``lm_head`` (by default in the file's own
type in ``'gguf'``, int8 in ``'int4'``/``'int8'``). A tied ``lm_head`` gets its own quantized copy and the embedding
table stays in the model dtype: besides the bytes a decode step reads for the head, the packed kernels compute each row
independently of how many rows are in the batch, while dense bfloat16 ``F.linear`` with a 1536-wide input
does not, so a dense head would give a k-token verify pass other logits than k single steps and flip
greedy near-ties. Embeddings, norms and biases stay in the model dtype (biases are added after the
quantized matmul).
"""
from __future__ import annotations

import functools
import math
import reprlib
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from torch import nn

from quickdraft.config import ModelConfig
from quickdraft.errors import InvalidParameterError, QuickdraftError
from quickdraft.loading.checkpoint import Checkpoint
from quickdraft.loading.gguf import hf_tensor_types, rows_reader
from quickdraft.loading.gguf_families import is_stacked
from quickdraft.loading.gguf_metadata import int_value, read_header, tensor_shapes, tensor_types as gguf_tensor_types
from quickdraft.loading.pack_float import pack_float_linears
from quickdraft.loading.quant_cache import install_quantized, open_quantized, quant_cache_entry, write_quantized
from quickdraft.loading.quant_convert import (
    EMBED,
    QUANT_FORMATS,
    Sources,
    layer_kernel,
    lm_head_format,
    quant_info,
    quantizable_linears,
    quantize_model,
    quantized_layers,
)
from quickdraft.loading.weight_cache import dtype_name, float_weights
from quickdraft.loading.quant_groups import fuse_quant_linears
from quickdraft.loading.weight_choice import (auto_format, describe_float, describe_kernels, head_kernel,
                                             kernel_sources, layer_linear_types, planned_kernel_bytes,
                                             planned_kernels, planned_weight_bytes)
from quickdraft.models import qmatmul
from quickdraft.models.block_embedding import BlockEmbedding
from quickdraft.models.quant_formats import INT4_GROUP_SIZES
from quickdraft.models.transformer import Transformer, build_model, step_weight_bytes

WEIGHT_FORMATS = ("auto", "gguf", "int4", "int8", "bfloat16", "float32")
FLOAT_FORMATS = {"bfloat16": torch.bfloat16, "float32": torch.float32}
# lm_head (tied or not) in load_model of an int4/int8 model: int8 (see bench/quant_accuracy.py for the trade-off); a
# gguf model keeps the file's own type there too.
DEFAULT_LM_HEAD: bool | str = "int8"


def default_lm_head(fmt: str | None) -> str:
    """The lm_head's format ``load_model`` gives a model in ``fmt`` by default."""
    return "gguf" if fmt == "gguf" else DEFAULT_LM_HEAD


def resolve_weights(weights: str, device: str = "cpu", tensor_types: Mapping[str, str] | None = None) -> str | None:
    """The weight format to run: ``'gguf'``, ``'int4'``, ``'int8'``, ``'bfloat16'``, ``'float32'``, or None for float
    weights in the model dtype.

    ``'auto'`` on CPU follows the checkpoint whose ``tensor_types`` are given (``weight_choice.auto_format``): a
    decode step reads the bytes the file holds, not its dequantized size. A quantized GGUF runs ``'gguf'`` (each
    tensor in its own type), a float GGUF or an HF directory float weights. Off CPU it keeps float weights (the
    quantized layers only have a slow dequantize fallback there). ``'gguf'`` needs the qmatmul kernel on CPU."""
    if not isinstance(weights, str) or weights not in WEIGHT_FORMATS:
        raise InvalidParameterError(f"weights must be one of {', '.join(WEIGHT_FORMATS)}, got {weights!r}")
    if weights == "auto":
        return auto_format(tensor_types) if str(device).startswith("cpu") else None
    if weights == "gguf" and not (str(device).startswith("cpu") and qmatmul.available()):
        raise InvalidParameterError(f"weights='gguf' runs the file's own quantization on quickdraft's CPU kernel, "
                                    f"which is unavailable here ({qmatmul.unavailable_reason() or f'device {device}'});"
                                    f" use 'int4', 'int8' or a float format")
    return weights


def resolve_draft_weights(draft_weights: str, target_format: str, cfg: ModelConfig,
                          device: str = "cpu") -> str:
    """The weight format of a draft model. A draft only has to be cheap: the target verifies every token it
    proposes, so its precision never changes the output, only the acceptance rate.

    ``'auto'``: ``'int4'`` on CPU when every linear's input width is a multiple of the int4 group (a 1-token
    int4 step is much cheaper than a bfloat16 one, docs/MEASUREMENTS.md; bench/speculative.py compares the
    two drafts end to end), else the target's format."""
    if draft_weights == "auto":
        widths = (cfg.hidden_size, cfg.intermediate_size, cfg.num_heads * cfg.head_dim)
        fits = all(w % INT4_GROUP_SIZES[0] == 0 for w in widths)
        return "int4" if str(device).startswith("cpu") and fits else target_format
    return resolve_weights(draft_weights, device)


# Options load_model gets for an int4 draft: every layer int4, the lm_head included (a draft
# needs speed, not the last bit of perplexity; see resolve_draft_weights)
DRAFT_INT4_OPTIONS = {"wide_sources": "int4", "lm_head": "int4"}


def restrict_lm_head(model: Transformer, rows: int | Sequence[int]) -> None:
    """Keep only some rows of the lm_head (an own copy when tied; the embedding stays whole): the first ``rows``, or
    the rows listed, in that order.

    For a draft model (FR-Spec style): it then proposes only among those token ids (the first ones of a byte-level
    BPE vocabulary are its earliest, i.e. most frequent, merges; a draft of another vocabulary keeps the tokens it
    shares with the target), and its head reads that much less per step. The target still verifies over the full
    vocabulary, so the output does not change; a sampled draft's q is its distribution renormalised over those ids
    (0 elsewhere), which the verifier handles."""
    vocab = model.config.vocab_size
    if isinstance(rows, int) and not isinstance(rows, bool):
        if not 1 <= rows <= vocab:
            raise InvalidParameterError(f"draft_vocab must be an int in 1..{vocab} (the draft's vocabulary), got {rows!r}")
        if rows == model.lm_head.out_features:
            return
        index: slice | torch.Tensor = slice(0, rows)
        count = rows
    elif isinstance(rows, Sequence) and rows and all(isinstance(r, int) and 0 <= r < vocab for r in rows):
        index, count = torch.tensor(list(rows), dtype=torch.long), len(rows)
    else:
        raise InvalidParameterError(f"draft_vocab must be an int in 1..{vocab} (the draft's vocabulary), got "
                                    f"{reprlib.repr(rows)}")
    head = model.lm_head
    cut = nn.Linear(head.in_features, count, bias=head.bias is not None, device="meta")
    cut.weight = nn.Parameter(head.weight.detach()[index].clone(), requires_grad=False)
    if head.bias is not None:
        cut.bias = nn.Parameter(head.bias.detach()[index].clone(), requires_grad=False)
    model.lm_head = cut


def listed_rows(rows: int | Sequence[int] | None) -> Sequence[int] | None:
    """The rows of a head cut to listed rows (None for a head cut to its first rows, or whole)."""
    return None if rows is None or isinstance(rows, int) else rows


def load_model(checkpoint: Checkpoint, fmt: str, device: str | torch.device = "cpu", *, head_rows: int | Sequence[int] | None = None,
               group_size: int = 32, lm_head: bool | str | None = None, wide_sources: str = "int8",
               use_cache: bool = True) -> Transformer:
    """``checkpoint`` as a Transformer on ``device`` whose linear layers run in ``fmt``: ``'gguf'``, ``'int4'``/``'int8'``,
    or a float format (``'bfloat16'``/``'float32'``/``'float16'``: float weights, packed for oneDNN on CPU by
    ``pack_float_linears``). Built one tensor at a time: the whole model never exists in float.

    * ``'gguf'``: every tensor in the GGML type its file stores it in, repacked at its own size (``BlockLinear``);
      a tensor stored in a float type becomes int8.
    * ``'int4'`` from a GGUF: Q4_0/Q4_1/Q4_K tensors map exactly to int4 (group 32); with ``wide_sources='int8'``
      (default) tensors stored with more bits become int8, else they are requantized to int4, from the
      float32-dequantized GGUF data.
    * ``group_size``: int4 group (32, 64, 128); only 32 maps GGUF Q4 blocks exactly.
    * ``lm_head``: the lm_head's format: False (keep the model dtype), ``'gguf'``, ``'int8'``/True or ``'int4'``;
      None: ``default_lm_head(fmt)`` (see bench/quant_accuracy.py for the trade-off). A tied lm_head becomes a
      quantized copy. The embedding's rows are read from a GGUF's blocks on the CPU (``embeds_from_blocks``), else
      the table keeps the model dtype.
    * ``head_rows``: keep only the lm_head's first rows (``restrict_lm_head``, a draft's vocabulary).
    * ``use_cache``: the converted model goes to ``cache_root()/quantized/`` as it is made, a layer at a time, and runs
      memory-mapped from there (``quant_cache.py``), keyed by the checkpoint fingerprint, format and options, dtype,
      source precision and the layout of the backend the layers run on (``cache_layout``: the qmatmul kernel's, or
      torch's ISA-dependent int4pack layout with the torch version), so an entry is only reused where the same kernel
      runs. A float model from a GGUF maps its dequantized tensors from ``weight_cache.float_weights``.
    * On the qmatmul kernel, q/k/v and gate/up of each decoder layer become one ``QuantGroup`` call each
      (``fuse_quant_linears``).
    """
    if fmt in FLOAT_FORMATS or fmt == "float16":  # float weights (LLM passes its dtype name)
        return _load_float(checkpoint, device, head_rows, use_cache)
    if fmt not in QUANT_FORMATS:
        raise InvalidParameterError(f"weights format must be one of {', '.join(QUANT_FORMATS + tuple(FLOAT_FORMATS))}, "
                                    f"got {fmt!r}")
    device = torch.device(device)
    cfg = checkpoint.config
    head_fmt = lm_head_format(default_lm_head(fmt) if lm_head is None else lm_head)
    names = _linear_names(cfg, head_fmt is not None)
    skip = {name + ".weight" for name in names}  # made from the file's blocks, never as float weights
    options = {"group_size": group_size, "lm_head": head_fmt or False, "wide_sources": wide_sources}
    source = "gguf" if checkpoint.blocks is not None else dtype_name(checkpoint.dtype)
    path, meta = quant_cache_entry(checkpoint.fingerprint, fmt, group_size, head_fmt, source, device,
                                   checkpoint.dtype, wide_sources=wide_sources, head_rows=head_rows)
    embedding = block_embedding(checkpoint, device, head_fmt)  # None: the table is a float tensor of the model
    kept = skip if embedding is None else skip | {EMBED}
    entry = open_quantized(path, meta) if use_cache else None
    if entry is None and use_cache:
        # a float head is stored whole (the model built from the entry cuts it), a quantized one as cut
        skeleton = _built(checkpoint.tensors, cfg, "cpu", skip | {EMBED}, head_rows if head_fmt else None)
        layers = quantized_layers(skeleton, fmt, Sources.of(checkpoint, listed_rows(head_rows)), device, **options)
        info = functools.partial(quant_info, fmt, group_size, wide_sources, head_fmt)
        late = {} if embedding is not None else {EMBED: lambda: checkpoint.tensors[EMBED]}
        if write_quantized(path, meta, skeleton, layers, info, late):
            entry = open_quantized(path, meta)
        del skeleton, layers
    if entry is not None:
        model = _built(entry.tensors, cfg, device, kept, head_rows)
        install_quantized(entry, model, group_size, device)
    else:  # no cache: converted in memory
        model = quantize_model(_built(checkpoint.tensors, cfg, device, kept, head_rows), fmt,
                               Sources.of(checkpoint, listed_rows(head_rows)), **options)
    if embedding is not None:
        model.model.embed_tokens = embedding
    # which kernel each layer runs on, read before fuse_quant_linears groups them (for weights_summary)
    model.quant_info = {**model.quant_info, "kernels": kernel_sources(model, names, checkpoint.tensor_types,
                                                                      checkpoint.quantization)}
    fuse_quant_linears(model)
    if head_fmt is not None:  # logits in float32 (see _QuantLinearBase.float_output)
        model.lm_head.float_output = True
    return model


def embeds_from_blocks(checkpoint: Checkpoint, device: str | torch.device, head: str | None) -> bool:
    """Whether a quantized model of this GGUF reads its token embedding's rows from the file's blocks (``head``: the
    lm_head's format or kernel, None: float): on the CPU, where no float head reads the table whole."""
    tied_float_head = checkpoint.config.tie_word_embeddings and head is None
    return torch.device(device).type == "cpu" and EMBED in (checkpoint.block_types or {}) and not tied_float_head


def planned_bytes(checkpoint: Checkpoint, fmt: str | None, head: str | None, device: str | torch.device,
                  wide_sources: str = "int8") -> int:
    """``planned_weight_bytes`` of a model of ``checkpoint`` in ``fmt`` (None: float) with its lm_head on ``head``,
    the embedding table left out where its rows are read from the file's blocks."""
    table = fmt is None or not embeds_from_blocks(checkpoint, device, head)
    return planned_weight_bytes(checkpoint.config, checkpoint.tensor_types, fmt, head, checkpoint.dtype, wide_sources,
                                table)


def block_embedding(checkpoint: Checkpoint, device: torch.device, head_fmt: str | None) -> BlockEmbedding | None:
    """The GGUF's token embedding read a row at a time from its own blocks (the rows a step looks up, dequantized
    when read: ``models/block_embedding.py``) where ``embeds_from_blocks``; else None."""
    if not embeds_from_blocks(checkpoint, device, head_fmt):
        return None
    cfg, types = checkpoint.config, checkpoint.block_types or {}
    rows = rows_reader(checkpoint.blocks[EMBED], types[EMBED], (cfg.vocab_size, cfg.hidden_size), checkpoint.dtype)
    return BlockEmbedding(rows, cfg.vocab_size, cfg.hidden_size)


def _linear_names(cfg: ModelConfig, lm_head: bool) -> list[str]:
    """The HF names of the linears a model of ``cfg`` replaces (``quantizable_linears`` of a weightless model)."""
    with torch.device("meta"):
        return list(quantizable_linears(Transformer(cfg), lm_head))


def _built(tensors: Mapping[str, torch.Tensor], cfg: ModelConfig, device: str | torch.device, skip: set[str],
           head_rows: int | Sequence[int] | None) -> Transformer:
    model = build_model(cfg, tensors, device, skip)
    if head_rows is not None:
        restrict_lm_head(model, head_rows)
    return model


def _load_float(checkpoint: Checkpoint, device: str | torch.device, head_rows: int | Sequence[int] | None,
                use_cache: bool) -> Transformer:
    """Float weights: a GGUF's dequantized tensors mapped from the weight cache (written a tensor at a time on the
    first load), an HF directory's mapped safetensors; the linears packed, then the mapped pages they were read from
    let go (the embedding's rows come back as they are read)."""
    cfg, tensors, entry = checkpoint.config, checkpoint.tensors, None
    if use_cache and checkpoint.blocks is not None:
        names = [k for k in tensors if not (cfg.tie_word_embeddings and k == "lm_head.weight")]
        entry = float_weights(checkpoint.fingerprint, checkpoint.dtype, tensors, names)
        if entry is not None:
            tensors = entry.tensors
    layer_weights = {name + ".weight" for name in _linear_names(cfg, lm_head=False)}
    model = _built(tensors, cfg, device, layer_weights, head_rows)
    pack_float_linears(model, tensors)  # a layer's float weights are read as it is packed
    for mapped in ([entry] if entry is not None else []) + list(checkpoint.files):
        mapped.release_pages()
    return model


def weights_summary(model: Transformer, checkpoint: Checkpoint, weights: str) -> str:
    """One line on the kernels ``model`` (built from ``checkpoint`` in format ``weights``) runs and the weight bytes a
    decode step reads, e.g. ``'weights: Q4_K kernels for 169 tensors (Q4_K), Q6_K for 29 (28 Q6_K, Q6_K lm_head);
    1.09 GB read per token'``."""
    kernels = model.quant_info.get("kernels")
    if weights in QUANT_FORMATS and kernels:
        line = describe_kernels(kernels)
    else:
        line = describe_float(checkpoint.tensor_types, checkpoint.config.num_layers, weights, checkpoint.quantization)
    return f"{line}; {step_weight_bytes(model) / 1e9:.3g} GB read per token"


def file_defaults(path: str | Path | None) -> tuple[str, str, int | None]:
    """(how a GGUF file stores its decoder-layer linears, e.g. ``'Q4_K+Q6_K'``; the kernels ``'auto'`` runs them
    on, e.g. ``'Q4_K x169, Q6_K x29'`` counting the lm_head, or ``'float'``; the weight bytes a decode step of those
    kernels reads, None for float weights), from the file's header alone: the CPU kernels are planned where they can
    be built, and not built (a listing must not compile them). A listing never fails: ``'?'`` where there is no file
    to read yet (a split model not assembled) and ``'unreadable'`` for a damaged one."""
    if path is None or not Path(path).is_file():
        return "?", "?", None
    try:
        types = hf_tensor_types(gguf_tensor_types(path))
        stored = "+".join(t for t, _ in layer_linear_types(types).most_common()) or "?"
        kernels = planned_kernels(types, lm_head_format(DEFAULT_LM_HEAD), qmatmul.can_build())
        if kernels is None:
            return stored, "float", None
        return stored, ", ".join(f"{k} x{n}" for k, n in kernels.items()), planned_step_bytes(path)
    except QuickdraftError:
        return "unreadable", "?", None


def planned_step_bytes(path: str | Path) -> int:
    """Weight bytes one decode step of the kernels ``'auto'`` runs a GGUF on reads, from the header alone: every
    linear in its kernel's layout (the lm_head too: a tied one reads the embedding's rows whole), norms as float32;
    the embedding table is left out (a step reads one row of it per token), and of a stack of experts only the
    ``expert_used_count`` a token chooses."""
    table = tensor_shapes(path)
    used = experts_used(path) if any(is_stacked(name) for name in table) else 0
    stacks = {name: shape[0] for name, (_, shape) in table.items() if is_stacked(name)}  # each expert typed
    types = hf_tensor_types({name: t for name, (t, _) in table.items()}, stacks)
    fmt = auto_format(types, qmatmul.can_build())
    head = head_kernel(fmt, default_lm_head(fmt), types)
    total = 0
    for name, (stored, shape) in table.items():
        if name == "token_embd.weight" and "output.weight" in table:
            continue
        kernel = head if name in ("output.weight", "token_embd.weight") else layer_kernel(fmt, stored) if fmt else None
        if name.endswith("ffn_gate_inp.weight"):  # a mixture's router stays float, like the norms
            kernel = None
        if is_stacked(name):  # [experts, rows, cols] (or a stack of biases): a token reads `used` of them
            one = shape[1:]
            total += (planned_kernel_bytes(one, kernel) if len(one) == 2 and kernel else math.prod(one) * 4) * used
        elif len(shape) == 2 and kernel is not None:
            total += planned_kernel_bytes(shape, kernel)
        else:
            total += math.prod(shape) * 4
    return total


def experts_used(path: str | Path) -> int:
    """``{arch}.expert_used_count`` of a GGUF of experts (a ModelLoadError where it is missing or out of range)."""
    metadata = read_header(path).metadata
    arch = metadata.get("general.architecture")
    return int_value(metadata, f"{arch}.expert_used_count", Path(path), 1, 1 << 12)
