"""What each GGUF architecture means, as llama.cpp's converter writes it: the HF names of its tensors, and the
ModelConfig fields its metadata (and a few small tensors) imply beyond Llama's.

Tensor names (``hf_targets``). ``attn_norm`` and ``ffn_norm`` are the norms before attention and before the MLP. HF
Llama calls the second ``post_attention_layernorm``; where a block also has ``post_attention_norm`` (Gemma's norms
after attention and after the MLP, with ``post_ffw_norm``) HF calls it ``pre_feedforward_layernorm``. Phi-3 stores
q/k/v as one ``attn_qkv`` (rows q, then k, then v) and gate/up as one ``ffn_up`` (rows gate, then up; its blocks have
no ``ffn_gate``): each HF tensor is a row range of the stored one (``fused_rows``), and since GGUF stores rows whole,
a contiguous byte range of it, so float and quantized loads both read only their own rows.

Config (``family_fields``):

* qwen3: q and k normed per head (``attn_q_norm``/``attn_k_norm``).
* gemma3: norms around attention and MLP, q/k norms, GELU-tanh, embeddings times sqrt(hidden), a tied head. The file
  stores no layer pattern, no local RoPE base and no query scale: like llama.cpp and transformers, every 6th layer is
  full and the others slide over ``gemma3.attention.sliding_window`` (none when it is 0 or absent), sliding layers
  use RoPE base 10000, and the attention scale is 1/sqrt(head_dim) (1/sqrt(hidden/heads) for the 62-layer 27B). Its
  norm weights are stored as 1 + w, which is what the model multiplies by.
* gemma2: Gemma 3's layout without q/k norms; attention scores and the final logits soft-capped
  (``gemma2.attn_logit_softcapping``, ``gemma2.final_logit_softcapping``), every 2nd layer full and the others
  (the first one too) sliding over ``gemma2.attention.sliding_window``, with llama.cpp's defaults (50, 30, 4096)
  where a key is absent; see ``_gemma2``.
* phi3: ``phi3.attention.sliding_window`` is ignored, as llama.cpp does (its converters fill it wrongly). A
  ``phi3.rope.dimension_count`` below the head dimension rotates that many dims of each head (Phi-4-mini: 96 of
  128), llama.cpp's NeoX RoPE over ``n_rot`` dims as transformers' ``partial_rotary_factor``.
* smollm3: Llama's layout (q/k rows permuted by the converter) with every 4th layer (3, 7, ...) attending without
  RoPE, which llama.cpp hard-codes as the file stores no key for it.
* granite: Llama's layout with transformers' multipliers under llama.cpp's names: ``granite.embedding_scale``,
  ``granite.attention.scale`` (the attention scale itself; 0 or absent: 1/sqrt(head_dim)), ``granite.residual_scale``
  and ``granite.logit_scale`` (the logits' divisor); ``granite.rope.scaling.finetuned`` false means no RoPE at all.
* olmo2: norms only after attention (``post_attention_norm``) and after the MLP (``post_ffw_norm``), and q and k
  each normed whole (``attn_q_norm``/``attn_k_norm`` as wide as all their heads). A sliding window (OLMo 3, which
  llama.cpp runs as olmo2) is refused.
* mixtures of experts (``{arch}.expert_count``): ``qwen3moe``, ``olmoe``, ``gpt-oss``, and ``llama`` with experts
  (Mixtral, run as ``mixtral``). A block's experts are stacked in ``ffn_gate_exps``/``ffn_up_exps`` ``[E, I, H]`` and
  ``ffn_down_exps`` ``[E, H, I]``, quantized per row; expert e is rows ``e * I .. (e + 1) * I`` of the stack seen as
  2-D, a contiguous byte range, so each expert is a tensor of its own (``experts.E.gate_proj``...) read at its own
  type. The router is ``ffn_gate_inp``; a block without one keeps a dense MLP. The top-k weights are renormalized as
  llama.cpp does per architecture (qwen3moe, gpt-oss and llama: yes, olmoe: no; ``{arch}.expert_weights_norm``
  where written). Shared experts and gating other than softmax are refused.
* gpt-oss: a bias on q/k/v/o, on the router (``ffn_gate_inp.bias``) and on each expert (``ffn_*_exps.bias``, stacked
  ``[E, rows]``); a sink logit per head (``attn_sinks.weight``); every other layer slides over
  ``gpt-oss.attention.sliding_window``, the first one included (llama.cpp's pattern of 2); YaRN over
  ``rope.scaling.original_context_length`` with the released model's settings the file does not store (beta 32/1,
  the band not rounded: its config's ``truncate: false``); the clamped SwiGLU's alpha 1.702 and limit 7 (llama.cpp's
  constants too).

RoPE scaling and the dims it rotates come from ``gguf_rope.py``. Soft caps are read for gemma2 (both) and gemma3 (the
final logits' cap, as llama.cpp reads it; an attention cap llama.cpp and transformers ignore for Gemma 3, and so does
this loader).
"""
from __future__ import annotations

