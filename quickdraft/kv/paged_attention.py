"""Paged attention for a step of static shape: each sequence's new tokens (one in a decode step, k+1 in a verify
pass) attend to its context, read in place through its block table.

This is the attention of the graph-ready step (``static_step.py``). Its shapes depend only on the step's bucket
(sequences x queries per sequence) and the block table's width, and it reads nothing back to the host, so a CUDA
graph can capture it. The same math has two implementations:
- ``triton``: ``splits`` programs per (sequence, key/value head, 16 query rows), each reading every ``splits``-th
  tile of keys (flash-decoding: a decode step's few rows would otherwise keep two or three programs busy); the last
  of them to finish merges their shares, counted on a per-group counter it resets (no second kernel: a launch a
  layer fewer in a step bound by its launches). The query heads that share a key/value head
  (GQA) and all k+1 queries of a verify pass read each key block once, straight from the pool, in its format
  (float, or int8 with a scale per ``SCALE_GROUP`` values), and compute in float32: a decode step's attention is
  bound by the bytes it reads, not by its arithmetic (and the interpreter's bfloat16 ``tl.dot`` is wrong). It runs
  on the GPU, and on the CPU under ``TRITON_INTERPRET=1``, which is how CI checks it against a float64 reference
  without a GPU.
- ``torch``: gathers each sequence's whole block table and calls SDPA with a mask. The step falls back to it where
  Triton does not run (the CPU, a head or block size the kernel does not take).

Why Triton rather than FlexAttention: the kernel reads the block table itself, so the paged cache is attended in
place with no gather, and the one source runs under the interpreter on CI's CPU.

Row ``i`` of sequence ``b`` (of ``queries`` rows, ``query_lens[b]`` of them real) is the token at position
``context_lens[b] - query_lens[b] + i`` and sees keys up to that position (within ``window`` keys where given). A
padding row (``i >= query_lens[b]``) repeats the last real row's keys; a padding sequence (no keys) gives zeros.
"""
from __future__ import annotations

import functools
import os

import torch

from quickdraft.kv.attention import dot_product_attention, with_sinks
from quickdraft.models.native import CacheLayer, KV_SCALE_GROUP
from quickdraft.models.triton_linear import triton_available

triton = tl = None  # optional (pip install triton): imported by _kernel, on first use
_merge = None  # the kernel's helper (_merge_helper)

BLOCK_M = 16  # query rows per program: tl.dot's smallest tile
# Keys a program reads per trip through its loop, as values of a key tile (64 keys of a 64-wide head, 32 of a
# 128-wide one): each trip waits for its block numbers, then its keys, so a decode step's short loop over 16-key
# blocks was bound by those waits (about 14 us a layer on an H100 at 128-wide heads), not by the bytes.
TILE_VALUES = 4096
# Programs per group of rows of the static step (flash-decoding): a 1.5B model's decode has two key/value heads, so
# without splitting two programs read a layer's whole context one after the other. Every forward that must give a
# row the same bits (decode steps, verify passes, prompt chunks with drafts beside them) uses this one value.
KEY_SPLITS = 8
# Run the kernel on CPU tensors too, in Triton's interpreter (tests set it; Triton must have been first imported
# with TRITON_INTERPRET=1, since Triton reads it once: torch imports Triton itself when it is installed).
KERNEL_ON_CPU = False


def kernel_possible(block_size: int) -> bool:
    """Whether the kernel can run a pool of ``block_size`` on a GPU: Triton installed, and a block size that is a
    power of two of at least 16 (tl.dot's smallest tile). Where it cannot, the torch fallback reads every block of
    every table, which no graph of a long context should hold."""
    return triton_available() and block_size >= 16 and block_size & (block_size - 1) == 0


