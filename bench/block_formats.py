"""Every weight format of the qmatmul kernel on its own: one linear layer of a real shape, decode (1 row) and verify
(5 rows) calls, the weight bytes each call reads and the rate it streams them at, beside the machine's measured read
bandwidth (same run).

Shapes: Qwen2.5-1.5B's gate/up (8960 x 1536) and down (1536 x 8960), and a 896-wide one (the 0.5B's q/gate rows,
whose last 128 columns are tail records). The GGML formats are random file blocks repacked as a GGUF load does;
int4/int8 are quickdraft's own. Timing: the best of --repeats calls after a warm-up, the layers of one shape taking
turns, so a drift of the machine's speed falls on all of them. The kernels are the build of this process:
QUICKDRAFT_KERNEL_ISA=avx2 measures the AVX2 code on an AVX-512 machine (and is named in the output).

Usage: python bench/block_formats.py [--repeats 30] [--threads 2] [--out block_formats]
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, memory_bandwidth_gbs, save, table  # noqa: E402

from quickdraft.models import block_formats as bf, native  # noqa: E402
from quickdraft.models.block_linear import BlockLinear  # noqa: E402
from quickdraft.models.quant import Int4Linear, Int8Linear  # noqa: E402

SHAPES = {"gate 8960x1536": (8960, 1536), "down 1536x8960": (1536, 8960), "q 896x896 (tail)": (896, 896)}


def layers_for(n: int, k: int) -> dict[str, torch.nn.Module]:
    g = torch.Generator().manual_seed(0)
    out: dict[str, torch.nn.Module] = {}
    for name, fmt in bf.FORMATS.items():
        if not fmt.takes(k):
            continue
        raw = torch.randint(0, 256, (n * fmt.file_row_bytes(k),), generator=g, dtype=torch.uint8)
        blocks = raw.view(-1, fmt.block_bytes)
        fp16 = {"Q6_K": 208, "Q2_K": 80, "Q3_K": 108}.get(name, 0)
        blocks[:, fp16:fp16 + 2] = (torch.rand(blocks.shape[0], generator=g) * 0.01).half().view(torch.uint8).view(-1, 2)
        if name in ("Q4_1", "Q5_1", "Q4_K", "Q5_K", "Q2_K"):  # the second fp16 (m, dmin) right after the first
            blocks[:, fp16 + 2:fp16 + 4] = blocks[:, fp16:fp16 + 2]
        if name == "MXFP4":  # an exponent byte, not an fp16: scales 2^-8 .. 2^-5, as a model's weights have them
            blocks[:, 0] = torch.randint(120, 124, (blocks.shape[0],), generator=g, dtype=torch.uint8)
        out[name] = BlockLinear(bf.repack(name, raw, n, k), name, k)
    w = torch.randn(n, k, generator=g) * 0.02
    out["int4"], out["int8"] = Int4Linear.from_float(w), Int8Linear.from_float(w)
    return out


def layer_bytes(layer: torch.nn.Module) -> int:
    return sum(b.numel() * b.element_size() for b in layer.buffers())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--out", default="block_formats")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    isa = os.environ.get(native.ISA_ENV, "native")
    bandwidth = memory_bandwidth_gbs()
    info = machine()
    print(f"machine: {info['cpu']}, {args.threads} threads, kernels built '{isa}' "
          f"(512-bit VNNI: {native.wide_int8_dot_products()}); measured read bandwidth {bandwidth:.1f} GB/s")
    rows = []
    for shape, (n, k) in SHAPES.items():
        layers = layers_for(n, k)
        for m in (1, 5):
            x = torch.randn(m, k)
            best = {name: float("inf") for name in layers}
            for layer in layers.values():
                layer(x)
            for _ in range(args.repeats):
                for name, layer in layers.items():
                    t0 = time.perf_counter()
                    layer(x)
                    best[name] = min(best[name], time.perf_counter() - t0)
            for name, layer in layers.items():
                nbytes = layer_bytes(layer)
                file_bits = bf.FORMATS[name].bits_per_weight if name in bf.FORMATS else None
                rows.append({"shape": shape, "rows": m, "format": name, "isa": isa,
                             "bits_per_weight": 8 * nbytes / (n * k), "file_bits_per_weight": file_bits,
                             "us": best[name] * 1e6, "GB_s": nbytes / best[name] / 1e9,
                             "pct_of_bandwidth": 100 * nbytes / best[name] / 1e9 / bandwidth})
    print(table(rows, ["shape", "rows", "format", "bits_per_weight", "file_bits_per_weight", "us", "GB_s",
                       "pct_of_bandwidth"]))
    path = save(args.out, {"machine": info, "bandwidth_GB_s": bandwidth, "isa": isa, "args": vars(args),
                           "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
