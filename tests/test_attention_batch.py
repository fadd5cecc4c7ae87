"""AttentionBatch (kv/attention.py) on a tiny pool, without a model: where new keys land, what each token attends
to, and that a token's result is bitwise the same whatever else shares its batch and however its prompt is
chunked at cell boundaries (what makes batched and speculative runs give the tokens of a plain run).

Head size 8 runs quickdraft's CPU kernel for single tokens where it builds; head size 6 is a layout it does not
take, so those run torch's per-bucket attention."""
from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from quickdraft.kv import AttentionBatch, KVPool, prefill_chunk
from quickdraft.kv.attention import PREFILL_CELL, ROWWISE_MAX_QUERIES, chunk_pieces

HEADS, KV_HEADS, BS, NUM_BLOCKS = 4, 2, 16, 40
PATHS = pytest.mark.parametrize("head_dim", [8, 6], ids=["kernel", "torch"])


@dataclass
class Seq:
    """One sequence's queries, keys and values at every position, and where its blocks are."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    table: list[int]


def make_seq(seed: int, table: list[int], head_dim: int, dtype: torch.dtype = torch.float32) -> Seq:
    g = torch.Generator().manual_seed(seed)
    length = len(table) * BS
    q, k, v = (torch.randn(length, h, head_dim, generator=g).to(dtype) for h in (HEADS, KV_HEADS, KV_HEADS))
    return Seq(q, k, v, table)


def make_pool(head_dim: int, dtype: torch.dtype = torch.float32) -> KVPool:
    """A pool full of noise: a token that reads a slot outside its own context gets a visibly wrong result."""
    pool = KVPool(1, KV_HEADS, head_dim, NUM_BLOCKS, BS, dtype, "cpu")
    g = torch.Generator().manual_seed(99)
    pool.k.copy_(torch.randn(pool.k.shape, generator=g) * 4)
    pool.v.copy_(torch.randn(pool.v.shape, generator=g) * 4)
    return pool


def slots_of(table: list[int], start: int, end: int) -> torch.Tensor:
    positions = torch.arange(start, end)
    return torch.tensor(table)[positions // BS] * BS + positions % BS


def run(pool: KVPool, batch: list[tuple[Seq, int, int]], chunks: list[int] | None = None,
        exact_below: int = 0) -> list[torch.Tensor]:
    """Cache each sequence's first ``start`` tokens, then attend its next ``length``; its output rows, one by one."""
    for seq, start, _ in batch:
        slots = slots_of(seq.table, 0, start)
        pool.k[0, slots], pool.v[0, slots] = seq.k[:start], seq.v[:start]
    attn = AttentionBatch(pool, [s.table for s, _, _ in batch], [start for _, start, _ in batch],
                          [n for _, _, n in batch], chunks, exact_below)
    q, k, v = (torch.cat([getattr(s, name)[start:start + n] for s, start, n in batch]) for name in "qkv")
    out = attn.attend(0, q, k, v)
    return list(out.split([n for _, _, n in batch]))


def reference(seq: Seq, start: int, length: int) -> torch.Tensor:
    """Each new token over exactly its own sequence's keys up to its position, in float64."""
    group, end = HEADS // KV_HEADS, start + length
    k = seq.k[:end].double().repeat_interleave(group, 1)
    v = seq.v[:end].double().repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", seq.q[start:end].double(), k) / math.sqrt(seq.q.shape[-1])
    future = torch.arange(end)[None, :] > torch.arange(start, end)[:, None]
    return torch.einsum("hqk,khd->qhd", scores.masked_fill(future, -math.inf).softmax(-1), v)


def test_slot_mapping_follows_each_block_table_from_its_cached_length():
    pool = KVPool(1, KV_HEADS, 8, 8, 4, torch.float32, "cpu")
    attn = AttentionBatch(pool, [[5, 2, 7], [1], [3, 0]], starts=[6, 0, 4], lengths=[3, 2, 1])
    assert attn.positions.tolist() == [6, 7, 8, 0, 1, 4]
    assert attn.slot_mapping.tolist() == [2 * 4 + 2, 2 * 4 + 3, 7 * 4 + 0, 1 * 4 + 0, 1 * 4 + 1, 0 * 4 + 0]
    k = torch.randn(6, KV_HEADS, 8)
    attn.attend(0, torch.randn(6, HEADS, 8), k, torch.randn(6, KV_HEADS, 8))
    assert torch.equal(pool.k[0, attn.slot_mapping], k)  # the new keys are written where they belong


@PATHS
def test_each_token_attends_to_exactly_its_own_sequence_context(head_dim):
    """A decode token, a long prompt chunk crossing a cell boundary, a short chunk and a fresh prompt together."""
    pool = make_pool(head_dim)
    batch = [(make_seq(1, [3, 9, 12, 0, 7, 30], head_dim), 70, 1),
             (make_seq(2, [4, 5, 6, 8, 10, 11, 13, 14], head_dim), 40, 60),
             (make_seq(3, [15, 16], head_dim), 17, 5),
             (make_seq(4, [20, 21], head_dim), 0, 20)]
    for (seq, start, n), out in zip(batch, run(pool, batch)):
        assert (out.double() - reference(seq, start, n)).abs().max() < 1e-5


