"""A decoder layer as one C call (``layer.c``) for batches in which every new token attends alone.

Decode steps, verify passes and draft steps are such batches (prompt chunks attend in pieces through torch and
take the module path). The call runs the kernels the modules call, in the same order and with the same
roundings, so both paths give bit-identical hidden states (``tests/test_fused.py``); it only saves the Python
and torch dispatch around them, a sizeable share of a quantized decode step (docs/MEASUREMENTS.md).

A layer is fused where all of its linear layers run on quickdraft's kernels (every quantized format on ``qmatmul``, or
bfloat16 ``PackedLinear`` on the native kernel), with q/k/v and gate/up as one projection each, and its head layout
suits the attention kernel; any other layer keeps the module path. What differs between families (q/k norms,
Gemma's sandwich norms, the gate activation, the attention scale and window, each layer's RoPE tables) is data in
the layer's description.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch
from torch import nn

from quickdraft.models import native, qmatmul
from quickdraft.models.packed import PackedLinear
from quickdraft.models.quant_group import QuantGroup, QuantLinear

_QUANTIZED, _BF16 = 1, 2
_P = ctypes.c_void_p


@dataclass
class SingleTokens:
    """What a fused layer needs of a batch whose every new token attends alone, each over its own context."""

    positions: torch.Tensor  # int64 [T]: position of each new token
    slot_mapping: torch.Tensor  # int64 [T]: cache slot its key and value go to
    items: native.AttnItems  # which context each token attends to
    cache: native.CacheLayer  # this layer's keys and values
    layer_stride: int  # values from one layer's cache to the next one's (the pool is [layers, slots, ...])
    scale_layer_stride: int  # likewise for an int8 cache's scales

    def takes(self, x: torch.Tensor) -> bool:
        """The cache holds x's dtype, or int8."""
        return self.cache.k.dtype in (x.dtype, torch.int8)


class _LinearDesc(ctypes.Structure):
    _fields_ = [("kind", ctypes.c_int), ("in_features", ctypes.c_int), ("padded_in", ctypes.c_int),
                ("nparts", ctypes.c_int), ("swiglu", ctypes.c_int), ("out_features", ctypes.c_int),
                ("weights", _P), ("scales_zeros", _P), ("formats", _P), ("part_rows", _P), ("biases", _P),
                ("dense", _P), ("dense_bias", _P)]


class _MoeDesc(ctypes.Structure):  # qd_moe_desc
    _fields_ = [("num_experts", ctypes.c_int), ("k", ctypes.c_int), ("normalize", ctypes.c_int), ("act", ctypes.c_int),
                ("limit", ctypes.c_float), ("alpha", ctypes.c_float), ("router", _P), ("router_bias", _P),
                ("gate_up", _P), ("down", _P)]


class _LayerDesc(ctypes.Structure):  # qd_layer_desc
    _fields_ = [("input_norm", _P), ("post_norm", _P), ("q_norm", _P), ("k_norm", _P), ("post_attn_norm", _P),
                ("post_mlp_norm", _P), ("norm_bf16", ctypes.c_int), ("qk_norm_whole", ctypes.c_int),
                ("eps", ctypes.c_float), ("attn_scale", ctypes.c_float), ("residual_scale", ctypes.c_float),
                ("hidden", ctypes.c_int), ("heads", ctypes.c_int), ("kv_heads", ctypes.c_int),
                ("head_dim", ctypes.c_int), ("intermediate", ctypes.c_int), ("act", ctypes.c_int),
                ("window", ctypes.c_int), ("rotary_half", ctypes.c_int), ("qkv", _LinearDesc), ("o", _LinearDesc),
                ("gate_up", _LinearDesc), ("down", _LinearDesc), ("cos", _P), ("sin", _P), ("sinks", _P),
                ("softcap", ctypes.c_float), ("moe", _MoeDesc)]


def _norms(layer: nn.Module) -> dict[str, nn.Module | None]:
    """The layer's RMSNorms by their place in qd_layer_desc (None: the layer has none there). In Gemma's sandwich
    the norm before the MLP is pre_feedforward_layernorm, and post_attention_layernorm normalizes the attention's
    output; OLMo 2's sandwich has no norm before attention or the MLP. q_norm and k_norm normalize each head, or all
    of q and of k at once (``norm_whole``: OLMoE, OLMo 2)."""
    attn = layer.self_attn
    if layer.sandwich:
        return {"input_norm": layer.input_layernorm, "post_norm": layer.pre_feedforward_layernorm,
                "q_norm": attn.q_norm, "k_norm": attn.k_norm, "post_attn_norm": layer.post_attention_layernorm,
                "post_mlp_norm": layer.post_feedforward_layernorm}
    return {"input_norm": layer.input_layernorm, "post_norm": layer.post_attention_layernorm,
            "q_norm": attn.q_norm, "k_norm": attn.k_norm, "post_attn_norm": None, "post_mlp_norm": None}


