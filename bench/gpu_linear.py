"""The GPU's linear layers one at a time: what weight-only int8 and int4 (``models/triton_linear.py``) give against
bfloat16 on cuBLAS, and bfloat16 on the same Triton tiles, on each projection of the SmolLM2, 1.5B and 7B shapes, at a
decode step's rows (1), a verify pass's (5) and a batch's (32).

Each call is timed inside a CUDA graph of ``--calls`` calls replayed back to back (as a decode step's graph runs
them), so launch gaps count as they do there. Bandwidth is the bytes the call reads (its weights, scales and
activations) over its time, against a device-to-device copy measured in the same run; "per token" sums a layer's
four projections times the layers, the linear part of a batch-1 decode step. int4 runs twice: K split over programs
where the shape asks (the default) and in one program per output tile, K not split (what splitting gains), and
bfloat16 on Triton's tiles both ways too. Gate/up also runs with its SwiGLU: cuBLAS or int4 then the activation's
own kernel, against the activation in the Triton kernel's last step (``gate=``). Q/k/v and gate/up on Triton's
bfloat16 tiles also run after the residual add and RMSNorm's own kernel (``triton_ops.add_rms_norm``), against the
add and the norm inside the call (``norm=``, where the call is not split: ``models/norms.py``). Every call writes
bfloat16, as the model's layers do.

Usage: python bench/gpu_linear.py [--shapes smollm2-135m,qwen2.5-1.5b,qwen2.5-7b] [--rows 1,5,32] [--calls 50]
       [--device cuda|cpu] [--name gpu_linear]
``--device cpu`` runs the kernels under Triton's interpreter on a small shape (``smoke``), to check the script.
Prints a table and writes bench/results/<name>.json.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
if "--device" in sys.argv and sys.argv[sys.argv.index("--device") + 1] == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # before Triton is first imported

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from common import machine, save, table  # noqa: E402
from cuda_decode import SHAPES, read_bandwidth  # noqa: E402

from quickdraft.models import triton_linear, triton_ops  # noqa: E402
from quickdraft.models.quant import Int4Linear, Int8Linear  # noqa: E402


def projections(shape: dict) -> dict[str, tuple[int, int]]:
    """(out, in) features of a decoder layer's four linear calls: q, k and v fused, o, gate and up fused, down."""
    d, heads, kv = shape["hidden_size"], shape["num_attention_heads"], shape["num_key_value_heads"]
    head_dim = d // heads
    return {"qkv": ((heads + 2 * kv) * head_dim, d), "o": (d, d),
            "gate_up": (2 * shape["intermediate_size"], d), "down": (d, shape["intermediate_size"])}


def time_call(call, calls: int, device: str) -> float:
    """Seconds per call: ``calls`` of them captured in a CUDA graph and replayed (on the CPU: run and timed)."""
    call()
    if device != "cuda":
        t0 = time.perf_counter()
        call()
        return time.perf_counter() - t0
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            call()
    graph.replay()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) / 1000 / calls)
    return best


