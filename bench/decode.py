"""Plain greedy decode speed: quickdraft vs HF transformers on the same GGUF weights, vs the bandwidth limit.

Usage: python bench/decode.py [--models smollm2-135m,qwen2.5-coder-0.5b,qwen2.5-coder-1.5b]
                              [--dtypes float32,bfloat16] [--tokens 64] [--prompts 2] [--no-hf]
Prompts: the first N public HumanEval prompts. Decode tokens/s excludes the prefill (first token).
"""
from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (TimingStreamer, humaneval_prompts, machine, memory_bandwidth_gbs, save, table,  # noqa: E402
                    weight_bytes_per_token)

from quickdraft import LLM, SamplingParams  # noqa: E402
from quickdraft.loading import resolve_model  # noqa: E402


def bench_quickdraft(model: str, dtype: str, prompts: list[str], tokens: int) -> tuple[float, int, list[list[int]]]:
    llm = LLM(model, dtype=dtype, weights=dtype)  # float weights, as HF's (the default would run the file's own)
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    llm.generate([prompts[0]], SamplingParams(max_tokens=4, temperature=0.0))  # warm-up
    speeds, outputs = [], []
    for p in prompts:
        out = llm.generate([p], params)[0]
        speeds.append(out.metrics.tokens_per_s)
        outputs.append(out.token_ids)
    nbytes = weight_bytes_per_token(llm.model)
    del llm
    gc.collect()
    return sum(speeds) / len(speeds), nbytes, outputs


def bench_hf(model: str, dtype: str, prompts: list[str], tokens: int) -> tuple[float, list[list[int]]]:
    import transformers
    path = resolve_model(model)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                           dtype=getattr(torch, dtype)).eval()
    tok = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    speeds, outputs = [], []
    with torch.inference_mode():
        hf.generate(**tok(prompts[0], return_tensors="pt"), max_new_tokens=4, do_sample=False)
        for p in prompts:
            inputs = tok(p, return_tensors="pt")
            streamer = TimingStreamer()
            out = hf.generate(**inputs, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                              streamer=streamer, pad_token_id=tok.eos_token_id)
            speeds.append(streamer.decode_tokens_per_s())
            outputs.append(out[0, inputs["input_ids"].shape[1]:].tolist())
    del hf
    gc.collect()
    return sum(speeds) / len(speeds), outputs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="smollm2-135m,qwen2.5-coder-0.5b,qwen2.5-coder-1.5b")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--no-hf", action="store_true", help="skip the HF transformers baseline")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    bandwidth = memory_bandwidth_gbs()
    info = machine()
    print(f"machine: {info['cpu']}, {info['cores']} cores, torch {info['torch']}, {args.threads} threads; "
          f"measured read bandwidth {bandwidth:.1f} GB/s")
    prompts = humaneval_prompts(args.prompts)
    rows = []
    for model in args.models.split(","):
        for dtype in args.dtypes.split(","):
            ours, nbytes, our_ids = bench_quickdraft(model, dtype, prompts, args.tokens)
            limit = bandwidth * 1e9 / nbytes
            row = {"model": model, "dtype": dtype, "weights_GB_per_token": nbytes / 1e9,
                   "quickdraft_tok_s": ours, "bandwidth_limit_tok_s": limit, "pct_of_limit": 100 * ours / limit,
                   "quickdraft_GB_s": ours * nbytes / 1e9}
            if not args.no_hf:
                hf, hf_ids = bench_hf(model, dtype, prompts, args.tokens)
                row.update(hf_tok_s=hf, speedup_vs_hf=ours / hf if hf else None,
                           same_tokens_as_hf=sum(a == b for a, b in zip(our_ids, hf_ids)))
            rows.append(row)
            print(table([row], list(row)), flush=True)
    cols = ["model", "dtype", "quickdraft_tok_s", "hf_tok_s", "speedup_vs_hf", "bandwidth_limit_tok_s",
            "pct_of_limit", "quickdraft_GB_s", "same_tokens_as_hf"]
    print("\n" + table(rows, cols))
    path = save("decode", {"machine": info, "bandwidth_GB_s": bandwidth, "tokens": args.tokens,
                           "prompts": f"first {args.prompts} public HumanEval prompts", "results": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
