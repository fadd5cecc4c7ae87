"""The one builder: a model name and options -> a ready ``LLMEngine`` with its models, tokenizer and drafter.

``LLM``, the server and sessions all start from ``build_engine``; nothing else loads, quantizes or wires models.
Every option is checked before any model is loaded, so a bad one fails at once.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from quickdraft.engine.engine import EngineConfig, LLMEngine
from quickdraft.engine.scheduler import SchedulerConfig
from quickdraft.engine.threads import check_threads
from quickdraft.errors import InvalidParameterError, ModelLoadError
from quickdraft.kv import ModelRunner
from quickdraft.loading import Checkpoint, load_checkpoint
from quickdraft.loading.quantize import (DRAFT_INT4_OPTIONS, FLOAT_FORMATS, QUANT_FORMATS, quantize_checkpoint,
                                        resolve_draft_weights, resolve_weights, restrict_lm_head, weights_summary)
from quickdraft.models import Transformer, build_model, native
from quickdraft.speculative.drafters import Drafter, ModelDrafter, NgramDrafter
from quickdraft.speculative.run_ahead import RunAheadDrafter
from quickdraft.tokenizer import Tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SPECULATIVE = ("ngram", "self")


@dataclass
class EngineOptions:
    """Everything ``LLM(model, ...)`` takes besides the model; see ``LLM.__init__`` for what each means."""

    draft: str | None = None
    speculative: str | None = None
    num_speculative_tokens: int | str = "auto"
    max_speculative_tokens: int = 8
    dtype: str = "auto"
    weights: str = "auto"
    draft_weights: str = "auto"
    draft_vocab: int | None = None
    device: str = "cpu"
    max_model_len: int | None = None
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 512
    policy: str = "fcfs"
    preemption: str = "recompute"
    kv_cache_memory: int | str = "1GiB"
    block_size: int = 16
    self_draft_layers: int | None = None
    ngram_max: int = 4
    ngram_min: int = 1
    run_ahead: bool = False
    threads: int | str = "auto"

    def __post_init__(self) -> None:
        check_threads(self.threads)
        if self.draft is not None and self.speculative is not None:
            raise InvalidParameterError("pass either draft=MODEL or speculative='ngram'|'self', not both")
        v = self.draft_vocab
        if v is not None and (self.draft is None or isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise InvalidParameterError(f"draft_vocab must be a positive int and needs draft=MODEL, got {v!r}"
                                        + ("" if self.draft is not None else " without a draft model"))
        if self.speculative is not None and self.speculative not in SPECULATIVE:
            raise InvalidParameterError(
                f"speculative must be one of {', '.join(SPECULATIVE)}, got {self.speculative!r}")


@dataclass
class LoadedEngine:
    """What ``build_engine`` made: the engine and the models, tokenizer and formats it runs with."""

    engine: LLMEngine
    tokenizer: Tokenizer
    model: Transformer
    checkpoint: Checkpoint
    draft_checkpoint: Checkpoint | None
    dtype: torch.dtype
    weights: str  # the target's weight format: int4, int8 or a float dtype's name
    draft_weights: str | None
    device: str

    @property
    def target(self) -> ModelRunner:
        return self.engine.target

    @property
    def drafter(self) -> Drafter | None:
        return self.engine.drafter

    @property
    def max_model_len(self) -> int:
        return self.engine.config.max_model_len

    @property
    def weights_summary(self) -> str:
        """Which kernels the target's linear layers run on and how the file stores them (see ``weights_summary``)."""
        return weights_summary(self.model, self.checkpoint, self.weights)

    def chat_prompt(self, messages: list[dict]) -> list[int]:
        """Token ids of a conversation rendered with the model's chat template, ready for the reply."""
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return self.tokenizer.encode(text, add_special_tokens=False)


def parse_size(size: int | str) -> int:
    """'2GiB', '512MB', '1.5G' or a byte count."""
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*([\d.]+)\s*([KMGT]?)(i?B)?\s*", str(size), re.IGNORECASE)
    if not m:
        raise InvalidParameterError(f"kv_cache_memory must be a size like '2GiB' or '512MB', got {size!r}")
    return int(float(m.group(1)) * 1024 ** "_KMGT".index(m.group(2).upper() or "_"))