def kernel_runs(q: torch.Tensor, cache: CacheLayer, block_size: int) -> bool:
    """Whether the Triton kernel takes this step: Triton installed, a CUDA tensor (or a CPU one with
    ``KERNEL_ON_CPU`` and the interpreter on), a block size that is a power of two of at least 16 (tl.dot's smallest
    tile), a float or int8 cache."""
    interpreted = KERNEL_ON_CPU and q.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"
    on_device = q.is_cuda or interpreted
    return (on_device and kernel_possible(block_size) and q.stride(-1) == 1
            and cache.k.dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int8))


def query_last_keys(context_lens: torch.Tensor, query_lens: torch.Tensor, queries: int) -> torch.Tensor:
    """``[B, queries]``: the last key position each row sees (-1: none)."""
    rows = torch.arange(queries, device=context_lens.device)
    return (context_lens - query_lens)[:, None] + torch.minimum(rows[None, :], (query_lens - 1)[:, None])


def paged_attention(q: torch.Tensor, cache: CacheLayer, block_tables: torch.Tensor, context_lens: torch.Tensor,
                    query_lens: torch.Tensor, queries: int, block_size: int, scale: float, window: int = 0,
                    sinks: torch.Tensor | None = None, splits: int = 1, counters: torch.Tensor | None = None,
                    softcap: float | None = None) -> torch.Tensor:
    """q ``[B * queries, H, D]`` (rows of a sequence consecutive); block_tables ``[B, width]``; context_lens,
    query_lens ``[B]``. Returns ``[B * queries, H, D]`` in q's dtype. ``window`` 0: every earlier key. ``sinks``
    [H] (gpt-oss's attention sinks) take the torch path: a mixture of experts, the one family with them, runs
    its static step eagerly. ``splits`` (a power of two, the kernel only): programs per group of rows, each reading
    every ``splits``-th tile of keys, merged after (flash-decoding): a decode step's few rows then keep more of the
    GPU busy. A row's result depends on ``splits``, so every forward that must give a row's bits alike (the static
    step's decode steps, verify passes and prompt chunks) passes the same value (``KEY_SPLITS``). ``counters``:
    int32 zeros, at least ``merge_groups`` of them, that the split kernel counts its finished programs on and leaves
    at zero (a CUDA graph's step keeps one buffer for every layer: ``static_step.py``); None: made for this call.
    ``softcap``: each score (after the scale) soft-capped to ``softcap * tanh(s / softcap)`` (Gemma 2)."""
    if splits < 1 or splits & (splits - 1):
        raise ValueError(f"splits must be a power of two, got {splits}")
    if sinks is None and kernel_runs(q, cache, block_size):
        return _triton_attention(q, cache, block_tables, context_lens, query_lens, queries, block_size, scale, window,
                                 splits, counters, softcap)
    return paged_attention_torch(q, cache, block_tables, context_lens, query_lens, queries, block_size, scale, window,
                                 sinks, softcap)


def paged_attention_torch(q: torch.Tensor, cache: CacheLayer, block_tables: torch.Tensor, context_lens: torch.Tensor,
                          query_lens: torch.Tensor, queries: int, block_size: int, scale: float, window: int = 0,
                          sinks: torch.Tensor | None = None, softcap: float | None = None) -> torch.Tensor:
    """The same attention as the kernel with torch ops of static shape (reads every block of every table)."""
    batch, width = block_tables.shape
    tokens, heads, dim = q.shape
    kv_heads = cache.k.shape[1]
    group = heads // kv_heads
    slots = (block_tables.long()[:, :, None] * block_size
             + torch.arange(block_size, device=q.device)).reshape(batch, width * block_size)
    k, v = cache.k[slots], cache.v[slots]  # [B, L, KVH, D]
    if cache.k_scale is not None:
        k = (k.float().unflatten(-1, (-1, KV_SCALE_GROUP)) * cache.k_scale[slots][..., None]).flatten(-2)
        v = (v.float().unflatten(-1, (-1, KV_SCALE_GROUP)) * cache.v_scale[slots][..., None]).flatten(-2)
    k, v = k.to(q.dtype), v.to(q.dtype)
    last = query_last_keys(context_lens, query_lens, queries)  # [B, Q]
    key = torch.arange(width * block_size, device=q.device)
    mask = key[None, None, :] <= last[:, :, None]
    if window:
        mask &= key[None, None, :] > last[:, :, None] - window
    mask = mask.repeat_interleave(group, dim=1)[:, None]  # [B, 1, Q*G, L]: rows in (query, head of group) order
    qs = q.view(batch, queries, kv_heads, group, dim).permute(0, 2, 1, 3, 4).reshape(batch, kv_heads,
                                                                                    queries * group, dim)
    k, v, bias = k.transpose(1, 2), v.transpose(1, 2), mask
    if sinks is not None:  # each row's head: rows are (query, head of the group) of each key/value head
        rows = sinks.view(kv_heads, 1, group).expand(kv_heads, queries, group).reshape(1, kv_heads, -1, 1)
        k, v, bias = with_sinks(k, v, mask, rows)
    o = dot_product_attention(qs, k, v, bias, scale, softcap)
    o = torch.where(mask.any(-1, keepdim=True), o, 0)  # a row with no keys: zeros, as the kernel
    return o.view(batch, kv_heads, queries, group, dim).permute(0, 2, 1, 3, 4).reshape(tokens, heads, dim)


