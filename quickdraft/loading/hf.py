"""Load a Hugging Face model directory (config.json + *.safetensors)."""
from __future__ import annotations

import functools
import json
import logging
from pathlib import Path
from typing import Any

import torch

from quickdraft.config import ModelConfig
from quickdraft.errors import ModelLoadError
from quickdraft.loading.checkpoint import Checkpoint, LazyTensors, fingerprint
from quickdraft.loading.tensor_set import check_tensor_set, expected_shapes
from quickdraft.loading.dequant import dequantize
from quickdraft.loading.hf_config import checkpoint_tensors, config_from_hf, is_offset_norm
from quickdraft.loading.hf_mxfp4 import MXFP4, take_mxfp4_experts
from quickdraft.loading.tensor_file import TensorFile, map_tensors

log = logging.getLogger(__name__)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} does not hold a JSON object")
    return data


def chat_template_from_dir(path: Path) -> str | None:
    """``chat_template.jinja`` if present, else ``chat_template`` of tokenizer_config.json."""
    jinja = path / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    tok_cfg = path / "tokenizer_config.json"
    if not tok_cfg.is_file():
        return None
    template = _read_json(tok_cfg).get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": "..."}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        return named.get("default") or next(iter(named.values()), None)
    return template if isinstance(template, str) else None


def weight_files(path: Path) -> list[Path]:
    """The safetensors files of an HF directory, from the shard index when there is one."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelLoadError(f"{index} has no weight_map")
        files = [path / name for name in dict.fromkeys(weight_map.values())]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{path}: shard(s) listed in {index.name} are missing: {', '.join(missing)}")
        return files
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        others = sorted(p.name for p in path.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".gguf"))
        hint = f" (found {', '.join(others)}; only safetensors weights are supported)" if others else ""
        raise ModelLoadError(f"{path} has no *.safetensors weights{hint}")
    return files


def load_hf_dir(path: str | Path, dtype: torch.dtype = torch.float32) -> Checkpoint:
    """Load a Hugging Face directory of a supported family (``hf_config.MODEL_TYPES``); safetensors are memory-mapped, each tensor converted to
    ``dtype`` when it is read (no copy when the stored dtype already is ``dtype``)."""
    path = Path(path).resolve()
    if not path.is_dir():
        raise ModelLoadError(f"model directory not found: {path}")
    config_path = path / "config.json"
    if not config_path.is_file():
        raise ModelLoadError(f"{path} has no config.json; a Hugging Face model directory needs config.json and *.safetensors")
    cfg_json = _read_json(config_path)
    gen_path = path / "generation_config.json"
    generation = _read_json(gen_path) if gen_path.is_file() else {}
    kwargs = config_from_hf(cfg_json, generation, path)
    files = weight_files(path)

    tensors: dict[str, torch.Tensor] = {}
    mapped = []
    for f in files:
        try:
            part, _, mapping = map_tensors(f)
        except Exception as exc:
            raise ModelLoadError(f"{f} is a corrupt or truncated safetensors file: {exc}") from exc
        mapped.append(TensorFile(part, {}, mapping))
        tensors.update((name, t) for name, t in part.items() if not name.endswith("rotary_emb.inv_freq"))

    embed = tensors.get("model.embed_tokens.weight")
    if embed is None:
        raise ModelLoadError(f"{path}: checkpoint is missing tensor model.embed_tokens.weight")
    kwargs["vocab_size"] = int(embed.shape[0])
    kwargs["attention_bias"] = kwargs["attention_bias"] or "model.layers.0.self_attn.q_proj.bias" in tensors
    # transformers' Llama, Qwen3, Gemma 3, Granite, OLMo 2... give o_proj a bias with attention_bias too (Qwen2 not)
    kwargs["attention_out_bias"] = kwargs.get("attention_out_bias") or "model.layers.0.self_attn.o_proj.bias" in tensors
    try:
        cfg = ModelConfig(**kwargs)
    except ValueError as exc:
        raise ModelLoadError(f"{config_path}: {exc}") from exc
    packed = take_mxfp4_experts(tensors, cfg)  # gpt-oss's released experts: GGUF MXFP4 blocks when read
    tensors = checkpoint_tensors(tensors, cfg)
    if cfg.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    check_tensor_set({**{k: tuple(v.shape) for k, v in tensors.items()}, **{k: s for k, (_, s) in packed.items()}},
                     cfg, path)
    wanted = expected_shapes(cfg)
    extra = sorted(set(tensors) - set(wanted))
    if extra:
        log.warning("%s: ignoring %d unused tensors (e.g. %s)", path, len(extra), extra[0])
        for name in extra:
            del tensors[name]
    if cfg.tie_word_embeddings:
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    makers = {name: functools.partial(_converted, t, dtype, is_offset_norm(name, cfg)) for name, t in tensors.items()}
    makers.update((name, functools.partial(_dequantized, blocks, shape, dtype)) for name, (blocks, shape) in
                  packed.items())
    return Checkpoint(
        config=cfg, tensors=LazyTensors(makers), source=path, fingerprint=fingerprint(path),
        chat_template=chat_template_from_dir(path), gguf_metadata=None, hf_dir=path,
        quantization="safetensors",
        tensor_types={name: "MXFP4" for name in packed} if packed else None,
        blocks=LazyTensors({name: blocks for name, (blocks, _) in packed.items()}) if packed else None,
        block_types=dict.fromkeys(packed, MXFP4) if packed else None,
        dtype=dtype, files=mapped,
    )


def _dequantized(blocks, shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    return dequantize(blocks(), MXFP4, shape).to(dtype)


def _converted(t: torch.Tensor, dtype: torch.dtype, add_one: bool = False) -> torch.Tensor:
    if add_one:  # 1 + weight in float32, as HF's Gemma norm computes it
        return (t.float() + 1.0).to(dtype)
    return t if t.dtype == dtype else t.to(dtype)
