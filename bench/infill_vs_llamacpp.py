"""Fill in the middle, `quickdraft serve` against llama.cpp's own `llama-server`: both servers' ``/infill`` on the same
GGUF file, HumanEval's canonical solutions with a block of lines taken out (an editor's multi-line completion).

For each of the first ``--tasks`` public HumanEval tasks, the middle third of the canonical solution's lines (at least
one) is the span to fill: ``input_prefix`` is the prompt and the lines before it, ``input_suffix`` the lines after.
Greedy, at most ``--tokens`` tokens, the fill ending where the model ends it (its end of sequence). Each fill is run
against the task's tests (the prefix, the fill and the suffix as one program, in a subprocess with a 10 s limit):
pass@1. tokens/s = tokens written over the requests' wall time, prompt included. Each server runs alone on the
machine, every configuration in turn, then all again in reverse order. Every quickdraft speculative fill is checked
against quickdraft plain's.

Usage: python bench/infill_vs_llamacpp.py [--target qwen2.5-coder-1.5b] [--tasks 20] [--tokens 64]
         [--modes plain,ngram,suffix] [--llama-modes plain,ngram-mod] [--threads 2] [--out infill_vs_llamacpp]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import BENCH_DATA, machine, memory_bandwidth_gbs, save, table  # noqa: E402
from serve_vs_llamacpp import (LLAMA_SPEC_TYPES, LlamaServer, each_server_alone, llama_server_path,  # noqa: E402
                               quickdraft_server)

from quickdraft.loading import resolve_model  # noqa: E402


def tasks(count: int) -> list[dict]:
    """HumanEval's first ``count`` tasks as fills: prefix, suffix, the span taken out, the tests."""
    out = []
    for line in (BENCH_DATA / "humaneval.public.jsonl").read_text().splitlines()[:count]:
        task = json.loads(line)
        lines = task["canonical_solution"].splitlines(keepends=True)
        start, end = len(lines) // 3, max(len(lines) // 3 + 1, 2 * len(lines) // 3)
        out.append({"id": task["task_id"], "prefix": task["prompt"] + "".join(lines[:start]),
                    "suffix": "".join(lines[end:]), "span": "".join(lines[start:end]),
                    "test": task["test"] + f"\ncheck({task['entry_point']})\n"})
    return out


def passes(task: dict, fill: str) -> bool:
    program = task["prefix"] + fill + task["suffix"] + "\n" + task["test"]
    try:
        return subprocess.run([sys.executable, "-c", program], capture_output=True, timeout=10).returncode == 0
    except subprocess.TimeoutExpired:
        return False


