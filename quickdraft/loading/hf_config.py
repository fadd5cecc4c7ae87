"""A Hugging Face config.json as a ``ModelConfig``: one function per family difference, read from both the keys
checkpoints on the Hub use (``rope_theta``, ``rope_scaling``, ``rope_local_base_freq``, ``sliding_window_pattern``)
and the ones transformers 5 writes (``rope_parameters``, per layer type for Gemma 3, and ``layer_types``)."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from quickdraft.config import LAYER_TYPES, MAX_WIDTH, ROPE_TYPES, ModelConfig, RopeScaling, every_nth_full
from quickdraft.errors import ModelLoadError

log = logging.getLogger(__name__)

# model_type in config.json -> our architecture name
MODEL_TYPES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2",
               "gemma3_text": "gemma3", "phi3": "phi3", "smollm3": "smollm3", "granite": "granite", "olmo2": "olmo2",
               "qwen3_moe": "qwen3_moe", "mixtral": "mixtral", "olmoe": "olmoe",
               "gpt_oss": "gpt_oss"}
_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}
# transformers' defaults where a family's config.json leaves a key out and the family's default is not Llama's
_FAMILY_DEFAULTS = {
    "gemma2": {"head_dim": 256, "hidden_activation": "gelu_pytorch_tanh", "sliding_window": 4096},
    "gemma3": {"head_dim": 256, "hidden_activation": "gelu_pytorch_tanh", "sliding_window": 4096},
}
# transformers' older names for the same scalings
_ROPE_ALIASES = {"su": "longrope", None: "default"}


def _ids(value: Any) -> list[int]:
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _object(value: Any, what: str) -> dict[str, Any]:
    """A JSON object of the config ({} where it is absent)."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ModelLoadError(f"{what} is {type(value).__name__} {value!r:.60}; it must be an object")
    return value


def _numbers(value: Any, what: str) -> tuple:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise ModelLoadError(f"{what} is {type(value).__name__} {value!r:.60}; it must be a list of numbers")
    return tuple(value)


def _rope_scaling(params: dict[str, Any], cfg: dict[str, Any]) -> RopeScaling | None:
    """One rope entry (``rope_scaling`` or one ``rope_parameters``) as a RopeScaling; None for plain RoPE. Values go
    to RopeScaling as written, which checks their types and ranges."""
    kind = params.get("rope_type", params.get("type"))
    if kind is not None and not isinstance(kind, str):
        raise ModelLoadError(f"rope_type is {kind!r:.60}; supported: {', '.join(ROPE_TYPES)}")
    kind = _ROPE_ALIASES.get(kind, kind)
    if kind not in ROPE_TYPES:
        raise ModelLoadError(f"rope scaling {kind!r} is not supported; supported: {', '.join(ROPE_TYPES)}")
    if kind == "default":
        return None
    original = params.get("original_max_position_embeddings") or cfg.get("original_max_position_embeddings")
    if kind == "dynamic":  # HF stretches from max_position_embeddings itself
        original = original or cfg.get("max_position_embeddings")
    factor = params.get("factor", 1.0)
    if kind == "longrope" and "factor" not in params and isinstance(original, int) and original > 0:
        factor = max(1.0, cfg.get("max_position_embeddings", original) / original)  # transformers' default
    try:
        return RopeScaling(
            type=kind, factor=factor, low_freq_factor=params.get("low_freq_factor", 1.0),
            high_freq_factor=params.get("high_freq_factor", 4.0), original_max_position_embeddings=original,
            short_factor=_numbers(params.get("short_factor"), "short_factor"),
            long_factor=_numbers(params.get("long_factor"), "long_factor"),
            attention_factor=params.get("attention_factor"), beta_fast=params.get("beta_fast") or 32.0,
            beta_slow=params.get("beta_slow") or 1.0, truncate=params.get("truncate", True),
        )
    except ValueError as exc:
        raise ModelLoadError(str(exc)) from exc


