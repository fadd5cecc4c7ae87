"""The feed-forward part of a decoder layer: a gated MLP, or a mixture of experts (Qwen3-MoE, Mixtral, OLMoE).

In a mixture, a router picks each token's top-k experts, and each chosen expert runs once per forward on the rows
that chose it (a verify pass or a batch reads each chosen expert's weights once); experts nobody chose are not read.
Parameter names follow Hugging Face's per-expert checkpoints (``mlp.gate.weight``, ``mlp.experts.3.up_proj.weight``;
Mixtral's ``block_sparse_moe`` names are mapped at load), so each expert is an ordinary ``MLP`` whose linears every
weight format (float, int8/int4, a GGUF's own blocks) replaces as it replaces a dense layer's.
"""
from __future__ import annotations

import torch
from torch import nn
import torch.nn.functional as F

from quickdraft.config import ModelConfig
from quickdraft.models import native, triton_ops
from quickdraft.models.fused import FusedExperts
from quickdraft.models.lora import LoraRows
from quickdraft.models.norms import RMSNorm, add_norm, add_norm_project


class MLP(nn.Module):
    """A gated MLP: a dense layer's, or one expert of a mixture (``intermediate``: the expert's width)."""

    def __init__(self, cfg: ModelConfig, intermediate: int | None = None) -> None:
        super().__init__()
        width = intermediate or cfg.intermediate_size
        bias = cfg.expert_bias and intermediate is not None
        self.gate_proj = nn.Linear(cfg.hidden_size, width, bias=bias)
        self.up_proj = nn.Linear(cfg.hidden_size, width, bias=bias)
        self.down_proj = nn.Linear(width, cfg.hidden_size, bias=bias)
        self.gate_up_proj: nn.Module | None = None  # gate and up in one module (set by the loader, see fuse())
        self.activated = False
        # down(act(gate) * up): silu (SwiGLU) or gelu_tanh (Gemma's GeGLU); gpt-oss clamps its SwiGLU (see forward)
        self.act = "clamped_swiglu" if cfg.swiglu_limit is not None else cfg.hidden_act
        self.limit, self.alpha = cfg.swiglu_limit, cfg.swiglu_alpha

    def fuse(self, gate_up_proj: nn.Module, activation: str | None = None) -> None:
        """Run gate and up as one projection whose output is their concatenation, or, where the projection applies
        the MLP's ``activation`` itself, already ``act(gate) * up``. A fused MLP may be fused again (the GPU's
        loader moves a projection onto another kernel)."""
        if activation is not None and activation != self.act:  # (a clamped SwiGLU is applied by torch only)
            raise ValueError(f"a gate/up projection that applies {activation} cannot serve an MLP of {self.act}")
        self.gate_up_proj, self.activated = gate_up_proj, activation is not None
        if hasattr(self, "gate_proj"):
            del self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is not None:
            return self.down_from(self.gate_up_proj(x))
        return self.down_proj(self._gated(self.gate_proj(x), self.up_proj(x)))

    def forward_lora(self, x: torch.Tensor, lora: LoraRows, layer: int) -> torch.Tensor:
        """``forward`` with the adapters' terms added to their rows' gate/up (before the activation) and down
        projections (of decoder layer ``layer``)."""
        if self.gate_up_proj is None:
            gate_up = torch.cat([self.gate_proj(x), self.up_proj(x)], dim=-1)
        else:  # (a projection that applies the activation gives float32 here, as it applies it)
            gate_up = self.gate_up_proj.unactivated(x) if self.activated else self.gate_up_proj(x)
        hidden = self.activate(lora.add(gate_up, x, layer, "gate_up")).to(x.dtype)
        return lora.add(self.down_proj(hidden), hidden, layer, "down")

    def forward_added(self, x: torch.Tensor, pending: torch.Tensor | None, norm: RMSNorm | None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(s, self(norm(s)))`` for ``s = x + pending``: the add and the norm in the gate/up projection's kernel
        where it takes them (``add_norm_project``)."""
        if self.gate_up_proj is None:
            x, h = add_norm(x, pending, norm)
            return x, self(h)
        x, gate_up = add_norm_project(x, pending, norm, self.gate_up_proj)
        return x, self.down_from(gate_up)

    def down_from(self, gate_up: torch.Tensor) -> torch.Tensor:
        """The MLP's output from the output of ``gate_up_proj`` (already gated where ``activated``)."""
        return self.down_proj(gate_up if self.activated else self.activate(gate_up))

    def activate(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``act(gate) * up`` from ``[gate | up]``."""
        if native.runs_gated(gate_up):  # the kernel the fused layer and qd_moe apply
            return native.gated(gate_up, self.act, self.limit or 0.0, self.alpha or 0.0)
        if triton_ops.runs_gated(gate_up, self.act):  # one kernel on a GPU
            return triton_ops.gated(gate_up, self.act)
        return self._gated(*gate_up.chunk(2, dim=-1))

    def _gated(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.act == "clamped_swiglu":  # gpt-oss, in float32 as transformers' float32 reference
            dtype = gate.dtype
            gate, up = gate.float().clamp(max=self.limit), up.float().clamp(-self.limit, self.limit)
            return ((up + 1) * gate * torch.sigmoid(gate * self.alpha)).to(dtype)
        act = F.silu(gate) if self.act == "silu" else F.gelu(gate, approximate="tanh")
        return act * up


class Router(nn.Module):
    """Each token's top-k experts and their weights: softmax over the router's logits in float32, the k largest
    (ties to the lower id, as torch.topk), renormalized to sum to 1 where the family does (Mixtral always; Qwen3-MoE
    and OLMoE by ``norm_topk_prob``; gpt-oss's softmax over its top-k logits is the same, after a bias on the
    logits). The same rule as transformers' routers for the four families."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size))
        self.bias = nn.Parameter(torch.empty(cfg.num_experts)) if cfg.router_bias else None  # gpt-oss
        self.top_k, self.normalize = cfg.num_experts_per_tok, cfg.norm_topk_prob
        # (the weight, the bias, their copies by name), replaced whole: threads that share the model (run-ahead
        # self-drafting) read it in one go. The copies: the weight in float32 (qd_route widens each value as it reads
        # it: half the bytes of float64), in float64 for torch (elsewhere), the bias in float64
        self._copied: tuple[torch.Tensor, torch.Tensor | None, dict[str, torch.Tensor | None]] | None = None

    def read_as(self, name: str) -> torch.Tensor | None:
        """The weight ("weight32", "weight64") or bias ("bias64") in the type a path reads, made once per weight."""
        state = self._copied
        if state is None or state[0] is not self.weight or state[1] is not self.bias:
            state = (self.weight, self.bias, {})
        if name not in state[2]:
            source = state[1] if name == "bias64" else state[0]
            copy = None if source is None else \
                source.detach().to(torch.float32 if name == "weight32" else torch.float64).contiguous()
            state = (state[0], state[1], {**state[2], name: copy})
        self._copied = state
        return state[2][name]

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x ``[T, hidden]`` -> (weights ``[T, k]`` float32, experts ``[T, k]`` int64). The logits are summed in
        float64 and rounded to float32, so a row's logits (and its choice) do not depend on how many rows share the
        call, which a float32 GEMM's blocking may; the router is a few hundred thousand products a token. On the
        CPU quickdraft's kernel routes (``qd_route``, one call instead of six torch ops); elsewhere torch does."""
        bias64 = self.read_as("bias64")
        if native.runs_rms_norm(x, self.weight):  # float32/bfloat16 on the CPU, kernels built
            weight32 = self.read_as("weight32")
            experts = torch.empty(x.shape[0], self.top_k, dtype=torch.int64)
            weights = torch.empty(x.shape[0], self.top_k, dtype=torch.float32)
            x = x.contiguous()
            rc = native.lib().qd_route(x.data_ptr(), int(x.dtype == torch.bfloat16), x.shape[0], x.shape[1],
                                       weight32.data_ptr(), None if bias64 is None else bias64.data_ptr(),
                                       weight32.shape[0], self.top_k, int(self.normalize), experts.data_ptr(),
                                       weights.data_ptr())
            native._check(rc, "qd_route")
            return weights, experts
        logits = F.linear(x.double(), self.read_as("weight64"), bias64).to(torch.float32)
        probs = torch.softmax(logits, dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, experts


class SparseMoE(nn.Module):
    """A mixture-of-experts feed-forward: ``gate`` (the router) and ``experts``, each an ``MLP`` of the experts'
    width."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate = Router(cfg)
        self.experts = nn.ModuleList(MLP(cfg, cfg.expert_width) for _ in range(cfg.num_experts))
        self._fused: tuple[tuple, FusedExperts | None] | None = None  # (the experts' linears it was built on, it)

    def fused(self) -> FusedExperts | None:
        """The experts as one C call (``FusedExperts``), built on first use and again when the loader replaced
        their linears."""
        experts = self.experts
        key = tuple(id(m) for e in (experts[0], experts[-1]) for m in (e.gate_up_proj, e.down_proj))
        cached = self._fused
        if cached is None or cached[0] != key:
            cached = self._fused = (key, FusedExperts.build(list(experts)))
        return cached[1]

    def fused_key(self) -> tuple:
        """What a fused decoder layer holding this mixture was built on: its experts' C call and its router's
        weights (by storage: a key of tensors would compare their values)."""
        bias = self.gate.bias
        return self.fused(), self.gate.weight.data_ptr(), None if bias is None else bias.data_ptr()

    def forward_added(self, x: torch.Tensor, pending: torch.Tensor | None, norm: RMSNorm | None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(s, self(norm(s)))`` for ``s = x + pending`` (the router reads the normed input: nothing to fuse)."""
        x, h = add_norm(x, pending, norm)
        return x, self(h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Each token's output is the sum of its chosen experts' outputs times their weights, added in float32 in
        the order of the expert ids: a token's result never depends on which other tokens share the forward."""
        weights, experts = self.gate(x)
        fused = self.fused()
        if fused is not None and fused.runs(x):
            return fused(x, experts, weights)
        flat = experts.flatten()
        order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        rows, slots = order // experts.shape[1], order % experts.shape[1]
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        start = 0
        for expert, count in enumerate(counts):
            if count:
                chosen = rows[start:start + count]
                y = self.experts[expert](x[chosen]).float() * weights[chosen, slots[start:start + count], None]
                out.index_add_(0, chosen, y)
                start += count
        return out.to(x.dtype)