import logging
import math
import re
from collections.abc import Container
from pathlib import Path
from typing import Any

from quickdraft.config import (ATTENTION_MULTIPLIER_RANGE, MAX_CONTEXT, MAX_WIDTH, SCALAR_RANGE, THETA_RANGE,
                               ModelConfig, every_nth_full)
from quickdraft.errors import ModelLoadError
from quickdraft.loading.gguf_metadata import int_value, positive_float, show
from quickdraft.loading.gguf_rope import FloatReader, rope_scaling, rotary_dims

log = logging.getLogger(__name__)

GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
LAYER_NAMES = {  # GGUF name in a block -> the HF names it holds, in row order
    "attn_q": ("self_attn.q_proj",),
    "attn_k": ("self_attn.k_proj",),
    "attn_v": ("self_attn.v_proj",),
    "attn_qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "attn_output": ("self_attn.o_proj",),
    "attn_q_norm": ("self_attn.q_norm",),
    "attn_k_norm": ("self_attn.k_norm",),
    "ffn_gate": ("mlp.gate_proj",),
    "ffn_up": ("mlp.up_proj",),
    "ffn_down": ("mlp.down_proj",),
    "ffn_gate_inp": ("mlp.gate",),
    "attn_sinks": ("self_attn.sinks",),
    "attn_norm": ("input_layernorm",),
    "ffn_norm": ("post_attention_layernorm",),
    "post_attention_norm": ("post_attention_layernorm",),
    "post_ffw_norm": ("post_feedforward_layernorm",),
}
LAYER_RE = re.compile(r"blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
EXPERT_NAMES = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}  # stacked
GGUF_ARCHITECTURES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2",
                      "gemma3": "gemma3", "phi3": "phi3", "smollm3": "smollm3", "granite": "granite", "olmo2": "olmo2",
                      "qwen3moe": "qwen3_moe", "olmoe": "olmoe",
                      "gpt-oss": "gpt_oss"}  # general.architecture -> ours
MAX_EXPERTS = 1 << 12
# read into the config (RoPE factors), or not needed (rotary tables are recomputed)
IGNORED = re.compile(r"(rope_freqs\.weight|rope_factors_(long|short)\.weight|blk\.\d+\.attn_rot_embd.*)$")
QK_NORM_ARCHITECTURES = ("qwen3", "gemma3", "qwen3moe", "olmoe", "olmo2")
SMOLLM3_NOPE_STEP = 4  # every 4th layer attends without RoPE (llama.cpp hard-codes it; the file stores no key)
GEMMA3_PATTERN = 6  # every 6th layer attends to the whole context
GEMMA3_LOCAL_ROPE_THETA = 10000.0
# llama.cpp's Gemma 2 defaults where the file has no key: a window of 4096 on every 2nd layer (the first one slides),
# scores soft-capped at 50, logits at 30
GEMMA2_WINDOW, GEMMA2_PATTERN, GEMMA2_SOFTCAPS = 4096, 2, (50.0, 30.0)


def is_stacked(gguf_name: str) -> bool:
    """A block's experts stacked in one tensor (``ffn_*_exps``)."""
    m = LAYER_RE.match(gguf_name)
    return m is not None and m.group(2) in EXPERT_NAMES


def hf_targets(gguf_name: str, names: Container[str], experts: int = 0) -> tuple[str, ...]:
    """HF names of the tensors a GGUF tensor holds: one, several in row order for a fused one (``experts`` of them for
    a stacked one), or none for a tensor the model does not use. ``names``: the file's tensor names (a block's others
    tell what ffn_norm and ffn_up are)."""
    if gguf_name in GLOBAL_NAMES:
        return (GLOBAL_NAMES[gguf_name],)
    m = LAYER_RE.match(gguf_name)
    if m is not None and m.group(2) in EXPERT_NAMES:
        layer, kind, suffix = m.groups()
        return tuple(f"model.layers.{layer}.mlp.experts.{e}.{EXPERT_NAMES[kind]}.{suffix}" for e in range(experts))
    if m is None or m.group(2) not in LAYER_NAMES:
        return ()
    layer, kind, suffix = m.groups()
    if kind == "attn_sinks":  # a parameter of its own, not a module's weight
        return (f"model.layers.{layer}.self_attn.sinks",)
    targets = LAYER_NAMES[kind]
    if kind == "ffn_norm" and f"blk.{layer}.post_attention_norm.weight" in names:
        targets = ("pre_feedforward_layernorm",)
    elif kind == "ffn_up" and f"blk.{layer}.ffn_gate.weight" not in names:
        targets = ("mlp.gate_proj", "mlp.up_proj")
    return tuple(f"model.layers.{layer}.{t}.{suffix}" for t in targets)


