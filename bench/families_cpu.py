"""The families whose layers differ from Llama's in RoPE or scaling, at their real shapes, against llama.cpp on the same
GGUF: SmolLM3-3B (every 4th of 36 layers without RoPE), Phi-4-mini (RoPE over 96 of each head's 128 dims, longrope,
fused q/k/v and gate/up), Granite-3.3-2B (embedding, attention, residual and logit multipliers), OLMo-2-1B (norms
after attention and the MLP only, whole-q/k norms) and Gemma-2-2B (norms around attention and the MLP, soft-capped
attention scores and logits, 256-wide heads, a 256,000-token vocabulary). Each is a random-weight model of the released
config's sizes and vocabulary (tied embeddings where the release ties them: all but OLMo 2), written as F16 with
gguf-py a tensor at a time, quantized to Q4_K_M by llama.cpp's own quantizer (llama-cpp-python's
``llama_model_quantize``), the F16 source then deleted. The tokenizer is the packaged SmolLM2's (below 151,936 tokens)
or Qwen2.5's, padded with control tokens to the shape's vocabulary.

Per family, with greedy decoding of ``--tokens`` tokens after each of ``--prompts`` HumanEval prompts (prefill
included): quickdraft (default weights: each tensor at the file's own type, the fused C layers) and llama.cpp
(llama-cpp-python, built natively), both loaded, each prompt run by both back to back in an order that turns with
every prompt (this shared host's bandwidth drifts); tokens/s, decode tokens/s (after the first token), the bytes a
token reads (quickdraft's ``step_weight_bytes``; llama.cpp: the file's, ``gguf_step_bytes``), each engine's decode
share of the read-bandwidth limit (bandwidth measured in the same run). Greedy tokens are not compared: the weights
repeat slices of one pool, so many logits tie exactly, and the engines' int8 activations break ties their own ways;
the layout is checked against llama.cpp's float32 logits by tests/test_families_converted.py.

Usage: python bench/families_cpu.py [--families smollm3,phi4-mini,granite,olmo2,gemma2] [--tokens 64] [--prompts 3]
       [--name families_cpu]
Prints a table and the process's peak RSS (both engines loaded at once), and writes bench/results/<name>.json.
Needs llama-cpp-python (pip install quickdraft[llamacpp]) and about 8 GB of free disk for the largest F16 source.
"""
from __future__ import annotations

import argparse
import gc
import math
import resource
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import gguf_step_bytes, humaneval_prompts, machine, memory_bandwidth_gbs, save, table  # noqa: E402
from cpu_vs_llamacpp import llamacpp_runner, prompt_ids, quickdraft_runner  # noqa: E402
from gguf_files import (add_metadata, add_shape_keys, folder, pool_slice, quantized_from_f16,  # noqa: E402
                        write_streamed)

from quickdraft.loading import resolve_model  # noqa: E402
from quickdraft.loading.gguf_metadata import read_header  # noqa: E402

FAMILIES = {  # the released configs' sizes
    "smollm3": dict(arch="smollm3", model="SmolLM3-3B", hidden=2048, layers=36, heads=16, kv_heads=4, head_dim=128,
                    ffn=11008, vocab=128256, rope_base=5e6, context=65536, eps=1e-6),
    "phi4-mini": dict(arch="phi3", model="Phi-4-mini", hidden=3072, layers=32, heads=24, kv_heads=8, head_dim=128,
                      ffn=8192, vocab=200064, rope_base=1e4, context=131072, eps=1e-5, rotary=96, original=4096),
    "granite": dict(arch="granite", model="Granite-3.3-2B", hidden=2048, layers=40, heads=32, kv_heads=8, head_dim=64,
                    ffn=8192, vocab=49159, rope_base=1e7, context=131072, eps=1e-5),
    "olmo2": dict(arch="olmo2", model="OLMo-2-1B", hidden=2048, layers=16, heads=16, kv_heads=16, head_dim=128,
                  ffn=8192, vocab=100352, rope_base=5e5, context=4096, eps=1e-6),
    "gemma2": dict(arch="gemma2", model="Gemma-2-2B", hidden=2304, layers=26, heads=8, kv_heads=4, head_dim=256,
                   ffn=9216, vocab=256000, rope_base=1e4, context=8192, eps=1e-6, window=4096, caps=(50.0, 30.0)),
}
GRANITE_SCALES = dict(embedding=12.0, attention=0.015625, residual=0.22, logit=8.0)