def merge_groups(batch: int, queries: int, heads: int, kv_heads: int) -> int:
    """How many groups of split programs (each merging its own rows) a call of ``batch`` sequences of ``queries``
    rows has: the counters it needs."""
    return batch * kv_heads * -(-queries * (heads // kv_heads) // BLOCK_M)


def _triton_attention(q: torch.Tensor, cache: CacheLayer, block_tables: torch.Tensor, context_lens: torch.Tensor,
                      query_lens: torch.Tensor, queries: int, block_size: int, scale: float, window: int,
                      splits: int, counters: torch.Tensor | None, softcap: float | None) -> torch.Tensor:
    tokens, heads, dim = q.shape
    kv_heads = cache.k.shape[1]
    group = heads // kv_heads
    batch = block_tables.shape[0]
    if splits > 1:
        groups = merge_groups(batch, queries, heads, kv_heads)
        if counters is None:
            counters = torch.zeros(groups, dtype=torch.int32, device=q.device)
        elif (counters.dtype != torch.int32 or counters.numel() < groups or counters.device != q.device
              or not counters.is_contiguous()):
            raise ValueError(f"counters must be at least {groups} contiguous int32 zeros on {q.device}, got "
                             f"{counters.numel()} {counters.dtype} on {counters.device}")
    else:
        counters = context_lens  # (unread)
    out = torch.empty_like(q)
    quantized = cache.k_scale is not None
    scales = (cache.k_scale, cache.v_scale) if quantized else (cache.k, cache.v)  # unread placeholders
    block_d = max(16, 1 << (dim - 1).bit_length())
    # each split's share of every row (running max and sum, weighted values), merged by the group's last program
    parts = (torch.empty(tokens, heads, splits, block_d, dtype=torch.float32, device=q.device),
             torch.empty(tokens, heads, splits, 2, dtype=torch.float32, device=q.device)) if splits > 1 else (out, out)
    # the rows per sequence are an argument, not a constant: prompt chunks of every length (static_step.run_chunks)
    # share the kernel compiled for decode and verify steps (Triton specializes an int only on 1 and multiples of 16)
    grid = (batch, kv_heads, -(-queries * group // BLOCK_M) * splits)
    attend = _kernel()
    attend[grid](
        q, cache.k, cache.v, scales[0], scales[1], out, block_tables, context_lens, query_lens,
        q.stride(0), q.stride(1), cache.k.stride(0), cache.k.stride(1), scales[0].stride(0), scales[0].stride(1),
        out.stride(0), out.stride(1), block_tables.stride(0), scale, queries, parts[0], parts[1], heads, counters,
        softcap or 1.0, SOFTCAP=softcap is not None, GROUP=group, HEAD_DIM=dim, BLOCK_D=block_d, BLOCK_SIZE=block_size,
        TILE=max(block_size, TILE_VALUES // block_d), BLOCK_M=BLOCK_M, WINDOW=window, INT8=quantized,
        SCALE_GROUP=KV_SCALE_GROUP, SPLITS=splits)
    return out


@functools.cache
def _kernel():
    """Triton imported and the kernel defined on first use: a CPU process never imports it. Triton reads
    ``TRITON_INTERPRET`` when it is first imported; the interpreter finds ``tl`` among the kernel's globals."""
    global triton, tl
    import triton
    import triton.language as tl
    _merge_helper()

    @triton.jit
    def paged_attention_kernel(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, out_ptr, tables_ptr, ctx_ptr, qlen_ptr,
                               stride_qt, stride_qh, stride_ks, stride_kh, stride_ss, stride_sh, stride_ot, stride_oh,
                               stride_table, scale, queries, part_acc_ptr, part_ml_ptr, HEADS, counter_ptr, softcap,
                               SOFTCAP: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                               BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr,
                               BLOCK_M: tl.constexpr, WINDOW: tl.constexpr, INT8: tl.constexpr, SCALE_GROUP: tl.constexpr,
                               SPLITS: tl.constexpr):
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2) % SPLITS
        m = tl.program_id(2) // SPLITS * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = m < queries * GROUP
        query = m // GROUP
        head = kv_head * GROUP + m % GROUP
        ctx = tl.load(ctx_ptr + seq).to(tl.int32)
        qlen = tl.load(qlen_ptr + seq).to(tl.int32)
        last = ctx - qlen + tl.minimum(query, qlen - 1)  # the last key each row sees
        d = tl.arange(0, BLOCK_D)
        d_ok = d < HEAD_DIM
        token = (seq * queries + query).to(tl.int64)
        q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        m_i = tl.full([BLOCK_M], -1e30, tl.float32)  # finite: a block where a row sees nothing gives p = 0, not NaN
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        end = tl.max(tl.where(row_ok, last, -1), 0) + 1
        first = 0
        if WINDOW > 0:
            first = tl.maximum(tl.min(tl.where(row_ok, last, 1 << 30), 0) - WINDOW + 1, 0)
        offs = tl.arange(0, TILE)  # a tile of TILE // BLOCK_SIZE blocks a step: fewer trips through the loop
        # tiles at fixed positions (multiples of TILE): a row's sums then group its keys the same way in a decode step
        # and in a verify pass, whose window starts at an earlier key (greedy speculation's exactness). With SPLITS
        # programs per rows, this one takes every SPLITS-th tile, from the first whose number is ``split`` mod SPLITS
        tile = first // TILE
        tile += (split - tile % SPLITS + SPLITS) % SPLITS
        block = tile * (TILE // BLOCK_SIZE)
        blocks = tl.cdiv(end, BLOCK_SIZE)
        # a while loop: Triton's interpreter cannot take a loaded bound in range(); compiled, both are a loop
        while block < blocks:
            key = block * BLOCK_SIZE + offs
            # a tile's last blocks may lie past the table's used ones, and a block's last slots past its keys: what
            # they hold (anything, NaN too) is never loaded, since a zero weight times NaN would still be NaN
            held = key < end
            physical = tl.load(tables_ptr + seq * stride_table + block + offs // BLOCK_SIZE, mask=held,
                               other=0).to(tl.int64)
            slot = physical * BLOCK_SIZE + offs % BLOCK_SIZE
            kv_offsets = slot[:, None] * stride_ks + kv_head * stride_kh + d[None, :]
            kv_ok = held[:, None] & d_ok[None, :]
            k = tl.load(k_ptr + kv_offsets, mask=kv_ok, other=0.0)
            v = tl.load(v_ptr + kv_offsets, mask=kv_ok, other=0.0)
            if INT8:
                scale_offsets = slot[:, None] * stride_ss + kv_head * stride_sh + d[None, :] // SCALE_GROUP
                k = k.to(tl.float32) * tl.load(ks_ptr + scale_offsets, mask=kv_ok, other=0.0)
                v = v.to(tl.float32) * tl.load(vs_ptr + scale_offsets, mask=kv_ok, other=0.0)
            k = k.to(tl.float32)
            v = v.to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
            if SOFTCAP:  # softcap * tanh(s / softcap) (Gemma 2), tanh|y| = (1 - e) / (1 + e), e = exp(-2|y|) <= 1
                e = tl.exp(-2.0 * tl.abs(s / softcap))
                s = tl.where(s < 0, -softcap, softcap) * (1.0 - e) / (1.0 + e)
            seen = key[None, :] <= last[:, None]
            if WINDOW > 0:
                seen = seen & (key[None, :] > last[:, None] - WINDOW)
            s = tl.where(seen, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
            m_i = m_new
            block += SPLITS * (TILE // BLOCK_SIZE)
        if SPLITS == 1:
            o = acc / tl.maximum(l_i, 1e-30)[:, None]
            tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                     o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
        else:  # this split's share of each row (its running max, sum and weighted values); the last split merges
            at = (token * HEADS + head) * SPLITS + split
            tl.store(part_ml_ptr + at * 2, m_i, mask=row_ok)
            tl.store(part_ml_ptr + at * 2 + 1, l_i, mask=row_ok)
            tl.store(part_acc_ptr + at[:, None] * BLOCK_D + d[None, :], acc, mask=row_ok[:, None])
            # every thread's shares stored before the count (a CUTLASS semaphore's order: the block's barrier, then
            # one release at the GPU's scope); the program that counts the group's last merges, acquiring first
            groups = tl.num_programs(2) // SPLITS
            at_counter = counter_ptr + (seq * tl.num_programs(1) + kv_head) * groups + tl.program_id(2) // SPLITS
            tl.debug_barrier()
            if tl.atomic_add(at_counter, 1, sem="acq_rel", scope="gpu") == SPLITS - 1:
                tl.store(at_counter, 0)  # zero again for the next launch (or the graph's next replay)
                _merge(part_acc_ptr, part_ml_ptr, out_ptr, token, head, d, row_ok, d_ok, stride_ot, stride_oh, HEADS,
                       BLOCK_M, BLOCK_D, SPLITS)

    return paged_attention_kernel


@functools.cache
def _merge_helper() -> None:
    """The merge of a split group's shares, a module global (where the interpreter looks for it)."""
    global _merge

    @triton.jit
    def _merge(part_acc_ptr, part_ml_ptr, out_ptr, token, head, d, row_ok, d_ok, stride_ot, stride_oh, HEADS,
               BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, SPLITS: tl.constexpr):
        """Rows ``(token, head)`` from their ``SPLITS`` shares, in split order (log-sum-exp). A split that saw none
        of a row's keys holds (-1e30, 0, 0) and adds exact zeros; a row that saw no key at all gives zeros. Read
        past the L1 cache (``.cg``): the shares are other programs' writes."""
        first = (token * HEADS + head) * SPLITS
        top = tl.load(part_ml_ptr + first * 2, mask=row_ok, other=0.0, cache_modifier=".cg")
        for s in tl.static_range(1, SPLITS):
            top = tl.maximum(top, tl.load(part_ml_ptr + (first + s) * 2, mask=row_ok, other=0.0,
                                          cache_modifier=".cg"))
        total = tl.zeros_like(top)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for s in tl.static_range(SPLITS):
            at = first + s
            weight = tl.exp(tl.load(part_ml_ptr + at * 2, mask=row_ok, other=0.0, cache_modifier=".cg") - top)
            total += weight * tl.load(part_ml_ptr + at * 2 + 1, mask=row_ok, other=0.0, cache_modifier=".cg")
            acc += weight[:, None] * tl.load(part_acc_ptr + at[:, None] * BLOCK_D + d[None, :], mask=row_ok[:, None],
                                             other=0.0, cache_modifier=".cg")
        o = acc / tl.maximum(total, 1e-30)[:, None]
        tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
