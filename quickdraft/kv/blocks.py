"""Block bookkeeping of the paged KV cache: one pool of fixed-size blocks per model, in memory as far as used.

A sequence owns a list of block ids (its block table). Token ``i`` of a
sequence lives in slot ``block_table[i // block_size] * block_size + i % block_size``
of the flattened pool. Truncating a sequence (speculative rewind) only moves its
length back and returns whole blocks it no longer needs; nothing is recomputed.
The storage itself is ``pool.py``; what the model computes over it lives in ``attention.py``.
"""
from __future__ import annotations

import hashlib
import heapq
from array import array
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from quickdraft.kv.attention import PREFILL_CELL

if TYPE_CHECKING:
    import torch

    from quickdraft.kv.pool import KVPool
    from quickdraft.models.lora import Mix


PROMPT_LOGITS_ROWS = 256  # prompt rows through the LM head at once (150 MB of float32 logits at a 150k vocabulary)


class OutOfBlocks(RuntimeError):
    """The pool has no free block left; the scheduler must wait or preempt."""


def block_hash(parent: bytes, tokens: list[int]) -> bytes:
    """Content hash of a full block, chained to its predecessor so equal blocks at different offsets differ."""
    return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=16).digest()


class BlockAllocator:
    """Reference-counted blocks with a prefix cache of full blocks by content hash.

    A released block keeps its content and hash until it is handed out again, so a later request with the same
    prefix can take it back. Blocks are handed out so that memory grows only when the sequences need more: first a
    free block whose content nobody can reuse (the lowest id), then a block never used before (``high_water`` grows:
    the pool's pages up to it are the ones in memory), and only when none is left the least recently freed block of
    the prefix cache. ``trim`` lowers the high-water mark past the blocks no sequence and no cached prefix holds.
    """

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.high_water = 0  # blocks from here on were never handed out (or were trimmed): they hold no memory
        self._plain: list[int] = []  # heap of free blocks below high_water without cached content
        self._cached: OrderedDict[int, None] = OrderedDict()  # free blocks holding a cached prefix, least recent first
        self._hash_of: dict[int, bytes] = {}
        self._block_of: dict[bytes, int] = {}
        self.prefix_hit_blocks = 0
        self.prefix_query_blocks = 0

    @property
    def num_free(self) -> int:
        return len(self._plain) + len(self._cached) + self.num_blocks - self.high_water

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        """Free blocks that still hold a cached prefix (read without a lock by /metrics: a length, not a copy)."""
        return len(self._cached)

    @property
    def cached_blocks(self) -> list[int]:
        """Free blocks that still hold a cached prefix (reusable by a later request with that prefix)."""
        return list(self._cached)

    def allocate(self) -> int:
        if self._plain:
            block = heapq.heappop(self._plain)
        elif self.high_water < self.num_blocks:
            block, self.high_water = self.high_water, self.high_water + 1
        elif self._cached:
            block, _ = self._cached.popitem(last=False)
            self.forget(block)
        else:
            raise OutOfBlocks(f"all {self.num_blocks} KV blocks are in use")
        self.ref_counts[block] = 1
        return block

    def share(self, block: int) -> int:
        if self.ref_counts[block] == 0:
            del self._cached[block]  # only a cached block is found (lookup) while free
        self.ref_counts[block] += 1
        return block

    def release(self, block: int) -> None:
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            if block in self._hash_of:
                self._cached[block] = None
            else:
                heapq.heappush(self._plain, block)

    def register(self, block: int, digest: bytes) -> None:
        if digest not in self._block_of:
            self._block_of[digest] = block
            self._hash_of[block] = digest

    def lookup(self, digest: bytes) -> int | None:
        return self._block_of.get(digest)

    def forget(self, block: int) -> None:
        """Take a block out of the prefix cache: its content is about to change (or is no longer wanted)."""
        digest = self._hash_of.pop(block, None)
        if digest is not None and self._block_of.get(digest) == block:
            del self._block_of[digest]
        if block in self._cached:
            del self._cached[block]
            heapq.heappush(self._plain, block)

    def reset_prefix_cache(self) -> None:
        """Forget the cached content of every free block; blocks in use keep theirs (their sequences still share
        them)."""
        for block in list(self._cached):
            self.forget(block)

    def trim(self) -> int:
        """Lower ``high_water`` to just past the highest block in use or holding a cached prefix, and return it: the
        pool can give back the memory of every block from there on."""
        held = [b for b in range(self.high_water) if self.ref_counts[b] or b in self._cached]
        self.high_water = held[-1] + 1 if held else 0
        self._plain = [b for b in self._plain if b < self.high_water]
        heapq.heapify(self._plain)
        return self.high_water


