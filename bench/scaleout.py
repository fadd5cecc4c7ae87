"""Multi-turn chats through 1 and 2 engine replicas on Ray Serve: prefix-aware routing against round-robin.

Usage: python bench/scaleout.py [--model smollm2-135m] [--conversations 32] [--concurrency 4] [--max-tokens 64]
         [--configs 1:prefix,2:prefix,2:round_robin,2:power_of_two] [--name scaleout]

Each config starts ``quickdraft serve MODEL --replicas N --routing POLICY --num-cpus-per-replica 1`` (a local Ray
instance), waits for its replicas, and plays the first --conversations public MT-Bench conversations (both turns
each; turn 2 sends turn 1, the model's answer and the next question) with --concurrency conversations at a time,
streaming, greedy. Per request: TTFT (time to the first content token, at the client), prompt tokens and
``usage.prompt_tokens_details.cached_tokens``. Reported per config: the prefix-cache hit rate (cached prompt tokens /
prompt tokens), TTFT p50 and p99, and throughput (completion tokens per second of wall time).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import openai

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import BENCH_DATA, machine, save, table  # noqa: E402
from server_process import ServerProcess  # noqa: E402

MT_BENCH = BENCH_DATA / "mt_bench.public.jsonl"


def conversations(count: int) -> list[list[str]]:
    rows = [json.loads(line) for line in MT_BENCH.read_text().splitlines() if line.strip()]
    return [row["turns"] for row in rows[:count]]


async def turn(client: openai.AsyncOpenAI, messages: list[dict], max_tokens: int) -> dict:
    t0 = time.perf_counter()
    ttft, text, usage = None, [], None
    stream = await client.chat.completions.create(model="m", messages=messages, max_tokens=max_tokens,
                                                  temperature=0, stream=True,
                                                  stream_options={"include_usage": True})
    async for event in stream:
        for choice in event.choices:
            if choice.delta.content:
                ttft = ttft if ttft is not None else time.perf_counter() - t0
                text.append(choice.delta.content)
        if event.usage is not None:
            usage = event.usage
    return {"ttft_s": ttft if ttft is not None else time.perf_counter() - t0, "text": "".join(text),
            "prompt_tokens": usage.prompt_tokens, "cached_tokens": usage.prompt_tokens_details.cached_tokens,
            "completion_tokens": usage.completion_tokens}


async def play(url: str, convs: list[list[str]], concurrency: int, max_tokens: int) -> tuple[list[dict], float]:
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)
    gate = asyncio.Semaphore(concurrency)
    results: list[dict] = []

    async def conversation(i: int, turns: list[str]) -> None:
        async with gate:
            messages: list[dict] = []
            for t, question in enumerate(turns):
                messages.append({"role": "user", "content": question})
                r = await turn(client, messages, max_tokens)
                results.append({"conversation": i, "turn": t + 1, **r})
                messages.append({"role": "assistant", "content": r["text"]})

    t0 = time.perf_counter()
    await asyncio.gather(*(conversation(i, turns) for i, turns in enumerate(convs)))
    wall = time.perf_counter() - t0
    await client.close()
    return results, wall


def summarize(config: str, results: list[dict], wall_s: float) -> dict:
    ttfts = sorted(r["ttft_s"] for r in results)
    prompt = sum(r["prompt_tokens"] for r in results)
    later = [r for r in results if r["turn"] > 1]
    return {"config": config, "requests": len(results), "hit_rate": sum(r["cached_tokens"] for r in results) / prompt,
            "turn2_hit_rate": sum(r["cached_tokens"] for r in later) / max(1, sum(r["prompt_tokens"] for r in later)),
            "ttft_p50_s": statistics.median(ttfts), "ttft_p99_s": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
            "throughput_tok_s": sum(r["completion_tokens"] for r in results) / wall_s, "wall_s": wall_s}


def run_config(model: str, config: str, convs: list[list[str]], args: argparse.Namespace, logs: Path) -> dict:
    replicas, policy = config.split(":")
    server = ServerProcess([model, "--replicas", replicas, "--routing", policy, "--num-cpus-per-replica", "1",
                            "--max-model-len", "4096", "--kv-cache-memory", "256MiB", "--served-model-name", "m"],
                           logs / f"scaleout_{replicas}_{policy}.log")
    try:
        deadline = time.monotonic() + 300
        while True:  # /health counts the replicas that report ready
            try:
                if httpx.get(f"{server.url}/health", timeout=5).json().get("replicas", 0) >= int(replicas):
                    break
            except (httpx.TransportError, ValueError):
                pass
            if server.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{config}: replicas not ready:\n{server.log_text()[-3000:]}")
            time.sleep(1)
        asyncio.run(play(server.url, convs[:2], 1, 4))  # warm-up (then forgotten: the caches are reset)
        httpx.post(f"{server.url}/reset_prefix_cache", timeout=60).raise_for_status()
        results, wall = asyncio.run(play(server.url, convs, args.concurrency, args.max_tokens))
        return {**summarize(config, results, wall), "rows": results}
    finally:
        server.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--conversations", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--configs", default="1:prefix,2:prefix,2:round_robin,2:power_of_two")
    ap.add_argument("--name", default="scaleout")
    args = ap.parse_args()
    info = machine()
    convs = conversations(args.conversations)
    print(f"machine: {info['cpu']}, {info['cores']} cores; {args.model}, {len(convs)} MT-Bench conversations "
          f"(2 turns), {args.concurrency} at a time, {args.max_tokens} tokens per answer", flush=True)
    logs = Path(tempfile.mkdtemp(prefix="scaleout-"))  # the servers' logs
    runs = []
    for config in args.configs.split(","):
        runs.append(run_config(args.model, config, convs, args, logs))
        print({k: v for k, v in runs[-1].items() if k != "rows"}, flush=True)
    print(table(runs, ["config", "requests", "hit_rate", "turn2_hit_rate", "ttft_p50_s", "ttft_p99_s",
                       "throughput_tok_s", "wall_s"]))
    by = {r["config"]: r for r in runs}
    for base in ("round_robin", "power_of_two"):
        if "2:prefix" in by and f"2:{base}" in by:
            p, other = by["2:prefix"], by[f"2:{base}"]
            print(f"2 replicas: prefix-aware hit rate {p['hit_rate'] / max(other['hit_rate'], 1e-9):.2f}x {base}'s; "
                  f"TTFT p50 {p['ttft_p50_s'] * 1e3:.0f} ms vs {other['ttft_p50_s'] * 1e3:.0f} ms")
    print(f"wrote {save(args.name, {'machine': info, 'args': vars(args), 'runs': runs})}")


if __name__ == "__main__":
    main()
