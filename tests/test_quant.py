"""Quantized execution: Int8Linear / Int4Linear, the exact GGUF Q4 -> int4 mapping, quantized models, the cache."""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

from quickdraft.errors import InvalidParameterError
from quickdraft.kv import ForwardItem, ModelRunner, SequenceKV
from quickdraft.loading import load_checkpoint
from quickdraft.loading import quantize as qz
from quickdraft.loading import quant_cache
from quickdraft.loading.quant_convert import LAYER_LINEARS, Sources, gguf_int4_params
from quickdraft.loading.dequant import dequantize
from quickdraft.loading.gguf import unpermute_rows
from quickdraft.models import build_model
from quickdraft.models import qmatmul
from quickdraft.models.packed import PackedLinear
from quickdraft.models.quant import Int4Linear, Int8Linear
from quickdraft.models.quant_backends import BACKENDS
from quickdraft.models.quant_formats import dequantize_int4, pack_nibbles, quantize_int4, quantize_int8, unpack_nibbles

try:
    from fixtures_loading import write_tiny_gguf
except ImportError:  # tests/ imported as a package
    from tests.fixtures_loading import write_tiny_gguf

BF16_EPS = 2.0 ** -8  # unit roundoff of bfloat16 (8-bit significand): |bf16(v) - v| <= BF16_EPS * |v|