@dataclass
class SequenceKV:
    """What one sequence holds in one model's pool: its block table and how many tokens are cached."""

    block_table: list[int] = field(default_factory=list)
    num_cached: int = 0
    hashes: list[bytes] = field(default_factory=list)  # content hashes of the leading full, committed blocks
    # the ids cached, kept by an owner whose ids can change under it (a draft of another vocabulary re-encodes the
    # text); None: not kept. May run past num_cached while tokens are hidden.
    tokens: list[int] | None = None
    # the LoRA adapters whose keys and values these are (slots and scales in the model's ``LoraWeights``; (): the base
    # model alone)
    adapter: Mix = ()

    @property
    def hash_seed(self) -> bytes:
        """What its blocks' hashes start from: the adapters, so that a prefix cached under one is never another's."""
        return repr(self.adapter).encode() if self.adapter else b""

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
        if self.tokens is not None:
            del self.tokens[length:]
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

    def fork(self, length: int, allocator: BlockAllocator, block_size: int) -> SequenceKV:
        """A child sharing this sequence's first ``length`` cached tokens (n > 1 samples of one prompt)."""
        length = min(length, self.num_cached)
        table = [allocator.share(b) for b in self.block_table[: -(-length // block_size)]]
        return SequenceKV(table, length, self.hashes[: length // block_size],
                          None if self.tokens is None else self.tokens[:length], self.adapter)

    def match_prefix(self, tokens: list[int], allocator: BlockAllocator, block_size: int, exact_below: int = 0) -> int:
        """Take cached full blocks that hold a prefix of ``tokens``; at least one token is left to compute.
        ``exact_below``: positions below which a token's bits depend on its position and context alone
        (``attention.exact_positions``): the computation may start at any block there, past it only at a cell."""
        if self.block_table:
            return 0
        parent = self.hash_seed
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
        # past exact_below, start computing at a cell boundary, as a run without the cache would have (see
        # PREFILL_CELL); below it a token attends alone whatever its chunk
        while (PREFILL_CELL % block_size == 0 and len(self.block_table) * block_size > exact_below
               and len(self.block_table) * block_size % PREFILL_CELL):
            allocator.release(self.block_table.pop())
            self.hashes.pop()
        self.num_cached = len(self.block_table) * block_size
        return self.num_cached

    def publish(self, tokens: list[int], allocator: BlockAllocator, block_size: int) -> None:
        """Register blocks that are now full of committed tokens so later prompts can reuse them."""
        full = min(self.num_cached, len(tokens)) // block_size
        while len(self.hashes) < full:
            i = len(self.hashes)
            parent = self.hashes[-1] if self.hashes else self.hash_seed
            digest = block_hash(parent, tokens[i * block_size:(i + 1) * block_size])
            allocator.register(self.block_table[i], digest)
            self.hashes.append(digest)


@dataclass
class ForwardItem:
    """One sequence's part of a batched forward: its KV handle, new tokens, and how many trailing logits rows it
    needs. ``prompt_logits``, where set, also takes the logits of the tokens before those rows (a prompt chunk's,
    for prompt logprobs), a slice of rows at a time: (the index in ``tokens`` of the slice's first token, its
    float32 rows, or the error computing them). It must not raise: it runs inside the step's shared forward."""

    kv: SequenceKV
    tokens: list[int]
    num_logits: int
    prompt_logits: Callable[[int, torch.Tensor | Exception], None] | None = None

    def give_prompt_logits(self, hidden: torch.Tensor, head: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Hand ``prompt_logits`` the logits (``head``, float32) of ``hidden``, the final hidden states of the tokens
        before the trailing ``num_logits``, PROMPT_LOGITS_ROWS rows at a time: a whole chunk's rows over a
        vocabulary of 150k would hold GBs at once."""
        for first in range(0, len(hidden), PROMPT_LOGITS_ROWS):
            try:
                rows = head(hidden[first:first + PROMPT_LOGITS_ROWS])
            except Exception as exc:  # noqa: BLE001 - (out of memory, say) this item's alone: its taker keeps it
                rows = exc
            self.prompt_logits(first, rows)
