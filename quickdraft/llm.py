"""The Python API, shaped like vLLM's: ``LLM(...).generate / stream / chat``."""
from __future__ import annotations

import re
from collections.abc import Iterator, Sequence as Seq
from pathlib import Path

import torch

from quickdraft.engine.engine import EngineConfig, LLMEngine
from quickdraft.engine.outputs import RequestOutput, StreamChunk
from quickdraft.engine.scheduler import SchedulerConfig
from quickdraft.errors import InvalidParameterError, ModelLoadError, RequestFailedError
from quickdraft.kv import ModelRunner
from quickdraft.loading import Checkpoint, load_checkpoint
from quickdraft.loading.quantize import (DRAFT_INT4_OPTIONS, FLOAT_FORMATS, QUANT_FORMATS, quantize_checkpoint,
                                        resolve_draft_weights, resolve_weights, restrict_lm_head)
from quickdraft.models import Transformer, build_model
from quickdraft.sampling import SamplingParams
from quickdraft.session import Session
from quickdraft.speculative.drafters import Drafter, ModelDrafter, NgramDrafter, RunAheadDrafter
from quickdraft.tokenizer import Tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SPECULATIVE = ("ngram", "self")
Prompt = str | list[int]


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
        flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
        return torch.bfloat16 if ("avx512_bf16" in flags or "amx_bf16" in flags) else torch.float32
    if dtype not in DTYPES:
        raise InvalidParameterError(f"dtype must be one of auto, {', '.join(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


def tokenizer_for(ckpt: Checkpoint) -> Tokenizer:
    if ckpt.gguf_metadata is not None:
        return Tokenizer.from_gguf_metadata(ckpt.gguf_metadata, chat_template=ckpt.chat_template)
    return Tokenizer.from_hf_dir(ckpt.hf_dir)


class LLM:
    def __init__(self, model: str, *, draft: str | None = None, speculative: str | None = None,
                 num_speculative_tokens: int | str = "auto", max_speculative_tokens: int = 8,
                 dtype: str = "auto", weights: str | None = None, draft_weights: str = "auto",
                 draft_vocab: int | None = None, device: str = "cpu",
                 max_model_len: int | None = None, max_num_seqs: int = 16, max_num_batched_tokens: int = 512,
                 policy: str = "fcfs", preemption: str = "recompute",
                 kv_cache_memory: int | str = "1GiB", block_size: int = 16, self_draft_layers: int | None = None,
                 ngram_max: int = 4, ngram_min: int = 1, run_ahead: bool = False) -> None:
        """``draft_weights``: the draft model's weight format (``'auto'``: int4 on CPU, see
        ``resolve_draft_weights``; it changes acceptance, never the output).
        ``draft_vocab``: the draft proposes only among the first N token ids (its lm_head keeps those rows, see
        ``restrict_lm_head``): a cheaper draft step for a little acceptance; the output does not change.
        ``run_ahead``: a draft model (or self-speculation) drafts round t+1 in a background thread while the
        target verifies round t, keeping that work when round t is accepted in full (see RunAheadDrafter);
        no effect with n-gram lookup or without speculation."""
        if draft is not None and speculative is not None:
            raise InvalidParameterError("pass either draft=MODEL or speculative='ngram'|'self', not both")
        if draft_vocab is not None and (draft is None or isinstance(draft_vocab, bool)
                                        or not isinstance(draft_vocab, int) or draft_vocab < 1):
            raise InvalidParameterError(f"draft_vocab must be a positive int and needs draft=MODEL, got {draft_vocab!r}"
                                        + ("" if draft is not None else " without a draft model"))
        # an explicit draft format is checked (and its float dtype known) before anything is loaded
        draft_fmt = None if draft_weights == "auto" else resolve_weights(draft_weights, device)
        if speculative is not None and speculative not in SPECULATIVE:
            raise InvalidParameterError(f"speculative must be one of {', '.join(SPECULATIVE)}, got {speculative!r}")
        self.device = device
        # weights: None keeps float weights in `dtype`; int4/int8 keep the linear layers quantized
        # (activations, embeddings and norms stay in `dtype`); "auto" picks the fastest measured format
        fmt = resolve_weights(weights, device) if weights is not None else None
        if fmt in FLOAT_FORMATS:
            dtype = fmt
        self.dtype = resolve_dtype(dtype, device)
        self.weights = fmt or str(self.dtype).removeprefix("torch.")
        kv_bytes = parse_size(kv_cache_memory)
        self.checkpoint = load_checkpoint(model, dtype=self.dtype)
        self.tokenizer = tokenizer_for(self.checkpoint)
        self.model: Transformer = self._build(self.checkpoint, self.weights)
        cfg = self.checkpoint.config
        self.max_model_len = min(max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        self.target = ModelRunner("target", self.model, kv_bytes, block_size)
        # one sequence of the full context (plus drafts) must fit in the pool, or it could never finish
        capacity = self.target.allocator.num_blocks * block_size - max_speculative_tokens - 1
        if capacity < self.max_model_len:
            if max_model_len is not None:
                raise InvalidParameterError(
                    f"max_model_len={max_model_len} does not fit in the KV cache ({capacity} tokens with "
                    f"kv_cache_memory={kv_cache_memory}); raise kv_cache_memory or lower max_model_len")
            self.max_model_len = capacity
        self.drafter: Drafter | None = None
        self.draft_checkpoint: Checkpoint | None = None
        self.draft_weights: str | None = None
        self.draft_vocab = draft_vocab
        if draft is not None:
            self.draft_checkpoint = load_checkpoint(draft, dtype=FLOAT_FORMATS.get(draft_fmt, self.dtype))
            self._check_draft_vocab(tokenizer_for(self.draft_checkpoint))
            self.draft_weights = draft_fmt or resolve_draft_weights("auto", self.weights, self.draft_checkpoint.config,
                                                                    device)
            quantized = self.draft_weights in QUANT_FORMATS
            draft_model = self._build(self.draft_checkpoint, self.draft_weights,
                                      DRAFT_INT4_OPTIONS if self.draft_weights == "int4" else {}, draft_vocab,
                                      release=not quantized)
            # a quantized draft keeps float weights too, for long prompts (see ModelRunner long_model)
            long_model = self._build(self.draft_checkpoint, str(self.dtype).removeprefix("torch."), None,
                                     draft_vocab) if quantized else None
            model_drafter = RunAheadDrafter if run_ahead else ModelDrafter
            self.drafter = model_drafter(ModelRunner("draft", draft_model, kv_bytes, block_size, long_model=long_model),
                                         cfg.vocab_size)
        elif speculative == "ngram":
            self.drafter = NgramDrafter(ngram_max, ngram_min)
        elif speculative == "self":
            layers = self_draft_layers or max(1, cfg.num_layers // 4)
            if not 1 <= layers < cfg.num_layers:
                raise InvalidParameterError(f"self_draft_layers must be in 1..{cfg.num_layers - 1}, got {layers}")
            model_drafter = RunAheadDrafter if run_ahead else ModelDrafter
            self.drafter = model_drafter(ModelRunner("self", self.model, kv_bytes, block_size, num_layers=layers),
                                        cfg.vocab_size, name="self")
        config = EngineConfig(
            max_model_len=self.max_model_len,
            scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                      policy=policy, preemption=preemption),
            num_speculative_tokens=num_speculative_tokens if self.drafter is not None else 0,
            max_speculative_tokens=max_speculative_tokens)
        self.engine = LLMEngine(self.target, self.tokenizer, config, self.drafter)

    def _build(self, checkpoint: Checkpoint, fmt: str, options: dict | None = None,
               head_rows: int | None = None, release: bool = True) -> Transformer:
        model = build_model(checkpoint.config, checkpoint.tensors, self.device)
        if head_rows is not None:
            restrict_lm_head(model, head_rows)
        return quantize_checkpoint(model, checkpoint, fmt, release=release, **(options or {}))

    def _check_draft_vocab(self, draft_tokenizer: Tokenizer) -> None:
        """Draft and target must share a tokenizer; checkpoint vocab sizes may differ by padding rows only."""
        ours = self.tokenizer
        same = ours.vocab_size == draft_tokenizer.vocab_size and all(
            ours.decode([i]) == draft_tokenizer.decode([i]) for i in range(0, ours.vocab_size, max(1, ours.vocab_size // 512)))
        if not same:
            raise ModelLoadError(
                f"draft model tokenizer ({draft_tokenizer.vocab_size} tokens) does not match the target's "
                f"({ours.vocab_size} tokens); speculative decoding needs the same vocabulary")

    # ---- generation -------------------------------------------------------------------------
    def _encode(self, prompt: Prompt) -> tuple[list[int], str | None]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt), prompt
        if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return list(prompt), None
        raise InvalidParameterError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")

    def _submit(self, prompts: Seq[Prompt], params: SamplingParams | Seq[SamplingParams] | None) -> list[str]:
        if params is None:
            params = SamplingParams()
        all_params = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(all_params) != len(prompts):
            raise InvalidParameterError(f"got {len(all_params)} SamplingParams for {len(prompts)} prompts")
        encoded = [self._encode(p) for p in prompts]
        for p in all_params:  # every request is checked before any is queued
            p.validate()
            p.check_vocab(self.engine.vocab_size)
        ids = []
        try:
            for (prompt_ids, text), p in zip(encoded, all_params):
                ids.append(self.engine.add_request(prompt_ids, p, prompt=text))
        except Exception:
            for rid in ids:
                self.engine.abort(rid)
            raise
        return ids

    def generate(self, prompts: Prompt | Seq[Prompt], params: SamplingParams | Seq[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        ids = self._submit(list(prompts), params)
        try:
            while any(not s.finished for rid in ids for s in self.engine.sequences(rid)):
                self.engine.step()
        except BaseException:
            for rid in ids:
                self.engine.abort(rid)
            raise
        outputs = []
        for rid in ids:
            seqs = self.engine.sequences(rid)
            outputs.append(RequestOutput(rid, seqs[0].prompt, seqs[0].prompt_ids, [s.to_output() for s in seqs], True))
            self.engine.release(rid)
        failed = [(o.request_id, c.error) for o in outputs for c in o.outputs if c.finish_reason == "error"]
        if failed:
            rid, error = failed[0]
            raise RequestFailedError(f"{len(failed)} of {len(outputs)} requests failed ({rid}: {error}); "
                                     f"the others finished (RequestFailedError.outputs has every output)", outputs)
        return outputs

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[StreamChunk]:
        """Yield chunks of new text as they are generated; closing the iterator aborts the request."""
        (rid,) = self._submit([prompt], params)
        done = False
        try:
            while not done:
                for chunk in self.engine.step():
                    if chunk.request_id == rid:
                        if chunk.error is not None:
                            raise RequestFailedError(f"request {rid} failed: {chunk.error}")
                        yield chunk
                done = all(s.finished for s in self.engine.sequences(rid))
        finally:
            self.engine.abort(rid)

    def cancel(self, request_id: str | None = None) -> None:
        """Cancel one request (a ``StreamChunk.request_id``), or every request in flight when None, from any
        thread. The step in progress completes, then each finishes with finish_reason "abort": ``generate``
        returns the tokens generated so far and ``stream`` ends."""
        if request_id is None:
            self.engine.cancel_all()
        else:
            self.engine.cancel(request_id)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prompt prefix no request is using (as vLLM's ``LLM.reset_prefix_cache``), in the target's
        and the draft's pools: the next request with the same prompt computes it again. Benchmarks call it so that a
        repeated prompt costs what a new one does."""
        for runner in (self.target, self.drafter.runner if self.drafter is not None else None):
            if runner is not None:
                runner.allocator.reset_prefix_cache()

    def chat(self, messages: list[dict] | list[list[dict]], params: SamplingParams | None = None
             ) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        return self.generate([self.chat_prompt(c) for c in conversations], params)

    def chat_prompt(self, messages: list[dict]) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return self.tokenizer.encode(text, add_special_tokens=False)

    # ---- sessions ---------------------------------------------------------------------------
    def session(self) -> Session:
        """A conversation whose KV caches stay in the pools between turns (``generate``/``stream``/``chat``),
        saved with ``save(path)``; free its blocks with ``close()`` (or use it as a context manager)."""
        return Session(self)

    def load_session(self, path: str | Path) -> Session:
        """Resume a saved session in this LLM (same models and options as when it was saved); raises
        SessionError, before taking any KV block, when the file is damaged or was made with other models."""
        return Session.load(self, path)

    @property
    def spec_stats(self):
        return self.engine.stats
