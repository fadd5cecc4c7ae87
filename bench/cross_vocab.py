"""Drafts of another vocabulary beside the same-family draft and n-gram lookup, on one target, in one run.

Usage: python bench/cross_vocab.py [--target qwen2.5-coder-1.5b] [--tokens 128] [--humaneval 4] [--per-category 1]
         [--configs plain,ngram,qwen2.5-coder-0.5b,smollm2-135m,gemma3-270m] [--batch 8] [--name cross_vocab]

Configs: plain decoding, n-gram prompt lookup, one config per draft model (the same-family Qwen 0.5B, and
SmolLM2-135M and Gemma 3 270M, which draft through the tokens they share with Qwen: speculative/vocab.py), and
suffix decoding with SmolLM2 beside it (suffix+smollm2-135m: a suffix match where the text repeats, SmolLM2
elsewhere; its output cache fills with the earlier prompts' outputs, as a server's would). Every
model runs in its default weights (the file's own precision: int4 for these Q4 GGUFs) with k chosen by the cost
model, as a user gets them. Sample: the first --humaneval public HumanEval prompts and the first --per-category
public Spec-Bench prompts of every category (first turn, chat template). Greedy, --tokens new tokens
(ignore_eos); tokens/s is the whole generate call over new tokens. Each prompt runs on plain and then on the config,
back to back (bench/speculative.py's run_paired: this machine's bandwidth drifts over minutes). Every output is
checked token for token against plain at batch 1, and again with all prompts in batches of --batch.
"""
from __future__ import annotations

import argparse
import gc
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import humaneval_prompts, machine, memory_bandwidth_gbs, save, spec_bench_prompts, table  # noqa: E402
from common import weight_bytes_per_token  # noqa: E402
from speculative import chat_ids, run_ours, run_paired, summarize  # noqa: E402

from quickdraft import LLM, SamplingParams  # noqa: E402

CONFIGS = ("plain", "ngram", "qwen2.5-coder-0.5b", "smollm2-135m", "gemma3-270m", "suffix+smollm2-135m")


def options(config: str) -> dict:
    """LLM options of a config: "ngram", "suffix", a draft model's name, or "suffix+" a draft model's name."""
    if config in ("plain", "ngram", "suffix"):
        return {} if config == "plain" else {"speculative": config}
    if config.startswith("suffix+"):
        return {"speculative": "suffix", "draft": config.removeprefix("suffix+")}
    return {"draft": config}


def load(target: str, config: str) -> LLM:
    kwargs = options(config)
    llm = LLM(target, **kwargs)
    llm.generate([chat_ids(llm, "hi")], SamplingParams(max_tokens=4, temperature=0.0))  # warm-up
    return llm


def batched_identical(llm: LLM, prompts: list[tuple[str, str]], plain_ids: list[list[int]], tokens: int,
                      batch: int) -> str:
    """Every prompt again, ``batch`` at a time: outputs must still equal plain's batch-1 outputs."""
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    same = 0
    for start in range(0, len(prompts), batch):
        chunk = prompts[start:start + batch]
        outs = llm.generate([chat_ids(llm, text) for _, text in chunk], params)
        same += sum(o.token_ids == ref for o, ref in zip(outs, plain_ids[start:start + batch]))
    return f"{same}/{len(prompts)}"


def overall(summary: list[dict], rows: list[dict]) -> list[dict]:
    """Per config over every prompt: tok/s and speed-up against its paired plain runs."""
    out = []
    for config in dict.fromkeys(r["config"] for r in rows if r["config"] != "plain"):
        rs = [r for r in rows if r["config"] == config]
        tok_s, base = sum(r["tok_s"] for r in rs) / len(rs), sum(r["plain_tok_s"] for r in rs) / len(rs)
        drafted, accepted = sum(r["draft_tokens"] for r in rs), sum(r["accepted_tokens"] for r in rs)
        rounds, generated = sum(r["drafting_rounds"] for r in rs), sum(r["generated"] for r in rs)
        out.append({"config": config, "category": "all", "prompts": len(rs), "tok_s": tok_s, "plain_tok_s": base,
                    "speedup_vs_plain": tok_s / base,
                    "identical_to_plain": f"{sum(r['token_ids'] == r['plain_ids'] for r in rs)}/{len(rs)}",
                    "acceptance": accepted / drafted if drafted else None,
                    "mean_accepted": accepted / rounds if rounds else None,
                    "tokens_per_pass": generated / sum(r["rounds"] for r in rs)})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--humaneval", type=int, default=4)
    ap.add_argument("--per-category", type=int, default=1)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--name", default="cross_vocab")
    args = ap.parse_args()
    prompts = [("humaneval", p) for p in humaneval_prompts(args.humaneval)] + spec_bench_prompts(args.per_category)
    info = machine()
    bandwidth = memory_bandwidth_gbs()
    print(f"machine: {info['cpu']}, {info['cores']} cores, {bandwidth:.1f} GB/s read; target {args.target}, "
          f"{len(prompts)} prompts, {args.tokens} new tokens", flush=True)
    plain = load(args.target, "plain")
    target_bytes = weight_bytes_per_token(plain.loaded.model)
    rows, loads, batched, plain_ids = [], {}, {}, None
    for config in args.configs.split(","):
        if config == "plain":
            continue
        t0 = time.perf_counter()
        llm = load(args.target, config)
        loads[config] = {"load_s": time.perf_counter() - t0, "pairing": llm.loaded.draft_pairing,
                         "memory": llm.memory_summary}
        print(f"{config}: loaded in {loads[config]['load_s']:.1f} s; {llm.loaded.draft_pairing or ''}", flush=True)
        pair = run_paired(config, plain, lambda c, t, llm=llm: run_ours(llm, config, c, t, args.tokens), prompts,
                          args.tokens)
        rows += pair
        if plain_ids is None:
            plain_ids = [r["token_ids"] for r in pair if r["config"] == "plain"]
        batched[config] = batched_identical(llm, prompts, plain_ids, args.tokens, args.batch)
        print(f"{config}: batch {args.batch} identical to plain {batched[config]}", flush=True)
        del llm
        gc.collect()
    summary = summarize(rows)
    summary += overall(summary, rows)
    for r in summary:
        r["identical_batched"] = batched.get(r["config"]) if r["category"] == "all" else None
    plain_runs = [r["tok_s"] for r in rows if r["config"] == "plain"]
    plain_tok_s = sum(plain_runs) / len(plain_runs)
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10
    limit = bandwidth * 1e9 / target_bytes
    cols = ["config", "category", "prompts", "tok_s", "plain_tok_s", "speedup_vs_plain", "acceptance",
            "mean_accepted", "tokens_per_pass", "identical_to_plain", "identical_batched"]
    print(table(summary, cols))
    print(f"plain: {plain_tok_s:.1f} tok/s = {plain_tok_s / limit:.0%} of the bandwidth limit ({limit:.1f} tok/s: "
          f"{target_bytes / 1e6:.0f} MB of target weights per token at {bandwidth:.1f} GB/s); peak RSS "
          f"{peak_rss:.0f} MiB (every config loaded in turn, plain kept)")
    path = save(args.name, {"machine": info, "bandwidth_gbs": bandwidth, "args": vars(args), "loads": loads,
                            "target_weight_bytes_per_token": target_bytes, "plain_tok_s": plain_tok_s,
                            "bandwidth_limit_tok_s": limit, "peak_rss_mib": peak_rss, "summary": summary,
                            "rows": [{k: v for k, v in r.items() if k not in ("token_ids", "plain_ids")}
                                     for r in rows]})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
