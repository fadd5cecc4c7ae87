"""The graph-ready step: a decode or verify forward over static buffers, replayed as a CUDA graph on a GPU.

A forward fits a bucket when every sequence brings 1..Q new tokens that all need logits: decode steps (one token)
and verify passes (the pending token and k drafts). The bucket is (B sequences, Q queries each), the smallest that
holds the batch. Prompt chunks take the dynamic path (``AttentionBatch``), or on a GPU the same forward in a bucket
of their own (``run_chunks``), whose graph stops at the hidden states: the few rows that want logits are picked
after it. Its inputs (token ids, positions, cache
slots, block tables, context and query lengths) are packed on the host into one int64 tensor and reach the device in
one copy. The forward reads them from static buffers, attends with ``paged_attention`` (which reads the block tables
on the device), and writes float32 logits into a static output: nothing in it reads back to the host.

On CUDA each bucket's forward is captured once as a CUDA graph and replayed (``graphs=True``; a prompt chunk's
bucket on first use, unless ``warm_up`` captured it): run eagerly, a forward launches each of its few hundred
kernels from Python, and a short prompt's first token waits on the host, not on the GPU. Anywhere, the same function
can run eagerly on the same buffers, which is how CI checks everything but the capture on a CPU. Padding sequences
and padding rows write their keys to a scratch block no sequence owns, and their logits are never read.
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from quickdraft.kv.blocks import ForwardItem, SequenceKV
from quickdraft.kv.paged_attention import KEY_SPLITS, paged_attention
from quickdraft.kv.pool import KVPool
from quickdraft.models import Transformer
from quickdraft.models.transformer import RotaryEmbedding
from quickdraft.sampling.sampler import to_device


MAX_CHUNK = 512  # the longest prompt chunk run_chunks takes (the scheduler's default token budget)
MAX_CHUNK_ROWS = 1024  # the most rows, padding included, of a run_chunks forward (a default budget's, padded)


def buckets_up_to(limit: int) -> list[int]:
    """1, 2, 4, ... and ``limit`` itself: the sizes a bucket axis takes."""
    sizes = [1 << i for i in range(max(1, limit).bit_length()) if 1 << i < limit]
    return sizes + [max(1, limit)]


@dataclass(frozen=True)
class Bucket:
    seqs: int
    queries: int

    @property
    def rows(self) -> int:
        return self.seqs * self.queries


class _Inputs:
    """One bucket's packed inputs: a host tensor (pinned on CUDA) and its device copy, with a view per field."""

    def __init__(self, bucket: Bucket, width: int, device: torch.device) -> None:
        rows, seqs = bucket.rows, bucket.seqs
        # in this order (``StaticStep._pack`` writes the first three fields as one stretch, the last two as another)
        self.sizes = {"tokens": rows, "positions": rows, "slots": rows, "tables": seqs * width, "context_lens": seqs,
                      "query_lens": seqs}
        total = sum(self.sizes.values())
        self.host = torch.zeros(total, dtype=torch.long, pin_memory=device.type == "cuda")
        self.device = torch.zeros(total, dtype=torch.long, device=device)
        self.width = width
        # the last copy from ``host``, until which ``host`` may not be rewritten (a launch-ahead step packs the next
        # step's inputs while the device has not reached this one's copy yet)
        self.copied = torch.cuda.Event() if device.type == "cuda" else None

    def upload(self) -> None:
        self.device.copy_(self.host, non_blocking=True)
        if self.copied is not None:  # on the stream of the copy: the device's, which need not be the current one
            self.copied.record(torch.cuda.current_stream(self.device.device))

    def wait_for_upload(self) -> None:
        if self.copied is not None:
            self.copied.synchronize()

    def views(self, packed: torch.Tensor) -> dict[str, torch.Tensor]:
        out, start = {}, 0
        for name, size in self.sizes.items():
            out[name] = packed[start:start + size]
            start += size
        out["tables"] = out["tables"].view(-1, self.width)
        return out


