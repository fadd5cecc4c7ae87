"""Memory: the KV caches take pages only as sequences use them and give them back, the plan refuses a configuration
that cannot fit before any weight is read, and the server reports (and returns) what it holds.

Resident KV memory is measured for real, from /proc/self/pagemap over the pool's storage: a page counts when it is
present and exclusively mapped (bits 63 and 56), so the shared zero page a read of an untouched page maps does not."""
from __future__ import annotations

import asyncio
import math
import mmap
import os
import struct
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from test_server import serve

from quickdraft import LLM, SamplingParams
from quickdraft.engine import build
from quickdraft.engine.memory import (
    KV_FREE_FRACTION,
    RUNTIME_BYTES,
    GiB,
    KVNeed,
    MemoryPlan,
    MiB,
    parse_size,
    plan_memory,
)
from quickdraft.errors import InvalidParameterError, QuickdraftError
from quickdraft.loading.quantize import load_model as real_load_model
from quickdraft.serving import AsyncEngine
from quickdraft.serving.metrics import parse_metrics

PAGE = mmap.PAGESIZE
GREEDY = {"temperature": 0.0, "ignore_eos": True}


# ---- measuring what the pool holds -------------------------------------------------------------------
def _pagemap_ok() -> bool:
    try:
        with open("/proc/self/pagemap", "rb") as f:
            f.read(8)
        return True
    except OSError:
        return False


needs_pagemap = pytest.mark.skipif(not _pagemap_ok(), reason="no readable /proc/self/pagemap")


def resident_pages(address: int, nbytes: int) -> int:
    """Pages of [address, address + nbytes) present in memory and mapped by this process alone (not the zero page)."""
    first, last = address // PAGE, (address + nbytes - 1) // PAGE
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(first * 8)
        data = f.read((last - first + 1) * 8)
    return sum(1 for e in struct.unpack(f"{len(data) // 8}Q", data) if e >> 63 & 1 and e >> 56 & 1)


def pool_resident(runner) -> int:
    """Bytes of a runner's KV pool (keys and values) in memory."""
    return sum(resident_pages(t.data_ptr(), t.numel() * t.element_size()) * PAGE for t in (runner.pool.k, runner.pool.v))


def pool_slack(runner) -> int:
    """What page rounding may add or take at the ends of each layer's run of blocks, keys and values."""
    layer_block = runner.bytes_per_block // (2 * runner.pool.k.shape[0])
    return 0 if layer_block % PAGE == 0 else 2 * 2 * runner.pool.k.shape[0] * PAGE


def check_resident(runner) -> int:
    """The pool holds the pages of the blocks below high_water (all written since they were handed out), no more."""
    resident, touched = pool_resident(runner), runner.kv_bytes_touched
    assert touched == runner.allocator.high_water * runner.bytes_per_block
    slack = pool_slack(runner)
    assert touched - slack <= resident <= touched + slack, (resident, touched, slack)
    return resident


def straddling_pages(runner) -> int:
    """Pages that hold the end of one layer's keys (or values) and the start of the next's."""
    layers = runner.pool.k.shape[0]
    layer_bytes = runner.pool.k[0].numel() * runner.pool.k.element_size()
    return 2 * sum(1 for layer in range(1, layers) if layer * layer_bytes % PAGE)


def check_released(runner) -> None:
    """Nothing is held: the pool gives back every page (but see
    test_release_gives_back_the_pages_straddling_two_layers for the pages on layer boundaries)."""
    alloc = runner.allocator
    assert alloc.high_water == 0 and alloc.num_free == alloc.num_blocks and alloc.cached_blocks == []
    assert runner.kv_bytes_used == 0 and runner.kv_bytes_touched == 0
    assert pool_resident(runner) <= straddling_pages(runner) * PAGE


def check_no_block_held(llm: LLM) -> None:
    """Nothing finished holds a block: only cached prefixes (free, reusable) remain below high_water."""
    for runner in llm.loaded.runners:
        alloc = runner.allocator
        assert alloc.num_used == 0 and alloc.num_free == alloc.num_blocks
        assert all(c == 0 for c in alloc.ref_counts)
        assert runner.kv_bytes_used == len(alloc.cached_blocks) * runner.bytes_per_block
        assert all(b < alloc.high_water for b in alloc.cached_blocks)
    assert not llm.engine.has_unfinished()