def _rope(cfg: dict[str, Any], arch: str, head_dim: int) -> dict[str, Any]:
    """rope_theta, rope_scaling (of full layers), local_rope_theta (of sliding layers, if their own) and rotary_dim
    (Phi-3's ``partial_rotary_factor``: the first int(head_dim * factor) dims of each head, as transformers cuts them;
    the other families' transformers code rotates whole heads)."""
    params = _object(cfg.get("rope_parameters"), "rope_parameters")
    full, local = params, {}
    if any(t in params for t in LAYER_TYPES):  # transformers 5: one entry per layer type
        full = _object(params.get("full_attention"), "rope_parameters.full_attention")
        local = _object(params.get("sliding_attention"), "rope_parameters.sliding_attention")
    scaling = _object(cfg["rope_scaling"], "rope_scaling") if cfg.get("rope_scaling") is not None else full
    if local and _rope_scaling(local, cfg) is not None:
        raise ModelLoadError("rope scaling of sliding layers is not supported")
    factor = cfg.get("partial_rotary_factor", full.get("partial_rotary_factor", 1.0))
    if not isinstance(factor, (int, float)) or isinstance(factor, bool) or not 0 < factor <= 1:
        raise ModelLoadError(f"partial_rotary_factor={factor!r:.40}; allowed: a number above 0 up to 1")
    rotary_dim = None
    if factor != 1:
        if arch != "phi3":
            raise ModelLoadError(f"partial_rotary_factor={factor!r:.40} is supported for phi3 only (transformers "
                                 f"rotates whole heads of {arch})")
        rotary_dim = int(head_dim * factor)
        if rotary_dim < 2 or rotary_dim % 2:
            raise ModelLoadError(f"partial_rotary_factor={factor!r:.40} rotates {rotary_dim} of each head's "
                                 f"{head_dim} dims; RoPE needs an even number of at least 2")
    return dict(rope_theta=cfg.get("rope_theta", full.get("rope_theta", 10000.0)),
                rope_scaling=_rope_scaling(scaling, cfg),
                local_rope_theta=cfg.get("rope_local_base_freq", local.get("rope_theta")), rotary_dim=rotary_dim)


def _unrotated_layers(cfg: dict[str, Any], num_layers: int) -> tuple[int, ...]:
    """SmolLM3's NoPE layers: ``no_rope_layers`` holds 1 for each layer that rotates, 0 for one that does not; where
    it is absent, every ``no_rope_layer_interval``-th layer does not (transformers' default)."""
    flags = cfg.get("no_rope_layers")
    if flags is None:
        interval = cfg.get("no_rope_layer_interval", 4)
        if not isinstance(interval, int) or isinstance(interval, bool) or interval < 1:
            raise ModelLoadError(f"no_rope_layer_interval={interval!r:.40}; it must be an int of at least 1")
        return tuple(i for i in range(num_layers) if (i + 1) % interval == 0)
    if not isinstance(flags, list) or len(flags) != num_layers or any(f not in (0, 1) or isinstance(f, float)
                                                                      for f in flags):
        raise ModelLoadError(f"no_rope_layers={flags!r:.60}; it must list 1 (RoPE) or 0 (none) for each of the "
                             f"{num_layers} layers")
    return tuple(i for i, f in enumerate(flags) if not f)


def _layer_types(cfg: dict[str, Any], arch: str, num_layers: int) -> tuple[tuple[str, ...], Any]:
    """Each layer's attention and the sliding window, as transformers decides them per family (ModelConfig checks
    the values)."""
    window = cfg.get("sliding_window")
    types = cfg.get("layer_types")
    if arch in ("qwen2", "qwen3", "qwen3_moe", "smollm3") and not cfg.get("use_sliding_window") or arch == "olmo2":
        window = None  # Qwen and SmolLM3 configs carry a window that only use_sliding_window switches on; OLMo 2's none
    if window is None:
        return (), None
    if types is not None:
        return tuple(_numbers(types, "layer_types")), window
    if arch == "gemma2":  # transformers: every 2nd layer full, the first one slides
        return every_nth_full(num_layers, 2), window
    if arch == "gemma3":
        pattern = cfg.get("sliding_window_pattern", 6)
        if not isinstance(pattern, int) or isinstance(pattern, bool) or pattern < 1:
            raise ModelLoadError(f"sliding_window_pattern={pattern!r}; it must be an int of at least 1")
        return every_nth_full(num_layers, pattern), window
    if arch in ("qwen2", "qwen3", "qwen3_moe"):
        first = cfg.get("max_window_layers", num_layers)
        return tuple("sliding_attention" if i >= first else "full_attention" for i in range(num_layers)), window
    return (), window  # Mistral, Phi-3: every layer slides