class StaticAttention:
    """What the model sees of a static step (the model's ``Attention`` protocol): the new keys go to their slots,
    each sequence's queries attend through its block table."""

    lora = None  # a sequence with a LoRA adapter runs on the dynamic path (``ModelRunner``)

    def __init__(self, pool: KVPool, inputs: dict[str, torch.Tensor], queries: int, end: int, splits: int,
                 counters: torch.Tensor) -> None:
        self.pool, self.queries, self.end, self.splits, self.counters = pool, queries, end, splits, counters
        self.positions = inputs["positions"][:]  # a new view per forward: RoPE caches its rows by tensor identity
        self.slots, self.tables = inputs["slots"], inputs["tables"]
        self.context_lens, self.query_lens = inputs["context_lens"], inputs["query_lens"]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None,
               window: int | None = None, sinks: torch.Tensor | None = None,
               rotary: RotaryEmbedding | None = None, softcap: float | None = None) -> torch.Tensor:
        if rotary is None or not self.pool.write_rotated(layer, self.slots, q, k, v, self.positions,
                                                          *rotary.tables()):
            if rotary is not None:
                q, k = rotary.rotate_pair(q, k, self.positions)
            self.pool.write(layer, self.slots, k, v)
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        return paged_attention(q, self.pool.layer(layer), self.tables, self.context_lens, self.query_lens,
                               self.queries, self.pool.block_size, scale, window or 0, sinks, self.splits,
                               self.counters, softcap)

    def single_tokens(self, layer: int) -> None:
        return None  # the CPU's fused C layers are not part of this path


