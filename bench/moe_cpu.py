"""A mixture of experts on the CPU against llama.cpp, on the same GGUF: a random-weight model with Qwen3-30B-A3B's
layer shape (hidden 2048, 128 experts, 8 chosen per token, expert width 768, 32 query / 4 key-value heads of 128,
Qwen's 151,936-token vocabulary), in llama.cpp's Q4_K_M, as many layers as ``--layers`` says; or, with
``--family gpt-oss``, gpt-oss-20b's (hidden 2880, 32 experts, 4 chosen, expert width 2880, 64 query / 8 key-value
heads of 64, a 128-token window on every other layer, sinks and biases, 201,088 tokens) in the released GGUF's types:
experts MXFP4, the other matrices Q8_0, norms, biases and sinks F32.

Usage: python bench/moe_cpu.py [--family qwen3moe|gpt-oss] [--layers 24] [--tokens 64] [--prompts 4] [--name moe_cpu]
Builds the file once, in the cache's bench-files folder. Qwen3-MoE: an F16 file written with gguf-py, quantized by
llama.cpp's own quantizer (llama-cpp-python's ``llama_model_quantize``), the F16 source then deleted; the layer count
is bounded by the disk the F16 source needs (1.25 GB a layer) as much as by memory (the Q4_K_M file, 0.37 GB a layer,
must stay in the page cache for either engine). gpt-oss: random blocks written in their types directly (0.45 GB a
layer; llama.cpp's quantizer has no MXFP4 target for float experts). The tokenizer is the packaged Qwen2.5's, padded
with control tokens to the shape's vocabulary. Then, with greedy decoding of ``--tokens`` tokens after each of ``--prompts``
HumanEval prompts (prefill included):
- quickdraft (default weights: each tensor at its own type) and llama.cpp (llama-cpp-python, built natively), tokens/s
  side by side (prefill included, and decode alone: tokens after the first over the time after the first), each
  against the bandwidth limit of the bytes a token reads (measured read bandwidth / bytes);
- the bytes a token reads: quickdraft's own account (``step_weight_bytes``: the dense parts plus 8 of 128 experts)
  beside the file's (``planned_step_bytes``, from the header alone);
- the cost of a verify pass of 5 tokens against a one-token step (median of 15 each; a verify pass reads the union
  of its tokens' experts);
- quickdraft with n-gram speculation (k adaptive) against plain: never below 0.95x (random weights rarely repeat, so
  the controller should draft little).
Both engines stay loaded and each prompt is run by the three configurations back to back, their order turning with
every prompt, so that this shared host's drift (its read bandwidth moves by 2x within minutes) falls on all alike.
Prints tables and writes bench/results/<name>.json.
"""
from __future__ import annotations

import argparse
import gc
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import humaneval_prompts, machine, memory_bandwidth_gbs, save, table  # noqa: E402
from cpu_vs_llamacpp import llamacpp_runner, prompt_ids, quickdraft_runner  # noqa: E402
from gguf_files import (add_metadata, add_qwen_tokenizer, add_shape_keys, folder, pool_slice,  # noqa: E402
                        quantized_from_f16, write_streamed)

from quickdraft import LLM  # noqa: E402
from quickdraft.loading import resolve_model  # noqa: E402
from quickdraft.loading.gguf_metadata import read_header  # noqa: E402
from quickdraft.kv import ForwardItem, SequenceKV  # noqa: E402
from quickdraft.loading.quantize import planned_step_bytes  # noqa: E402
from quickdraft.models import step_weight_bytes  # noqa: E402

SHAPE = dict(hidden=2048, experts=128, used=8, expert_ffn=768, ffn=6144, heads=32, kv_heads=4, head_dim=128,
             vocab=151936)
GPT_OSS = dict(hidden=2880, experts=32, used=4, expert_ffn=2880, ffn=2880, heads=64, kv_heads=8, head_dim=64,
               vocab=201088, window=128)