def bench_projection(name: str, out_f: int, in_f: int, rows: list[int], calls: int, device: str, bandwidth: float
                     ) -> list[dict]:
    g = torch.Generator().manual_seed(out_f + in_f)
    weight = (torch.randn(out_f, in_f, generator=g) / in_f ** 0.5).to(device, torch.bfloat16)
    int8 = Int8Linear.from_float(weight, kernel="triton")
    int4 = Int4Linear.from_float(weight, group_size=32, kernel="triton")
    sz = int4.scales_and_zeros
    bf16 = torch.bfloat16
    formats = {
        "bfloat16": (lambda x: F.linear(x, weight), weight.numel() * 2),
        "bfloat16, triton": (lambda x: triton_linear.float_matmul(x, weight, out_dtype=bf16), weight.numel() * 2),
        "int8": (int8, int8.qweight.numel() + int8.scales.numel() * 2),
        "int4": (int4, int4.qweight.numel() + sz.numel() * 2),
        "int4, one program a tile": (lambda x: triton_linear.int4_matmul(x, int4.qweight, sz, 32, out_dtype=bf16,
                                                                         split=False),
                                     int4.qweight.numel() + sz.numel() * 2),
        "bfloat16, triton, one program a tile": (
            lambda x: triton_linear.float_matmul(x, weight, out_dtype=bf16, split=False), weight.numel() * 2),
        "bfloat16, triton, K split": (
            lambda x: triton_linear.float_matmul(x, weight, out_dtype=bf16, split=True), weight.numel() * 2),
    }
    if name == "gate_up":  # the activation after the call (its own kernel), or in the call's last step
        formats.update({
            "bfloat16, then gated": (lambda x: triton_ops.gated(F.linear(x, weight), "silu"), weight.numel() * 2),
            "bfloat16, triton, gated": (lambda x: triton_linear.float_matmul(x, weight, out_dtype=bf16, gate="silu"),
                                        weight.numel() * 2),
            "int4, then gated": (lambda x: triton_ops.gated(int4(x), "silu"), int4.qweight.numel() + sz.numel() * 2),
            "int4, gated": (lambda x: int4.forward_gated(x, "silu"), int4.qweight.numel() + sz.numel() * 2)})
    if name in ("qkv", "gate_up"):  # the layer's residual add and norm before the call (x as its own residual)
        gate = "silu" if name == "gate_up" else None
        norm_weight = torch.ones(in_f, device=device, dtype=bf16)
        formats.update({
            "bfloat16, triton, after add+norm": (
                lambda x: triton_linear.float_matmul(triton_ops.add_rms_norm(x, x, norm_weight, 1e-6)[1], weight,
                                                     out_dtype=bf16, gate=gate), weight.numel() * 2),
            "bfloat16, triton, add+norm in it": (
                lambda x: triton_linear.float_matmul(x, weight, out_dtype=bf16, gate=gate,
                                                     norm=triton_linear.AddNorm(x, norm_weight, 1e-6))[1],
                weight.numel() * 2)})
    out = []
    for m in rows:
        x = torch.randn(m, in_f, generator=g).to(device, torch.bfloat16)
        for fmt, (fn, weight_bytes) in formats.items():
            if fmt.endswith("in it") and triton_linear.splits(m, out_f // 2 if name == "gate_up" else out_f, in_f):
                continue  # (a split call keeps the norm's own kernel)
            seconds = time_call(lambda: fn(x), calls, device)
            read = weight_bytes + x.numel() * 2
            out.append(dict(projection=name, out=out_f, inp=in_f, rows=m, format=fmt, us=seconds * 1e6,
                            read_gb=read / 1e9, gb_s=read / seconds / 1e9, of_bandwidth=read / seconds / bandwidth))
    return out


def per_token(rows: list[dict], shape_name: str, layers: int) -> list[dict]:
    """A layer's four projections times the layers, per format and row count: the linear part of a decode step
    (formats timed on every projection; the gated ones are gate/up's alone)."""
    summary = []
    everywhere = [f for f in dict.fromkeys(r["format"] for r in rows)
                  if len({r["projection"] for r in rows if r["format"] == f}) == len({r["projection"] for r in rows})]
    for m in sorted({r["rows"] for r in rows}):
        for fmt in everywhere:
            chosen = [r for r in rows if r["rows"] == m and r["format"] == fmt]
            us = sum(r["us"] for r in chosen) * layers
            summary.append(dict(shape=shape_name, rows=m, format=fmt, layers_ms=us / 1000,
                                bytes_gb=sum(r["read_gb"] for r in chosen) * layers))
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="smollm2-135m,qwen2.5-1.5b,qwen2.5-7b")
    ap.add_argument("--rows", default="1,5,32")
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--name", default="gpu_linear")
    args = ap.parse_args()
    if args.device == "cpu":
        triton_linear.KERNEL_ON_CPU = triton_ops.KERNEL_ON_CPU = True
        shapes = ["smoke"]
    else:
        shapes = args.shapes.split(",")
    bandwidth = read_bandwidth(args.device)
    rows_per_call = [int(r) for r in args.rows.split(",")]
    calls, summary = [], []
    for shape_name in shapes:
        shape = SHAPES[shape_name]
        mine = []
        for proj, (out_f, in_f) in projections(shape).items():
            mine += bench_projection(proj, out_f, in_f, rows_per_call, args.calls, args.device, bandwidth)
        for r in mine:
            r["shape"] = shape_name
        print(table(mine, ["shape", "projection", "rows", "format", "us", "gb_s", "of_bandwidth"]))
        calls += mine
        summary += per_token(mine, shape_name, shape["num_hidden_layers"])
    print(table(summary, list(summary[0])))
    print(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s")
    path = save(args.name, {"machine": machine(), "args": vars(args), "bandwidth": bandwidth, "calls": calls,
                            "per_token": summary})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