def resolve_dtype(dtype: str, device: str) -> torch.dtype:
    if dtype == "auto":
        if device.startswith("cuda"):
            return torch.bfloat16
        return torch.bfloat16 if {"avx512_bf16", "amx_bf16"} & native.cpu_flags() else torch.float32
    if dtype not in DTYPES:
        raise InvalidParameterError(f"dtype must be one of auto, {', '.join(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


def tokenizer_for(ckpt: Checkpoint) -> Tokenizer:
    if ckpt.gguf_metadata is not None:
        return Tokenizer.from_gguf_metadata(ckpt.gguf_metadata, chat_template=ckpt.chat_template)
    return Tokenizer.from_hf_dir(ckpt.hf_dir)


def build_engine(model: str, options: EngineOptions) -> LoadedEngine:
    """Load ``model`` (and the draft), put their weights in the chosen formats and wire the engine."""
    o = options
    # an explicit draft format is checked (and its float dtype known) before anything is loaded
    draft_fmt = None if o.draft_weights == "auto" else resolve_weights(o.draft_weights, o.device)
    resolve_weights(o.weights, o.device)  # a bad format fails before anything is loaded
    dtype = resolve_dtype(o.weights if o.weights in FLOAT_FORMATS else o.dtype, o.device)
    kv_bytes = parse_size(o.kv_cache_memory)
    checkpoint = load_checkpoint(model, dtype=dtype)
    # int4/int8 keep the linear layers quantized (activations, embeddings and norms stay in `dtype`), None keeps
    # float weights in `dtype`; "auto" follows the file's own precision (see loading/weight_choice.py)
    fmt = resolve_weights(o.weights, o.device, checkpoint.tensor_types)
    weights = fmt or str(dtype).removeprefix("torch.")
    tokenizer = tokenizer_for(checkpoint)
    target_model = _build_model(checkpoint, weights, o.device)
    cfg = checkpoint.config
    max_model_len = min(o.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
    target = ModelRunner("target", target_model, kv_bytes, o.block_size)
    # one sequence of the full context (plus drafts) must fit in the pool, or it could never finish
    capacity = target.allocator.num_blocks * o.block_size - o.max_speculative_tokens - 1
    if capacity < max_model_len:
        if o.max_model_len is not None:
            raise InvalidParameterError(
                f"max_model_len={o.max_model_len} does not fit in the KV cache ({capacity} tokens with "
                f"kv_cache_memory={o.kv_cache_memory}); raise kv_cache_memory or lower max_model_len")
        max_model_len = capacity
    drafter, draft_checkpoint, draft_weights = None, None, None
    if o.draft is not None:
        draft_checkpoint = load_checkpoint(o.draft, dtype=FLOAT_FORMATS.get(draft_fmt, dtype))
        check_same_vocabulary(tokenizer, tokenizer_for(draft_checkpoint))
        draft_weights = draft_fmt or resolve_draft_weights("auto", weights, draft_checkpoint.config, o.device)
        drafter = _draft_model_drafter(o, draft_checkpoint, draft_weights, dtype, kv_bytes, cfg.vocab_size)
    elif o.speculative == "ngram":
        drafter = NgramDrafter(o.ngram_max, o.ngram_min)
    elif o.speculative == "self":
        layers = o.self_draft_layers or max(1, cfg.num_layers // 4)
        if not 1 <= layers < cfg.num_layers:
            raise InvalidParameterError(f"self_draft_layers must be in 1..{cfg.num_layers - 1}, got {layers}")
        drafter_class = RunAheadDrafter if o.run_ahead else ModelDrafter
        drafter = drafter_class(ModelRunner("self", target_model, kv_bytes, o.block_size, num_layers=layers),
                                cfg.vocab_size, name="self")
    config = EngineConfig(
        max_model_len=max_model_len,
        scheduler=SchedulerConfig(max_num_seqs=o.max_num_seqs, max_num_batched_tokens=o.max_num_batched_tokens,
                                  policy=o.policy, preemption=o.preemption),
        num_speculative_tokens=o.num_speculative_tokens if drafter is not None else 0,
        max_speculative_tokens=o.max_speculative_tokens, threads=o.threads)
    engine = LLMEngine(target, tokenizer, config, drafter)
    return LoadedEngine(engine, tokenizer, target_model, checkpoint, draft_checkpoint, dtype, weights, draft_weights,
                        o.device)


def _build_model(checkpoint: Checkpoint, fmt: str, device: str, options: dict | None = None,
                 head_rows: int | None = None, release: bool = True) -> Transformer:
    model = build_model(checkpoint.config, checkpoint.tensors, device)
    if head_rows is not None:
        restrict_lm_head(model, head_rows)
    return quantize_checkpoint(model, checkpoint, fmt, release=release, **(options or {}))


def _draft_model_drafter(o: EngineOptions, checkpoint: Checkpoint, fmt: str, dtype: torch.dtype, kv_bytes: int,
                         target_vocab: int) -> ModelDrafter:
    """A draft model in ``fmt``; a quantized draft keeps float weights too, for long prompts (see ModelRunner), except
    where the int4 kernel is faster at every length (``wide_int8_dot_products``)."""
    quantized = fmt in QUANT_FORMATS
    int4_everywhere = fmt == "int4" and str(o.device).startswith("cpu") and native.wide_int8_dot_products()
    keep_float = quantized and not int4_everywhere
    draft_model = _build_model(checkpoint, fmt, o.device, DRAFT_INT4_OPTIONS if fmt == "int4" else {}, o.draft_vocab,
                               release=not keep_float)
    long_model = _build_model(checkpoint, str(dtype).removeprefix("torch."), o.device, None,
                              o.draft_vocab) if keep_float else None
    drafter_class = RunAheadDrafter if o.run_ahead else ModelDrafter
    return drafter_class(ModelRunner("draft", draft_model, kv_bytes, o.block_size, long_model=long_model),
                         target_vocab)


def check_same_vocabulary(target: Tokenizer, draft: Tokenizer) -> None:
    """Draft and target must share a tokenizer; checkpoint vocab sizes may differ by padding rows only."""
    step = max(1, target.vocab_size // 512)
    same = target.vocab_size == draft.vocab_size and all(
        target.decode([i]) == draft.decode([i]) for i in range(0, target.vocab_size, step))
    if not same:
        raise ModelLoadError(
            f"draft model tokenizer ({draft.vocab_size} tokens) does not match the target's "
            f"({target.vocab_size} tokens); speculative decoding needs the same vocabulary")
