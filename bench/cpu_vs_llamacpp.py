"""quickdraft vs llama.cpp on CPU, same GGUF target, greedy, side by side in one run.

Usage: python bench/cpu_vs_llamacpp.py [--target qwen2.5-coder-1.5b] [--draft qwen2.5-coder-0.5b]
         [--tokens 128] [--humaneval 3] [--spec-bench 3] [--weights auto,int4,int8,bfloat16]
         [--modes plain,draft,ngram] [--threads 2] [--repeats 1]
Sample: the first --humaneval public HumanEval prompts and the first public Spec-Bench prompt of the
first --spec-bench categories, each wrapped in the chat template; both engines get the same token ids.
llama.cpp enters through the PyPI package llama-cpp-python (`pip install llama-cpp-python`, it compiles
llama.cpp for this CPU): plain decoding and its LlamaPromptLookupDecoding drafter. tokens/s = new tokens
/ wall time of the whole call (prefill included) for every configuration; plain configurations are also
reported against the memory-bandwidth limit of the weights one decode step reads (measured bandwidth / bytes).
Every configuration is loaded at start-up and the prompts run in turn through all of them (the first
configuration rotating from prompt to prompt), so a drift in the machine's speed over minutes, which is tens of
percent on shared cloud hosts, falls on every configuration alike. Summaries are given over all prompts and for
the HumanEval and Spec-Bench groups apart; JSON and a PNG chart go to bench/results/cpu_vs_llamacpp.{json,png}.
"""
from __future__ import annotations

import argparse
import gc
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (humaneval_prompts, machine, memory_bandwidth_gbs, save, spec_bench_prompts, table,  # noqa: E402
                    weight_bytes_per_token)

from quickdraft import LLM, SamplingParams  # noqa: E402
from quickdraft.loading import resolve_model  # noqa: E402


def prompt_ids(target: str, texts: list[tuple[str, str]]) -> list[tuple[str, list[int]]]:
    llm = LLM(target, dtype="float32", kv_cache_memory="64MiB")  # tokenizer + chat template only
    out = [(cat, llm.chat_prompt([{"role": "user", "content": t}])) for cat, t in texts]
    del llm
    gc.collect()
    return out


Runner = Callable[[str, list[int]], dict]


def quickdraft_runner(target: str, draft: str, weights: str, mode: str, tokens: int) -> Runner:
    kwargs = {"draft": draft} if mode == "draft" else {"speculative": "ngram"} if mode == "ngram" else {}
    llm = LLM(target, weights=weights, **kwargs)
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=8, temperature=0.0))  # warm-up
    config, nbytes = f"{llm.weights}/{mode}", weight_bytes_per_token(llm.model)

    def run(cat: str, ids: list[int]) -> dict:
        llm.reset_prefix_cache()
        t0 = time.perf_counter()
        out = llm.generate([ids], params)[0]
        sec = time.perf_counter() - t0
        spec = out.metrics.spec
        return {"engine": "quickdraft", "config": config, "category": cat, "tok_s": len(out.token_ids) / sec,
                "token_ids": out.token_ids, "weight_bytes": nbytes,
                "acceptance": spec.acceptance_rate if spec.draft_tokens else None,
                "tokens_per_pass": spec.tokens_per_pass}
    return run