def _gemma(cfg: dict[str, Any], arch: str, hidden: int) -> dict[str, Any]:
    """Gemma 2 and 3: norms around attention and the MLP (stored as weight, scaling by 1 + weight), embeddings times
    sqrt(hidden), a query scale of its own, the final logits soft-capped where set; Gemma 2 soft-caps attention scores
    too (transformers' defaults 50 and 30 where config.json leaves them out; null: no cap), Gemma 3 norms q and k per
    head instead (transformers' Gemma 3 reads no attention cap, whatever its config says)."""
    if cfg.get("use_bidirectional_attention"):
        raise ModelLoadError("use_bidirectional_attention=true (an embedding model) is not supported")
    out = dict(sandwich_norms=True, embedding_multiplier=hidden ** 0.5, query_pre_attn_scalar=cfg.get(
        "query_pre_attn_scalar", 256), final_logit_softcapping=cfg.get("final_logit_softcapping",
                                                                       30.0 if arch == "gemma2" else None))
    if arch == "gemma2":
        return {**out, "attn_logit_softcapping": cfg.get("attn_logit_softcapping", 50.0)}
    if cfg.get("attn_logit_softcapping") is not None:
        log.warning("attn_logit_softcapping=%r is ignored, as transformers' and llama.cpp's Gemma 3 ignore it",
                    cfg["attn_logit_softcapping"])
    return {**out, "qk_norm": True}


def _granite(cfg: dict[str, Any]) -> dict[str, Any]:
    """Granite's four multipliers (transformers' defaults 1; ModelConfig checks their ranges)."""
    return dict(embedding_multiplier=cfg.get("embedding_multiplier", 1.0),
                attention_multiplier=cfg.get("attention_multiplier", 1.0),
                residual_multiplier=cfg.get("residual_multiplier", 1.0), logits_scaling=cfg.get("logits_scaling", 1.0))


def _experts(cfg: dict[str, Any], arch: str, num_layers: int) -> dict[str, Any]:
    """A mixture's fields, with each family's transformers defaults where config.json leaves one out: Mixtral always
    renormalizes its top-k, Qwen3-MoE and OLMoE by ``norm_topk_prob`` (false by default); Qwen3-MoE's experts have
    their own width and some layers may stay dense (``mlp_only_layers``, ``decoder_sparse_step``); OLMoE normalizes
    all of q and k and may clamp them."""
    if arch not in ("qwen3_moe", "mixtral", "olmoe", "gpt_oss"):
        return {}
    count = cfg.get("num_experts", cfg.get("num_local_experts"))  # transformers 5 writes num_local_experts
    out = dict(num_experts=count, num_experts_per_tok=cfg.get("num_experts_per_tok"),
               norm_topk_prob=True if arch in ("mixtral", "gpt_oss") else _flag(cfg, "norm_topk_prob", False))
    if arch == "gpt_oss":  # softmax over the top-k logits: softmax, top-k, renormalized
        out.update(attention_sinks=True, attention_out_bias=_flag(cfg, "attention_bias", True), router_bias=True,
                   expert_bias=True, swiglu_limit=cfg.get("swiglu_limit", 7.0), swiglu_alpha=cfg.get("swiglu_alpha", 1.702))
    if arch == "qwen3_moe":
        step, dense = cfg.get("decoder_sparse_step", 1), cfg.get("mlp_only_layers") or []
        if not isinstance(step, int) or isinstance(step, bool) or step < 1 or not isinstance(dense, list):
            raise ModelLoadError(f"decoder_sparse_step={step!r:.40} and mlp_only_layers={dense!r:.60} must be an int "
                                 "of at least 1 and a list of layer numbers")
        out.update(expert_intermediate_size=cfg.get("moe_intermediate_size"), qk_norm=True,
                   dense_layers=tuple(sorted({*dense, *(i for i in range(num_layers) if (i + 1) % step)})))
    if arch == "olmoe":
        out.update(qk_norm=True, qk_norm_per_head=False, clip_qkv=cfg.get("clip_qkv"))
    if cfg.get("shared_expert_intermediate_size"):
        raise ModelLoadError("shared experts are not supported")
    return out


def _flag(cfg: dict[str, Any], key: str, default: bool) -> bool:
    value = cfg.get(key, default)
    if not isinstance(value, bool):
        raise ModelLoadError(f"{key} is {value!r:.60}; it must be true or false")
    return value