class StaticStep:
    """One model's decode and verify forwards in buckets of static shape (see the module docstring)."""

    def __init__(self, model: Transformer, pool: KVPool, scratch_block: int, max_seqs: int, max_queries: int,
                 num_layers: int | None = None, graphs: bool = False, capture_chunks: bool = True) -> None:
        """``capture_chunks``: capture a prompt chunk bucket's graph on its first use; False where another thread
        may use the GPU meanwhile (run-ahead drafting), whose work a capture would break: the buckets ``warm_up`` did
        not capture then run eagerly."""
        if graphs and pool.k.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device; run the static step eagerly elsewhere")
        self.model, self.pool, self.num_layers, self.graphs = model, pool, num_layers, graphs
        self.capture_chunks = capture_chunks
        self.device = pool.k.device
        self.block_size = pool.block_size
        self.scratch_slot = scratch_block * pool.block_size
        self.seq_sizes, self.query_sizes = buckets_up_to(max_seqs), buckets_up_to(max_queries)
        self._inputs: dict[Bucket, _Inputs] = {}
        # (bucket, logit columns): a decode/verify bucket's graph; (bucket, None): a prompt chunk bucket's
        self._graphs: dict[tuple[Bucket, int | None], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._graph_pool = torch.cuda.graph_pool_handle() if graphs else None
        # every graph's output is a view of one buffer of its kind (logits, or a chunk's hidden states), grown to the
        # largest bucket of that kind
        self._outputs: dict[str, torch.Tensor] = {}
        self.forwards = self.replays = 0  # decode and verify forwards run here, and of those served by a graph
        self.chunk_forwards = 0  # forwards of prompt chunks (run_chunks), replayed or eager
        # the split attention's counters (paged_attention's ``counters``), zeros between launches: one buffer for
        # every layer and bucket, made here since a graph must not zero its own (a launch a layer more). Two of this
        # step's forwards must never run at once (they never do: one stream at a time, _graph's side stream joined)
        rows = max(MAX_CHUNK_ROWS, self.seq_sizes[-1] * self.query_sizes[-1])  # a forward's most rows
        self.merge_counters = torch.zeros(rows * model.config.num_heads, dtype=torch.int32, device=self.device)  # (a
        # group merges up to 16 of a sequence's rows of one key/value head's queries: never more groups than rows
        # times query heads)

    @property
    def end(self) -> int:
        """One past the last position a step may reach: the engine limits the model's positions after building
        its runners, before any forward."""
        return self.model.max_positions

    @property
    def width(self) -> int:
        """Block table entries per sequence: enough for every position."""
        return -(-self.end // self.block_size)

    @property
    def captured(self) -> int:
        """How many decode and verify buckets have a captured graph."""
        return sum(columns is not None for _, columns in self._graphs)

    @property
    def captured_chunks(self) -> int:
        """How many prompt chunk buckets have a captured graph."""
        return len(self._graphs) - self.captured

    def bucket(self, lengths: list[int]) -> Bucket | None:
        """The bucket for sequences bringing ``lengths`` new tokens each (all with logits), or None."""
        if not lengths or min(lengths) < 1:
            return None
        seqs = next((s for s in self.seq_sizes if s >= len(lengths)), None)
        queries = next((q for q in self.query_sizes if q >= max(lengths)), None)
        return None if seqs is None or queries is None else Bucket(seqs, queries)

    def run(self, kvs: list[SequenceKV], tokens: list[list[int]], logit_columns: int,
            device_tokens: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Each sequence's float32 logits rows, one per new token, of the forward that appends ``tokens[b]`` to
        ``kvs[b]``'s cache (its blocks already reserved); the caller advances ``num_cached``. ``device_tokens``
        (one token per sequence, on the device) replace the ids of ``tokens``: a launch-ahead step's ids are the
        previous step's choices, not yet read back."""
        bucket = self.bucket([len(t) for t in tokens])
        if bucket is None:
            raise ValueError(f"no static bucket holds {len(tokens)} sequences of up to {max(map(len, tokens))} tokens")
        if device_tokens is not None and (bucket.queries != 1 or device_tokens.shape != (len(tokens),)):
            raise ValueError(f"device_tokens must hold one token per sequence, got {tuple(device_tokens.shape)} for "
                             f"{len(tokens)} sequences of up to {bucket.queries} tokens")
        inputs = self._load(bucket, kvs, tokens)
        if device_tokens is not None:
            inputs.views(inputs.device)["tokens"][:len(tokens)].copy_(device_tokens)
        if self.graphs:
            graph, out = self._graph(bucket, inputs, logit_columns)
            graph.replay()
            self.replays += 1
            logits = out.clone()  # the graph's output is overwritten by the next replay
        else:
            logits = self._forward(bucket, inputs, logit_columns)
        self.forwards += 1
        return [logits[b * bucket.queries:b * bucket.queries + len(t)] for b, t in enumerate(tokens)]

    def _inputs_of(self, bucket: Bucket) -> _Inputs:
        """The bucket's packed inputs, made on first use."""
        if bucket not in self._inputs:
            self._inputs[bucket] = _Inputs(bucket, self.width, self.device)
        return self._inputs[bucket]

    def _load(self, bucket: Bucket, kvs: list[SequenceKV], tokens: list[list[int]]) -> _Inputs:
        """The bucket's inputs packed for this forward and on their way to the device (the host tensor rewritten
        only once its previous copy is done)."""
        inputs = self._inputs_of(bucket)
        inputs.wait_for_upload()
        self._pack(inputs, bucket, kvs, tokens)
        inputs.upload()
        return inputs

    def _pack(self, inputs: _Inputs, bucket: Bucket, kvs: list[SequenceKV], tokens: list[list[int]]) -> None:
        """Fill the host tensor: each sequence's rows, padding elsewhere (token 0 at a scratch slot; an empty
        sequence whose table points at the scratch block). Python lists and three tensor writes (a tensor a field,
        and one a sequence's table, cost several times as much at 32 sequences): this runs every step."""
        host = inputs.views(inputs.host)
        bs, queries, rows, scratch = self.block_size, bucket.queries, bucket.rows, self.scratch_slot // self.block_size
        ids, positions, slots = [0] * rows, [0] * rows, [self.scratch_slot] * rows
        context, lengths = [0] * bucket.seqs, [0] * bucket.seqs
        used_tables = []
        for b, (kv, new) in enumerate(zip(kvs, tokens)):
            start, n, table = kv.num_cached, len(new), kv.block_table
            for i, token in enumerate(new):
                row, position = b * queries + i, start + i
                ids[row], positions[row] = token, position
                slots[row] = table[position // bs] * bs + position % bs
            used_tables.append(table[:-(-(start + n) // bs)])
            context[b], lengths[b] = start + n, n
        # tokens, positions and slots are the packed tensor's first stretch, context and query lengths its last
        inputs.host[:3 * rows].copy_(torch.tensor(ids + positions + slots))
        tables = host["tables"]
        tables.fill_(scratch)
        widest = max(map(len, used_tables), default=0)
        if widest:
            tables[:len(used_tables), :widest] = torch.tensor([t + [scratch] * (widest - len(t)) for t in used_tables])
        inputs.host[-2 * bucket.seqs:].copy_(torch.tensor(context + lengths))

    def chunk_bucket(self, lengths: list[int]) -> Bucket | None:
        """The bucket ``run_chunks`` pads prompt chunks of ``lengths`` tokens to: a sequence bucket and the longest
        chunk rounded up to a power of two (so a few shapes serve every batch); None where a chunk is longer than
        ``MAX_CHUNK``, padding would be more than half the rows, or the rows are more than ``MAX_CHUNK_ROWS`` (the
        attention's split buffers grow with them)."""
        seqs = next((s for s in self.seq_sizes if s >= len(lengths)), None)
        if not lengths or seqs is None or not 0 < max(lengths) <= MAX_CHUNK or min(lengths) < 1:
            return None
        bucket = Bucket(seqs, 1 << (max(lengths) - 1).bit_length())
        return bucket if bucket.rows <= min(2 * sum(lengths), MAX_CHUNK_ROWS) else None

    def run_chunks(self, items: list[ForwardItem], logit_columns: int) -> list[torch.Tensor]:
        """Prompt chunks (any lengths, each wanting its last ``num_logits`` rows of logits, maybe none) through
        the step's forward (its graph, or run eagerly): the paged kernel attends each chunk's rows causally as it
        does a verify pass's (``chunk_bucket``). The rows that want logits go through the head after the forward, and
        a chunk's other rows too where it takes prompt logits (``ForwardItem.give_prompt_logits``); the caller
        advances ``num_cached``."""
        kvs, tokens, num_logits = [it.kv for it in items], [it.tokens for it in items], [it.num_logits for it in items]
        bucket = self.chunk_bucket([len(t) for t in tokens])
        if bucket is None:
            raise ValueError(f"no chunk bucket holds {len(tokens)} prompt chunks of up to {max(map(len, tokens))} "
                             f"tokens")
        inputs = self._load(bucket, kvs, tokens)
        rows = [b * bucket.queries + i for b, (chunk, n) in enumerate(zip(tokens, num_logits))
                for i in range(len(chunk) - n, len(chunk))]
        if self.graphs and (self.capture_chunks or (bucket, None) in self._graphs):
            graph, hidden = self._graph(bucket, inputs, None)
            graph.replay()
        else:
            hidden = self._forward(bucket, inputs, None)
        self.chunk_forwards += 1
        for b, it in enumerate(items):
            if it.prompt_logits is not None:
                first = b * bucket.queries
                it.give_prompt_logits(hidden[first:first + len(it.tokens) - it.num_logits],
                                      lambda h: self.model.logits(h)[:, :logit_columns])
        if not rows:  # prompt pieces before a prompt's last: no row wants logits
            logits = hidden.new_zeros(0, self.model.config.vocab_size, dtype=torch.float32)
        else:  # (indexing copies the rows out of the graph's output before its next replay)
            logits = self._head(hidden[to_device(torch.tensor(rows, dtype=torch.long), self.device)], logit_columns)
        out, start = [], 0
        for n in num_logits:
            out.append(logits[start:start + n])
            start += n
        return out

    def _forward(self, bucket: Bucket, inputs: _Inputs, logit_columns: int | None) -> torch.Tensor:
        """The forward over the bucket's packed inputs: float32 logits of every row, or (``logit_columns`` None, a
        prompt chunk's) the hidden states of every row. Every row's attention splits its keys the same way
        (``KEY_SPLITS``), prompt chunks' too: a draft verified beside the last prompt chunk must get the bits it gets
        as a decode step."""
        views = inputs.views(inputs.device)
        attn = StaticAttention(self.pool, views, bucket.queries, self.end, KEY_SPLITS, self.merge_counters)
        hidden = self.model(views["tokens"], attn, num_layers=self.num_layers)
        return hidden if logit_columns is None else self._head(hidden, logit_columns)

    def _head(self, hidden: torch.Tensor, logit_columns: int) -> torch.Tensor:
        """Float32 logits of ``hidden``'s rows, the columns from ``logit_columns`` on masked out."""
        logits = self.model.logits(hidden)
        if logit_columns < logits.shape[1]:
            logits[:, logit_columns:] = float("-inf")
        return logits

    def forget_graphs(self) -> None:
        """Drop every captured graph (the kernels' choices, ``Tiles`` among them, are baked into a capture): a bucket
        is captured again on its next use (a prompt chunk's, without ``capture_chunks``, runs eagerly). Later captures
        take a new memory pool: torch refuses a pool whose graphs are all gone, and keeps the old one's memory until
        its cache is emptied (which a capture's own out-of-memory retry does not do)."""
        self._graphs.clear()
        if self.graphs:
            torch.cuda.empty_cache()
            self._graph_pool = torch.cuda.graph_pool_handle()

    def _graph(self, bucket: Bucket, inputs: _Inputs, logit_columns: int | None
               ) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """The bucket's graph and its output (``_forward``'s), captured on first use."""
        key = (bucket, logit_columns)
        if key not in self._graphs:
            self._graphs[key] = self._capture(bucket, inputs, logit_columns)
        return self._graphs[key]

    def _capture(self, bucket: Bucket, inputs: _Inputs, logit_columns: int | None
                 ) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Warm the bucket up on a side stream (kernel compiles, cuBLAS workspaces), then capture it. The forwards
        of warm-up and capture write the packed inputs' slots; the packed inputs of the current step are restored
        after, so capturing inside a step changes nothing."""
        with self._on_scratch(inputs):  # warm-up and capture write only the scratch block
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                warm = self._forward(bucket, inputs, logit_columns)
                out = self._output(logit_columns is None, bucket.rows, warm)
                out.copy_(warm)
                out.copy_(self._forward(bucket, inputs, logit_columns))
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._graph_pool):
                out.copy_(self._forward(bucket, inputs, logit_columns))
        return graph, out

    def _output(self, chunk: bool, rows: int, like: torch.Tensor) -> torch.Tensor:
        """``rows`` rows of the buffer all graphs of the kind write (a prompt chunk's hidden states, or logits), made
        for the largest bucket of the kind on first use, and again where a row is wider (a draft's head may be cut
        to fewer rows than its vocabulary) or there are more rows."""
        kind = "hidden" if chunk else "logits"
        buffer = self._outputs.get(kind)
        if buffer is None or buffer.shape[0] < rows or buffer.shape[1:] != like.shape[1:] or buffer.dtype != like.dtype:
            largest = MAX_CHUNK_ROWS if chunk else Bucket(self.seq_sizes[-1], self.query_sizes[-1]).rows
            buffer = self._outputs[kind] = like.new_empty(max(largest, rows), *like.shape[1:])
        return buffer[:rows]

    @contextlib.contextmanager
    def _on_scratch(self, inputs: _Inputs) -> Iterator[None]:
        """Inside, the bucket's packed inputs send every key to the scratch block; after, they are the current step's
        again (a capture or a timing inside a step changes nothing)."""
        saved = inputs.device.clone()
        inputs.views(inputs.device)["slots"].fill_(self.scratch_slot)
        try:
            yield
        finally:
            inputs.device.copy_(saved)

    @torch.inference_mode()  # the buffers are inference tensors
    def device_seconds(self, seqs: int, queries: int, logit_columns: int, repeats: int = 50) -> float:
        """Seconds the GPU takes to run the captured graph of the bucket holding ``seqs`` x ``queries`` (replayed back
        to back, so the host's launches hide behind the device's work): a step's device time without the host's.
        The replays write keys to the scratch block only."""
        bucket = self.bucket([queries] * seqs)
        if not self.graphs or bucket is None:
            raise ValueError("device_seconds times a captured graph: graphs=True and a bucket that holds the step")
        inputs = self._inputs_of(bucket)
        graph, _ = self._graph(bucket, inputs, logit_columns)
        with self._on_scratch(inputs):
            graph.replay()
            torch.cuda.synchronize(self.device)
            start = time.perf_counter()
            for _ in range(repeats):
                graph.replay()
            torch.cuda.synchronize(self.device)
            return (time.perf_counter() - start) / repeats

    def warm_up(self, logit_columns: int, chunks: bool = False) -> None:
        """Capture every decode and verify bucket now (at load), so that no request waits for a capture; with
        ``chunks``, the prompt chunk buckets of one sequence too (those of several are captured on first use)."""
        if not self.graphs:
            return
        # the largest first: smaller graphs reuse its memory pool
        chunk_buckets = [Bucket(1, 1 << i) for i in reversed(range(MAX_CHUNK.bit_length()))] if chunks else []
        for bucket in chunk_buckets:
            self._graph(bucket, self._inputs_of(bucket), None)
        for seqs in reversed(self.seq_sizes):
            for queries in reversed(self.query_sizes):
                bucket = Bucket(seqs, queries)
                self._graph(bucket, self._inputs_of(bucket), logit_columns)
