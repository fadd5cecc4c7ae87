"""Every GGML block format the qmatmul kernel reads at the file's own size (Q4_0 .. Q8_0, the K-quants Q2_K .. Q6_K,
IQ4_NL, IQ4_XS, the lattice IQ2_XXS .. IQ1_M, TQ1_0, TQ2_0, Q1_0, Q2_0, MXFP4): the repacked layout, the kernel
against the file's float32 weights, rows of every width the format allows (tail groups included), mixed formats in
one call, and tiny models written in each format that load, run on their own kernels, read the file's bytes per step,
compute the dequantized file's math and keep greedy speculative output equal to plain."""
from __future__ import annotations

import math
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT, GGUFWriter

from quickdraft import LLM, SamplingParams
from quickdraft.errors import ModelLoadError
from quickdraft.loading import load_checkpoint
from quickdraft.loading.dequant import dequantize
from quickdraft.loading.ggml_types import BY_NAME, ggml_type
from quickdraft.models import block_formats as bf, iq_grids
from quickdraft.models import qmatmul, step_weight_bytes
from quickdraft.models.block_linear import BlockLinear
from quickdraft.models.quant_group import QuantGroup

try:
    from fixtures_loading import cache_dir  # noqa: F401
except ImportError:  # tests/ imported as a package
    from tests.fixtures_loading import cache_dir  # noqa: F401

pytestmark = pytest.mark.skipif(not qmatmul.available(), reason="the qmatmul kernel is not built on this CPU")

FORMATS = list(bf.FORMATS)
FP16_AT = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q4_K": (0, 2), "Q5_K": (0, 2),
           "Q6_K": (208,), "IQ4_NL": (0,), "IQ4_XS": (0,), "Q1_0": (0,), "Q2_0": (0,), "MXFP4": (),
           "Q2_K": (80, 82), "Q3_K": (108,), "TQ2_0": (64,), "TQ1_0": (52,),
           **{name: (0,) for name in bf.GRID_FORMATS if name != "IQ1_M"}, "IQ1_M": ()}  # (IQ1_M's d: random_rows)
# widths with and without tail groups: 256 (one block), 64 / 128 (tail only), 576 (SmolLM2: 2 blocks + 2 groups),
# 896 (Qwen2.5 0.5B: 3 blocks + 4 groups), 1536
WIDTHS = (256, 64, 128, 576, 896, 1536)


def random_rows(name: str, n: int, k: int, seed: int, scale: float = 0.01) -> torch.Tensor:
    """The file's bytes of ``n`` random rows of ``k`` columns: random bits, finite fp16 numbers of either sign (of
    standard deviation ``scale``)."""
    fmt = bf.FORMATS[name]
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (n * k // fmt.block, fmt.block_bytes), generator=g, dtype=torch.uint8)
    for at in FP16_AT[name]:
        values = (torch.randn(blocks.shape[0], generator=g) * scale).half()
        blocks[:, at:at + 2] = values.view(torch.uint8).reshape(-1, 2)
    if name == "IQ1_M":  # its fp16 d is spread over the top nibbles of the block's last 4 16-bit words
        d = (torch.randn(blocks.shape[0], generator=g) * scale).half().view(torch.int16).to(torch.int32) & 0xFFFF
        for i in range(4):
            top = ((d >> (4 * i)) & 0xF).to(torch.uint8) << 4
            blocks[:, 49 + 2 * i] = (blocks[:, 49 + 2 * i] & 0x0F) | top
    if name == "MXFP4":  # its scale is an exponent byte, 2^(e - 128): values of about ``scale`` (at most 12 steps)
        top = 128 + math.floor(math.log2(scale)) - 2
        blocks[:, 0] = torch.randint(top - 4, top + 1, (blocks.shape[0],), generator=g, dtype=torch.uint8)
    return blocks.reshape(-1)


def q1_0_reference(raw: np.ndarray, n: int) -> np.ndarray:
    """llama.cpp's dequantize_row_q1_0: bit j of the block's 16 bytes -> +d or -d."""
    blocks = raw.reshape(-1, 18)
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32)
    bits = np.unpackbits(blocks[:, 2:], axis=1, bitorder="little").astype(np.float32)
    return np.where(bits == 1, d, -d).reshape(n, -1)