# ---- models ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tiny_dir) -> Path:
    """head_dim 32 in float32: one block of one layer's keys is exactly a 4 KiB page (the bound is then exact)."""
    return tiny_dir(arch="qwen2", vocab_size=64, hidden=128, heads=4, kv_heads=2, layers=2)


@pytest.fixture(scope="module")
def small(tiny_dir) -> Path:
    """head_dim 16: two blocks share a page."""
    return tiny_dir(arch="qwen2", vocab_size=64, layers=2)


def prompt(seed: int, length: int) -> list[int]:
    """Repetitive token ids (n-grams match) from 1..63."""
    base = [(seed * 7 + i * 13) % 63 + 1 for i in range(max(1, length // 3))]
    return (base * 4)[:length]


# ---- 1. grow with use, shrink on release, nothing leaked ------------------------------------------------
def workload(llm: LLM) -> tuple[list, list[int]]:
    """Several kinds of request, each batch checked for leaks and the resident bound; returns every output and
    the resident bytes after each batch."""
    runner = llm.target
    outputs, resident = [], []
    # a batch of different lengths, greedy
    params = [SamplingParams(max_tokens=m, **GREEDY) for m in (5, 30, 60)]
    outs = llm.generate([prompt(1, 3), prompt(2, 40), prompt(3, 150)], params)
    outputs.append([o.outputs[0].token_ids for o in outs])
    check_no_block_held(llm)
    resident.append(check_resident(runner))
    # n > 1 samples of one prompt (copy-on-write of the shared last block)
    outs = llm.generate(prompt(4, 70), SamplingParams(n=3, max_tokens=25, temperature=0.9, seed=11, ignore_eos=True))
    outputs.append([c.token_ids for c in outs[0].outputs])
    check_no_block_held(llm)
    resident.append(check_resident(runner))
    # streaming, the client leaves after two chunks (abort)
    stream = llm.stream(prompt(5, 90), SamplingParams(max_tokens=300, **GREEDY))
    outputs.append([t for _, chunk in zip(range(2), stream) for t in chunk.token_ids])
    assert runner.allocator.num_used > 0
    stream.close()
    check_no_block_held(llm)
    resident.append(check_resident(runner))
    # stepping the engine by hand: the bound holds at every step, and a request cancelled mid-way frees its blocks
    engine = llm.engine
    rids = [engine.add_request(prompt(10 + i, 20 + 45 * i), SamplingParams(max_tokens=10 + 15 * i, **GREEDY))
            for i in range(4)]
    cancelled = engine.add_request(prompt(20, 33), SamplingParams(max_tokens=400, **GREEDY))
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
        check_resident(runner)
        if steps == 3:
            assert runner.allocator.num_used > 0
            llm.cancel(cancelled)
    assert [s.finish_reason for s in engine.sequences(cancelled)] == ["abort"]
    outputs.append([engine.sequences(r)[0].token_ids for r in rids + [cancelled]])
    for rid in rids + [cancelled]:
        engine.release(rid)
    check_no_block_held(llm)
    resident.append(check_resident(runner))
    return outputs, resident


@needs_pagemap
@pytest.mark.parametrize("speculative", [None, "ngram"])
@pytest.mark.parametrize("model", ["tiny", "small"])
def test_kv_grows_with_use_and_release_gives_every_page_back(request, model, speculative):
    llm = LLM(str(request.getfixturevalue(model)), dtype="float32", speculative=speculative)
    runner = llm.target
    start = check_resident(runner)
    # nothing but the drafter's cost calibration (a few blocks) has run
    assert start <= 8 * runner.bytes_per_block + pool_slack(runner)
    assert runner.kv_bytes_cap == runner.allocator.num_blocks * runner.bytes_per_block > 100 * runner.bytes_per_block
    first, resident = workload(llm)
    assert resident[0] > start and max(resident) > 2 * max(start, runner.bytes_per_block)
    assert resident == sorted(resident)  # the pool only grows while requests come (cached prefixes are kept)
    assert max(resident) <= runner.kv_bytes_cap // 4  # far from the cap: pages are taken as used

    llm.release_memory()
    check_released(runner)
    assert llm.memory_summary.endswith("(0 MiB in use)")

    # the pages come back as zeros: the same requests give the same tokens (greedy and seeded)
    second, resident_again = workload(llm)
    assert second == first
    if speculative is None:  # (how far ahead n-gram drafts reserve depends on measured costs)
        assert resident_again == resident  # the same requests take the same blocks again
    llm.release_memory()
    check_released(runner)


@needs_pagemap
def test_release_gives_back_the_pages_straddling_two_layers(small):
    llm = LLM(str(small), dtype="float32", kv_cache_memory=521 * 8192)  # 521 blocks of 8 KiB: layers end mid-page
    assert straddling_pages(llm.target) == 2  # 2 layers of 8336 slots of 128 bytes: 260.5 pages each
    llm.generate(prompt(1, 40), SamplingParams(max_tokens=5, **GREEDY))
    llm.release_memory()
    assert llm.target.allocator.high_water == 0
    assert pool_resident(llm.target) == 0


@needs_pagemap
def test_release_keeping_the_prefix_cache_trims_above_it_and_the_prefix_still_hits(tiny):
    llm = LLM(str(tiny), dtype="float32")
    runner, alloc = llm.target, llm.target.allocator
    other, repeated = prompt(30, 200), prompt(31, 140)
    params = SamplingParams(max_tokens=20, **GREEDY)
    llm.generate(other, params)  # takes the low blocks, then stops being a cached prefix
    llm.reset_prefix_cache()
    [ref] = llm.generate(repeated, params)
    high = alloc.high_water
    assert pool_resident(runner) == high * runner.bytes_per_block
    cached = alloc.cached_blocks
    assert cached and max(cached) + 1 < high  # the repeated prompt sits in the low blocks

    llm.release_memory(keep_prefix_cache=True)
    assert alloc.cached_blocks == cached and alloc.high_water == max(cached) + 1
    assert pool_resident(runner) == alloc.high_water * runner.bytes_per_block < high * runner.bytes_per_block
    hits = llm.engine.prefix_cache_hits
    [again] = llm.generate(repeated, params)
    assert llm.engine.prefix_cache_hits >= hits + 128  # two 64-token prefill cells came from the cache
    assert again.outputs[0].token_ids == ref.outputs[0].token_ids
    check_no_block_held(llm)
    check_resident(runner)

    # without keep_prefix_cache (LLM's default) the prefix goes too, and the prompt is computed again
    llm.release_memory()
    assert alloc.high_water == 0 and pool_resident(runner) == 0
    hits = llm.engine.prefix_cache_hits
    [third] = llm.generate(repeated, params)
    assert llm.engine.prefix_cache_hits == hits
    assert third.outputs[0].token_ids == ref.outputs[0].token_ids


@needs_pagemap
def test_release_while_a_session_holds_its_kv_keeps_the_session_right(tiny):
    turns = [prompt(40, 50), prompt(41, 30), prompt(42, 20)]
    params = SamplingParams(max_tokens=12, **GREEDY)

    def run(release: bool) -> list[list[int]]:
        llm = LLM(str(tiny), dtype="float32")
        out = []
        with llm.session() as session:
            for turn in turns:
                llm.generate(prompt(43, 120), params)  # other traffic in blocks above the session's
                if release:
                    llm.release_memory()
                    check_resident(llm.target)
                    assert llm.target.allocator.num_used == (len(session.kv["target"].block_table) if out else 0)
                    assert llm.target.allocator.high_water > 0 or not out  # the session's blocks stay
                out.append(session.generate(turn, params).outputs[0].token_ids)
        check_no_block_held(llm)
        return out

    assert run(release=True) == run(release=False)


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_preemption_with_a_small_explicit_kv_cache_keeps_outputs(small, preemption):
    probe = LLM(str(small), dtype="float32", kv_cache_memory="1MiB", block_size=4)
    per_block = probe.target.bytes_per_block
    assert probe.target.kv_bytes_cap == (1 << 20) // per_block * per_block  # an explicit size is the cap
    del probe
    llm = LLM(str(small), dtype="float32", kv_cache_memory=f"{32 * per_block // 1024}KiB", block_size=4,
              max_num_seqs=8, preemption=preemption)
    assert llm.target.allocator.num_blocks == 32 and llm.loaded.memory.kv_caps == {"target": 32 * per_block}
    requests = [(prompt(50 + i, 20 + 5 * i), SamplingParams(max_tokens=30 + 3 * i, temperature=0.0 if i % 2 else 0.8,
                                                           seed=i, ignore_eos=True)) for i in range(6)]
    alone = [llm.generate(p, params)[0].outputs[0].token_ids for p, params in requests]
    assert llm.engine.scheduler.num_preemptions == 0
    llm.release_memory()
    together = llm.generate([p for p, _ in requests], [params for _, params in requests])
    assert [o.outputs[0].token_ids for o in together] == alone
    assert llm.engine.scheduler.num_preemptions > 0
    check_no_block_held(llm)
    llm.release_memory()
    if _pagemap_ok():
        check_released(llm.target)


# ---- 3. the server gives memory back when idle ---------------------------------------------------------
@needs_pagemap
def test_async_engine_gives_kv_memory_back_when_idle(tiny):
    llm = LLM(str(tiny), dtype="float32", speculative="ngram")
    aengine = AsyncEngine(llm, release_idle_s=0.3).start()

    async def complete(ids: list[int]) -> list[int]:
        out = []
        async for chunk in await aengine.generate(ids, SamplingParams(max_tokens=20, **GREEDY)):
            out.extend(chunk.token_ids)
        return out

    async def wait_released(timeout: float = 5.0) -> float:
        t0 = time.monotonic()
        while (await aengine.stats_async())["kv_bytes_resident"] and time.monotonic() - t0 < timeout:
            await asyncio.sleep(0.02)
        return time.monotonic() - t0

    async def run() -> None:
        first = await complete(prompt(60, 100))
        stats = await aengine.stats_async()
        assert stats["kv_bytes_resident"] > 0 and stats["kv_bytes_used"] > 0  # the prompt is a cached prefix
        assert stats["kv_bytes_resident"] == llm.target.kv_bytes_touched <= stats["kv_bytes_cap"]
        assert stats["kv_bytes_cap"] == llm.target.kv_bytes_cap
        waited = await wait_released()
        assert 0.15 < waited < 5.0
        stats = await aengine.stats_async()
        assert stats["kv_bytes_resident"] == 0 and stats["kv_bytes_used"] == 0 and stats["kv_blocks_used"] == 0
        assert pool_resident(llm.target) == 0
        # serving again takes memory again, gives the same tokens, and is given back again
        assert await complete(prompt(60, 100)) == first
        assert (await aengine.stats_async())["kv_bytes_resident"] > 0
        assert await wait_released() < 5.0
        assert pool_resident(llm.target) == 0

    try:
        asyncio.run(asyncio.wait_for(run(), 60))
    finally:
        aengine.shutdown()


def test_async_engine_keeps_memory_while_it_is_not_idle_long_enough(small):
    llm = LLM(str(small), dtype="float32")
    aengine = AsyncEngine(llm, release_idle_s=30.0).start()

    async def run() -> None:
        async for _ in await aengine.generate(prompt(61, 40), SamplingParams(max_tokens=5, **GREEDY)):
            pass
        await asyncio.sleep(0.4)  # a few idle polls
        assert (await aengine.stats_async())["kv_bytes_resident"] > 0

    try:
        asyncio.run(asyncio.wait_for(run(), 60))
    finally:
        aengine.shutdown()


# ---- 4. /metrics -------------------------------------------------------------------------------------------
def test_metrics_report_process_and_kv_memory(small, tiny_dir):
    draft = tiny_dir(arch="llama", vocab_size=64, layers=1, seed=3)
    with serve(small, "tiny", draft=str(draft), draft_weights="float32") as server:
        r = httpx.post(f"{server.url}/v1/completions",
                       json={"model": "tiny", "prompt": "t1 t2 t3 t4 t5 t1 t2 t3", "max_tokens": 16, "ignore_eos": True},
                       timeout=60)
        assert r.status_code == 200
        m = server.wait_idle()
        text = httpx.get(f"{server.url}/metrics", timeout=10).text
        assert set(parse_metrics(text)) == set(m)
        llm = server.app.state.llm
        runners = llm.loaded.runners
        assert len(runners) == 2  # the target's and the draft model's caches
        assert m["quickdraft_kv_cache_bytes_cap"] == sum(r.kv_bytes_cap for r in runners) > 0
        assert m["quickdraft_kv_cache_bytes_cap"] > 16 * MiB  # two caches of 16MiB each (to a block)
        assert 0 < m["quickdraft_kv_cache_bytes_used"] <= m["quickdraft_kv_cache_bytes_resident"]
        assert m["quickdraft_kv_cache_bytes_resident"] <= m["quickdraft_kv_cache_bytes_cap"]
        rss = m["process_resident_memory_bytes"]
        assert 50 * MiB < rss <= m["process_virtual_memory_bytes"]
        with open("/proc/self/status") as f:  # the server runs in this process
            vm_rss = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
        assert abs(rss - vm_rss) < max(64 * MiB, vm_rss // 4)
        assert m["process_cpu_seconds_total"] > 0
        assert time.time() - 24 * 3600 < m["process_start_time_seconds"] <= time.time()
        assert m["process_open_fds"] >= 3
        for name, kind in (("process_resident_memory_bytes", "gauge"), ("process_cpu_seconds_total", "counter"),
                           ("quickdraft_kv_cache_bytes_resident", "gauge")):
            assert f"# TYPE {name} {kind}" in text
        llm.release_memory()
        after = server.metrics()
        assert after["quickdraft_kv_cache_bytes_resident"] == after["quickdraft_kv_cache_bytes_used"] == 0
        assert after["quickdraft_kv_cache_bytes_cap"] == m["quickdraft_kv_cache_bytes_cap"]


# ---- 5. max_memory refuses before loading ----------------------------------------------------------------
@pytest.fixture
def no_loading(monkeypatch):
    """Make reading any weight an error: what must fail before loading fails with its own error."""
    def refuse(*args, **kwargs):
        raise AssertionError("weights were loaded")

    monkeypatch.setattr(build, "load_model", refuse)


def test_max_memory_too_small_for_smollm2_is_refused_before_loading(smollm2, no_loading):
    with pytest.raises(InvalidParameterError) as info:
        LLM("smollm2-135m", max_memory="300MiB")
    message = str(info.value)
    assert "max_memory=300MiB" in message and "too small" in message
    assert "weights take" in message and "MiB" in message and "allow at least" in message
    allow = float(message.split("allow at least ")[1].split(" MiB")[0]) * MiB
    assert 400 * MiB < allow < 700 * MiB  # ~100 MiB of weights, the runtime and a 2048-token sequence's KV
    with pytest.raises(AssertionError, match="weights were loaded"):  # enough memory: loading starts
        LLM("smollm2-135m", max_memory="64GiB")


def test_max_memory_on_the_command_line_fails_with_one_clear_line(smollm2):
    run = subprocess.run([sys.executable, "-m", "quickdraft.cli", "generate", "smollm2-135m", "hi", "--max-tokens",
                          "2", "--max-memory", "300MiB"], capture_output=True, text=True, timeout=300, check=False,
                         env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert run.returncode == 2 and run.stdout == ""
    assert "Traceback" not in run.stderr
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("error: max_memory=300MiB is too small") and len(lines) == 1, run.stderr


@pytest.mark.parametrize("flags", [["--max-memory", "abc"], ["--kv-cache-memory", "0"], ["--max-memory=-1GiB"]])
def test_bad_memory_flags_fail_with_one_clear_line(small, flags):
    run = subprocess.run([sys.executable, "-m", "quickdraft.cli", "generate", str(small), "t1", "--max-tokens", "2",
                          *flags], capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 2 and "Traceback" not in run.stderr
    name = flags[0].removeprefix("--").split("=")[0].replace("-", "_")
    assert run.stderr.strip().splitlines()[-1].startswith(f"error: {name} must be a positive size"), run.stderr


@pytest.mark.parametrize("value", ["0", "-1GiB", "1e400", "abc", True, False, "nanGiB", "infGiB", float("nan"),
                                   float("inf"), -5, 0, "", "1.5.5G", "2 GiBs", "99999999999T", "12 34", None.__class__.__name__])
@pytest.mark.parametrize("option", ["max_memory", "kv_cache_memory"])
def test_hostile_sizes_are_refused_before_loading(small, no_loading, option, value):
    with pytest.raises(InvalidParameterError, match=option):
        LLM(str(small), dtype="float32", **{option: value})


@pytest.mark.parametrize("option", ["max_memory", "kv_cache_memory"])
def test_a_size_too_long_for_a_float_is_refused(small, no_loading, option):
    with pytest.raises(InvalidParameterError, match=option):
        LLM(str(small), dtype="float32", **{option: "1" * 400})


def test_a_huge_int_kv_cache_memory_is_refused_before_loading(small, no_loading):
    with pytest.raises(InvalidParameterError, match="kv_cache_memory"):
        LLM(str(small), dtype="float32", kv_cache_memory=10**30)


def _machine_memory() -> int:
    with open("/proc/meminfo") as f:
        info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
    return info["MemTotal"] + info.get("SwapTotal", 0)


def test_a_kv_cap_above_the_machines_memory_loads_or_fails_clearly(small):
    cap = -(-2 * _machine_memory() // GiB)
    try:
        llm = LLM(str(small), dtype="float32", kv_cache_memory=f"{cap}GiB")
    except QuickdraftError:
        return  # refused with a clear error: fine
    assert llm.target.kv_bytes_cap > _machine_memory()  # reserved, not committed
    assert llm.generate(prompt(1, 10), SamplingParams(max_tokens=3, **GREEDY))[0].outputs[0].token_ids


@pytest.mark.parametrize("value", ["auto", "64MiB", "1GiB", 3 * MiB])
def test_good_kv_cache_memory_values_load(small, value):
    llm = LLM(str(small), dtype="float32", kv_cache_memory=value)
    assert llm.target.kv_bytes_cap > 0
    if value != "auto":
        cap = parse_size(value)
        assert cap - llm.target.bytes_per_block < llm.target.kv_bytes_cap <= cap


def test_max_memory_bounds_the_auto_kv_cap_at_the_smallest_that_fits(small, monkeypatch):
    """At exactly weights + runtime + one full sequence's KV it loads (with the smallest cap); one byte less, it
    is refused before loading."""
    loaded = []
    monkeypatch.setattr(build, "load_model", lambda *a, **k: loaded.append(1) or real_load_model(*a, **k))
    full = LLM(str(small), dtype="float32")
    plan = full.loaded.memory
    bs = full.target.block_size
    bpt = full.target.bytes_per_block // bs
    min_tokens = -(-(full.max_model_len + 8 + 1) // bs) * bs  # a full context and max_speculative_tokens=8, whole blocks
    smallest = sum(plan.weights.values()) + RUNTIME_BYTES + bpt * min_tokens
    assert plan.kv_caps["target"] == bpt * 16 * min_tokens  # auto: max_num_seqs=16 full contexts
    loaded.clear()
    with pytest.raises(InvalidParameterError, match=f"max_memory={smallest - 1} is too small"):
        LLM(str(small), dtype="float32", max_memory=smallest - 1)
    assert not loaded
    tight = LLM(str(small), dtype="float32", max_memory=smallest)
    assert loaded and tight.loaded.memory.kv_caps["target"] == bpt * min_tokens
    assert tight.loaded.memory.total <= smallest
    assert tight.generate(prompt(2, 30), SamplingParams(max_tokens=5, **GREEDY))[0].outputs[0].token_ids
    middle = LLM(str(small), dtype="float32", max_memory=smallest + 4 * bpt * min_tokens)
    assert middle.loaded.memory.total <= smallest + 4 * bpt * min_tokens
    assert bpt * min_tokens < middle.loaded.memory.kv_caps["target"] < plan.kv_caps["target"]
    with pytest.raises(InvalidParameterError, match="kv_cache_memory=64MiB .* exceed max_memory"):
        LLM(str(small), dtype="float32", kv_cache_memory="64MiB", max_memory=smallest + MiB)


def test_fewer_sequences_means_a_smaller_auto_cap(small):
    caps = [LLM(str(small), dtype="float32", max_num_seqs=n, max_model_len=256).loaded.memory.kv_caps["target"]
            for n in (4, 8)]
    assert caps[1] == 2 * caps[0]


@pytest.mark.parametrize("max_model_len", [256, None])
def test_one_sequence_of_the_full_context_fits_in_the_auto_cap(small, max_model_len):
    llm = LLM(str(small), dtype="float32", max_num_seqs=1, max_model_len=max_model_len)
    assert llm.max_model_len == (max_model_len or 512)


# ---- 6. plan_memory ------------------------------------------------------------------------------------------
WEIGHTS = {"target": 300 * MiB}
NEEDS = [KVNeed("target", 10_000, 16 * 4096), KVNeed("draft", 2_000, 16 * 4096)]


def test_explicit_kv_cache_memory_is_each_caches_cap(caplog):
    with caplog.at_level("WARNING", logger="quickdraft"):
        plan = plan_memory(WEIGHTS, NEEDS, "64MiB", 1000, free=1 * MiB)  # an explicit size is kept, with a warning
    assert plan.kv_caps == {"target": 64 * MiB, "draft": 64 * MiB}
    assert "kv_cache_memory=64MiB" in caplog.text and "free" in caplog.text
    assert plan.total == 300 * MiB + 128 * MiB + RUNTIME_BYTES
    assert plan_memory(WEIGHTS, NEEDS, 5000, 10).kv_caps == {"target": 5000, "draft": 5000}
    with pytest.raises(InvalidParameterError, match="exceed max_memory"):
        plan_memory(WEIGHTS, NEEDS, "64MiB", 1000, max_memory=300 * MiB + RUNTIME_BYTES + 100 * MiB)
    plan = plan_memory(WEIGHTS, NEEDS, "64MiB", 1000, max_memory=300 * MiB + RUNTIME_BYTES + 128 * MiB)
    assert plan.kv_caps["target"] == 64 * MiB


def test_auto_is_the_need_when_memory_is_plentiful():
    plan = plan_memory(WEIGHTS, NEEDS, "auto", 1000, free=1 << 40)
    assert plan.kv_caps == {"target": 10_000 * 16 * 4096, "draft": 2_000 * 16 * 4096}


@pytest.mark.parametrize("free_gib", [0.0, 0.8, 1.0, 2.0])
def test_auto_scales_down_to_half_the_free_memory_but_never_below_min_tokens(free_gib):
    free = int(free_gib * GiB)
    min_tokens = 2048
    plan = plan_memory(WEIGHTS, NEEDS, "auto", min_tokens, free=free)
    fixed = 300 * MiB + RUNTIME_BYTES
    budget = KV_FREE_FRACTION * max(0, free - fixed)
    wanted = {n.name: n.bytes_per_block * n.blocks for n in NEEDS}
    floor = {n.name: n.bytes_per_block * min_tokens for n in NEEDS}
    for name, cap in plan.kv_caps.items():
        assert floor[name] <= cap <= wanted[name]
    if budget >= sum(floor.values()):
        assert sum(plan.kv_caps.values()) <= budget
        # whole blocks: each cap rounds down by less than one block
        assert sum(plan.kv_caps.values()) >= min(budget, sum(wanted.values())) - sum(n.bytes_per_block for n in NEEDS)
        ratio = {name: plan.kv_caps[name] / wanted[name] for name in wanted}
        assert math.isclose(ratio["target"], ratio["draft"], rel_tol=1e-6)  # scaled alike
    else:
        assert plan.kv_caps == floor


def test_auto_within_max_memory():
    limit = 300 * MiB + RUNTIME_BYTES + 200 * MiB
    plan = plan_memory(WEIGHTS, NEEDS, "auto", 100, max_memory=limit, free=1 << 40)
    assert plan.total <= limit and sum(plan.kv_caps.values()) > 190 * MiB
    assert plan_memory(WEIGHTS, NEEDS, "auto", 100, max_memory="2GiB", free=1 << 40).total <= 2 * GiB


@pytest.mark.parametrize("limit", [100 * MiB, 300 * MiB + RUNTIME_BYTES - 1, 300 * MiB + RUNTIME_BYTES + 1])
def test_max_memory_below_weights_runtime_and_one_sequence_raises(limit):
    with pytest.raises(InvalidParameterError, match="max_memory=.* is too small") as info:
        plan_memory(WEIGHTS, NEEDS, "auto", 2048, max_memory=limit, free=1 << 40)
    assert "300 MiB" in str(info.value) and "400 MiB" in str(info.value)


def test_parse_size():
    assert parse_size("2GiB") == 2 * GiB == parse_size("2G") == parse_size("2gb") == parse_size(" 2 GiB ")
    assert parse_size("512MB") == 512 * MiB and parse_size("1.5G") == 3 * GiB // 2 and parse_size("4K") == 4096
    assert parse_size("1000") == parse_size(1000) == 1000 and parse_size("1T") == 1 << 40
    for bad in ("0", "0.4", "-1", "1e9", "x", "", "GiB", "1 PiB", True, None, [], float("nan"), 0, -1):
        with pytest.raises(InvalidParameterError, match="max_memory must be a positive size"):
            parse_size(bad, "max_memory")


# ---- 7. memory_summary ------------------------------------------------------------------------------------
def test_memory_summary_and_load_log(small, caplog):
    with caplog.at_level("INFO", logger="quickdraft.llm"):
        llm = LLM(str(small), dtype="float32", kv_cache_memory="8MiB")
    summary = llm.memory_summary
    assert summary.startswith("weights ") and "(float32)" in summary
    assert "KV up to 8 MiB (0 MiB in use)" in summary
    assert summary in caplog.text
    llm.generate([prompt(70 + i, 300) for i in range(4)], SamplingParams(max_tokens=100, **GREEDY))
    assert "(0 MiB in use)" not in llm.memory_summary
    llm.release_memory()
    assert llm.memory_summary == summary
    plan = MemoryPlan({"target": GiB}, {"target": GiB // 2, "draft": GiB // 4})
    assert plan.describe() == "weights 1.00 GiB, KV up to 768 MiB, total up to 2.14 GiB with the runtime"


def test_memory_summary_counts_the_draft_models_weights_and_cache(small, tiny_dir):
    draft = tiny_dir(arch="llama", vocab_size=64, layers=1, seed=3)
    alone = LLM(str(small), dtype="float32", kv_cache_memory="4MiB")
    both = LLM(str(small), draft=str(draft), dtype="float32", draft_weights="float32", kv_cache_memory="4MiB")
    assert "KV up to 4 MiB" in alone.memory_summary and "KV up to 8 MiB" in both.memory_summary
    assert "float32 + float32 draft" in both.memory_summary
    assert set(both.loaded.memory.kv_caps) == {"target", "draft"}


@pytest.mark.parametrize("weights", ["auto", "int4", "int8", "float32"])
def test_planned_weights_are_what_the_model_holds(smollm2, weights):
    """The plan made from the header alone (before any weight is read) is the model's weight bytes: the file's own
    types ('auto': Q4_1 layers, Q8_0 head), requantized ones, and an explicit float format (once planned as int8)."""
    from quickdraft.models import weight_bytes

    llm = LLM(str(smollm2), weights=weights, dtype="float32", kv_cache_memory="16MiB")
    assert llm.loaded.memory.weights["target"] == weight_bytes(llm.model)
