"""Our torch dequantizers against gguf-py's reference, on random blocks and on real tensors."""
from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QT
import gguf.quants

from quickdraft.errors import ModelLoadError
from quickdraft.loading.dequant import SUPPORTED_TYPES, dequantize

try:
    from fixtures_loading import ALL_TYPES, one_torch_thread, random_blocks, smollm_gguf  # noqa: F401
except ImportError:  # tests/ imported as a package
    from tests.fixtures_loading import ALL_TYPES, one_torch_thread, random_blocks, smollm_gguf  # noqa: F401


def reference(raw: np.ndarray, qtype: QT, shape: tuple[int, ...]) -> np.ndarray:
    block, type_size = GGML_QUANT_SIZES[qtype]
    rows = raw.reshape(shape[0], -1) if len(shape) == 2 else raw.reshape(1, -1)
    return np.asarray(gguf.quants.dequantize(rows, qtype), dtype=np.float32).reshape(shape)


def assert_same(ours: torch.Tensor, ref: np.ndarray) -> None:
    assert ours.dtype == torch.float32
    assert tuple(ours.shape) == ref.shape
    a = ours.numpy()
    assert np.isfinite(ref).all()
    # bit-exact in practice; the brief allows 1e-6 relative
    np.testing.assert_allclose(a, ref, rtol=1e-6, atol=0)


def test_supported_list_is_the_brief():
    assert set(SUPPORTED_TYPES) == {t.name for t in ALL_TYPES} | {"Q1_0", "Q2_0"}


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda q: q.name)
def test_random_blocks_match_reference(qtype):
    rng = np.random.default_rng(int(qtype))
    block, _ = GGML_QUANT_SIZES[qtype]
    rows, cols = 24, 4 * 256  # 4 K-blocks or 32 small blocks per row
    raw = random_blocks(qtype, rows * cols // block, rng)
    ours = dequantize(raw, qtype, (rows, cols))
    ref = reference(raw, qtype, (rows, cols))
    assert_same(ours, ref)
    assert np.array_equal(ours.numpy().view(np.uint32), ref.view(np.uint32)), "not bit-exact"
    # same bytes given as a torch tensor, as a flat array, and with a 1-D shape
    assert torch.equal(dequantize(torch.from_numpy(raw.copy()), qtype, (rows, cols)), ours)
    assert torch.equal(dequantize(raw.reshape(-1), qtype, (rows * cols,)), ours.reshape(-1))


def test_chunked_path_matches_reference(monkeypatch):
    """Tensors larger than one chunk go through several chunks; the seams must be right."""
    import quickdraft.loading.dequant as dq

    monkeypatch.setattr(dq, "_CHUNK_ELEMENTS", 3 * 256)
    rng = np.random.default_rng(7)
    for qtype in (QT.Q4_0, QT.Q4_K, QT.Q6_K):
        block, _ = GGML_QUANT_SIZES[qtype]
        raw = random_blocks(qtype, 10 * 2048 // block, rng)
        assert_same(dequantize(raw, qtype, (10, 2048)), reference(raw, qtype, (10, 2048)))


def test_typed_arrays_as_the_reader_returns_them():
    rng = np.random.default_rng(1)
    f32 = rng.standard_normal((3, 8)).astype(np.float32)
    f16 = rng.standard_normal((3, 8)).astype(np.float16)
    assert torch.equal(dequantize(f32, QT.F32, (3, 8)), torch.from_numpy(f32))
    assert torch.equal(dequantize(f16, QT.F16, (3, 8)), torch.from_numpy(f16.astype(np.float32)))
    out = dequantize(f32, QT.F32, (3, 8))
    out += 1  # a copy, not a view of the (possibly read-only, memory-mapped) source
    assert not np.array_equal(out.numpy(), f32)


@pytest.mark.parametrize("qtype", [QT.Q8_K, QT.F64, QT.I8])
def test_unsupported_type_names_type_and_supported_list(qtype):
    block, type_size = GGML_QUANT_SIZES[qtype]
    raw = np.zeros(type_size * 4, dtype=np.uint8)
    with pytest.raises(ModelLoadError) as exc:
        dequantize(raw, qtype, (4 * block,))
    msg = str(exc.value)
    assert qtype.name in msg and "supported:" in msg
    for t in ALL_TYPES:
        assert t.name in msg


def test_wrong_byte_count_is_an_error():
    raw = np.zeros(18 * 3, dtype=np.uint8)
    with pytest.raises(ModelLoadError, match="needs 72 bytes"):
        dequantize(raw, QT.Q4_0, (4, 32))
    with pytest.raises(ModelLoadError, match="blocks"):
        dequantize(raw, QT.Q4_0, (3, 20))


@pytest.fixture(scope="module")
def smollm_reader():
    from gguf import GGUFReader

    return GGUFReader(smollm_gguf(), "r")  # gguf-py's own reading of the file: the reference


def test_real_smollm_tensors_match_reference(smollm_reader):
    """One of every type in the real file plus a few large ones, against gguf-py."""
    tensors = smollm_reader.tensors
    seen: dict[QT, int] = {}
    picked = []
    for t in tensors:
        if seen.get(t.tensor_type, 0) < 2:
            seen[t.tensor_type] = seen.get(t.tensor_type, 0) + 1
            picked.append(t)
    picked += [t for t in tensors if t.name in ("token_embd.weight", "blk.29.ffn_down.weight", "blk.15.attn_q.weight")]
    assert {QT.Q4_1, QT.Q8_0, QT.F32} <= set(seen)
    for t in picked:
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))
        ref = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
        assert_same(dequantize(t.data, t.tensor_type, shape), ref)


def test_whole_smollm_dequantizes_fast(smollm_reader):
    torch_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        start = time.perf_counter()
        n = 0
        for t in smollm_reader.tensors:
            n += dequantize(t.data, t.tensor_type, tuple(reversed(t.shape.tolist()))).numel()
        elapsed = time.perf_counter() - start
    finally:
        torch.set_num_threads(torch_threads)
    assert n == 134_515_008
    # ~0.3 s on one idle core; generous for a shared CI machine
    assert elapsed < 15, f"dequantizing SmolLM2 took {elapsed:.1f}s"