@PATHS
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_sequence_gets_bitwise_the_same_output_alone_and_batched(head_dim, dtype):
    """Other sequences, other block ids and a longer padded context in the batch change nothing."""
    def seqs(tables: list[list[int]]) -> list[Seq]:
        return [make_seq(i, t, head_dim, dtype) for i, t in enumerate(tables)]

    spans = [(70, 1), (0, 100), (130, 5), (33, 2)]  # decode, prompt, drafts, short prompt piece
    chunks = [1, 100, 1, 2]
    tables = [list(range(5)), list(range(5, 12)), list(range(12, 21)), list(range(21, 24))]
    alone = [run(make_pool(head_dim, dtype), [(seq, *span)], [chunk])[0]
             for seq, span, chunk in zip(seqs(tables), spans, chunks)]
    moved = seqs([[30, 2, 31, 4, 1], [0, 39, 6, 38, 8, 9, 37], list(range(10, 19)), [36, 35, 34]])
    batched = run(make_pool(head_dim, dtype), [(seq, *span) for seq, span in zip(moved, spans)], chunks)
    for one, together in zip(alone, batched):
        assert torch.equal(one, together)


@PATHS
def test_a_prompt_chunked_at_cell_boundaries_matches_one_chunk_bitwise(head_dim):
    seq = make_seq(5, list(range(10)), head_dim, torch.bfloat16)
    whole = run(make_pool(head_dim, torch.bfloat16), [(seq, 0, 150)])[0]
    pool = make_pool(head_dim, torch.bfloat16)
    parts = [run(pool, [(seq, start, n)])[0] for start, n in ((0, 64), (64, 64), (128, 22))]
    assert torch.equal(whole, torch.cat(parts))


@PATHS
def test_below_exact_below_a_prompt_started_anywhere_gets_the_bits_of_one_chunk(head_dim):
    """What lets a cached prefix end at any block there: a prompt token below ``exact_below`` attends alone, so a
    prompt resumed mid-cell (after a cached prefix, or a decoded answer) gets the bits of the prompt in one chunk;
    past it the pieces start on cells as before."""
    seq = make_seq(5, list(range(10)), head_dim, torch.bfloat16)
    exact = 2 * PREFILL_CELL
    whole = run(make_pool(head_dim, torch.bfloat16), [(seq, 0, 150)], exact_below=exact)[0]
    pool = make_pool(head_dim, torch.bfloat16)
    parts = [run(pool, [(seq, start, n)], exact_below=exact)[0] for start, n in ((0, 16), (16, 1), (17, 80), (97, 53))]
    assert torch.equal(whole, torch.cat(parts))
    assert (whole.double() - reference(seq, 0, 150)).abs().max() < 3e-2
    attn = AttentionBatch(make_pool(head_dim), [seq.table], [17], [200], exact_below=exact)
    assert [(first, end) for first, end, _, _ in attn.pieces] == [(exact - 17, exact + PREFILL_CELL - 17),
                                                                 (exact + PREFILL_CELL - 17, 200)]
    with pytest.raises(ValueError, match="exact_below must be a multiple of 64, got 100"):
        AttentionBatch(make_pool(head_dim), [seq.table], [0], [8], exact_below=100)


def test_chunk_pieces_cut_a_chunk_at_cell_boundaries():
    assert chunk_pieces(40, 100) == [(40, PREFILL_CELL), (PREFILL_CELL, 2 * PREFILL_CELL), (2 * PREFILL_CELL, 140)]
    assert chunk_pieces(PREFILL_CELL, PREFILL_CELL) == [(PREFILL_CELL, 2 * PREFILL_CELL)]
    assert chunk_pieces(5, 3) == [(5, 8)]
    assert chunk_pieces(5, 0) == []


def test_prefill_chunk_takes_everything_that_fits_else_stops_at_a_cell_boundary():
    assert prefill_chunk(0, 50, 100) == 50
    assert prefill_chunk(10, 100, 100) == 100
    assert prefill_chunk(0, 200, 100) == PREFILL_CELL
    assert prefill_chunk(10, 200, 100) == PREFILL_CELL - 10
    assert prefill_chunk(PREFILL_CELL, 300, 150) == 2 * PREFILL_CELL
    assert prefill_chunk(10, 200, 50) == 0  # no boundary in reach: wait for a step with more room


def test_long_pieces_attend_causally_and_the_rest_alone():
    """Pieces of more than ROWWISE_MAX_QUERIES tokens are one causal call; short pieces, decode tokens and drafts
    under verification (past ``chunks``) attend one by one."""
    pool = KVPool(1, KV_HEADS, 8, NUM_BLOCKS, BS, torch.float32, "cpu")
    tables = [list(range(10)), list(range(10, 12)), list(range(12, 18)), list(range(18, 20))]
    attn = AttentionBatch(pool, tables, starts=[40, 0, 48, 0], lengths=[100, 25, 40, ROWWISE_MAX_QUERIES],
                          chunks=[100, 20, 40, ROWWISE_MAX_QUERIES])
    assert [(first, end) for first, end, _, _ in attn.pieces] == [(0, 24), (24, 88), (100, 120), (141, 165)]
    singles = [*range(88, 100), *range(120, 125), *range(125, 141), *range(165, 165 + ROWWISE_MAX_QUERIES)]
    assert attn.items.rows.tolist() == singles
    # a sequence's single tokens are one group: its context is read once for all of them
    assert attn.items.group_first.tolist() == [0, 12, 17, 33, 33 + ROWWISE_MAX_QUERIES]
    _, _, slots, mask = attn.pieces[1]
    assert torch.equal(slots, slots_of(tables[0], 0, 2 * PREFILL_CELL))  # its whole context, cache included
    assert mask.shape == (PREFILL_CELL, 2 * PREFILL_CELL) and torch.equal(mask.sum(1), torch.arange(65, 129))
