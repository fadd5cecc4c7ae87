"""One decoder-only transformer for Llama, Mistral, SmolLM and Qwen2 checkpoints.

Parameter names follow Hugging Face (``model.layers.0.self_attn.q_proj.weight``)
so an HF state dict loads as is. Tokens from several sequences arrive as one
flat ``[T]`` vector; the attention object decides who attends to what.
"""
from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Protocol

import torch
from torch import nn
import torch.nn.functional as F

from quickdraft.config import ModelConfig
from quickdraft.models import native
from quickdraft.models.fused import FusedLayer, FusedStack, SingleTokens


class Attention(Protocol):
    positions: torch.Tensor

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor: ...

    def single_tokens(self, layer: int) -> SingleTokens | None:
        """Where every new token attends alone on quickdraft's CPU kernel: what a fused layer needs; else None."""


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if native.runs_rms_norm(x, self.weight):  # one call instead of ~8 small torch ops
            return native.rms_norm(x, self.weight, self.eps)
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps).to(x.dtype)


class RotaryEmbedding(nn.Module):
    """Rotate-half (NeoX) layout, as HF stores Llama and Qwen2 q/k projections."""

    def __init__(self, head_dim: int, theta: float, max_positions: int) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv_freq)
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)
        self._rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # (positions, cos, sin)

    def rows(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of ``positions`` as ``[T, 1, head_dim / 2]``, gathered once per step: every layer of a forward
        passes the same positions tensor (on a GPU each gather is a kernel launch, and decoding is launch-bound)."""
        cached = self._rows  # one read: threads that share the model (run-ahead self-drafting) each see a whole tuple
        if cached is None or cached[0] is not positions:
            cached = self._rows = (positions, self.cos[positions][:, None, :], self.sin[positions][:, None, :])
        return cached[1], cached[2]

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: [T, heads, head_dim]; may rotate x in place (x is a fresh projection output)."""
        if native.runs_rope(x):
            return native.rope_(x, positions, self.cos, self.sin)
        cos, sin = self.rows(positions)
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


class SelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)
        # q, k and v in one module whose output is their concatenation (set by the loader, see fuse())
        self.qkv_proj: nn.Module | None = None
        self.qkv_sizes = [cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim]

    def fuse(self, qkv_proj: nn.Module) -> None:
        """Run q/k/v as one projection (one weight read, one kernel call instead of three)."""
        self.qkv_proj = qkv_proj
        del self.q_proj, self.k_proj, self.v_proj

    def forward(self, x: torch.Tensor, rope: RotaryEmbedding, attn: Attention) -> torch.Tensor:
        t = x.shape[0]
        if self.qkv_proj is not None:
            qkv = self.qkv_proj(x)
            heads, kv_heads, dim = self.num_heads, self.num_kv_heads, self.head_dim
            qk = qkv[:, :(heads + kv_heads) * dim].reshape(t, heads + kv_heads, dim)
            if not native.runs_rope(qk):  # torch's rotation (off CPU): q and k in one, half the kernel launches
                qk = rope(qk, attn.positions)
                v = qkv[:, (heads + kv_heads) * dim:].reshape(t, kv_heads, dim)
                return self.o_proj(attn.attend(self.layer, qk[:, :heads], qk[:, heads:], v).reshape(t, -1))
            q, k, v = qkv.split(self.qkv_sizes, dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = rope(q.reshape(t, self.num_heads, self.head_dim), attn.positions)
        k = rope(k.reshape(t, self.num_kv_heads, self.head_dim), attn.positions)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        return self.o_proj(attn.attend(self.layer, q, k, v).reshape(t, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.gate_up_proj: nn.Module | None = None  # gate and up in one module (set by the loader, see fuse())
        self.activated = False

    def fuse(self, gate_up_proj: nn.Module, activated: bool = False) -> None:
        """Run gate and up as one projection whose output is their concatenation, or, ``activated``, already
        ``silu(gate) * up``."""
        self.gate_up_proj, self.activated = gate_up_proj, activated
        del self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.activated:
            return self.down_proj(self.gate_up_proj(x))
        if self.gate_up_proj is not None:
            gate_up = self.gate_up_proj(x)
            if native.runs_swiglu(gate_up):  # one kernel, the one the fused layer applies (see fused.py)
                return self.down_proj(native.swiglu(gate_up))
            gate, up = gate_up.chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = SelfAttention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)
        self._fused: FusedLayer | None = None
        self._fused_key: tuple | None = None

    def fused(self, rope: RotaryEmbedding) -> FusedLayer | None:
        """This layer as one C call (see fused.py), built on first use and again whenever its modules or weights
        were replaced since."""
        # read through the module dicts: this runs for every layer of every step, and nn.Module.__getattr__ is slow
        mods = self._modules
        attn, mlp = mods["self_attn"]._modules, mods["mlp"]._modules
        key = (attn.get("qkv_proj"), attn["o_proj"], mlp.get("gate_up_proj"), mlp["down_proj"],
               mods["input_layernorm"]._parameters["weight"].data_ptr(),
               mods["post_attention_layernorm"]._parameters["weight"].data_ptr(), rope.cos.data_ptr())
        if key != self._fused_key:
            self._fused, self._fused_key = FusedLayer.build(self, rope), key
        return self._fused

    def forward(self, x: torch.Tensor, rope: RotaryEmbedding, attn: Attention) -> torch.Tensor:
        tokens = attn.single_tokens(self.self_attn.layer)
        if tokens is not None:
            fused = self.fused(rope)
            if fused is not None and fused.runs(x, tokens):
                return fused(x, tokens)
        x = x + self.self_attn(self.input_layernorm(x), rope, attn)
        return x + self.mlp(self.post_attention_layernorm(x))


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
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.max_position_embeddings)
        self._stacks: dict[int | None, FusedStack] = {}
        self.quant_info: dict = {}  # set where the loader quantizes the linear layers (format, kernels, sources)

    def forward(self, tokens: torch.Tensor, attn: Attention, num_layers: int | None = None) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` after the final norm; ``num_layers`` runs only the first layers
        (self-speculation drafts with a prefix of the target)."""
        x = self.model.embed_tokens(tokens)
        singles = attn.single_tokens(0)
        stack = self.fused_stack(num_layers) if singles is not None else None
        if stack is not None and stack.runs(x, singles):
            return self.model.norm(stack(x, singles))
        for layer in list(self.model.layers)[:num_layers]:  # slicing a ModuleList builds a new one
            x = layer(x, self.rope, attn)
        return self.model.norm(x)

    def fused_stack(self, num_layers: int | None) -> FusedStack | None:
        """The first ``num_layers`` layers as one C call when every one of them is fused (see fused.py), else None;
        rebuilt whenever a layer's fused form was."""
        layers = [layer.fused(self.rope) for layer in list(self.model.layers)[:num_layers]]
        if not layers or any(layer is None for layer in layers):
            return None
        stack = self._stacks.get(num_layers)
        if stack is None or any(a is not b for a, b in zip(stack.layers, layers)):
            stack = self._stacks[num_layers] = FusedStack(layers)
        return stack

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()


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
    model.rope = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.max_position_embeddings).to(device)
    return model.eval().requires_grad_(False)


def weight_bytes(module: torch.nn.Module) -> int:
    """Bytes of parameters and weight buffers (packed and quantized layers keep weights as buffers)."""
    tensors = list(module.parameters()) + [b for name, b in module.named_buffers() if not name.startswith("rope.")]
    return sum(t.numel() * t.element_size() for t in tensors)
