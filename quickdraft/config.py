"""Model architecture description shared by loaders and the torch model.

A family is data: the fields below say how its decoder differs from Llama's (``models/transformer.py`` reads them);
``loading/hf_config.py`` and ``loading/gguf_families.py`` map each checkpoint format's names and keys onto them.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "smollm3", "granite",
                           "olmo2", "qwen3_moe", "mixtral", "olmoe", "gpt_oss")
ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "longrope", "yarn")
# Bounds far beyond any checkpoint's values (factors of 1 to ~100, bases of 10^4 to 10^8, widths of ~16k, contexts of
# up to ~10M tokens): within them every RoPE angle stays finite and every size fits the C kernels' ints, and a damaged
# value is refused at load rather than failing every request (or sizing a loop or an allocation) later.
FACTOR_RANGE = (1e-3, 1e6)
THETA_RANGE = (1.0, 1e12)
# query_pre_attn_scalar (attention scale = its -1/2 power), the embedding and residual multipliers, the logits' divisor
SCALAR_RANGE = (1e-3, 1e9)
ATTENTION_MULTIPLIER_RANGE = (1e-6, 1e3)  # Granite's attention scale itself (1/64 in the released models)
MAX_WIDTH = 1 << 20
MAX_CONTEXT = 1 << 24
MAX_EXPERTS = 1 << 12  # the largest mixtures have a few hundred experts a layer
# fields added since saved sessions began fingerprinting the config (loading/checkpoint.content_fingerprint): each is
# hashed only where it differs from its default, so a model whose fingerprint did not use it keeps the fingerprint
# (and its sessions resume); a field added later joins them
ADDED_FIELDS = ("rotary_dim", "unrotated_layers", "attention_multiplier", "residual_multiplier", "logits_scaling",
                "pre_norms", "attn_logit_softcapping", "final_logit_softcapping")


def _is_int(value: object, low: int, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def _is_number(value: object, low: float, high: float) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and low <= value <= high


def every_nth_full(num_layers: int, n: int) -> tuple[str, ...]:
    """Gemma 3's interleave: every ``n``-th layer attends to the whole context, the others slide."""
    return tuple("full_attention" if (i + 1) % n == 0 else "sliding_attention" for i in range(num_layers))
ACTIVATIONS = ("silu", "gelu_tanh")
LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass(frozen=True)
class RopeScaling:
    """How a checkpoint stretches RoPE past its training context (HF's ``rope_scaling`` / ``rope_parameters``).

    ``linear`` divides every frequency by ``factor``; ``dynamic`` (NTK) raises the base past the original context:
    position p gets the base HF computes for a forward of length p + 1, which is what HF gives a token decoded one at
    a time (a prompt longer than the original context HF rotates wholly with its last position's base, so the two
    agree up to the original context and in decoding); ``llama3`` divides low frequencies by
    ``factor`` and blends the middle band; ``longrope`` (Phi-3) divides each frequency by its own factor,
    ``short_factor`` up to the original context and ``long_factor`` from there (per position, so a token's
    rotation never depends on the batch), and scales cos and sin by ``attention_factor``; ``yarn`` (gpt-oss) divides
    the frequencies below the band ``beta_slow``..``beta_fast`` rotations by ``factor``, keeps those above it and
    ramps linearly between (``truncate``: the band's ends rounded outward), and scales cos and sin by
    ``attention_factor`` (default ``0.1 ln(factor) + 1``)."""

    type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    attention_factor: float | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True

    def __post_init__(self) -> None:
        if self.type not in ROPE_TYPES:
            raise ValueError(f"unsupported rope scaling type {self.type!r}; supported: {', '.join(ROPE_TYPES)}")
        for name in ("short_factor", "long_factor"):
            if not isinstance(getattr(self, name), tuple) or len(getattr(self, name)) > MAX_WIDTH:
                raise ValueError(f"rope scaling {name} must be a list of at most {MAX_WIDTH:,} numbers")
        numbers = [self.factor, self.low_freq_factor, self.high_freq_factor, *self.short_factor, *self.long_factor,
                   self.beta_fast, self.beta_slow]
        if self.attention_factor is not None:
            numbers.append(self.attention_factor)
        low, high = FACTOR_RANGE
        bad = next((x for x in numbers if not _is_number(x, low, high)), None)
        if bad is not None:
            raise ValueError(f"rope scaling {self.type!r} has a factor {bad!r}; allowed: {low:g} to {high:g}")
        if self.type == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            raise ValueError("rope scaling 'llama3' needs high_freq_factor > low_freq_factor")
        original = self.original_max_position_embeddings
        if not isinstance(self.truncate, bool):
            raise ValueError(f"rope scaling truncate={self.truncate!r}; it must be true or false")
        if self.type in ("llama3", "longrope", "dynamic", "yarn") and not _is_int(original, 2, MAX_CONTEXT):
            raise ValueError(f"rope scaling {self.type!r} needs original_max_position_embeddings, an int in 2 to "
                             f"{MAX_CONTEXT:,}; got {original!r}")
        if self.type == "longrope" and (not self.short_factor or len(self.short_factor) != len(self.long_factor)):
            raise ValueError("rope scaling 'longrope' needs short_factor and long_factor lists of one length")

    @property
    def attention(self) -> float:
        """What longrope and yarn scale cos and sin by: ``attention_factor``, else transformers' default from
        ``factor``."""
        if self.attention_factor is not None:
            return self.attention_factor
        if self.factor <= 1.0:
            return 1.0
        if self.type == "yarn":
            return 0.1 * math.log(self.factor) + 1.0
        return math.sqrt(1 + math.log(self.factor) / math.log(self.original_max_position_embeddings))


