"""LoRA adapters from PEFT directories and llama.cpp's GGUF adapters, checked against the model they adapt before
any is used.

An adapter is a set of (layer, module) -> (A ``[r, in]``, B ``[out, r]``, scale). PEFT writes ``adapter_config.json``
(``r``, ``lora_alpha``, ``use_rslora``, ``alpha_pattern``) and ``adapter_model.safetensors`` (``...layers.3.self_attn.
q_proj.lora_A.weight``); scale is alpha / r (alpha / sqrt(r) with rsLoRA). llama.cpp's GGUF LoRA, as its
``convert_lora_to_gguf.py`` writes one: ``general.type`` ``adapter``, ``adapter.type`` ``lora``, ``adapter.lora.alpha``,
and per adapted weight ``blk.3.attn_q.weight.lora_a`` (PEFT's A) and ``.lora_b`` (B, its rows permuted as the base
weight's are where the converter permutes q and k: llama's rotary layout); scale alpha / r, or 1 where alpha is 0,
as llama.cpp applies it. ``write_gguf_lora`` writes one from a PEFT adapter, so one adapter runs on both engines.
"""
from __future__ import annotations

import json
import math
import re
import reprlib
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch

from quickdraft.config import ModelConfig
from quickdraft.errors import InvalidParameterError, ModelLoadError, require_unicode
from quickdraft.loading.dequant import SUPPORTED_IDS, dequantize, qtype_name
from quickdraft.loading.gguf import PERMUTED_ARCHITECTURES, unpermute_rows
from quickdraft.loading.gguf_metadata import read_header
from quickdraft.models.lora import MAX_SCALE, MODULE_SITES, LoraPart, LoraWeights
from quickdraft.models.transformer import Transformer

MAX_LORA_RANK = 512  # vLLM's largest max_lora_rank
MAX_ADAPTERS = 64
_PEFT_KEY = re.compile(r"^base_model\.model\.((?:model\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+))"
                       r"\.lora_([AB])\.weight$")
Modules = dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor, float]]


def module_shape(cfg: ModelConfig, module: str) -> tuple[int, int]:
    """(in, out) features of a decoder layer's ``module``."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    hidden, width = cfg.hidden_size, cfg.intermediate_size
    return {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
            "gate_proj": (hidden, width), "up_proj": (hidden, width), "down_proj": (width, hidden)}[module]


def _offset(cfg: ModelConfig, module: str) -> int:
    """The first column of ``module``'s output in its site's (q, k, v side by side; gate, up side by side)."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return {"k_proj": q, "v_proj": q + kv, "up_proj": cfg.intermediate_size}.get(module, 0)


