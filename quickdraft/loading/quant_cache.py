"""On-disk cache of quantized layers, so a model is converted once per source, format and kernel layout.

An entry is a safetensors file under ``cache_root()/quantized/`` holding the model's float tensors (norms, biases, and
the embedding where the model does not read its rows from the GGUF's own blocks) and each quantized layer in the layout
of the kernel it runs on, written one layer at a time as it is converted and loaded back memory-mapped (an embedding
costs only the rows read; the layers, which every step reads whole, are copied out a layer at a time, see
``TensorFile.copy``); keyed by the checkpoint fingerprint, the
format and its options, the source precision and that layout (``cache_layout``), so an entry is only reused where
the same kernel runs. A damaged or mismatching entry is dropped and rebuilt; ``cache_budget`` drops the least recently
used entries past a bound.
"""
from __future__ import annotations

import functools
import hashlib
import json
import logging
from array import array
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

import torch
from torch import nn

from quickdraft.loading import cache_budget
from quickdraft.loading.quant_convert import set_module
from quickdraft.loading.tensor_file import TensorFile, TensorFileWriter, header_room, open_tensor_file
from quickdraft.loading.weight_cache import cache_root, dtype_name
from quickdraft.models.block_formats import FORMATS
from quickdraft.models.block_linear import BlockLinear
from quickdraft.models.quant import Int4Linear, Int8Linear
from quickdraft.models.quant_backends import cpu_capability, default_backend
from quickdraft.models.quant_formats import unpack_nibbles
from quickdraft.models.transformer import Transformer

log = logging.getLogger(__name__)

# Bump when the quantization (rounding, mapping) or what an entry holds changes (8: no embedding table where the model
# reads its rows from the GGUF's blocks); a change of the kernel's stored layout is caught by
# LAYOUT_SOURCES without a bump.
QUANT_CACHE_VERSION = "8"
# The files that define how the qmatmul kernel's weights are stored: the repacking, the quantizers, and the C
# header that reads them. Any change to them makes earlier cache files unusable (a file written in another layout
# would be read as garbage), so their digest is part of every qmatmul cache key.
LAYOUT_SOURCES = ("models/block_formats.py", "models/grid_formats.py", "models/format_table.py",
                  "models/quant_formats.py", "models/qformats.h")


@functools.cache
def layout_digest() -> str:
    """A digest of LAYOUT_SOURCES' bytes."""
    root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for name in LAYOUT_SOURCES:
        digest.update((root / name).read_bytes())
    return digest.hexdigest()[:12]


def cache_layout(device: torch.device) -> str:
    """Storage layout tag of the quantized layers on ``device``: the qmatmul kernel's own layout (by the digest of
    the code that writes and reads it), or torch's int4pack packing (which depends on the ISA and possibly the torch
    version), or portable nibbles off CPU."""
    backend = default_backend(device)
    if backend == "qmatmul":
        return f"qmatmul-{layout_digest()}"
    if backend == "torch":
        return f"cpu-{cpu_capability()}-torch{torch.__version__.split('+')[0]}"
    return "nibbles"


def rows_tag(rows: int | Sequence[int]) -> str:
    """The lm_head rows kept, as a cache key: a count, or a digest of the rows listed."""
    if isinstance(rows, int):
        return str(rows)
    return "rows-" + hashlib.sha256(array("q", rows).tobytes()).hexdigest()[:16]


def quant_cache_entry(fingerprint: str, fmt: str, group_size: int, lm_head: str | None, source: str,
                      device: torch.device, dtype: torch.dtype, *, wide_sources: str,
                      head_rows: int | Sequence[int] | None) -> tuple[Path, dict[str, str]]:
    """The cache file for one source + format on ``device`` (its float tensors in ``dtype``) and the metadata an
    entry must carry to be used."""
    layout = cache_layout(device)
    key = f"{fingerprint}|{fmt}|g{group_size}|lm-{lm_head}|wide-{wide_sources}|{source}|{layout}|{dtype_name(dtype)}" \
          f"|v{QUANT_CACHE_VERSION}" + (f"|head-rows-{rows_tag(head_rows)}" if head_rows is not None else "")
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    tag = f"{fmt}-g{group_size}" if fmt == "int4" else fmt
    path = cache_root() / "quantized" / f"{fingerprint}-{tag}-{digest}.safetensors"
    meta = {"fingerprint": fingerprint, "format": fmt, "group_size": str(group_size), "lm_head": str(lm_head),
            "wide_sources": wide_sources, "source": source, "layout": layout, "dtype": dtype_name(dtype),
            "quickdraft_quant_cache_version": QUANT_CACHE_VERSION}
    if head_rows is not None:
        meta["head_rows"] = rows_tag(head_rows)
    return path, meta


def _module_tensors(name: str, mod: nn.Module) -> dict[str, torch.Tensor]:
    """The tensors a quantized layer is cached as: each kernel's own layout, loaded back without conversion."""
    if mod.backend == "qmatmul":  # a BlockLinear keeps its scales inside its rows
        kernel = {f"{name}.kweight": mod.kweight, f"{name}.kscales": mod.kscales}
        return {key: t for key, t in kernel.items() if t is not None}
    if isinstance(mod, Int8Linear):
        return {f"{name}.qweight": mod.qweight, f"{name}.scales": mod.scales}
    assert isinstance(mod, Int4Linear)
    if mod.backend == "torch":
        return {f"{name}.packed": mod.packed, f"{name}.scales_and_zeros": mod.scales_and_zeros}
    return {f"{name}.qweight": mod.qweight, f"{name}.scales": mod.scales.contiguous(),
            f"{name}.zeros": mod.zeros.contiguous()}