@dataclass(frozen=True)
class ModelConfig:
    """Everything the transformer needs to know about a checkpoint.

    Llama is the base: pre-norm attention and a SwiGLU MLP. Qwen2 adds a bias on q/k/v; SmolLM ties the head;
    Qwen3 normalizes q and k per head (``qk_norm``); Mistral slides a window; Gemma 3 scales the embeddings, wraps
    attention and MLP in norms before and after (``sandwich_norms``), gates with GELU-tanh, interleaves sliding and
    full layers and gives sliding layers their own RoPE base (Gemma 2 alternates them, has no q/k norms, and
    soft-caps attention scores and the final logits, ``cap * tanh(x / cap)``); Phi-3 stores q/k/v and gate/up fused
    (split at load) and stretches RoPE with longrope (Phi-4-mini rotates only the first ``rotary_dim`` dims of each
    head); SmolLM3 leaves RoPE out of every 4th layer (``unrotated_layers``); Granite scales embeddings, attention, each residual
    add and the logits by multipliers of its own; OLMo 2 keeps only the norms after attention and after the MLP
    (``pre_norms`` False) and normalizes all of q and of k at once, as OLMoE does.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    rope_scaling: RopeScaling | None = None  # of full-attention layers (Gemma 3's sliding layers have none)
    local_rope_theta: float | None = None  # RoPE base of sliding layers when it differs (Gemma 3)
    sliding_window: int | None = None  # a sliding layer at position i sees keys j with i - window < j <= i
    layer_types: tuple[str, ...] = ()  # one of LAYER_TYPES per layer; () = every layer full, or sliding if a window is set
    qk_norm: bool = False  # RMSNorm over each head of q and k before RoPE
    # RoPE rotates the first rotary_dim dims of each q and k head (Phi-4-mini: 3/4 of them), the rest pass as they are;
    # None: all. Layers in unrotated_layers attend without RoPE at all (SmolLM3: every 4th, "NoPE")
    rotary_dim: int | None = None
    unrotated_layers: tuple[int, ...] = ()
    sandwich_norms: bool = False  # norms after attention and after the MLP too (Gemma)
    pre_norms: bool = True  # False: none before attention or the MLP, only the sandwich's after them (OLMo 2)
    hidden_act: str = "silu"  # the MLP's gate activation
    embedding_multiplier: float = 1.0  # embeddings times this (Gemma: sqrt(hidden_size))
    query_pre_attn_scalar: float | None = None  # attention scale is this ** -0.5; None: head_dim ** -0.5
    # Granite's multipliers: the attention scale itself (over query_pre_attn_scalar), each attention and MLP output
    # times residual_multiplier before its residual add, and the logits divided by logits_scaling
    attention_multiplier: float | None = None
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    # Gemma 2: each attention score (after the scale) and each final logit soft-capped to (-cap, cap) as
    # cap * tanh(x / cap); None: not capped
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    qk_norm_per_head: bool = True  # with qk_norm: each head (Qwen3, Gemma 3), or all of q and of k at once (OLMoE)
    clip_qkv: float | None = None  # q, k and v clamped to +-clip_qkv (OLMoE)
    # a mixture of experts (Qwen3-MoE, Mixtral, OLMoE): num_experts per layer (0: dense), each token's top
    # num_experts_per_tok of them, renormalized to sum to 1 with norm_topk_prob; expert_intermediate_size: an expert's
    # width (None: intermediate_size); dense_layers: layers that keep a dense MLP of intermediate_size
    num_experts: int = 0
    num_experts_per_tok: int = 0
    expert_intermediate_size: int | None = None
    norm_topk_prob: bool = True
    dense_layers: tuple[int, ...] = ()
    # gpt-oss: a learned logit per query head that every softmax of attention also normalizes over (a "sink" no
    # value comes from); a bias on the attention's output projection; a bias on the router's logits and on each
    # expert's linears; experts gated by a clamped SwiGLU, (clamp(up, +-limit) + 1) * g * sigmoid(alpha * g) with
    # g = min(gate, limit) (None: plain SwiGLU)
    attention_sinks: bool = False
    attention_out_bias: bool = False
    router_bias: bool = False
    expert_bias: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.0

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim"):
            if not _is_int(getattr(self, name), 1, MAX_WIDTH):
                raise ValueError(f"{name}={getattr(self, name)!r}; allowed: an int in 1 to {MAX_WIDTH:,}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim}; rotary embeddings need an even head dimension")
        rotary = self.rotary_dim
        if rotary is not None and not (_is_int(rotary, 2, self.head_dim) and rotary % 2 == 0):
            raise ValueError(f"rotary_dim={self.rotary_dim!r}; allowed: an even int in 2 to head_dim={self.head_dim}")
        if any(not _is_int(i, 0, self.num_layers - 1) for i in self.unrotated_layers):
            raise ValueError(f"unrotated_layers={list(self.unrotated_layers)!r:.80}; allowed: layer numbers below "
                             f"{self.num_layers}")
        if not _is_int(self.max_position_embeddings, 1, MAX_CONTEXT):
            raise ValueError(f"max_position_embeddings={self.max_position_embeddings!r}; allowed: an int in 1 to "
                             f"{MAX_CONTEXT:,}")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"unsupported hidden_act {self.hidden_act!r}; supported: {', '.join(ACTIVATIONS)}")
        if not self.pre_norms and not self.sandwich_norms:
            raise ValueError("pre_norms=False needs sandwich_norms: a layer needs a norm before or after each block")
        if self.sandwich_norms and self.num_experts:
            raise ValueError("sandwich_norms with a mixture of experts is not supported (no such family)")
        self._check_layers()
        self._check_scales()
        self._check_experts()

    def _check_layers(self) -> None:
        if self.layer_types and (len(self.layer_types) != self.num_layers
                                 or any(t not in LAYER_TYPES for t in self.layer_types)):
            raise ValueError(f"layer_types must name one of {', '.join(LAYER_TYPES)} for each of the "
                             f"{self.num_layers} layers")
        if self.sliding_window is not None and not _is_int(self.sliding_window, 1, MAX_CONTEXT):
            raise ValueError(f"sliding_window={self.sliding_window!r}; allowed: a number of tokens, an int in 1 to "
                             f"{MAX_CONTEXT:,}")
        if "sliding_attention" in self.layer_types and self.sliding_window is None:
            raise ValueError("layer_types has sliding layers but no sliding_window is set")

    def _check_scales(self) -> None:
        for name in ("rope_theta", "local_rope_theta"):
            value = getattr(self, name)
            if value is not None and not (_is_number(value, *THETA_RANGE) and value > THETA_RANGE[0]):
                raise ValueError(f"{name}={value}; allowed: above {THETA_RANGE[0]:g} up to {THETA_RANGE[1]:g}")
        for name in ("embedding_multiplier", "query_pre_attn_scalar", "residual_multiplier", "logits_scaling",
                     "attn_logit_softcapping", "final_logit_softcapping"):
            value = getattr(self, name)
            # None: head_dim's scale, no cap; the multipliers always have a value
            optional = name in ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping")
            if not (optional and value is None) and not _is_number(value, *SCALAR_RANGE):
                raise ValueError(f"{name}={value!r}; allowed: {SCALAR_RANGE[0]:g} to {SCALAR_RANGE[1]:g}")
        low, high = ATTENTION_MULTIPLIER_RANGE
        if self.attention_multiplier is not None and not _is_number(self.attention_multiplier, low, high):
            raise ValueError(f"attention_multiplier={self.attention_multiplier!r}; allowed: {low:g} to {high:g}")
        if self.clip_qkv is not None and not _is_number(self.clip_qkv, 1e-6, 1e9):
            raise ValueError(f"clip_qkv={self.clip_qkv!r}; allowed: 1e-06 to 1e+09")
        if self.swiglu_limit is not None and not _is_number(self.swiglu_limit, 1e-6, 1e9):
            raise ValueError(f"swiglu_limit={self.swiglu_limit!r}; allowed: 1e-06 to 1e+09")
        if not _is_number(self.swiglu_alpha, 1e-6, 1e9):
            raise ValueError(f"swiglu_alpha={self.swiglu_alpha!r}; allowed: 1e-06 to 1e+09")
        if not _is_number(self.rms_norm_eps, 0.0, 1.0) or not self.rms_norm_eps > 0:
            raise ValueError(f"rms_norm_eps={self.rms_norm_eps!r}; allowed: above 0 up to 1")
        scaling = self.rope_scaling
        if scaling is not None and scaling.type == "dynamic" and self.rotated_dims <= 2:  # its base has dims / (dims - 2)
            raise ValueError(f"dynamic RoPE scaling needs more than 2 rotated dims; rotary_dim={self.rotary_dim}")
        if scaling is not None and scaling.type == "longrope" and len(scaling.short_factor) != self.rotated_dims // 2:
            raise ValueError(f"longrope factors have {len(scaling.short_factor)} entries; {self.rotated_dims} rotated "
                             f"dims need {self.rotated_dims // 2}, one per frequency")

    def _check_experts(self) -> None:
        """A mixture's sizes, checked before any weight is read (a damaged count would size every allocation)."""
        if not _is_int(self.num_experts, 0, MAX_EXPERTS):
            raise ValueError(f"num_experts={self.num_experts!r}; allowed: an int in 0 (dense) to {MAX_EXPERTS:,}")
        if not self.num_experts:
            if self.num_experts_per_tok or self.dense_layers:
                raise ValueError("num_experts_per_tok and dense_layers need num_experts > 0")
            return
        if not _is_int(self.num_experts_per_tok, 1, self.num_experts):
            raise ValueError(f"num_experts_per_tok={self.num_experts_per_tok!r}; allowed: an int in 1 to "
                             f"num_experts={self.num_experts}")
        width = self.expert_intermediate_size
        if width is not None and not _is_int(width, 1, MAX_WIDTH):
            raise ValueError(f"expert_intermediate_size={width!r}; allowed: an int in 1 to {MAX_WIDTH:,}")
        if any(not _is_int(i, 0, self.num_layers - 1) for i in self.dense_layers):
            raise ValueError(f"dense_layers={list(self.dense_layers)!r:.80}; allowed: layer numbers below "
                             f"{self.num_layers}")

    def is_moe_layer(self, layer: int) -> bool:
        """Whether ``layer``'s feed-forward is a mixture of experts."""
        return self.num_experts > 0 and layer not in self.dense_layers

    @property
    def expert_width(self) -> int:
        return self.expert_intermediate_size or self.intermediate_size

    def is_sliding(self, layer: int) -> bool:
        """Whether ``layer`` attends within the sliding window."""
        if self.sliding_window is None:
            return False
        return self.layer_types[layer] == "sliding_attention" if self.layer_types else True

    def window(self, layer: int) -> int | None:
        """How many keys (itself included) a token of ``layer`` sees at most; None: its whole context."""
        return self.sliding_window if self.is_sliding(layer) else None

    @property
    def rotated_dims(self) -> int:
        """How many of each head's dims RoPE rotates (in layers that rotate at all)."""
        return self.head_dim if self.rotary_dim is None else self.rotary_dim

    @property
    def attention_scale(self) -> float:
        if self.attention_multiplier is not None:
            return self.attention_multiplier
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """The inverse of ``to_dict`` (JSON turns tuples into lists). Raises TypeError/ValueError on a damaged one."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown ModelConfig fields {unknown}")
        d = dict(d)
        d["eos_token_ids"] = tuple(d.get("eos_token_ids", ()))
        d["layer_types"] = tuple(d.get("layer_types", ()))
        d["dense_layers"] = tuple(d.get("dense_layers", ()))
        d["unrotated_layers"] = tuple(d.get("unrotated_layers", ()))
        scaling = d.get("rope_scaling")
        if isinstance(scaling, dict):
            d["rope_scaling"] = RopeScaling(**{**scaling, "short_factor": tuple(scaling.get("short_factor", ())),
                                               "long_factor": tuple(scaling.get("long_factor", ()))})
        return cls(**d)

    @property
    def num_parameters(self) -> int:
        d, f, v, l = self.hidden_size, self.intermediate_size, self.vocab_size, self.num_layers
        q = self.num_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        norms = (2 if self.pre_norms else 0) + (2 if self.sandwich_norms else 0)
        per_layer = d * (q + 2 * kv) + q * d + d * norms
        per_layer += ((2 * self.head_dim if self.qk_norm_per_head else q + kv) if self.qk_norm else 0)
        feed_forward = sum(self.num_experts * (3 * d * self.expert_width + d) if self.is_moe_layer(i) else 3 * d * f
                           for i in range(l))
        head = 0 if self.tie_word_embeddings else v * d
        return l * per_layer + feed_forward + v * d + head + d
