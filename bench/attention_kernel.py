"""quickdraft's decode attention kernel alone (models/attention.c): milliseconds per layer call, by context length,
cache format, queries per sequence (1: a decode step; k+1: a verify pass) and thread count, for the head layouts of
Qwen2.5-Coder-0.5B (14 query heads, 2 key/value heads, head_dim 64) and -1.5B (12 / 2 / 128). Beside each: the
cache bytes the call reads per second.

    python bench/attention_kernel.py --contexts 1024,8192,16384
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, save, table  # noqa: E402

from quickdraft.kv.pool import KVPool  # noqa: E402
from quickdraft.models import native  # noqa: E402

SHAPES = {"0.5b": (14, 2, 64), "1.5b": (12, 2, 128)}


def time_call(q: torch.Tensor, pool: KVPool, items: native.AttnItems, repeats: int) -> float:
    out = torch.empty_like(q)
    native.attend(q, pool.layer(0), items, out, q.shape[-1] ** -0.5, 0)
    t0 = time.perf_counter()
    for _ in range(repeats):
        native.attend(q, pool.layer(0), items, out, q.shape[-1] ** -0.5, 0)
    return (time.perf_counter() - t0) / repeats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default="1024,8192,16384")
    ap.add_argument("--queries", default="1,5", help="queries per sequence: 1 decode, k+1 verify")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--out", default="attention_kernel")
    args = ap.parse_args()
    torch.manual_seed(0)
    rows = []
    for shape_name, (heads, kv_heads, dim) in SHAPES.items():
        for length in (int(c) for c in args.contexts.split(",")):
            for fmt in (torch.bfloat16, torch.int8):
                pool = KVPool(1, kv_heads, dim, -(-length // 16), 16, fmt, "cpu")
                pool.write(0, torch.arange(length), torch.randn(length, kv_heads, dim).bfloat16(),
                           torch.randn(length, kv_heads, dim).bfloat16())
                cache_bytes = pool.bytes_per_block(1, kv_heads, dim, 16, fmt) // 16 * length
                for nq in (int(n) for n in args.queries.split(",")):
                    q = torch.randn(nq, heads, dim).bfloat16()
                    items = native.AttnItems(torch.arange(nq), torch.arange(length).repeat(nq, 1).contiguous(),
                                             torch.arange(length - nq + 1, length + 1), torch.tensor([0, nq]))
                    for threads in (int(t) for t in args.threads.split(",")):
                        torch.set_num_threads(threads)
                        seconds = time_call(q, pool, items, args.repeats)
                        rows.append({"model": shape_name, "context": length, "cache": str(fmt).removeprefix("torch."),
                                     "queries": nq, "threads": threads, "ms": seconds * 1e3,
                                     "cache_GB_s": cache_bytes / seconds / 1e9})
                        print(rows[-1], flush=True)
    print(f"{machine()['cpu']}, one layer's attention call")
    print(table(rows, list(rows[0])))
    path = save(args.out, {"machine": machine(), "args": vars(args), "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