def _checked(path: Path, cfg: ModelConfig, layer: int, module: str, a: torch.Tensor | None, b: torch.Tensor | None,
             alpha: float | None) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(A, B, scale) of one module, each checked against the model; ``alpha`` None: scale 1 (llama.cpp's alpha 0)."""
    where = f"{path}: layer {layer}'s {module}"
    if module not in MODULE_SITES:
        raise ModelLoadError(f"{where}: quickdraft applies LoRA to {', '.join(MODULE_SITES)} only")
    if not 0 <= layer < cfg.num_layers:
        raise ModelLoadError(f"{where}: the model has layers 0 to {cfg.num_layers - 1}")
    if cfg.is_moe_layer(layer) and module in ("gate_proj", "up_proj", "down_proj"):
        raise ModelLoadError(f"{where}: layer {layer} is a mixture of experts, whose experts take no adapter here")
    if a is None or b is None:
        raise ModelLoadError(f"{where}: needs both lora_A and lora_B, got only lora_{'B' if a is None else 'A'}")
    fan_in, fan_out = module_shape(cfg, module)
    rank = a.shape[0] if a.dim() == 2 else 0
    if not (a.dim() == b.dim() == 2 and a.shape[1] == fan_in and b.shape == (fan_out, rank)
            and 1 <= rank <= MAX_LORA_RANK):
        raise ModelLoadError(f"{where}: lora_A must be [r, {fan_in}] and lora_B [{fan_out}, r] with r in 1 to "
                             f"{MAX_LORA_RANK}, got {list(a.shape)} and {list(b.shape)}")
    if not (a.is_floating_point() and b.is_floating_point()):
        raise ModelLoadError(f"{where}: lora_A and lora_B must be float tensors, got {a.dtype} and {b.dtype}")
    a, b = a.float(), b.float()
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        raise ModelLoadError(f"{where}: lora_A or lora_B holds NaN or infinity")
    scale = 1.0 if alpha is None else alpha / rank
    if not torch.isfinite(b.abs().max() * abs(scale) * MAX_SCALE):  # B scaled, at a request's largest scale
        raise ModelLoadError(f"{where}: its scale ({scale:g}, alpha / r) times lora_B overflows float32")
    return a, b, scale


def _pattern_value(patterns: Mapping[str, object], name: str, default: float) -> float:
    """PEFT's per-module override (``alpha_pattern``): the first pattern that matches the end of the module's name."""
    for pattern, value in patterns.items():
        try:
            if re.match(rf"(.*\.)?({pattern})$", name):
                return value  # type: ignore[return-value]
        except re.error as exc:
            raise ModelLoadError(f"alpha_pattern's key {pattern!r} is not a regular expression ({exc})") from None
    return default


def read_peft(directory: Path, cfg: ModelConfig) -> Modules:
    """A PEFT LoRA directory's modules."""
    try:
        config = json.loads((directory / "adapter_config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{directory}: cannot read adapter_config.json ({exc})") from None
    if not isinstance(config, dict) or config.get("peft_type", "LORA") != "LORA":
        raise ModelLoadError(f"{directory}: adapter_config.json is not a LoRA adapter's (peft_type "
                             f"{config.get('peft_type') if isinstance(config, dict) else None!r})")
    refused = {"use_dora": "DoRA", "modules_to_save": "modules_to_save (whole copied layers)",
               "lora_bias": "lora_bias"}
    for key, what in refused.items():
        if config.get(key):
            raise ModelLoadError(f"{directory}: {what} is not supported; a plain LoRA (A and B per module) is")
    if config.get("bias", "none") != "none":
        raise ModelLoadError(f"{directory}: bias={config['bias']!r} is not supported; only bias='none' is")
    alpha = config.get("lora_alpha", 8)
    patterns = config.get("alpha_pattern") or {}
    if not _is_number(alpha) or not isinstance(patterns, dict) or not all(map(_is_number, patterns.values())):
        raise ModelLoadError(f"{directory}: lora_alpha and alpha_pattern's values must be numbers")
    weights = directory / "adapter_model.safetensors"
    if not weights.is_file():
        raise ModelLoadError(f"{directory}: no adapter_model.safetensors (a pickled adapter_model.bin is not read: "
                             f"save the adapter with safe_serialization=True)")
    from safetensors.torch import load_file
    try:
        tensors = load_file(weights)
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own kinds for a damaged file
        raise ModelLoadError(f"{weights}: cannot read it ({exc})") from None
    found: dict[tuple[int, str], dict[str, torch.Tensor | str]] = {}
    for key, tensor in tensors.items():
        match = _PEFT_KEY.match(key)
        if match is None:
            raise ModelLoadError(f"{weights}: tensor {key!r} is not a decoder layer's lora_A or lora_B (embedding and "
                                 f"LM head adapters are not supported)")
        found.setdefault((int(match[2]), match[3]), {"name": match[1]})[match[4]] = tensor
    modules: Modules = {}
    for (layer, module), pair in sorted(found.items()):
        name = pair["name"]  # the module's name in the base model, as PEFT matches alpha_pattern against it
        a, b = pair.get("A"), pair.get("B")
        rank = a.shape[0] if a is not None and a.dim() == 2 else 1
        scale_alpha = float(_pattern_value(patterns, name, alpha))
        if config.get("use_rslora"):  # scale alpha / sqrt(r), written as alpha' / r
            scale_alpha *= math.sqrt(rank)
        modules[(layer, module)] = _checked(directory, cfg, layer, module, a, b, scale_alpha)
    return modules


_GGUF_KEY = re.compile(r"^blk\.(\d+)\.(\w+)\.weight\.lora_([ab])$")
GGUF_MODULES = {"attn_q": "q_proj", "attn_k": "k_proj", "attn_v": "v_proj", "attn_output": "o_proj",
                "ffn_gate": "gate_proj", "ffn_up": "up_proj", "ffn_down": "down_proj"}


def read_gguf_lora(path: Path, cfg: ModelConfig) -> Modules:
    """A GGUF LoRA's modules (``convert_lora_to_gguf.py``'s layout: lora_a ``[r, in]``, lora_b ``[out, r]`` with q/k
    rows permuted as the base's are, for the architectures whose converter permutes them)."""
    header = read_header(path)  # every count, length and offset checked
    meta = header.metadata
    kind = (meta.get("general.type"), meta.get("adapter.type"))
    if kind != ("adapter", "lora"):
        raise ModelLoadError(f"{path}: not a LoRA adapter (general.type {kind[0]!r}, adapter.type {kind[1]!r}; a "
                             f"GGUF LoRA has 'adapter' and 'lora')")
    arch = meta.get("general.architecture")
    if not isinstance(arch, str) or arch not in _GGUF_ARCHITECTURES.get(cfg.architecture, (gguf_architecture(cfg),)):
        raise ModelLoadError(f"{path}: an adapter of a {arch!r} model cannot adapt this {cfg.architecture!r} one")
    alpha = meta.get("adapter.lora.alpha", 0.0)
    if not _is_number(alpha) or alpha < 0:
        raise ModelLoadError(f"{path}: adapter.lora.alpha must be a finite number >= 0, got {alpha!r}")
    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    widest = max(max(module_shape(cfg, module)) for module in GGUF_MODULES.values())
    with open(path, "rb") as f:
        for name, dims, qtype, offset, nbytes in header.tensors:
            match = _GGUF_KEY.match(name)
            if match is None or match[2] not in GGUF_MODULES:
                raise ModelLoadError(f"{path}: tensor {name!r} is not a decoder layer's lora_a or lora_b of "
                                     f"{', '.join(GGUF_MODULES)}")
            if len(dims) != 2 or math.prod(dims) > MAX_LORA_RANK * widest:  # checked again in full once read
                raise ModelLoadError(f"{path}: tensor {name} has dims {dims}; a LoRA matrix is 2-D, of rank at most "
                                     f"{MAX_LORA_RANK}")
            if qtype not in SUPPORTED_IDS:
                raise ModelLoadError(f"{path}: tensor {name} has type {qtype_name(qtype)}, which quickdraft cannot "
                                     f"read")
            f.seek(offset)
            raw = np.frombuffer(f.read(nbytes), dtype=np.uint8)
            shape = tuple(reversed(dims))
            found.setdefault((int(match[1]), GGUF_MODULES[match[2]]), {})[match[3].upper()] = \
                dequantize(raw, qtype, shape)
    modules: Modules = {}
    for (layer, module), pair in sorted(found.items()):
        a, b = pair.get("A"), pair.get("B")
        if b is not None and b.dim() == 2 and arch in PERMUTED_ARCHITECTURES and module in ("q_proj", "k_proj"):
            heads = cfg.num_heads if module == "q_proj" else cfg.num_kv_heads
            if b.shape[0] % (2 * heads) == 0:
                b = unpermute_rows(b, heads)
        modules[(layer, module)] = _checked(path, cfg, layer, module, a, b, float(alpha) or None)
    return modules


# the general.architecture values llama.cpp writes for a model of each family, the first what write_gguf_lora writes
_GGUF_ARCHITECTURES = {"mistral": ("llama", "mistral"), "mixtral": ("llama", "mixtral"), "gpt_oss": ("gpt-oss",),
                       "qwen3_moe": ("qwen3moe",)}


def gguf_architecture(cfg: ModelConfig) -> str:
    return _GGUF_ARCHITECTURES.get(cfg.architecture, (cfg.architecture,))[0]


def write_gguf_lora(modules: Modules, out: str | Path, cfg: ModelConfig) -> Path:
    """``modules`` (``read_adapter``'s) as the GGUF LoRA llama.cpp's converter writes, float32. One alpha serves the
    file: where every module's scale is alpha / r of one alpha it is written; else each B is scaled and alpha is 0."""
    import gguf

    arch = gguf_architecture(cfg)
    alphas = {round(scale * a.shape[0], 6) for a, _, scale in modules.values()}
    alpha = alphas.pop() if len(alphas) == 1 and min(alphas) > 0 else 0.0  # (0: none; a negative one is refused here)
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_type("adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", alpha)
    names = {module: name for name, module in GGUF_MODULES.items()}
    for (layer, module), (a, b, scale) in sorted(modules.items()):
        b = b if alpha else b * scale
        if arch in PERMUTED_ARCHITECTURES and module in ("q_proj", "k_proj"):  # convert_hf_to_gguf's permute
            heads = cfg.num_heads if module == "q_proj" else cfg.num_kv_heads
            b = b.reshape(heads, 2, b.shape[0] // heads // 2, b.shape[1]).transpose(1, 2).reshape(b.shape)
        for half, t in (("a", a), ("b", b)):
            writer.add_tensor(f"blk.{layer}.{names[module]}.weight.lora_{half}", t.float().contiguous().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(out)


def _is_number(value: object) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an int of hundreds of digits
        return False


def read_adapter(path: str | Path, cfg: ModelConfig) -> Modules:
    """The modules of the adapter at ``path``: a PEFT directory or a GGUF LoRA file."""
    path = Path(path).expanduser()
    if path.is_dir():
        modules = read_peft(path, cfg)
    elif path.is_file() and path.suffix == ".gguf":
        modules = read_gguf_lora(path, cfg)
    else:
        raise ModelLoadError(f"{path}: a LoRA adapter is a PEFT directory (adapter_config.json and "
                             f"adapter_model.safetensors) or a GGUF LoRA file (.gguf); neither is there")
    if not modules:
        raise ModelLoadError(f"{path}: the adapter adapts no module")
    return modules


def check_adapter_names(adapters: object) -> None:
    """``adapters`` is a mapping of at most MAX_ADAPTERS names (1 to 256 characters) to paths."""
    if adapters is None:
        return
    if not isinstance(adapters, Mapping) or len(adapters) > MAX_ADAPTERS or not all(
            isinstance(name, str) and 0 < len(name) <= 256 and isinstance(path, (str, Path))
            for name, path in adapters.items()):
        raise InvalidParameterError(f"lora_adapters must map at most {MAX_ADAPTERS} names (1 to 256 characters) to "
                                    f"adapter paths, got {reprlib.repr(adapters)}")
    for name, path in adapters.items():  # (they are shown as JSON: /v1/models, /lora-adapters)
        require_unicode("lora_adapters' name", name)
        require_unicode(f"lora_adapters' path of {name!r}", str(path))


def read_adapters(adapters: Mapping[str, str | Path], cfg: ModelConfig) -> dict[str, Modules]:
    """Each adapter of ``adapters`` (name -> path) read and checked against a model of ``cfg``."""
    return {name: read_adapter(path, cfg) for name, path in adapters.items()}


def lora_weights(adapters: Mapping[str, Modules], model: Transformer, sources: list[str]) -> LoraWeights | None:
    """The adapters as the model applies them (float32, each B scaled and transposed, on the model's device), read
    from ``sources``; None without any."""
    if not adapters:
        return None
    cfg = model.config
    device = model.model.norm.weight.device
    parts: dict[tuple[int, int, str], list[LoraPart]] = {}
    for slot, modules in enumerate(adapters.values(), start=1):
        for (layer, module), (a, b, scale) in modules.items():
            part = LoraPart(_offset(cfg, module), a.contiguous().to(device), (b * scale).T.contiguous().to(device))
            parts.setdefault((slot, layer, MODULE_SITES[module]), []).append(part)
    return LoraWeights(list(adapters), parts, sources, cfg.num_layers)