def run(url: str, work: list[dict], tokens: int) -> tuple[list[dict], float]:
    rows = []
    with httpx.Client(timeout=1800) as client:
        client.post(f"{url}/infill", json={"input_prefix": "def f(", "input_suffix": "", "n_predict": 4,
                                           "temperature": 0})  # warm-up
        t0 = time.perf_counter()
        for task in work:
            body = {"input_prefix": task["prefix"], "input_suffix": task["suffix"], "n_predict": tokens,
                    "temperature": 0, "return_tokens": True}
            start = time.perf_counter()
            r = client.post(f"{url}/infill", json=body)
            r.raise_for_status()
            data = r.json()
            rows.append({"task": task["id"], "seconds": time.perf_counter() - start, "text": data["content"],
                         "tokens": data["tokens_predicted"], "evaluated": data["tokens_evaluated"],
                         "drafted": (data.get("timings") or {}).get("draft_n"),
                         "accepted": (data.get("timings") or {}).get("draft_n_accepted"),
                         "speculative": data.get("speculative")})
        wall = time.perf_counter() - t0
    return rows, wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--tasks", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--modes", default="plain,ngram,suffix")
    ap.add_argument("--llama-modes", default="plain,ngram-mod")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--llama-server", default=None)
    ap.add_argument("--out", default="infill_vs_llamacpp")
    args = ap.parse_args()
    modes, llama_modes = args.modes.split(","), args.llama_modes.split(",")
    if modes[0] != "plain" or not set(modes) <= {"plain", "ngram", "suffix"}:
        ap.error("--modes: plain first, then ngram and/or suffix")
    if not set(llama_modes) <= {"plain", *LLAMA_SPEC_TYPES}:
        ap.error(f"--llama-modes: any of plain, {', '.join(LLAMA_SPEC_TYPES)}")
    binary = llama_server_path(args.llama_server)
    target = resolve_model(args.target)
    work = tasks(args.tasks)
    configs = [("quickdraft", m) for m in modes] + [("llama-server", m) for m in llama_modes]

    def start(engine: str, mode: str, log: Path):
        return (quickdraft_server if engine == "quickdraft" else
                lambda *a: LlamaServer(binary, *a))(target, mode, target, args.threads, 1, log)

    runs, walls = each_server_alone(configs, start, lambda url: run(url, work, args.tokens),
                                    Path(tempfile.mkdtemp(prefix="infill-vs-llamacpp-")))
    summary = []
    for (engine, mode), rows in runs.items():
        first = rows[:len(work)]  # pass@1 and the texts of the first pass (greedy: the second gives the same)
        drafted = sum((r["speculative"] or {}).get("drafted_tokens", 0) or r["drafted"] or 0 for r in rows)
        accepted = sum((r["speculative"] or {}).get("accepted_tokens", 0) or r["accepted"] or 0 for r in rows)
        summary.append({"engine": engine, "mode": mode, "fills": len(rows), "tokens": sum(r["tokens"] for r in rows),
                        "tok_s": sum(r["tokens"] for r in rows) / walls[engine, mode],
                        "acceptance": accepted / drafted if drafted else None,
                        "pass_at_1": sum(passes(t, r["text"]) for t, r in zip(work, first)) / len(work),
                        "exact_span": sum(r["text"].strip() == t["span"].strip() for t, r in zip(work, first))
                        / len(work)})
    plain = {s["engine"]: s["tok_s"] for s in summary if s["mode"] == "plain"}
    for s in summary:
        s["vs_llama_plain"] = s["tok_s"] / plain["llama-server"] if "llama-server" in plain else None
    reference = runs["quickdraft", "plain"]
    identical = {m: sum(a["text"] == b["text"] for a, b in zip(reference, runs["quickdraft", m])) for m in modes[1:]}
    same_prompt = sum(a["evaluated"] == b["evaluated"] for a, b in zip(reference, runs.get(("llama-server", "plain"),
                                                                                          [])))
    info, bandwidth = machine(), memory_bandwidth_gbs()
    print(f"machine: {info['cpu']}, {args.threads} threads, {bandwidth:.1f} GB/s measured; {len(work)} HumanEval "
          f"fills x 2 passes, at most {args.tokens} tokens, greedy; prompts of the same length as llama-server's: "
          f"{same_prompt}/{len(reference)}; quickdraft's speculative fills equal to plain's: "
          + (", ".join(f"{m} {n}/{len(reference)}" for m, n in identical.items()) or "none run"))
    print(table(summary, ["engine", "mode", "fills", "tokens", "tok_s", "acceptance", "pass_at_1", "exact_span",
                          "vs_llama_plain"]))
    path = save(args.out, {"machine": {**info, "bandwidth_gbs": bandwidth}, "args": vars(args), "summary": summary,
                           "identical_to_plain": identical, "same_prompt_length": same_prompt,
                           "llama_server": str(binary),
                           "runs": [{"engine": e, "mode": m, **r} for (e, m), rows in runs.items() for r in rows]})
    print(f"wrote {path}")
    if any(n != len(reference) for n in identical.values()):
        sys.exit("MISMATCH: a quickdraft speculative fill differs from plain's")


if __name__ == "__main__":
    main()