def config_from_hf(cfg: dict[str, Any], generation: dict[str, Any], path: Path) -> dict[str, Any]:
    """ModelConfig keyword arguments from config.json (vocab size and bias are settled from the tensors)."""
    where = path / "config.json"
    model_type = cfg.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ModelLoadError(f"{where}: unsupported model_type {model_type!r}; supported: {', '.join(MODEL_TYPES)}")
    arch = MODEL_TYPES[model_type]
    cfg = {**_FAMILY_DEFAULTS.get(arch, {}), **cfg}  # (Gemma's MLP reads hidden_activation alone, as transformers')
    try:
        hidden, heads, num_layers = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_hidden_layers"]
        if not isinstance(num_layers, int) or isinstance(num_layers, bool) or not 1 <= num_layers <= MAX_WIDTH:
            raise ModelLoadError(f"num_hidden_layers={num_layers!r:.40}; allowed: an int in 1 to {MAX_WIDTH:,}")
        if cfg.get("mlp_bias"):
            raise ModelLoadError("mlp_bias=true is not supported")
        act = cfg.get("hidden_activation", cfg.get("hidden_act", "silu"))
        if act not in _ACTIVATIONS:
            raise ModelLoadError(f"activation {act!r} is not supported; supported: {', '.join(_ACTIVATIONS)}")
        layer_types, window = _layer_types(cfg, arch, num_layers)
        head_dim = cfg.get("head_dim") or hidden // heads
        eos = _ids(cfg.get("eos_token_id")) + _ids(generation.get("eos_token_id"))
        bos = cfg.get("bos_token_id")
        kwargs = dict(
            architecture=arch,
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            attention_bias=_flag(cfg, "attention_bias", arch in ("qwen2", "gpt_oss")),
            tie_word_embeddings=_flag(cfg, "tie_word_embeddings", arch in ("gemma2", "gemma3")),
            bos_token_id=bos if isinstance(bos, int) and not isinstance(bos, bool) else None,
            eos_token_ids=tuple(dict.fromkeys(eos)),
            hidden_act=_ACTIVATIONS[act],
            sliding_window=window,
            layer_types=layer_types,
            qk_norm=arch == "qwen3",
            unrotated_layers=_unrotated_layers(cfg, num_layers) if arch == "smollm3" else (),
            **_rope(cfg, arch, head_dim),
        )
        if arch in ("gemma2", "gemma3"):
            kwargs.update(_gemma(cfg, arch, hidden))
        elif arch == "granite":
            kwargs.update(_granite(cfg))
        elif arch == "olmo2":  # norms after attention and the MLP only; all of q and of k normed at once
            kwargs.update(sandwich_norms=True, pre_norms=False, qk_norm=True, qk_norm_per_head=False)
        kwargs.update(_experts(cfg, arch, num_layers))
        scaling = kwargs["rope_scaling"]
        if scaling is not None and scaling.type == "dynamic":  # the context it stretches to
            stretched = int(scaling.original_max_position_embeddings * scaling.factor)
            kwargs["max_position_embeddings"] = max(kwargs["max_position_embeddings"], stretched)
        return kwargs
    except ModelLoadError as exc:
        raise ModelLoadError(f"{where}: {exc}") from exc
    except KeyError as exc:
        raise ModelLoadError(f"{where} is missing {exc.args[0]!r}") from exc
    except (TypeError, ValueError, ArithmeticError, AttributeError) as exc:
        raise ModelLoadError(f"{where} has an invalid value: {exc}") from exc


def checkpoint_tensors(tensors: dict[str, Any], cfg: ModelConfig) -> dict[str, Any]:
    """HF tensors under the names the model takes: Phi-3's fused q/k/v and gate/up split into row slices (views,
    no copy)."""
    q, kv, f = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    out = {}
    tensors = _expert_tensors(tensors, cfg)
    for name, t in tensors.items():
        fused_and_split = name.replace("qkv_proj", "q_proj") if "qkv_proj" in name else \
            name.replace("gate_up_proj", "gate_proj") if "gate_up_proj" in name else None
        if fused_and_split is not None and fused_and_split in tensors:
            raise ModelLoadError(f"the checkpoint holds both {name} and {fused_and_split}; one of them is extra")
        if name.endswith("self_attn.qkv_proj.weight"):
            prefix = name.removesuffix("qkv_proj.weight")
            out.update({prefix + "q_proj.weight": t[:q], prefix + "k_proj.weight": t[q:q + kv],
                        prefix + "v_proj.weight": t[q + kv:]})
        elif name.endswith("mlp.gate_up_proj.weight"):
            prefix = name.removesuffix("gate_up_proj.weight")
            out.update({prefix + "gate_proj.weight": t[:f], prefix + "up_proj.weight": t[f:]})
        else:
            out[name] = t
    return out