def fused_rows(targets: tuple[str, ...], cfg: ModelConfig) -> tuple[int, ...]:
    """The rows each of ``targets`` (``hf_targets`` of one fused tensor) takes from it, in order."""
    kv = cfg.num_kv_heads * cfg.head_dim
    rows = {"q_proj": cfg.num_heads * cfg.head_dim, "k_proj": kv, "v_proj": kv,
            "gate_proj": cfg.intermediate_size, "up_proj": cfg.intermediate_size}
    return tuple(rows[t.split(".")[-2]] for t in targets)


_END_OF_TURN = {  # besides <|im_end|>: the end-of-turn tokens llama.cpp and the HF generation configs stop on
    "qwen2": ("<|endoftext|>",), "qwen3": ("<|endoftext|>",), "qwen3moe": ("<|endoftext|>",),
    "gemma2": ("<end_of_turn>",), "gemma3": ("<end_of_turn>",),
    "phi3": ("<|end|>", "<|endoftext|>"),
    # harmony: <|return|> ends the final answer, <|call|> a tool call (<|end|> ends a message, not the turn)
    "gpt-oss": ("<|return|>", "<|call|>", "<|endoftext|>"),
}


def end_of_turn_texts(arch: str) -> tuple[str, ...]:
    return ("<|im_end|>",) + _END_OF_TURN.get(arch, ())


def family_fields(arch: str, metadata: dict[str, Any], shapes: dict[str, tuple[int, ...]], path: Path,
                  base: dict[str, Any], read_floats: FloatReader) -> dict[str, Any]:
    """The ModelConfig fields beyond Llama's that this family's metadata and tensors imply (see the module doc);
    ``base``: the Llama fields already read (hidden size, heads, head_dim, layers, context)."""
    rotary = rotary_dims(arch, metadata, path, base["head_dim"])
    out: dict[str, Any] = {
        "rope_scaling": rope_scaling(arch, metadata, shapes, path, rotary, base["max_position_embeddings"],
                                     read_floats),
        "qk_norm": arch in QK_NORM_ARCHITECTURES,
        "rotary_dim": None if rotary == base["head_dim"] else rotary,
    }
    if arch == "smollm3":
        out["unrotated_layers"] = tuple(i for i in range(base["num_layers"]) if (i + 1) % SMOLLM3_NOPE_STEP == 0)
    elif arch == "granite":
        out.update(_granite(metadata, path, base["num_layers"]))
    elif arch == "olmo2":
        window = metadata.get("olmo2.attention.sliding_window")
        if window not in (None, 0):
            raise ModelLoadError(f"{path}: GGUF metadata 'olmo2.attention.sliding_window' is {show(window)}: OLMo 3's "
                                 f"sliding layers are not supported yet (OLMo 2 files have none)")
        out.update(sandwich_norms=True, pre_norms=False, qk_norm_per_head=False)
    out.update(_experts(arch, metadata, shapes, path, base["num_layers"]))
    if arch == "gemma3":
        out.update(_gemma3(metadata, path, base))
    elif arch == "gemma2":
        out.update(_gemma2(metadata, path, base))
        if out["rope_scaling"] is not None and out["local_rope_theta"] is not None:
            raise ModelLoadError(f"{path}: GGUF metadata 'gemma2.rope.freq_base_swa' with RoPE scaling is not "
                                 f"supported (the sliding layers' own base would need the scaling too)")
    elif arch == "gpt-oss":
        out.update(_gpt_oss(metadata, shapes, path, base))
    elif arch == "phi3" and metadata.get("phi3.attention.sliding_window"):
        log.info("%s: ignoring phi3.attention.sliding_window=%s, as llama.cpp does", path.name,
                 metadata["phi3.attention.sliding_window"])
    return out


