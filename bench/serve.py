"""Serving benchmark: `quickdraft serve` under concurrent load, with and without speculative decoding.

Starts one server subprocess per mode (plain, speculative), both up for the whole run, drives
/v1/chat/completions with streaming requests built from Spec-Bench public prompts at several concurrency
levels, each level on one server and then the other (the machine's speed drifts by 10-25% over minutes on
shared hosts, so the modes are compared at the same moment), and reports output tokens/s, time to first token
(TTFT), time per output token (TPOT) and inter-token latency (ITL) p50/p99.

Sample (fixed, stated): the first turn of Spec-Bench records (``spec_bench.public.jsonl``), taken round-robin
over its six tasks (mt_bench, translation, summarization, qa, math_reasoning, rag; each task ordered by
question_id): request i is record i // 6 of task i % 6. Every concurrency level sends the same ``--requests``
requests, greedy (temperature 0), ``--max-tokens`` each, so both modes must produce the same text
(speculation is exact); the JSON records how many outputs matched. The server's prefix cache is reset
(``POST /reset_prefix_cache``) before each level, so every level computes every prompt: without it, the levels
after the first found all 16 prompts cached and measured decoding alone.

Definitions (as vLLM's ``bench serve``): TTFT = request start to the first content chunk; TPOT = (latency -
TTFT) / (output tokens - 1) per request; ITL = gap between consecutive content chunks (one chunk per engine
step, so with speculation a chunk can hold several tokens). Output tokens/s = all output tokens / wall time.
On CPU the report adds the prefill ceiling: the sum of TTFTs at concurrency 1 is prompt compute that batching
does not make cheaper, so wall(c1) / that sum bounds the throughput gain of any concurrency.

    python bench/serve.py                                   # qwen2.5-coder-1.5b, draft qwen2.5-coder-0.5b, bf16
    python bench/serve.py --model smollm2-135m --speculative ngram --dtype float32 --device cpu \\
        --requests 4 --max-tokens 16 --out /tmp/serve.json  # smoke run
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from server_process import ServerProcess  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "bench" / "data" / "spec_bench.public.jsonl"
TASKS = ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")
SERVED_NAME = "bench"


def load_sample(path: Path, count: int) -> list[dict]:
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    by_task: dict[str, list[dict]] = {t: [] for t in TASKS}
    for r in records:
        by_task[r["category"] if r["category"] in by_task else "mt_bench"].append(r)
    for recs in by_task.values():
        recs.sort(key=lambda r: r["question_id"])
    sample = []
    for i in range(count):
        task = TASKS[i % len(TASKS)]
        recs = by_task[task]
        r = recs[(i // len(TASKS)) % len(recs)]
        sample.append({"question_id": r["question_id"], "task": task, "prompt": r["turns"][0]})
    return sample


def machine_info() -> dict:
    try:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from common import machine  # the other benches' description of the machine (imports torch)
        return {**machine(), "platform": platform.platform()}
    except ImportError:
        return {"python": platform.python_version(), "platform": platform.platform(), "cores": os.cpu_count()}


def start_server(args: argparse.Namespace, spec_args: list[str], log_path: Path) -> ServerProcess:
    serve_args = [args.model, "--dtype", args.dtype, "--device", args.device, "--served-model-name", SERVED_NAME,
                  "--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
                  "--kv-cache-memory", args.kv_cache_memory, "--log-level", "warning", *spec_args]
    if args.max_model_len:
        serve_args += ["--max-model-len", str(args.max_model_len)]
    return ServerProcess(serve_args, log_path, args.port)


async def one_request(client: httpx.AsyncClient, prompt: str, max_tokens: int) -> dict:
    body = {"model": SERVED_NAME, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    times, text, usage = [], [], None
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread()).decode()[:500]}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(event["error"]["message"])
            if event.get("usage"):
                usage = event["usage"]
            for choice in event.get("choices", []):
                content = choice.get("delta", {}).get("content")
                if content:
                    times.append(time.perf_counter())
                    text.append(content)
    end = time.perf_counter()
    tokens = usage["completion_tokens"] if usage else len(times)
    ttft = times[0] - start if times else end - start
    return {"ttft": ttft, "latency": end - start, "tokens": tokens, "text": "".join(text),
            "itl": list(np.diff(times)) if len(times) > 1 else [],
            "tpot": (end - start - ttft) / (tokens - 1) if tokens > 1 else None}


async def run_level(url: str, sample: list[dict], concurrency: int, max_tokens: int) -> tuple[list[dict], float]:
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 4)

    async def guarded(client, item):
        async with gate:
            return await one_request(client, item["prompt"], max_tokens)

    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(3600, connect=30), limits=limits) as client:
        t0 = time.perf_counter()
        results = await asyncio.gather(*(guarded(client, item) for item in sample))
        return results, time.perf_counter() - t0


def pct(values: list[float], q: float) -> float | None:
    values = [v for v in values if v is not None]
    return float(np.percentile(values, q)) if values else None


def summarize(results: list[dict], wall: float, before: dict, after: dict) -> dict:
    tokens = sum(r["tokens"] for r in results)
    itl = [g for r in results for g in r["itl"]]

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    drafted, accepted = delta("quickdraft_spec_decode_num_draft_tokens_total"), delta(
        "quickdraft_spec_decode_num_accepted_tokens_total")
    rounds = delta("quickdraft_spec_decode_num_rounds_total")
    ms = lambda v: None if v is None else round(v * 1000, 2)  # noqa: E731
    return {
        "requests": len(results), "wall_s": round(wall, 3), "output_tokens": tokens,
        "output_tokens_per_s": round(tokens / wall, 2), "requests_per_s": round(len(results) / wall, 3),
        "ttft_s_sum": round(sum(r["ttft"] for r in results), 3),
        "ttft_ms_p50": ms(pct([r["ttft"] for r in results], 50)),
        "ttft_ms_p99": ms(pct([r["ttft"] for r in results], 99)),
        "tpot_ms_p50": ms(pct([r["tpot"] for r in results], 50)),
        "tpot_ms_p99": ms(pct([r["tpot"] for r in results], 99)),
        "itl_ms_p50": ms(pct(itl, 50)), "itl_ms_p99": ms(pct(itl, 99)),
        "acceptance_rate": round(accepted / drafted, 4) if drafted else None,
        "tokens_per_target_pass": round(tokens / rounds, 3) if rounds else None,
        "preemptions": int(delta("quickdraft_num_preemptions_total")),
    }


def chart(report: dict, path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install 'quickdraft[bench]'): no chart written", file=sys.stderr)
        return
    panels = [("output_tokens_per_s", "output tokens/s"), ("ttft_ms_p50", "TTFT p50 (ms)"),
              ("tpot_ms_p50", "TPOT p50 (ms)"), ("itl_ms_p99", "ITL p99 (ms)")]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6))
    for ax, (key, label) in zip(axes, panels):
        for mode, levels in report["results"].items():
            xs = sorted(int(c) for c in levels)
            ax.plot(xs, [levels[str(c)][key] for c in xs], marker="o", label=mode)
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.set_xlabel("concurrent requests")
        ax.set_title(label)
        ax.grid(alpha=0.3)
    axes[0].legend()
    cfg = report["config"]
    fig.suptitle(f"quickdraft serve: {cfg['model']} ({cfg['dtype']}, {cfg['device']}; spec: {cfg['speculation'] or 'none'}), "
                 f"{cfg['requests']} Spec-Bench prompts, max_tokens {cfg['max_tokens']}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"chart: {path}")


def print_table(report: dict) -> None:
    cols = ("mode", "conc", "tok/s", "speedup", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99", "ITL p50",
            "ITL p99", "accept")
    print(("{:<8} {:>5} {:>9} {:>8} {:>9} {:>9} {:>9} {:>9} {:>8} {:>8} {:>7}").format(*cols))
    base = report["results"].get("plain", {})
    for mode, levels in report["results"].items():
        for c, r in sorted(levels.items(), key=lambda kv: int(kv[0])):
            ref = base.get(c)
            speed = f"{r['output_tokens_per_s'] / ref['output_tokens_per_s']:.2f}x" if ref else "-"
            f = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
            print(("{:<8} {:>5} {:>9.1f} {:>8} {:>9} {:>9} {:>9} {:>9} {:>8} {:>8} {:>7}").format(
                mode, c, r["output_tokens_per_s"], speed, f(r["ttft_ms_p50"]), f(r["ttft_ms_p99"]),
                f(r["tpot_ms_p50"]), f(r["tpot_ms_p99"]), f(r["itl_ms_p50"]), f(r["itl_ms_p99"]),
                "-" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.0%}"))
    print("latencies in ms; TPOT = (latency - TTFT) / (tokens - 1); ITL = gap between streamed chunks")
    ceiling = report.get("plain_prefill_ceiling")
    if ceiling:
        print(f"prefill ceiling: at concurrency 1, {ceiling['prefill_share']:.0%} of the wall time was time to first "
              f"token; on a CPU a prompt's compute does not shrink when batched, so no concurrency can exceed "
              f"{ceiling['max_speedup_vs_c1']:.2f}x the throughput of concurrency 1 on this sample")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-coder-1.5b")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b", help="draft model ('' for none)")
    p.add_argument("--speculative", choices=["ngram", "self"], help="draft-free speculation (replaces --draft)")
    p.add_argument("--k", default="auto")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--draft-weights", default="auto", help="the draft's weight format (auto: int4 on CPU)")
    p.add_argument("--device", default="auto", help="auto: cuda when available, else cpu")
    p.add_argument("--concurrency", default="1,4,16", help="comma-separated levels")
    p.add_argument("--requests", type=int, default=48, help="requests per concurrency level (same sample each)")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--modes", default="plain,spec", help="plain, spec or both")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=512, help="the server's token budget per step")
    p.add_argument("--kv-cache-memory", default="4GiB")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--port", type=int, default=0, help="0: a free port")
    p.add_argument("--data", type=Path, default=DATA)
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "serve.json")
    p.add_argument("--chart", type=Path, default=None, help="PNG path (default: --out with .png)")
    p.add_argument("--startup-timeout", type=float, default=900)
    args = p.parse_args(argv)

    if args.device == "auto":
        import torch
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    levels = [int(c) for c in args.concurrency.split(",")]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    spec_args = ["--speculative", args.speculative] if args.speculative else (
        ["--draft", args.draft, "--draft-weights", args.draft_weights] if args.draft else [])
    if "spec" in modes and not spec_args:
        p.error("mode 'spec' needs --draft or --speculative")
    spec_args += ["--k", str(args.k)] if spec_args else []
    sample = load_sample(args.data, args.requests)
    warmup = load_sample(args.data, 2)

    report = {
        "config": {"model": args.model, "speculation": " ".join(spec_args), "dtype": args.dtype,
                   "device": args.device, "concurrency": levels, "requests": args.requests,
                   "max_tokens": args.max_tokens, "max_num_seqs": args.max_num_seqs,
                   "max_num_batched_tokens": args.max_num_batched_tokens,
                   "kv_cache_memory": args.kv_cache_memory, "temperature": 0.0, "endpoint": "/v1/chat/completions"},
        "sample": {"file": str(args.data.name), "selection": "first turn, round-robin over the 6 Spec-Bench tasks "
                   "(each ordered by question_id)", "question_ids": [s["question_id"] for s in sample]},
        "machine": machine_info(),
        "results": {mode: {} for mode in modes}, "outputs_identical_to_plain": {},
    }
    texts: dict[str, dict[int, list[str]]] = {mode: {} for mode in modes}
    logs = Path(tempfile.mkdtemp(prefix="quickdraft-bench-"))
    servers = {mode: start_server(args, spec_args if mode == "spec" else [], logs / f"{mode}.log") for mode in modes}
    try:
        for mode, server in servers.items():
            print(f"[{mode}] {' '.join(server.cmd[2:])}", file=sys.stderr)
            t0 = time.perf_counter()
            server.wait_ready(args.startup_timeout)
            print(f"[{mode}] ready in {time.perf_counter() - t0:.0f}s; warming up", file=sys.stderr)
            asyncio.run(run_level(server.url, warmup, 2, min(16, args.max_tokens)))
        for c in levels:  # both servers stay up; each level runs on one, then the other, so drift hits both
            for mode, server in servers.items():
                server.reset_prefix_cache()
                before = server.metrics()
                results, wall = asyncio.run(run_level(server.url, sample, c, args.max_tokens))
                summary = summarize(results, wall, before, server.metrics())
                report["results"][mode][str(c)] = summary
                texts[mode][c] = [r["text"] for r in results]
                print(f"[{mode}] concurrency {c}: {summary['output_tokens_per_s']:.1f} tok/s, "
                      f"TTFT p50 {summary['ttft_ms_p50']} ms, TPOT p50 {summary['tpot_ms_p50']} ms", file=sys.stderr)
    finally:
        for server in servers.values():
            server.stop()
    first = report["results"].get("plain", {}).get("1")
    if first and args.device == "cpu":
        # each request's TTFT at concurrency 1 is its prefill (plus one step): compute-bound work that batching
        # cannot share, so the wall time at any concurrency is at least their sum
        report["plain_prefill_ceiling"] = {"prefill_share": round(first["ttft_s_sum"] / first["wall_s"], 3),
                                           "max_speedup_vs_c1": round(first["wall_s"] / first["ttft_s_sum"], 2)}
    if "plain" in texts:
        for mode in texts:
            if mode != "plain":
                report["outputs_identical_to_plain"][mode] = {
                    str(c): sum(a == b for a, b in zip(texts["plain"][c], texts[mode][c])) / len(sample)
                    for c in levels}
    print_table(report)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"results: {args.out}")
    chart(report, args.chart or args.out.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