# Mixtral's names for a mixture's tensors -> the names the model takes (Qwen3-MoE's and OLMoE's)
_MIXTRAL_NAMES = {"block_sparse_moe.gate.": "mlp.gate.", ".w1.": ".gate_proj.", ".w3.": ".up_proj.",
                  ".w2.": ".down_proj."}


def _expert_tensors(tensors: dict[str, Any], cfg: ModelConfig) -> dict[str, Any]:
    """A mixture's tensors under per-expert names: Mixtral's ``block_sparse_moe.experts.E.w1/w3/w2`` renamed, and
    transformers 5's stacked ``mlp.experts.gate_up_proj [E, 2I, H]`` / ``down_proj [E, H, I]`` cut into each
    expert's views (no copy); a stacked tensor of the wrong shape is left whole, for the shape check to name."""
    if not cfg.num_experts:
        return tensors
    if cfg.architecture == "gpt_oss":
        return _gpt_oss_expert_tensors(tensors, cfg)
    out, width = {}, cfg.expert_width
    for name, t in tensors.items():
        if ".block_sparse_moe." in name:
            name = name.replace("block_sparse_moe.experts.", "mlp.experts.")
            for old, new in _MIXTRAL_NAMES.items():
                name = name.replace(old, new)
        stacked = name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj"))
        if stacked and len(t.shape) == 3 and t.shape[0] == cfg.num_experts:
            prefix = name.rpartition(".")[0]
            for e in range(cfg.num_experts):
                if name.endswith("gate_up_proj") and t.shape[1] == 2 * width:
                    out[f"{prefix}.{e}.gate_proj.weight"] = t[e, :width]
                    out[f"{prefix}.{e}.up_proj.weight"] = t[e, width:]
                elif name.endswith("down_proj"):
                    out[f"{prefix}.{e}.down_proj.weight"] = t[e]
            continue
        out[name] = t
    return out


def _gpt_oss_expert_tensors(tensors: dict[str, Any], cfg: ModelConfig) -> dict[str, Any]:
    """gpt-oss stores a layer's experts stacked and transposed (``x @ W``): ``gate_up_proj [E, H, 2I]`` with gate and
    up in alternate columns, ``down_proj [E, I, H]``, each with a bias; its router is ``mlp.router``. Each expert
    becomes an MLP's [out, in] weights (copies: the columns are strided) and biases."""
    out, width, experts = {}, cfg.expert_width, cfg.num_experts
    for name, t in tensors.items():
        prefix, _, leaf = name.rpartition(".")
        if ".mlp.router." in name:
            out[name.replace(".mlp.router.", ".mlp.gate.")] = t
            continue
        if not prefix.endswith("mlp.experts") or leaf not in ("gate_up_proj", "gate_up_proj_bias", "down_proj",
                                                                 "down_proj_bias"):
            out[name] = t
            continue
        shapes = {"gate_up_proj": (experts, cfg.hidden_size, 2 * width), "gate_up_proj_bias": (experts, 2 * width),
                  "down_proj": (experts, width, cfg.hidden_size), "down_proj_bias": (experts, cfg.hidden_size)}
        if tuple(t.shape) != shapes[leaf]:
            raise ModelLoadError(f"{name} has shape {list(t.shape)}; the config needs {list(shapes[leaf])}")
        for e in range(experts):
            if leaf == "gate_up_proj":
                out[f"{prefix}.{e}.gate_proj.weight"] = t[e, :, 0::2].t().contiguous()
                out[f"{prefix}.{e}.up_proj.weight"] = t[e, :, 1::2].t().contiguous()
            elif leaf == "gate_up_proj_bias":
                out[f"{prefix}.{e}.gate_proj.bias"] = t[e, 0::2].contiguous()
                out[f"{prefix}.{e}.up_proj.bias"] = t[e, 1::2].contiguous()
            elif leaf == "down_proj":
                out[f"{prefix}.{e}.down_proj.weight"] = t[e].t().contiguous()
            else:
                out[f"{prefix}.{e}.down_proj.bias"] = t[e]
    return out


def is_offset_norm(name: str, cfg: ModelConfig) -> bool:
    """Gemma's norms scale by 1 + weight; the model scales by its weight, so these get 1 added when loaded (GGUF
    files store them so already)."""
    return cfg.architecture in ("gemma2", "gemma3") and name.endswith("norm.weight")
