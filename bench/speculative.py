"""Speculative decoding benchmark: plain vs each drafter vs HF assisted generation, same weights, one run.

Usage: python bench/speculative.py [--target qwen2.5-coder-1.5b] [--draft qwen2.5-coder-0.5b] [--dtype bfloat16]
         [--tokens 128] [--humaneval 3] [--per-category 1]
         [--draft-weights auto] [--configs plain,draft,draft-float,draft-runahead,ngram,suffix,self,self-runahead,hf,...]
         [--categories rag,summarization,...] [--name speculative]
Sample: the first --humaneval public HumanEval prompts and the first --per-category public Spec-Bench prompts
of each category (first turn). Greedy; tokens/s is the whole generate call (prefill included) divided by
new tokens, for ours and HF's alike. Every speculative run is checked token for token against plain.
Each config runs prompt by prompt right after a plain run of the same prompt (one plain LLM stays loaded, its
prefix cache reset before every run), and its speed-up is against those plain runs: this machine's memory
bandwidth drifts by tens of percent over minutes, so only runs seconds apart are compared.
draft-runahead / self-runahead are draft / self with run_ahead=True (the draft drafts the next round while the
target verifies); `run_ahead` is the fraction of drafting rounds whose proposal began with run-ahead tokens.
draft / draft-runahead run the draft in --draft-weights (default auto: int4 on CPU); draft-float runs it in
--dtype, like the target (and like HF's assistant model).
"""
from __future__ import annotations

import argparse
import gc
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import humaneval_prompts, machine, save, spec_bench_prompts, table  # noqa: E402

from quickdraft import LLM, SamplingParams  # noqa: E402
from quickdraft.engine.outputs import SpecMetrics  # noqa: E402
from quickdraft.loading import resolve_model  # noqa: E402

OURS = {"plain": {}, "draft": None, "draft-float": None, "draft-runahead": None, "ngram": {"speculative": "ngram"},
        "suffix": {"speculative": "suffix"},
        "self": {"speculative": "self"}, "self-runahead": {"speculative": "self", "run_ahead": True}}
CONFIGS = ("plain", "draft", "draft-float", "draft-runahead", "ngram", "suffix", "self", "self-runahead", "hf", "hf-assist", "hf-lookup")


def chat_ids(llm: LLM, text: str) -> list[int]:
    return llm.chat_prompt([{"role": "user", "content": text}])


def load_ours(name: str, kwargs: dict, target: str, dtype: str, k) -> LLM:
    # float target weights in --dtype (bfloat16 or float32), the weights HF runs (the default follows the file)
    llm = LLM(target, dtype=dtype, weights=dtype, num_speculative_tokens=k if name != "plain" else "auto", **kwargs)
    llm.generate([chat_ids(llm, "hi")], SamplingParams(max_tokens=4, temperature=0.0))  # warm-up
    return llm


def run_ours(llm: LLM, name: str, category: str, text: str, tokens: int) -> dict:
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    ids = chat_ids(llm, text)
    llm.reset_prefix_cache()  # plain is reused across configs: it must compute every prompt again, as they do
    t0 = time.perf_counter()
    out = llm.generate([ids], params)[0]
    seconds = time.perf_counter() - t0
    spec = out.metrics.spec
    row = {"config": name, "category": category, "tok_s": len(out.token_ids) / seconds,
           "token_ids": out.token_ids, "rounds": spec.rounds, "draft_tokens": spec.draft_tokens,
           "accepted_tokens": spec.accepted_tokens, "drafting_rounds": spec.drafting_rounds,
           "run_ahead_rounds": spec.run_ahead_rounds, "generated": len(out.token_ids)}
    ahead = (f"  run-ahead {spec.run_ahead_rounds / spec.drafting_rounds:5.1%} of rounds"
             if name.endswith("-runahead") and spec.drafting_rounds else "")
    print(f"  {name:<14} {category:<16} {row['tok_s']:6.2f} tok/s  acceptance "
          f"{spec.acceptance_rate:5.1%}  mean accepted {spec.mean_accepted_length:4.2f}{ahead}", flush=True)
    return row


