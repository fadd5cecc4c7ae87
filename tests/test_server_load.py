"""Under load: client disconnects free every KV block, preemption keeps outputs, the engine keeps serving."""
from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
import pytest

from quickdraft import LLM, SamplingParams
from quickdraft.errors import PromptTooLongError
from quickdraft.serving import AsyncEngine, EngineError

from test_server import serve, words


def test_200_streams_with_random_disconnects(tiny_dir):
    target = tiny_dir(arch="qwen2", vocab_size=64, layers=2)
    draft = tiny_dir(arch="llama", vocab_size=64, layers=1, seed=3)
    rng = random.Random(11)
    plans = []
    for i in range(200):
        body = {"model": "tiny", "prompt": words(rng, rng.randrange(2, 30)), "max_tokens": rng.randrange(4, 48),
                "temperature": rng.choice([0.0, 0.7]), "ignore_eos": rng.random() < 0.8, "stream": True,
                "n": 2 if i % 10 == 0 else 1}
        plans.append((body, rng.randrange(0, 6) if rng.random() < 0.5 else None))  # chunks read before leaving

    async def one(client: httpx.AsyncClient, gate: asyncio.Semaphore, body: dict, leave_after: int | None) -> str:
        async with gate:
            async with client.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                seen = 0
                async for line in r.aiter_lines():
                    if not line:
                        continue
                    if line == "data: [DONE]":
                        return "done"
                    assert "error" not in json.loads(line[6:])
                    seen += 1
                    if leave_after is not None and seen > leave_after:
                        return "left"  # leaving the block closes the connection mid-stream
            return "cut"

    async def run() -> list[str]:
        gate = asyncio.Semaphore(16)
        limits = httpx.Limits(max_connections=32, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as client:
            return await asyncio.gather(*(one(client, gate, body, leave) for body, leave in plans))

    with serve(target, "tiny", draft=str(draft), num_speculative_tokens=3, max_num_seqs=16) as server:
        t0 = time.perf_counter()
        outcomes = asyncio.run(asyncio.wait_for(run(), 240))
        elapsed = time.perf_counter() - t0
        assert outcomes.count("left") > 50 and outcomes.count("done") > 50, outcomes
        m = server.wait_idle(timeout=20)
        assert m["quickdraft_kv_blocks_used"] == 0
        assert m["quickdraft_draft_kv_blocks_used"] == 0
        assert m["quickdraft_num_requests_running"] == 0 and m["quickdraft_num_requests_waiting"] == 0
        ok, aborted = m['quickdraft_requests_total{status="ok"}'], m['quickdraft_requests_total{status="aborted"}']
        assert ok + aborted == 200 and aborted > 0 and m['quickdraft_requests_total{status="error"}'] == 0
        assert server.engine.stats()["num_tracked_requests"] == 0
        assert m["quickdraft_spec_decode_num_draft_tokens_total"] > 0
        r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "t1 t2", "max_tokens": 8, "ignore_eos": True},
                       timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
        print(f"200 streaming requests with disconnects in {elapsed:.1f}s")


def test_abort_frees_blocks_at_once(tiny_dir):
    llm = LLM(str(tiny_dir(arch="qwen2", vocab_size=64, layers=2)), dtype="float32", kv_cache_memory="4MiB")
    aengine = AsyncEngine(llm).start()

    async def run() -> None:
        stream = await aengine.generate(list(range(1, 40)), SamplingParams(max_tokens=400, ignore_eos=True))
        got = 0
        async for chunk in stream:
            got += len(chunk.token_ids)
            if got >= 3:
                break
        assert llm.target.allocator.num_used > 0
        await stream.aclose()
        for _ in range(100):  # at most one step later
            if llm.target.allocator.num_used == 0:
                break
            await asyncio.sleep(0.01)
        assert llm.target.allocator.num_used == 0
        assert aengine.metrics.requests["aborted"] == 1

    try:
        asyncio.run(asyncio.wait_for(run(), 60))
    finally:
        aengine.shutdown()


@pytest.mark.parametrize("speculative", [None, "ngram"])
def test_preemption_keeps_outputs(tiny_dir, speculative):
    model = tiny_dir(arch="qwen2", vocab_size=64, layers=2)
    probe = LLM(str(model), dtype="float32", kv_cache_memory="1MiB", block_size=4)
    per_block = (1 << 20) // probe.target.allocator.num_blocks
    del probe
    llm = LLM(str(model), dtype="float32", kv_cache_memory=32 * per_block, block_size=4, max_num_seqs=8,
              speculative=speculative)
    assert llm.target.allocator.num_blocks == 32  # 128 tokens of KV for 8 requests of up to ~70 tokens
    rng = random.Random(3)
    requests = []
    for i in range(8):
        prompt = [rng.randrange(1, 64) for _ in range(rng.randrange(8, 24))] * 2
        params = SamplingParams(max_tokens=rng.randrange(24, 40), ignore_eos=True,
                                temperature=0.0 if i % 2 == 0 else 0.9, seed=None if i % 2 == 0 else 50 + i)
        requests.append((prompt, params))
    aengine = AsyncEngine(llm).start()

    async def tokens(prompt, params) -> list[int]:
        out = {}
        async for chunk in await aengine.generate(prompt, params):
            out.setdefault(chunk.index, []).extend(chunk.token_ids)
        return out[0]

    async def run():
        alone = [await tokens(p, params) for p, params in requests]
        assert llm.engine.scheduler.num_preemptions == 0
        together = await asyncio.gather(*(tokens(p, params) for p, params in requests))
        return alone, together

    try:
        alone, together = asyncio.run(asyncio.wait_for(run(), 120))
        assert together == alone
        assert llm.engine.scheduler.num_preemptions > 0
        assert llm.target.allocator.num_used == 0
        # the context is capped to what the KV cache holds, so a request that could never fit is rejected up front
        assert llm.max_model_len < 128
        with pytest.raises(PromptTooLongError):
            asyncio.run(aengine.generate(list(range(1, 64)) * 2, SamplingParams(max_tokens=4)))
    finally:
        aengine.shutdown()


def test_stalled_engine_fails_requests_instead_of_hanging(tiny_dir):
    llm = LLM(str(tiny_dir(arch="qwen2", vocab_size=64, layers=2)), dtype="float32", kv_cache_memory="4MiB")
    aengine = AsyncEngine(llm, stall_timeout_s=0.3).start()
    scheduler = llm.engine.scheduler

    async def run() -> None:
        scheduler.schedule = lambda draft_room: []  # a scheduler that never admits anything
        try:
            stream = await aengine.generate([1, 2, 3], SamplingParams(max_tokens=4))
            with pytest.raises(EngineError, match="could not schedule"):
                async for _ in stream:
                    pass
        finally:
            del scheduler.schedule
        assert not llm.engine.has_unfinished() and llm.target.allocator.num_used == 0
        out = [c async for c in await aengine.generate([1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True))]
        assert sum(len(c.token_ids) for c in out) == 4

    try:
        asyncio.run(asyncio.wait_for(run(), 60))
    finally:
        aengine.shutdown()
