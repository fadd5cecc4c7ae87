"""The GPU's weight-only int8 and int4 kernel (models/triton_linear.py), run on the CPU under Triton's interpreter:
it must give what the weights it reads say, against a float64 reference, for every tile edge (rows, columns and
input widths that are not multiples of a tile) and row count (a decode step, a verify pass, a prompt chunk); a row's
result must not depend on the rows beside it; a GGUF's Q4 blocks, mapped exactly to int4, give the file's own
dequantization. tests/test_cuda.py runs it on a GPU inside whole models."""
from __future__ import annotations

import functools
import importlib.util

import pytest
import torch

from quickdraft.models import triton_linear
from quickdraft.models.quant import Int4Linear, Int8Linear

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")

# On a GPU the kernel runs there, its products in bfloat16 with float32 sums (the reference rounds what it rounds);
# elsewhere on the CPU under the interpreter, in float32.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = dict(rtol=1e-2, atol=2e-2) if DEVICE == "cuda" else dict(rtol=1e-5, atol=1e-4)
FLOAT32 = dict(rtol=1e-4, atol=1e-3)  # torch's float32 matmul against float64


@pytest.fixture(autouse=True)
def interpreted(monkeypatch):
    monkeypatch.setattr(triton_linear, "KERNEL_ON_CPU", True)


def reference(x: torch.Tensor, layer, rounded: bool = DEVICE == "cuda") -> torch.Tensor:
    """``x @ W.T`` in float64 of what the kernel multiplies: on a GPU (``rounded``) x and an int4 weight rounded to
    bfloat16 (an int8 weight is exact in bfloat16; its row scale applies after the sum)."""
    w = layer.dequantize().to(x.device)
    if rounded:
        x = x.to(torch.bfloat16)
        w = w.to(torch.bfloat16) if isinstance(layer, Int4Linear) else w
    return (x.double() @ w.double().T).float()


def randn(*shape: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, generator=generator).to(DEVICE)


@pytest.mark.parametrize("rows", [1, 5, 17, 70])
@pytest.mark.parametrize("out_features,in_features", [(40, 96), (64, 256), (7, 160)])
def test_int8_kernel_equals_the_weights(rows, out_features, in_features):
    g = torch.Generator().manual_seed(rows * 1000 + in_features)
    weight = randn(out_features, in_features, generator=g)
    layer = Int8Linear.from_float(weight, kernel="triton")
    assert layer.backend == "triton"
    x = randn(rows, in_features, generator=g)
    torch.testing.assert_close(layer(x), reference(x, layer), **TOLERANCE)


@pytest.mark.parametrize("rows", [1, 5, 17, 70])
@pytest.mark.parametrize("out_features,in_features,group", [(40, 96, 32), (64, 256, 64), (7, 256, 128)])
def test_int4_kernel_equals_the_weights(rows, out_features, in_features, group):
    g = torch.Generator().manual_seed(rows * 1000 + in_features + group)
    weight = randn(out_features, in_features, generator=g)
    layer = Int4Linear.from_float(weight, group_size=group, kernel="triton")
    assert layer.backend == "triton"
    x = randn(rows, in_features, generator=g)
    torch.testing.assert_close(layer(x), reference(x, layer), **TOLERANCE)
    # the same weights on the reference path (dequantize, then matmul), which multiplies them unrounded
    ref = Int4Linear(layer.int_weight(), layer.scales, layer.zeros, group, kernel="reference")
    torch.testing.assert_close(ref(x), reference(x, layer, rounded=False), **FLOAT32)


@pytest.mark.parametrize("bits", [4, 8])
def test_a_rows_result_does_not_depend_on_its_batch(bits):
    g = torch.Generator().manual_seed(bits)
    # 1,120 input columns: three chunks of K, the last one partly outside
    weight = randn(64, 1120, generator=g)
    layer = (Int4Linear.from_float(weight, kernel="triton") if bits == 4 else
             Int8Linear.from_float(weight, kernel="triton"))
    x = randn(18, 1120, generator=g)
    alone = torch.cat([layer(x[i:i + 1]) for i in range(18)])
    assert torch.equal(layer(x[:5]), alone[:5]) and torch.equal(layer(x[:17])[:5], alone[:5])
    assert torch.equal(layer(x), alone)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows", [1, 5, 33])
def test_k_split_over_programs_gives_the_same_bits_as_one_program(bits, rows):
    """A decode step's few output tiles sum K's chunks in programs of their own, a prompt chunk's in one program:
    the same sums in the same order, so a row gets the same bits either way (and so whatever its batch)."""
    g = torch.Generator().manual_seed(rows + bits)
    in_features = 3 * triton_linear.CHUNK_K + 96
    weight, x = randn(72, in_features, generator=g), randn(rows, in_features, generator=g)
    if bits == 4:
        layer = Int4Linear.from_float(weight, group_size=32, kernel="triton")
        run = functools.partial(triton_linear.int4_matmul, x, layer.qweight, layer.scales_and_zeros, 32)
    else:
        layer = Int8Linear.from_float(weight, kernel="triton")
        run = functools.partial(triton_linear.int8_matmul, x, layer.qweight, layer.scales)
    apart, together = run(split=True), run(split=False)
    assert torch.equal(apart, together)
    torch.testing.assert_close(apart, reference(x, layer), **TOLERANCE)


def test_bias_and_zero_rows():
    g = torch.Generator().manual_seed(1)
    weight, bias = randn(24, 64, generator=g), randn(24, generator=g)
    layer = Int8Linear.from_float(weight, bias, kernel="triton")
    x = randn(3, 64, generator=g)
    torch.testing.assert_close(layer(x), reference(x, layer) + bias, **TOLERANCE)
    assert layer(x[:0]).shape == (0, 24)


def test_gguf_q4_blocks_run_as_the_file_says():
    gguf = pytest.importorskip("gguf")
    from gguf import GGMLQuantizationType as T

    from quickdraft.loading.dequant import dequantize
    from quickdraft.loading.gguf_int4 import gguf_int4_params

    g = torch.Generator().manual_seed(2)
    weight = torch.randn(48, 256, generator=g).numpy()
    x = randn(3, 256, generator=g)
    for qtype in (T.Q4_0, T.Q4_1):  # gguf-py quantizes these two (tests/test_quant.py maps Q4_K)
        raw = gguf.quants.quantize(weight, qtype)
        q, scale, zero = gguf_int4_params(raw, int(qtype), (48, 256))
        layer = Int4Linear(q.to(DEVICE), scale.to(DEVICE), zero.to(DEVICE), 32, kernel="triton")
        file_weight = dequantize(raw, int(qtype), (48, 256)).to(DEVICE)
        # the file's weights, but for scale and zero rounded to bfloat16 (as on every int4 backend)
        torch.testing.assert_close(layer.dequantize().to(DEVICE), file_weight, rtol=1e-2, atol=2e-2)
        torch.testing.assert_close(layer(x), reference(x, layer), **TOLERANCE)


def test_the_backend_is_refused_where_it_cannot_run(monkeypatch):
    monkeypatch.setattr(triton_linear, "KERNEL_ON_CPU", False)
    with pytest.raises(ValueError, match="triton backend needs"):
        Int8Linear.from_float(torch.randn(8, 32), kernel="triton")
