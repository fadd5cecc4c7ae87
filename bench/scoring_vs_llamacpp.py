"""Scoring text, as evaluation harnesses do, against llama.cpp through llama-cpp-python: every prompt token's logprob.

lm-evaluation-harness scores a continuation by sending context + continuation with ``echo``, ``logprobs=1`` and
``max_tokens=1`` and summing the continuation's logprobs (its ``gguf`` backend sends exactly that to llama-cpp-python,
whose ``Llama`` must be built with ``logits_all=True`` for it). The work here: each of the first ``--tasks`` public
HumanEval tasks as context (its prompt) and continuation (its canonical solution), the same text to both engines in
the same order (quickdraft gets its token ids; llama.cpp the text, since its echo takes no ids, checked to tokenize
the same).

- quickdraft: ``LLM.generate`` over all the requests at once with ``prompt_logprobs=1`` (batched, as the harness
  batches them); the same with each request alone; and the batch without prompt logprobs (prefill and one token:
  what scoring adds to it). The prefix cache is emptied before each configuration.
- llama.cpp: ``Llama(..., logits_all=True).create_completion(text, max_tokens=1, echo=True, logprobs=1)`` for each
  request in turn, as its server answers them (llama-cpp-python reuses the previous request's matching prefix); and
  its engine alone, ``eval`` of each prompt and the logprobs from its rows in numpy, the ratios' reference: 0.3.36's
  echo spends most of its time sorting each row's vocabulary in Python, and reports each token's logprob from its
  own row instead of the row before it (llama-cpp-python issue #1983), which the run checks.

Each engine runs in its own process (its peak RSS is its own), one after the other, ``--rounds`` times alternating
which goes first. tokens/s: prompt tokens scored over the wall time. Prefill is bound by arithmetic, not by reading
the weights, so the table gives GFLOP/s (2 x the weights' parameters per token, attention left out) beside it. The
two engines' logprobs are compared position by position (same file, different kernels: they differ by rounding) and
by the decision the harness makes of them: is every continuation token the top one.

Usage: python bench/scoring_vs_llamacpp.py [--target qwen2.5-coder-0.5b] [--tasks 30] [--rounds 2] [--threads 2]
         [--out scoring_vs_llamacpp]
"""
from __future__ import annotations

import argparse
import json
import math
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import BENCH_DATA, machine, memory_bandwidth_gbs, save, table  # noqa: E402


def work(target: str, count: int) -> list[dict]:
    """HumanEval's first ``count`` tasks as (context ids, continuation ids), by the GGUF's own tokenizer."""
    from quickdraft import LLM
    tokenizer = LLM(target, kv_cache_memory="64MiB").tokenizer
    out = []
    for line in (BENCH_DATA / "humaneval.public.jsonl").read_text().splitlines()[:count]:
        task = json.loads(line)
        text = task["prompt"] + task["canonical_solution"]
        out.append({"id": task["task_id"], "text": text, "context": tokenizer.encode(task["prompt"]),
                    "ids": tokenizer.encode(text)})
    return out


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def scored(entries: list[dict | None]) -> list[tuple[float, bool]]:
    """(logprob, is the top token) of every prompt token after the first."""
    return [(e["logprob"], e["rank"] == 1) for e in entries[1:]]


def run_quickdraft(target: str, requests: list[dict], threads: int) -> dict:
    from quickdraft import LLM, SamplingParams
    llm = LLM(target, threads=threads)
    batch = [r["ids"] for r in requests]
    llm.generate([batch[0][:16]], SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=1))  # warm-up
    configs: dict[str, dict] = {}

    def timed(name: str, calls) -> list:
        llm.reset_prefix_cache()
        t0 = time.perf_counter()
        outs = [o for call in calls for o in call()]
        configs[name] = {"wall_s": time.perf_counter() - t0, "tokens": sum(len(ids) for ids in batch)}
        return outs

    score = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1)
    timed("prefill + 1 token, batched", [lambda: llm.generate(batch, SamplingParams(max_tokens=1, temperature=0))])
    outs = timed("scored, batched", [lambda: llm.generate(batch, score)])
    alone = timed("scored, one at a time", [lambda ids=ids: llm.generate([ids], score) for ids in batch])
    if [o.prompt_logprobs for o in alone] != [o.prompt_logprobs for o in outs]:
        raise AssertionError("a request scored alone differs from the same request scored in the batch")
    return {"configs": configs, "logprobs": [scored(o.prompt_logprobs) for o in outs], "peak_rss_mib": peak_rss_mib()}


