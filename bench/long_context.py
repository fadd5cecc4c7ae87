"""Decode speed as the context grows: quickdraft beside llama.cpp on the same GGUF, greedy, in one run.

For each context length the prompt is that many tokens of held-out HumanEval problems (from problem 20 on, so not
the prompts the other benchmarks use); each engine then decodes --tokens new tokens. The decode rate runs from the
first streamed token to the last (prefill excluded), as llama.cpp and vLLM report it. Beside it: the bytes one
decode step reads (the weights plus the KV cache of the whole context, in the engine's cache format) and the rate
those bytes allow at the measured memory bandwidth.

Each context is a prefix of the next one, and both engines keep what they cached of the last prompt (quickdraft's
prefix cache, llama.cpp's reuse of the previous prompt's KV), so a run prefills the longest context once per
engine; ttft_s is then the time to prefill the part that was new.

    python bench/long_context.py --model qwen2.5-coder-0.5b --contexts 128,1024,4096
    python bench/long_context.py --model qwen2.5-coder-1.5b --configs plain,plain:int8,ngram,draft --contexts 128,4096,8192
    python bench/long_context.py --model qwen2.5-coder-0.5b --llamacpp-kv f16,q8_0   # llama.cpp's cache formats
"""
from __future__ import annotations

import argparse
import gc
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import BENCH_DATA, machine, memory_bandwidth_gbs, save, table, weight_bytes_per_token  # noqa: E402

from quickdraft import LLM, SamplingParams  # noqa: E402
from quickdraft.loading import resolve_model  # noqa: E402

HELD_OUT_FROM = 20  # HumanEval problems before this one are the other benchmarks' prompts


def context_ids(llm: LLM, length: int) -> list[int]:
    """``length`` tokens of held-out HumanEval problems, one after another."""
    import json

    rows = [json.loads(line) for line in (BENCH_DATA / "humaneval.public.jsonl").read_text().splitlines()]
    ids: list[int] = []
    for row in rows[HELD_OUT_FROM:] * 4:
        ids += llm.tokenizer.encode(row["prompt"] + row["canonical_solution"] + "\n\n", add_special_tokens=False)
        if len(ids) >= length:
            return ids[:length]
    raise ValueError(f"the HumanEval problems hold fewer than {length} tokens")


def kv_bytes_per_token(llm: LLM) -> int:
    """KV bytes one token of context takes in the target's cache (what a decode step reads per token of context)."""
    runner = llm.target
    return runner.bytes_per_block // runner.block_size


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def quickdraft_rate(llm: LLM, ids: list[int], tokens: int) -> dict:
    out = llm.generate([ids], SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True))[0]
    spec = out.metrics.spec
    return {"tok_s": out.metrics.tokens_per_s, "token_ids": out.token_ids, "ttft_s": out.metrics.ttft_s,
            "acceptance": spec.acceptance_rate if spec.draft_tokens else None}


