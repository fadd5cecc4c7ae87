"""Accuracy and speed of quantized execution (float32, bfloat16, int8, int4) per packaged model.

For each model and weight format:

* logits vs bfloat16: max / mean absolute difference of the next-token logits at every position of the
  text sample, and how often the top-1 token agrees with bfloat16's;
* perplexity on the text sample: the first ``--tokens`` tokens (tokenizer's default special tokens) of
  each of the first ``--articles`` Spec-Bench "summarization" articles
  (bench/data/spec_bench.public.jsonl, the text after "Summarize: ");
* speed of one full-model forward through ``quickdraft.kv.ModelRunner``: a 1-token decode step and a
  5-token verify step (5 logits rows), each after a ``--context``-token prefix (min and median over
  ``--repeats`` rounds; the KV is rewound after each step so the context stays the same), plus a
  ``--prefill``-token prefill. The formats are timed round-robin in one process so that changes in
  machine load (this is a shared machine) hit all of them alike.

Prints a table and writes bench/results/quant_accuracy.json.
Run: .venv/bin/python bench/quant_accuracy.py [--models smollm2-135m,qwen2.5-coder-1.5b] [--threads 2]

``--default-vs-float32``: instead, the proof that the default weights (``LLM(name)``: the file's own precision,
see quickdraft/loading/weight_choice.py) compute the file's own math: against ``LLM(name, weights='float32')``
(float32 weights dequantized from the same file), on the first ``--humaneval`` HumanEval prompts and the first
prompt of ``--spec-bench`` Spec-Bench categories (chat template applied, as the speed benchmarks do), greedy:
how many of the ``--new-tokens`` new tokens are identical, and the max / mean absolute difference and top-1
agreement of the logits at the positions that predict them (both models fed the float32 continuation).
Writes bench/results/default_weights.json.
Run: .venv/bin/python bench/quant_accuracy.py --default-vs-float32 [--models smollm2-135m] [--humaneval 3]
     [--spec-bench 3] [--new-tokens 32]
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from common import BENCH_DATA, humaneval_prompts, spec_bench_prompts  # noqa: E402

from quickdraft import LLM, SamplingParams  # noqa: E402
from quickdraft.models import weight_bytes  # noqa: E402
from quickdraft.kv import ForwardItem, ModelRunner, SequenceKV  # noqa: E402
from quickdraft.engine.build import tokenizer_for  # noqa: E402
from quickdraft.loading import load_checkpoint, resolve_model  # noqa: E402
from quickdraft.loading.quantize import load_model  # noqa: E402
from quickdraft.models import build_model  # noqa: E402
from quickdraft.models.quant_backends import cpu_capability  # noqa: E402

DATA = BENCH_DATA / "spec_bench.public.jsonl"
MODELS = ("smollm2-135m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b")


def articles(n: int) -> list[str]:
    out = []
    with open(DATA) as f:
        for line in f:
            row = json.loads(line)
            if row.get("category") == "summarization":
                text = row["turns"][0]
                out.append(text.removeprefix("Summarize:").strip())
                if len(out) == n:
                    break
    return out


def all_logits(runner: ModelRunner, ids: list[int]) -> torch.Tensor:
    kv = SequenceKV()
    (logits,) = runner.forward([ForwardItem(kv, ids, len(ids))])
    runner.free(kv)
    return logits


def step_times(runner: ModelRunner, context: list[int], n_new: int, repeats: int) -> tuple[float, float]:
    """(min, median) ms of forwarding ``n_new`` tokens after ``context`` (rewound after each step)."""
    kv = SequenceKV()
    runner.forward([ForwardItem(kv, context, 1)])
    new = context[-n_new:]
    times = []
    for i in range(repeats + 2):
        t0 = time.perf_counter()
        runner.forward([ForwardItem(kv, new, n_new)])
        dt = time.perf_counter() - t0
        runner.truncate(kv, len(context))
        if i >= 2:  # warm-up
            times.append(dt * 1e3)
    runner.free(kv)
    return min(times), statistics.median(times)


def build(name: str, fmt: str, ckpt_bf16):
    """``fmt``: float32 | bfloat16 | int8 | int4, optionally with ``/lm=bf16|int8|int4`` (untied lm_head) and
    ``/g=32|64|128`` (int4 group size) and ``/wide=int8`` (int4: keep layers stored with more than 4 bits in the
    GGUF as int8), e.g. ``int4/lm=bf16``."""
    fmt, *opts = fmt.split("/")
    kw = {}
    for o in opts:
        key, _, value = o.partition("=")
        if key == "lm":
            kw["lm_head"] = False if value == "bf16" else value
        elif key == "wide":
            kw["wide_sources"] = value
        elif key == "g":
            kw["group_size"] = int(value)
        else:
            raise SystemExit(f"unknown format option {o!r}")
    if fmt == "float32":
        ckpt = load_checkpoint(name, dtype=torch.float32)  # dense float32 (build_model writes no float weight cache)
        return build_model(ckpt.config, ckpt.tensors), {}
    if fmt in ("int8", "int4"):
        t0 = time.perf_counter()
        model = load_model(ckpt_bf16, fmt, **kw)  # built a layer at a time, from (or into) the quantized cache
        return model, {"quantize_or_cache_load_s": round(time.perf_counter() - t0, 2),
                       "quant_info": model.quant_info}
    return build_model(ckpt_bf16.config, ckpt_bf16.tensors), {}


def run_model(name: str, args) -> dict:
    ckpt = load_checkpoint(name, dtype=torch.bfloat16)
    tok = tokenizer_for(ckpt)
    samples = [tok.encode(t)[: args.tokens] for t in articles(args.articles)]
    context = samples[0][: args.context]
    prefill = (samples[0] * 4)[: args.prefill]
    result = {"model": name, "gguf_quantization": ckpt.quantization, "tokens_per_article": [len(s) for s in samples],
              "formats": {}}
    ref: list[torch.Tensor] | None = None
    runners: dict[str, ModelRunner] = {}
    for fmt in args.formats:
        model, extra = build(name, fmt, ckpt)
        runner = ModelRunner(fmt, model, 256 << 20)
        nll, count, maxd, sumd, nd, agree = 0.0, 0, 0.0, 0.0, 0, 0
        logits_per = []
        with torch.inference_mode():
            for ids in samples:
                lg = all_logits(runner, ids)
                lp = torch.log_softmax(lg[:-1].float(), dim=-1)
                nll -= lp.gather(1, torch.tensor(ids[1:])[:, None]).sum().item()
                count += len(ids) - 1
                logits_per.append(lg)
        if fmt == "bfloat16":
            ref = logits_per
        if ref is not None:
            for a, b in zip(logits_per, ref):
                d = (a - b).abs()
                maxd = max(maxd, d.max().item())
                sumd += d.sum().item()
                nd += d.numel()
                agree += (a.argmax(-1) == b.argmax(-1)).sum().item()
        del logits_per
        entry = {
            "perplexity": round(math.exp(nll / count), 4),
            "logit_max_abs_diff_vs_bf16": round(maxd, 4) if ref is not None else None,
            "logit_mean_abs_diff_vs_bf16": round(sumd / nd, 5) if ref is not None else None,
            "top1_agreement_vs_bf16": round(agree / sum(len(s) for s in samples), 4) if ref is not None else None,
            "weight_bytes": weight_bytes(model),
            **extra,
        }
        entry["loadavg_after_accuracy"] = [round(x, 2) for x in os.getloadavg()]
        if args.repeats and fmt in args.speed_formats:
            if entry["weight_bytes"] <= args.max_speed_gib * 2**30:
                runners[fmt] = runner
            else:
                entry["speed_skipped"] = f"weights over --max-speed-gib {args.max_speed_gib}"
        result["formats"][fmt] = entry
        print(f"  {name:20s} {fmt:15s} ppl {entry['perplexity']:9.4f}  "
              f"max|d| {entry['logit_max_abs_diff_vs_bf16'] if ref is not None else '-':>7}  "
              f"mean|d| {entry['logit_mean_abs_diff_vs_bf16'] if ref is not None else '-':>8}  "
              f"top1 {entry['top1_agreement_vs_bf16'] if ref is not None else '-':>6}  "
              f"{entry['weight_bytes'] / 2**20:7.0f} MiB", flush=True)
        del runner, model
        gc.collect()
    if args.formats and args.formats[0] != "bfloat16" and "bfloat16" in args.formats:
        print("  (formats before bfloat16 have no logit diff; put bfloat16 first)")
    if runners:
        for fmt, timing in interleaved_speed(runners, context, prefill, args).items():
            result["formats"][fmt].update(timing)
            print(f"  {name:20s} {fmt:15s} 1-token step {timing['decode_1_ms_min']:8.2f} ms (median "
                  f"{timing['decode_1_ms_median']:8.2f})  5-token step {timing['verify_5_ms_min']:8.2f} ms (median "
                  f"{timing['verify_5_ms_median']:8.2f})  prefill {args.prefill} {timing['prefill_ms_min']:8.1f} ms",
                  flush=True)
        runners.clear()
        gc.collect()
    return result


def interleaved_speed(runners: dict[str, ModelRunner], context: list[int], prefill: list[int], args) -> dict:
    """Round-robin over the formats (so a change in machine load hits all of them alike): each round runs
    one 1-token step and one 5-token step per format after the same context (then rewinds the KV);
    min and median over rounds. Prefill: min over ``--prefill-repeats`` rounds."""
    kvs = {}
    for fmt, r in runners.items():
        kvs[fmt] = SequenceKV()
        r.forward([ForwardItem(kvs[fmt], context, 1)])
    times = {fmt: {1: [], 5: []} for fmt in runners}
    for rnd in range(args.repeats + 2):
        for fmt, r in runners.items():
            for n in (1, 5):
                t0 = time.perf_counter()
                r.forward([ForwardItem(kvs[fmt], context[-n:], n)])
                dt = (time.perf_counter() - t0) * 1e3
                r.truncate(kvs[fmt], len(context))
                if rnd >= 2:  # warm-up rounds
                    times[fmt][n].append(dt)
    pre = {fmt: [] for fmt in runners}
    for _ in range(args.prefill_repeats):
        for fmt, r in runners.items():
            kv = SequenceKV()
            t0 = time.perf_counter()
            r.forward([ForwardItem(kv, prefill, 1)])
            pre[fmt].append((time.perf_counter() - t0) * 1e3)
            r.free(kv)
    out = {}
    for fmt, r in runners.items():
        r.free(kvs[fmt])
        out[fmt] = {"decode_1_ms_min": round(min(times[fmt][1]), 2),
                    "decode_1_ms_median": round(statistics.median(times[fmt][1]), 2),
                    "verify_5_ms_min": round(min(times[fmt][5]), 2),
                    "verify_5_ms_median": round(statistics.median(times[fmt][5]), 2),
                    "prefill_ms_min": round(min(pre[fmt]), 1),
                    "loadavg_after_speed": [round(x, 2) for x in os.getloadavg()]}
    return out


def last_logits(llm: LLM, ids: list[int], rows: int) -> torch.Tensor:
    """float32 logits of the last ``rows`` positions of ``ids``, fed from an empty cache."""
    kv = SequenceKV()
    (logits,) = llm.target.forward([ForwardItem(kv, ids, rows)])
    llm.target.free(kv)
    return logits


def default_vs_float32(name: str, texts: list[tuple[str, str]], tokens: int) -> dict:
    """Greedy tokens and logits of ``LLM(name)`` against ``LLM(name, weights='float32')`` (see the module doc)."""
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    ref = LLM(name, weights="float32")
    prompts = [ref.chat_prompt([{"role": "user", "content": t}]) for _, t in texts]
    ref_ids = [o.token_ids for o in ref.generate(prompts, params)]
    with torch.inference_mode():  # the positions that predict each new token, the float32 tokens fed
        ref_logits = [last_logits(ref, p + r[:-1], len(r)) for p, r in zip(prompts, ref_ids)]
    del ref
    gc.collect()
    llm = LLM(name)
    ids = [o.token_ids for o in llm.generate(prompts, params)]
    rows, maxd, sumd, nd, agree = [], 0.0, 0.0, 0, 0
    for (cat, _), p, r, got, ref_lg in zip(texts, prompts, ref_ids, ids, ref_logits):
        with torch.inference_mode():
            lg = last_logits(llm, p + r[:-1], len(r))
        d, top1 = (lg - ref_lg).abs(), (lg.argmax(-1) == ref_lg.argmax(-1)).sum().item()
        same = next((i for i, (a, b) in enumerate(zip(got, r)) if a != b), min(len(got), len(r)))
        rows.append({"category": cat, "prompt_tokens": len(p), "identical_new_tokens": same, "new_tokens": len(r),
                     "logit_max_abs_diff": round(d.max().item(), 4), "logit_mean_abs_diff": round(d.mean().item(), 5),
                     "top1_agreement": round(top1 / len(r), 4)})
        maxd, sumd, nd, agree = max(maxd, d.max().item()), sumd + d.sum().item(), nd + d.numel(), agree + top1
        print(f"  {name:20s} {cat:15s} {len(p):5d} prompt tokens: greedy identical for {same:2d}/{len(r)} new tokens"
              f"  max|d| {d.max().item():6.3f}  mean|d| {d.mean().item():7.4f}  top1 {top1}/{len(r)}", flush=True)
    summary = {"model": name, "weights": llm.weights, "dtype": str(llm.dtype).removeprefix("torch."),
               "kernels": llm.weights_summary, "prompts": len(rows),
               "fully_identical_prompts": sum(r["identical_new_tokens"] == r["new_tokens"] for r in rows),
               "identical_new_tokens": sum(r["identical_new_tokens"] for r in rows),
               "new_tokens": sum(r["new_tokens"] for r in rows), "logit_max_abs_diff": round(maxd, 4),
               "logit_mean_abs_diff": round(sumd / nd, 5),
               "top1_agreement": round(agree / sum(r["new_tokens"] for r in rows), 4), "per_prompt": rows}
    print(f"  {name}: {summary['kernels']}, {summary['dtype']} activations; {summary['fully_identical_prompts']}/"
          f"{len(rows)} prompts identical over all new tokens, {summary['identical_new_tokens']}/"
          f"{summary['new_tokens']} tokens before the first difference; max|d| {maxd:.3f}, mean|d| "
          f"{summary['logit_mean_abs_diff']}, top1 {summary['top1_agreement']}", flush=True)
    return summary


def run_default_vs_float32(models: list[str], args) -> None:
    cats = ("summarization", "rag", "translation", "qa", "math_reasoning", "writing")[: args.spec_bench]
    texts = [("humaneval", p) for p in humaneval_prompts(args.humaneval)] + spec_bench_prompts(1, cats)
    out = Path(args.out or ROOT / "bench" / "results" / "default_weights.json")
    results = {"settings": {"humaneval": args.humaneval, "spec_bench": list(cats), "new_tokens": args.new_tokens,
                            "threads": args.threads},
               "machine": {"cpu": platform.processor() or platform.machine(), "cpu_capability": cpu_capability(),
                           "cores": os.cpu_count(), "torch": torch.__version__}, "models": []}
    for name in models:
        results["models"].append(default_vs_float32(name, texts, args.new_tokens))
        out.write_text(json.dumps(results, indent=2))  # after every model: a killed run keeps what it finished
    print(f"wrote {out}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--formats", default="bfloat16,float32,int8,int4,int4/wide=int4")
    p.add_argument("--articles", type=int, default=3)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--prefill", type=int, default=128)
    p.add_argument("--repeats", type=int, default=15, help="timed steps per measurement; 0: accuracy only")
    p.add_argument("--prefill-repeats", type=int, default=2)
    p.add_argument("--speed-formats", default=None,
                   help="formats to time (default: all of --formats); their models stay in memory together")
    p.add_argument("--max-speed-gib", type=float, default=4.0,
                   help="formats whose weights are larger are not timed (all timed models stay in memory together)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None, help="default: bench/results/quant_accuracy.json "
                                                 "(default_weights.json with --default-vs-float32)")
    p.add_argument("--default-vs-float32", action="store_true",
                   help="compare LLM(name) with LLM(name, weights='float32') instead (see above)")
    p.add_argument("--humaneval", type=int, default=3, help="--default-vs-float32: HumanEval prompts")
    p.add_argument("--spec-bench", type=int, default=3, help="--default-vs-float32: Spec-Bench categories, one "
                                                               "prompt each")
    p.add_argument("--new-tokens", type=int, default=32, help="--default-vs-float32: greedy tokens per prompt")
    p.add_argument("--append", action="store_true",
                   help="keep the results of other models already in --out (run models one at a time)")
    args = p.parse_args()
    args.formats = [f for f in args.formats.split(",") if f]
    args.speed_formats = args.formats if args.speed_formats is None else args.speed_formats.split(",")
    torch.set_num_threads(args.threads)
    models = []
    for name in args.models.split(","):
        try:
            resolve_model(name)
            models.append(name)
        except Exception as exc:
            print(f"skipping {name}: {exc}")
    if args.default_vs_float32:
        run_default_vs_float32(models, args)
        return
    print(f"torch {torch.__version__} ({cpu_capability()}), {args.threads} threads, loadavg {os.getloadavg()}; "
          f"times: min/median ms")
    out = Path(args.out or ROOT / "bench" / "results" / "quant_accuracy.json")
    kept = []
    if args.append and out.is_file():  # keep earlier results of the models not run now
        kept = [m for m in json.loads(out.read_text()).get("models", []) if m["model"] not in models]
    results = {
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "text_sample": f"first {args.tokens} tokens of each of the first {args.articles} summarization articles "
                       f"of {DATA.name} (after 'Summarize:')",
        "machine": {"cpu": platform.processor() or platform.machine(), "cpu_capability": cpu_capability(),
                    "cores": os.cpu_count(), "torch": torch.__version__, "loadavg_start": os.getloadavg()},
        "models": kept,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    for name in models:
        result = run_model(name, args)
        result["settings"] = results["settings"]
        results["models"].append(result)
        out.write_text(json.dumps(results, indent=2))  # after every model: a killed run keeps what it finished
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
