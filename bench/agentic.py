"""Agent-like workload: plain vs n-gram vs suffix decoding vs a draft model vs suffix + draft, side by side.

Usage: python bench/agentic.py [--target qwen2.5-coder-1.5b] [--draft qwen2.5-coder-0.5b] [--tasks 3]
         [--tokens 160] [--modes plain,ngram,suffix,draft,suffix+draft] [--memory-requests 10000] [--out agentic]

The workload, from public prompts (HumanEval and Spec-Bench), sent in one fixed order:
- edit-resend: a HumanEval function to complete, sent again twice with the instruction lightly reworded (an agent
  retrying a step); greedy answers repeat most of the earlier answer;
- multi-turn: write a HumanEval function, then two follow-ups that ask for the whole function again with a small
  change (restated code, visible to prompt lookup too);
- tool-call: Spec-Bench QA questions, each answered with a JSON tool call of one fixed shape.
A request's "round" is 1 for the first request of a task (and the first tool call: nothing to remember yet) and
2+ for the rest. Every mode's LLM stays loaded and runs each request right after the others (plain first), so a
ratio compares runs seconds apart; each mode keeps its own suffix cache, filled by the same request sequence.
Greedy; tokens/s is the whole generate call (prefill included) over new tokens. Every output is checked token for
token against plain. --memory-requests feeds that many benchmark-text outputs through a suffix drafter's cache of
the default size and reports its tokens and bytes (bounded by construction) and the process's RSS.
"""
from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import humaneval_prompts, machine, memory_bandwidth_gbs, save, spec_bench_prompts, table  # noqa: E402
from common import weight_bytes_per_token  # noqa: E402

from quickdraft import LLM, SamplingParams  # noqa: E402
from quickdraft.speculative.suffix import DEFAULT_CACHE_TOKENS, SuffixDrafter  # noqa: E402

EDITS = ("Complete the following Python function.", "Please complete the Python function below.",
         "Finish writing this Python function.")
FOLLOW_UPS = ("Rename the function's parameters to shorter names and show the whole function again.",
              "Add a one-line comment above the return statement and show the whole function again.")
TOOL_INSTRUCTION = ('You can call one tool: search(query: str, top_k: int). Reply with only the call, as JSON of the '
                    'form {"tool": "search", "arguments": {"query": "...", "top_k": 3}}.\n\nQuestion: ')


def workload(tasks: int) -> list[dict]:
    """The requests in order: each a list of chat messages (assistant turns filled in from plain's answers)."""
    code = humaneval_prompts(2 * tasks)
    out = []
    for i, prompt in enumerate(code[:tasks]):
        for r, edit in enumerate(EDITS):
            out.append({"kind": "edit-resend", "task": i, "round": r + 1,
                        "messages": [{"role": "user", "content": f"{edit}\n\n{prompt}"}]})
    for i, prompt in enumerate(code[tasks:]):
        out.append({"kind": "multi-turn", "task": i, "round": 1,
                    "messages": [{"role": "user", "content": f"Write this Python function:\n\n{prompt}"}]})
        for r, follow in enumerate(FOLLOW_UPS):
            out.append({"kind": "multi-turn", "task": i, "round": r + 2, "follows": True,
                        "messages": [{"role": "user", "content": follow}]})
    for r, (_, question) in enumerate(spec_bench_prompts(2 * tasks, ("qa",))):
        out.append({"kind": "tool-call", "task": 0, "round": r + 1,
                    "messages": [{"role": "user", "content": TOOL_INSTRUCTION + question}]})
    return out


def mode_options(mode: str, draft: str | None) -> dict:
    return {"plain": {}, "ngram": {"speculative": "ngram"}, "suffix": {"speculative": "suffix"},
            "draft": {"draft": draft}, "suffix+draft": {"speculative": "suffix", "draft": draft}}[mode]


def run_workload(target: str, draft: str | None, modes: list[str], tasks: int, tokens: int) -> tuple[list[dict], LLM]:
    llms = {m: LLM(target, max_model_len=4096, **mode_options(m, draft)) for m in modes}
    params = SamplingParams(max_tokens=tokens, temperature=0.0)
    for llm in llms.values():  # warm-up: the weights' pages and the kernels
        llm.generate([llm.chat_prompt([{"role": "user", "content": "hi"}])], SamplingParams(max_tokens=4, temperature=0))
    rows, history = [], []
    for index, request in enumerate(workload(tasks)):
        if not request.get("follows"):
            history = []
        history = history + request["messages"]
        reference = None
        for mode, llm in llms.items():
            ids = llm.chat_prompt(history)
            t0 = time.perf_counter()
            out = llm.generate([ids], params)[0]
            seconds = time.perf_counter() - t0
            if reference is None:
                reference = out
            spec = out.metrics.spec
            rows.append({"request": index, "kind": request["kind"], "round": request["round"], "mode": mode,
                         "seconds": seconds, "tokens": len(out.token_ids), "drafted": spec.draft_tokens,
                         "accepted": spec.accepted_tokens, "passes": spec.rounds,
                         "identical": out.token_ids == reference.token_ids})
        history = history + [{"role": "assistant", "content": reference.text}]
        line = "  ".join(f"{r['mode']} {r['tokens'] / r['seconds']:6.1f}" for r in rows[-len(llms):])
        print(f"  #{index:<2} {request['kind']:<11} round {request['round']}  tok/s: {line}", flush=True)
    return rows, llms[modes[0]]