def _experts(arch: str, metadata: dict[str, Any], shapes: dict[str, tuple[int, ...]], path: Path,
             num_layers: int) -> dict[str, Any]:
    """A mixture's fields (see the module doc), every value range-checked before any tensor is read."""
    count = int_value(metadata, f"{arch}.expert_count", path, 0, MAX_EXPERTS, default=0)
    stacked = sorted(name for name in shapes if is_stacked(name))
    if not count:
        if stacked:
            raise ModelLoadError(f"{path}: tensor {stacked[0]} holds experts but GGUF metadata '{arch}.expert_count' "
                                 f"is absent or 0")
        return {}
    if arch not in ("qwen3moe", "olmoe", "llama", "gpt-oss"):
        raise ModelLoadError(f"{path}: experts in a {arch!r} file are not supported; mixtures supported: qwen3moe, "
                             f"olmoe, gpt-oss, llama (Mixtral)")
    used = int_value(metadata, f"{arch}.expert_used_count", path, 1, count)
    if int_value(metadata, f"{arch}.expert_shared_count", path, 0, MAX_EXPERTS, default=0):
        raise ModelLoadError(f"{path}: shared experts ({arch}.expert_shared_count) are not supported")
    gating = metadata.get(f"{arch}.expert_gating_func")
    if gating not in (None, 1):  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX
        raise ModelLoadError(f"{path}: GGUF metadata '{arch}.expert_gating_func' is {show(gating)}; only softmax "
                             f"gating (1) is supported")
    norm = metadata.get(f"{arch}.expert_weights_norm", arch != "olmoe")
    if not isinstance(norm, bool):
        raise ModelLoadError(f"{path}: GGUF metadata '{arch}.expert_weights_norm' is {show(norm)}; it must be a bool")
    width = int_value(metadata, f"{arch}.expert_feed_forward_length", path, 0, MAX_WIDTH, default=0)
    out: dict[str, Any] = dict(
        num_experts=count, num_experts_per_tok=used, expert_intermediate_size=width or None, norm_topk_prob=norm,
        dense_layers=tuple(i for i in range(num_layers) if f"blk.{i}.ffn_gate_inp.weight" not in shapes))
    if arch == "llama":
        out["architecture"] = "mixtral"
    if arch == "olmoe":
        clamp = metadata.get("olmoe.attention.clamp_kqv")
        out.update(qk_norm_per_head=False, clip_qkv=None if clamp in (None, 0, 0.0) else clamp)
    return out


def _granite(metadata: dict[str, Any], path: Path, num_layers: int) -> dict[str, Any]:
    """Granite's multipliers (see the module doc; a 0 means none, as llama.cpp reads it), each within the range
    ModelConfig allows, refused under its own key."""
    def scale(key: str, default: float | None, bounds: tuple[float, float]) -> float | None:
        return _bounded(metadata, key, path, default, bounds, zero=default)

    rotates = metadata.get("granite.rope.scaling.finetuned", True)
    if not isinstance(rotates, bool):
        raise ModelLoadError(f"{path}: GGUF metadata 'granite.rope.scaling.finetuned' is {show(rotates)}; it must be a "
                             f"bool")
    return dict(embedding_multiplier=scale("granite.embedding_scale", 1.0, SCALAR_RANGE),
                attention_multiplier=scale("granite.attention.scale", None, ATTENTION_MULTIPLIER_RANGE),
                residual_multiplier=scale("granite.residual_scale", 1.0, SCALAR_RANGE),
                logits_scaling=scale("granite.logit_scale", 1.0, SCALAR_RANGE),
                unrotated_layers=() if rotates else tuple(range(num_layers)))


GPT_OSS_SWIGLU = (1.702, 7.0)  # alpha, limit: the released models' (llama.cpp hard-codes them too)
GPT_OSS_PATTERN = 2  # every 2nd layer attends to the whole context, the others (the first one too) slide


def _gpt_oss(metadata: dict[str, Any], shapes: dict[str, tuple[int, ...]], path: Path,
             base: dict[str, Any]) -> dict[str, Any]:
    window = int_value(metadata, "gpt-oss.attention.sliding_window", path, 1, MAX_CONTEXT)
    alpha, limit = GPT_OSS_SWIGLU
    return dict(attention_sinks=True, attention_out_bias="blk.0.attn_output.bias" in shapes,
                router_bias="blk.0.ffn_gate_inp.bias" in shapes, expert_bias="blk.0.ffn_gate_exps.bias" in shapes,
                swiglu_alpha=alpha, swiglu_limit=limit, sliding_window=window,
                layer_types=every_nth_full(base["num_layers"], GPT_OSS_PATTERN))


