"""Decode speed on CUDA: plain vs speculative decoding (n-gram lookup, self-speculation, a draft model), greedy.

Usage: python bench/cuda_decode.py [--model PATH] [--draft PATH] [--tokens 128] [--batches 1,8] [--cpu]
         [--name cuda_decode]
--model: a GGUF file or HF directory (default: a tiny random-weight model, which only measures per-step overhead);
float weights in --dtype (auto: bfloat16 on CUDA). --draft: the draft model (default: the target itself, which shows
what a draft pass costs; the output is the same whatever the draft). Three fixed chat prompts (code, a repetitive
summary where n-gram lookup pays, a short answer); at batch 1 each runs alone, at batch B the three are cycled to B
requests in one generate call. tok/s: new tokens / wall time of the generate call (prefill included, the prompts are
short); decode tok/s: per request, tokens after the first / time after the first (mean). Every speculative run is
checked token for token against plain ("same"). --cpu adds plain on the CPU (its default weights) for reference.
Prints a table and writes bench/results/<name>.json, with the device.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, save, table  # noqa: E402

from quickdraft import LLM, SamplingParams  # noqa: E402

PROMPTS = ["Write a Python function that checks whether a number is prime, with a docstring and tests.",
           ("Summarise this text, reusing its words: The cat sat on the mat. The cat sat on the mat because the mat "
            "was warm. The dog watched the cat sit on the warm mat, and the dog wanted the warm mat too."),
           "What is the capital of France? Answer in one sentence."]


def configs(model: str, draft: str) -> dict[str, dict]:
    return {"plain": {}, "ngram": {"speculative": "ngram"}, "ngram-k4": {"speculative": "ngram",
                                                                       "num_speculative_tokens": 4},
            "self": {"speculative": "self"}, "draft-k3": {"draft": draft, "num_speculative_tokens": 3},
            "draft-auto": {"draft": draft}}


def prompt_ids(llm: LLM) -> list:
    if llm.tokenizer.chat_template:
        return [llm.chat_prompt([{"role": "user", "content": p}]) for p in PROMPTS]
    vocab = llm.model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    return [(torch.randint(1, vocab, (12,), generator=g).tolist()) * 3 for _ in PROMPTS]


def run(llm: LLM, prompts: list, batch: int, tokens: int) -> tuple[dict, list[list[int]]]:
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    groups = [[p] for p in prompts] if batch == 1 else [[prompts[i % len(prompts)] for i in range(batch)]]
    outs, seconds = [], 0.0
    llm.generate(groups[0][:1], SamplingParams(max_tokens=8, temperature=0.0))  # warm-up
    stats = llm.spec_stats
    before = (stats.rounds, stats.draft_tokens, stats.accepted_tokens)
    for group in groups:
        llm.reset_prefix_cache()
        torch.cuda.synchronize() if torch.cuda.is_available() else None
        t0 = time.perf_counter()
        outs += llm.generate(group, params)
        torch.cuda.synchronize() if torch.cuda.is_available() else None
        seconds += time.perf_counter() - t0
    new = sum(len(o.token_ids) for o in outs)
    row = {"batch": batch, "tok_s": new / seconds, "decode_tok_s": sum(o.metrics.tokens_per_s for o in outs) / len(outs)}
    if llm.drafter is not None:
        drafted = stats.draft_tokens - before[1]
        row["acceptance"] = (stats.accepted_tokens - before[2]) / drafted if drafted else 0.0
        row["tok_per_pass"] = new / max(1, stats.rounds - before[0])  # rounds: one per sequence per target pass
    return row, [o.token_ids for o in outs]


def tiny_model() -> str:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from conftest import make_tiny_checkpoint
    return str(make_tiny_checkpoint(Path(tempfile.mkdtemp()) / "tiny", vocab_size=512, hidden=256, layers=4))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model")
    ap.add_argument("--draft")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--configs", default=None, help="comma-separated subset of the configs")
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--name", default="cuda_decode")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke test of this script where there is no GPU")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device: this benchmark times quickdraft's CUDA path")
    model = args.model or tiny_model()
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu (smoke test)"
    print(f"device: {device}; torch {torch.__version__}; model: {model}")
    rows, plain = [], {}
    chosen = configs(model, args.draft or model)
    if args.configs:
        chosen = {k: v for k, v in chosen.items() if k in args.configs.split(",")}
    runs = [(name, args.device, kw) for name, kw in chosen.items()] + ([("plain", "cpu", {})] if args.cpu else [])
    for name, dev, kw in runs:
        t0 = time.perf_counter()
        try:
            llm = LLM(model, device=dev, dtype=args.dtype if dev == args.device else "auto", kv_cache_memory="1GiB", **kw)
        except Exception as exc:  # noqa: BLE001 - reported in the table
            rows.append({"config": name, "device": dev, "error": f"{type(exc).__name__}: {exc}"[:200]})
            continue
        load_s = time.perf_counter() - t0
        prompts = prompt_ids(llm)
        for batch in [int(b) for b in args.batches.split(",")] if dev == args.device else [1]:
            try:
                row, ids = run(llm, prompts, batch, args.tokens)
            except Exception as exc:  # noqa: BLE001
                rows.append({"config": name, "device": dev, "batch": batch, "error": f"{type(exc).__name__}: {exc}"[:200]})
                continue
            if name == "plain" and dev == args.device:
                plain[batch] = ids
            row.update(config=name, device=dev, weights=llm.weights, load_s=load_s,
                       same=ids == plain[batch] if name != "plain" and batch in plain else None)
            if name != "plain":
                row["speedup"] = row["tok_s"] / next((r["tok_s"] for r in rows if r["config"] == "plain"
                                                       and r["device"] == dev and r.get("batch") == batch), float("nan"))
            rows.append(row)
            print(table([row], ["config", "device", "batch", "tok_s", "decode_tok_s", "speedup", "acceptance", "same"]))
        del llm
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    columns = ["config", "device", "weights", "batch", "tok_s", "decode_tok_s", "speedup", "acceptance",
               "tok_per_pass", "same", "error"]
    print(f"\n{device}, {args.tokens} new tokens per request, greedy\n" + table(rows, columns))
    path = save(args.name, {"device": device, "model": model, "args": vars(args), "machine": machine(), "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