def _moe(layer: nn.Module) -> tuple[_MoeDesc, list[object]]:
    """A mixture's router and experts as qd_layer_desc's ``moe``, and what must stay alive with them; an empty
    description (the caller runs the feed-forward) where the module path would not run them in C (experts off the
    kernel, a router weight the kernel does not read, Gemma's sandwich norms)."""
    mlp = layer.mlp
    experts, router = mlp.fused(), mlp.gate
    kernel_router = router.weight.device.type == "cpu" and router.weight.dtype in (torch.float32, torch.bfloat16)
    if experts is None or not kernel_router or layer.sandwich:
        return _MoeDesc(), []
    weight, bias = router.read_as("weight32"), router.read_as("bias64")
    act, limit, alpha = experts.act
    desc = _MoeDesc(num_experts=len(experts.gate_up), k=router.top_k, normalize=int(router.normalize), act=act,
                    limit=limit, alpha=alpha, router=weight.data_ptr(),
                    router_bias=None if bias is None else bias.data_ptr(),
                    gate_up=ctypes.addressof(experts.gate_up), down=ctypes.addressof(experts.down))
    return desc, [experts, weight, bias, router.weight, router.bias]  # the key's storage stays theirs (fused_key)


def _linear(module: nn.Module) -> tuple[_LinearDesc, object] | None:
    """The kernel description of a linear module and what must stay alive with it, or None if no kernel runs it."""
    if isinstance(module, QuantGroup):
        call = module.call
    elif isinstance(module, QuantLinear) and module.backend == "qmatmul":
        call = qmatmul.PartsCall([module.kernel_part()], module.in_features)
    elif isinstance(module, PackedLinear) and module.backend == "native":
        bias = module.bias
        return _LinearDesc(kind=_BF16, in_features=module.in_features, out_features=module.out_features,
                           dense=module.weight_packed.data_ptr(),
                           dense_bias=None if bias is None else bias.data_ptr()), module
    else:
        return None
    desc = _LinearDesc(kind=_QUANTIZED, in_features=call.in_features, padded_in=call.kpad, nparts=len(call.parts),
                       swiglu=int(call.swiglu), out_features=call.out_features,
                       weights=ctypes.addressof(call._w), scales_zeros=ctypes.addressof(call._sz),
                       formats=ctypes.addressof(call._fmt), part_rows=ctypes.addressof(call._n),
                       biases=ctypes.addressof(call._bias))
    return desc, call


