"""Paged KV cache: one preallocated pool of fixed-size blocks per model.

A sequence owns a list of block ids (its block table). Token ``i`` of a
sequence lives in slot ``block_table[i // block_size] * block_size + i % block_size``
of the flattened pool. Truncating a sequence (speculative rewind) only moves its
length back and returns whole blocks it no longer needs; nothing is recomputed.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


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

    @staticmethod
    def bytes_per_block(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


class BlockAllocator:
    """Free list with reference counts, so several sequences can share blocks (n > 1, prefix cache)."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise OutOfBlocks(f"all {self.num_blocks} KV blocks are in use")
        block = self._free.pop()
        self.ref_counts[block] = 1
        return block

    def share(self, block: int) -> int:
        self.ref_counts[block] += 1
        return block

    def release(self, block: int) -> None:
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self._free.append(block)


@dataclass
class SequenceKV:
    """What one sequence holds in one model's pool: its block table and how many tokens are cached."""

    block_table: list[int] = field(default_factory=list)
    num_cached: int = 0

    def blocks_needed(self, new_length: int, block_size: int) -> int:
        return max(0, -(-new_length // block_size) - len(self.block_table))

    def reserve(self, new_length: int, allocator: BlockAllocator, block_size: int) -> None:
        """Make room for ``new_length`` tokens; all-or-nothing so a failure leaves the table unchanged."""
        needed = self.blocks_needed(new_length, block_size)
        if needed > allocator.num_free:
            raise OutOfBlocks(f"need {needed} KV blocks, {allocator.num_free} free")
        self.block_table.extend(allocator.allocate() for _ in range(needed))

    def truncate(self, length: int, allocator: BlockAllocator, block_size: int) -> None:
        """Forget every token from ``length`` on and give back blocks that held only those."""
        self.num_cached = min(self.num_cached, length)
        keep = -(-length // block_size)
        while len(self.block_table) > keep:
            allocator.release(self.block_table.pop())

    def free(self, allocator: BlockAllocator) -> None:
        self.truncate(0, allocator, 1)


class AttentionBatch:
    """Per-step attention metadata for a flat batch of new tokens from several sequences.

    The model hands each layer's q, k, v here; this writes the new keys and values
    into the pool and attends each sequence's queries to its own cached context.
    The model never sees block tables or scheduling.
    """

    def __init__(self, pool: KVPool, tables: list[list[int]], starts: list[int], lengths: list[int]) -> None:
        self.pool = pool
        self.starts, self.lengths = starts, lengths
        device = pool.k.device
        bs = pool.block_size
        new_slots, self.context_slots, self.masks = [], [], []
        for table, start, n in zip(tables, starts, lengths):
            total = start + n
            positions = torch.arange(total)
            slots = torch.tensor(table, dtype=torch.long)[positions // bs] * bs + positions % bs
            new_slots.append(slots[start:])
            self.context_slots.append(slots.to(device))
            if n == 1:
                mask = None
            else:
                # query i (absolute position start+i) sees keys 0..start+i
                mask = positions[None, :] <= (start + torch.arange(n))[:, None]
                mask = mask.to(device)
            self.masks.append(mask)
        self.slot_mapping = torch.cat(new_slots).to(device)
        self.positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lengths)]).to(device)
        self.single_context = len(lengths) == 1

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [T, H, D], k/v: [T, KVH, D] for the new tokens; returns [T, H, D]."""
        k_cache, v_cache = self.pool.k[layer], self.pool.v[layer]
        k_cache.index_copy_(0, self.slot_mapping, k)
        v_cache.index_copy_(0, self.slot_mapping, v)
        out = []
        offset = 0
        for n, slots, mask in zip(self.lengths, self.context_slots, self.masks):
            qs = q[offset:offset + n].transpose(0, 1)  # [H, n, D]
            ks = k_cache.index_select(0, slots).transpose(0, 1)  # [KVH, L, D]
            vs = v_cache.index_select(0, slots).transpose(0, 1)
            out.append(F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, enable_gqa=True).transpose(0, 1))
            offset += n
        return out[0] if self.single_context else torch.cat(out)
