"""Decode speed on a GPU: quickdraft's CUDA-graph step against its dynamic path, HF transformers eager and the
bandwidth limit measured in the same run, on random-weight models of real shapes that this script builds itself.

Usage: python bench/cuda_decode.py [--shapes smollm2-135m,qwen2.5-1.5b,qwen2.5-7b] [--batches 1,8,32]
         [--tokens 128] [--no-hf] [--hf-batches 1] [--device cuda|cpu] [--name cuda_decode] [--linears int8,int4,triton]
         [--linears-shapes qwen2.5-7b] [--norm-apart] [--profile] [--kernels] [--graphs-only]
Per shape (bfloat16, weights drawn from N(0, 0.02), norms at 1, a word-level tokenizer of the shape's vocabulary):
- the read bandwidth (a device-to-device copy of 1 GiB, bytes read + written per second) and the batch-1 limit it
  gives: bandwidth / bytes of weights a decode step reads;
- tokens/s of a 32-token prompt and ``--tokens`` greedy tokens (prefill included; the time to the first token
  beside it) at each batch: quickdraft with
  ``static_step="graphs"`` (replayed CUDA graphs), quickdraft ``static_step="off"`` (the dynamic path) at batch 1,
  and HF transformers ``generate`` (eager, its default cache);
- the cost of a verify pass of 5 tokens against a one-token decode step (batch 1, median of 30 forwards each), and
  on a GPU the device's own time for each (its graph replayed back to back): the rest of a step is the host's;
- n-gram speculation where the prompt repeats itself: tokens/s, tokens per target pass, and whether its tokens equal
  plain greedy's;
- with ``--linears int8,int4,triton`` (on ``--linears-shapes``, default the 7B): the same model with weight-only
  int8 / int4 (group 32) linears on Triton's kernel (``models/triton_linear.py``), or its bfloat16 linears on the
  same kernel's tiles (``gpu_linears="triton"``), batch 1 and the largest batch, against the limit of the bytes they
  read; with ``--norm-apart``, the first of them again at batch 1 with each residual add and RMSNorm in a kernel of
  its own instead of inside the q/k/v or gate/up projection after it (``models/norms.py``); each load chooses the
  tiles of the layers on Triton's kernel (``kv/tile_tuning.py``): a one-sequence step's device time with the default
  tiles and with the chosen ones, and each group's choice, go beside its rows;
- the same graphs with launch-ahead off (``engine/launch_ahead.py``): each step's tokens read before the next step
  is launched, as before launch-ahead;
- with ``--profile``: where the host's time goes at the smallest and largest batch, and under n-gram drafting
  (cProfile, a file each);
- with ``--kernels``: the kernels of a batch-1 decode step and the device time of each (torch.profiler).
Random weights say nothing about acceptance; they time the mechanics. ``--device cpu`` runs a small shape as a smoke
test of this script where there is no GPU. Prints a table per section and writes bench/results/<name>.json.
"""
from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, save, table  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from conftest import write_word_tokenizer  # noqa: E402

from quickdraft import LLM, SamplingParams  # noqa: E402
from quickdraft.kv import ForwardItem, SequenceKV  # noqa: E402
from quickdraft.models import norms, step_weight_bytes, triton_linear  # noqa: E402
from quickdraft.models.triton_tuning import tile_groups  # noqa: E402

