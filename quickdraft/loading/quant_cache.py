"""On-disk cache of quantized layers, so a model is converted once per source, format and kernel layout.

An entry is a safetensors file under ``cache_root()/quantized/`` holding each quantized layer in the layout of the
kernel it runs on (loaded back without conversion, memory-mapped), keyed by the checkpoint fingerprint, the
format and its options, the source precision and that layout (``cache_layout``), so an entry is only reused where
the same kernel runs. A damaged or mismatching entry is dropped and rebuilt.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from quickdraft.loading.quant_convert import set_module
from quickdraft.loading.weight_cache import cache_root, write_atomic
from quickdraft.models.quant import Int4Linear, Int8Linear
from quickdraft.models.quant_backends import cpu_capability, default_backend
from quickdraft.models.quant_formats import unpack_nibbles
from quickdraft.models.transformer import Transformer

log = logging.getLogger(__name__)

# Bump when the quantization (rounding, mapping, stored layout) changes.
QUANT_CACHE_VERSION = "5"


def cache_layout(device: torch.device) -> str:
    """Storage layout tag of the quantized layers on ``device``: the qmatmul kernel's own layout, or torch's int4pack
    packing (which depends on the ISA and possibly the torch version), or portable nibbles off CPU."""
    backend = default_backend(device)
    if backend == "qmatmul":
        return "qmatmul-v2"
    if backend == "torch":
        return f"cpu-{cpu_capability()}-torch{torch.__version__.split('+')[0]}"
    return "nibbles"


def quant_cache_entry(fingerprint: str, fmt: str, group_size: int, lm_head: str | None, source: str,
                      device: torch.device, *, wide_sources: str, head_rows: int | None) -> tuple[Path, dict[str, str]]:
    """The cache file for one source + format on ``device`` and the metadata an entry must carry to be used."""
    layout = cache_layout(device)
    key = f"{fingerprint}|{fmt}|g{group_size}|lm-{lm_head}|wide-{wide_sources}|{source}|{layout}" \
          f"|v{QUANT_CACHE_VERSION}" + (f"|head-rows-{head_rows}" if head_rows is not None else "")
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    tag = f"{fmt}-g{group_size}" if fmt == "int4" else fmt
    path = cache_root() / "quantized" / f"{fingerprint}-{tag}-{digest}.safetensors"
    meta = {"fingerprint": fingerprint, "format": fmt, "group_size": str(group_size), "lm_head": str(lm_head),
            "wide_sources": wide_sources, "source": source, "layout": layout,
            "quickdraft_quant_cache_version": QUANT_CACHE_VERSION}
    if head_rows is not None:
        meta["head_rows"] = str(head_rows)
    return path, meta


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


def _cached_layer(f: Any, keys: set[str], name: str, kind: str, old: nn.Linear, group_size: int) -> nn.Module:
    """The quantized layer cached under ``name``, built straight from the kernel's own tensors where it runs."""
    bias = None if old.bias is None else old.bias.detach()
    device = old.weight.device
    out_f, in_f = old.weight.shape
    if f"{name}.kweight" in keys and device.type == "cpu":
        cls = Int8Linear if kind == "int8" else Int4Linear
        mod: nn.Module = cls.from_kernel_tensors(f.get_tensor(f"{name}.kweight"), f.get_tensor(f"{name}.kscales"),
                                                 in_f, bias)
    elif kind == "int8":
        mod = Int8Linear(f.get_tensor(f"{name}.qweight").to(device), f.get_tensor(f"{name}.scales").to(device), bias)
    elif f"{name}.packed" in keys and device.type == "cpu":
        mod = Int4Linear.from_packed(f.get_tensor(f"{name}.packed"), f.get_tensor(f"{name}.scales_and_zeros"),
                                     group_size, in_f, out_f, bias)
    else:
        q = unpack_nibbles(f.get_tensor(f"{name}.qweight")).to(device)
        s, z = f.get_tensor(f"{name}.scales").to(device), f.get_tensor(f"{name}.zeros").to(device)
        mod = Int4Linear(q, s, z, group_size, bias)
    if (mod.out_features, mod.in_features) != (out_f, in_f):
        raise ValueError(f"{name}: cached shape {(mod.out_features, mod.in_features)} != {(out_f, in_f)}")
    return mod


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
                new[name] = _cached_layer(f, keys, name, kind, old, group_size)
        for name, mod in new.items():
            set_module(model, name, mod)
        model.quant_info = json.loads(stored.get("info", "{}"))
        return True
    except Exception as exc:
        log.warning("ignoring damaged quantized weight cache %s (%s: %s); rebuilding", path, type(exc).__name__, exc)
        with contextlib.suppress(OSError):
            path.unlink()
        return False
