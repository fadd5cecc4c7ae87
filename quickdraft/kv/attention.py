"""Attention over the paged KV cache, computed so that a token's result never depends on what else is in the batch.

The model sees only an ``AttentionBatch``: slots to write, and for each new token the context it attends to.
Block bookkeeping (which blocks a sequence holds) lives in ``blocks.py``.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from quickdraft.models import native
from quickdraft.models.fused import SingleTokens
from quickdraft.models.lora import LoraRows

if TYPE_CHECKING:  # for annotations only: blocks.py imports PREFILL_CELL from here
    from quickdraft.kv.pool import KVPool
    from quickdraft.models.transformer import RotaryEmbedding


# Attention is computed so that a token's result depends only on its position and the cached context,
# never on how many other tokens share the call (see AttentionBatch). Prompt chunks are cut into pieces at
# multiples of PREFILL_CELL positions; a piece of more than ROWWISE_MAX_QUERIES tokens attends in one
# causal call; every other token (decode steps, short pieces, drafts under verification) attends on its
# own, batched with the others whose context rounds up to the same multiple of KEY_BUCKET keys. The
# scheduler cuts prefill chunks that stop short of the sequence's end at cell boundaries, so every piece
# is the same whatever the batch.
PREFILL_CELL = 64
ROWWISE_MAX_QUERIES = 16
KEY_BUCKET = 64
# Where quickdraft's CPU kernel attends, every prompt token at a position below EXACT_POSITIONS attends alone too (no
# pieces there), so a token's bits there depend on its position and context only: a cached prefix may then end at
# any block below it, not only at a cell boundary (a chat's shared system prompt, a multi-turn conversation's
# earlier answers). Above it long pieces stay on torch's causal call, which is faster over long contexts
# (docs/MEASUREMENTS.md, "Prefix cache"). A multiple of PREFILL_CELL, so the pieces past it start on cells.
EXACT_POSITIONS = 1024


def native_attention(pool: KVPool) -> bool:
    """Whether single tokens attend on quickdraft's CPU kernel (``models/attention.c``) over this pool (where a
    layer's queries are not of a layout it takes, they go to torch's attention per key bucket)."""
    return native.available() and pool.k.device.type == "cpu" and pool.dtype in native.KV_FORMATS


def exact_positions(pool: KVPool, activations: torch.dtype) -> int:
    """The ``exact_below`` of a forward over ``pool`` with queries of ``activations``: EXACT_POSITIONS where
    quickdraft's CPU kernel takes every single token, else 0 (every long piece in torch's causal call)."""
    runs = native_attention(pool) and native.attends(pool.k.shape[-1], pool.dtype, activations)
    return EXACT_POSITIONS if runs else 0


def chunk_pieces(start: int, chunk: int) -> list[tuple[int, int]]:
    """Absolute [a, b) pieces of a prompt chunk covering positions start..start+chunk-1, cut at cell boundaries."""
    pieces, a, end = [], start, start + chunk
    while a < end:
        b = min(end, (a // PREFILL_CELL + 1) * PREFILL_CELL)
        pieces.append((a, b))
        a = b
    return pieces


def prefill_chunk(num_cached: int, pending: int, budget: int) -> int:
    """How many of a sequence's ``pending`` tokens to compute in a step with ``budget`` tokens left: all of
    them if they fit, else the most that end at a cell boundary (possibly 0: wait for a step with more room)."""
    if pending <= budget:
        return pending
    return max(0, (num_cached + budget) // PREFILL_CELL * PREFILL_CELL - num_cached)


class AttentionBatch:
    """Per-step attention metadata for a flat batch of new tokens from several sequences.

    The model hands each layer's q, k, v here; this writes the new keys and values
    into the pool and attends each sequence's queries to its own cached context.
    The model never sees block tables or scheduling.

    Why not one padded call for everything: torch's CPU attention rounds a query row
    differently depending on how many query rows share its call and how long the padded
    key axis is (not on the batch size), so verifying k drafts in one causal call would
    give logits a few bfloat16 ulps away from k single-token steps, and greedy
    speculation (or batching) would flip near-ties. So each single token is one batch
    element whose query rows are its own query heads (grouped per key/value head, also
    much faster on CPU than a one-row GQA call), attending to its context padded to the
    next multiple of KEY_BUCKET, a length that depends only on its position, in a call run
    on one thread (torch splits a batch between threads in a way that leaks into the
    results; on one thread a batch element's result is its own). On CPU, quickdraft's attention
    kernel (``models/attention.c``) takes the single tokens instead: each attends to exactly its own
    context, read in place through the slot table in the cache's format, with a fixed order of
    operations; a sequence's consecutive single tokens (a verify pass) are one group that reads the
    context once; it takes every prompt token below EXACT_POSITIONS too. Long prompt pieces past it (all of them
    where the kernel does not run) attend in one causal call over exactly their own context.
    Plain, speculative and batched runs therefore compute every token the same way.
    """

    def __init__(self, pool: KVPool, tables: list[list[int]], starts: list[int], lengths: list[int],
                 chunks: list[int] | None = None, exact_below: int = 0, lora: LoraRows | None = None) -> None:
        """``chunks[b]``: how many leading new tokens of sequence b are a prompt chunk; the rest (drafts being
        verified) attend as single tokens. Default: all of them. ``exact_below`` (``exact_positions``, a multiple
        of PREFILL_CELL): prompt tokens at positions below it attend as single tokens too. ``lora``: the rows that
        run a LoRA adapter (the model adds its terms; attention is the same)."""
        self.lora = lora
        if exact_below % PREFILL_CELL:
            raise ValueError(f"exact_below must be a multiple of {PREFILL_CELL}, got {exact_below}")
        self.pool = pool
        device = pool.k.device
        bs = pool.block_size
        num_seqs = len(lengths)
        self.num_tokens = sum(lengths)
        totals = [s + n for s, n in zip(starts, lengths)]
        self.end = max(totals)  # one past the largest position
        width = -(-self.end // KEY_BUCKET) * KEY_BUCKET
        # slot of every position of every sequence, [B, width] (past a sequence's end: some slot, never read unmasked)
        table_width = -(-width // bs)
        table = torch.tensor([(t + [0] * table_width)[:table_width] for t in tables], dtype=torch.long)
        position = torch.arange(width)
        slots = table[:, position // bs] * bs + position % bs
        # per new token (row): its sequence and absolute position
        counts = torch.tensor(lengths)
        seq_of_row = torch.repeat_interleave(torch.arange(num_seqs), counts)
        first_row = torch.cumsum(counts, 0) - counts
        positions = (torch.arange(self.num_tokens) - first_row[seq_of_row]) + torch.tensor(starts)[seq_of_row]
        lone = torch.ones(self.num_tokens, dtype=torch.bool)
        self.pieces: list[tuple[int, int, torch.Tensor, torch.Tensor]] = []  # (first row, end row, slots, mask)
        self._windowed: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}  # see _piece
        for b in range(num_seqs):
            chunk = lengths[b] if chunks is None else chunks[b]
            if chunk <= ROWWISE_MAX_QUERIES:
                continue  # every piece is short: all its tokens attend alone
            row = int(first_row[b]) - starts[b]  # row of absolute position 0 of this sequence
            for a, e in chunk_pieces(starts[b], chunk):
                if e - a > ROWWISE_MAX_QUERIES and a >= exact_below:
                    mask = torch.arange(e)[None, :] <= torch.arange(a, e)[:, None]
                    self.pieces.append((row + a, row + e, slots[b, :e], mask))
                    lone[row + a:row + e] = False
        rows = lone.nonzero().squeeze(1)
        keys = positions[rows] + 1
        self.native = native_attention(pool)
        # single tokens: quickdraft's CPU attention kernel when it runs here (each token over exactly its own
        # context, read in place from the pool; a sequence's consecutive tokens, a verify pass, read it once),
        # else torch's attention per key bucket (see attend)
        seq_of_single = seq_of_row[rows]
        starts_of_groups = (seq_of_single[1:] != seq_of_single[:-1]).nonzero().squeeze(1) + 1
        group_first = torch.cat([torch.zeros(1, dtype=torch.long), starts_of_groups,
                                 torch.tensor([len(rows)])]) if len(rows) else torch.zeros(1, dtype=torch.long)
        self.items = native.AttnItems(rows, slots[seq_of_single].contiguous(), keys, group_first)
        self._bucket_args = (rows, keys, slots, seq_of_row, device)
        self._singles: dict[int, list] = {}  # by window (0: none), built when first needed off the native kernel
        self.slot_mapping = slots[seq_of_row, positions].to(device)
        self.positions = positions.to(device)

    @staticmethod
    def _buckets(rows: torch.Tensor, keys: torch.Tensor, slots: torch.Tensor, seq_of_row: torch.Tensor,
                 device: torch.device, window: int | None
                 ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Per key bucket: (rows [R], key slots [R, bucket], mask [R, 1, 1, bucket]); a row sees its last
        ``window`` keys where one is given."""
        out = []
        buckets = (keys + KEY_BUCKET - 1) // KEY_BUCKET * KEY_BUCKET
        for bucket in buckets.unique().tolist():
            chosen = buckets == bucket
            bucket_rows, bucket_keys = rows[chosen], keys[chosen]
            key = torch.arange(bucket)[None, :]
            mask = key < bucket_keys[:, None]
            if window is not None:
                mask &= key >= bucket_keys[:, None] - window
            key_slots = slots[seq_of_row[bucket_rows], :bucket].masked_fill(~mask, 0)  # padding reads slot 0
            out.append((bucket_rows.to(device), key_slots.to(device), mask[:, None, None, :].to(device)))
        return out

    def _piece(self, index: int, window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """A prompt piece's key slots and mask on the pool's device, within ``window`` keys of each query when one
        is given: keys before every query's window are not read at all."""
        key = (index, window or 0)
        if key not in self._windowed:
            first, end, slots, mask = self.pieces[index]
            if window is not None:
                last = mask.shape[1]  # the piece's queries are the last end - first positions of its context
                query = torch.arange(last - (end - first), last)[:, None]
                lo = max(0, last - (end - first) - window + 1)
                mask = mask[:, lo:] & (torch.arange(lo, last)[None, :] > query - window)
                slots = slots[lo:]
            device = self.pool.k.device
            self._windowed[key] = (slots.to(device), mask.to(device))
        return self._windowed[key]

    def single_tokens(self, layer: int) -> SingleTokens | None:
        """Every new token attends alone on quickdraft's kernel (a decode, verify or draft step): what a fused
        decoder layer needs (``models/fused.py``); None when a prompt piece is in the batch or the kernel does not run."""
        if not self.native or self.pieces or not len(self.items.rows):
            return None
        return SingleTokens(self.positions, self.slot_mapping, self.items, self.pool.layer(layer),
                            self.pool.k.stride(0), self.pool.scale_layer_stride)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None,
               window: int | None = None, sinks: torch.Tensor | None = None,
               rotary: RotaryEmbedding | None = None, softcap: float | None = None) -> torch.Tensor:
        """q: [T, H, D], k/v: [T, KVH, D] for the new tokens; returns [T, H, D]. ``scale``: of the dot products
        (default D ** -0.5); ``window``: a token at position p sees keys p - window < j <= p (default: all);
        ``sinks`` [H]: each head's softmax also normalizes over exp(sink) (gpt-oss); ``rotary``: q and k are not
        rotated yet (see the ``Attention`` protocol); ``softcap``: scores soft-capped (Gemma 2)."""
        if rotary is not None:
            q, k = rotary.rotate_pair(q, k, self.positions)
        self.pool.write(layer, self.slot_mapping, k, v)
        tokens, heads, dim = q.shape
        kv_heads = k.shape[1]
        scale = dim ** -0.5 if scale is None else scale
        out = q.new_empty(tokens, heads, dim)
        for index, (first, end, _, _) in enumerate(self.pieces):
            slots, mask = self._piece(index, window)
            ks, vs = self.pool.read(layer, slots, q.dtype)
            qs = q[first:end].transpose(0, 1).unsqueeze(0)  # [1, H, m, D]
            ks, vs = ks.transpose(0, 1).unsqueeze(0), vs.transpose(0, 1).unsqueeze(0)  # [1, KVH, L, D]
            if sinks is not None:
                ks, vs, mask = with_sinks(ks, vs, mask[None, None], sinks.view(1, heads, 1, 1))
            o = dot_product_attention(qs, ks, vs, mask, scale, softcap, enable_gqa=True)
            out[first:end] = o[0].transpose(0, 1)
        if not len(self.items.rows):
            return out
        if self.native:
            cache = self.pool.layer(layer)
            if native.runs_attend(q, cache):
                native.attend(q, cache, self.items, out, scale, window or 0, sinks, softcap)
                return out
            self.native = False  # a head layout the kernel does not take (checked once per batch)
        if (window or 0) not in self._singles:
            self._singles[window or 0] = self._buckets(*self._bucket_args, window)
        grouped = q.view(tokens, kv_heads, heads // kv_heads, dim)  # query heads that share a key/value head
        for rows, key_slots, mask in self._singles[window or 0]:
            ks, vs = self.pool.read(layer, key_slots, q.dtype)  # [R, bucket, KVH, D]
            ks, vs = ks.transpose(1, 2), vs.transpose(1, 2)
            if sinks is not None:
                ks, vs, mask = with_sinks(ks, vs, mask, sinks.view(1, kv_heads, heads // kv_heads, 1))
            with one_thread(q.device):
                o = dot_product_attention(grouped[rows], ks, vs, mask, scale, softcap)  # [R, KVH, G, D]
            out[rows] = o.reshape(len(rows), heads, dim)
        return out


def dot_product_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                          softcap: float | None = None, enable_gqa: bool = False) -> torch.Tensor:
    """torch's ``scaled_dot_product_attention`` of q ``[..., H, m, D]`` over k/v ``[..., KVH, L, D]`` under ``mask``
    (boolean, or additive logits); ``enable_gqa``: H is a multiple of KVH, consecutive query heads sharing a
    key/value head. With ``softcap`` (Gemma 2), which SDPA has no option for, the scores are computed out in float32
    and each soft-capped to ``softcap * tanh(s / softcap)`` before the mask and the softmax, as transformers' Gemma 2
    does."""
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=enable_gqa, scale=scale)
    *lead, heads, rows, dim = q.shape
    kv_heads = k.shape[-3]
    group = heads // kv_heads
    if group > 1 and mask.dtype == torch.bool and mask.dim() == 2:
        # a prompt piece: the query heads of a key/value head as one block of rows over its keys, never copied
        q = q.reshape(*lead, kv_heads, group * rows, dim)
        mask = mask.repeat(group, 1)
    elif group > 1:
        k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
    scores = torch.tanh(q.float() @ k.float().transpose(-1, -2) * scale / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    out = (torch.softmax(scores, dim=-1) @ v.float()).to(q.dtype)
    return out.reshape(*lead, heads, rows, dim)


def with_sinks(ks: torch.Tensor, vs: torch.Tensor, mask: torch.Tensor, sinks: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention sinks as one more key: a zero key and value after the context (``ks``/``vs`` [..., L, D]), and the
    boolean ``mask`` [..., L] as additive logits with each head's sink (``sinks``, broadcast to the query rows) as
    that key's logit. Its score is the sink itself, and its value adds nothing: the softmax over the context is
    normalized by the sum with exp(sink), as gpt-oss's attention does."""
    zero = ks.new_zeros(*ks.shape[:-2], 1, ks.shape[-1])
    bias = torch.zeros(mask.shape, dtype=ks.dtype, device=ks.device).masked_fill_(~mask, float("-inf"))
    shape = torch.broadcast_shapes(bias.shape[:-1], sinks.shape[:-1])
    bias = torch.cat([bias.expand(*shape, bias.shape[-1]), sinks.to(ks.dtype).expand(*shape, 1)], dim=-1)
    return torch.cat([ks, zero], dim=-2), torch.cat([vs, zero], dim=-2), bias


@contextlib.contextmanager
def one_thread(device: torch.device) -> Iterator[None]:
    """With several threads, torch's CPU attention gives a batch element a result that depends on how the
    batch was split between threads; on one thread each element's result is its own."""
    threads = torch.get_num_threads()
    if device.type != "cpu" or threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
