"""What each sampler costs a decode step on the host: milliseconds of ``LogitsProcessor.process`` for one row (a
plain step) and for five (a verification of four drafts), over a 151,936-token vocabulary (Qwen2.5's), at contexts
of 1k, 8k and 32k tokens.

The context is text-like (Zipf-distributed ids) with a 64-token passage repeated every 512 tokens, so DRY finds
repeats to penalize (and, for DRY's worst case, one token repeated throughout); DRY's breakers are 1% of the vocabulary (about what "\\n", ":", '"', "*" mark in Qwen's).
Logits shaped as a language model's (the k-th most likely token's logit -1.8 log k, plus noise of deviation 0.3,
in a random order per row: entropy about 2.2 nats, the top token 0.5; uniform random logits would spread the mass
over thousands of tokens as no model's do). Compare the figures with a decode step of the model that runs them (the
1.5B at about 30 ms a token on a 2-core machine, docs/MEASUREMENTS.md).

``--logprobs`` measures instead what a token's logprobs cost (``sampler.top_logprobs``: the chosen token's logprob
and rank and the top k) on quickdraft's kernel and on torch's operations, for 1 row (a decode step), 5 (a verify
pass) and 256 (a slice of a scored prompt).

Usage: python bench/sampler_cost.py [--repeats 15] [--contexts 1024,8192,32768] [--name sampler_cost] [--logprobs]
Prints a table and writes bench/results/<name>.json (the median of ``--repeats`` calls per row).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, save, table  # noqa: E402

from quickdraft.sampling import LogitsProcessor, SamplingParams  # noqa: E402
from quickdraft.sampling.dry import SequenceBreakers  # noqa: E402
from quickdraft.sampling.sampler import _torch_logprobs, top_logprobs  # noqa: E402

VOCAB = 151_936
SETUPS = {
    "greedy": dict(temperature=0),
    "temperature": dict(temperature=0.8),
    "top_k 40 + top_p 0.95": dict(temperature=0.8, top_k=40, top_p=0.95),
    "min_p 0.05": dict(temperature=0.8, min_p=0.05),
    "typical_p 0.9": dict(temperature=0.8, typical_p=0.9),
    "top_n_sigma 1.0": dict(temperature=0.8, top_n_sigma=1.0),
    "xtc 0.5 / 0.1": dict(temperature=0.8, xtc_probability=0.5, xtc_threshold=0.1),
    "dry 0.8 (greedy)": dict(temperature=0, dry_multiplier=0.8),
    "dry 0.8 + min_p": dict(temperature=0.8, dry_multiplier=0.8, min_p=0.05),
    "mirostat 1 (tau 5, eta 0.1)": dict(temperature=0.8, mirostat=1),
    "mirostat 2 (tau 5, eta 0.1)": dict(temperature=0.8, mirostat=2),
    "repetition 1.1 (vLLM's)": dict(temperature=0, repetition_penalty=1.1),
    "repetition 1.1, last 64 (llama.cpp's)": dict(temperature=0, repetition_penalty=1.1, repeat_last_n=64),
    "repetition 1.1, last -1 (llama.cpp's)": dict(temperature=0, repetition_penalty=1.1, repeat_last_n=-1),
}


def context_ids(length: int, rng: np.random.Generator) -> list[int]:
    ids = np.minimum(rng.zipf(1.2, size=length), VOCAB - 1).astype(np.int64)
    passage = ids[:64].copy()
    for start in range(512, length - 64, 512):
        ids[start:start + 64] = passage
    return ids.tolist()


def timed(proc: LogitsProcessor, logits: torch.Tensor, drafted: list[int], repeats: int) -> float:
    proc.process(logits, drafted)  # builds the caches a request builds once
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        proc.process(logits, drafted)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def logprobs_cost(logits: torch.Tensor, repeats: int) -> list[dict]:
    """ms of top_logprobs (the kernel) and of torch's operations, per call of 1, 5 and 256 rows, k 1 and 20."""
    rows = []
    for count in (1, 5, 256):
        x = logits.repeat(-(-count // len(logits)), 1)[:count].contiguous()
        chosen = torch.arange(count) * 37 % VOCAB
        for k in (1, 20):
            row = {"rows": count, "k": k}
            for name, fn in (("kernel_ms", lambda: top_logprobs(x, chosen, k)),
                             ("torch_ms", lambda: _torch_logprobs(x, chosen, k))):
                fn()
                times = []
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    fn()
                    times.append(time.perf_counter() - t0)
                row[name] = statistics.median(times) * 1e3
            row["speed_up"] = row["torch_ms"] / row["kernel_ms"]
            rows.append(row)
            print(f"{count:>4} rows, k {k:>2}: kernel {row['kernel_ms']:8.2f} ms, torch {row['torch_ms']:8.2f} ms",
                  flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--contexts", default="1024,8192,32768")
    ap.add_argument("--name", default="sampler_cost")
    ap.add_argument("--logprobs", action="store_true", help="measure the logprobs' cost instead")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    whole = np.zeros(VOCAB, dtype=bool)
    whole[::97] = True
    breakers = SequenceBreakers(whole, whole.copy(), {})
    g = torch.Generator().manual_seed(0)
    shape = -1.8 * torch.log(torch.arange(1, VOCAB + 1, dtype=torch.float32))
    logits = torch.stack([(shape + 0.3 * torch.randn(VOCAB, generator=g))[torch.randperm(VOCAB, generator=g)]
                          for _ in range(5)])
    if args.logprobs:
        rows = logprobs_cost(logits, args.repeats)
        print(table(rows, ["rows", "k", "kernel_ms", "torch_ms", "speed_up"]))
        where = save(args.name, {"machine": machine(), "vocab": VOCAB, "threads": torch.get_num_threads(),
                                 "rows": rows})
        print(f"machine: {machine()['cpu']}, {torch.get_num_threads()} threads; wrote {where}")
        return
    rows = []
    for length in (int(c) for c in args.contexts.split(",")):
        context = context_ids(length, rng)
        prompt, output, drafted = context[:-20], context[-20:], context[-4:]
        for name, kw in SETUPS.items():
            row = {"context": length, "sampler": name}
            for count in (1, 5):
                proc = LogitsProcessor(SamplingParams(**kw), prompt, VOCAB, breakers=breakers)
                proc.accept(output)
                row[f"ms_{count}_row{'s' if count > 1 else ''}"] = timed(proc, logits[:count], drafted[:count - 1],
                                                                        args.repeats)
            rows.append(row)
            print(f"{length:>6} {name:<24} {row['ms_1_row']:7.2f} {row['ms_5_rows']:7.2f} ms", flush=True)
        # DRY's worst case: one token repeated (every position a repeat as long as it can be)
        row = {"context": length, "sampler": "dry 0.8, one token repeated"}
        for count in (1, 5):
            proc = LogitsProcessor(SamplingParams(temperature=0, dry_multiplier=0.8), [7] * (length - 20), VOCAB,
                                   breakers=breakers)
            proc.accept([7] * 20)
            row[f"ms_{count}_row{'s' if count > 1 else ''}"] = timed(proc, logits[:count], [7] * (count - 1),
                                                                    args.repeats)
        rows.append(row)
    columns = ["context", "sampler", "ms_1_row", "ms_5_rows"]
    print(table(rows, columns))
    where = save(args.name, {"machine": machine(), "vocab": VOCAB, "threads": torch.get_num_threads(), "rows": rows})
    print(f"machine: {machine()['cpu']}, {torch.get_num_threads()} threads; wrote {where}")


if __name__ == "__main__":
    main()
