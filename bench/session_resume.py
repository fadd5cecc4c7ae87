"""Time to the first new token of a long conversation: resuming a saved session vs re-sending the history.

Usage: python bench/session_resume.py [--model smollm2-135m] [--tokens 2000] [--reply-tokens 96] [--repeats 3]

The conversation: successive public MT-Bench questions (both turns of each record, in file order) as chat
turns of one session, each answered by the model itself (greedy, at most --reply-tokens tokens), until the
history holds at least --tokens tokens. The session is saved to a snapshot file, then, --repeats times, in a
freshly built LLM (so its prefix cache is cold):

  (b) re-send: ``llm.generate(history_ids, max_tokens=1)``: the whole history is prefilled;
  (a) resume:  ``llm.load_session(file)`` + ``generate(None, max_tokens=1)``, timed from the load call
      (reading and checking the file, scattering the saved KV into the pool, one one-token target pass).

The snapshot was just written, so it is read from the OS page cache (a cold disk read adds its size / disk
bandwidth). Medians are reported, with the ratio (b) / (a).
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import BENCH_DATA, machine, save, table  # noqa: E402

from quickdraft import LLM, SamplingParams  # noqa: E402


def mt_bench_turns() -> list[str]:
    records = [json.loads(line) for line in (BENCH_DATA / "mt_bench.public.jsonl").read_text().splitlines()]
    return [turn for r in records for turn in r["turns"]]


def build_conversation(llm: LLM, tokens: int, reply_tokens: int):
    session = llm.session()
    params = SamplingParams(max_tokens=reply_tokens, temperature=0.0)
    questions = iter(mt_bench_turns())
    while session.num_tokens < tokens:
        session.chat({"role": "user", "content": next(questions)}, params)
    return session


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=2000, help="conversation length to reach (tokens)")
    ap.add_argument("--reply-tokens", type=int, default=96, help="max tokens of each generated assistant reply")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    info = machine()
    print(f"machine: {info['cpu']}, {info['cores']} cores, torch {info['torch']}, {args.threads} threads")

    llm = LLM(args.model)
    t0 = time.perf_counter()
    session = build_conversation(llm, args.tokens, args.reply_tokens)
    build_s = time.perf_counter() - t0
    history = list(session.history)
    workdir = Path(tempfile.mkdtemp(prefix="quickdraft-session-bench-"))
    snapshot = workdir / "conversation.qds"
    t0 = time.perf_counter()
    session.save(snapshot)
    save_s = time.perf_counter() - t0
    turns, dtype, weights = session.turns, str(llm.dtype).removeprefix("torch."), llm.weights
    session.close()
    print(f"conversation: {turns} chat turns, {len(history)} tokens (built in {build_s:.1f}s); snapshot "
          f"{snapshot.stat().st_size / 1e6:.1f} MB, saved in {save_s * 1000:.0f} ms")
    del llm, session
    gc.collect()

    one = SamplingParams(max_tokens=1, temperature=0.0)
    rows = []
    for run in range(args.repeats):
        llm = LLM(args.model)  # fresh: empty prefix cache
        t0 = time.perf_counter()
        resent = llm.generate([history], one)[0]
        resend_s = time.perf_counter() - t0

        t0 = time.perf_counter()
        resumed = llm.load_session(snapshot)
        load_s = time.perf_counter() - t0
        out = resumed.generate(None, one)
        resume_s = time.perf_counter() - t0
        resumed.close()
        rows.append({"run": run + 1, "resume_ttft_s": resume_s, "load_s": load_s, "resend_ttft_s": resend_s,
                     "speedup": resend_s / resume_s, "same_token": out.token_ids == resent.token_ids})
        print(table([rows[-1]], list(rows[-1])), flush=True)
        del llm, resumed
        gc.collect()

    med_resume = statistics.median(r["resume_ttft_s"] for r in rows)
    med_resend = statistics.median(r["resend_ttft_s"] for r in rows)
    summary = {"model": args.model, "dtype": dtype, "weights": weights, "history_tokens": len(history),
               "resume_ttft_s": med_resume, "resend_ttft_s": med_resend, "speedup": med_resend / med_resume}
    print("\nmedians over", args.repeats, "runs")
    print(table([summary], list(summary)))
    path = save("session_resume", {
        "machine": info, "threads": args.threads,
        "conversation": f"{turns} chat turns of public MT-Bench questions (both turns of each record, file order) "
                        f"answered by the model (greedy, <= {args.reply_tokens} tokens each): {len(history)} tokens",
        "snapshot_bytes": snapshot.stat().st_size, "save_s": save_s,
        "method": "each run builds a fresh LLM (cold prefix cache); re-send = generate(history_ids, max_tokens=1); "
                  "resume = load_session(file) + generate(None, max_tokens=1) timed from the load call; "
                  "the snapshot is read from the OS page cache",
        "runs": rows, "median": summary})
    snapshot.unlink()
    workdir.rmdir()
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
