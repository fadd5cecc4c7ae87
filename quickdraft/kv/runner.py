"""Runs one model's batched forward over the paged KV cache. Knows nothing about sampling."""
from __future__ import annotations

import time

import torch

from quickdraft.errors import InvalidParameterError
from quickdraft.kv.attention import AttentionBatch, exact_positions
from quickdraft.kv.blocks import BlockAllocator, ForwardItem, SequenceKV
from quickdraft.kv.paged_attention import kernel_possible
from quickdraft.kv.pool import KVPool
from quickdraft.kv.static_step import StaticStep
from quickdraft.kv.tile_tuning import tune_tiles
from quickdraft.models import Transformer
from quickdraft.models.lora import LoraRows

STATIC_STEPS = ("graphs", "eager", "off")


class ModelRunner:
    def __init__(self, name: str, model: Transformer, kv_cache_bytes: int, block_size: int = 16,
                 num_layers: int | None = None, long_model: Transformer | None = None,
                 long_tokens: int = 128, kv_dtype: torch.dtype | None = None, static_step: str = "off",
                 max_seqs: int = 16, max_queries: int = 9, capture_chunks: bool = True) -> None:
        """``num_layers`` < all runs only the first layers (self-speculation); the KV pool then holds only those.
        ``kv_dtype``: the cache's format (``kv/pool.py``), by default the model's own dtype.

        ``long_model``: the same network with other weights (a draft's float weights beside its int4 ones) that
        runs every item of at least ``long_tokens`` new tokens (a long prompt): on AVX2 quickdraft's int4 kernel beats
        the bfloat16 one up to about 128 rows and loses beyond (docs/MEASUREMENTS.md; with 512-bit VNNI it wins at
        every length and the builder keeps no float copy), so catch-ups after a
        stretch without drafting stay on the int4 weights. The choice is per item, by its own length,
        so it never depends on what else is in the batch.

        ``static_step``: how decode and verify forwards of up to ``max_seqs`` sequences of up to ``max_queries``
        tokens run (``static_step.py``): ``graphs`` (replayed CUDA graphs), ``eager`` (the same static buffers, no
        graph), or ``off`` (the dynamic path every forward takes otherwise). ``capture_chunks``: whether a prompt
        chunk bucket not captured at load is captured on first use (else run eagerly; see ``StaticStep``)."""
        self.name = name
        self.model = model
        self.long_model, self.long_tokens = long_model, long_tokens
        self.logit_columns = model.config.vocab_size  # see mask_logits_from
        cfg = model.config
        self.num_layers = num_layers or cfg.num_layers
        norm = model.model.norm.weight  # (every model has one in its activations' dtype; an embedding may hold none)
        self.device, self.dtype = norm.device, norm.dtype
        self.block_size = block_size
        self.kv_dtype = kv_dtype or self.dtype
        per_block = KVPool.bytes_per_block(self.num_layers, cfg.num_kv_heads, cfg.head_dim, block_size, self.kv_dtype)
        num_blocks = max(1, kv_cache_bytes // per_block)
        if static_step not in STATIC_STEPS:
            raise ValueError(f"static_step must be one of {', '.join(STATIC_STEPS)}, got {static_step!r}")
        scratch = static_step != "off"  # one block past the allocator's, where a static step's padding writes
        self.pool = KVPool(self.num_layers, cfg.num_kv_heads, cfg.head_dim, num_blocks + scratch, block_size,
                           self.kv_dtype, self.device)
        self.allocator = BlockAllocator(num_blocks)
        self.static = StaticStep(model, self.pool, num_blocks, max_seqs, max_queries, num_layers,
                                 graphs=static_step == "graphs", capture_chunks=capture_chunks) if scratch else None
        self.bytes_per_block = per_block
        self.last_forward_s = 0.0
        self.tile_tuning: list[dict] = []  # what choosing the Triton linears' tiles tried (``warm_up``)
        # On a GPU, prompt chunks run on the static step's kernels too (graphs of their own): the dynamic path's
        # attention builds its batch on the host with reads back from the device, tens of milliseconds a forward. Not
        # where the step's attention would be torch's (no Triton, or gpt-oss's sinks): that one reads every block
        # of every table. On the CPU the dynamic path has quickdraft's fused C layers and stays (tests turn this on).
        self.chunks_on_static = (self.device.type == "cuda" and kernel_possible(block_size)
                                 and not cfg.attention_sinks)

    @property
    def kv_bytes_used(self) -> int:
        """KV bytes in blocks that sequences or cached prefixes hold now."""
        return (self.allocator.num_blocks - self.allocator.num_free + self.allocator.num_cached) \
            * self.bytes_per_block

    @property
    def kv_bytes_touched(self) -> int:
        """KV bytes of every block handed out since the last ``release_memory``: what the pool holds in memory."""
        return self.allocator.high_water * self.bytes_per_block

    @property
    def kv_bytes_cap(self) -> int:
        return self.allocator.num_blocks * self.bytes_per_block

    def release_memory(self, keep_prefix_cache: bool = True) -> None:
        """Give back the memory of blocks nothing holds (and of cached prefixes too, unless ``keep_prefix_cache``)."""
        if not keep_prefix_cache:
            self.allocator.reset_prefix_cache()
        self.pool.release_from(self.allocator.trim())

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    def new_kv(self, lora: str | dict[str, float] | None = None) -> SequenceKV:
        """An empty cache for a sequence that runs the LoRA adapters ``lora`` names (``SamplingParams.lora``)."""
        if not lora:  # (None, or llama-server's empty list: the base model)
            return SequenceKV()
        weights = self.model.lora
        names = weights.names if weights is not None else []
        unknown = [name for name in ([lora] if isinstance(lora, str) else lora) if name not in names]
        if unknown:
            raise InvalidParameterError(f"lora {unknown[0]!r} is not an adapter this model serves; it serves "
                                        f"{', '.join(map(repr, names)) or 'none'}")
        return SequenceKV(adapter=weights.mix(lora))

    def blocks_for(self, kv: SequenceKV, length: int) -> int:
        """Free blocks a forward growing ``kv`` to ``length`` tokens takes: new ones plus copy-on-write copies."""
        bs = self.block_size
        shared = sum(1 for b in kv.block_table[kv.num_cached // bs: -(-length // bs)] if self.allocator.ref_counts[b] > 1)
        return kv.blocks_needed(length, bs) + shared

    def swap_out(self, kv: SequenceKV) -> tuple[dict[str, torch.Tensor], int]:
        """Copy a sequence's cached keys/values to host memory and free its blocks."""
        saved = (self.gather(kv), kv.num_cached)
        self.free(kv)
        return saved

    def gather(self, kv: SequenceKV) -> dict[str, torch.Tensor]:
        """Host copies of a sequence's cache, one per plane of the pool (keys, values, and an int8 cache's scales),
        ``[layers, num_cached, ...]`` each (contiguous); the blocks stay where they are (session snapshots)."""
        slots = self._slots(kv, kv.num_cached)
        return {name: plane[:, slots].to("cpu").contiguous() for name, plane in self.pool.planes.items()}

    def swap_in(self, kv: SequenceKV, saved: tuple[dict[str, torch.Tensor], int]) -> None:
        planes, length = saved
        kv.reserve(length, self.allocator, self.block_size)
        slots = self._slots(kv, length)
        for name, plane in self.pool.planes.items():
            plane[:, slots] = planes[name].to(self.device)
        kv.num_cached = length

    def _slots(self, kv: SequenceKV, length: int) -> torch.Tensor:
        bs = self.block_size
        positions = torch.arange(length)
        return (torch.tensor(kv.block_table, dtype=torch.long)[positions // bs] * bs + positions % bs).to(self.device)

    def truncate(self, kv: SequenceKV, length: int) -> None:
        kv.truncate(length, self.allocator, self.block_size)

    def free(self, kv: SequenceKV) -> None:
        kv.free(self.allocator)

    def mask_logits_from(self, column: int) -> None:
        """Logits columns from ``column`` on (a checkpoint's padding rows past the tokenizer's vocabulary) come out
        -inf, so no sampler has to copy a row to mask them."""
        self.logit_columns = column

    def match_prefix(self, kv: SequenceKV, tokens: list[int]) -> int:
        return kv.match_prefix(tokens, self.allocator, self.block_size, self._exact_below())

    def _exact_below(self) -> int:
        """Where prompts attend on the dynamic path (no static step), positions below which a token attends alone
        whatever its chunk (``attention.exact_positions``): a cached prefix may end at any block there."""
        return exact_positions(self.pool, self.dtype) if self.static is None else 0

    def publish(self, kv: SequenceKV, tokens: list[int]) -> None:
        kv.publish(tokens, self.allocator, self.block_size)

    def fork(self, kv: SequenceKV, length: int) -> SequenceKV:
        return kv.fork(length, self.allocator, self.block_size)

    @torch.inference_mode()
    def forward(self, items: list[ForwardItem], device_tokens: torch.Tensor | None = None,
                wait: bool = True) -> list[torch.Tensor]:
        """Append each item's tokens to its cache and return its last ``num_logits`` rows of float32 logits.

        ``device_tokens`` (a decode step on the static step, one token per item, on the device): the ids to run,
        in place of the items' own. ``wait=False`` returns once the work is queued (``last_forward_s`` is then the
        host's time alone): the caller reads the results when it needs them."""
        t0 = time.perf_counter()
        if device_tokens is not None and not (self.launches_ahead(len(items)) and not any(it.kv.adapter for it in items)
                                              and all(len(it.tokens) == 1 == it.num_logits for it in items)):
            raise ValueError("device_tokens need the static step, one token with logits per item of the base model, "
                             "and a bucket of that many sequences")
        for item in items:  # every block first: running out must leave no cache half-advanced
            end = item.kv.num_cached + len(item.tokens)
            item.kv.make_writable(item.kv.num_cached, end, self.allocator, self.pool)
            item.kv.reserve(end, self.allocator, self.block_size)
        if self.device.type == "cuda" and 0 < sum(bool(it.kv.adapter) for it in items) < len(items):
            return self._forward_apart(items, wait)
        long = [len(it.tokens) >= self.long_tokens for it in items] if self.long_model is not None else []
        if self._fits_static(items):  # (an item with prompt logits is a prompt chunk: never in a static bucket)
            out = self.static.run([it.kv for it in items], [it.tokens for it in items], self.logit_columns,
                                  device_tokens)
            for it in items:
                it.kv.num_cached += len(it.tokens)
        elif not any(long) and (groups := self._static_groups(items)) is not None:
            out = self._run_static_groups(items, *groups)
        elif not any(long):
            out = self._forward(items, self.model)
        else:
            out: list[torch.Tensor] = [None] * len(items)  # type: ignore[list-item]
            for model, chosen in ((self.long_model, True), (self.model, False)):
                picked = [i for i, is_long in enumerate(long) if is_long == chosen]
                if picked:
                    for i, rows in zip(picked, self._forward([items[i] for i in picked], model)):
                        out[i] = rows
        if wait and self.device.type == "cuda":  # launches return before the GPU is done: time the work, not them
            torch.cuda.synchronize(self.device)
        self.last_forward_s = time.perf_counter() - t0
        return out

    def _forward_apart(self, items: list[ForwardItem], wait: bool) -> list[torch.Tensor]:
        """On a GPU, the base model's items and the LoRA adapters' in two forwards: the base's keep their static step
        and fused kernels, and so their bits, whatever adapters share the step (on the CPU one forward gives every
        row its own bits, ``models/lora.py``)."""
        out: list[torch.Tensor] = [None] * len(items)  # type: ignore[list-item]
        spent = 0.0
        for adapted in (False, True):
            picked = [i for i, it in enumerate(items) if bool(it.kv.adapter) == adapted]
            for i, rows in zip(picked, self.forward([items[i] for i in picked], wait=wait)):
                out[i] = rows
            spent += self.last_forward_s
        self.last_forward_s = spent
        return out

    def launches_ahead(self, num_seqs: int) -> bool:
        """Whether a decode step of ``num_seqs`` sequences can take its token ids from the device (``forward``'s
        ``device_tokens``): the static step has a bucket for it."""
        return self.static is not None and self.static.bucket([1] * num_seqs) is not None

    def _static_groups(self, items: list[ForwardItem]) -> tuple[list[int], list[int]] | None:
        """Where prompt chunks run on the static step (``chunks_on_static``, on by default on a GPU): the items of a
        step's decode and verify bucket, and the prompt chunks its second forward takes beside them (in a bucket of
        ``StaticStep.chunk_bucket``); None where the dynamic path takes the forward."""
        if self.static is None or not self.chunks_on_static or any(it.kv.adapter for it in items):
            return None
        steps = [i for i, it in enumerate(items) if it.num_logits == len(it.tokens) <= self.static.query_sizes[-1]]
        in_steps = set(steps)
        chunks = [i for i in range(len(items)) if i not in in_steps]
        if not chunks or steps and self.static.bucket([len(items[i].tokens) for i in steps]) is None:
            return None
        return (steps, chunks) if self.static.chunk_bucket([len(items[i].tokens) for i in chunks]) else None

    def _run_static_groups(self, items: list[ForwardItem], steps: list[int], chunks: list[int]) -> list[torch.Tensor]:
        """A step's decode and verify items in their bucket, its prompt chunks in a second (eager) forward."""
        out: list[torch.Tensor] = [None] * len(items)  # type: ignore[list-item]
        if steps:
            rows = self.static.run([items[i].kv for i in steps], [items[i].tokens for i in steps], self.logit_columns)
            for i, r in zip(steps, rows):
                out[i] = r
        rows = self.static.run_chunks([items[i] for i in chunks], self.logit_columns)
        for i, r in zip(chunks, rows):
            out[i] = r
        for it in items:
            it.kv.num_cached += len(it.tokens)
        return out

    def _fits_static(self, items: list[ForwardItem]) -> bool:
        """A decode or verify forward (every token wants logits) that a static bucket holds, of the base model alone
        (LoRA adapters run on the dynamic path)."""
        return (self.static is not None and all(it.num_logits == len(it.tokens) and not it.kv.adapter for it in items)
                and self.static.bucket([len(it.tokens) for it in items]) is not None)

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Capture the static step's graphs now (at load), where it replays them, after choosing the tiles of the
        layers on Triton's linear kernel there (``tile_tuning``)."""
        if self.static is not None and self.static.graphs:
            self.tile_tuning = tune_tiles(self)
            self.static.warm_up(self.logit_columns, chunks=self.chunks_on_static)

    @torch.inference_mode()
    def embed(self, token_lists: list[list[int]], pooling: str = "last", chunk: int = 512) -> torch.Tensor:
        """Pooled final hidden states ``[n, hidden]`` (float32) of each token list: its last token's ("last") or
        the mean over its tokens ("mean"). The lists are read together, ``chunk`` tokens of each per forward (as a
        prompt is), into blocks lent for the call and given back after it: nothing is cached or published, so no
        sequence ever sees these tokens."""
        if pooling not in ("last", "mean"):
            raise ValueError(f"pooling must be 'last' or 'mean', got {pooling!r}")
        kvs = [SequenceKV() for _ in token_lists]
        pooled: list[torch.Tensor | None] = [None] * len(token_lists)
        try:
            for kv, ids in zip(kvs, token_lists):
                kv.reserve(len(ids), self.allocator, self.block_size)
            for start in range(0, max(map(len, token_lists)), chunk):
                live = [i for i, ids in enumerate(token_lists) if len(ids) > start]
                pieces = [token_lists[i][start:start + chunk] for i in live]
                lengths = [len(p) for p in pieces]
                attn = AttentionBatch(self.pool, [kvs[i].block_table for i in live], [start] * len(live), lengths,
                                      lengths)
                tokens = torch.tensor([t for p in pieces for t in p], dtype=torch.long, device=self.device)
                hidden = self.model(tokens, attn, num_layers=self.num_layers).float()
                for i, rows in zip(live, hidden.split(lengths)):
                    previous = pooled[i] if pooled[i] is not None and pooling == "mean" else 0
                    pooled[i] = rows[-1] if pooling == "last" else rows.sum(0) + previous
        finally:
            for kv in kvs:
                kv.free(self.allocator)
        out = torch.stack(pooled)  # type: ignore[arg-type]
        if pooling == "mean":
            out /= torch.tensor([len(ids) for ids in token_lists], dtype=out.dtype, device=out.device)[:, None]
        return out

    def _forward(self, items: list[ForwardItem], model: Transformer) -> list[torch.Tensor]:
        # every logits row after the first is a drafted token under verification, not part of a prompt chunk
        chunks = [len(it.tokens) - max(0, it.num_logits - 1) for it in items]
        lengths = [len(it.tokens) for it in items]
        lora = LoraRows.of(model.lora, [it.kv.adapter for it in items], lengths, self.device)
        attn = AttentionBatch(self.pool, [it.kv.block_table for it in items], [it.kv.num_cached for it in items],
                              lengths, chunks, self._exact_below(), lora)
        tokens = torch.tensor([t for it in items for t in it.tokens], dtype=torch.long, device=self.device)
        hidden = model(tokens, attn, num_layers=self.num_layers)
        rows, offset = [], 0
        for it in items:
            offset += len(it.tokens)
            rows.extend(range(offset - it.num_logits, offset))
            it.kv.num_cached += len(it.tokens)
            if it.prompt_logits is not None:
                it.give_prompt_logits(hidden[offset - len(it.tokens):offset - it.num_logits], self._head(model))
        logits = model.logits(hidden[rows]) if rows else hidden.new_zeros(0, self.vocab_size)
        if self.logit_columns < logits.shape[1]:
            logits[:, self.logit_columns:] = float("-inf")
        out, start = [], 0
        for it in items:
            out.append(logits[start:start + it.num_logits])
            start += it.num_logits
        return out

    def _head(self, model: Transformer):
        """The LM head as prompt logprobs read it: float32 logits of the vocabulary's columns."""
        return lambda hidden: model.logits(hidden)[:, :self.logit_columns]