def run_paired(name: str, plain: LLM, run_one, prompts, tokens: int) -> list[dict]:
    """Each prompt runs on plain decoding and then on ``name``, back to back.

    This machine's memory bandwidth drifts by tens of percent over minutes, so a ratio is taken only between
    runs seconds apart: every config gets its own plain runs (kept loaded for the whole benchmark)."""
    rows = []
    for i, (category, text) in enumerate(prompts):
        base = run_ours(plain, "plain", category, text, tokens)
        row = run_one(category, text)
        base["pair"], row["pair"], base["prompt"], row["prompt"] = name, name, i, i
        row["plain_tok_s"], row["plain_ids"] = base["tok_s"], base["token_ids"]
        rows += [base, row]
    return rows


def load_hf(name: str, target: str, draft: str, dtype: str, tokens: int, encode):
    """``encode(text)``: the chat prompt's ids as quickdraft makes them, so both engines decode the same prompt (a
    GGUF without a chat template has none in transformers)."""
    """HF transformers on the same GGUF weights; returns a function that times one prompt."""
    import transformers
    tpath = resolve_model(target)
    torch_dtype = getattr(torch, dtype)
    model = transformers.AutoModelForCausalLM.from_pretrained(tpath.parent, gguf_file=tpath.name,
                                                              dtype=torch_dtype).eval()
    tok = transformers.AutoTokenizer.from_pretrained(tpath.parent, gguf_file=tpath.name)
    extra = {}
    if name == "hf-assist":
        dpath = resolve_model(draft)
        extra["assistant_model"] = transformers.AutoModelForCausalLM.from_pretrained(
            dpath.parent, gguf_file=dpath.name, dtype=torch_dtype).eval()
    elif name == "hf-lookup":
        extra["prompt_lookup_num_tokens"] = 10

    def run_one(category: str, text: str) -> dict:
        ids = torch.tensor([encode(text)])
        with torch.inference_mode():
            t0 = time.perf_counter()
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens,
                                 min_new_tokens=tokens, do_sample=False, pad_token_id=tok.eos_token_id, **extra)
            seconds = time.perf_counter() - t0
        new = out[0, ids.shape[1]:].tolist()
        print(f"  {name:<14} {category:<16} {len(new) / seconds:6.2f} tok/s", flush=True)
        return {"config": name, "category": category, "tok_s": len(new) / seconds, "token_ids": new}

    return run_one


def summarize(rows: list[dict]) -> list[dict]:
    """Mean tok/s per (config, category); a config's speed-up is against its own paired plain runs."""
    groups = defaultdict(list)
    for r in rows:
        groups[(r["config"], r["category"])].append(r)
    out = []
    for (config, category), rs in groups.items():
        tok_s = sum(r["tok_s"] for r in rs) / len(rs)
        if config == "plain":
            base = tok_s  # the same prompt's plain runs must agree with each other: plain decoding is deterministic
            first = {}
            same = sum(first.setdefault(r["prompt"], r["token_ids"]) == r["token_ids"] for r in rs)
            same = f"{same}/{len(rs)}"
        else:
            base = sum(r["plain_tok_s"] for r in rs) / len(rs)
            same = f"{sum(r['token_ids'] == r['plain_ids'] for r in rs)}/{len(rs)}"
        spec = SpecMetrics(rounds=sum(r.get("rounds", 0) for r in rs),
                           draft_tokens=sum(r.get("draft_tokens", 0) for r in rs),
                           accepted_tokens=sum(r.get("accepted_tokens", 0) for r in rs),
                           drafting_rounds=sum(r.get("drafting_rounds", 0) for r in rs),
                           generated_tokens=sum(r.get("generated", 0) for r in rs),
                           run_ahead_rounds=sum(r.get("run_ahead_rounds", 0) for r in rs))
        out.append({"config": config, "category": category, "prompts": len(rs), "tok_s": tok_s,
                    "plain_tok_s": base, "speedup_vs_plain": tok_s / base, "identical_to_plain": same,
                    "acceptance": spec.acceptance_rate if spec.draft_tokens else None,
                    "mean_accepted": spec.mean_accepted_length if spec.draft_tokens else None,
                    "tokens_per_pass": spec.tokens_per_pass if spec.rounds else None,
                    "run_ahead": spec.run_ahead_rounds / spec.drafting_rounds
                    if config.endswith("-runahead") and spec.drafting_rounds else None})
    return sorted(out, key=lambda r: (r["category"], r["config"]))


