"""What loading a GGUF costs on disk and in time: the converted-weight cache entry its first load writes, the first
load (converting) and a second one (mapping the entry), then greedy decode speed, each model in a process of its own
on an empty cache (its C kernels copied in prebuilt, so no build is timed).

Usage: python bench/load_cache.py [--models qwen2.5-coder-1.5b,...|PATH.gguf] [--tokens 64] [--name load_cache]
Prints a table and writes bench/results/<name>.json. To compare two versions of the code, run it at each (the cache
directory is its own, so neither sees the other's entries).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, save, table  # noqa: E402

PROMPT = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'


def measure(model: str, tokens: int) -> dict:
    """One model, in this process (the caller gives it an empty $QUICKDRAFT_CACHE_DIR)."""
    import resource

    from quickdraft import LLM, SamplingParams
    from quickdraft.paths import cache_root

    start = time.perf_counter()
    llm = LLM(model)
    first = time.perf_counter() - start
    entry = sum(p.stat().st_size for p in (cache_root() / "quantized").glob("*.safetensors"))
    del llm
    start = time.perf_counter()
    llm = LLM(model)
    second = time.perf_counter() - start
    ids = llm.tokenizer.encode(PROMPT)
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    llm.generate([ids], params)
    rates = []
    for _ in range(3):
        llm.reset_prefix_cache()
        rates.append(llm.generate([ids], params)[0].metrics.tokens_per_s)
    return dict(model=Path(model).name, file_gb=Path(llm.loaded.checkpoint.source).stat().st_size / 1e9,
                cache_entry_gb=entry / 1e9, first_load_s=first, second_load_s=second,
                decode_tok_s=sum(rates) / len(rates), peak_rss_gb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="qwen2.5-coder-1.5b")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--name", default="load_cache")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # a child process measuring one model
    args = ap.parse_args()
    if args.one:
        print(json.dumps(measure(args.one, args.tokens)))
        return
    from quickdraft.models import native
    from quickdraft.paths import cache_root

    native.available()  # built once into the user's cache, copied into each empty one
    rows = []
    for model in args.models.split(","):
        with tempfile.TemporaryDirectory() as empty:
            if (cache_root() / "kernels").is_dir():
                shutil.copytree(cache_root() / "kernels", Path(empty) / "kernels")
            out = subprocess.run([sys.executable, __file__, "--one", model, "--tokens", str(args.tokens)],
                                 env={**os.environ, "QUICKDRAFT_CACHE_DIR": empty}, capture_output=True, text=True,
                                 check=True)
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(rows[-1], flush=True)
    columns = ["model", "file_gb", "cache_entry_gb", "first_load_s", "second_load_s", "decode_tok_s", "peak_rss_gb"]
    print(table(rows, columns))
    print(f"wrote {save(args.name, {'machine': machine(), 'args': vars(args), 'rows': rows})}")


if __name__ == "__main__":
    main()