def q2_0_reference(raw: np.ndarray, n: int) -> np.ndarray:
    """llama.cpp's dequantize_row_q2_0: 2 bits of element j at (j % 4) * 2 of byte j / 4, value (q - 1) * d."""
    blocks = raw.reshape(-1, 18)
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32)
    q = (blocks[:, 2:, None] >> np.array([0, 2, 4, 6], dtype=np.uint8)) & 3
    return ((q.reshape(-1, 64).astype(np.float32) - 1) * d).reshape(n, -1)


def activation_rounding(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Bound on what the kernel's int8 activations change in x @ w.T: each element moves by at most half a step,
    amax(group of 32) / 254 (as in tests/test_quant.py)."""
    m, k = x.shape
    step = x.abs().reshape(m, k // 32, 32).amax(-1) / 254
    return step @ w.abs().reshape(w.shape[0], k // 32, 32).sum(-1).T


@pytest.mark.parametrize("name", FORMATS)
def test_the_file_bytes_per_row_and_the_kernels_agree(name):
    fmt = bf.FORMATS[name]
    for k in WIDTHS:
        if fmt.takes(k):
            assert fmt.row_bytes(k) == qmatmul.row_bytes(fmt.code, k)
            # the file's own size, or within 3%
            assert fmt.row_bytes(k) <= 1.03 * fmt.file_row_bytes(k)
        else:
            assert k % fmt.block or qmatmul.row_bytes(fmt.code, k) == 0
    assert ggml_type(BY_NAME[name]).type_size == fmt.block_bytes and ggml_type(BY_NAME[name]).block == fmt.block


@pytest.mark.parametrize("name", FORMATS)
def test_float_weights_are_the_files(name):
    """block_formats.dequantize (what the kernel multiplies with) = gguf-py's dequantization, or llama.cpp's reference
    formulas for the types gguf-py does not know; the loader's dequantize gives the same."""
    n, k = 6, 512
    raw = random_rows(name, n, k, seed=1)
    ours = bf.dequantize(name, raw, n, k)
    if name == "Q1_0":
        ref = q1_0_reference(raw.numpy(), n)
    elif name == "Q2_0":
        ref = q2_0_reference(raw.numpy(), n)
    else:
        import gguf.quants
        ref = gguf.quants.dequantize(raw.numpy().reshape(n, -1), QT[name])
    assert np.array_equal(ours.numpy(), ref)
    assert torch.equal(dequantize(raw, BY_NAME[name], (n, k)), ours)


@pytest.mark.parametrize("name", FORMATS)
def test_kernel_computes_the_files_weights(name):
    """Every width the format takes, 1 to 11 rows: within the int8 activations' rounding of x @ W.T (float64), with
    a bias; each row bit-identical alone and in the batch (speculative verification relies on it)."""
    fmt = bf.FORMATS[name]
    g = torch.Generator().manual_seed(2)
    for k in (w for w in WIDTHS if fmt.takes(w)):
        n = 40
        raw = random_rows(name, n, k, seed=k)
        w = bf.dequantize(name, raw, n, k)
        bias = torch.randn(n, generator=g)
        layer = BlockLinear(bf.repack(name, raw, n, k), name, k, bias)
        x = torch.randn(11, k, generator=g)
        x[3] *= 100  # a row of large activations
        y = layer(x)
        ref = (x.double() @ w.double().T + bias.double()).float()
        tol = activation_rounding(x, w) + 1e-5 * (x.abs() @ w.abs().T + bias.abs()) + 1e-6
        assert ((y - ref).abs() <= tol).all(), (name, k, ((y - ref).abs() / tol).max())
        for m in (1, 4, 8):
            assert torch.equal(layer(x[:m]), y[:m])
        assert torch.equal(layer(x[5:6])[0], y[5])
        assert torch.equal(layer(x.bfloat16()).float(), layer(x.bfloat16().float()).bfloat16().float())


def with_every_grid_index(name: str, raw: torch.Tensor) -> torch.Tensor:
    """``raw``'s blocks with their grid indices set to 0, 1, 2, .. in file order (wrapping at the grid's size), each
    field where the file keeps it (ggml's block structs)."""
    b = raw.reshape(-1, bf.FORMATS[name].block_bytes).clone()
    nb = b.shape[0]
    per = 8 if name.startswith("IQ3") else 4  # entries a group of 32
    entries = iq_grids.values(name).shape[0]
    idx = (torch.arange(nb * 8 * per) % entries).reshape(nb, 8, per)
    low = (idx & 0xFF).to(torch.uint8)
    if name == "IQ2_XXS":
        b[:, 2:66].view(nb, 8, 8)[:, :, :4] = low
    elif name == "IQ2_XS":  # 16 bits an entry: the index in the low 9, sign bits above
        words = b[:, 2:66].contiguous().view(torch.int16).to(torch.int32).reshape(nb, 8, 4) & ~511
        b[:, 2:66] = (words | idx).to(torch.int16).reshape(nb, 32).view(torch.uint8)
    elif name == "IQ2_S":
        b[:, 2:34] = low.reshape(nb, 32)
        b[:, 66:74] = ((idx >> 8) << (2 * torch.arange(4))).sum(-1).to(torch.uint8)
    elif name == "IQ3_XXS":
        b[:, 2:66] = low.reshape(nb, 64)
    elif name == "IQ3_S":
        b[:, 2:66] = low.reshape(nb, 64)
        b[:, 66:74] = ((idx >> 8) << torch.arange(8)).sum(-1).to(torch.uint8)
    elif name == "IQ1_S":  # 3 high bits an entry in the group's 16-bit word, scale and sign above
        b[:, 2:34] = low.reshape(nb, 32)
        words = b[:, 34:50].contiguous().view(torch.int16).to(torch.int32) & 0xF000
        b[:, 34:50] = (words | ((idx >> 8) << (3 * torch.arange(4))).sum(-1)).to(torch.int16).view(torch.uint8)
    else:  # IQ1_M: 3 high bits in the low 3 of the entry's nibble
        b[:, :32] = low.reshape(nb, 32)
        nib = ((b[:, 32:48].unsqueeze(-1) >> torch.tensor([0, 4], dtype=torch.uint8)) & 0xF).reshape(nb, 32)
        nib = (nib & 8) | (idx.reshape(nb, 32) >> 8).to(torch.uint8)
        b[:, 32:48] = nib[:, 0::2] | (nib[:, 1::2] << 4)
    return b.reshape(-1)


@pytest.mark.parametrize("name", bf.GRID_FORMATS)
def test_every_grid_entry_is_ggmls(name):
    """A lattice format's grid (iq_grids.py) is ggml's entry for entry (gguf-py's copy), and the kernel's gathers read
    the same table: rows whose blocks name every index in turn give the file's weights."""
    import gguf.quants
    grid = getattr(gguf.quants, iq_grids.SHARED.get(name, name))
    grid.init_grid()
    assert np.array_equal(iq_grids.values(name).numpy(), grid.grid.reshape(grid.grid_shape))
    entries = iq_grids.values(name).shape[0]
    k = 1024
    n = max(2, entries * (8 if name.startswith("IQ3") else 4) // 256)  # each index at least once
    raw = with_every_grid_index(name, random_rows(name, n, k, seed=5))
    w = bf.dequantize(name, raw, n, k)
    ref = gguf.quants.dequantize(raw.numpy().reshape(n, -1), QT[name])
    assert np.array_equal(w.numpy(), ref)
    # one-hot rows: the int8 activations are exact, y holds W's columns up to the float sums' rounding (a wrong entry
    # moves a weight by a grid step, 1/6 of the largest value at least)
    y = BlockLinear(bf.repack(name, raw, n, k), name, k)(3.0 * torch.eye(k))
    torch.testing.assert_close(y, 3.0 * w.T, rtol=1e-5, atol=1e-5 * float(w.abs().max()))


def test_one_call_mixes_formats_and_swiglu():
    """A Q4_K_M file's q/k/v and gate/up differ in type: one call takes them side by side (each its own format,
    int8 and int4 too), and gate/up with SwiGLU, equal to the layers one by one."""
    k = 512
    layers = []
    for i, name in enumerate(("Q5_0", "Q6_K", "Q4_K", "IQ4_XS", "Q8_0", "Q1_0")):
        raw = random_rows(name, 24 + 8 * i, k, seed=i)
        layers.append(BlockLinear(bf.repack(name, raw, 24 + 8 * i, k), name, k))
    from quickdraft.models.quant import Int4Linear, Int8Linear
    layers += [Int8Linear.from_float(torch.randn(16, k) * 0.02), Int4Linear.from_float(torch.randn(8, k) * 0.02)]
    x = torch.randn(6, k)
    fused = QuantGroup(layers)(x)
    assert torch.equal(fused, torch.cat([m(x) for m in layers], dim=1))
    gate = BlockLinear(bf.repack("Q4_K", random_rows("Q4_K", 32, k, 7), 32, k), "Q4_K", k)
    up = BlockLinear(bf.repack("Q6_K", random_rows("Q6_K", 32, k, 8), 32, k), "Q6_K", k)
    act = QuantGroup([gate, up], swiglu=True)(x)
    g_, u_ = gate(x), up(x)
    torch.testing.assert_close(act, g_ * torch.sigmoid(g_) * u_, rtol=1e-5, atol=1e-5)


def test_layer_refuses_what_its_format_cannot_hold():
    raw = random_rows("Q4_K", 4, 256, 0)
    packed = bf.repack("Q4_K", raw, 4, 256)
    with pytest.raises(ValueError, match="Q4_K rows cannot have 320 columns"):
        BlockLinear(packed, "Q4_K", 320)
    with pytest.raises(ValueError, match=r"Q4_K weight must be uint8 \[N, 148\]"):
        BlockLinear(packed[:, :100], "Q4_K", 256)
    with pytest.raises(ValueError, match="format must be one of"):
        BlockLinear(packed, "Q8_K", 256)


# ---- tiny models written in each format ---------------------------------------------------------------------------

def _patch_tensor_types(path: Path, names: set[str], new_type: int, scale_dim0: float) -> None:
    """Rewrite the type id of ``names`` in a GGUF's tensor infos (and their row length by ``scale_dim0``): how a test
    writes a type this gguf-py cannot write (Q2_0 as Q1_0 rows of twice the length: the same bytes per row)."""
    data = bytearray(path.read_bytes())
    for name in names:
        key = struct.pack("<Q", len(name)) + name.encode()
        at = data.index(key) + len(key)
        n_dims = struct.unpack_from("<I", data, at)[0]
        dim0 = struct.unpack_from("<Q", data, at + 4)[0]
        struct.pack_into("<Q", data, at + 4, int(dim0 * scale_dim0))
        struct.pack_into("<I", data, at + 4 + 8 * n_dims, new_type)
    path.write_bytes(bytes(data))


def _byte_tokens() -> list[str]:
    """GPT-2's printable stand-ins for the 256 bytes (the byte-level BPE alphabet)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    extra = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(extra)) for b in range(256)]


BYTE_TOKENS = _byte_tokens()


def write_model(path: Path, name: str, hidden: int, ffn: int, seed: int = 0, arch: str = "qwen2") -> None:
    """A 2-layer GGUF (qwen2: biases on q/k/v; llama: none, and its q/k rows in llama.cpp's permuted order; a tied
    head) whose matrices, embedding included, are random blocks of ``name``; norms and biases F32."""
    vocab, heads, kv_heads, layers = 257, 4, 2, 2
    hd = 64
    rng = np.random.default_rng(seed)
    writer = GGUFWriter(str(path), arch)
    for add, value in ((writer.add_block_count, layers), (writer.add_context_length, 512),
                       (writer.add_embedding_length, hidden), (writer.add_feed_forward_length, ffn),
                       (writer.add_head_count, heads), (writer.add_head_count_kv, kv_heads),
                       (writer.add_key_length, hd), (writer.add_value_length, hd), (writer.add_rope_freq_base, 1e4),
                       (writer.add_layer_norm_rms_eps, 1e-6), (writer.add_file_type, 0)):
        add(value)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(BYTE_TOKENS + ["!!"])  # a byte-level vocabulary: the 256 bytes and one merge
    writer.add_token_merges(["! !"])
    writer.add_eos_token_id(0)
    stored = "Q1_0" if name == "Q2_0" else name  # written as Q1_0 rows of twice the length, then patched
    patched = set()
    # weights of standard deviation about 0.02 in every format (random bits make a format's values alone anywhere
    # from +-1 to +-250 times its scale), so that no model's activations blow up
    unit = bf.dequantize(name, random_rows(name, 16, 512, seed=seed), 16, 512).std().item() / 0.01
    scale = 0.02 / unit

    def matrix(gname: str, rows: int, cols: int) -> None:
        raw = random_rows(name, rows, cols, seed=int(rng.integers(1 << 30)), scale=scale).numpy().reshape(rows, -1)
        writer.add_tensor(gname, raw, raw_dtype=QT[stored])  # the shape follows from the bytes per row
        patched.add(gname)

    def vector(gname: str, size: int, base: float) -> None:
        writer.add_tensor(gname, (base + 0.05 * rng.standard_normal(size)).astype(np.float32))

    matrix("token_embd.weight", vocab, hidden)
    vector("output_norm.weight", hidden, 1.0)
    for i in range(layers):
        p = f"blk.{i}."
        vector(p + "attn_norm.weight", hidden, 1.0)
        vector(p + "ffn_norm.weight", hidden, 1.0)
        matrix(p + "attn_q.weight", heads * hd, hidden)
        matrix(p + "attn_k.weight", kv_heads * hd, hidden)
        matrix(p + "attn_v.weight", kv_heads * hd, hidden)
        for part, size in (("q", heads * hd), ("k", kv_heads * hd), ("v", kv_heads * hd)) if arch == "qwen2" else ():
            vector(p + f"attn_{part}.bias", size, 0.0)
        matrix(p + "attn_output.weight", hidden, heads * hd)
        matrix(p + "ffn_gate.weight", ffn, hidden)
        matrix(p + "ffn_up.weight", ffn, hidden)
        matrix(p + "ffn_down.weight", hidden, ffn)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    if name == "Q2_0":
        _patch_tensor_types(path, patched, BY_NAME["Q2_0"], 0.5)


def shapes_for(name: str) -> list[tuple[int, int]]:
    """(hidden, ffn) of the tiny models of a format: whole blocks, and for the formats with tail records rows with a
    tail (hidden 384 = one block and 4 groups, ffn 640 = two blocks and 4 groups)."""
    return [(256, 512)] + ([(384, 640)] if bf.FORMATS[name].tail_cols else [])


@pytest.fixture(scope="module")
def model_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("block_models")
    made = {}
    for name in FORMATS:
        for hidden, ffn in shapes_for(name):
            path = root / f"{name}-{hidden}.gguf"
            write_model(path, name, hidden, ffn)
            made[name, hidden] = path
    return made


GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 17, 99, 3, 41, 7, 5, 17, 99, 3, 41, 7], [200, 13, 13, 62, 140, 8, 200, 13, 13]]


def file_tensor_bytes(path: Path) -> int:
    """Bytes of every tensor the GGUF holds (the tied head reads the embedding's: a step reads them all but the
    embedding rows it does not look up)."""
    from quickdraft.loading.gguf_metadata import tensor_shapes
    return sum(math.prod(shape) // ggml_type(BY_NAME[t]).block * ggml_type(BY_NAME[t]).type_size
               for t, shape in tensor_shapes(path).values())


def logits(llm: LLM, ids: list[int]) -> torch.Tensor:
    from quickdraft.kv import ForwardItem, SequenceKV
    kv = SequenceKV()
    with torch.inference_mode():
        (out,) = llm.target.forward([ForwardItem(kv, ids, len(ids))])
    llm.target.free(kv)
    return out


# logits against the float32 model of the same file's dequantized weights, relative to their largest magnitude: the
# int8 activations' error alone (the weights are the file's own), which these random-bit models amplify: measured
# 0.5-1.3% (Q4_0, Q8_0, IQ4_NL, Q6_K, Q1_0), and weights='int4' on the Q4_0 model (the same activations) gives the
# same; a wrong tensor, row order or scale gives errors of the logits' own size
LOGIT_BOUND = 0.03


@pytest.mark.parametrize("name", FORMATS)
def test_tiny_model_runs_its_own_format(model_files, name, cache_dir):
    for hidden, _ in shapes_for(name):
        path = model_files[name, hidden]
        llm = LLM(str(path), dtype="float32", kv_cache_memory="16MiB")
        assert llm.weights == "gguf"
        assert llm.model.quant_info["kernels"] == {name: {name: 14, f"{name} lm_head": 1}}
        assert all(isinstance(m, BlockLinear) for m in llm.model.modules() if hasattr(m, "kernel_name"))
        # the bytes a step reads: the file's tensors, within 3%
        assert abs(step_weight_bytes(llm.model) / file_tensor_bytes(path) - 1) <= 0.03
        # the dequantized file's math: float32 weights from the same file
        ref = LLM(str(path), dtype="float32", weights="float32", kv_cache_memory="16MiB")
        for ids in PROMPTS:
            ours, theirs = logits(llm, ids), logits(ref, ids)
            assert (ours - theirs).abs().max() <= LOGIT_BOUND * theirs.abs().max(), (name, hidden)
        # greedy speculation equals plain greedy token for token
        plain = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
        for spec in ({"speculative": "ngram"}, {"speculative": "self"}):
            fast = LLM(str(path), dtype="float32", kv_cache_memory="16MiB", **spec)
            assert [o.token_ids for o in fast.generate(PROMPTS, GREEDY)] == plain, spec


def test_unsupported_types_are_named(tmp_path, cache_dir):
    """A type the kernel and the loader do not read is refused by name, with the supported list."""
    path = tmp_path / "i8.gguf"
    write_model(path, "Q8_0", 256, 512)
    data = path.read_bytes()
    _patch_tensor_types(path, {"blk.0.ffn_up.weight"}, int(QT.I8), 1.0)  # I8: 256 bytes a row, within Q8_0's 272
    assert path.read_bytes() != data
    with pytest.raises(ModelLoadError, match=r"unsupported GGUF quantization type I8 .*supported: .*TQ2_0"):
        load_checkpoint(path)


@pytest.mark.parametrize("name", ["Q4_0", "Q6_K"])
def test_llama_rows_are_unpermuted_in_the_files_blocks(tmp_path, cache_dir, name):
    """A llama-family file stores q/k rows in llama.cpp's rotary order: the repacked rows are put back in HF order
    (a row out of place would change the logits by their own size)."""
    path = tmp_path / "llama.gguf"
    write_model(path, name, 256, 512, arch="llama")
    llm = LLM(str(path), dtype="float32", kv_cache_memory="16MiB")
    ref = LLM(str(path), dtype="float32", weights="float32", kv_cache_memory="16MiB")
    assert llm.weights == "gguf" and llm.model.config.architecture == "llama"
    for ids in PROMPTS:
        ours, theirs = logits(llm, ids), logits(ref, ids)
        assert (ours - theirs).abs().max() <= LOGIT_BOUND * theirs.abs().max()


@pytest.mark.parametrize("isa", ["avx2", "avx512-novbmi"])
def test_the_other_isas_kernels_compute_the_same_math(isa):
    """On an AVX-512 machine the AVX2 code (what a CPU without AVX-512 runs), and on one with AVX512-VBMI the AVX-512
    code without it (Cascade Lake's), are otherwise never run: the kernel tests again in a process whose kernels are
    built without them (QUICKDRAFT_KERNEL_ISA)."""
    from quickdraft.models import native
    if not native.wide_int8_dot_products():
        pytest.skip("this CPU runs the AVX2 code in every other test already")
    if isa == "avx512-novbmi" and "avx512vbmi" not in native.cpu_flags():
        pytest.skip("this CPU runs the AVX-512 code without VBMI in every other test already")
    env = {**os.environ, native.ISA_ENV: isa}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
                           "kernel_computes_the_files_weights or one_call_mixes_formats or every_grid_entry"],
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout.splitlines()[-1]
