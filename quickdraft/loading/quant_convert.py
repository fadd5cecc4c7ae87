"""Checkpoint tensors -> quantized layers in a built Transformer (``quantize_model``), in one of three formats:

* ``gguf``: every tensor of a GGUF in its own GGML type, repacked for the kernel at the file's size (``BlockLinear``,
  ``models/block_formats.py``); a tensor the file stores in a float type becomes int8.
* ``int4``: Q4_0, Q4_1 and Q4_K tensors map exactly onto quickdraft's int4 (``gguf_int4.py``); tensors the GGUF
  stores with more bits (Q5_*, Q6_K, Q8_0, F16, ...) become int8 by default (``wide_sources='int8'``; ``'int4'``
  requantizes them).
* ``int8``: every tensor requantized per output channel.

Requantization (int8, int4 of other types or group sizes, HF checkpoints) starts from the float32-dequantized GGUF
weights, not from the possibly bfloat16 model weights: round to nearest, per-channel absmax (int8) or per-group
min/max (int4).
"""
from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from quickdraft.config import ModelConfig
from quickdraft.errors import InvalidParameterError
from quickdraft.loading.checkpoint import Checkpoint
from quickdraft.loading.ggml_types import type_name
from quickdraft.loading.gguf import single_thread
from quickdraft.loading.dequant import as_bytes
from quickdraft.loading.gguf_int4 import INT4_TYPES, gguf_int4_params
from quickdraft.models.block_formats import FORMATS, repack
from quickdraft.models.block_linear import BlockLinear
from quickdraft.models.quant import Int4Linear, Int8Linear
from quickdraft.models.quant_backends import default_backend
from quickdraft.models.quant_formats import INT4_GROUP_SIZES, quantize_int4, quantize_int8
from quickdraft.models.transformer import Transformer

log = logging.getLogger(__name__)

QUANT_FORMATS = ("gguf", "int4", "int8")
ATTENTION_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
MLP_LINEARS = ("gate_proj", "up_proj", "down_proj")
LAYER_LINEARS = ATTENTION_LINEARS + tuple(f"mlp.{name}" for name in MLP_LINEARS)  # a dense layer's


def layer_linears(layer: nn.Module) -> list[str]:
    """The paths, within a ``DecoderLayer``, of its linears: attention's, and each gated MLP's (the dense one, or
    every expert of a mixture; a mixture's router stays float)."""
    return list(ATTENTION_LINEARS) + [f"{path}.{name}" for path, _ in layer.feed_forwards() for name in MLP_LINEARS]


def quantizable_linears(model: Transformer, lm_head: bool = False) -> dict[str, nn.Linear]:
    """HF-prefixed name (``model.layers.0.self_attn.q_proj``) -> nn.Linear to replace."""
    out: dict[str, nn.Linear] = {}
    for i, layer in enumerate(model.model.layers):
        for path in layer_linears(layer):
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


def layer_kernel(fmt: str, stored: str | None, wide_sources: str = "int8") -> str:
    """The kernel a linear runs on in a model of format ``fmt``, given the GGML type its file stores it in
    (``stored``; None: not a GGUF tensor): ``gguf`` runs each tensor on its own type's kernel (``int8`` for a float
    or HF tensor); an int4 model keeps a tensor stored with more bits than 4 (Q5_*, Q6_K, Q8_0, F16, ...) in int8
    where ``wide_sources='int8'``. One rule for the conversion and for the plans made from a file's header
    (``weight_choice.planned_kernels``, ``planned_weight_bytes``)."""
    if fmt == "gguf":
        return stored if stored in FORMATS else "int8"
    wide = stored is not None and stored not in INT4_TYPES
    return "int8" if fmt == "int4" and wide_sources == "int8" and wide else fmt


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


EMBED = "model.embed_tokens.weight"
# float32 bytes converted at a time for big matrices (a vocabulary-wide head): a 151936 x 1536 head would otherwise
# pass through several float32 copies of 0.9 GB each
CHUNK_BYTES = 8 << 20
DEVICE_ROWS_BYTES = 256 << 20  # float32 rows quantized at a time off the qmatmul kernel (a GPU's layers)