def build_f16(path: Path, layers: int) -> Path:
    """The F16 source, written a tensor at a time (never the whole model in memory); weights repeat slices of one
    random pool (their values do not matter for speed), routers are random per layer."""
    from gguf import GGUFWriter

    s, rng = SHAPE, np.random.default_rng(0)
    pool = (rng.standard_normal(1 << 25, dtype=np.float32) * 0.02).astype(np.float16)
    w = GGUFWriter(str(path.with_suffix(".tmp")), "qwen3moe")
    add_shape_keys(w, s, layers, context=40960, rope_base=1e6, eps=1e-6)
    w.add_file_type(1)
    add_qwen_tokenizer(w)
    d, e, f, hd = s["hidden"], s["experts"], s["expert_ffn"], s["head_dim"]
    q, kv = s["heads"] * hd, s["kv_heads"] * hd
    tensors: list[tuple[str, tuple[int, ...], str]] = [("token_embd.weight", (s["vocab"], d), "w"),
                                                       ("output_norm.weight", (d,), "norm"),
                                                       ("output.weight", (s["vocab"], d), "w")]
    for i in range(layers):
        p = f"blk.{i}."
        tensors += [(p + "attn_norm.weight", (d,), "norm"), (p + "attn_q.weight", (q, d), "w"),
                    (p + "attn_k.weight", (kv, d), "w"), (p + "attn_v.weight", (kv, d), "w"),
                    (p + "attn_output.weight", (d, q), "w"), (p + "attn_q_norm.weight", (hd,), "norm"),
                    (p + "attn_k_norm.weight", (hd,), "norm"), (p + "ffn_norm.weight", (d,), "norm"),
                    (p + "ffn_gate_inp.weight", (e, d), "router"), (p + "ffn_gate_exps.weight", (e, f, d), "w"),
                    (p + "ffn_up_exps.weight", (e, f, d), "w"), (p + "ffn_down_exps.weight", (e, d, f), "w")]

    def data(shape: tuple[int, ...], kind: str, index: int) -> np.ndarray:
        if kind == "norm":
            return np.ones(shape, dtype=np.float32)
        if kind == "router":
            return rng.standard_normal(shape, dtype=np.float32)
        return pool_slice(pool, shape, index)

    return write_streamed(w, path, tensors, data)