def run_llamacpp(target: str, requests: list[dict], threads: int, echo_tasks: int) -> dict:
    from llama_cpp import Llama

    from quickdraft.loading import resolve_model
    n_ctx = max(len(r["ids"]) for r in requests) + 16
    llm = Llama(str(resolve_model(target)), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                logits_all=True, verbose=False)
    for r in requests:  # its echo takes text only (token ids fail in llama-cpp-python 0.3.36), as its server does
        if llm.tokenize(r["text"].encode(), add_bos=False) != r["ids"]:
            raise AssertionError(f"{r['id']}: llama.cpp tokenizes the text otherwise than quickdraft")
    llm.create_completion(requests[0]["text"][:40], max_tokens=2, temperature=0, echo=True, logprobs=1)  # warm-up
    logprobs = []
    t0 = time.perf_counter()
    for r in requests[:echo_tasks]:  # (slow: see the module's docstring)
        lp = llm.create_completion(r["text"], max_tokens=1, temperature=0, echo=True, logprobs=1)["choices"][0]["logprobs"]
        n = len(r["ids"])
        logprobs.append([(float(v), bool(v >= max(top.values()) - 1e-6))
                         for v, top in zip(lp["token_logprobs"][1:n], lp["top_logprobs"][1:n])])
    wall = time.perf_counter() - t0
    engine, engine_wall, eval_wall = llamacpp_engine_alone(llm, requests)
    shifted = sum(abs(a[0] - b) < 1e-3 for lps, r in zip(logprobs, engine) for a, b in zip(lps, r["own_row"]))
    tokens = sum(len(r["ids"]) for r in requests)
    return {"configs": {f"create_completion, echo (its server's way; first {echo_tasks} tasks)":
                        {"wall_s": wall, "tokens": sum(len(r["ids"]) for r in requests[:echo_tasks])},
                        "its engine alone: eval + log_softmax": {"wall_s": engine_wall, "tokens": tokens},
                        "its engine alone: eval (logits, no logprobs)": {"wall_s": eval_wall, "tokens": tokens}},
            "logprobs": [r["scored"] for r in engine], "echo_logprobs": logprobs,
            "echo_is_own_row": f"{shifted}/{sum(map(len, logprobs))}", "peak_rss_mib": peak_rss_mib()}


def llamacpp_engine_alone(llm, requests: list[dict]) -> tuple[list[dict], float, float]:
    """llama.cpp's forward of each prompt with every row's logits (``eval`` under ``logits_all``), each prompt token
    scored from the row before it, in numpy: what a correct wrapper computes at its engine's own speed. Also each
    token's logprob in its own row (the next token's distribution), which is what 0.3.36's echo reports for it.
    Returns them, the wall time, and the part of it in ``eval``."""
    import numpy as np
    out, eval_s = [], 0.0
    t0 = time.perf_counter()
    for r in requests:
        ids = np.array(r["ids"])
        llm.reset()
        t1 = time.perf_counter()
        llm.eval(r["ids"])
        eval_s += time.perf_counter() - t1
        rows = np.asarray(llm.scores[:len(ids)])
        logp = rows - rows.max(1, keepdims=True)
        logp -= np.log(np.exp(logp).sum(1, keepdims=True))
        before = logp[np.arange(len(ids) - 1), ids[1:]]
        out.append({"scored": [(float(v), bool(v >= logp[i].max() - 1e-6)) for i, v in enumerate(before)],
                    "own_row": logp[np.arange(1, len(ids)), ids[1:]].tolist()})
    return out, time.perf_counter() - t0, eval_s