def write_quantized(path: Path, meta: dict[str, str], model: Transformer, layers: Iterator[tuple[str, nn.Module, bool]],
                    info: Callable[[dict[str, str], int], dict], late: Mapping[str, Callable[[], torch.Tensor]]) -> bool:
    """Write the model's float tensors (norms, biases; the linears to quantize are meta placeholders), each quantized
    layer as ``layers`` makes it, one at a time, so no more than one converted layer is held, and last the ``late``
    tensors, each made when written (the embedding table, so that it is never held during the conversion); False
    (nothing written) when the cache cannot be written. ``info(layers, exact)`` is the ``quant_info`` kept with them."""
    kinds: dict[str, str] = {}
    exact = 0
    try:
        # a quantized linear writes a few tensors where its placeholder had one, and names itself in "modules"
        with TensorFileWriter(path, header_room(4 * len(model.state_dict()))) as writer:
            for name, t in model.state_dict().items():
                if t.device.type != "meta":  # a tied head reads the (meta) embedding: written late, once
                    writer.add(name, t)
            for name, mod, is_exact in layers:
                for key, t in _module_tensors(name, mod).items():
                    writer.add(key, t)
                kinds[name] = mod.kernel_name
                exact += is_exact
                del mod  # written: not held while the next one is made
            for name, make in late.items():
                writer.add(name, make())
            writer.finish({**meta, "modules": json.dumps(kinds), "info": json.dumps(info(kinds, exact))})
    except (OSError, ValueError) as exc:  # ValueError: a header past the reserved room
        log.warning("could not write quantized weight cache %s: %s", path, exc)
        return False
    drop_outdated(path, meta)
    cache_budget.trim(keep=path)
    return True


def drop_outdated(path: Path, meta: dict[str, str]) -> list[Path]:
    """Delete the cache files of the same source written for another qmatmul layout or cache version: no build of
    this code can read them, and each is a whole converted model (the removed files are returned)."""
    removed = []
    for other in path.parent.glob(f"{meta['fingerprint']}-*.safetensors"):
        if other == path:
            continue
        try:
            with open(other, "rb") as f:
                size = int.from_bytes(f.read(8), "little")
                theirs = json.loads(f.read(size)).get("__metadata__", {}) if size < (64 << 20) else {}
        except (OSError, ValueError):
            continue
        layout = theirs.get("layout", "")
        outdated = theirs.get("quickdraft_quant_cache_version") != meta["quickdraft_quant_cache_version"] or (
            layout.startswith("qmatmul-") and meta["layout"].startswith("qmatmul-") and layout != meta["layout"])
        if outdated and theirs.get("fingerprint") == meta["fingerprint"]:
            other.unlink(missing_ok=True)
            removed.append(other)
    return removed


def open_quantized(path: Path, meta: dict[str, str]) -> TensorFile | None:
    """The cache entry mapped (float tensors and the kernels' own layer tensors, none copied), or None."""
    entry = open_tensor_file(path, meta, "quantized weight cache")
    if entry is None or "modules" not in entry.metadata:
        return None
    cache_budget.mark_used(path)
    return entry


def install_quantized(entry: TensorFile, model: Transformer, group_size: int, device: torch.device) -> None:
    """Put the entry's quantized layers in place of the model's placeholders (its float tensors built the model)."""
    kinds: dict[str, str] = json.loads(entry.metadata["modules"])
    keys = set(entry.tensors)
    for name, kind in kinds.items():
        old = model.get_submodule(name)
        if not isinstance(old, nn.Linear):
            raise ValueError(f"{name} is not an nn.Linear in the model")
        # every step reads these whole: copied out of the mapping (see TensorFile.copy), one layer at a time
        own = {key: entry.copy(key) for key in keys if key.startswith(name + ".") and not key.endswith(".bias")}
        set_module(model, name, _cached_layer(own, keys, name, kind, old, group_size, device))
    model.quant_info = json.loads(entry.metadata.get("info", "{}"))


def _cached_layer(f: dict[str, torch.Tensor], keys: set[str], name: str, kind: str, old: nn.Linear, group_size: int,
                  device: torch.device) -> nn.Module:
    """The quantized layer cached under ``name``, built straight from the kernel's own tensors where it runs."""
    bias = None if old.bias is None else old.bias.detach()
    out_f, in_f = old.weight.shape
    if kind in FORMATS:
        mod: nn.Module = BlockLinear(f[f"{name}.kweight"], kind, in_f, bias)
    elif f"{name}.kweight" in keys and device.type == "cpu":
        cls = Int8Linear if kind == "int8" else Int4Linear
        mod = cls.from_kernel_tensors(f[f"{name}.kweight"], f[f"{name}.kscales"], in_f, bias)
    elif kind == "int8":
        mod = Int8Linear(f[f"{name}.qweight"].to(device), f[f"{name}.scales"].to(device), bias)
    elif f"{name}.packed" in keys and device.type == "cpu":
        mod = Int4Linear.from_packed(f[f"{name}.packed"], f[f"{name}.scales_and_zeros"], group_size, in_f, out_f, bias)
    else:
        q = unpack_nibbles(f[f"{name}.qweight"]).to(device)
        s, z = f[f"{name}.scales"].to(device), f[f"{name}.zeros"].to(device)
        mod = Int4Linear(q, s, z, group_size, bias)
    if (mod.out_features, mod.in_features) != (out_f, in_f):
        raise ValueError(f"{name}: cached shape {(mod.out_features, mod.in_features)} != {(out_f, in_f)}")
    return mod
