"""The Python API, shaped like vLLM's: ``LLM(...).generate / stream / chat / session``.

A thin facade: ``engine/build.py`` loads and wires everything, ``LLMEngine.step`` generates.
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator, Sequence as Seq
from pathlib import Path

import torch

from quickdraft.engine.build import EngineOptions, LoadedEngine, build_engine
from quickdraft.engine.embedding import EmbeddingOptions, batch_calls, check_inputs
from quickdraft.engine.engine import LLMEngine
from quickdraft.engine.outputs import RequestOutput, StreamChunk
from quickdraft.errors import InvalidParameterError, RequestFailedError
from quickdraft.kv import ModelRunner
from quickdraft.loading import Checkpoint
from quickdraft.models import Transformer
from quickdraft.sampling import SamplingParams
from quickdraft.session import Session
from quickdraft.speculative.drafters import Drafter
from quickdraft.tokenizer import Tokenizer
from quickdraft.tokenizer.fim import FimTokens, Infill, describe_missing, infill_ids

Prompt = str | list[int]
log = logging.getLogger(__name__)


class LLM:
    def __init__(self, model: str, **options) -> None:
        """Load ``model`` (a packaged name, a GGUF file or an HF directory) with ``options`` (``EngineOptions``):

        ``draft=MODEL`` or ``speculative='ngram'|'self'|'suffix'``: the drafter (``'suffix'`` may take a ``draft``
        beside it; ``suffix_scope`` ``'global'|'request'`` and ``suffix_cache_tokens``: see docs/SPECULATION.md); ``num_speculative_tokens``: k, an int or
        ``'auto'`` (adaptive, up to ``max_speculative_tokens``); ``dtype`` (activations; ``'auto'``: bfloat16 where
        the CPU has AVX512-BF16/AMX or on CUDA, else float32); ``weights``: the linear layers' format, ``'auto'``
        (default: the file's own precision on CPU, so a Q4 GGUF runs int4 kernels, a Q5/Q6/Q8 one int8, a float
        GGUF or an HF directory float weights in ``dtype``; float weights off CPU; see ``weights_summary``),
        ``'int4'``, ``'int8'``, ``'bfloat16'`` or ``'float32'`` (float weights dequantized from the file);
        ``device``; ``max_model_len``, ``max_num_seqs``,
        ``max_num_batched_tokens``, ``policy`` (``fcfs|sjf|priority|deadline``), ``preemption``
        (``recompute|swap``), ``kv_cache_memory`` (the cap of each model's KV cache, e.g.
        ``'1GiB'``; ``'auto'``: what ``max_num_seqs`` full contexts need, within half the free memory; it fills as
        sequences need it), ``max_memory`` (refuse, before loading, a configuration whose weights, KV caps and runtime
        exceed it, e.g. ``'4GiB'``), ``block_size``;
        ``self_draft_layers``, ``ngram_max``, ``ngram_min``; ``threads``: CPU threads per step, ``'auto'`` (default:
        the cores other processes leave free, re-read as it runs) or an int.
        ``draft_weights``: the draft model's weight format (``'auto'``: int4 on CPU, see
        ``resolve_draft_weights``; it changes acceptance, never the output).
        ``draft_vocab``: the draft proposes only among the first N token ids (its lm_head keeps those rows, see
        ``restrict_lm_head``): a cheaper draft step for a little acceptance; the output does not change.
        ``run_ahead``: a draft model (or self-speculation) drafts round t+1 in a background thread while the
        target verifies round t, keeping that work when round t is accepted in full (see RunAheadDrafter);
        no effect with n-gram lookup or without speculation.
        ``static_step``: how decode steps and verify passes run: ``'auto'`` (CUDA graphs on a GPU, the dynamic path
        elsewhere), ``'graphs'``, ``'eager'`` (the graph-ready step without graphs: static buffers and the paged
        attention of ``kv/paged_attention.py``, on any device) or ``'off'``.
        ``launch_ahead``: ``'auto'`` (where CUDA graphs run), ``'on'`` (with a static step) or ``'off'``: a plain
        decode step is queued before the previous one's tokens are read, so the host's work between steps overlaps
        the device's (``engine/launch_ahead.py``); the tokens do not change.
        ``gpu_linears``: what a GPU's bfloat16 decoder-layer linears run on: ``'cublas'`` (torch's, the default) or
        ``'triton'`` (``models/triton_linear.py``'s tiles, which compute a row alike whatever the rows beside it, in
        every decode and verify forward; ``bench/gpu_linear.py`` times both).
        ``lora_adapters``: LoRA adapters by name (``{"sql": "path/to/peft_dir_or.gguf"}``), each applied at run time to
        the requests whose ``SamplingParams.lora`` names it, beside the base model's requests in the same batches
        (``models/lora.py``)."""
        try:
            opts = EngineOptions(**options)
        except TypeError as exc:
            raise InvalidParameterError(f"LLM() got an unknown option: {exc}") from None
        self.loaded: LoadedEngine = build_engine(model, opts)
        log.info("loaded %s: %s; %s", model, self.weights_summary, self.memory_summary)

    # what callers (the CLI, the server, benchmarks) read of the loaded engine
    @property
    def engine(self) -> LLMEngine:
        return self.loaded.engine

    @property
    def tokenizer(self) -> Tokenizer:
        return self.loaded.tokenizer

    @property
    def model(self) -> Transformer:
        return self.loaded.model

    @property
    def target(self) -> ModelRunner:
        return self.loaded.target

    @property
    def drafter(self) -> Drafter | None:
        return self.loaded.drafter

    @property
    def checkpoint(self) -> Checkpoint:
        return self.loaded.checkpoint

    @property
    def draft_checkpoint(self) -> Checkpoint | None:
        return self.loaded.draft_checkpoint

    @property
    def max_model_len(self) -> int:
        return self.loaded.max_model_len

    @property
    def dtype(self) -> torch.dtype:
        return self.loaded.dtype

    @property
    def weights(self) -> str:
        return self.loaded.weights

    @property
    def memory_summary(self) -> str:
        """e.g. ``'weights 1.02 GiB (int4), KV up to 10.5 GiB (1 MiB in use)'`` (see ``LoadedEngine.memory_summary``)."""
        return self.loaded.memory_summary

    def release_memory(self, keep_prefix_cache: bool = False) -> None:
        """Give the KV memory no request holds back to the system (the server does this when idle for a while);
        without ``keep_prefix_cache`` the cached prompt prefixes go too."""
        self.loaded.release_memory(keep_prefix_cache)

    @property
    def weights_summary(self) -> str:
        """e.g. ``'weights: int4 kernels for 210 tensors (Q4_1), int8 for 1 (Q8_0 lm_head)'``."""
        return self.loaded.weights_summary

    @property
    def draft_weights(self) -> str | None:
        return self.loaded.draft_weights

    @property
    def device(self) -> str:
        return self.loaded.device

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
            outputs.append(RequestOutput(rid, seqs[0].prompt, seqs[0].prompt_ids, [s.to_output() for s in seqs], True,
                                         seqs[0].prompt_logprobs_out()))
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
        for runner in self.loaded.runners:
            runner.allocator.reset_prefix_cache()

    def infill(self, prefix: str, suffix: str, params: SamplingParams | None = None, *, prompt: str = "",
               extra: Seq[tuple[str, str]] = ()) -> RequestOutput:
        """Fill in the middle between ``prefix`` and ``suffix`` (the code before and after the cursor; ``prompt``:
        text typed after the prefix; ``extra``: other files as (filename, text)), with the prompt llama-server's
        /infill builds (``tokenizer/fim.py``); the fill ends at the end of the sequence or at a mark that closes a
        file. A model without fill-in-the-middle tokens raises InvalidParameterError."""
        fim = FimTokens.of(self.tokenizer)
        if fim is None:
            raise InvalidParameterError(describe_missing())
        params = params or SamplingParams()
        ids, _ = infill_ids(self.tokenizer, fim, Infill(prefix, suffix, prompt, tuple(extra)), self.max_model_len,
                            params.max_tokens)
        ends = sorted(set(params.stop_token_ids or ()) | set(fim.ends))
        return self.generate([ids], dataclasses.replace(params, stop_token_ids=ends))[0]

    def chat(self, messages: list[dict] | list[list[dict]], params: SamplingParams | None = None
             ) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        return self.generate([self.chat_prompt(c) for c in conversations], params)

    def chat_prompt(self, messages: list[dict], tools: list[dict] | None = None, **template_kwargs) -> list[int]:
        return self.loaded.chat_prompt(messages, tools, **template_kwargs)

    def embed(self, inputs: Prompt | Seq[Prompt], pooling: str = "last", normalize: bool = True) -> list[list[float]]:
        """One embedding per input (a string or token ids): the model's final hidden states pooled (see
        ``engine/embedding.py`` for the choice of pooling), in batches of the engine's token budget."""
        options = EmbeddingOptions(pooling, normalize)
        if isinstance(inputs, str) or (isinstance(inputs, list) and inputs and isinstance(inputs[0], int)):
            inputs = [inputs]
        token_lists = [self._encode(p)[0] for p in inputs]
        check_inputs(token_lists, self.engine.vocab_size, self.max_model_len)
        budget = self.engine.config.scheduler.max_num_batched_tokens
        out: list[list[float]] = [[] for _ in token_lists]
        for batch, read in batch_calls(self.target, token_lists, options, budget):
            for i, vector in zip(batch, read().tolist()):
                out[i] = vector
        return out

    # ---- sessions ---------------------------------------------------------------------------
    def session(self) -> Session:
        """A conversation whose KV caches stay in the pools between turns (``generate``/``stream``/``chat``),
        saved with ``save(path)``; free its blocks with ``close()`` (or use it as a context manager)."""
        return Session(self.loaded)

    def load_session(self, path: str | Path) -> Session:
        """Resume a saved session in this LLM (same models and options as when it was saved); raises
        SessionError, before taking any KV block, when the file is damaged or was made with other models."""
        return Session.load(self.loaded, path)

    @property
    def spec_stats(self):
        return self.engine.stats