def in_child(engine: str, args: argparse.Namespace, requests_file: Path) -> dict:
    """One engine's run in a process of its own."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        subprocess.run([sys.executable, __file__, "--child", engine, "--requests", str(requests_file),
                        "--child-out", out.name, "--target", args.target, "--threads", str(args.threads),
                        "--echo-tasks", str(args.echo_tasks)], check=True)
        return json.loads(Path(out.name).read_text())


def compare(requests: list[dict], ours: list, theirs: list) -> dict:
    """Position by position: how far the two engines' logprobs are apart; continuation by continuation: whether
    both make the harness's decision (every continuation token the top one) the same way."""
    diffs, same_decision, sums = [], 0, []
    pairs = list(zip(requests, ours, theirs))  # (as many as both scored)
    for r, a, b in pairs:
        diffs += [abs(x[0] - y[0]) for x, y in zip(a, b)]
        start = len(r["context"]) - 1
        same_decision += all(x[1] for x in a[start:]) == all(y[1] for y in b[start:])
        sums.append(abs(sum(x[0] for x in a[start:]) - sum(y[0] for y in b[start:])))
    return {"positions": len(diffs), "mean_abs_logprob_diff": sum(diffs) / len(diffs), "max_abs_logprob_diff": max(diffs),
            "continuation_sum_max_abs_diff": max(sums), "same_greedy_decision": f"{same_decision}/{len(pairs)}"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="qwen2.5-coder-0.5b")
    parser.add_argument("--tasks", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--echo-tasks", type=int, default=4, help="tasks llama-cpp-python's echo path scores")
    parser.add_argument("--out", default="scoring_vs_llamacpp")
    parser.add_argument("--child", choices=["quickdraft", "llama.cpp"], help=argparse.SUPPRESS)
    parser.add_argument("--requests", help=argparse.SUPPRESS)
    parser.add_argument("--child-out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        requests = json.loads(Path(args.requests).read_text())
        out = run_quickdraft(args.target, requests, args.threads) if args.child == "quickdraft" else \
            run_llamacpp(args.target, requests, args.threads, args.echo_tasks)
        Path(args.child_out).write_text(json.dumps(out))
        return

    requests = work(args.target, args.tasks)
    tokens = sum(len(r["ids"]) for r in requests)
    from quickdraft.loading import resolve_model
    from quickdraft.loading.gguf_metadata import tensor_shapes
    params = sum(math.prod(shape) for name, (_, shape) in tensor_shapes(resolve_model(args.target)).items()
                 if name != "token_embd.weight")
    try:
        import llama_cpp  # noqa: F401
        engines = ["quickdraft", "llama.cpp"]
    except ImportError:
        print("llama-cpp-python is not installed (pip install llama-cpp-python); reporting quickdraft only")
        engines = ["quickdraft"]
    runs: dict[str, list[dict]] = {e: [] for e in engines}
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        json.dump(requests, f)
        f.flush()
        for rnd in range(args.rounds):
            for engine in engines if rnd % 2 == 0 else engines[::-1]:
                runs[engine].append(in_child(engine, args, Path(f.name)))
                print(f"round {rnd + 1}: {engine} " + ", ".join(f"{name} {c['wall_s']:.1f} s" for name, c in
                                                          runs[engine][-1]["configs"].items()), flush=True)
    bandwidth = memory_bandwidth_gbs()
    rows = []
    for engine, done in runs.items():
        for name in done[0]["configs"]:
            walls = [d["configs"][name]["wall_s"] for d in done]
            best, scored_tokens = min(walls), done[0]["configs"][name]["tokens"]
            rows.append({"engine": engine, "config": name, "tok_s": scored_tokens / best,
                         "tok_s_each_round": [round(scored_tokens / w, 1) for w in walls],
                         "gflop_s": 2 * params * scored_tokens / best / 1e9, "peak_rss_mib": max(d["peak_rss_mib"] for d in done)})
    llama = next((r for r in rows if r["config"].startswith("its engine alone")), None)
    for r in rows:
        r["vs_llama_cpp"] = r["tok_s"] / llama["tok_s"] if llama else None
    print(f"\n{machine()['cpu']}, {args.threads} threads, {bandwidth:.1f} GB/s read; {args.target}: "
          f"{len(requests)} HumanEval tasks, {tokens} prompt tokens scored")
    print(table(rows, ["engine", "config", "tok_s", "vs_llama_cpp", "gflop_s", "tok_s_each_round", "peak_rss_mib"]))
    agreement = None
    if llama:
        theirs = runs["llama.cpp"][0]
        agreement = {"with its engine alone": compare(requests, runs["quickdraft"][0]["logprobs"], theirs["logprobs"]),
                     "with its echo": compare(requests, runs["quickdraft"][0]["logprobs"], theirs["echo_logprobs"]),
                     "its echo's logprob of a token is the one in that token's own row": theirs["echo_is_own_row"]}
        for name, value in agreement.items():
            print(f"{name}: {value}")
    path = save(args.out, {"machine": machine(), "bandwidth_gbs": bandwidth, "target": args.target,
                           "tasks": len(requests), "prompt_tokens": tokens, "weight_parameters": params, "rows": rows,
                           "agreement": agreement, "rounds": args.rounds, "threads": args.threads})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
