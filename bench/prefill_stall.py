"""Inter-token latency of running streams while a long prompt is admitted: what chunked prefill buys.

--streams requests decode greedily from short prompts; once each has streamed a few tokens, a --prompt-tokens prompt
(held-out HumanEval text) arrives. Every stream's token arrival times are recorded; the inter-token latencies (ITL)
of the intervals that overlap the long prompt's prefill (its arrival to its first token) are reported as p50, p99
and max, beside the ITL before it arrived and the long prompt's time to first token. One engine per setting, in
one run:
- ``--budgets``: max_num_batched_tokens values; one at least the prompt's length prefills it in one step, which is
  what an engine without chunked prefill does;
- ``--decode-budgets``: prefill_tokens_while_decoding values (the prompt tokens a step takes while other sequences
  decode; 0 = no separate limit).

    python bench/prefill_stall.py --model qwen2.5-coder-0.5b --budgets 16384,512 --decode-budgets 0,64
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, save, table  # noqa: E402
from long_context import context_ids  # noqa: E402

from quickdraft import LLM, SamplingParams  # noqa: E402

SHORT_PROMPTS = ["def fibonacci(n):", "class LinkedList:", "def parse_csv(path):", "def quicksort(items):"]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def measure(llm: LLM, streams: int, prompt_tokens: int, warm_tokens: int, after_tokens: int) -> dict:
    engine = llm.engine
    params = SamplingParams(max_tokens=100_000, temperature=0.0, ignore_eos=True)
    ids = [llm.tokenizer.encode(SHORT_PROMPTS[i % len(SHORT_PROMPTS)]) for i in range(streams)]
    stream_ids = [engine.add_request(p, params) for p in ids]
    stamps: dict[str, list[float]] = {rid: [] for rid in stream_ids}
    long_id, arrived, first_token = None, None, None
    llm.reset_prefix_cache()
    while True:
        chunks = engine.step()
        now = time.perf_counter()
        for chunk in chunks:
            if chunk.request_id in stamps and chunk.token_ids:
                stamps[chunk.request_id].append(now)
            if chunk.request_id == long_id and chunk.token_ids and first_token is None:
                first_token = now
        if long_id is None and all(len(s) >= warm_tokens for s in stamps.values()):
            long_id = engine.add_request(context_ids(llm, prompt_tokens), SamplingParams(max_tokens=4, temperature=0.0))
            arrived = time.perf_counter()
        if first_token is not None and all(sum(t > first_token for t in s) >= after_tokens for s in stamps.values()):
            break
    for rid in stream_ids:
        engine.abort(rid)
    while engine.has_unfinished():
        engine.step()
    during, before = [], []
    for s in stamps.values():
        for a, b in zip(s, s[1:]):
            if b > arrived and a < first_token:
                during.append(b - a)
            elif b <= arrived:
                before.append(b - a)
    return {"itl_before_p50_ms": statistics.median(before) * 1e3,
            "itl_during_p50_ms": statistics.median(during) * 1e3, "itl_during_p99_ms": percentile(during, 0.99) * 1e3,
            "itl_during_max_ms": max(during) * 1e3, "long_prompt_ttft_s": first_token - arrived,
            "intervals_during": len(during)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=8192)
    ap.add_argument("--budgets", default="16384,512", help="max_num_batched_tokens values")
    ap.add_argument("--decode-budgets", default="0", help="prefill_tokens_while_decoding values (0: no limit)")
    ap.add_argument("--warm-tokens", type=int, default=8)
    ap.add_argument("--after-tokens", type=int, default=4)
    ap.add_argument("--out", default="prefill_stall")
    args = ap.parse_args()
    rows = []
    for budget in (int(b) for b in args.budgets.split(",")):
        for decode_budget in (int(b) for b in args.decode_budgets.split(",")):
            llm = LLM(args.model, max_model_len=args.prompt_tokens + 1024, max_num_batched_tokens=budget,
                      prefill_tokens_while_decoding=decode_budget or None)
            row = {"max_num_batched_tokens": budget, "prefill_tokens_while_decoding": decode_budget or None,
                   **measure(llm, args.streams, args.prompt_tokens, args.warm_tokens, args.after_tokens)}
            rows.append(row)
            print(row, flush=True)
            del llm
    print(f"{args.model}, {machine()['cpu']}, {args.streams} streams, a {args.prompt_tokens}-token prompt admitted")
    print(table(rows, list(rows[0])))
    path = save(args.out, {"machine": machine(), "args": vars(args), "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
