"""The one builder: a model name and options -> a ready ``LLMEngine`` with its models, tokenizer and drafter.

``LLM``, the server and sessions all start from ``build_engine``; nothing else loads, quantizes or wires models.
Every option is checked before any model is loaded, so a bad one fails at once.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from quickdraft.engine.engine import EngineConfig, LLMEngine, check_speculative_tokens
from quickdraft.engine.launch_ahead import check_launch_ahead
from quickdraft.engine.memory import KVNeed, MemoryPlan, fmt_bytes, parse_size, plan_memory, return_freed_heap
from quickdraft.engine.scheduler import SchedulerConfig
from quickdraft.engine.threads import check_threads
from quickdraft.config import ModelConfig
from quickdraft.errors import InvalidParameterError
from quickdraft.kv import STATIC_STEPS, KVPool, ModelRunner, check_kv_cache_dtype, resolve_kv_cache_dtype
from quickdraft.kv.paged_attention import kernel_possible
from quickdraft.loading import Checkpoint, load_checkpoint
from quickdraft.loading.lora import check_adapter_names, lora_weights, read_adapters
from quickdraft.loading.pack_float import check_gpu_linears, triton_float_linears
from quickdraft.loading.quantize import (DRAFT_INT4_OPTIONS, FLOAT_FORMATS, QUANT_FORMATS, default_lm_head,
                                        load_model, planned_bytes, resolve_draft_weights, resolve_weights,
                                        weights_summary)
from quickdraft.loading.weight_cache import dtype_name
from quickdraft.loading.weight_choice import head_kernel, planned_weight_bytes
from quickdraft.models import Transformer, native, weight_bytes
from quickdraft.speculative.drafters import Drafter, ModelDrafter, NgramDrafter
from quickdraft.speculative.run_ahead import RunAheadDrafter
from quickdraft.speculative.suffix import DEFAULT_CACHE_TOKENS, SuffixDrafter, check_suffix_options
from quickdraft.speculative.vocab import CrossVocabulary, SharedVocabulary
from quickdraft.tokenizer import Tokenizer

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SPECULATIVE = ("ngram", "self", "suffix")
STATIC_STEP_CHOICES = ("auto", *STATIC_STEPS)


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
    prefill_tokens_while_decoding: int | None = 128  # docs/MEASUREMENTS.md, Long contexts: streams' ITL vs prefill
    policy: str = "fcfs"
    preemption: str = "recompute"
    kv_cache_memory: int | str = "auto"
    kv_cache_dtype: str = "auto"
    max_memory: int | str | None = None
    block_size: int = 16
    self_draft_layers: int | None = None
    ngram_max: int = 4
    ngram_min: int = 1
    suffix_scope: str | None = None  # None: "global" with speculative="suffix"
    suffix_cache_tokens: int | None = None  # None: DEFAULT_CACHE_TOKENS with speculative="suffix"
    run_ahead: bool = False
    threads: int | str = "auto"
    static_step: str = "auto"
    launch_ahead: str = "auto"
    gpu_linears: str = "cublas"
    lora_adapters: dict[str, str] | None = None  # LoRA adapters by name (a PEFT directory or a GGUF LoRA)

    def __post_init__(self) -> None:
        check_threads(self.threads)
        self.scheduler_config()  # bad scheduling options fail before anything is loaded
        if self.kv_cache_memory != "auto":
            parse_size(self.kv_cache_memory, "kv_cache_memory")
        if self.max_memory is not None:
            parse_size(self.max_memory, "max_memory")
        check_kv_cache_dtype(self.kv_cache_dtype)
        self.runner_options()  # a bad static_step fails before anything is loaded
        check_launch_ahead(self.launch_ahead)  # before anything is loaded
        check_gpu_linears(self.gpu_linears, self.device)
        check_speculative_tokens(self.num_speculative_tokens)
        check_adapter_names(self.lora_adapters)
        if self.draft is not None and self.speculative not in (None, "suffix"):
            raise InvalidParameterError("pass either draft=MODEL or speculative='ngram'|'self', not both "
                                        "(speculative='suffix' may take a draft model beside it)")
        if self.speculative != "suffix" and (self.suffix_scope, self.suffix_cache_tokens) != (None, None):
            raise InvalidParameterError("suffix_scope and suffix_cache_tokens need speculative='suffix'")
        check_suffix_options(*self.suffix_options())
        v = self.draft_vocab
        if v is not None and (self.draft is None or isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise InvalidParameterError(f"draft_vocab must be a positive int and needs draft=MODEL, got {v!r}"
                                        + ("" if self.draft is not None else " without a draft model"))
        if self.speculative is not None and self.speculative not in SPECULATIVE:
            raise InvalidParameterError(f"speculative must be one of {', '.join(SPECULATIVE)}, got "
                                        f"{self.speculative!r}")

    @property
    def draft_limit(self) -> int:
        """The most drafts a verify pass holds: a fixed k (the engine's limit then), else ``max_speculative_tokens``."""
        return self.max_speculative_tokens if self.num_speculative_tokens == "auto" else self.num_speculative_tokens

    @property
    def drafts_ahead(self) -> bool:
        """Whether a run-ahead thread drafts (a draft model, or self-speculation) beside the target's steps."""
        with_model = self.draft is not None and self.speculative != "suffix" or self.speculative == "self"
        return self.run_ahead and with_model

    def suffix_options(self) -> tuple[str, int]:
        """(scope, cache tokens) of the suffix drafter, defaults filled in."""
        return (self.suffix_scope if self.suffix_scope is not None else "global",
                self.suffix_cache_tokens if self.suffix_cache_tokens is not None else DEFAULT_CACHE_TOKENS)

    def runner_options(self, cfg: ModelConfig | None = None) -> dict:
        """What the ModelRunner of a model of ``cfg`` takes: how its decode and verify forwards run (``static_step``:
        ``auto`` is replayed CUDA graphs on a GPU and the dynamic path elsewhere; see ``kv/static_step.py``) and
        the largest bucket. A mixture of experts reads its routing on the host every forward, which no graph can
        capture: ``auto`` runs its static step eagerly."""
        if self.static_step not in STATIC_STEP_CHOICES:
            raise InvalidParameterError(f"static_step must be one of {', '.join(STATIC_STEP_CHOICES)}, "
                                        f"got {self.static_step!r}")
        on_gpu = str(self.device).startswith("cuda")
        if self.static_step == "graphs" and not on_gpu:
            raise InvalidParameterError(f"static_step='graphs' needs device='cuda', got device={self.device!r}: use "
                                        "'eager' to run the static step without graphs")
        mode = ("graphs" if on_gpu else "off") if self.static_step == "auto" else self.static_step
        if mode == "graphs" and not kernel_possible(self.block_size):
            if self.static_step == "graphs":
                raise InvalidParameterError(f"static_step='graphs' needs Triton (pip install triton) and a block_size "
                                            f"that is a power of two of at least 16, got {self.block_size}")
            mode = "off"  # the torch fallback would read every block of every table in each graphed step
        if cfg is not None and cfg.num_experts and mode == "graphs":
            if self.static_step == "graphs":
                raise InvalidParameterError("static_step='graphs' cannot capture a mixture of experts (its routing is "
                                            "read on the host in every forward): use 'auto' or 'eager'")
            mode = "eager"
        # run-ahead drafts in a second thread on the same GPU: no graph may be captured while it runs
        return {"static_step": mode, "max_seqs": self.max_num_seqs, "max_queries": self.draft_limit + 1,
                "capture_chunks": not self.drafts_ahead}

    def scheduler_config(self) -> SchedulerConfig:
        return SchedulerConfig(max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
                               prefill_tokens_while_decoding=self.prefill_tokens_while_decoding, policy=self.policy,
                               preemption=self.preemption)


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
    memory: MemoryPlan  # what the weights and KV caps were planned to take
    # e.g. "smollm2-135m drafts for qwen2.5-coder-1.5b over 39,234 shared tokens": a draft of another vocabulary
    draft_pairing: str | None = None

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

    @property
    def runners(self) -> list[ModelRunner]:
        """The model runners with a KV cache of their own: the target's, and the drafter's when it has one."""
        draft = self.drafter.runner if self.drafter is not None else None
        return [self.target] + ([draft] if draft is not None and draft is not self.target else [])

    @property
    def memory_summary(self) -> str:
        """What the engine holds, e.g. ``'weights 1.02 GiB (int4), KV up to 10.5 GiB (1 MiB in use)'``: the weights as
        loaded (a memory-mapped embedding table counts whole, though only the rows read take memory; one read from the
        GGUF's blocks counts nothing) and the KV caches' caps, which fill as sequences need them."""
        models = {id(m): m for r in self.runners for m in (r.model, r.long_model) if m is not None}
        weights = sum(weight_bytes(m) for m in models.values())
        kv = self.kv_bytes()
        formats = self.weights + (f" + {self.draft_weights} draft" if self.draft_weights else "")
        return (f"weights {fmt_bytes(weights)} ({formats}), KV up to {fmt_bytes(kv['kv_bytes_cap'])} "
                f"({fmt_bytes(kv['kv_bytes_resident'])} in use)")

    def kv_bytes(self) -> dict[str, int]:
        """KV cache bytes over every cache: held by sequences and cached prefixes, in memory, and the caps."""
        return {"kv_bytes_used": sum(r.kv_bytes_used for r in self.runners),
                "kv_bytes_resident": sum(r.kv_bytes_touched for r in self.runners),
                "kv_bytes_cap": sum(r.kv_bytes_cap for r in self.runners)}

    def release_memory(self, keep_prefix_cache: bool = False) -> None:
        """Give back the KV memory no sequence holds (and, unless ``keep_prefix_cache``, the cached prefixes')."""
        for runner in self.runners:
            runner.release_memory(keep_prefix_cache)

    def chat_prompt(self, messages: list[dict], tools: list[dict] | None = None, **template_kwargs) -> list[int]:
        """Token ids of a conversation rendered with the model's chat template, ready for the reply; ``tools``
        (OpenAI's function list) reach the template as its ``tools``, ``template_kwargs`` as variables (Qwen3's
        ``enable_thinking``, gpt-oss's ``reasoning_effort``)."""
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tools=tools, **template_kwargs)
        return self.tokenizer.encode(text, add_special_tokens=False)


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
    """Load ``model`` (and the draft), put their weights in the chosen formats and wire the engine. The headers are
    read first and the memory planned (``memory.plan_memory``), so a configuration that cannot fit fails before any
    weight is loaded."""
    o = options
    draft_fmt = None if o.draft_weights == "auto" else resolve_weights(o.draft_weights, o.device)  # (checked first)
    resolve_weights(o.weights, o.device)  # a bad format fails before anything is loaded
    dtype = resolve_dtype(o.weights if o.weights in FLOAT_FORMATS else o.dtype, o.device)
    checkpoint = load_checkpoint(model, dtype=dtype)  # the header; tensors are read as the model is built
    # gguf/int4/int8 keep the linear layers quantized (activations, embeddings and norms stay in `dtype`), None keeps
    # float weights in `dtype`; "auto" follows the file's own types (see loading/weight_choice.py)
    fmt = resolve_weights(o.weights, o.device, checkpoint.tensor_types)
    weights = fmt or dtype_name(dtype)
    tokenizer = tokenizer_for(checkpoint)
    cfg = checkpoint.config
    draft_checkpoint, draft_weights, vocab = None, None, None
    if o.draft is not None:
        draft_checkpoint = load_checkpoint(o.draft, dtype=FLOAT_FORMATS.get(draft_fmt, dtype))
        vocab = draft_vocabulary(tokenizer, tokenizer_for(draft_checkpoint), Path(model).name, Path(o.draft).name,
                                 cfg.vocab_size)
        draft_weights = draft_fmt or resolve_draft_weights("auto", weights, draft_checkpoint.config, o.device)
    self_layers = None
    if o.speculative == "self":
        self_layers = o.self_draft_layers or max(1, cfg.num_layers // 4)
        if not 1 <= self_layers < cfg.num_layers:
            raise InvalidParameterError(f"self_draft_layers must be in 1..{cfg.num_layers - 1}, got {self_layers}")
    max_model_len = min(o.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
    plan = _memory_plan(o, checkpoint, fmt, draft_checkpoint, draft_weights, self_layers, max_model_len)
    if o.gpu_linears == "triton" and weights != "bfloat16":
        raise InvalidParameterError(f"gpu_linears='triton' runs bfloat16 weights, got weights={weights!r}")
    adapters = read_adapters(o.lora_adapters or {}, cfg)  # a bad adapter fails before any weight is read
    target_model = load_model(checkpoint, weights, o.device)
    target_model.lora = lora_weights(adapters, target_model, [str(p) for p in (o.lora_adapters or {}).values()])
    if o.gpu_linears == "triton":
        triton_float_linears(target_model, o.max_num_seqs * (o.draft_limit + 1))  # the largest decode/verify forward
    target = ModelRunner("target", target_model, plan.kv_caps["target"], o.block_size,
                         kv_dtype=_kv_dtype(o, checkpoint), **o.runner_options(cfg))
    # one sequence of the full context (plus drafts) must fit in the pool, or it could never finish
    capacity = target.allocator.num_blocks * o.block_size - o.draft_limit - 1
    if capacity < max_model_len:
        if o.max_model_len is not None:
            raise InvalidParameterError(
                f"max_model_len={o.max_model_len} does not fit in the KV cache ({capacity} tokens with "
                f"kv_cache_memory={o.kv_cache_memory}); raise kv_cache_memory or lower max_model_len")
        log.warning("the KV cache holds %d tokens of one sequence: max_model_len lowered from %d to that (raise "
                    "kv_cache_memory or max_memory for the model's full context)", capacity, max_model_len)
        max_model_len = capacity
    positions = max_model_len + o.draft_limit + 2  # a verify pass reaches k + 1 past the context
    target_model.limit_positions(positions)
    drafter = None
    if draft_checkpoint is not None:
        drafter = _draft_model_drafter(o, draft_checkpoint, draft_weights, dtype, plan.kv_caps["draft"],
                                       cfg.vocab_size, positions, vocab)
    if o.speculative == "suffix":  # suffix match first, the draft model (if any) where it has nothing
        drafter = SuffixDrafter(*o.suffix_options(), model=drafter, max_k=o.draft_limit)
    elif o.speculative == "ngram":
        drafter = NgramDrafter(o.ngram_max, o.ngram_min)
    elif self_layers is not None:
        drafter_class = RunAheadDrafter if o.drafts_ahead else ModelDrafter
        drafter = drafter_class(ModelRunner("self", target_model, plan.kv_caps["self"], o.block_size,
                                            num_layers=self_layers, kv_dtype=_kv_dtype(o, checkpoint),
                                            **o.runner_options(cfg)),
                                cfg.vocab_size, name="self")
    config = EngineConfig(
        max_model_len=max_model_len,
        scheduler=o.scheduler_config(),
        num_speculative_tokens=o.num_speculative_tokens if drafter is not None else 0,
        max_speculative_tokens=o.max_speculative_tokens, threads=o.threads, launch_ahead=o.launch_ahead)
    engine = LLMEngine(target, tokenizer, config, drafter)
    return_freed_heap()
    # the loading thread's OpenMP workers go: another thread (a server's) may run the engine
    if str(o.device).startswith("cpu") and native.available():
        native.lib().qd_release_threads()
    return LoadedEngine(engine, tokenizer, target_model, checkpoint, draft_checkpoint, dtype, weights, draft_weights,
                        o.device, plan, None if vocab is None else vocab.pairing)


def _memory_plan(o: EngineOptions, checkpoint: Checkpoint, fmt: str | None, draft: Checkpoint | None,
                 draft_fmt: str | None, self_layers: int | None, max_model_len: int) -> MemoryPlan:
    """Weights and KV caps of this configuration, from the headers alone (see ``memory.plan_memory``)."""
    cfg = checkpoint.config
    quantized = fmt if fmt in QUANT_FORMATS else None  # an explicit float format holds float weights
    head = head_kernel(quantized, default_lm_head(quantized), checkpoint.tensor_types)
    weights = {"target": planned_bytes(checkpoint, quantized, head, o.device)}
    # a sequence of the full context holds its drafts too (see the capacity check in build_engine)
    blocks = -(-(max_model_len + o.draft_limit + 1) // o.block_size)

    def kv_need(name: str, ckpt: Checkpoint, layers: int) -> KVNeed:
        c = ckpt.config
        per_block = KVPool.bytes_per_block(layers, c.num_kv_heads, c.head_dim, o.block_size, _kv_dtype(o, ckpt))
        return KVNeed(name, per_block, o.max_num_seqs * blocks)

    kv = [kv_need("target", checkpoint, cfg.num_layers)]
    if draft is not None:
        dc = draft.config
        int4 = draft_fmt == "int4"
        quantized = draft_fmt if draft_fmt in QUANT_FORMATS else None
        draft_head = "int4" if int4 else head_kernel(quantized, default_lm_head(quantized), draft.tensor_types)
        weights["draft"] = planned_bytes(draft, quantized, draft_head, o.device, "int4" if int4 else "int8")
        if _keeps_float(draft_fmt, o.device):
            weights["draft float copy"] = planned_weight_bytes(dc, draft.tensor_types, None, None, draft.dtype)
        kv.append(kv_need("draft", draft, dc.num_layers))
    if self_layers is not None:
        kv.append(kv_need("self", checkpoint, self_layers))
    # the least a cache may hold: one sequence of the context asked for, or of 2048 tokens when max_model_len may shrink
    shortest = max_model_len if o.max_model_len is not None else min(max_model_len, 2048)
    min_blocks = -(-(shortest + o.draft_limit + 1) // o.block_size)
    # a CUDA pool is allocated whole: its auto cap comes out of the GPU's free memory, not the host's
    free = torch.cuda.mem_get_info(torch.device(o.device))[0] if str(o.device).startswith("cuda") else None
    return plan_memory(weights, kv, o.kv_cache_memory, min_blocks, o.max_memory, free)


def _kv_dtype(o: EngineOptions, checkpoint: Checkpoint) -> torch.dtype:
    """The KV cache format of a model computing in the checkpoint's dtype (``kv/pool.py``)."""
    return resolve_kv_cache_dtype(o.kv_cache_dtype, checkpoint.dtype, checkpoint.config.head_dim)


def _keeps_float(fmt: str | None, device: str) -> bool:
    """A quantized draft keeps float weights too, for long prompts (see ModelRunner), except where the int4 kernel is
    faster at every length (``wide_int8_dot_products``)."""
    int4_everywhere = fmt == "int4" and str(device).startswith("cpu") and native.wide_int8_dot_products()
    return fmt in QUANT_FORMATS and not int4_everywhere


def _draft_model_drafter(o: EngineOptions, checkpoint: Checkpoint, fmt: str, dtype: torch.dtype, kv_bytes: int,
                         target_vocab: int, positions: int, vocab: SharedVocabulary | CrossVocabulary) -> ModelDrafter:
    """A draft model in ``fmt``, with a float copy where ``_keeps_float``; both reach positions below ``positions``."""
    keep_float = _keeps_float(fmt, o.device)
    head_rows = vocab.head_rows(o.draft_vocab, checkpoint.config.vocab_size)
    draft_model = load_model(checkpoint, fmt, o.device, head_rows=head_rows,
                             **(DRAFT_INT4_OPTIONS if fmt == "int4" else {}))
    draft_model.limit_positions(positions)
    if o.gpu_linears == "triton":  # a bfloat16 draft's too (a quantized one is on Triton's kernel already)
        triton_float_linears(draft_model, o.max_num_seqs * (o.draft_limit + 1))
    long_model = load_model(checkpoint, dtype_name(dtype), o.device,
                            head_rows=head_rows) if keep_float else None
    if long_model is not None:
        long_model.limit_positions(positions)
    # run-ahead drafts during the target pass for a model drafter alone (the suffix drafter proposes no model draft
    # for most rounds of the texts it serves)
    drafter_class = RunAheadDrafter if o.drafts_ahead else ModelDrafter
    return drafter_class(ModelRunner("draft", draft_model, kv_bytes, o.block_size, long_model=long_model,
                                     kv_dtype=_kv_dtype(o, checkpoint), **o.runner_options(checkpoint.config)),
                          target_vocab, vocab=vocab)


def draft_vocabulary(target: Tokenizer, draft: Tokenizer, target_name: str, draft_name: str,
                     target_vocab: int) -> SharedVocabulary | CrossVocabulary:
    """The target's own vocabulary when the draft shares its tokenizer (checkpoint vocab sizes may differ by padding
    rows only), else a bridge over the tokens both spell the same (refused when they share too few)."""
    step = max(1, target.vocab_size // 512)
    same = target.vocab_size == draft.vocab_size and all(
        target.decode([i]) == draft.decode([i]) for i in range(0, target.vocab_size, step))
    if same:
        return SharedVocabulary(target_vocab)
    bridge = CrossVocabulary(target, draft, target_name, draft_name, target_vocab)
    log.info("%s", bridge.pairing)
    return bridge