@dataclass
class Sources:
    """Where the weights to quantize come from, by HF name (``...q_proj.weight``): a GGUF's own blocks and their
    GGML type ids (``Checkpoint.blocks``/``block_types``: repacked as they are in ``'gguf'``, the exact int4 mapping,
    or float32 dequantization to requantize), else float tensors in HF layout (``Checkpoint.tensors``, made when read), else the module's weight.
    A tied lm_head is the embedding's blocks rounded to ``float_dtype`` (the table the model holds)."""

    blocks: Mapping[str, Any] | None = None
    block_types: Mapping[str, int] | None = None
    floats: Mapping[str, torch.Tensor] | None = None
    float_dtype: torch.dtype | None = None
    # the file's rows an lm_head cut to listed rows holds (``restrict_lm_head``); None: its first rows
    head_rows: torch.Tensor | None = None

    @classmethod
    def of(cls, checkpoint: Checkpoint, head_rows: Sequence[int] | None = None) -> Sources:
        rows = None if head_rows is None else torch.tensor(list(head_rows), dtype=torch.long)
        return cls(checkpoint.blocks, checkpoint.block_types, checkpoint.tensors, checkpoint.dtype, rows)

    def _rows(self, name: str, r0: int, r1: int) -> slice | torch.Tensor:
        """The file's rows behind the module's rows r0..r1."""
        return self.head_rows[r0:r1] if name == "lm_head" and self.head_rows is not None else slice(r0, r1)

    def _stored_key(self, name: str, cfg: ModelConfig) -> str | None:
        """The key of the file's blocks that hold this weight: its own, or the embedding a tied lm_head reads; None
        when the blocks do not hold it."""
        key, types = name + ".weight", self.block_types or {}
        if name == "lm_head" and key not in types and cfg.tie_word_embeddings:
            key = EMBED
        return key if self.blocks is not None and key in types else None

    def stored_type(self, name: str, cfg: ModelConfig) -> str | None:
        """The GGML type name the file stores this weight in (a tied lm_head: the embedding's; None: not in the
        file's blocks)."""
        key = self._stored_key(name, cfg)
        return None if key is None else type_name(self.block_types[key])

    def _block_rows(self, key: str, shape: tuple[int, int], heads: int | None, rows: slice | torch.Tensor
                    ) -> tuple[torch.Tensor, tuple[int, int]]:
        """The stored bytes of ``rows`` and their shape (all rows where q/k rows must be unpermuted first)."""
        data = as_bytes(self.blocks[key])
        if heads:
            return data, shape
        per_row = data.numel() // shape[0]
        if isinstance(rows, slice):
            return data[rows.start * per_row:rows.stop * per_row], (rows.stop - rows.start, shape[1])
        return data.view(shape[0], per_row)[rows].reshape(-1), (len(rows), shape[1])

    def float32(self, name: str, linear: nn.Linear, cfg: ModelConfig, rows: tuple[int, int] | None = None,
                device: torch.device | None = None) -> torch.Tensor:
        """float32 weight of ``name`` in HF layout, rows ``rows`` (default: the module's, which an lm_head cut by
        ``restrict_lm_head`` has fewer of than the file), on ``device`` (default: where it is stored; a stored
        bfloat16 weight is moved before it is widened)."""
        key = name + ".weight"
        r0, r1 = rows or (0, linear.out_features)
        src = self._stored_key(name, cfg)
        if src is not None:
            from quickdraft.loading.dequant import dequantize
            from quickdraft.loading.gguf import unpermute_rows

            heads = _unpermute(name, cfg)
            data, shape = self._block_rows(src, _source_shape(name, linear, cfg), heads, self._rows(name, r0, r1))
            w = dequantize(data, self.block_types[src], shape)
            w = unpermute_rows(w, heads)[r0:r1] if heads else w
            tied = src != key  # the head the model holds: the embedding rounded to its dtype
            return (w.to(self.float_dtype).float() if tied and self.float_dtype is not None else w).to(device)
        if self.floats is not None and key in self.floats:
            return self.floats[key][self._rows(name, r0, r1)].to(device).float()
        return linear.weight.detach()[r0:r1].to(device).float()

    def int4(self, name: str, linear: nn.Linear, cfg: ModelConfig, group_size: int,
             rows: tuple[int, int] | None = None, device: torch.device | None = None
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]:
        """(q, scale, zero, exact) of rows ``rows``: exact when taken from the GGUF's own int4 blocks, else
        quantized on ``device`` (default: where the weight is)."""
        key = name + ".weight"
        r0, r1 = rows or (0, linear.out_features)
        if group_size == 32 and self.blocks is not None and self.block_types is not None and key in self.block_types:
            heads = _unpermute(name, cfg)
            data, shape = self._block_rows(key, _source_shape(name, linear, cfg), heads, self._rows(name, r0, r1))
            mapped = gguf_int4_params(data, self.block_types[key], shape)
            if mapped is not None:
                if heads:
                    from quickdraft.loading.gguf import unpermute_rows

                    mapped = tuple(unpermute_rows(t, heads)[r0:r1] for t in mapped)
                return (*mapped, True)
        return (*quantize_int4(self.float32(name, linear, cfg, (r0, r1), device), group_size), False)

    def kernel_rows(self, name: str, linear: nn.Linear, cfg: ModelConfig, kernel: str, rows: tuple[int, int]
                    ) -> torch.Tensor:
        """Rows ``rows`` of the file's blocks of ``name`` (stored as ``kernel``, a GGML type) repacked for the kernel:
        ``[r1 - r0, row_bytes]`` uint8 (q/k rows unpermuted; a tied head: the embedding's rows)."""
        from quickdraft.loading.gguf import unpermute_rows

        r0, r1 = rows
        src = self._stored_key(name, cfg)
        heads = _unpermute(name, cfg)
        data, (n, k) = self._block_rows(src, _source_shape(name, linear, cfg), heads, self._rows(name, r0, r1))
        packed = repack(kernel, data, n, k)
        return unpermute_rows(packed, heads)[r0:r1].contiguous() if heads else packed

    def reads_rows(self, name: str, cfg: ModelConfig) -> bool:
        """A block of this weight's rows can be read without the rest: the file's blocks hold it (or the embedding
        a tied head reads) and no q/k permutation mixes its rows."""
        return self._stored_key(name, cfg) is not None and _unpermute(name, cfg) is None