SHAPES = {  # transformers config fields of each real model's shape
    "smollm2-135m": dict(model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True,
                         rope_theta=100000.0),
    "qwen2.5-1.5b": dict(model_type="qwen2", hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True,
                         rope_theta=1000000.0),
    "qwen2.5-7b": dict(model_type="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False,
                       rope_theta=1000000.0),
    "smoke": dict(model_type="qwen2", hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=512, tie_word_embeddings=True,
                  rope_theta=10000.0),
}
PROMPT_TOKENS = 32
MAX_LEN = 1024


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def read_bandwidth(device: str) -> float:
    """Bytes read + written per second by a device-to-device copy of 1 GiB (the figure docs/gpu notes use)."""
    size = 1 << 30 if device == "cuda" else 1 << 26
    a = torch.empty(size, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    b.copy_(a)
    sync(device)
    t0 = time.perf_counter()
    for _ in range(10):
        b.copy_(a)
    sync(device)
    return 2 * size * 10 / (time.perf_counter() - t0)


def build_shape(name: str, device: str, root: Path):
    """A random-weight HF model of ``name``'s shape on ``device`` (kept for the HF baseline) and its saved copy."""
    import transformers

    fields = dict(SHAPES[name])
    cfg = transformers.AutoConfig.for_model(fields.pop("model_type"), max_position_embeddings=32768,
                                            eos_token_id=0, bos_token_id=None, **fields)
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            p.fill_(1.0) if "norm" in pname else p.normal_(0.0, 0.02)
    directory = root / name
    model.save_pretrained(directory)
    write_word_tokenizer(directory, cfg.vocab_size)
    return model, directory


def prompts_for(vocab: int, batch: int, repeat: bool = False) -> list[list[int]]:
    g = torch.Generator().manual_seed(batch)
    if repeat:  # a 16-token phrase said twice, then its start: where n-gram lookup finds the continuation
        phrase = torch.randint(1, vocab, (16,), generator=g).tolist()
        return [phrase * 2] * batch
    return [torch.randint(1, vocab, (PROMPT_TOKENS,), generator=g).tolist() for _ in range(batch)]


def time_generate(llm: LLM, prompts: list[list[int]], tokens: int, device: str) -> tuple[float, list[list[int]]]:
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    # warm-up at this batch: its first prompt chunks and steps pay one-time costs (kernel compiles, cuBLAS's first
    # calls of new shapes) that would otherwise land on whichever timed row runs that batch first
    llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    llm.reset_prefix_cache()
    sync(device)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    sync(device)
    seconds = time.perf_counter() - t0
    return sum(len(o.token_ids) for o in outs) / seconds, [o.token_ids for o in outs]


def time_first_token(llm: LLM, prompts: list[list[int]], device: str) -> float:
    """Milliseconds to the first token of ``prompts`` (their prefill and one step), the prefix cache emptied."""
    llm.reset_prefix_cache()
    sync(device)
    t0 = time.perf_counter()
    llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    sync(device)
    return 1000 * (time.perf_counter() - t0)


def time_hf(model, prompts: list[list[int]], tokens: int, device: str) -> float:
    ids = torch.tensor(prompts, device=device)
    kwargs = dict(max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, pad_token_id=0)
    model.generate(ids[:1], **{**kwargs, "max_new_tokens": 4, "min_new_tokens": 4})
    sync(device)
    t0 = time.perf_counter()
    with torch.no_grad():
        model.generate(ids, **kwargs)
    sync(device)
    return len(prompts) * tokens / (time.perf_counter() - t0)


def verify_cost(llm: LLM, vocab: int, repeats: int = 30) -> dict:
    """Median seconds of a 1-token decode step and of a 5-token verify pass (batch 1, a 32-token context)."""
    runner = llm.loaded.engine.target
    kv = SequenceKV()
    runner.forward([ForwardItem(kv, prompts_for(vocab, 1)[0], 1)])
    start = kv.num_cached
    out = {}
    for n in (1, 5):
        seconds = []
        for i in range(repeats + 3):
            runner.forward([ForwardItem(kv, list(range(1, n + 1)), n)])
            runner.truncate(kv, start)
            seconds.append(runner.last_forward_s)
        out[f"step_{n}_ms"] = 1000 * statistics.median(seconds[3:])
    runner.free(kv)
    out["verify5_over_step"] = out["step_5_ms"] / out["step_1_ms"]
    if runner.static is not None and runner.static.graphs:  # the device's share of a step, the rest is the host's
        for n in (1, 5):
            out[f"graph_{n}_ms"] = 1000 * runner.static.device_seconds(1, n, runner.logit_columns)
    return out


def kernel_profile(llm: LLM, name: str, args, steps: int = 20) -> dict:
    """Which kernels a batch-1 decode step runs and for how long each (torch.profiler's device times): the static
    step's forward run eagerly on its own buffers (the graph's kernels, without the graph), ``steps`` times after a
    prompt. Written as ``<name>_kernels_<shape>.txt``; returns the kernels and their time per step."""
    from torch.profiler import ProfilerActivity, profile

    runner = llm.loaded.engine.target
    kv = SequenceKV()
    runner.forward([ForwardItem(kv, prompts_for(SHAPES[name]["vocab_size"], 1)[0], 1)])
    graphs, runner.static.graphs = runner.static.graphs, False
    try:
        runner.forward([ForwardItem(kv, [1], 1)])  # warm: the eager forward's first call
        on_gpu = runner.device.type == "cuda"  # the CPU (a smoke test): its operators' own times
        with profile(activities=[ProfilerActivity.CUDA if on_gpu else ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                runner.forward([ForwardItem(kv, [1], 1)])
    finally:
        runner.static.graphs = graphs
        runner.free(kv)
    kernels = []
    for event in prof.key_averages():
        device_us = getattr(event, "self_device_time_total", getattr(event, "self_cuda_time_total", 0)) if on_gpu \
            else event.self_cpu_time_total
        if device_us > 0:
            kernels.append(dict(kernel=event.key[:90], per_step=event.count / steps, us_per_step=device_us / steps))
    kernels.sort(key=lambda k: -k["us_per_step"])
    total = sum(k["us_per_step"] for k in kernels)
    text = table(kernels[:25], ["kernel", "per_step", "us_per_step"])
    summary = (f"{name}: {sum(k['per_step'] for k in kernels):.0f} kernels a batch-1 decode step, {total:.0f} us of "
               f"device time in kernels (the graph's step adds the gaps between them)")
    path = Path(__file__).resolve().parent / "results" / f"{Path(args.name).name}_kernels_{name}.txt"
    path.write_text(summary + "\n" + text + "\n")
    print(summary + "\n" + text)
    return dict(kernels_per_step=sum(k["per_step"] for k in kernels), kernel_us_per_step=total, top=kernels[:8])


def profile_host(llm: LLM, vocab: int, args, name: str, batches: list[int], repeat: bool = False) -> None:
    """Where a decode's host time goes at the smallest and largest batch: cProfile's 30 costliest functions (by their
    own time) over ``--tokens`` answers, written beside the JSON as ``<name>_profile_<shape>.txt``."""
    import cProfile
    import io
    import pstats

    params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    text = io.StringIO()
    for batch in sorted({batches[0], batches[-1]}):
        profiler = cProfile.Profile()
        profiler.enable()
        llm.generate(prompts_for(vocab, batch, repeat), params)
        profiler.disable()
        text.write(f"batch {batch}\n")
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(30)
    path = Path(__file__).resolve().parent / "results" / f"{Path(args.name).name}_profile_{name}.txt"
    path.write_text(text.getvalue())
    print(f"{name}: host profile in {path}")


def tile_choices(llm: LLM) -> dict:
    """What the load's choice of tiles for the layers on Triton's kernel found (``runner.tile_tuning``): a
    one-sequence step's device time with the defaults and as chosen, each group's tiles (output columns / warps /
    K split) by its weight's shape, and every trial."""
    runner = llm.loaded.engine.target
    report = runner.tile_tuning
    if not report:
        return {}
    if "error" in report[0]:
        return dict(tile_error=report[0]["error"])
    chosen = {" ".join(map(str, key)): "{0.block_n}/{0.warps}/{0.split}".format(layers[0].tiles)
              for key, layers in tile_groups(runner.model).items()}
    return dict(default_step_ms=1000 * report[0]["seconds"], tuned_step_ms=1000 * report[-1]["seconds"],
                tiles=chosen, tile_trials=report)


def bench_linears(directory: Path, name: str, args, bandwidth: float, common: dict, mode: str, rows: list[dict],
                  record) -> None:
    """The shape with other linears: weight-only int8 / int4 (quantized from its bfloat16 weights at load), or its
    bfloat16 weights on Triton's tiles (``triton``), at the smallest and largest batch; with ``--norm-apart`` the
    first of them again at the smallest batch with the residual adds and norms in kernels of their own
    (``norms.IN_PROJECTIONS`` off), where the shape's q/k/v or gate/up would take them."""
    shape, batches = SHAPES[name], [int(b) for b in args.batches.split(",")]
    formats = [f for f in args.linears.split(",") if f]
    # gate/up takes the norm where any projection does (q/k/v is as wide or narrower, so splits K as soon as it does)
    takes = triton_linear.takes_norm(shape["intermediate_size"], shape["hidden_size"])
    runs = []  # (label, options, batches, norms inside the projections)
    for fmt in formats:
        options = {"gpu_linears": "triton"} if fmt == "triton" else {"weights": fmt}
        runs.append((fmt, options, sorted({batches[0], batches[-1]}), True))
        if args.norm_apart and fmt == formats[0] and takes:
            runs.append((f"{fmt}, norms apart", options, batches[:1], False))
    for label, options, run_batches, norms_inside in runs:
        norms.IN_PROJECTIONS = norms_inside  # read at every call: off for the load's graphs and the timed calls
        try:
            t0 = time.perf_counter()
            llm = LLM(str(directory), static_step=mode, **options, **common)
            load_s = time.perf_counter() - t0
            step_bytes = step_weight_bytes(llm.model)
            limit = bandwidth / step_bytes
            tiles = tile_choices(llm)
            for batch in run_batches:
                tok_s, _ = time_generate(llm, prompts_for(shape["vocab_size"], batch), args.tokens, args.device)
                rows.append(dict(shape=name, engine=f"quickdraft {mode} {label}", batch=batch, tok_s=tok_s,
                                 load_s=load_s, step_gb=step_bytes / 1e9, limit_tok_s=limit if batch == 1 else None,
                                 of_limit=tok_s / limit if batch == 1 else None, **tiles))
                print(table([rows[-1]], [column for column in rows[-1] if column != "tile_trials"]))
                record()
        finally:
            norms.IN_PROJECTIONS = True
        del llm
        gc.collect()
        torch.cuda.empty_cache() if args.device == "cuda" else None


def bench_shape(name: str, args, bandwidth: float, root: Path, rows: list[dict], record) -> None:
    """Appends the shape's rows to ``rows``, calling ``record`` (which saves them) after each."""
    device, batches = args.device, [int(b) for b in args.batches.split(",")]
    t0 = time.perf_counter()
    hf_model, directory = build_shape(name, device, root)
    vocab = SHAPES[name]["vocab_size"]
    print(f"{name}: built in {time.perf_counter() - t0:.0f} s")
    hf = {}
    if args.hf:
        for batch in [int(b) for b in args.hf_batches.split(",")] if args.hf_batches else batches:
            hf[batch] = time_hf(hf_model, prompts_for(vocab, batch), args.tokens, device)
    del hf_model
    gc.collect()
    torch.cuda.empty_cache() if device == "cuda" else None
    common = dict(device=device, dtype="bfloat16", max_model_len=MAX_LEN, max_num_seqs=max(batches),
                  max_speculative_tokens=4, kv_cache_memory="4GiB" if device == "cuda" else "256MiB")
    modes = ["graphs", "off"] if device == "cuda" else ["eager", "off"]
    modes = modes[:1] if args.graphs_only else modes
    for mode in modes:
        t0 = time.perf_counter()
        # launch-ahead is on by itself where graphs run; the CPU's smoke test asks for it on the eager step
        llm = LLM(str(directory), static_step=mode, launch_ahead="on" if mode == "eager" else "auto", **common)
        load_s = time.perf_counter() - t0
        step_bytes = step_weight_bytes(llm.model)
        limit = bandwidth / step_bytes
        for batch in batches if mode == modes[0] else batches[:1]:
            tok_s, _ = time_generate(llm, prompts_for(vocab, batch), args.tokens, device)
            row = dict(shape=name, engine=f"quickdraft {mode}", batch=batch, tok_s=tok_s,
                       first_token_ms=time_first_token(llm, prompts_for(vocab, batch), device), load_s=load_s,
                       step_gb=step_bytes / 1e9, limit_tok_s=limit if batch == 1 else None,
                       of_limit=tok_s / limit if batch == 1 else None, hf_tok_s=hf.get(batch),
                       vs_hf=tok_s / hf[batch] if batch in hf else None)
            rows.append(row)
            print(table([row], list(row)))
            record()
        if mode == modes[0] and llm.loaded.engine.ahead.enabled:  # the same graphs, each step read before the next
            llm.loaded.engine.ahead.enabled = False
            for batch in batches:
                tok_s, _ = time_generate(llm, prompts_for(vocab, batch), args.tokens, device)
                rows.append(dict(shape=name, engine=f"quickdraft {mode}, no launch-ahead", batch=batch, tok_s=tok_s,
                                 limit_tok_s=limit if batch == 1 else None, of_limit=tok_s / limit if batch == 1 else None))
                print(table([rows[-1]], list(rows[-1])))
            llm.loaded.engine.ahead.enabled = True
            record()
        if mode == modes[0] and args.profile:
            profile_host(llm, vocab, args, name, batches)
        if mode == modes[0] and args.kernels and llm.loaded.engine.target.static is not None:
            rows.append(dict(shape=name, engine=f"quickdraft {mode}", batch=1, kind="kernels",
                             **kernel_profile(llm, name, args)))
            record()
        if mode == modes[0] and args.graphs_only:
            del llm
        elif mode == modes[0]:
            cost = verify_cost(llm, vocab)
            plain_tok_s, plain_ids = time_generate(llm, prompts_for(vocab, 1, repeat=True), args.tokens, device)
            rows.append(dict(shape=name, engine=f"quickdraft {mode}", batch=1, kind="verify cost", **cost))
            del llm
            gc.collect()
            ngram = LLM(str(directory), static_step=mode, speculative="ngram", **common)
            tok_s, ids = time_generate(ngram, prompts_for(vocab, 1, repeat=True), args.tokens, device)
            if args.profile:
                profile_host(ngram, vocab, args, f"{name}_ngram", [1], repeat=True)
            stats = ngram.spec_stats
            rows.append(dict(shape=name, engine=f"quickdraft {mode} n-gram", batch=1, kind="repeating prompt",
                             tok_s=tok_s, plain_tok_s=plain_tok_s, speedup=tok_s / plain_tok_s,
                             tok_per_pass=stats.generated_tokens / max(1, stats.rounds),
                             acceptance=stats.acceptance_rate, same=ids == plain_ids))
            print(table(rows[-2:], list(rows[-1])))
            record()
            del ngram
        else:
            del llm
        gc.collect()
        torch.cuda.empty_cache() if device == "cuda" else None
    if name in args.linears_shapes.split(","):
        bench_linears(directory, name, args, bandwidth, common, modes[0], rows, record)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=None, help="comma-separated: " + ", ".join(SHAPES))
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--no-hf", dest="hf", action="store_false", help="skip HF transformers' baseline")
    ap.add_argument("--hf-batches", default=None, help="the batches HF transformers runs at (default: --batches)")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke test of this script where there is no GPU")
    ap.add_argument("--name", default="cuda_decode")
    ap.add_argument("--linears", default="",
                    help="other linears to time too: int8, int4 (weight-only), triton (bfloat16 on Triton's tiles)")
    ap.add_argument("--linears-shapes", default="qwen2.5-7b", help="the shapes --linears runs on")
    ap.add_argument("--norm-apart", action="store_true",
                    help="with --linears: the first of them again at batch 1 with each residual add and norm in a "
                         "kernel of its own, not in the projection after it")
    ap.add_argument("--profile", action="store_true", help="cProfile a batch-1 answer per shape (host time)")
    ap.add_argument("--graphs-only", action="store_true",
                    help="only the graphs' tokens/s (launch-ahead on and off) and --kernels: no dynamic path, verify "
                         "cost or n-gram (a short run)")
    ap.add_argument("--kernels", action="store_true",
                    help="torch.profiler's kernels of a batch-1 decode step per shape (device time)")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device: this benchmark times quickdraft's CUDA path (--device cpu: a smoke test)")
    shapes = (args.shapes or ("smollm2-135m,qwen2.5-1.5b,qwen2.5-7b" if args.device == "cuda" else "smoke")).split(",")
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        sys.exit(f"unknown shapes {unknown}: choose from {', '.join(SHAPES)}")
    card = torch.cuda.get_device_name() if args.device == "cuda" else "cpu (smoke test)"
    bandwidth = read_bandwidth(args.device)
    print(f"device: {card}; torch {torch.__version__}; copy bandwidth (read + write) {bandwidth / 1e12:.2f} TB/s")
    rows: list[dict] = []

    def record() -> Path:  # after every row: a run cut short by its time limit keeps what it measured
        return save(args.name, {"device": card, "bandwidth_bytes_s": bandwidth, "args": vars(args),
                                "machine": machine(), "rows": rows})

    with tempfile.TemporaryDirectory() as root:
        for name in shapes:
            try:
                bench_shape(name, args, bandwidth, Path(root), rows, record)
            except Exception as exc:  # noqa: BLE001 - one shape's failure is reported, the others still run
                rows.append({"shape": name, "error": f"{type(exc).__name__}: {exc}"[:300]})
                print(f"{name}: {rows[-1]['error']}")
            path = record()
    speed = [r for r in rows if "kind" not in r]
    print(f"\n{card}, {args.tokens} greedy tokens after a {PROMPT_TOKENS}-token prompt, bfloat16\n" + table(
        speed, ["shape", "engine", "batch", "tok_s", "first_token_ms", "limit_tok_s", "of_limit", "hf_tok_s", "vs_hf", "error"]))
    kinds = [r for r in rows if "kind" in r]  # (none with --graphs-only and no --kernels)
    if kinds:
        print("\n" + table(kinds, ["shape", "engine", "kind", "step_1_ms", "step_5_ms", "verify5_over_step",
                                   "graph_1_ms", "graph_5_ms", "tok_s", "speedup", "tok_per_pass", "same"]))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