def build_gpt_oss(path: Path, layers: int) -> Path:
    """gpt-oss-20b's shape in its released GGUF's types, random blocks written as they are: MXFP4 experts (exponents
    2^-10..2^-8: weights of a few thousandths, at most 0.023), Q8_0 attention, embedding and head (scale 2^-13,
    weights of about 0.009), random F32 routers and biases, zero sinks, YaRN as the released file (factor 32 over 4,096 positions)."""
    from gguf import GGMLQuantizationType as QT, GGUFWriter, RopeScalingType

    s, rng = GPT_OSS, np.random.default_rng(0)
    w = GGUFWriter(str(path.with_suffix(".tmp")), "gpt-oss")
    add_shape_keys(w, s, layers, context=131072, rope_base=150000.0, eps=1e-5)
    w.add_rope_scaling_type(RopeScalingType.YARN)
    w.add_rope_scaling_factor(32.0)
    w.add_rope_scaling_orig_ctx_len(4096)
    w.add_sliding_window(s["window"])
    tokenizer = {k: v for k, v in read_header(resolve_model("qwen2.5-coder-0.5b")).metadata.items()
                 if k.startswith("tokenizer.")}
    pad = s["vocab"] - len(tokenizer["tokenizer.ggml.tokens"])
    tokenizer["tokenizer.ggml.tokens"] = tokenizer["tokenizer.ggml.tokens"] + [f"<|pad_{i}|>" for i in range(pad)]
    tokenizer["tokenizer.ggml.token_type"] = tokenizer["tokenizer.ggml.token_type"] + [3] * pad  # control tokens
    add_metadata(w, tokenizer)
    d, e, f, hd, v = s["hidden"], s["experts"], s["expert_ffn"], s["head_dim"], s["vocab"]
    q, kv = s["heads"] * hd, s["kv_heads"] * hd
    tensors: list[tuple[str, tuple[int, ...], object]] = [("token_embd.weight", (v, d), QT.Q8_0),
                                                          ("output_norm.weight", (d,), "ones"),
                                                          ("output.weight", (v, d), QT.Q8_0)]
    for i in range(layers):
        p = f"blk.{i}."
        tensors += [(p + "attn_norm.weight", (d,), "ones"), (p + "post_attention_norm.weight", (d,), "ones"),
                    (p + "attn_sinks.weight", (s["heads"],), "zeros")]
        for name, rows, cols in (("attn_q", q, d), ("attn_k", kv, d), ("attn_v", kv, d), ("attn_output", d, q)):
            tensors += [(p + name + ".weight", (rows, cols), QT.Q8_0), (p + name + ".bias", (rows,), "small")]
        tensors += [(p + "ffn_gate_inp.weight", (e, d), "router"), (p + "ffn_gate_inp.bias", (e,), "small")]
        for name, rows, cols in (("ffn_gate_exps", f, d), ("ffn_up_exps", f, d), ("ffn_down_exps", d, f)):
            tensors += [(p + name + ".weight", (e, rows, cols), QT.MXFP4), (p + name + ".bias", (e, rows), "small")]

    def data(shape: tuple[int, ...], kind: object) -> np.ndarray:
        if kind in ("ones", "zeros"):
            return (np.ones if kind == "ones" else np.zeros)(shape, dtype=np.float32)
        if kind in ("router", "small"):
            return rng.standard_normal(shape, dtype=np.float32) * (1.0 if kind == "router" else 0.01)
        blocks = rng.integers(0, 256, (int(np.prod(shape)) // 32, 17 if kind == QT.MXFP4 else 34), dtype=np.uint8)
        if kind == QT.MXFP4:
            blocks[:, 0] = rng.integers(117, 120, blocks.shape[0], dtype=np.uint8)  # the exponent byte
        else:
            blocks[:, :2] = np.frombuffer(np.float16(2.0 ** -13).tobytes(), dtype=np.uint8)  # the scale
        return blocks.reshape(*shape[:-1], -1)

    for name, shape, kind in tensors:
        if isinstance(kind, str):
            w.add_tensor_info(name, shape, np.dtype(np.float32), int(np.prod(shape)) * 4)
        else:
            per_row = shape[-1] // 32 * (17 if kind == QT.MXFP4 else 34)
            w.add_tensor_info(name, (*shape[:-1], per_row), np.dtype(np.uint8),
                              int(np.prod(shape[:-1])) * per_row, raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, shape, kind in tensors:
        w.write_tensor_data(data(shape, kind))
    w.close()
    path.with_suffix(".tmp").replace(path)
    return path


def model_file(family: str, layers: int) -> Path:
    if family == "gpt-oss":
        out = folder() / f"gpt-oss-20b-shape-{layers}l-MXFP4.gguf"
        return out if out.is_file() else build_gpt_oss(out, layers)
    return quantized_from_f16(folder() / f"qwen3moe-30b-a3b-shape-{layers}l-Q4_K_M.gguf",
                              lambda source: build_f16(source, layers))


def verify_cost(path: Path, repeats: int = 15) -> dict:
    """Median seconds of a one-token step and a 5-token verify pass after a 64-token context (batch 1)."""
    llm = LLM(str(path), kv_cache_memory="256MiB")
    runner = llm.loaded.engine.target
    kv = SequenceKV()
    runner.forward([ForwardItem(kv, list(range(1000, 1064)), 1)])
    start, out = kv.num_cached, {}
    for n in (1, 5):
        seconds = []
        for i in range(repeats + 2):
            runner.forward([ForwardItem(kv, [2000 + 17 * i + j for j in range(n)], n)])  # other tokens each time
            runner.truncate(kv, start)
            seconds.append(runner.last_forward_s)
        out[f"step_{n}_ms"] = 1000 * statistics.median(seconds[2:])
    out["verify5_over_step"] = out["step_5_ms"] / out["step_1_ms"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--family", choices=("qwen3moe", "gpt-oss"), default="qwen3moe")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--name", default="moe_cpu")
    args = ap.parse_args()
    path = model_file(args.family, args.layers)
    size = path.stat().st_size
    print(f"model: {path.name}, {size / 1e9:.2f} GB", flush=True)
    texts = [("humaneval", t) for t in humaneval_prompts(args.prompts)]
    prompts = prompt_ids(str(path), texts)
    bandwidth = memory_bandwidth_gbs() * 1e9
    # both engines loaded at once (one mapped file, shared pages), each prompt run by the three configurations back
    # to back in an order that turns with every prompt: a drift of this shared host falls on all of them alike
    ours = quickdraft_runner(str(path), "", "auto", "ngram", args.tokens)
    theirs = llamacpp_runner(str(path), "plain", args.tokens, args.threads)
    configs = {("quickdraft", "plain"): lambda cat, ids: ours(cat, ids, speculative=False),
               ("llama.cpp", "plain"): theirs, ("quickdraft", "ngram"): ours}
    results: dict[tuple[str, str], list[dict]] = {config: [] for config in configs}
    for p, (cat, ids) in enumerate(prompts):
        order = list(configs)[p % 3:] + list(configs)[:p % 3]
        for config in order:
            results[config].append(configs[config](cat, ids))
        print(f"prompt {p + 1}/{len(prompts)}: " + ", ".join(
            f"{' '.join(c)} {results[c][-1]['decode_tok_s']:.2f}" for c in configs), flush=True)
    rows = []
    for (engine, mode), runs in results.items():
        tok_s, nbytes = statistics.mean(r["tok_s"] for r in runs), runs[0]["weight_bytes"]
        rows.append(dict(engine=engine, mode=mode, tok_s=tok_s,
                         decode_tok_s=statistics.mean(r["decode_tok_s"] for r in runs), step_gb=nbytes / 1e9,
                         limit_tok_s=bandwidth / nbytes, of_limit=tok_s * nbytes / bandwidth,
                         tokens_per_pass=statistics.mean(r.get("tokens_per_pass") or 1.0 for r in runs)))
    same = sum(a["token_ids"] == b["token_ids"] for a, b in zip(results[("quickdraft", "plain")],
                                                                results[("quickdraft", "ngram")]))
    del ours, theirs, configs
    gc.collect()
    plain = {r["engine"]: r["tok_s"] for r in rows if r["mode"] == "plain"}
    decode = {r["engine"]: r["decode_tok_s"] for r in rows if r["mode"] == "plain"}
    ngram = next(r["tok_s"] for r in rows if r["mode"] == "ngram")
    llm = LLM(str(path), kv_cache_memory="64MiB")
    step_bytes, planned = step_weight_bytes(llm.model), planned_step_bytes(path)
    del llm
    gc.collect()
    cost = verify_cost(path)
    summary = dict(layers=args.layers, file_gb=size / 1e9, bandwidth_gb_s=bandwidth / 1e9,
                   quickdraft_over_llamacpp=plain["quickdraft"] / plain["llama.cpp"],
                   decode_quickdraft_over_llamacpp=decode["quickdraft"] / decode["llama.cpp"],
                   ngram_over_plain=ngram / plain["quickdraft"], ngram_outputs_equal_plain=f"{same}/{len(prompts)}",
                   step_bytes_quickdraft=step_bytes, step_bytes_file=planned, bytes_ratio=step_bytes / planned, **cost)
    shape = "gpt-oss-20b's layer shape, MXFP4 experts" if args.family == "gpt-oss" else \
        "Qwen3-30B-A3B layer shape, Q4_K_M"
    print(f"\n{shape}, {args.layers} layers, {args.tokens} greedy tokens x {args.prompts} HumanEval prompts\n"
          + table(rows, list(rows[0])) + "\n\n" + table([summary], list(summary)))
    out = save(args.name, {"machine": machine(), "args": vars(args), "model": path.name, "rows": rows,
                           "summary": summary})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