class FusedLayer:
    """One decoder layer's C description, built once from its modules (``build``), and the call."""

    def __init__(self, desc: _LayerDesc, keep: list[object], dtype: torch.dtype) -> None:
        self.desc, self._keep, self.dtype = desc, keep, dtype
        self._ref = ctypes.byref(desc)
        self.whole = bool(desc.gate_up.kind or desc.moe.num_experts)  # the feed-forward too

    @classmethod
    def build(cls, layer: nn.Module, rope: nn.Module) -> FusedLayer | None:
        """``layer``: a ``DecoderLayer``; None where the fused path does not apply (see the module docstring). A
        mixture of experts' layer (``layer.sparse``) runs its router and experts in the call too where they run in C
        (``whole``); else the call ends at its attention's residual add, and the caller runs its feed-forward."""
        attn, mlp = layer.self_attn, layer.mlp
        placed = {place: norm for place, norm in _norms(layer).items() if norm is not None}
        norms = [norm.weight for norm in placed.values()]
        if attn.qkv_proj is None or (not layer.sparse and mlp.gate_up_proj is None) or not native.available():
            return None
        if any(w.device.type != "cpu" or w.dtype not in (torch.float32, torch.bfloat16) for w in norms):
            return None
        if len({w.dtype for w in norms}) != 1 or len({norm.eps for norm in placed.values()}) != 1:
            return None  # the kernel takes one dtype and one eps for all of them
        if attn.num_heads % attn.num_kv_heads or attn.head_dim % 8 or attn.head_dim > native.MAX_HEAD_DIM:
            return None
        linears = [_linear(m) for m in (attn.qkv_proj, attn.o_proj)]
        linears += [(_LinearDesc(), None)] * 2 if layer.sparse else [_linear(mlp.gate_up_proj), _linear(mlp.down_proj)]
        if any(lin is None for lin in linears):
            return None
        (qkv, a), (o, b), (gate_up, c), (down, d) = linears
        intermediate = down.in_features
        if layer.sparse:
            moe, held = _moe(layer)
            return cls._described(layer, rope, placed, norms, qkv, o, gate_up, down, [a, b, *held], moe)
        # gate/up either apply SwiGLU in the kernel (an "activated" MLP) or return [gate | up] for qd_gated
        if bool(gate_up.swiglu) != mlp.activated or gate_up.out_features != intermediate * (1 if mlp.activated else 2):
            return None
        if bool(mlp.activated) and gate_up.kind != _QUANTIZED:
            return None
        return cls._described(layer, rope, placed, norms, qkv, o, gate_up, down, [a, b, c, d])

    @classmethod
    def _described(cls, layer: nn.Module, rope: nn.Module, placed: dict, norms: list, qkv: _LinearDesc,
                   o: _LinearDesc, gate_up: _LinearDesc, down: _LinearDesc, keep: list,
                   moe: _MoeDesc | None = None) -> FusedLayer | None:
        attn, hidden = layer.self_attn, o.out_features
        if qkv.out_features != sum(attn.qkv_sizes) or hidden % 8:
            return None
        dtypes = {lin.kind for lin in (qkv, o, gate_up, down)}
        dtype = torch.bfloat16 if _BF16 in dtypes else None  # bfloat16 weights need bfloat16 activations
        act = native.ACTIVATIONS[layer.mlp.act] if not layer.sparse else 0
        if not layer.sparse and layer.mlp.act == "clamped_swiglu":
            return None  # a dense MLP never has gpt-oss's activation
        sinks = None if attn.sinks is None else attn.sinks.detach().float().reshape(attn.num_heads).contiguous()
        desc = _LayerDesc(**{place: norm.weight.data_ptr() for place, norm in placed.items()},
                          norm_bf16=int(norms[0].dtype == torch.bfloat16), qk_norm_whole=int(attn.norm_whole),
                          eps=next(iter(placed.values())).eps,
                          attn_scale=attn.scale, residual_scale=layer.residual_multiplier, hidden=hidden,
                          heads=attn.num_heads, kv_heads=attn.num_kv_heads, head_dim=attn.head_dim,
                          intermediate=down.in_features, act=act,
                          window=attn.window or 0, rotary_half=rope.cos.shape[1], qkv=qkv, o=o, gate_up=gate_up,
                          down=down, cos=rope.cos.data_ptr(), sin=rope.sin.data_ptr(),
                          sinks=None if sinks is None else sinks.data_ptr(), softcap=attn.softcap or 0.0,
                          moe=moe or _MoeDesc())
        return cls(desc, [*keep, *norms, rope.cos, rope.sin, sinks], dtype)

    def runs(self, x: torch.Tensor, tokens: SingleTokens) -> bool:
        return (x.dtype in (torch.float32, torch.bfloat16) and (self.dtype is None or x.dtype == self.dtype)
                and tokens.takes(x) and x.is_contiguous() and x.shape[-1] == self.desc.hidden)

    def __call__(self, x: torch.Tensor, tokens: SingleTokens, lora: object = None, layer: int = 0) -> torch.Tensor:
        """``x [T, hidden]`` through the layer, in place (it is returned); ``lora``: the step's adapters as
        ``qd_lora`` (``LoraRows.fused``), this layer being the model's layer ``layer``."""
        kv, items = tokens.cache.desc(), tokens.items.desc()
        rc = native.lib().qd_decoder_layer(
            self._ref, x.data_ptr(), int(x.dtype == torch.bfloat16), x.shape[0], tokens.positions.data_ptr(),
            tokens.slot_mapping.data_ptr(), ctypes.byref(kv), ctypes.byref(items), lora, layer)
        native._check(rc, "qd_decoder_layer")
        return x