def _layer_data(n: int = 40, k: int = 256, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    w[3, 7] = 0.9  # an outlier row/group
    w[5] += 0.3  # a row with an offset (exercises the int4 zero)
    b = torch.randn(n, generator=g)
    x = torch.randn(5, k, generator=g)
    return w, b, x


needs_qmatmul = pytest.mark.skipif(not qmatmul.available(), reason="qmatmul kernel not built on this CPU")


def _activation_rounding(x: torch.Tensor, w_hat: torch.Tensor) -> torch.Tensor:
    """Bound on what qmatmul's int8 activations change in x @ w_hat.T: each element moves by at most half a step,
    amax(group of 32) / 254, so row m, output n moves by at most sum_g amax[m, g] / 254 * sum_(k in g) |w_hat[n, k]|."""
    m, k = x.shape
    step = x.float().abs().reshape(m, k // 32, 32).amax(-1) / 254
    return step @ w_hat.abs().reshape(w_hat.shape[0], k // 32, 32).sum(-1).T


def _assert_backends_agree(y, other, x, w_hat, b):
    """Two backends of one layer agree within bfloat16 rounding and qmatmul's int8 activation rounding."""
    tol = _activation_rounding(x, w_hat) + 8 * BF16_EPS * (x.float().abs() @ w_hat.abs().T + b.abs()) + 1e-3
    assert ((y.float() - other.float()).abs() <= tol).all()


def _check_output(mod, w_hat, b, x, dtype):
    """Output = x @ w_hat.T + b up to bfloat16 activation/accumulation rounding (and, with qmatmul, int8
    activations), and keeps the input dtype."""
    xd = x.to(dtype)
    y = mod(xd)
    assert y.dtype == dtype and y.shape == (x.shape[0], w_hat.shape[0])
    ref = xd.float().bfloat16().float() @ w_hat.T + b
    tol = 4 * BF16_EPS * (xd.float().abs() @ w_hat.abs().T + b.abs()) + 1e-4
    if mod.backend == "qmatmul":
        tol = tol + _activation_rounding(xd, w_hat)
    assert ((y.float() - ref).abs() <= tol).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_linear_within_quantization_error(dtype):
    w, b, x = _layer_data()
    mod = Int8Linear.from_float(w, b)
    w_hat = mod.dequantize()
    scale = mod.channel_scales().float()[:, None]
    assert ((w_hat - w).abs() <= scale / 2 + 1e-7).all()  # round to nearest, scale rounded up: no clipping
    assert (w.abs().amax(1, keepdim=True) <= 127 * scale).all()
    _check_output(mod, w_hat, b, x, dtype)
    # the float reference, within the quantization error bound sum_k |x_k| * scale / 2 (+ bf16 rounding)
    y = mod(x.to(dtype)).float()
    ref = x.to(dtype).float() @ w.T + b
    bound = x.to(dtype).float().abs() @ (scale.expand_as(w) / 2).T + 4 * BF16_EPS * (x.abs() @ w.abs().T + b.abs())
    if mod.backend == "qmatmul":
        bound = bound + _activation_rounding(x.to(dtype), w_hat)
    assert ((y - ref).abs() <= bound + 1e-3).all()
    fallback = Int8Linear(mod.int_weight(), mod.channel_scales(), b, kernel=False)
    _assert_backends_agree(fallback(x.to(dtype)), y, x.to(dtype), w_hat, b)


@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_linear_within_quantization_error(group_size, dtype):
    w, b, x = _layer_data()  # 40 rows: not a multiple of 16, so the kernel's row padding is exercised
    mod = Int4Linear.from_float(w, b, group_size)
    q, s, z = quantize_int4(w, group_size)
    assert torch.equal(mod.int_weight(), q)  # recovered from the packed layout through the kernel
    w_hat = mod.dequantize()
    assert torch.equal(w_hat, dequantize_int4(q, s, z, group_size))
    s_el = s.float().repeat_interleave(group_size, 1)
    z_el = z.float().repeat_interleave(group_size, 1)
    assert ((w_hat - w).abs() <= s_el / 2 + BF16_EPS * z_el.abs() + 1e-6).all()
    _check_output(mod, w_hat, b, x, dtype)
    fallback = Int4Linear(q, s, z, group_size, b, kernel=False)
    _assert_backends_agree(fallback(x.to(dtype)), mod(x.to(dtype)), x.to(dtype), w_hat, b)
    assert torch.equal(fallback.int_weight(), q)


def _misaligned(t: torch.Tensor, offset_bytes: int = 8) -> torch.Tensor:
    """A copy of ``t`` whose data starts ``offset_bytes`` past a 64-byte boundary (like a safetensors mmap)."""
    n = offset_bytes // t.element_size()
    buf = torch.empty(t.numel() + n, dtype=t.dtype)
    out = buf[n:].view(t.shape)
    out.copy_(t)
    assert out.data_ptr() % 64 != 0
    return out


def test_torch_kernels_take_misaligned_operands():
    """torch's int8pack kernel segfaults on operands that are not 64-byte aligned (weights memory-mapped from the
    cache, sliced activations): the layers copy such operands."""
    w, b, x = _layer_data(n=48)
    for ref in (Int8Linear.from_float(w, b, kernel="torch"), Int4Linear.from_float(w, b, kernel="torch")):
        if isinstance(ref, Int8Linear):
            mod = Int8Linear(_misaligned(ref.qweight), _misaligned(ref.scales), b, kernel="torch")
        else:
            mod = Int4Linear.from_packed(_misaligned(ref.packed, 1), _misaligned(ref.scales_and_zeros, 2), 32,
                                         w.shape[1], w.shape[0], b)
        for rows in (1, 5):
            xm = _misaligned(x[:rows].bfloat16())
            assert torch.equal(mod(xm), ref(x[:rows].bfloat16()))


@needs_qmatmul
def test_qmatmul_layers_from_misaligned_kernel_tensors():
    """Cached kernel tensors are memory-mapped at any offset: the kernel reads them unaligned."""
    w, b, x = _layer_data(n=48, k=576)  # 576 columns: a partly padded last block
    for ref in (Int8Linear.from_float(w, b), Int4Linear.from_float(w, b)):
        cls = type(ref)
        mod = cls.from_kernel_tensors(_misaligned(ref.kweight, 3), _misaligned(ref.kscales, 2), w.shape[1], b)
        for rows in (1, 5):
            assert torch.equal(mod(_misaligned(x[:rows].bfloat16())), ref(x[:rows].bfloat16()))


@needs_qmatmul
@pytest.mark.parametrize("k", [256, 576, 1536])
def test_qmatmul_rows_are_batch_invariant_and_match_other_backends(k):
    """Each row's output is bit-identical whether it is computed alone or among others (any row tile, 1 or 2
    threads), and agrees with torch's kernel and the reference within the int8 activation rounding."""
    w, b, _ = _layer_data(n=72, k=k)
    x = torch.randn(11, k, generator=torch.Generator().manual_seed(1)).bfloat16()
    for cls in (Int4Linear, Int8Linear):
        mods = {be: cls.from_float(w, b, kernel=be) for be in BACKENDS if be != "triton"}  # (the GPU kernel: test_triton_linear.py)
        mod = mods["qmatmul"]
        full = mod(x)
        threads = torch.get_num_threads()
        try:
            for n_threads in (1, 2):
                torch.set_num_threads(n_threads)
                for rows in (slice(0, 1), slice(3, 5), slice(2, 9), slice(0, 11)):
                    assert torch.equal(mod(x[rows]), full[rows])
        finally:
            torch.set_num_threads(threads)
        w_hat = mod.dequantize()
        assert torch.equal(w_hat, mods["torch"].dequantize())
        for other in ("torch", "reference"):
            _assert_backends_agree(full, mods[other](x), x, w_hat, b)


def test_nibble_roundtrip_and_bad_group():
    q = torch.randint(0, 16, (16, 64), dtype=torch.uint8)
    assert torch.equal(unpack_nibbles(pack_nibbles(q)), q)
    with pytest.raises(ValueError):
        quantize_int4(torch.randn(16, 96), 64)
    q8, s8 = quantize_int8(torch.zeros(16, 32))  # all-zero rows stay finite
    assert torch.isfinite(s8.float()).all() and not q8.any()


# ---- exact GGUF mapping ------------------------------------------------------------------------------------


def _random_blocks(qtype: T, n_blocks: int, seed: int = 0) -> np.ndarray:
    """Random block bytes with finite fp16 scales."""
    rng = np.random.default_rng(seed)
    block, size = GGML_QUANT_SIZES[qtype]
    data = rng.integers(0, 256, size=(n_blocks, size), dtype=np.uint8)
    n_f16 = 1 if qtype == T.Q4_0 else 2
    f16 = (rng.standard_normal((n_blocks, n_f16)) * 0.01).astype(np.float16)
    data[:, : 2 * n_f16] = f16.view(np.uint8).reshape(n_blocks, 2 * n_f16)
    return data


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q4_K])
def test_gguf_int4_mapping_is_exact(qtype):
    shape = (16, 512)
    block = GGML_QUANT_SIZES[qtype][0]
    raw = _random_blocks(qtype, shape[0] * shape[1] // block)
    q, s, z = gguf_int4_params(raw, qtype, shape)
    assert q.dtype == torch.uint8 and int(q.max()) <= 15 and s.shape == (16, 16)
    ref = dequantize(raw, qtype, shape)
    # (q - 8) * scale + zero with float32 scale/zero: one float32 rounding away from the GGUF dequantization
    assert torch.allclose(dequantize_int4(q, s, z, 32), ref, rtol=1e-6, atol=1e-6 * ref.abs().max().item())
    assert gguf_int4_params(raw, T.Q5_0, shape) is None  # wider types are not mapped


@pytest.fixture(scope="module")
def smollm2_bf16(smollm2):
    return load_checkpoint(smollm2, dtype=torch.bfloat16)


def test_smollm2_q4_1_maps_exactly(smollm2_bf16):
    """SmolLM2's Q4_1 tensors (q/k rows permuted by llama.cpp) map to int4 and back to the dequantized GGUF."""
    sources = Sources.of(smollm2_bf16)
    src, types = sources.blocks, sources.block_types  # the file's own blocks (memory-mapped) and GGML types
    assert src is smollm2_bf16.blocks and types is smollm2_bf16.block_types
    cfg = smollm2_bf16.config
    for name, heads in (("model.layers.0.self_attn.q_proj.weight", cfg.num_heads),
                        ("model.layers.0.self_attn.k_proj.weight", cfg.num_kv_heads),
                        ("model.layers.5.mlp.down_proj.weight", None)):
        assert T(types[name]) == T.Q4_1
        shape = (cfg.num_heads * cfg.head_dim, cfg.hidden_size) if "q_proj" in name else None
        shape = shape or ((cfg.num_kv_heads * cfg.head_dim, cfg.hidden_size) if "k_proj" in name
                          else (cfg.hidden_size, cfg.intermediate_size))
        ref = dequantize(src[name], types[name], shape)
        q, s, z = gguf_int4_params(src[name], types[name], shape)
        if heads:
            ref = unpermute_rows(ref, heads)
            q, s, z = (unpermute_rows(t, heads) for t in (q, s, z))
        assert torch.allclose(dequantize_int4(q, s, z, 32), ref, rtol=0, atol=1e-6)
        if heads != cfg.num_heads:
            continue
        # in the layer, only scale and zero are rounded to bfloat16
        mod = Int4Linear(q, s, z, 32)
        s_el, z_el = s.repeat_interleave(32, 1), z.repeat_interleave(32, 1)
        bound = BF16_EPS * ((q.float() - 8).abs() * s_el.abs() + z_el.abs()) + 1e-6
        assert ((mod.dequantize() - ref).abs() <= bound).all()


# ---- whole models ------------------------------------------------------------------------------------------


def _logits(model, ids):
    runner = ModelRunner("t", model, 32 << 20)
    kv = SequenceKV()
    (out,) = runner.forward([ForwardItem(kv, ids, len(ids))])
    runner.free(kv)
    return out


@pytest.fixture(scope="module")
def smollm2_reference(smollm2_bf16):
    from quickdraft.engine.build import tokenizer_for

    text = ("The quick brown fox jumps over the lazy dog. Speculative decoding drafts several tokens and the "
            "target model verifies them in one forward pass, so the output is exactly what it would have been.")
    ids = tokenizer_for(smollm2_bf16).encode(text)
    return ids, _logits(build_model(smollm2_bf16.config, smollm2_bf16.tensors), ids)


# Bounds measured on 3 x 256 tokens of Spec-Bench summarization text (bench/quant_accuracy.py): int4 mean |d| 0.12,
# max 2.0, top-1 97%; int8 (requantized per channel from Q4_1, so coarser than int4's exact mapping) mean 0.25,
# max 3.9, top-1 95%. For reference float32 vs bfloat16: mean 0.10, max 1.5.
@pytest.mark.parametrize("fmt,mean_bound,max_bound", [("int4", 0.25, 4.0), ("int8", 0.5, 8.0)])
def test_quantized_smollm2_logits_close_to_bf16(smollm2_bf16, smollm2_reference, tmp_path, monkeypatch, fmt,
                                               mean_bound, max_bound):
    monkeypatch.setenv("QUICKDRAFT_CACHE_DIR", str(tmp_path))
    ckpt = smollm2_bf16
    ids, ref = smollm2_reference
    model = qz.load_model(ckpt, fmt)  # converted into the cache a layer at a time, then run mapped from it
    assert len(list((tmp_path / "quantized").glob("*.safetensors"))) == 1
    assert model.quant_info["format"] == fmt
    if fmt == "int4":
        assert model.quant_info["exact_from_file"] == 7 * ckpt.config.num_layers  # every layer is Q4_1
    n_quant = sum(isinstance(m, (Int4Linear, Int8Linear)) for m in model.modules())
    # the tied head gets its own int8 copy (row-independent kernel); the embedding's rows are read from the file's
    # blocks, in bfloat16
    assert n_quant == 7 * ckpt.config.num_layers + 1 and isinstance(model.lm_head, Int8Linear)
    assert model.model.embed_tokens(torch.tensor([0, 7])).dtype == torch.bfloat16
    out = _logits(model, ids)
    d = (out - ref).abs()
    assert d.mean().item() < mean_bound and d.max().item() < max_bound
    assert (out.argmax(-1) == ref.argmax(-1)).float().mean().item() >= 0.85


def _boom(*a, **k):
    raise AssertionError("should have loaded from the cache")


@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_cache_round_trip(tiny_dir, tmp_path, monkeypatch, fmt):
    """Untied Qwen2 (q/k/v bias, lm_head quantized): the first load converts into the cache and runs from it, with
    the logits of a conversion in memory; the second maps the cache without converting, identical logits; a damaged
    entry is rebuilt."""
    monkeypatch.setenv("QUICKDRAFT_CACHE_DIR", str(tmp_path))
    ckpt = load_checkpoint(tiny_dir(arch="qwen2", tie=False, vocab_size=96), dtype=torch.bfloat16)
    ids = list(range(1, 40))
    first = qz.load_model(ckpt, fmt)
    attn = first.model.layers[0].self_attn
    # on the qmatmul kernel q/k/v run as one call (QuantGroup), each keeping its own layer and bias
    assert (attn.qkv_proj is not None) == qmatmul.available()
    q_proj = attn.qkv_proj.layers[0] if attn.qkv_proj is not None else attn.q_proj
    assert isinstance(first.lm_head, Int8Linear) and q_proj.bias is not None
    files = list((tmp_path / "quantized").glob("*.safetensors"))
    assert len(files) == 1 and not list((tmp_path / "quantized").glob("*.tmp"))
    expected = _logits(first, ids)
    in_memory = qz.load_model(ckpt, fmt, use_cache=False)  # the same conversion, never written
    assert torch.equal(_logits(in_memory, ids), expected)
    assert first.quant_info == in_memory.quant_info

    # a cache hit converts nothing and reads no weight of the checkpoint: everything comes from the entry
    monkeypatch.setattr(qz, "quantize_model", _boom)
    monkeypatch.setattr(qz, "quantized_layers", _boom)
    monkeypatch.setattr(quant_cache, "TensorFileWriter", _boom)
    unread = dataclasses.replace(ckpt, tensors={k: None for k in ckpt.tensors})
    stamp = files[0].stat().st_mtime_ns
    second = qz.load_model(unread, fmt)
    assert torch.equal(_logits(second, ids), expected)
    assert second.quant_info == first.quant_info
    assert type(second.model.layers[1].mlp.down_proj) is type(first.model.layers[1].mlp.down_proj)
    assert files[0].stat().st_mtime_ns == stamp
    monkeypatch.undo()
    monkeypatch.setenv("QUICKDRAFT_CACHE_DIR", str(tmp_path))

    for damaged in (b"garbage", files[0].read_bytes()[: files[0].stat().st_size // 2]):
        files[0].write_bytes(damaged)  # damaged: ignored and rebuilt
        third = qz.load_model(ckpt, fmt)
        assert torch.equal(_logits(third, ids), expected)
        path, meta = quant_cache.quant_cache_entry(ckpt.fingerprint, fmt, 32, "int8", "bfloat16",
                                                   torch.device("cpu"), torch.bfloat16, wide_sources="int8",
                                                   head_rows=None)
        assert path == files[0] and quant_cache.open_quantized(path, meta) is not None  # rewritten whole
    assert not list((tmp_path / "quantized").glob("*.tmp"))


def test_wide_gguf_sources_become_int8(tiny_dir):
    """int4 keeps layers the GGUF stores with more than 4 bits (here F32) as int8 unless wide_sources='int4'."""
    ckpt = load_checkpoint(tiny_dir(arch="qwen2", tie=True, vocab_size=96), dtype=torch.float32)
    names = [n for n in ckpt.tensors if n.startswith("model.layers.") and n.endswith("proj.weight")]
    raw = {n: ckpt.tensors[n].numpy() for n in names}  # F32 "GGUF data" (qwen2: no q/k permutation)
    types = {n: int(T.F32) for n in names}
    ids = list(range(1, 30))
    ref = _logits(build_model(ckpt.config, ckpt.tensors), ids)
    for wide, cls, bound in (("int8", Int8Linear, 0.005), ("int4", Int4Linear, 0.05)):  # measured 0.0006, 0.006
        model = qz.quantize_model(build_model(ckpt.config, ckpt.tensors), "int4", Sources(raw, types),
                                  wide_sources=wide)
        assert all(isinstance(model.get_submodule(n.removesuffix(".weight")), cls) for n in names)
        assert model.quant_info["exact_from_file"] == 0
        assert (_logits(model, ids) - ref).abs().max() < bound * ref.abs().max()


def test_gguf_int4_cache_round_trip(tmp_path, monkeypatch):
    """From a GGUF (Q4_0 layers and tied embedding, q/k rows permuted): the layers map exactly from the file's blocks
    into the cache; a hit is identical and converts nothing; with the cache unwritable the model converts in memory,
    to the same logits."""
    monkeypatch.setenv("QUICKDRAFT_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "t.gguf"
    write_tiny_gguf(path, "llama", T.Q4_0, tied=True)
    ckpt = load_checkpoint(path, dtype=torch.bfloat16)
    ids = list(range(1, 30))
    first = qz.load_model(ckpt, "int4")
    assert first.quant_info["exact_from_file"] == 7 * ckpt.config.num_layers
    assert first.quant_info["kernels"]["int4"] == {"Q4_0": 7 * ckpt.config.num_layers}
    expected = _logits(first, ids)
    assert torch.equal(_logits(qz.load_model(ckpt, "int4", use_cache=False), ids), expected)
    monkeypatch.setattr(qz, "quantize_model", _boom)
    monkeypatch.setattr(qz, "quantized_layers", _boom)
    second = qz.load_model(ckpt, "int4")
    assert torch.equal(_logits(second, ids), expected) and second.quant_info == first.quant_info
    monkeypatch.undo()
    blocker = tmp_path / "blocker"
    blocker.write_text("not a directory")
    monkeypatch.setenv("QUICKDRAFT_CACHE_DIR", str(blocker))
    assert torch.equal(_logits(qz.load_model(ckpt, "int4"), ids), expected)


def test_float_formats_keep_float_weights_packed_for_onednn(tiny_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("QUICKDRAFT_CACHE_DIR", str(tmp_path))
    ckpt = load_checkpoint(tiny_dir(arch="llama", tie=True, vocab_size=96), dtype=torch.float32)
    unpacked = build_model(ckpt.config, ckpt.tensors)
    ids = torch.tensor([1, 5, 9, 2, 7])
    ref = _logits(unpacked, ids)
    for fmt in ("float32", "bfloat16", "float16"):  # float weights in the checkpoint's dtype (LLM passes its name)
        model = qz.load_model(ckpt, fmt)
        layer = model.model.layers[0]
        assert isinstance(layer.self_attn.qkv_proj, PackedLinear) and isinstance(layer.mlp.gate_up_proj, PackedLinear)
        assert isinstance(layer.mlp.down_proj, PackedLinear) and isinstance(model.lm_head, PackedLinear)
        assert model.model.embed_tokens.weight.dtype == torch.float32  # the tied embedding stays
        torch.testing.assert_close(_logits(model, ids), ref, atol=1e-4, rtol=1e-4)
    assert not (tmp_path / "weights").exists()  # an HF directory is mapped as it is: no float weight cache
    with pytest.raises(InvalidParameterError, match="group size"):
        qz.quantize_model(unpacked, "int4", group_size=128)  # hidden 64 is not a multiple of 128
    with pytest.raises(InvalidParameterError, match="group size"):
        qz.load_model(ckpt, "int4", group_size=128)
    assert not list((tmp_path / "quantized").glob("*"))  # the refused conversion left no partial cache file


def test_resolve_weights():
    q4 = {f"model.layers.0.{name}.weight": "Q4_K" for name in LAYER_LINEARS}
    assert qz.resolve_weights("auto", "cpu", q4) == ("gguf" if qmatmul.available() else "int4")  # tests/test_default_weights.py
    assert qz.resolve_weights("auto", "cpu") is None  # no GGUF types (an HF directory): float weights
    assert qz.resolve_weights("auto", "cuda:0", q4) is None  # off CPU: float weights
    for w in ("int4", "int8", "bfloat16", "float32"):
        assert qz.resolve_weights(w, "cpu") == w
    for bad in ("int3", "INT4", "fp16", "", None, 4):
        with pytest.raises(InvalidParameterError, match="weights must be one of"):
            qz.resolve_weights(bad, "cpu")
    with pytest.raises(InvalidParameterError, match="weights format must be one of"):
        qz.load_model(None, "int2")  # type: ignore[arg-type]  (refused before the checkpoint is looked at)


def test_without_qmatmul_layers_use_torch_kernels(tmp_path):
    """Where the kernel cannot be built (here: turned off; likewise no compiler or no VNNI) the layers fall back to
    torch's kernels, with the reason on record, in a fresh process."""
    code = ("from quickdraft.models import qmatmul; from quickdraft.models.quant import Int4Linear; "
            "from quickdraft.models.quant_backends import default_backend; "
            "import torch; m = Int4Linear.from_float(torch.randn(16, 64)); "
            "print(default_backend('cpu'), m.backend, qmatmul.unavailable_reason())")
    env = {**os.environ, "QUICKDRAFT_KERNELS": "0", "QUICKDRAFT_CACHE_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split()[:2] == ["torch", "torch"] and "QUICKDRAFT_KERNELS=0" in out
    with pytest.raises(ValueError, match="backend must be one of"):
        Int8Linear.from_float(torch.randn(16, 64), kernel="fast")


@pytest.mark.parametrize("use_cache", [True, False])
def test_cut_float_head_beside_quantized_layers(tiny_dir, tmp_path, monkeypatch, use_cache):
    """A draft's cut vocabulary with the head kept in float (lm_head=False), untied: the cache stores the head whole
    and the model built from it cuts it, as the in-memory conversion does."""
    monkeypatch.setenv("QUICKDRAFT_CACHE_DIR", str(tmp_path / "cache"))
    ckpt = load_checkpoint(tiny_dir(arch="llama", tie=False, vocab_size=96), dtype=torch.float32)
    ids = [1, 5, 9, 2, 7]
    expected = _logits(qz.load_model(ckpt, "int8", head_rows=40, lm_head=False, use_cache=False), ids)
    for _ in range(2):  # the conversion into the cache, then a hit
        model = qz.load_model(ckpt, "int8", head_rows=40, lm_head=False, use_cache=use_cache)
        assert model.lm_head.out_features == 40
        assert torch.equal(_logits(model, ids), expected)


def test_a_quantized_head_gives_float32_logits_from_bfloat16_activations(tiny_dir):
    """Logits rounded to bfloat16 tie often (a step of 0.5 at 64-128), and greedy choices would hinge on it."""
    from quickdraft import LLM
    from test_parity import our_logits

    llm = LLM(str(tiny_dir(arch="llama", vocab_size=96)), dtype="bfloat16", weights="int8", kv_cache_memory="16MiB")
    assert llm.model.lm_head.float_output
    logits = our_logits(llm, list(range(1, 40)))
    assert logits.dtype == torch.float32 and not torch.equal(logits, logits.bfloat16().float())


def test_a_change_of_the_stored_layout_makes_new_cache_files(monkeypatch):
    """A cache file written by code with another block layout is never read (it would decode as garbage): the
    digest of the files that define the layout is part of every qmatmul cache key."""
    from quickdraft.loading import quant_cache
    from quickdraft.models.quant_backends import default_backend

    if default_backend(torch.device("cpu")) != "qmatmul":
        pytest.skip("the qmatmul kernel does not run here")

    def key() -> Path:
        quant_cache.layout_digest.cache_clear()
        return quant_cache.quant_cache_entry("f" * 32, "gguf", 32, None, "gguf", torch.device("cpu"), torch.float32,
                                             wide_sources="none", head_rows=None)[0]

    before = key()
    read = Path.read_bytes
    monkeypatch.setattr(Path, "read_bytes", lambda self: read(self) + (b"\n" if self.name == "qformats.h" else b""))
    changed = key()
    monkeypatch.undo()
    assert changed != before and key() == before


def test_a_new_layout_deletes_the_files_no_build_can_read(tmp_path, monkeypatch):
    """Each layout change would leave a whole converted model behind: writing an entry deletes the same source's
    entries of another qmatmul layout (and only those)."""
    from quickdraft.loading import quant_cache
    from quickdraft.loading.tensor_file import TensorFileWriter

    def entry(name: str, layout: str, fingerprint: str = "f" * 32) -> Path:
        path = tmp_path / f"{fingerprint}-gguf-{name}.safetensors"
        with TensorFileWriter(path) as writer:
            writer.add("x", torch.zeros(4))
            writer.finish({"fingerprint": fingerprint, "layout": layout,
                           "quickdraft_quant_cache_version": quant_cache.QUANT_CACHE_VERSION})
        return path

    old, same, other_model, torch_kind = (entry("old", "qmatmul-aaaa"), entry("same", "qmatmul-bbbb"),
                                          entry("o", "qmatmul-aaaa", "e" * 32), entry("t", "cpu-avx2-torch2"))
    new = entry("new", "qmatmul-bbbb")
    meta = {"fingerprint": "f" * 32, "layout": "qmatmul-bbbb",
            "quickdraft_quant_cache_version": quant_cache.QUANT_CACHE_VERSION}
    assert quant_cache.drop_outdated(new, meta) == [old]
    assert not old.exists() and same.exists() and other_model.exists() and torch_kind.exists()


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_off_the_qmatmul_kernel_a_big_matrix_is_quantized_in_blocks_of_rows(tiny_dir, monkeypatch, fmt):
    """Layers off the qmatmul kernel (a GPU's) quantize a matrix of many rows a block of rows at a time (a 150k-row
    head would otherwise pass through gigabytes of float32 temporaries): the same layer as quantized whole."""
    from quickdraft.loading import quant_convert
    from quickdraft.models import quant_backends

    ckpt = load_checkpoint(tiny_dir(arch="qwen2", tie=False, vocab_size=96), dtype=torch.float32)
    for module in (quant_convert, quant_backends):
        monkeypatch.setattr(module, "default_backend", lambda device: "reference")

    def layers() -> dict[str, torch.nn.Module]:
        model = build_model(ckpt.config, ckpt.tensors)
        return {name: layer for name, layer, _ in quant_convert.quantized_layers(
            model, fmt, Sources(), torch.device("cpu"), lm_head=fmt)}

    whole = layers()
    monkeypatch.setattr(quant_convert, "DEVICE_ROWS_BYTES", 4 * 64 * 7)  # 7 rows of a 64-wide input a block
    read, real = [], Sources.float32
    monkeypatch.setattr(Sources, "float32", lambda self, name, linear, cfg, rows=None, device=None: read.append(
        rows) or real(self, name, linear, cfg, rows, device))
    blocks = layers()
    assert (0, 7) in read and (7, 14) in read
    assert blocks.keys() == whole.keys() and all(m.backend == "reference" for m in blocks.values())
    for name, layer in whole.items():
        assert all(torch.equal(a, b) for a, b in zip(layer.buffers(), blocks[name].buffers())), name
