"""quickdraft vs llama.cpp on CPU, same GGUF targets, greedy, side by side in one run.

Usage: python bench/cpu_vs_llamacpp.py [--targets qwen2.5-coder-1.5b[,smollm2-135m,...]] [--draft qwen2.5-coder-0.5b]
         [--tokens 128] [--humaneval 3] [--spec-bench 3] [--weights auto,int4,int8,bfloat16]
         [--modes plain,draft,ngram] [--threads 2] [--repeats 1] [--busy] [--out cpu_vs_llamacpp]
Sample: the first --humaneval public HumanEval prompts and the first public Spec-Bench prompt of the
first --spec-bench categories, each wrapped in the chat template; both engines get the same token ids.
llama.cpp enters through the PyPI package llama-cpp-python (`pip install llama-cpp-python`, it compiles
llama.cpp for this CPU): plain decoding at the file's own quantization, and with ngram in --modes its
LlamaPromptLookupDecoding drafter. quickdraft runs each --weights (auto: its default, the file's own precision)
in each mode (draft: --draft as draft model; a target no larger than the draft runs plain only).
tokens/s = new tokens / wall time of the whole call (prefill included) for every configuration; plain
configurations are also reported against the memory-bandwidth limit of the weights one decode step reads
(measured bandwidth / bytes; read_MB: quickdraft's from the model it loaded, llama.cpp's the file's tensors but the
embedding table, which a tied head reads whole). --targets takes packaged names or GGUF paths. Each target's configurations are loaded together and the prompts run in turn
through all of them (the first configuration rotating from prompt to prompt), so a drift in the machine's speed
over minutes, which is tens of percent on shared cloud hosts, falls on every configuration alike.
--busy: every run is made twice, on the idle machine and with one CPU-bound process beside it (a Python busy
loop), and the table gives the slowdown. Summaries are per target over all prompts and for the HumanEval and
Spec-Bench groups apart; JSON and a PNG chart go to bench/results/<out>.{json,png}.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (gguf_step_bytes, humaneval_prompts, machine, memory_bandwidth_gbs, save,  # noqa: E402
                    spec_bench_prompts, table, weight_bytes_per_token)

from quickdraft import LLM, SamplingParams  # noqa: E402
from quickdraft.loading import resolve_model  # noqa: E402


def prompt_ids(target: str, texts: list[tuple[str, str]]) -> list[tuple[str, list[int]]]:
    llm = LLM(target, dtype="float32", kv_cache_memory="64MiB")  # tokenizer + chat template only
    out = [(cat, llm.chat_prompt([{"role": "user", "content": t}])) for cat, t in texts]
    del llm
    gc.collect()
    return out


Runner = Callable[[str, list[int]], dict]
WARM_UP = "Write a Python function that returns the sum of a list of numbers."


def quickdraft_runner(target: str, draft: str, weights: str, mode: str, tokens: int) -> Runner:
    kwargs = {"draft": draft} if mode == "draft" else {"speculative": "ngram"} if mode == "ngram" else {}
    llm = LLM(target, weights=weights, **kwargs)
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    # warm-up with a request like the measured ones (not from the sample): four arbitrary token ids would also
    # teach the speculation controller that the draft never hits, and each prompt would start from that
    llm.generate([llm.chat_prompt([{"role": "user", "content": WARM_UP}])], SamplingParams(max_tokens=16, temperature=0.0))
    config, nbytes = f"{llm.weights}/{mode}", weight_bytes_per_token(llm.model)

    plain = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, speculative=False)

    def run(cat: str, ids: list[int], speculative: bool = True) -> dict:
        """One prompt; ``speculative=False`` decodes it without drafts on the same LLM (an A/B in one process)."""
        llm.reset_prefix_cache()
        t0 = time.perf_counter()
        out = llm.generate([ids], params if speculative else plain)[0]
        sec = time.perf_counter() - t0
        spec = out.metrics.spec
        label = config if speculative else f"{llm.weights}/plain"
        return {"engine": "quickdraft", "config": label, "category": cat, "tok_s": len(out.token_ids) / sec,
                "decode_tok_s": out.metrics.tokens_per_s,
                "token_ids": out.token_ids, "weight_bytes": nbytes,
                "acceptance": spec.acceptance_rate if spec.draft_tokens else None,
                "tokens_per_pass": spec.tokens_per_pass}
    return run


def llamacpp_runner(target: str, mode: str, tokens: int, threads: int) -> Runner:
    from llama_cpp import Llama
    from quickdraft.loading.quantize import file_defaults
    quant = file_defaults(resolve_model(target))[0]
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
        out_ids, first = [], None
        for tok in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
            out_ids.append(tok)
            first = first or time.perf_counter()
            if len(out_ids) >= tokens:
                break
        end = time.perf_counter()
        sec = end - t0
        return {"engine": "llama.cpp", "config": f"{quant}/{mode}", "category": cat, "tok_s": len(out_ids) / sec,
                "decode_tok_s": (len(out_ids) - 1) / (end - first) if len(out_ids) > 1 else None,
                "token_ids": out_ids, "weight_bytes": gguf_step_bytes(resolve_model(target))}
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--targets", "--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--humaneval", type=int, default=3)
    ap.add_argument("--spec-bench", type=int, default=3, help="categories of Spec-Bench, one prompt each")
    ap.add_argument("--weights", default="auto,int4,int8,bfloat16")
    ap.add_argument("--modes", default="plain,draft,ngram")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--repeats", type=int, default=1,
                    help="passes over the sample; with 2 or more the table gives each configuration's run-to-run spread")
    ap.add_argument("--busy", action="store_true", help="also run every configuration beside a CPU-bound process")
    ap.add_argument("--out", default="cpu_vs_llamacpp")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    info = machine()
    bandwidth = memory_bandwidth_gbs()
    cats = ("summarization", "rag", "translation", "qa", "math_reasoning", "writing")[: args.spec_bench]
    texts = [("humaneval", p) for p in humaneval_prompts(args.humaneval)] + spec_bench_prompts(1, cats)
    print(f"machine: {info['cpu']}, {info['cores']} cores, {args.threads} threads; {len(texts)} prompts, "
          f"{args.tokens} new tokens, greedy; measured read bandwidth {bandwidth:.1f} GB/s")
    rows, summary = [], []
    for target in args.targets.split(","):
        target_rows = run_target(target, texts, args)
        rows += target_rows
        for group in ("all", "humaneval", "spec-bench"):
            picked = [r for r in target_rows if group == "all" or (r["category"] == "humaneval") == (group == "humaneval")]
            summary += summarize(picked, f"{target} {group}", bandwidth)
    cols = ["group", "engine", "config", "tok_s", "vs_own_plain", "spread", "identical_to_own_plain", "acceptance",
            "tokens_per_pass", "vs_best_llamacpp", "read_MB", "pct_of_bandwidth_limit"]
    if args.busy:
        cols += ["busy_tok_s", "busy_slowdown"]
    print("\n" + table(summary, cols))
    path = save(args.out, {"machine": info, "bandwidth_GB_s": bandwidth, "args": vars(args), "summary": summary,
                           "runs": [{k: v for k, v in r.items() if k != "token_ids"} for r in rows]})
    chart(summary, path.with_suffix(".png"))
    print(f"wrote {path}")


def run_target(target: str, texts: list[tuple[str, str]], args: argparse.Namespace) -> list[dict]:
    """Every configuration of one target over the prompts, rotating which goes first; freed afterwards."""
    prompts = prompt_ids(target, texts)
    modes = args.modes.split(",")
    if resolve_model(target).stat().st_size <= resolve_model(args.draft).stat().st_size:
        modes = [m for m in modes if m != "draft"]  # a draft no smaller than its target has nothing to offer
    runners: list[Runner] = []
    try:
        import llama_cpp  # noqa: F401
        runners += [llamacpp_runner(target, mode, args.tokens, args.threads)
                    for mode in ("plain", "lookup") if mode == "plain" or "ngram" in modes]
    except ImportError:
        print("llama-cpp-python is not installed (pip install llama-cpp-python); reporting quickdraft only")
    for weights in args.weights.split(","):
        for mode in modes:
            runners.append(quickdraft_runner(target, args.draft, weights, mode, args.tokens))
    rows = []
    for rep in range(args.repeats):
        for i, (cat, ids) in enumerate(prompts):  # every configuration on one prompt, then the next prompt
            turn = (rep * len(prompts) + i) % len(runners)  # each prompt starts one configuration further on
            for run in runners[turn:] + runners[:turn]:
                for busy in (False, True) if args.busy else (False,):
                    with busy_process(busy):
                        rows.append({**run(cat, ids), "target": target, "prompt": i, "repeat": rep, "busy": busy})
                    r = rows[-1]
                    print(f"  {target:<20} {r['engine']:<10} {r['config']:<16} {cat:<14} {r['tok_s']:6.2f} tok/s"
                          f"{' (busy)' if busy else ''}", flush=True)
    del runners
    gc.collect()
    return rows


@contextlib.contextmanager
def busy_process(busy: bool):
    """A CPU-bound process (a Python busy loop) runs beside the body when ``busy``."""
    if not busy:
        yield
        return
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.5)  # running, and seen by anything that measures the load
        yield
    finally:
        hog.kill()
        hog.wait()


def summarize(all_rows: list[dict], group: str, bandwidth: float) -> list[dict]:
    """One line per (engine, config): mean tok/s, ratio to the same engine and weights without speculation, the
    median run-to-run spread of one prompt's tok/s (max - min over repeats, relative; with --repeats 2 or more), how
    many outputs equal that plain run's, (plain only) tok/s as a share of the bandwidth limit, and with --busy the
    mean tok/s beside a CPU-bound process and the slowdown it caused."""
    rows = [r for r in all_rows if not r["busy"]]
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
                    "read_MB": rs[0]["weight_bytes"] / 1e6,
                    "pct_of_bandwidth_limit": 100 * tok_s / limit if key[1].endswith("/plain") else None})
        busy = [r["tok_s"] for r in all_rows if r["busy"] and (r["engine"], r["config"]) == key]
        if busy:
            out[-1]["busy_tok_s"] = sum(busy) / len(busy)
            out[-1]["busy_slowdown"] = tok_s / out[-1]["busy_tok_s"]
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
    ax.set_title("quickdraft vs llama.cpp on CPU, same GGUF files")
    ax.legend(ncol=3, fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _mean(values):
    vals = [v for v in values if v is not None]
    return sum(vals) / len(vals) if vals else None


if __name__ == "__main__":
    main()
