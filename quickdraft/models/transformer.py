"""One decoder-only transformer for the Llama, Mistral, Qwen2/3, Gemma 2/3, Phi-3/4, SmolLM3, Granite and OLMo 2
families.

A family is data (``ModelConfig``): which norms a layer has, the MLP's activation, the attention scale and window,
the RoPE tables. Parameter names follow Hugging Face (``model.layers.0.self_attn.q_proj.weight``) so an HF state
dict loads as is. Tokens from several sequences arrive as one flat ``[T]`` vector; the attention object decides
who attends to what.
"""
from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Protocol

import torch
from torch import nn

from quickdraft.config import ModelConfig
from quickdraft.models import native, triton_ops
from quickdraft.models.feed_forward import MLP, SparseMoE
from quickdraft.models.fused import FusedLayer, FusedStack, SingleTokens
from quickdraft.models.lora import LoraRows, LoraWeights
from quickdraft.models.norms import RMSNorm, add_norm, add_norm_project, normed
from quickdraft.models.rope import RotaryEmbedding


class Attention(Protocol):
    positions: torch.Tensor
    end: int  # one past the largest position (known on the host: no device sync to size the RoPE tables)
    lora: LoraRows | None  # the rows that run a LoRA adapter, if any do (models/lora.py)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None,
               window: int | None = None, sinks: torch.Tensor | None = None,
               rotary: RotaryEmbedding | None = None, softcap: float | None = None) -> torch.Tensor:
        """Write k, v to the cache; each query attends to its context (its last ``window`` keys where given);
        ``sinks`` [H]: a logit per query head that each softmax also normalizes over (gpt-oss). ``rotary``: q and k
        are not rotated yet: rotate them (q in place allowed) at the attention's positions, where a GPU can in the
        kernel that writes the keys (one launch a layer fewer). ``softcap``: each score (after the scale) becomes
        ``softcap * tanh(score / softcap)`` before the softmax (Gemma 2)."""

    def single_tokens(self, layer: int) -> SingleTokens | None:
        """Where every new token attends alone on quickdraft's CPU kernel: what a fused layer needs; else None."""


class SelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=cfg.attention_out_bias)
        # gpt-oss: a learned logit per query head in every softmax's denominator
        self.sinks = nn.Parameter(torch.zeros(cfg.num_heads)) if cfg.attention_sinks else None
        # q, k and v in one module whose output is their concatenation (set by the loader, see fuse())
        self.qkv_proj: nn.Module | None = None
        self.qkv_sizes = [cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim]
        # Qwen3 and Gemma 3 normalize each head of q and k before RoPE; OLMoE all of q (and of k) at once
        self.norm_whole = cfg.qk_norm and not cfg.qk_norm_per_head
        q_width, k_width = (self.qkv_sizes[0], self.qkv_sizes[1]) if self.norm_whole else (cfg.head_dim, cfg.head_dim)
        self.q_norm = RMSNorm(q_width, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(k_width, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.clip = cfg.clip_qkv  # OLMoE: q, k and v clamped to +-clip_qkv
        self.scale = cfg.attention_scale
        self.window = cfg.window(layer)
        self.softcap = cfg.attn_logit_softcapping  # Gemma 2: scores soft-capped before the softmax

    def fuse(self, qkv_proj: nn.Module) -> None:
        """Run q/k/v as one projection (one weight read, one kernel call instead of three)."""
        self.qkv_proj = qkv_proj
        del self.q_proj, self.k_proj, self.v_proj

    def forward(self, x: torch.Tensor, rope: RotaryEmbedding, attn: Attention) -> torch.Tensor:
        if self.qkv_proj is not None:
            return self.forward_qkv(self.qkv_proj(x), rope, attn)
        return self.o_proj(self._attend(self.q_proj(x), self.k_proj(x), self.v_proj(x), rope, attn))

    def forward_lora(self, x: torch.Tensor, rope: RotaryEmbedding, attn: Attention, lora: LoraRows) -> torch.Tensor:
        """``forward`` with each adapter's terms added to its rows' q/k/v and output projections."""
        if self.qkv_proj is not None:
            qkv = self.qkv_proj(x)
        else:
            qkv = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
        heads = self.attend_qkv(lora.add(qkv, x, self.layer, "qkv"), rope, attn)
        return lora.add(self.o_proj(heads), heads, self.layer, "o")

    def forward_added(self, x: torch.Tensor, pending: torch.Tensor | None, norm: RMSNorm | None, rope: RotaryEmbedding,
                      attn: Attention) -> tuple[torch.Tensor, torch.Tensor]:
        """``(s, self(norm(s), ...))`` for ``s = x + pending``: the add and the norm in the q/k/v projection's
        kernel where it takes them (``add_norm_project``)."""
        if self.qkv_proj is None:
            x, h = add_norm(x, pending, norm)
            return x, self(h, rope, attn)
        x, qkv = add_norm_project(x, pending, norm, self.qkv_proj)
        return x, self.forward_qkv(qkv, rope, attn)

    def forward_qkv(self, qkv: torch.Tensor, rope: RotaryEmbedding, attn: Attention) -> torch.Tensor:
        """The attention's output from the output of ``qkv_proj``."""
        return self.o_proj(self.attend_qkv(qkv, rope, attn))

    def attend_qkv(self, qkv: torch.Tensor, rope: RotaryEmbedding, attn: Attention) -> torch.Tensor:
        """The heads' outputs ``[T, heads * head_dim]`` (what ``o_proj`` reads) from q, k and v side by side."""
        t = qkv.shape[0]
        heads, kv_heads, dim = self.num_heads, self.num_kv_heads, self.head_dim
        qk = qkv[:, :(heads + kv_heads) * dim].reshape(t, heads + kv_heads, dim)
        if self.q_norm is None and self.clip is None and not native.runs_rope(qk):  # off CPU: rotated by attend
            v = qkv[:, (heads + kv_heads) * dim:].reshape(t, kv_heads, dim)
            out = attn.attend(self.layer, qk[:, :heads], qk[:, heads:], v, self.scale, self.window, self.sinks,
                              rotary=rope, softcap=self.softcap)
            return out.reshape(t, -1)
        return self._attend(*qkv.split(self.qkv_sizes, dim=-1), rope, attn)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope: RotaryEmbedding, attn: Attention
                ) -> torch.Tensor:
        t = q.shape[0]
        if self.norm_whole:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip is not None:
            q, k, v = (z.clamp(-self.clip, self.clip) for z in (q, k, v))
        q, k = q.reshape(t, self.num_heads, self.head_dim), k.reshape(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and not self.norm_whole:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rope(q, attn.positions), rope(k, attn.positions)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        return attn.attend(self.layer, q, k, v, self.scale, self.window, self.sinks,
                           softcap=self.softcap).reshape(t, -1)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        # OLMo 2 has no norm before attention or the MLP (None), only the sandwich's after them
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if cfg.pre_norms else None
        self.self_attn = SelfAttention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.sparse = cfg.is_moe_layer(layer)
        # what the fused C layer does not do: OLMoE's clamps; a mixture of experts' layer is fused with its router and
        # experts where they run in C, else up to its attention (its feed-forward runs after)
        self.fusable = self.self_attn.clip is None
        self.mlp = SparseMoE(cfg) if self.sparse else MLP(cfg)
        # Gemma: post_attention_layernorm normalizes the attention output, and the MLP has a norm on each side
        self.sandwich = cfg.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if cfg.pre_norms else None
            self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.residual_multiplier = cfg.residual_multiplier  # Granite: each sublayer's output scaled before its add
        # which RoPE it rotates with: the sliding layers' own base (Gemma 3), none at all (SmolLM3's NoPE layers), or
        # the model's
        self.rope_kind = ("none" if layer in cfg.unrotated_layers else
                          "local" if cfg.is_sliding(layer) and cfg.local_rope_theta is not None else "global")
        # (key, fused layer) as one tuple: threads sharing the model (run-ahead self-drafting) read it in one go
        self._fused: tuple[tuple, FusedLayer | None] | None = None

    def feed_forwards(self) -> list[tuple[str, MLP]]:
        """Each gated MLP of the layer with its path in it: the dense one, or every expert of a mixture."""
        if self.sparse:
            return [(f"mlp.experts.{e}", expert) for e, expert in enumerate(self.mlp.experts)]
        return [("mlp", self.mlp)]

    def fused(self, rope: RotaryEmbedding) -> FusedLayer | None:
        """This layer as one C call (see fused.py), built on first use and again whenever its modules or weights
        were replaced since."""
        if not self.fusable:
            return None
        # read through the module dicts: this runs for every layer of every step, and nn.Module.__getattr__ is slow
        mods = self._modules
        attn, mlp = mods["self_attn"]._modules, mods["mlp"]._modules
        norms = tuple(m._parameters["weight"].data_ptr() for m in (
            mods.get("input_layernorm"), mods["post_attention_layernorm"], mods.get("pre_feedforward_layernorm"),
            mods.get("post_feedforward_layernorm"), attn.get("q_norm"), attn.get("k_norm")) if m is not None)
        sinks = mods["self_attn"]._parameters.get("sinks")
        key = (attn.get("qkv_proj"), attn["o_proj"], mlp.get("gate_up_proj"), mlp.get("down_proj"), norms,
               rope.cos.data_ptr(), None if sinks is None else sinks.data_ptr(),
               mods["mlp"].fused_key() if self.sparse else None)
        cached = self._fused
        if cached is None or cached[0] != key:
            cached = self._fused = (key, FusedLayer.build(self, rope))
        return cached[1]

    def forward(self, x: torch.Tensor, rope: RotaryEmbedding, attn: Attention) -> torch.Tensor:
        tokens = attn.single_tokens(self.self_attn.layer)
        if tokens is not None:
            fused = self.fused(rope)
            if fused is not None and fused.runs(x, tokens):
                layer, lora = self.self_attn.layer, attn.lora
                x = fused(x, tokens, None if lora is None else lora.fused(), layer)
                # a mixture's layer not fused whole: its attention and residual add
                return x if fused.whole else x + self.residual(self.mlp(self.post_attention_layernorm(x)))
        if attn.lora is not None:
            return self.forward_lora(x, rope, attn, attn.lora)
        if self.sandwich:
            out = self.self_attn(normed(self.input_layernorm, x), rope, attn)
            x = x + self.residual(self.post_attention_layernorm(out))
            out = self.mlp(normed(self.pre_feedforward_layernorm, x))
            return x + self.residual(self.post_feedforward_layernorm(out))
        x = x + self.residual(self.self_attn(self.input_layernorm(x), rope, attn))
        return x + self.residual(self.mlp(self.post_attention_layernorm(x)))

    def residual(self, out: torch.Tensor) -> torch.Tensor:
        """A sublayer's output as its residual add takes it: times Granite's multiplier (rounded to out's dtype, as
        transformers and the fused layer round it), else itself."""
        return out if self.residual_multiplier == 1.0 else out * self.residual_multiplier

    def forward_lora(self, x: torch.Tensor, rope: RotaryEmbedding, attn: Attention, lora: LoraRows) -> torch.Tensor:
        """``forward`` on the module path with the adapters' terms (a mixture's experts take none)."""
        layer = self.self_attn.layer
        out = self.self_attn.forward_lora(normed(self.input_layernorm, x), rope, attn, lora)
        if self.sandwich:
            x = x + self.residual(self.post_attention_layernorm(out))
            h = normed(self.pre_feedforward_layernorm, x)
            y = self.mlp(h) if self.sparse else self.mlp.forward_lora(h, lora, layer)
            return x + self.residual(self.post_feedforward_layernorm(y))
        x = x + self.residual(out)
        h = self.post_attention_layernorm(x)
        return x + self.residual(self.mlp(h) if self.sparse else self.mlp.forward_lora(h, lora, layer))

    def forward_pending(self, x: torch.Tensor, pending: torch.Tensor | None, rope: RotaryEmbedding, attn: Attention
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward`` of ``x + pending`` with its residual adds left to the norm after each (one kernel for the
        two on a GPU, or inside the next projection's: ``add_norm_project``): returns ``(x, pending)`` whose sum is
        the layer's output."""
        x, out = self.self_attn.forward_added(x, pending, self.input_layernorm, rope, attn)
        if self.sandwich:
            x, y = self.mlp.forward_added(x, self.residual(self.post_attention_layernorm(out)),
                                          self.pre_feedforward_layernorm)
            return x, self.residual(self.post_feedforward_layernorm(y))
        x, y = self.mlp.forward_added(x, self.residual(out), self.post_attention_layernorm)
        return x, self.residual(y)


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.ropes = _ropes(cfg)
        self._stacks: dict[int | None, FusedStack] = {}
        self.quant_info: dict = {}  # set where the loader quantizes the linear layers (format, kernels, sources)
        self.lora: LoraWeights | None = None  # the LoRA adapters it serves (set by the builder)

    def forward(self, tokens: torch.Tensor, attn: Attention, num_layers: int | None = None) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` after the final norm; ``num_layers`` runs only the first layers
        (self-speculation drafts with a prefix of the target)."""
        self.reach(attn.end)
        x = self.model.embed_tokens(tokens)
        if self.config.embedding_multiplier != 1.0:  # rounded to x's dtype first, as HF's Gemma does
            x = x * torch.tensor(self.config.embedding_multiplier, dtype=x.dtype)
        singles = attn.single_tokens(0)
        stack = self.fused_stack(num_layers) if singles is not None else None
        if stack is not None and stack.runs(x, singles):
            lora = None if attn.lora is None else attn.lora.fused()
            return self.model.norm(stack(x, singles, lora))
        layers = list(self.model.layers)[:num_layers]  # (slicing a ModuleList builds a new one)
        # a GPU: each residual add joins the norm after it (not where adapters add their terms after projections)
        if attn.lora is None and triton_ops.runs_rms_norm(x, self.model.norm.weight):
            pending = None
            for layer in layers:
                x, pending = layer.forward_pending(x, pending, self.rope_of(layer), attn)
            return add_norm(x, pending, self.model.norm)[1]
        for layer in layers:
            x = layer(x, self.rope_of(layer), attn)
        return self.model.norm(x)

    def reach(self, end: int) -> None:
        """RoPE rows for positions below ``end``; a position past the model's limit is refused (the C kernels index
        the tables by position, unchecked)."""
        if end > self.max_positions:
            raise ValueError(f"position {end - 1} is past the {self.max_positions} this model was limited to")
        for rope in self.ropes.values():
            rope.reach(end)

    @property
    def max_positions(self) -> int:
        """Positions below this have RoPE rows (the model's context, or the engine's limit on it)."""
        return self.ropes["global"].max_positions

    def limit_positions(self, positions: int) -> None:
        """The engine reaches positions below ``positions`` only: RoPE tables for those alone."""
        for rope in self.ropes.values():
            rope.limit(positions)

    def rope_of(self, layer: DecoderLayer) -> RotaryEmbedding:
        """The layer's RoPE (``DecoderLayer.rope_kind``)."""
        return self.ropes[layer.rope_kind]

    def fused_stack(self, num_layers: int | None) -> FusedStack | None:
        """The first ``num_layers`` layers as one C call when every one of them is fused (see fused.py), else None;
        rebuilt whenever a layer's fused form was."""
        chosen = list(self.model.layers)[:num_layers]
        layers = [layer.fused(self.rope_of(layer)) for layer in chosen]
        if not layers or any(layer is None or not layer.whole for layer in layers):
            return None  # (a mixture's feed-forward not fused runs between its layers' calls)
        stack = self._stacks.get(num_layers)
        if stack is None or any(a is not b for a, b in zip(stack.layers, layers)):
            stack = self._stacks[num_layers] = FusedStack(layers)
        return stack

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits of final hidden states (divided by Granite's ``logits_scaling``, soft-capped to
        ``cap * tanh(logit / cap)`` by Gemma 2's ``final_logit_softcapping``)."""
        logits = self.lm_head(hidden).float()
        scaling, cap = self.config.logits_scaling, self.config.final_logit_softcapping
        if scaling != 1.0:
            logits = logits / scaling
        return logits if cap is None else torch.tanh(logits / cap) * cap


def build_model(cfg: ModelConfig, tensors: Mapping[str, torch.Tensor], device: str | torch.device = "cpu",
                skip: Collection[str] = ()) -> Transformer:
    """Instantiate without random init and take the given tensors as parameters (no copy on CPU), reading each name
    once. Parameters named in ``skip`` stay on the meta device, holding no memory, for the loader to replace (a
    quantized layer is made from the file's blocks, never from a float weight); a tied lm_head in ``skip`` is not
    tied."""
    with torch.device("meta"):
        model = Transformer(cfg)
    expected = [k for k in model.state_dict() if k not in skip]
    tied = cfg.tie_word_embeddings and "lm_head.weight" not in skip
    if cfg.tie_word_embeddings:
        expected = [k for k in expected if k != "lm_head.weight"]
    missing = sorted(k for k in expected if k not in tensors)
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:3]}")
    model.load_state_dict({k: tensors[k].to(device) for k in expected}, strict=False, assign=True)
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.ropes = _ropes(cfg, device)
    return model.eval().requires_grad_(False)


def _ropes(cfg: ModelConfig, device: str | torch.device = "cpu") -> nn.ModuleDict:
    """The model's RoPE by ``DecoderLayer.rope_kind``: "global", and "local" (sliding layers with their own base) and
    "none" (layers without RoPE: tables 0 wide) where some layer uses them."""
    ropes = {"global": RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.max_position_embeddings, cfg.rope_scaling,
                                       device, cfg.rotary_dim)}
    if cfg.local_rope_theta is not None:
        ropes["local"] = RotaryEmbedding(cfg.head_dim, cfg.local_rope_theta, cfg.max_position_embeddings,
                                         device=device, rotary_dim=cfg.rotary_dim)
    if cfg.unrotated_layers:
        ropes["none"] = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.max_position_embeddings, device=device,
                                        rotary_dim=0)
    return nn.ModuleDict(ropes)


def weight_bytes(module: torch.nn.Module) -> int:
    """Bytes of parameters and weight buffers (packed and quantized layers keep weights as buffers)."""
    tensors = list(module.parameters()) + list(module.buffers())
    return sum(t.numel() * t.element_size() for t in tensors)


def expert_read(model: Transformer) -> tuple[int, float]:
    """(bytes of every expert of a mixture, the share of them one token chooses); (0, 0.0) for a dense model."""
    cfg = model.config
    total = sum(weight_bytes(layer.mlp.experts) for layer in model.model.layers if layer.sparse)
    return total, (cfg.num_experts_per_tok / cfg.num_experts if total else 0.0)


def step_weight_bytes(model: Transformer) -> int:
    """Bytes of weights one decode step of one token reads: all of them but the embedding table, of which a step reads
    one row per token (a head that is the embedding table itself, float weights tied, reads it whole), and of a
    mixture's experts only the ``num_experts_per_tok`` a token chooses (experts of one layer are the same size)."""
    embedding = model.model.embed_tokens  # (read from the file's blocks, a BlockEmbedding holds no tensor)
    experts, share = expert_read(model)
    total = weight_bytes(model) - experts + round(experts * share)
    tied = getattr(model.lm_head, "weight", None) is getattr(embedding, "weight", False)
    return total if tied else total - weight_bytes(embedding)