def _source_shape(name: str, linear: nn.Linear, cfg: ModelConfig) -> tuple[int, int]:
    """Shape of the stored tensor; an lm_head cut to its first rows (``restrict_lm_head``) keeps the full one."""
    return (cfg.vocab_size, linear.in_features) if name == "lm_head" else tuple(linear.weight.shape)


def check_quant_options(model: Transformer, fmt: str, group_size: int, lm_head: bool | str, wide_sources: str) -> None:
    """Raise InvalidParameterError for a format, group size or option the model's layers cannot take."""
    if wide_sources not in ("int4", "int8"):
        raise InvalidParameterError(f"wide_sources must be 'int4' or 'int8', got {wide_sources!r}")
    if fmt not in QUANT_FORMATS:
        raise InvalidParameterError(f"quantized weight format must be one of {', '.join(QUANT_FORMATS)}, got {fmt!r}")
    if fmt == "int4" and group_size not in INT4_GROUP_SIZES:
        raise InvalidParameterError(f"int4 group size must be one of {INT4_GROUP_SIZES}, got {group_size}")
    head_fmt = lm_head_format(lm_head)
    for name, linear in quantizable_linears(model, head_fmt is not None).items():
        f = head_fmt if name == "lm_head" else fmt
        if f == "int4" and linear.in_features % group_size:
            raise InvalidParameterError(f"int4 group size {group_size} does not divide {name}'s in_features "
                                        f"{linear.in_features}; use one of {INT4_GROUP_SIZES} that does")


