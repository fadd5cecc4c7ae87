"""Model architecture description shared by loaders and the torch model.

A family is data: the fields below say how its decoder differs from Llama's (``models/transformer.py`` reads them);
``loading/hf_config.py`` and ``loading/gguf_families.py`` map each checkpoint format's names and keys onto them.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma3", "phi3")
ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "longrope")
# far beyond any checkpoint's values (factors of 1 to ~100, bases of 10^4 to 10^8), and within them every angle of a
# 16M-position table stays finite
FACTOR_RANGE = (1e-3, 1e6)
THETA_RANGE = (1.0, 1e12)
ACTIVATIONS = ("silu", "gelu_tanh")
LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass(frozen=True)
class RopeScaling:
    """How a checkpoint stretches RoPE past its training context (HF's ``rope_scaling`` / ``rope_parameters``).

    ``linear`` divides every frequency by ``factor``; ``dynamic`` (NTK) raises the base for a context of
    ``factor`` times the original, fixed for the model's whole context as vLLM does (HF recomputes it from each
    forward's length, so the two agree up to the original context); ``llama3`` divides low frequencies by
    ``factor`` and blends the middle band; ``longrope`` (Phi-3) divides each frequency by its own factor,
    ``short_factor`` up to the original context and ``long_factor`` from there (per position, so a token's
    rotation never depends on the batch), and scales cos and sin by ``attention_factor``."""

    type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    attention_factor: float | None = None

    def __post_init__(self) -> None:
        if self.type not in ROPE_TYPES:
            raise ValueError(f"unsupported rope scaling type {self.type!r}; supported: {', '.join(ROPE_TYPES)}")
        numbers = [self.factor, self.low_freq_factor, self.high_freq_factor, *self.short_factor, *self.long_factor]
        if self.attention_factor is not None:
            numbers.append(self.attention_factor)
        low, high = FACTOR_RANGE
        if not all(isinstance(x, (int, float)) and low <= x <= high for x in numbers):
            bad = next(x for x in numbers if not (isinstance(x, (int, float)) and low <= x <= high))
            raise ValueError(f"rope scaling {self.type!r} has a factor {bad!r}; allowed: {low:g} to {high:g}")
        if self.type == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            raise ValueError("rope scaling 'llama3' needs high_freq_factor > low_freq_factor")
        if self.type in ("llama3", "longrope", "dynamic") and not self.original_max_position_embeddings:
            raise ValueError(f"rope scaling {self.type!r} needs original_max_position_embeddings")
        if self.type == "longrope" and (not self.short_factor or len(self.short_factor) != len(self.long_factor)):
            raise ValueError("rope scaling 'longrope' needs short_factor and long_factor lists of one length")


@dataclass(frozen=True)
class ModelConfig:
    """Everything the transformer needs to know about a checkpoint.

    Llama is the base: pre-norm attention and a SwiGLU MLP. Qwen2 adds a bias on q/k/v; SmolLM ties the head;
    Qwen3 normalizes q and k per head (``qk_norm``); Mistral slides a window; Gemma 3 scales the embeddings, wraps
    attention and MLP in norms before and after (``sandwich_norms``), gates with GELU-tanh, interleaves sliding and
    full layers and gives sliding layers their own RoPE base; Phi-3 stores q/k/v and gate/up fused (split at load)
    and stretches RoPE with longrope.
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
    sandwich_norms: bool = False  # norms after attention and after the MLP too (Gemma)
    hidden_act: str = "silu"  # the MLP's gate activation
    embedding_multiplier: float = 1.0  # embeddings times this (Gemma: sqrt(hidden_size))
    query_pre_attn_scalar: float | None = None  # attention scale is this ** -0.5; None: head_dim ** -0.5

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"unsupported hidden_act {self.hidden_act!r}; supported: {', '.join(ACTIVATIONS)}")
        if self.layer_types and (len(self.layer_types) != self.num_layers
                                 or any(t not in LAYER_TYPES for t in self.layer_types)):
            raise ValueError(f"layer_types must name one of {', '.join(LAYER_TYPES)} for each of the "
                             f"{self.num_layers} layers")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window={self.sliding_window}; it must be a positive number of tokens")
        if "sliding_attention" in self.layer_types and self.sliding_window is None:
            raise ValueError("layer_types has sliding layers but no sliding_window is set")
        for name in ("rope_theta", "local_rope_theta"):
            value = getattr(self, name)
            if value is not None and not THETA_RANGE[0] < value <= THETA_RANGE[1]:
                raise ValueError(f"{name}={value}; allowed: above {THETA_RANGE[0]:g} up to {THETA_RANGE[1]:g}")
        for name in ("embedding_multiplier", "query_pre_attn_scalar"):
            value = getattr(self, name)
            if value is not None and not 0 < value < math.inf:
                raise ValueError(f"{name}={value}; it must be a positive finite number")

    def is_sliding(self, layer: int) -> bool:
        """Whether ``layer`` attends within the sliding window."""
        if self.sliding_window is None:
            return False
        return self.layer_types[layer] == "sliding_attention" if self.layer_types else True

    def window(self, layer: int) -> int | None:
        """How many keys (itself included) a token of ``layer`` sees at most; None: its whole context."""
        return self.sliding_window if self.is_sliding(layer) else None

    @property
    def attention_scale(self) -> float:
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
        per_layer = d * (q + 2 * kv) + q * d + 3 * d * f + 2 * d
        per_layer += 2 * self.head_dim * self.qk_norm + 2 * d * self.sandwich_norms
        head = 0 if self.tie_word_embeddings else v * d
        return l * per_layer + v * d + head + d