def _bounded(metadata: dict[str, Any], key: str, path: Path, default: float | None, bounds: tuple[float, float],
             zero: float | None) -> float | None:
    """A positive number in ``bounds`` (``default`` where absent, ``zero`` where 0, as llama.cpp reads a 0), refused
    under its own key otherwise."""
    value = metadata.get(key)
    if type(value) in (int, float) and value == 0:
        return zero
    value = positive_float(metadata, key, path, default)
    low, high = bounds
    if value is not None and not low <= value <= high:
        raise ModelLoadError(f"{path}: GGUF metadata {key!r} is {value:g}; allowed: {low:g} to {high:g}")
    return value


def _gemma(base: dict[str, Any], layers_of_27b: int) -> dict[str, Any]:
    """What Gemma 2 and 3 share: norms around attention and the MLP, GELU-tanh, embeddings times sqrt(hidden), and
    llama.cpp's attention scale, 1/sqrt(head_dim), or 1/sqrt(hidden/heads) for the 27B (told by its layer count)."""
    hidden, heads = base["hidden_size"], base["num_heads"]
    return dict(sandwich_norms=True, hidden_act="gelu_tanh", embedding_multiplier=math.sqrt(hidden),
                query_pre_attn_scalar=float(hidden // heads if base["num_layers"] == layers_of_27b
                                            else base["head_dim"]))


def _gemma3(metadata: dict[str, Any], path: Path, base: dict[str, Any]) -> dict[str, Any]:
    if metadata.get("gemma3.attn_logit_softcapping") not in (None, 0, 0.0):
        log.warning("%s: ignoring GGUF metadata 'gemma3.attn_logit_softcapping', as llama.cpp and transformers do",
                    path.name)
    layers = base["num_layers"]
    out: dict[str, Any] = {
        **_gemma(base, layers_of_27b=62),
        "final_logit_softcapping": _bounded(metadata, "gemma3.final_logit_softcapping", path, None, SCALAR_RANGE,
                                            zero=None),
    }
    window = int_value(metadata, "gemma3.attention.sliding_window", path, 0, MAX_CONTEXT, default=0)
    if window:
        out.update(sliding_window=window, local_rope_theta=GEMMA3_LOCAL_ROPE_THETA,
                   layer_types=every_nth_full(layers, GEMMA3_PATTERN))
    return out


def _gemma2(metadata: dict[str, Any], path: Path, base: dict[str, Any]) -> dict[str, Any]:
    """Gemma 2 as llama.cpp reads it: Gemma's norms, activation and embedding scale; both soft-caps and the window
    (llama.cpp's defaults where absent, range-checked under their own keys); the sliding layers by
    ``attention.sliding_window_pattern`` (every n-th layer full; 0: none full) or as a flag per layer (true: slides),
    by default every 2nd full; ``rope.freq_base_swa`` the sliding layers' RoPE base where given; the attention scale
    1/sqrt(head_dim), or 1/sqrt(hidden/heads) for the 46-layer 27B. A cap of 0 caps nothing."""
    layers = base["num_layers"]
    caps = {key: _bounded(metadata, f"gemma2.{key}", path, default, SCALAR_RANGE, zero=None)
            for key, default in zip(("attn_logit_softcapping", "final_logit_softcapping"), GEMMA2_SOFTCAPS)}
    window = int_value(metadata, "gemma2.attention.sliding_window", path, 1, MAX_CONTEXT, default=GEMMA2_WINDOW)
    pattern = metadata.get("gemma2.attention.sliding_window_pattern", GEMMA2_PATTERN)
    if isinstance(pattern, list):
        if len(pattern) != layers or not all(type(flag) in (bool, int) and flag in (0, 1) for flag in pattern):
            raise ModelLoadError(f"{path}: GGUF metadata 'gemma2.attention.sliding_window_pattern' is "
                                 f"{show(pattern)}; as a list it must hold a flag (true/false, 1/0) for each of the "
                                 f"{layers} layers")
        layer_types = tuple("sliding_attention" if flag else "full_attention" for flag in pattern)
    else:
        every = int_value(metadata, "gemma2.attention.sliding_window_pattern", path, 0, MAX_WIDTH,
                          default=GEMMA2_PATTERN)
        layer_types = every_nth_full(layers, every) if every else ("sliding_attention",) * layers
    local_theta = positive_float(metadata, "gemma2.rope.freq_base_swa", path, base["rope_theta"])
    if not THETA_RANGE[0] < local_theta <= THETA_RANGE[1]:
        raise ModelLoadError(f"{path}: GGUF metadata 'gemma2.rope.freq_base_swa' is {local_theta:g}; allowed: above "
                             f"{THETA_RANGE[0]:g} up to {THETA_RANGE[1]:g}")
    return dict(_gemma(base, layers_of_27b=46), sliding_window=window, layer_types=layer_types,
                local_rope_theta=None if local_theta == base["rope_theta"] else local_theta, **caps)