def summarise(rows: list[dict], modes: list[str]) -> list[dict]:
    out = []
    for phase, keep in (("first rounds", lambda r: r["round"] == 1), ("repeated rounds", lambda r: r["round"] > 1),
                        ("all", lambda r: True)):
        chosen = [r for r in rows if keep(r)]
        plain_s = sum(r["seconds"] for r in chosen if r["mode"] == modes[0])
        for mode in modes:
            rs = [r for r in chosen if r["mode"] == mode]
            seconds, generated = sum(r["seconds"] for r in rs), sum(r["tokens"] for r in rs)
            drafted, accepted = sum(r["drafted"] for r in rs), sum(r["accepted"] for r in rs)
            out.append({"phase": phase, "mode": mode, "requests": len(rs), "tokens": generated,
                        "tok_s": generated / seconds if seconds else 0.0,
                        f"vs_{modes[0]}": plain_s / seconds if seconds else 0.0,
                        "acceptance": accepted / drafted if drafted else 0.0,
                        "tokens_per_pass": generated / max(1, sum(r["passes"] for r in rs)),
                        "identical": all(r["identical"] for r in rs)})
    for row in out:  # against n-gram too, where it ran
        ngram = next((r for r in out if r["phase"] == row["phase"] and r["mode"] == "ngram"), None)
        if ngram is not None and row["tok_s"]:
            row["vs_ngram"] = row["tok_s"] / ngram["tok_s"]
    return out


def memory_run(requests: int, tokenizer) -> dict:
    """The cache of earlier outputs over ``requests`` outputs of benchmark text, at its default size."""
    import psutil

    texts = humaneval_prompts(164) + [t for _, t in spec_bench_prompts(60)]
    outputs = [tokenizer.encode(t)[:512] for t in texts]
    drafter = SuffixDrafter()
    rss0 = psutil.Process().memory_info().rss
    peak_tokens = 0
    t0 = time.perf_counter()
    for i in range(requests):
        drafter.cache.add(outputs[i % len(outputs)])
        peak_tokens = max(peak_tokens, drafter.cache.tokens)
        if i % 100 == 0:
            drafter.cache.stream()
    seconds = time.perf_counter() - t0
    return {"requests": requests, "capacity_tokens": DEFAULT_CACHE_TOKENS, "peak_tokens": peak_tokens,
            "outputs_kept": len(drafter.cache), "cache_mib": drafter.cache.nbytes / 2**20,
            "rss_growth_mib": (psutil.Process().memory_info().rss - rss0) / 2**20, "seconds": seconds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b", help="'none': no draft-model modes")
    ap.add_argument("--modes", default="plain,ngram,suffix,draft,suffix+draft")
    ap.add_argument("--tasks", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=160)
    ap.add_argument("--memory-requests", type=int, default=0)
    ap.add_argument("--out", default="agentic")
    args = ap.parse_args()
    draft = None if args.draft == "none" else args.draft
    modes = [m for m in args.modes.split(",") if draft is not None or "draft" not in m]
    assert modes[0] == "plain", "plain runs first: the reference of every ratio and of the identity check"
    info = machine()
    print(f"{info['cpu']}, {info['cores']} cores; target {args.target}, draft {draft}", flush=True)
    rows, plain = run_workload(args.target, draft, modes, args.tasks, args.tokens)
    summary = summarise(rows, modes)
    print(table(summary, ["phase", "mode", "requests", "tokens", "tok_s", "vs_plain", "vs_ngram", "acceptance",
                          "tokens_per_pass", "identical"]))
    bytes_per_token = weight_bytes_per_token(plain.model)
    bandwidth = memory_bandwidth_gbs()
    limits = {"weight_bytes_per_token": bytes_per_token, "bandwidth_gbs": bandwidth,
              "plain_limit_tok_s": bandwidth * 1e9 / bytes_per_token,
              "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    print(f"plain decoding's bandwidth limit: {limits['plain_limit_tok_s']:.1f} tok/s "
          f"({bytes_per_token / 1e6:.0f} MB of weights per token at {bandwidth:.1f} GB/s); "
          f"peak RSS {limits['peak_rss_mib']:.0f} MiB (every mode's LLM loaded at once)")
    memory = memory_run(args.memory_requests, plain.tokenizer) if args.memory_requests else None
    if memory:
        print(f"suffix cache after {memory['requests']} outputs: {memory['peak_tokens']} tokens at most "
              f"(capacity {memory['capacity_tokens']}), {memory['cache_mib']:.2f} MiB, RSS grew "
              f"{memory['rss_growth_mib']:.1f} MiB, {memory['seconds']:.1f} s")
    path = save(args.out, {"machine": info, "args": vars(args), "summary": summary, "limits": limits,
                           "memory": memory, "rows": rows})
    print(f"wrote {path}")
    if not all(r["identical"] for r in rows):
        print("MISMATCH: a speculative output differs from plain", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