def padded_tokenizer(vocab: int) -> dict:
    """The packaged SmolLM2's (or, for a vocabulary past Qwen's 151,936, Qwen2.5's) tokenizer keys, padded with
    control tokens to ``vocab``."""
    source = "qwen2.5-coder-0.5b" if vocab >= 151936 else "smollm2-135m"
    tokenizer = {k: v for k, v in read_header(resolve_model(source)).metadata.items() if k.startswith("tokenizer.")}
    pad = vocab - len(tokenizer["tokenizer.ggml.tokens"])
    tokenizer["tokenizer.ggml.tokens"] = tokenizer["tokenizer.ggml.tokens"] + [f"<|pad_{i}|>" for i in range(pad)]
    tokenizer["tokenizer.ggml.token_type"] = tokenizer["tokenizer.ggml.token_type"] + [3] * pad
    return tokenizer


def build_f16(path: Path, name: str) -> Path:
    """The family's F16 source, a tensor at a time (weights repeat slices of one random pool: their values do not
    matter for speed), with the family's own keys and tensors."""
    from gguf import GGUFWriter

    s, rng = FAMILIES[name], np.random.default_rng(0)
    pool = (rng.standard_normal(1 << 25, dtype=np.float32) * 0.02).astype(np.float16)
    w = GGUFWriter(str(path.with_suffix(".tmp")), s["arch"])
    add_shape_keys(w, s, s["layers"], context=s["context"], rope_base=s["rope_base"], eps=s["eps"])
    w.add_file_type(1)
    add_metadata(w, padded_tokenizer(s["vocab"]))
    d, hd, f = s["hidden"], s["head_dim"], s["ffn"]
    q, kv = s["heads"] * hd, s["kv_heads"] * hd
    tensors: list[tuple[str, tuple[int, ...], str]] = [("token_embd.weight", (s["vocab"], d), "w"),
                                                       ("output_norm.weight", (d,), "norm")]
    if name == "olmo2":  # the one release here whose head is not its embedding table
        tensors.append(("output.weight", (s["vocab"], d), "w"))
    if name == "phi4-mini":
        half = s["rotary"] // 2
        scale = s["context"] / s["original"]
        w.add_rope_dimension_count(s["rotary"])
        w.add_rope_scaling_orig_ctx_len(s["original"])
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(s["original"])))
        tensors += [("rope_factors_long.weight", (half,), "long"), ("rope_factors_short.weight", (half,), "short")]
    if name == "granite":
        g = GRANITE_SCALES
        w.add_embedding_scale(g["embedding"])
        w.add_attention_scale(g["attention"])
        w.add_residual_scale(g["residual"])
        w.add_logit_scale(g["logit"])
    if name == "gemma2":
        w.add_sliding_window(s["window"])
        w.add_attn_logit_softcapping(s["caps"][0])
        w.add_final_logit_softcapping(s["caps"][1])
    for i in range(s["layers"]):
        p = f"blk.{i}."
        if name == "gemma2":  # norms before and after attention and the MLP
            tensors += [(p + "post_attention_norm.weight", (d,), "norm"), (p + "post_ffw_norm.weight", (d,), "norm")]
        if name == "olmo2":  # norms after attention and the MLP, q and k normed whole
            tensors += [(p + "post_attention_norm.weight", (d,), "norm"), (p + "post_ffw_norm.weight", (d,), "norm"),
                        (p + "attn_q_norm.weight", (q,), "norm"), (p + "attn_k_norm.weight", (kv,), "norm")]
        else:
            tensors += [(p + "attn_norm.weight", (d,), "norm"), (p + "ffn_norm.weight", (d,), "norm")]
        tensors += [(p + "attn_output.weight", (d, q), "w"), (p + "ffn_down.weight", (d, f), "w")]
        if name == "phi4-mini":  # fused, as the released Phi checkpoints and their GGUFs store them
            tensors += [(p + "attn_qkv.weight", (q + 2 * kv, d), "w"), (p + "ffn_up.weight", (2 * f, d), "w")]
        else:
            tensors += [(p + "attn_q.weight", (q, d), "w"), (p + "attn_k.weight", (kv, d), "w"),
                        (p + "attn_v.weight", (kv, d), "w"), (p + "ffn_gate.weight", (f, d), "w"),
                        (p + "ffn_up.weight", (f, d), "w")]

    def data(shape: tuple[int, ...], kind: str, index: int) -> np.ndarray:
        if kind == "norm":
            return np.ones(shape, dtype=np.float32)
        if kind in ("long", "short"):
            return (1.0 + (np.arange(shape[0], dtype=np.float32) * (0.5 if kind == "long" else 0.02)))
        return pool_slice(pool, shape, index)

    return write_streamed(w, path, tensors, data)