def quantized_layers(model: Transformer, fmt: str, sources: Sources, device: torch.device, *, group_size: int = 32,
                     lm_head: bool | str = False, wide_sources: str = "int8") -> Iterator[tuple[str, nn.Module, bool]]:
    """``(name, quantized layer, exact)`` for each linear to replace, made one at a time (at most one float32 weight
    alive), on ``device``; the model is not changed (its linears may be meta placeholders). ``exact``: int4 values
    taken as they are from the file's blocks (GGUF Q4 blocks as int4, every GGML type the kernel reads in ``gguf``)."""
    check_quant_options(model, fmt, group_size, lm_head, wide_sources)
    cfg = model.config
    head_fmt = lm_head_format(lm_head)
    with single_thread():
        for name, linear in quantizable_linears(model, head_fmt is not None).items():
            if name == "lm_head" and head_fmt != "gguf":
                kernel = head_fmt
            else:
                kernel = layer_kernel(head_fmt if name == "lm_head" else fmt, sources.stored_type(name, cfg),
                                      wide_sources)
            yield (name, *_quantized(name, linear, kernel, sources, cfg, group_size, device))


def _quantized(name: str, linear: nn.Linear, fmt: str, sources: Sources, cfg: ModelConfig, group_size: int,
               device: torch.device) -> tuple[nn.Module, bool]:
    """One quantized layer and whether it came exactly from the file's blocks. A big matrix on the qmatmul
    kernel is converted a block of rows at a time into its final tensors (the kernel's layout is row by row), so
    no float32 copy of the whole matrix is ever made (``CHUNK_BYTES`` of it at a time)."""
    bias = None if linear.bias is None else linear.bias.detach().to(device)
    n = linear.out_features
    if fmt in FORMATS:  # the file's own blocks, repacked a block of rows at a time (q/k rows unpermuted whole)
        kweight = torch.empty(n, FORMATS[fmt].row_bytes(linear.in_features), dtype=torch.uint8)
        step = max(1, CHUNK_BYTES // linear.in_features) if sources.reads_rows(name, cfg) else n
        for r0 in range(0, n, step):
            kweight[r0:r0 + step] = sources.kernel_rows(name, linear, cfg, fmt, (r0, min(n, r0 + step)))
        return BlockLinear(kweight, fmt, linear.in_features, bias), True

    def values(rows: tuple[int, int] | None) -> tuple[tuple[torch.Tensor, ...], bool]:
        """Rows ``rows`` quantized where the layer will run (a GPU rounds a large model's weights far faster than the
        host's cores, with the same bits): (q, scale) or (q, scale, zero) on ``device``, and whether exact."""
        if fmt == "int8":
            return quantize_int8(sources.float32(name, linear, cfg, rows, device)), False
        *tensors, exact = sources.int4(name, linear, cfg, group_size, rows, device)
        return tuple(t.to(device) for t in tensors), exact

    def part(rows: tuple[int, int] | None, part_bias: torch.Tensor | None) -> tuple[nn.Module, bool]:
        tensors, exact = values(rows)
        layer = Int8Linear(*tensors, part_bias) if fmt == "int8" else Int4Linear(*tensors, group_size, part_bias)
        return layer, exact

    kernel_rows = default_backend(device) == "qmatmul" and linear.in_features % 32 == 0 \
        and (fmt == "int8" or group_size == 32) and sources.reads_rows(name, cfg)
    rows = max(1, CHUNK_BYTES // (4 * linear.in_features))
    step = max(1, DEVICE_ROWS_BYTES // (4 * linear.in_features))
    if not kernel_rows and n > step and (sources.stored_type(name, cfg) is None or sources.reads_rows(name, cfg)):
        # (a GPU's layers) a head of 150k rows in blocks: a whole float32 copy and the quantizer's temporaries
        # would be gigabytes
        blocks = [values((r0, min(n, r0 + step))) for r0 in range(0, n, step)]
        tensors = tuple(torch.cat(parts) for parts in zip(*(b[0] for b in blocks)))
        exact = all(b[1] for b in blocks)
        del blocks
        return (Int8Linear(*tensors, bias) if fmt == "int8" else Int4Linear(*tensors, group_size, bias)), exact
    if n <= rows or not kernel_rows:
        return part(None, bias)
    kweight = kscales = None
    exact = True
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        mod, part_exact = part((r0, r1), None)
        if kweight is None:
            kweight = torch.empty((n, *mod.kweight.shape[1:]), dtype=mod.kweight.dtype)
            kscales = torch.empty((n, *mod.kscales.shape[1:]), dtype=mod.kscales.dtype)
        kweight[r0:r1], kscales[r0:r1] = mod.kweight, mod.kscales
        exact = exact and part_exact
        del mod
    cls = Int8Linear if fmt == "int8" else Int4Linear
    return cls.from_kernel_tensors(kweight, kscales, linear.in_features, bias), exact


def quant_info(fmt: str, group_size: int, wide_sources: str, head_fmt: str | None, kinds: dict[str, str],
               exact: int) -> dict[str, Any]:
    """What ``Transformer.quant_info`` records of a conversion (kept with the cached layers); ``kinds``: each
    replaced layer's kernel (``int4``, ``int8`` or a GGML type) by name."""
    if fmt != "int8":
        log.info("%s: %d of %d linear layers taken exactly from the file's blocks, the rest requantized",
                 fmt, exact, len(kinds))
    return {"format": fmt, "group_size": group_size if fmt == "int4" else None, "exact_from_file": exact,
            "layers": dict(Counter(kinds.values())), "wide_sources": wide_sources,
            "lm_head": head_fmt if "lm_head" in kinds else None}


def quantize_model(model: Transformer, fmt: str, sources: Sources | None = None, *, group_size: int = 32,
                   lm_head: bool | str = False, wide_sources: str = "int8") -> Transformer:
    """Replace the decoder layers' nn.Linear (and ``lm_head`` when ``lm_head``) with quantized layers (BlockLinear in
    ``'gguf'``, Int4Linear / Int8Linear), in place, one at a time; returns ``model``.

    ``sources``: where the weights come from (see ``Sources``; default: the modules' own weights).
    ``lm_head``: False keeps it; True or ``'int8'`` quantizes the lm_head to int8, ``'int4'`` to int4, ``'gguf'``
    keeps the file's own type.
    ``wide_sources`` (int4 only): format for layers whose GGUF type has more than 4 bits (Q5_*, Q6_K, Q8_0,
    F16, ...): ``'int8'`` (default) keeps them in int8, ``'int4'`` requantizes them to int4. A Q4_K_M GGUF stores
    some layers as Q6_K: int8 there brings the perplexity close to bfloat16's at the same decode speed
    (docs/MEASUREMENTS.md, bench/quant_accuracy.py).
    """
    check_quant_options(model, fmt, group_size, lm_head, wide_sources)
    device = model.model.norm.weight.device  # (the embedding may be read from the file's blocks, held nowhere)
    kinds, exact = {}, 0
    for name, mod, is_exact in quantized_layers(model, fmt, sources or Sources(), device, group_size=group_size,
                                                lm_head=lm_head, wide_sources=wide_sources):
        set_module(model, name, mod)
        kinds[name], exact = mod.kernel_name, exact + is_exact
    model.quant_info = quant_info(fmt, group_size, wide_sources, lm_head_format(lm_head), kinds, exact)
    return model


def lm_head_format(lm_head: bool | str | None) -> str | None:
    """The lm_head's quantized format from the ``lm_head`` option (``'gguf'``: the file's own type); None keeps it in
    the model dtype."""
    if lm_head is None or lm_head is False:
        return None
    if lm_head is True:
        return "int8"
    if lm_head in QUANT_FORMATS:
        return lm_head
    raise InvalidParameterError(f"lm_head must be False, True, 'gguf', 'int8' or 'int4', got {lm_head!r}")
