"""Paged KV cache: one preallocated pool of fixed-size blocks per model.

A sequence owns a list of block ids (its block table). Token ``i`` of a
sequence lives in slot ``block_table[i // block_size] * block_size + i % block_size``
of the flattened pool. Truncating a sequence (speculative rewind) only moves its
length back and returns whole blocks it no longer needs; nothing is recomputed.
"""
from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from quickdraft.models import native
from quickdraft.models.fused import SingleTokens


class OutOfBlocks(RuntimeError):
    """The pool has no free block left; the scheduler must wait or preempt."""


class KVPool:
    """Key and value storage for every layer of one model: ``[layers, blocks * block_size, kv_heads, head_dim]``."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"KV pool needs at least one block of at least one slot, got {num_blocks}x{block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        shape = (num_layers, num_blocks * block_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    def copy_block(self, src: int, dst: int) -> None:
        bs = self.block_size
        self.k[:, dst * bs:(dst + 1) * bs] = self.k[:, src * bs:(src + 1) * bs]
        self.v[:, dst * bs:(dst + 1) * bs] = self.v[:, src * bs:(src + 1) * bs]

    @staticmethod
    def bytes_per_block(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def block_hash(parent: bytes, tokens: list[int]) -> bytes:
    """Content hash of a full block, chained to its predecessor so equal blocks at different offsets differ."""
    return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=16).digest()


class BlockAllocator:
    """Reference-counted blocks with a prefix cache of full blocks by content hash.

    A released block keeps its content and hash until it is handed out again, so
    a later request with the same prefix can take it back (least recently freed
    blocks are reused first).
    """

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self._hash_of: dict[int, bytes] = {}
        self._block_of: dict[bytes, int] = {}
        self.prefix_hit_blocks = 0
        self.prefix_query_blocks = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise OutOfBlocks(f"all {self.num_blocks} KV blocks are in use")
        block, _ = self._free.popitem(last=False)
        digest = self._hash_of.pop(block, None)
        if digest is not None and self._block_of.get(digest) == block:
            del self._block_of[digest]
        self.ref_counts[block] = 1
        return block

    def share(self, block: int) -> int:
        if self.ref_counts[block] == 0:
            del self._free[block]
        self.ref_counts[block] += 1
        return block

    def release(self, block: int) -> None:
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self._free[block] = None

    def register(self, block: int, digest: bytes) -> None:
        if digest not in self._block_of:
            self._block_of[digest] = block
            self._hash_of[block] = digest

    def lookup(self, digest: bytes) -> int | None:
        return self._block_of.get(digest)

    def forget(self, block: int) -> None:
        """Take a block out of the prefix cache: its content is about to change."""
        digest = self._hash_of.pop(block, None)
        if digest is not None and self._block_of.get(digest) == block:
            del self._block_of[digest]

    def reset_prefix_cache(self) -> None:
        """Forget the cached content of every free block; blocks in use keep theirs (their sequences still share
        them)."""
        for block in [b for b in self._hash_of if self.ref_counts[b] == 0]:
            self.forget(block)


@dataclass
class SequenceKV:
    """What one sequence holds in one model's pool: its block table and how many tokens are cached."""

    block_table: list[int] = field(default_factory=list)
    num_cached: int = 0
    hashes: list[bytes] = field(default_factory=list)  # content hashes of the leading full, committed blocks

    def blocks_needed(self, new_length: int, block_size: int) -> int:
        return max(0, -(-new_length // block_size) - len(self.block_table))

    def reserve(self, new_length: int, allocator: BlockAllocator, block_size: int) -> None:
        """Make room for ``new_length`` tokens; all-or-nothing so a failure leaves the table unchanged."""
        needed = self.blocks_needed(new_length, block_size)
        if needed > allocator.num_free:
            raise OutOfBlocks(f"need {needed} KV blocks, {allocator.num_free} free")
        self.block_table.extend(allocator.allocate() for _ in range(needed))

    def make_writable(self, start: int, end: int, allocator: BlockAllocator, pool: KVPool) -> None:
        """Copy-on-write: give this sequence its own copy of any shared block that slots start..end-1 touch."""
        bs = pool.block_size
        for i in range(start // bs, min(-(-end // bs), len(self.block_table))):
            old = self.block_table[i]
            if allocator.ref_counts[old] > 1:
                new = allocator.allocate()
                pool.copy_block(old, new)
                allocator.release(old)
                self.block_table[i] = new

    def truncate(self, length: int, allocator: BlockAllocator, block_size: int) -> None:
        """Forget every token from ``length`` on and give back blocks that held only those."""
        self.num_cached = min(self.num_cached, length)
        full = length // block_size
        if full < len(self.hashes) and length % block_size:
            # a published block stays but will be rewritten from ``length`` on (a session's history edited
            # below committed tokens): the prefix cache must not hand it out for its old content any more
            allocator.forget(self.block_table[full])
        del self.hashes[full:]
        keep = -(-length // block_size)
        while len(self.block_table) > keep:
            allocator.release(self.block_table.pop())

    def free(self, allocator: BlockAllocator) -> None:
        self.truncate(0, allocator, 1)

    def hide(self, length: int) -> None:
        """Report only the first ``length`` cached tokens but keep the blocks (and contents) of the rest, so that
        whoever reads the cache sees committed tokens only until ``reveal`` takes the rest back."""
        self.num_cached = min(self.num_cached, length)

    def reveal(self, length: int, block_size: int) -> None:
        """Report ``length`` cached tokens again after ``hide``: the slots up to it still hold what was computed."""
        if length > len(self.block_table) * block_size:
            raise ValueError(f"cannot reveal {length} tokens: only {len(self.block_table)} blocks are held")
        self.num_cached = length

    def fork(self, length: int, allocator: BlockAllocator, block_size: int) -> "SequenceKV":
        """A child sharing this sequence's first ``length`` cached tokens (n > 1 samples of one prompt)."""
        length = min(length, self.num_cached)
        table = [allocator.share(b) for b in self.block_table[: -(-length // block_size)]]
        return SequenceKV(table, length, self.hashes[: length // block_size])

    def match_prefix(self, tokens: list[int], allocator: BlockAllocator, block_size: int) -> int:
        """Take cached full blocks that hold a prefix of ``tokens``; at least one token is left to compute."""
        if self.block_table:
            return 0
        parent = b""
        for i in range((len(tokens) - 1) // block_size):
            allocator.prefix_query_blocks += 1
            digest = block_hash(parent, tokens[i * block_size:(i + 1) * block_size])
            block = allocator.lookup(digest)
            if block is None:
                break
            allocator.prefix_hit_blocks += 1
            self.block_table.append(allocator.share(block))
            self.hashes.append(digest)
            parent = digest
        # start computing at a cell boundary, as a run without the cache would have (see PREFILL_CELL)
        while PREFILL_CELL % block_size == 0 and len(self.block_table) * block_size % PREFILL_CELL:
            allocator.release(self.block_table.pop())
            self.hashes.pop()
        self.num_cached = len(self.block_table) * block_size
        return self.num_cached

    def publish(self, tokens: list[int], allocator: BlockAllocator, block_size: int) -> None:
        """Register blocks that are now full of committed tokens so later prompts can reuse them."""
        full = min(self.num_cached, len(tokens)) // block_size
        while len(self.hashes) < full:
            i = len(self.hashes)
            digest = block_hash(self.hashes[-1] if self.hashes else b"", tokens[i * block_size:(i + 1) * block_size])
            allocator.register(self.block_table[i], digest)
            self.hashes.append(digest)


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
    >10x faster on CPU than a one-row GQA call), attending to its context padded to the
    next multiple of KEY_BUCKET, a length that depends only on its position, in a call run
    on one thread (torch splits a batch between threads in a way that leaks into the
    results; on one thread a batch element's result is its own). On CPU, quickdraft's attention
    kernel (``models/cpu_ops.c``) takes the single tokens instead: each attends to exactly its own
    context, read in place through the slot table, with a fixed order of operations. Long prompt
    pieces attend in one causal call over exactly their own context. Plain, speculative
    and batched runs therefore compute every token the same way.
    """

    def __init__(self, pool: KVPool, tables: list[list[int]], starts: list[int], lengths: list[int],
                 chunks: list[int] | None = None) -> None:
        """``chunks[b]``: how many leading new tokens of sequence b are a prompt chunk; the rest (drafts being
        verified) attend as single tokens. Default: all of them."""
        self.pool = pool
        device = pool.k.device
        bs = pool.block_size
        num_seqs = len(lengths)
        self.num_tokens = sum(lengths)
        totals = [s + n for s, n in zip(starts, lengths)]
        width = -(-max(totals) // KEY_BUCKET) * KEY_BUCKET
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
        for b in range(num_seqs):
            chunk = lengths[b] if chunks is None else chunks[b]
            if chunk <= ROWWISE_MAX_QUERIES:
                continue  # every piece is short: all its tokens attend alone
            row = int(first_row[b]) - starts[b]  # row of absolute position 0 of this sequence
            for a, e in chunk_pieces(starts[b], chunk):
                if e - a > ROWWISE_MAX_QUERIES:
                    mask = torch.arange(e)[None, :] <= torch.arange(a, e)[:, None]
                    self.pieces.append((row + a, row + e, slots[b, :e].to(device), mask.to(device)))
                    lone[row + a:row + e] = False
        rows = lone.nonzero().squeeze(1)
        keys = positions[rows] + 1
        # single tokens: quickdraft's CPU attention kernel when it runs here (each token over exactly its own
        # context, read in place from the pool), else torch's attention per key bucket (see attend)
        self.native = native.available() and pool.k.device.type == "cpu" and pool.k.dtype in (torch.float32,
                                                                                            torch.bfloat16)
        self.single_rows, self.single_slots, self.single_lengths = rows, slots[seq_of_row[rows]], keys
        self._bucket_args = (rows, keys, slots, seq_of_row, device)
        self.singles = [] if self.native else self._buckets(*self._bucket_args)
        self.slot_mapping = slots[seq_of_row, positions].to(device)
        self.positions = positions.to(device)

    @staticmethod
    def _buckets(rows: torch.Tensor, keys: torch.Tensor, slots: torch.Tensor, seq_of_row: torch.Tensor,
                 device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Per key bucket: (rows [R], key slots [R, bucket], mask [R, 1, 1, bucket])."""
        out = []
        buckets = (keys + KEY_BUCKET - 1) // KEY_BUCKET * KEY_BUCKET
        for bucket in buckets.unique().tolist():
            chosen = buckets == bucket
            bucket_rows, bucket_keys = rows[chosen], keys[chosen]
            mask = torch.arange(bucket)[None, :] < bucket_keys[:, None]
            key_slots = slots[seq_of_row[bucket_rows], :bucket].masked_fill(~mask, 0)  # padding reads slot 0
            out.append((bucket_rows.to(device), key_slots.to(device), mask[:, None, None, :].to(device)))
        return out

    def single_tokens(self, layer: int) -> SingleTokens | None:
        """Every new token attends alone on quickdraft's kernel (a decode, verify or draft step): what a fused
        decoder layer needs (``models/fused.py``); None when a prompt piece is in the batch or the kernel does not run."""
        if not self.native or self.pieces or not len(self.single_rows):
            return None
        return SingleTokens(self.positions, self.slot_mapping, self.single_rows, self.single_slots, self.single_lengths,
                            self.pool.k[layer], self.pool.v[layer])

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [T, H, D], k/v: [T, KVH, D] for the new tokens; returns [T, H, D]."""
        k_cache, v_cache = self.pool.k[layer], self.pool.v[layer]
        k_cache.index_copy_(0, self.slot_mapping, k)
        v_cache.index_copy_(0, self.slot_mapping, v)
        tokens, heads, dim = q.shape
        kv_heads = k.shape[1]
        out = q.new_empty(tokens, heads, dim)
        for first, end, slots, mask in self.pieces:
            qs = q[first:end].transpose(0, 1).unsqueeze(0)  # [1, H, m, D]
            ks = k_cache[slots].transpose(0, 1).unsqueeze(0)  # [1, KVH, L, D]
            vs = v_cache[slots].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, enable_gqa=True)
            out[first:end] = o[0].transpose(0, 1)
        if self.native and len(self.single_rows) and not native.runs_attend(q, k_cache):
            self.native = False  # a head layout the kernel does not take (checked once per batch)
            self.singles = self._buckets(*self._bucket_args)
        if self.native:
            if len(self.single_rows):
                native.attend_rows(q, k_cache, v_cache, self.single_rows, self.single_slots, self.single_lengths, out)
            return out
        grouped = q.view(tokens, kv_heads, heads // kv_heads, dim)  # query heads that share a key/value head
        for rows, key_slots, mask in self.singles:
            ks = k_cache[key_slots].transpose(1, 2)  # [R, KVH, bucket, D]
            vs = v_cache[key_slots].transpose(1, 2)
            with one_thread(q.device):
                o = F.scaled_dot_product_attention(grouped[rows], ks, vs, attn_mask=mask)  # [R, KVH, G, D]
            out[rows] = o.reshape(len(rows), heads, dim)
        return out


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