def llamacpp_runner(target: str, mode: str, tokens: int, threads: int) -> Runner:
    from llama_cpp import Llama
    kwargs = {}
    if mode == "lookup":
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
        kwargs["draft_model"] = LlamaPromptLookupDecoding(num_pred_tokens=10)
        kwargs["logits_all"] = True  # verifying drafts reads every position's logits (else only n_batch rows fit)
    llm = Llama(str(resolve_model(target)), n_ctx=8192, n_threads=threads, n_threads_batch=threads,
                verbose=False, **kwargs)
    llm.create_completion([1, 2, 3, 4], max_tokens=8, temperature=0.0)  # warm-up

    def run(cat: str, ids: list[int]) -> dict:
        llm.reset()
        t0 = time.perf_counter()
        out_ids = []
        for tok in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
            out_ids.append(tok)
            if len(out_ids) >= tokens:
                break
        sec = time.perf_counter() - t0
        return {"engine": "llama.cpp", "config": f"Q4_K_M/{mode}", "category": cat, "tok_s": len(out_ids) / sec,
                "token_ids": out_ids,
                "weight_bytes": resolve_model(target).stat().st_size}  # the whole GGUF: an upper bound
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--humaneval", type=int, default=3)
    ap.add_argument("--spec-bench", type=int, default=3, help="categories of Spec-Bench, one prompt each")
    ap.add_argument("--weights", default="auto,int4,int8,bfloat16")
    ap.add_argument("--modes", default="plain,draft,ngram")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--repeats", type=int, default=1,
                    help="passes over the sample; with 2 or more the table gives each configuration's run-to-run spread")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    info = machine()
    bandwidth = memory_bandwidth_gbs()
    cats = ("summarization", "rag", "translation", "qa", "math_reasoning", "writing")[: args.spec_bench]
    texts = [("humaneval", p) for p in humaneval_prompts(args.humaneval)] + spec_bench_prompts(1, cats)
    prompts = prompt_ids(args.target, texts)
    print(f"machine: {info['cpu']}, {info['cores']} cores, {args.threads} threads; {len(prompts)} prompts, "
          f"{args.tokens} new tokens, greedy; measured read bandwidth {bandwidth:.1f} GB/s")
    runners: list[Runner] = []
    try:
        import llama_cpp  # noqa: F401
        runners += [llamacpp_runner(args.target, mode, args.tokens, args.threads) for mode in ("plain", "lookup")]
    except ImportError:
        print("llama-cpp-python is not installed (pip install llama-cpp-python); reporting quickdraft only")
    for weights in args.weights.split(","):
        for mode in args.modes.split(","):
            runners.append(quickdraft_runner(args.target, args.draft, weights, mode, args.tokens))
    rows = []
    for rep in range(args.repeats):
        for i, (cat, ids) in enumerate(prompts):  # every configuration on one prompt, then the next prompt
            turn = (rep * len(prompts) + i) % len(runners)  # each prompt starts one configuration further on
            for run in runners[turn:] + runners[:turn]:
                rows.append({**run(cat, ids), "prompt": i, "repeat": rep})
                print(f"  {rows[-1]['engine']:<10} {rows[-1]['config']:<16} {cat:<14} {rows[-1]['tok_s']:6.2f} tok/s",
                      flush=True)
    summary = []
    for group in ("all", "humaneval", "spec-bench"):
        summary += summarize([r for r in rows if group == "all" or (r["category"] == "humaneval") == (group == "humaneval")],
                             group, bandwidth)
    cols = ["group", "engine", "config", "tok_s", "vs_own_plain", "spread", "identical_to_own_plain", "acceptance",
            "tokens_per_pass", "vs_best_llamacpp", "pct_of_bandwidth_limit"]
    print("\n" + table(summary, cols))
    path = save("cpu_vs_llamacpp", {"machine": info, "bandwidth_GB_s": bandwidth, "args": vars(args),
                                    "summary": summary,
                                    "runs": [{k: v for k, v in r.items() if k != "token_ids"} for r in rows]})
    chart(summary, path.with_suffix(".png"))
    print(f"wrote {path}")


def summarize(rows: list[dict], group: str, bandwidth: float) -> list[dict]:
    """One line per (engine, config): mean tok/s, ratio to the same engine and weights without speculation, the
    median run-to-run spread of one prompt's tok/s (max - min over repeats, relative; with --repeats 2 or more), how
    many outputs equal that plain run's, and (plain only) tok/s as a share of the bandwidth limit."""
    out = []
    for key in dict.fromkeys((r["engine"], r["config"]) for r in rows):
        rs = [r for r in rows if (r["engine"], r["config"]) == key]
        plain = [r for r in rows if r["engine"] == key[0] and r["config"].split("/")[0] == key[1].split("/")[0]
                 and r["config"].endswith("/plain")]
        same = sum(a["token_ids"] == b["token_ids"] for a, b in zip(rs, plain))
        tok_s = sum(r["tok_s"] for r in rs) / len(rs)
        base = sum(r["tok_s"] for r in plain) / len(plain) if plain else tok_s
        limit = bandwidth * 1e9 / rs[0]["weight_bytes"]
        by_prompt: dict[int, list[float]] = {}
        for r in rs:
            by_prompt.setdefault(r["prompt"], []).append(r["tok_s"])
        spreads = sorted((max(v) - min(v)) / (sum(v) / len(v)) for v in by_prompt.values() if len(v) > 1)
        out.append({"group": group, "engine": key[0], "config": key[1], "tok_s": tok_s, "vs_own_plain": tok_s / base,
                    "spread": spreads[len(spreads) // 2] if spreads else None,
                    "identical_to_own_plain": f"{same}/{len(rs)}",
                    "acceptance": _mean([r.get("acceptance") for r in rs]),
                    "tokens_per_pass": _mean([r.get("tokens_per_pass") for r in rs]),
                    "pct_of_bandwidth_limit": 100 * tok_s / limit if key[1].endswith("/plain") else None})
    best_llama = max((s["tok_s"] for s in out if s["engine"] == "llama.cpp"), default=None)
    for s in out:
        s["vs_best_llamacpp"] = s["tok_s"] / best_llama if best_llama else None
    return out


def chart(summary: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    groups = list(dict.fromkeys(s["group"] for s in summary))
    configs = list(dict.fromkeys(f"{s['engine']} {s['config']}" for s in summary))
    fig, ax = plt.subplots(figsize=(max(8, len(groups) * 3), 4.5))
    width = 0.8 / len(configs)
    for i, c in enumerate(configs):
        vals = [next((s["tok_s"] for s in summary if f"{s['engine']} {s['config']}" == c and s["group"] == g), 0)
                for g in groups]
        ax.bar([x + i * width for x in range(len(groups))], vals, width, label=c)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(groups))], groups)
    ax.set_ylabel("tokens/s (greedy, prefill included)")
    ax.set_title("quickdraft vs llama.cpp on CPU, Qwen2.5-Coder-1.5B (Q4_K_M GGUF)")
    ax.legend(ncol=3, fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _mean(values):
    vals = [v for v in values if v is not None]
    return sum(vals) / len(vals) if vals else None


if __name__ == "__main__":
    main()
