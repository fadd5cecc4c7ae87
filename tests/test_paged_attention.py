"""The static step's paged attention (kv/paged_attention.py): the Triton kernel (under TRITON_INTERPRET=1 on the CPU,
natively on a GPU) and the torch fallback against a float64 reference that reads the cache position by position:
float32, bfloat16 and int8 caches, grouped query heads, verify passes of several queries, padding rows and padding
sequences, sliding windows, a head size that is not a power of two, block tables in any order."""
from __future__ import annotations

import pytest
import torch

from quickdraft.kv import paged_attention as paged
from quickdraft.kv.paged_attention import kernel_runs, paged_attention, paged_attention_torch
from quickdraft.kv.pool import KVPool

pytestmark = pytest.mark.skipif(not __import__("importlib").util.find_spec("triton"),
                                reason="needs triton (pip install triton)")

BLOCK = 16
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def interpreter(monkeypatch):
    """On a CPU the kernel runs in Triton's interpreter (conftest.py turns it on before Triton is imported)."""
    monkeypatch.setattr(paged, "KERNEL_ON_CPU", True)


def make_case(dtype: torch.dtype, heads: int, kv_heads: int, dim: int, contexts: list[int], query_lens: list[int],
              queries: int, seed: int = 0, unwritten: float = 0.0):
    """A pool holding random keys/values for each sequence's context, in shuffled blocks, and the step's tensors;
    every slot no sequence wrote holds ``unwritten``."""
    g = torch.Generator().manual_seed(seed)
    width = max(-(-c // BLOCK) for c in contexts) + 1
    num_blocks = len(contexts) * width + 1
    pool = KVPool(1, kv_heads, dim, num_blocks, BLOCK, dtype, DEVICE)
    for plane in pool.planes.values():
        plane.fill_(unwritten)
    order = torch.randperm(num_blocks - 1, generator=g).tolist()
    tables = torch.full((len(contexts), width), num_blocks - 1, dtype=torch.int32)
    keys, values = [], []
    act = torch.float32 if dtype == torch.int8 else dtype
    for b, ctx in enumerate(contexts):
        blocks = [order.pop() for _ in range(-(-ctx // BLOCK))]
        tables[b, :len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        k = torch.randn(ctx, kv_heads, dim, generator=g).to(act)
        v = torch.randn(ctx, kv_heads, dim, generator=g).to(act)
        if ctx:
            slots = torch.tensor([blocks[p // BLOCK] * BLOCK + p % BLOCK for p in range(ctx)])
            pool.write(0, slots.to(DEVICE), k.to(DEVICE), v.to(DEVICE))
            read_k, read_v = pool.read(0, slots.to(DEVICE), torch.float64)  # what the cache holds (int8: rounded)
            keys.append(read_k.cpu())
            values.append(read_v.cpu())
        else:
            keys.append(torch.zeros(0, kv_heads, dim, dtype=torch.float64))
            values.append(torch.zeros(0, kv_heads, dim, dtype=torch.float64))
    q = torch.randn(len(contexts) * queries, heads, dim, generator=g).to(act)
    return (pool, q.to(DEVICE), tables.to(DEVICE), torch.tensor(contexts, dtype=torch.int32, device=DEVICE),
            torch.tensor(query_lens, dtype=torch.int32, device=DEVICE), keys, values)


def reference(q, keys, values, contexts, query_lens, queries, scale, window, softcap=None):
    """Float64, one row at a time: row i of sequence b sees positions up to ctx - qlen + min(i, qlen - 1); scores
    soft-capped to ``softcap * tanh(s / softcap)`` where given."""
    heads, dim = q.shape[1:]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for b, (ctx, qlen) in enumerate(zip(contexts, query_lens)):
        group = heads // keys[b].shape[1]
        for i in range(queries):
            last = ctx - qlen + min(i, qlen - 1)
            first = 0 if not window else max(0, last - window + 1)
            if last < first:
                continue
            for h in range(heads):
                k = keys[b][first:last + 1, h // group]
                v = values[b][first:last + 1, h // group]
                scores = (k @ q[b * queries + i, h].double().cpu()) * scale
                if softcap is not None:
                    scores = torch.tanh(scores / softcap) * softcap
                w = torch.softmax(scores, 0)
                out[b * queries + i, h] = w @ v
    return out


CASES = {  # name: (heads, kv_heads, dim, contexts, query_lens, queries, window)
    "decode": (4, 2, 64, [1, 17, 40, 16], [1, 1, 1, 1], 1, 0),
    "verify": (6, 2, 32, [5, 33, 64], [5, 3, 4], 5, 0),
    "padding": (4, 1, 64, [9, 0, 30], [2, 0, 4], 4, 0),
    "window": (4, 2, 32, [70, 100, 12], [1, 3, 2], 3, 24),
    "odd-head": (2, 1, 96, [20, 35], [1, 2], 2, 0),
    "many-groups": (16, 2, 32, [50, 3], [3, 3], 3, 0),  # 8 heads x 3 queries: two tiles of 16 rows
    # 128-wide heads: the kernel reads 32 keys (two blocks) a trip; several trips, a last one past the used blocks
    "long": (8, 2, 128, [150, 33, 16], [1, 2, 1], 2, 0),
    "long-window": (4, 1, 128, [200, 45], [3, 1], 3, 40),
    # longer than KEY_SPLITS tiles: each split program reads several tiles, a window's first in any of them
    "very-long": (4, 2, 128, [600, 300], [2, 1], 2, 0),
    "very-long-window": (4, 1, 128, [700, 500], [3, 2], 3, 300),
}
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 3e-2, torch.int8: 2e-5}


@pytest.mark.parametrize("impl", ["kernel", "kernel-split", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8], ids=["f32", "bf16", "int8"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_equals_float64_reference(case, dtype, impl):
    """``kernel-split``: the decode steps' kernel, each row's key tiles spread over KEY_SPLITS programs and merged."""
    heads, kv_heads, dim, contexts, query_lens, queries, window = CASES[case]
    pool, q, tables, ctx, qlens, keys, values = make_case(dtype, heads, kv_heads, dim, contexts, query_lens, queries)
    scale = dim ** -0.5
    cache = pool.layer(0)
    if impl.startswith("kernel"):
        assert kernel_runs(q, cache, BLOCK)
        splits = paged.KEY_SPLITS if impl == "kernel-split" else 1
        out = paged_attention(q, cache, tables, ctx, qlens, queries, BLOCK, scale, window, splits=splits)
    else:
        out = paged_attention_torch(q, cache, tables, ctx, qlens, queries, BLOCK, scale, window)
    assert out.dtype == q.dtype and out.shape == q.shape
    want = reference(q, keys, values, contexts, query_lens, queries, scale, window)
    tolerance = TOLERANCE[dtype]
    assert torch.isfinite(out).all()
    assert (out.double().cpu() - want).abs().max().item() < tolerance


@pytest.mark.parametrize("impl", ["kernel", "kernel-split", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.int8], ids=["f32", "int8"])
@pytest.mark.parametrize("case", ["verify", "window", "padding", "very-long-window"])
def test_soft_capped_scores_equal_float64_reference(case, dtype, impl):
    """Gemma 2's soft-capped scores in the kernel (split or not) and the torch fallback, with a cap that bends these
    scores (of up to ~4) a lot."""
    heads, kv_heads, dim, contexts, query_lens, queries, window = CASES[case]
    pool, q, tables, ctx, qlens, keys, values = make_case(dtype, heads, kv_heads, dim, contexts, query_lens, queries)
    scale, cap, cache = dim ** -0.5, 1.5, pool.layer(0)
    if impl == "torch":
        out = paged_attention_torch(q, cache, tables, ctx, qlens, queries, BLOCK, scale, window, softcap=cap)
    else:
        splits = paged.KEY_SPLITS if impl == "kernel-split" else 1
        out = paged_attention(q, cache, tables, ctx, qlens, queries, BLOCK, scale, window, splits=splits, softcap=cap)
    want = reference(q, keys, values, contexts, query_lens, queries, scale, window, cap)
    assert (out.double().cpu() - want).abs().max().item() < TOLERANCE[dtype]
    uncapped = reference(q, keys, values, contexts, query_lens, queries, scale, window)
    assert (want - uncapped).abs().max().item() > 100 * TOLERANCE[dtype]


@pytest.mark.parametrize("splits", [1, 8])
@pytest.mark.parametrize("case", ["decode", "long", "long-window", "padding"])
def test_what_no_sequence_wrote_never_enters(case, splits):
    """Slots past a sequence's keys in its last block, and blocks past its table's used ones in the kernel's last tile,
    hold NaN here: they are never read into the result."""
    heads, kv_heads, dim, contexts, query_lens, queries, window = CASES[case]
    pool, q, tables, ctx, qlens, keys, values = make_case(torch.float32, heads, kv_heads, dim, contexts, query_lens,
                                                          queries, unwritten=float("nan"))
    out = paged_attention(q, pool.layer(0), tables, ctx, qlens, queries, BLOCK, dim ** -0.5, window, splits=splits)
    want = reference(q, keys, values, contexts, query_lens, queries, dim ** -0.5, window)
    assert (out.double().cpu() - want).abs().max().item() < 2e-5


def test_kernel_and_torch_agree_in_float32():
    """The two implementations the step may take compute the same values (float32: within 1e-5)."""
    heads, kv_heads, dim, contexts, query_lens, queries, window = CASES["verify"]
    pool, q, tables, ctx, qlens, *_ = make_case(torch.float32, heads, kv_heads, dim, contexts, query_lens, queries, 3)
    a = paged_attention(q, pool.layer(0), tables, ctx, qlens, queries, BLOCK, 0.2)
    b = paged_attention_torch(q, pool.layer(0), tables, ctx, qlens, queries, BLOCK, 0.2)
    assert (a - b).abs().max().item() < 1e-5


def test_kernel_needs_a_tile_sized_block(monkeypatch):
    pool, q, *_ = make_case(torch.float32, 2, 1, 32, [4], [1], 1)
    assert not kernel_runs(q, pool.layer(0), 8)  # tl.dot's smallest tile is 16 keys
    assert not kernel_runs(q, pool.layer(0), 24)
    if DEVICE == "cpu":
        monkeypatch.setattr(paged, "KERNEL_ON_CPU", False)
        assert not kernel_runs(q, pool.layer(0), BLOCK)  # the CPU's static step takes torch's attention


@pytest.mark.parametrize("splits", [1, 8])
@pytest.mark.parametrize("window,ctx", [(0, 150), (21, 150), (37, 150), (0, 600), (301, 700)])
def test_a_row_gets_the_same_bits_in_a_verify_pass_as_alone(window, ctx, splits):
    """Greedy speculation's exactness on the GPU: a query's result may not depend on the other rows of its pass. Each
    row of a 3-query verify pass equals, bit for bit, the same query decoded alone at its position (keys are read in
    tiles at fixed positions, whatever the window's first key of the pass is, and split the same way). The windows
    put the rows' first keys in two blocks; 600-700 keys give each split several tiles."""
    heads, kv_heads, dim = 4, 1, 128
    pool, q, tables, _, _, *_ = make_case(torch.float32, heads, kv_heads, dim, [ctx], [3], 3, seed=5)
    cache = pool.layer(0)
    args = dict(cache=cache, block_tables=tables, block_size=BLOCK, scale=dim ** -0.5, window=window, splits=splits)
    together = paged_attention(q, queries=3, context_lens=torch.tensor([ctx], dtype=torch.int32, device=DEVICE),
                               query_lens=torch.tensor([3], dtype=torch.int32, device=DEVICE), **args)
    for i in range(3):
        alone = paged_attention(q[i:i + 1], queries=1,
                                context_lens=torch.tensor([ctx - 2 + i], dtype=torch.int32, device=DEVICE),
                                query_lens=torch.tensor([1], dtype=torch.int32, device=DEVICE), **args)
        assert torch.equal(alone, together[i:i + 1]), (window, i)


def test_splits_must_be_a_power_of_two():
    pool, q, tables, ctx, qlens, *_ = make_case(torch.float32, 2, 1, 32, [4], [1], 1)
    with pytest.raises(ValueError, match="splits must be a power of two, got 3"):
        paged_attention(q, pool.layer(0), tables, ctx, qlens, 1, BLOCK, 0.2, splits=3)


def test_the_split_programs_count_on_counters_they_leave_at_zero():
    """The last of a group's split programs merges their shares, counted on ``counters`` that it zeroes again: one
    buffer serves call after call (every layer of a step, every replay of its graph) and gives the same bits as a
    fresh one; a buffer too short or of another dtype is refused before the kernel runs."""
    heads, kv_heads, dim, contexts, query_lens, queries, window = CASES["verify"]
    pool, q, tables, ctx, qlens, keys, values = make_case(torch.float32, heads, kv_heads, dim, contexts, query_lens,
                                                          queries, 7)
    groups = paged.merge_groups(len(contexts), queries, heads, kv_heads)
    counters = torch.zeros(groups + 3, dtype=torch.int32, device=DEVICE)
    run = lambda **kw: paged_attention(q, pool.layer(0), tables, ctx, qlens, queries, BLOCK, 0.2, splits=8, **kw)
    fresh = run()
    for _ in range(2):
        assert torch.equal(run(counters=counters), fresh)
        assert not counters.any()
    want = reference(q, keys, values, contexts, query_lens, queries, 0.2, window)
    assert (fresh.double().cpu() - want).abs().max().item() < 2e-5
    strided = torch.zeros(2 * groups, dtype=torch.int32, device=DEVICE)[::2]
    for bad in (counters[:groups - 1], counters.long(), strided):
        with pytest.raises(ValueError, match=f"counters must be at least {groups} contiguous int32 zeros"):
            run(counters=bad)


@pytest.mark.skipif(DEVICE != "cuda",
                    reason="the interpreter runs programs one at a time: the order under test is a GPU's")
def test_many_groups_merge_right_launch_after_launch():
    """On a GPU the split programs of a group finish in any order and the last merges: 300 launches of a batch of 64
    decode rows (hundreds of groups) on one counters buffer, each bit for bit the first's, the buffer zero after."""
    contexts = [40 + 37 * i % 400 for i in range(64)]
    pool, q, tables, ctx, qlens, *_ = make_case(torch.bfloat16, 12, 2, 128, contexts, [1] * 64, 1, seed=9)
    counters = torch.zeros(paged.merge_groups(64, 1, 12, 2), dtype=torch.int32, device=DEVICE)
    run = lambda: paged_attention(q, pool.layer(0), tables, ctx, qlens, 1, BLOCK, 0.1, splits=8, counters=counters)
    first = run()
    outs = [run() for _ in range(300)]
    torch.cuda.synchronize()
    assert all(torch.equal(out, first) for out in outs)
    assert not counters.any()