def llamacpp_rate(llm, ids: list[int], tokens: int) -> dict:
    t0 = time.perf_counter()
    stamps, out = [], []
    for tok in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
        stamps.append(time.perf_counter())
        out.append(tok)
        if len(out) >= tokens:
            break
    rate = (len(out) - 1) / (stamps[-1] - stamps[0]) if len(out) > 1 else 0.0
    return {"tok_s": rate, "token_ids": out, "ttft_s": stamps[0] - t0, "acceptance": None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b")
    ap.add_argument("--contexts", default="128,1024,4096")
    ap.add_argument("--configs", default="plain",
                    help="comma-separated MODE[:KV_CACHE_DTYPE], MODE one of plain, ngram, draft; e.g. plain,plain:int8")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--llamacpp-kv", default="f16", help="llama.cpp cache types to run beside (f16, q8_0), or none")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="long_context")
    args = ap.parse_args()
    contexts = sorted(int(c) for c in args.contexts.split(","))
    longest = max(contexts) + args.tokens + 64
    bandwidth = memory_bandwidth_gbs()
    engines: dict[str, object] = {}
    for config in args.configs.split(","):
        mode, _, kv_dtype = config.partition(":")
        options = {"draft": args.draft} if mode == "draft" else {"speculative": "ngram"} if mode == "ngram" else {}
        engines[f"quickdraft/{mode}/{kv_dtype or 'auto'}"] = LLM(args.model, max_model_len=longest,
                                                                kv_cache_dtype=kv_dtype or "auto", **options)
    first = next(iter(engines.values()))
    weights = weight_bytes_per_token(first.model)
    kv_per_token = {name: kv_bytes_per_token(engine) for name, engine in engines.items()}
    if args.llamacpp_kv != "none":
        from llama_cpp import GGML_TYPE_F16, GGML_TYPE_Q8_0, Llama

        for kv in args.llamacpp_kv.split(","):
            kv_type = {"f16": GGML_TYPE_F16, "q8_0": GGML_TYPE_Q8_0}[kv]
            engines[f"llama.cpp/{kv}"] = Llama(str(resolve_model(args.model)), n_ctx=longest, n_threads=args.threads,
                                               n_threads_batch=args.threads, type_k=kv_type, type_v=kv_type,
                                               flash_attn=kv != "f16", verbose=False)
            cfg = first.model.config  # llama.cpp's bytes per cached value: f16 2, q8_0 34 per block of 32
            kv_per_token[f"llama.cpp/{kv}"] = int(2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim
                                                  * (2 if kv == "f16" else 34 / 32))
    document = context_ids(first, max(contexts))
    rows = []
    for i, length in enumerate(contexts):
        ids = document[:length]
        names = list(engines)
        for name in names[i % len(names):] + names[:i % len(names)]:  # who goes first rotates with the length
            engine = engines[name]
            result = (quickdraft_rate(engine, ids, args.tokens) if name.startswith("quickdraft")
                      else llamacpp_rate(engine, ids, args.tokens))
            step_bytes = weights + kv_per_token[name] * length
            rows.append({"context": length, "engine": name, "tok_s": result["tok_s"], "ttft_s": result["ttft_s"],
                         "acceptance": result["acceptance"], "read_MB_per_token": step_bytes / 1e6,
                         "bandwidth_limit_tok_s": bandwidth * 1e9 / step_bytes, "token_ids": result["token_ids"]})
            print(f"{length:>6} {name:<20} {result['tok_s']:7.2f} tok/s  ttft {result['ttft_s']:.2f}s", flush=True)
            gc.collect()
    def plain_row(r: dict) -> dict | None:  # quickdraft's plain decode with the same cache format
        kv_dtype = r["engine"].rsplit("/", 1)[-1] if r["engine"].startswith("quickdraft") else "auto"
        return next((p for p in rows if p["context"] == r["context"] and p["engine"] == f"quickdraft/plain/{kv_dtype}"),
                    None)

    shortest = {name: next(r["tok_s"] for r in rows if r["engine"] == name and r["context"] == min(contexts))
                for name in engines}
    for r in rows:
        plain = plain_row(r)
        r["vs_short_context"] = r["tok_s"] / shortest[r["engine"]] if shortest[r["engine"]] else None
        r["vs_quickdraft_plain"] = r["tok_s"] / plain["tok_s"] if plain else None
        r["same_as_plain"] = r["token_ids"] == plain["token_ids"] if plain else None
    print(f"{args.model}, {machine()['cpu']}, {bandwidth:.1f} GB/s read, weights {weights / 1e6:.0f} MB a step, "
          f"KV bytes a token of context: {kv_per_token}")
    print(table(rows, ["context", "engine", "tok_s", "vs_short_context", "vs_quickdraft_plain", "ttft_s",
                       "acceptance", "read_MB_per_token", "bandwidth_limit_tok_s", "same_as_plain"]))
    print(f"peak resident memory of this process (every engine at once): {peak_rss_mib():.0f} MiB")
    for r in rows:
        del r["token_ids"]
    path = save(args.out, {"machine": machine(), "bandwidth_GB_s": bandwidth, "args": vars(args),
                           "weight_bytes_per_step": weights, "kv_bytes_per_token": kv_per_token,
                           "peak_rss_MiB": peak_rss_mib(), "rows": rows})
    chart(rows, args.model, path.with_suffix(".png"))
    print(f"wrote {path}")


def chart(rows: list[dict], model: str, path: Path) -> None:
    """Decode tok/s against context length, one line per engine (dashed: llama.cpp)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install 'quickdraft[bench]'): no chart written", file=sys.stderr)
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for engine in dict.fromkeys(r["engine"] for r in rows):
        points = sorted((r["context"], r["tok_s"]) for r in rows if r["engine"] == engine)
        ax.plot(*zip(*points), marker="o", linestyle="--" if engine.startswith("llama.cpp") else "-", label=engine)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("decode tokens/s")
    ax.set_title(f"{model}: decode speed as the context grows")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
