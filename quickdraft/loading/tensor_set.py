"""Which tensors a checkpoint of a config must hold, and their shapes: one check for HF directories and GGUF files,
made from the header before any weight is read."""
from __future__ import annotations

from pathlib import Path

from quickdraft.config import ModelConfig
from quickdraft.errors import ModelLoadError


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape for a checkpoint of this config (lm_head only when untied; q/k norms with
    ``qk_norm``, the norms before and after the MLP with ``sandwich_norms``, none before attention or the MLP without
    ``pre_norms``)."""
    d, f, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    out = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,)}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (v, d)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        if cfg.pre_norms:  # (OLMo 2 has no norm before attention or the MLP: the sandwich's after them alone)
            out[p + "input_layernorm.weight"] = (d,)
        out.update({
            p + "post_attention_layernorm.weight": (d,),
            p + "self_attn.q_proj.weight": (q, d),
            p + "self_attn.k_proj.weight": (kv, d),
            p + "self_attn.v_proj.weight": (kv, d),
            p + "self_attn.o_proj.weight": (d, q),
        })
        if cfg.is_moe_layer(i):
            fe = cfg.expert_width
            out[p + "mlp.gate.weight"] = (cfg.num_experts, d)
            if cfg.router_bias:
                out[p + "mlp.gate.bias"] = (cfg.num_experts,)
            for e in range(cfg.num_experts):
                out.update({p + f"mlp.experts.{e}.gate_proj.weight": (fe, d),
                            p + f"mlp.experts.{e}.up_proj.weight": (fe, d),
                            p + f"mlp.experts.{e}.down_proj.weight": (d, fe)})
                if cfg.expert_bias:
                    out.update({p + f"mlp.experts.{e}.gate_proj.bias": (fe,), p + f"mlp.experts.{e}.up_proj.bias": (fe,),
                                p + f"mlp.experts.{e}.down_proj.bias": (d,)})
        else:
            out.update({p + "mlp.gate_proj.weight": (f, d), p + "mlp.up_proj.weight": (f, d),
                        p + "mlp.down_proj.weight": (d, f)})
        if cfg.attention_bias:
            out.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,), p + "self_attn.v_proj.bias": (kv,)})
        if cfg.attention_out_bias:
            out[p + "self_attn.o_proj.bias"] = (d,)
        if cfg.attention_sinks:
            out[p + "self_attn.sinks"] = (cfg.num_heads,)
        if cfg.qk_norm:
            whole = not cfg.qk_norm_per_head
            out.update({p + "self_attn.q_norm.weight": (q if whole else cfg.head_dim,),
                        p + "self_attn.k_norm.weight": (kv if whole else cfg.head_dim,)})
        if cfg.sandwich_norms:
            if cfg.pre_norms:
                out[p + "pre_feedforward_layernorm.weight"] = (d,)
            out[p + "post_feedforward_layernorm.weight"] = (d,)
    return out


def check_tensor_set(shapes: dict[str, tuple[int, ...]], cfg: ModelConfig, source: Path) -> None:
    """Raise ModelLoadError when a needed tensor is missing or has the wrong shape."""
    expected = expected_shapes(cfg)
    missing = [n for n in expected if n not in shapes]
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise ModelLoadError(f"{source}: checkpoint is missing tensors {', '.join(missing[:5])}{more}")
    # a mixture's tensors the config does not account for: more experts than num_experts, or a router where the
    # config says the layer is dense
    unplanned = sorted(n for n in shapes if (".mlp.experts." in n or ".mlp.gate." in n) and n not in expected)
    if unplanned:
        raise ModelLoadError(f"{source}: tensor {unplanned[0]} is not in the model config (num_experts="
                             f"{cfg.num_experts}; {len(unplanned)} such tensors)")
    for name, shape in expected.items():
        if tuple(shapes[name]) != shape:
            raise ModelLoadError(
                f"{source}: tensor {name} has shape {tuple(shapes[name])}, expected {shape} from the model config"
            )