class FusedStack:
    """Consecutive fused layers in one C call (``qd_decoder_stack``): a step's layers without a Python round trip
    per layer. Holds its layers, so their descriptions stay alive (and their ids unique) while it exists."""

    def __init__(self, layers: list[FusedLayer]) -> None:
        self.layers = layers
        self._array = (_P * len(layers))(*[ctypes.addressof(layer.desc) for layer in layers])
        needs = {layer.dtype for layer in layers} - {None}
        self.dtype = needs.pop() if len(needs) == 1 else None
        self.usable = len(needs) <= 1 and len({layer.desc.hidden for layer in layers}) == 1 and all(
            layer.whole for layer in layers)
        self.hidden = layers[0].desc.hidden

    def runs(self, x: torch.Tensor, tokens: SingleTokens) -> bool:
        return (self.usable and x.dtype in (torch.float32, torch.bfloat16)
                and (self.dtype is None or x.dtype == self.dtype) and tokens.takes(x)
                and x.is_contiguous() and x.shape[-1] == self.hidden)

    def __call__(self, x: torch.Tensor, tokens: SingleTokens, lora: object = None) -> torch.Tensor:
        """``x [T, hidden]`` through every layer, in place (it is returned); ``tokens`` carries layer 0's cache;
        ``lora``: the step's adapters (``LoraRows.fused``)."""
        kv, items = tokens.cache.desc(), tokens.items.desc()
        rc = native.lib().qd_decoder_stack(
            self._array, len(self.layers), x.data_ptr(), int(x.dtype == torch.bfloat16), x.shape[0],
            tokens.positions.data_ptr(), tokens.slot_mapping.data_ptr(), ctypes.byref(kv), tokens.layer_stride,
            tokens.scale_layer_stride, ctypes.byref(items), lora)
        native._check(rc, "qd_decoder_stack")
        return x


class FusedExperts:
    """A mixture's experts as one C call (``qd_moe``): every expert's gate/up (applying SwiGLU, or returning
    [gate | up] for ``qd_gated``'s activation: gpt-oss's clamped SwiGLU) and down on quickdraft's quantized kernel, the
    routing loop and the weighted sum in C, with the module path's arithmetic (``SparseMoE``), so both give the same
    bits. None from ``build`` where an expert's linears do not run there."""

    def __init__(self, gate_up: ctypes.Array, down: ctypes.Array, keep: list[object], hidden: int,
                 act: tuple[int, float, float]) -> None:
        self.gate_up, self.down, self._keep, self.hidden, self.act = gate_up, down, keep, hidden, act

    @classmethod
    def build(cls, experts: list[nn.Module]) -> FusedExperts | None:
        """``experts``: the mixture's MLPs, each with one gate/up projection, activated (SwiGLU) or not."""
        if not native.available() or any(getattr(e, "gate_up_proj", None) is None for e in experts):
            return None
        if len({e.activated for e in experts}) != 1 or (not experts[0].activated and experts[0].act != "clamped_swiglu"):
            return None  # (other activations are dense MLPs')
        described = [(_linear(e.gate_up_proj), _linear(e.down_proj)) for e in experts]
        if any(g is None or d is None or g[0].kind != _QUANTIZED or d[0].kind != _QUANTIZED for g, d in described):
            return None
        gate_up = (_LinearDesc * len(experts))(*[g[0] for g, _ in described])
        down = (_LinearDesc * len(experts))(*[d[0] for _, d in described])
        first = experts[0]
        act = (0, 0.0, 0.0) if first.activated else (native.ACTIVATIONS[first.act], first.limit, first.alpha)
        return cls(gate_up, down, [x for g, d in described for x in (g[1], d[1])], described[0][1][0].out_features,
                   act)

    def runs(self, x: torch.Tensor) -> bool:
        return (x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16) and x.dim() == 2
                and x.shape[1] == self.hidden)

    def __call__(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x ``[T, hidden]``; experts (int64) and weights (float32) ``[T, k]``; returns ``[T, hidden]`` in x's dtype."""
        x, experts, weights = x.contiguous(), experts.contiguous(), weights.float().contiguous()
        out = torch.empty_like(x)
        rc = native.lib().qd_moe(self.gate_up, self.down, len(self.gate_up), x.data_ptr(), int(x.dtype == torch.bfloat16),
                                 x.shape[0], self.hidden, experts.shape[1], experts.data_ptr(), weights.data_ptr(),
                                 *self.act, out.data_ptr())
        native._check(rc, "qd_moe")
        return out