def chart(summary: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    categories = sorted({r["category"] for r in summary})
    configs = [c for c in CONFIGS if any(r["config"] == c for r in summary)]
    fig, ax = plt.subplots(figsize=(max(8, len(categories) * 1.6), 4.5))
    width = 0.8 / len(configs)
    for i, c in enumerate(configs):
        vals = [next((r["tok_s"] for r in summary if r["config"] == c and r["category"] == cat), 0)
                for cat in categories]
        ax.bar([x + i * width for x in range(len(categories))], vals, width, label=c)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(categories))], categories, rotation=20)
    ax.set_ylabel("tokens/s (greedy)")
    ax.set_title("quickdraft speculative decoding vs plain and HF transformers")
    ax.legend(ncol=4, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--humaneval", type=int, default=3)
    ap.add_argument("--per-category", type=int, default=1)
    ap.add_argument("--categories", default=None, help="comma-separated Spec-Bench categories (default: all 13)")
    ap.add_argument("--k", default="auto")
    ap.add_argument("--draft-weights", default="auto", help="the draft's weight format for draft/draft-runahead")
    ap.add_argument("--configs", default="plain,draft,draft-runahead,ngram,self,self-runahead,hf,hf-assist,hf-lookup")
    ap.add_argument("--name", default="speculative", help="results file name: bench/results/NAME.{json,png}")
    args = ap.parse_args()
    k = args.k if args.k == "auto" else int(args.k)
    cats = tuple(args.categories.split(",")) if args.categories else None
    prompts = [("humaneval", p) for p in humaneval_prompts(args.humaneval)] + spec_bench_prompts(args.per_category, cats)
    info = machine()
    print(f"machine: {info['cpu']}, {info['cores']} cores, torch {info['torch']}; target {args.target}, "
          f"draft {args.draft} ({args.draft_weights}), {args.dtype}, {len(prompts)} prompts, {args.tokens} new tokens, k={args.k}")
    plain = load_ours("plain", {}, args.target, args.dtype, k)
    rows = []
    for name in args.configs.split(","):
        if name == "plain":
            continue  # every other config runs with its own plain runs (run_paired)
        if name in OURS:
            kwargs = OURS[name] if OURS[name] is not None else {
                "draft": args.draft, "run_ahead": name == "draft-runahead",
                "draft_weights": args.dtype if name == "draft-float" else args.draft_weights}
            llm = load_ours(name, kwargs, args.target, args.dtype, k)
            rows += run_paired(name, plain, lambda c, t: run_ours(llm, name, c, t, args.tokens), prompts, args.tokens)
            del llm
        else:
            run_one = load_hf(name, args.target, args.draft, args.dtype, args.tokens, lambda t: chat_ids(plain, t))
            rows += run_paired(name, plain, run_one, prompts, args.tokens)
            del run_one
        gc.collect()
        report(rows, info, args, final=False)  # results so far survive a run stopped part-way
    report(rows, info, args, final=True)


def report(rows: list[dict], info: dict, args: argparse.Namespace, final: bool) -> None:
    summary = summarize(rows)
    if final:
        print("\n" + table(summary, ["category", "config", "prompts", "tok_s", "plain_tok_s", "speedup_vs_plain",
                                     "identical_to_plain", "acceptance", "mean_accepted", "tokens_per_pass", "run_ahead"]))
    path = save(args.name, {"machine": info, "args": vars(args), "complete": final, "summary": summary,
                                "runs": [{k2: v for k2, v in r.items() if k2 not in ("token_ids", "plain_ids")} for r in rows]})
    chart(summary, path.with_suffix(".png"))
    if final:
        print(f"wrote {path} and {path.with_suffix('.png')}")


if __name__ == "__main__":
    main()
