"""quickdraft's attention kernel (models/attention.c) against a float64 reference, on random shapes: GQA ratios,
head sizes, contexts from 1 position to several partitions, block boundaries, verify groups of k+1 queries, each
cache format, and sliding windows. Also what speculation relies on: a query's bits do not depend on its batch, its
group or the thread count, with or without a window."""
from __future__ import annotations

import random

import pytest
import torch

from quickdraft.kv.pool import KVPool, dequantize_int8, quantize_int8
from quickdraft.models import native

pytestmark = pytest.mark.skipif(not native.available(), reason="quickdraft's CPU kernels are not built here")
BLOCK = 16


def make_case(rng: random.Random, heads: int, kv_heads: int, dim: int, fmt: torch.dtype, groups: list[int],
              longest: int, act: torch.dtype = torch.bfloat16):
    """A pool with random keys/values for len(groups) sequences; sequence s verifies groups[s] queries ending at a
    random length <= longest. Returns the pool, q, AttnItems and each item's (sequence, length)."""
    blocks_per_seq = -(-longest // BLOCK)
    pool = KVPool(1, kv_heads, dim, blocks_per_seq * len(groups) + 1, BLOCK, fmt, "cpu")
    order = list(range(1, blocks_per_seq * len(groups) + 1))
    rng.shuffle(order)  # block tables scattered over the pool
    tables = [order[s * blocks_per_seq:(s + 1) * blocks_per_seq] for s in range(len(groups))]
    slots_of = [torch.tensor([t[p // BLOCK] * BLOCK + p % BLOCK for p in range(blocks_per_seq * BLOCK)])
                for t in tables]
    for s in range(len(groups)):
        k = torch.randn(blocks_per_seq * BLOCK, kv_heads, dim) * 2
        k[:, :, rng.randrange(dim)] += 20  # an outlier channel, as Qwen's keys have
        pool.write(0, slots_of[s], k.to(act), torch.randn(blocks_per_seq * BLOCK, kv_heads, dim).to(act))
    items, rows_slots, lengths, group_first = [], [], [], [0]
    for s, n in enumerate(groups):
        end = rng.randint(n, longest)
        for length in range(end - n + 1, end + 1):
            items.append((s, length))
            rows_slots.append(slots_of[s])
            lengths.append(length)
        group_first.append(len(items))
    q = torch.randn(len(items), heads, dim).to(act)
    its = native.AttnItems(torch.arange(len(items)), torch.stack(rows_slots), torch.tensor(lengths),
                           torch.tensor(group_first))
    return pool, q, its, items


def reference(pool: KVPool, q: torch.Tensor, its: native.AttnItems, window: int = 0,
              sinks: torch.Tensor | None = None, softcap: float | None = None) -> torch.Tensor:
    k_all, v_all = pool.read(0, its.slots, torch.float64)  # dequantized exactly (int8 * float32 scale)
    heads, dim = q.shape[1:]
    out = torch.empty(len(its.lengths), heads, dim, dtype=torch.float64)
    for r, length in enumerate(its.lengths.tolist()):
        first = max(0, length - window) if window else 0
        k, v = k_all[r, first:length], v_all[r, first:length]
        group = heads // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)  # [L, H, D]
        scores = torch.einsum("hd,lhd->hl", q[r].double(), k) * dim ** -0.5
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        if sinks is not None:  # one more logit per head, whose value is zero
            scores = torch.cat([scores, sinks.double()[:, None]], dim=1)
            v = torch.cat([v, torch.zeros_like(v[:1])])
        out[r] = torch.einsum("hl,lhd->hd", scores.softmax(-1), v)
    return out


def run(pool: KVPool, q: torch.Tensor, its: native.AttnItems, window: int = 0,
        sinks: torch.Tensor | None = None, softcap: float | None = None) -> torch.Tensor:
    out = torch.empty_like(q)
    native.attend(q, pool.layer(0), its, out, q.shape[-1] ** -0.5, window, sinks, softcap)
    return out


def alone(pool: KVPool, q: torch.Tensor, its: native.AttnItems, r: int, window: int = 0,
          softcap: float | None = None) -> torch.Tensor:
    """Item r's result when its query attends alone, as a decode step computes it."""
    one = native.AttnItems(torch.tensor([0]), its.slots[r:r + 1].contiguous(), its.lengths[r:r + 1],
                           torch.tensor([0, 1]))
    return run(pool, q[r:r + 1].contiguous(), one, window, softcap=softcap)[0]


SHAPES = [(14, 2, 64), (12, 2, 128), (8, 8, 64), (16, 1, 32), (9, 3, 64), (32, 4, 128), (8, 2, 256)]


@pytest.mark.parametrize("fmt", [torch.float32, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("shape", SHAPES)
def test_matches_float64_reference(shape, fmt):
    heads, kv_heads, dim = shape
    rng = random.Random(hash((shape, str(fmt))) % 1000)
    act = torch.float32 if fmt == torch.float32 else torch.bfloat16
    for groups, longest in (([1], 1), ([1, 1, 1], 40), ([5, 1, 3], 300), ([2, 1], 2600)):  # up to 3 partitions
        pool, q, its, _ = make_case(rng, heads, kv_heads, dim, fmt, groups, longest, act)
        got, want = run(pool, q, its).double(), reference(pool, q, its)
        # float32 out: float32 sums; bfloat16 out: one rounding of the result
        tol = 2e-5 if act == torch.float32 else 8e-3
        assert (got - want).abs().max() <= tol * max(1.0, want.abs().max()), (groups, longest)


@pytest.mark.parametrize("fmt", [torch.bfloat16, torch.int8])
def test_a_query_gets_the_same_bits_in_any_batch_group_or_thread_count(fmt):
    rng = random.Random(7)
    pool, q, its, items = make_case(rng, 14, 2, 64, fmt, [4, 1, 6, 2], 2200)
    together = run(pool, q, its)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one_thread = run(pool, q, its)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(together, one_thread)
    for r in range(len(items)):  # each query alone, as a decode step computes it
        assert torch.equal(alone(pool, q, its, r), together[r]), items[r]


# windows below a tile, within a partition, across one boundary (1024) and across several, and covering it all
WINDOWS = [1, 7, 100, 1000, 1030, 2100, 4000]


@pytest.mark.parametrize("fmt", [torch.float32, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("shape", [(14, 2, 64), (8, 8, 128), (9, 3, 32)])
def test_window_matches_float64_reference(shape, fmt):
    """A row of length L sees positions L - window .. L - 1 only."""
    heads, kv_heads, dim = shape
    rng = random.Random(hash((shape, str(fmt), "window")) % 1000)
    act = torch.float32 if fmt == torch.float32 else torch.bfloat16
    for groups, longest in (([1, 1, 1], 40), ([5, 1, 3], 1100), ([2, 1, 4], 3300)):
        pool, q, its, _ = make_case(rng, heads, kv_heads, dim, fmt, groups, longest, act)
        for window in WINDOWS:
            got, want = run(pool, q, its, window).double(), reference(pool, q, its, window)
            tol = 2e-5 if act == torch.float32 else 8e-3
            assert (got - want).abs().max() <= tol * max(1.0, want.abs().max()), (groups, longest, window)


@pytest.mark.parametrize("fmt", [torch.float32, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("shape", [(14, 2, 64), (8, 8, 64)])
def test_sinks_match_float64_reference(shape, fmt):
    """gpt-oss's attention sinks: a logit per head in every row's softmax, with no value; across partitions (the
    merge adds the sink once) and with windows. Sinks of -inf change no bit, and a row's bits do not depend on its
    batch."""
    heads, kv_heads, dim = shape
    rng = random.Random(hash((shape, str(fmt), "sinks")) % 1000)
    act = torch.float32 if fmt == torch.float32 else torch.bfloat16
    sinks = torch.randn(heads, generator=torch.Generator().manual_seed(3)) * 2 + 6  # comparable to the scores
    for groups, longest in (([1, 1, 1], 40), ([5, 1, 3], 2600)):
        pool, q, its, items = make_case(rng, heads, kv_heads, dim, fmt, groups, longest, act)
        for window in (0, 100, 1030):
            got, want = run(pool, q, its, window, sinks).double(), reference(pool, q, its, window, sinks)
            tol = 2e-5 if act == torch.float32 else 8e-3
            assert (got - want).abs().max() <= tol * max(1.0, want.abs().max()), (groups, longest, window)
            assert (got - run(pool, q, its, window).double()).abs().max() > 10 * tol  # the sinks take mass
        assert torch.equal(run(pool, q, its, 0, torch.full((heads,), float("-inf"))), run(pool, q, its))
        assert torch.isnan(run(pool, q, its, 0, torch.full((heads,), float("nan")))).all()  # as torch's path
        together = run(pool, q, its, 0, sinks)
        one = native.AttnItems(torch.tensor([0]), its.slots[2:3].contiguous(), its.lengths[2:3], torch.tensor([0, 1]))
        alone = torch.empty_like(q[:1])
        native.attend(q[2:3].contiguous(), pool.layer(0), one, alone, dim ** -0.5, 0, sinks)
        assert torch.equal(alone[0], together[2]), items[2]


@pytest.mark.parametrize("fmt", [torch.float32, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("shape", [(14, 2, 64), (8, 8, 256)])
def test_soft_capped_scores_match_float64_reference(shape, fmt):
    """Gemma 2's soft-capped scores (cap * tanh(s / cap)), with caps that bend these scores of up to ~30 a lot (2) and
    a little (50), across partitions and with windows; a row's bits do not depend on its batch or verify group."""
    heads, kv_heads, dim = shape
    rng = random.Random(hash((shape, str(fmt), "softcap")) % 1000)
    act = torch.float32 if fmt == torch.float32 else torch.bfloat16
    tol = 2e-5 if act == torch.float32 else 8e-3
    for groups, longest in (([1, 1, 1], 40), ([5, 1, 3], 2600)):
        pool, q, its, items = make_case(rng, heads, kv_heads, dim, fmt, groups, longest, act)
        for window, cap in ((0, 2.0), (100, 50.0), (1030, 2.0), (0, 50.0)):
            got, want = run(pool, q, its, window, softcap=cap).double(), reference(pool, q, its, window, softcap=cap)
            assert (got - want).abs().max() <= tol * max(1.0, want.abs().max()), (groups, longest, window, cap)
            if cap == 2.0:  # a cap that changes the result
                assert (got - reference(pool, q, its, window)).abs().max() > 10 * tol
        together = run(pool, q, its, 100, softcap=2.0)
        for r in range(len(items)):
            assert torch.equal(alone(pool, q, its, r, 100, softcap=2.0), together[r]), items[r]


@pytest.mark.parametrize("fmt", [torch.float32, torch.bfloat16, torch.int8])
def test_a_windowed_query_gets_the_same_bits_alone_as_in_its_verify_group_and_batch(fmt):
    """Rows of one verify group start their windows in different partitions and tiles; each gets the bits it gets
    alone, whatever the other rows (and their groups) make the pass read."""
    rng = random.Random(11)
    act = torch.float32 if fmt == torch.float32 else torch.bfloat16
    pool, q, its, items = make_case(rng, 12, 2, 64, fmt, [6, 1, 4, 2], 3100, act)
    for window in (5, 33, 700, 1030, 2048):
        together = run(pool, q, its, window)
        for r in range(len(items)):
            assert torch.equal(alone(pool, q, its, r, window), together[r]), (items[r], window)


@pytest.mark.parametrize("fmt", [torch.bfloat16, torch.int8])
def test_a_window_covering_the_context_changes_no_bit(fmt):
    pool, q, its, _ = make_case(random.Random(5), 14, 2, 64, fmt, [4, 1, 3], 2500)
    whole = run(pool, q, its)
    longest = int(its.lengths.max())
    assert torch.equal(run(pool, q, its, longest), whole)
    assert torch.equal(run(pool, q, its, longest + 1000), whole)


@pytest.mark.parametrize("fmt", [torch.float32, torch.int8])
def test_keys_before_every_rows_window_are_not_read(fmt):
    """Positions before the tile of 32 where a group's earliest window starts are never read: poisoned with NaN,
    they change no bit (a read would spread the NaN, since 0 * NaN is NaN)."""
    pool, q, its, items = make_case(random.Random(9), 8, 2, 64, fmt, [3, 1], 3000, torch.float32)
    window = 900
    clean = run(pool, q, its, window)
    first = {}  # per sequence: the tile of its group's earliest window start
    for (seq, length) in items:
        start = max(0, length - window) // 32 * 32
        first[seq] = min(first.get(seq, start), start)
    for r, (seq, _) in enumerate(items):
        unread = its.slots[r, :first[seq]]
        if fmt == torch.int8:
            pool.k_scale[0][unread] = float("nan")
            pool.v_scale[0][unread] = float("nan")
        else:
            pool.k[0][unread] = float("nan")
            pool.v[0][unread] = float("nan")
    assert torch.equal(run(pool, q, its, window), clean)


def test_int8_store_matches_torch_quantizer_and_bounds_the_error():
    x = (torch.randn(37, 2, 64) * torch.logspace(-3, 2, 64)).to(torch.bfloat16)  # groups of very different sizes
    x[3] = 0  # an all-zero group gets scale 0, not NaN
    pool = KVPool(1, 2, 64, 4, BLOCK, torch.int8, "cpu")
    slots = torch.randperm(4 * BLOCK)[:37]
    native.kv_store(x, slots, pool.k[0], pool.k_scale[0])
    values, scales = quantize_int8(x)
    assert torch.equal(pool.k[0][slots], values) and torch.equal(pool.k_scale[0][slots], scales)
    back = dequantize_int8(values, scales, torch.float32)
    group_max = x.float().abs().unflatten(-1, (-1, 32)).amax(-1, keepdim=True).expand(-1, -1, -1, 32).flatten(-2)
    assert ((back - x.float()).abs() <= group_max / 254 * 1.0001).all()
    assert torch.equal(back[3], torch.zeros(2, 64))


def test_bad_arguments_are_refused_not_read_out_of_bounds():
    pool, q, its, _ = make_case(random.Random(1), 8, 2, 64, torch.bfloat16, [2], 50)
    for lengths in ([0, 1], [51, 52 + 1000]):
        bad = native.AttnItems(its.rows, its.slots, torch.tensor(lengths), its.group_first)
        with pytest.raises(RuntimeError, match="bad arguments"):
            run(pool, q, bad)
    with pytest.raises(RuntimeError, match="bad arguments"):
        run(pool, q, native.AttnItems(its.rows, its.slots, its.lengths, torch.tensor([0, 3])))
    with pytest.raises(RuntimeError, match="bad arguments"):
        run(pool, q, its, window=-1)