def model_file(name: str) -> Path:
    return quantized_from_f16(folder() / f"{name}-shape-Q4_K_M.gguf", lambda source: build_f16(source, name))


def run_family(name: str, args: argparse.Namespace, bandwidth: float) -> list[dict]:
    path = model_file(name)
    print(f"{name}: {path.name}, {path.stat().st_size / 1e9:.2f} GB", flush=True)
    prompts = prompt_ids(str(path), [("humaneval", t) for t in humaneval_prompts(args.prompts)])
    ours = quickdraft_runner(str(path), "", "auto", "plain", args.tokens)
    theirs = llamacpp_runner(str(path), "plain", args.tokens, args.threads)
    engines = {"quickdraft": ours, "llama.cpp": theirs}
    runs: dict[str, list[dict]] = {e: [] for e in engines}
    for p, (cat, ids) in enumerate(prompts):
        for engine in (list(engines) if p % 2 == 0 else list(engines)[::-1]):
            runs[engine].append(engines[engine](cat, ids))
        print(f"  prompt {p + 1}/{len(prompts)}: " + ", ".join(
            f"{e} {runs[e][-1]['decode_tok_s']:.2f}" for e in engines), flush=True)
    del ours, theirs, engines
    gc.collect()
    nbytes = {"quickdraft": runs["quickdraft"][0]["weight_bytes"], "llama.cpp": gguf_step_bytes(path)}
    rows = []
    for engine, results in runs.items():
        tok_s = statistics.mean(r["tok_s"] for r in results)
        rows.append(dict(family=FAMILIES[name]["model"], engine=engine, tok_s=tok_s,
                         decode_tok_s=statistics.mean(r["decode_tok_s"] for r in results),
                         step_gb=nbytes[engine] / 1e9))
        rows[-1]["decode_of_limit"] = rows[-1]["decode_tok_s"] * nbytes[engine] / bandwidth
    rows[0]["ratio"] = rows[0]["tok_s"] / rows[1]["tok_s"]
    rows[0]["decode_ratio"] = rows[0]["decode_tok_s"] / rows[1]["decode_tok_s"]
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--name", default="families_cpu")
    args = ap.parse_args()
    names = args.families.split(",")
    unknown = sorted(set(names) - set(FAMILIES))
    if unknown:
        raise SystemExit(f"unknown families {unknown}; known: {', '.join(FAMILIES)}")
    bandwidth = memory_bandwidth_gbs() * 1e9
    rows = [row for name in names for row in run_family(name, args, bandwidth)]
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # KiB -> GB
    columns = ["family", "engine", "tok_s", "decode_tok_s", "ratio", "decode_ratio", "step_gb", "decode_of_limit"]
    print(f"\nQ4_K_M, {args.tokens} greedy tokens x {args.prompts} HumanEval prompts, read bandwidth "
          f"{bandwidth / 1e9:.1f} GB/s\n" + table(rows, columns)
          + f"\npeak RSS of the process (both engines of the largest family loaded): {peak:.2f} GB")
    out = save(args.name, {"machine": machine(), "args": vars(args), "bandwidth_gb_s": bandwidth / 1e9, "rows": rows,
                           "peak_rss_gb": peak})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
