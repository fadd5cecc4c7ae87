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


def kernel_call(bits: int, weight: torch.Tensor, bias: torch.Tensor | None = None
                ) -> tuple[functools.partial, torch.Tensor]:
    """The kernel's call on ``weight`` in ``bits`` (16: bfloat16 as stored; int4 in groups of 32), its bias fixed,
    and the float32 weight it multiplies."""
    if bits == 16:
        weight = weight.to(torch.bfloat16)
        return functools.partial(triton_linear.float_matmul, weight=weight, bias=bias), weight.float()
    if bits == 8:
        layer = Int8Linear.from_float(weight, kernel="triton")
        run = functools.partial(triton_linear.int8_matmul, qweight=layer.qweight, scales=layer.scales, bias=bias)
    else:
        layer = Int4Linear.from_float(weight, group_size=32, kernel="triton")
        run = functools.partial(triton_linear.int4_matmul, qweight=layer.qweight,
                                scales_and_zeros=layer.scales_and_zeros, group=32, bias=bias)
    return run, layer.dequantize().to(weight.device)


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


@pytest.mark.parametrize("bits", [4, 8, 16])
@pytest.mark.parametrize("rows", [1, 3])
def test_the_tiles_past_k_are_skipped_with_the_bits_of_zeros(bits, rows):
    """A K that leaves tiles of its last chunk empty (a chunk and 64 columns: 3.5 of the second chunk's 4 tiles)
    skips them; the same weight and rows padded with zero columns to whole chunks run every tile: the same bits,
    split over programs (one row) or not."""
    g = torch.Generator().manual_seed(bits + rows)
    k, whole = triton_linear.CHUNK_K + 64, 2 * triton_linear.CHUNK_K
    weight, x = randn(24, k, generator=g), randn(rows, k, generator=g)
    run, _ = kernel_call(bits, weight)
    padded, _ = kernel_call(bits, torch.cat([weight, torch.zeros(24, whole - k)], dim=1))
    assert torch.equal(run(x), padded(torch.cat([x, torch.zeros(rows, whole - k)], dim=1)))


@pytest.mark.parametrize("rows", [1, 5, 17, 70])
@pytest.mark.parametrize("out_features,in_features", [(40, 96), (72, 3 * triton_linear.CHUNK_K + 96)])
def test_bfloat16_weights_run_the_same_tiles(rows, out_features, in_features):
    """``float_matmul``: a bfloat16 weight as stored, against float64; split and not, the same bits; a row's bits do
    not depend on the rows beside it."""
    g = torch.Generator().manual_seed(rows + in_features)
    weight = randn(out_features, in_features, generator=g).to(torch.bfloat16)
    x = randn(rows, in_features, generator=g)
    apart, together = (triton_linear.float_matmul(x, weight, split=split) for split in (True, False))
    assert torch.equal(apart, together)
    rounded = x.to(torch.bfloat16) if DEVICE == "cuda" else x
    torch.testing.assert_close(apart, (rounded.double() @ weight.double().T).float(), **TOLERANCE)
    alone = torch.cat([triton_linear.float_matmul(x[i:i + 1], weight) for i in range(rows)])
    assert torch.equal(triton_linear.float_matmul(x, weight), alone)


@pytest.mark.parametrize("bits", [4, 8, 16])
@pytest.mark.parametrize("split", [True, False])
def test_the_bias_and_the_rounding_happen_in_the_kernel(bits, split):
    """A layer's bias is added to the float32 sums and the result rounded once to the output's dtype, in the kernel
    (split or not): the bits of the float32 result plus the bias, rounded."""
    g = torch.Generator().manual_seed(bits)
    in_features = 2 * triton_linear.CHUNK_K + 64
    weight, bias = randn(40, in_features, generator=g), randn(40, generator=g).to(torch.bfloat16)
    x = randn(3, in_features, generator=g)
    if bits == 16:
        run = functools.partial(triton_linear.float_matmul, x, weight.to(torch.bfloat16))
    elif bits == 8:
        layer = Int8Linear.from_float(weight, kernel="triton")
        run = functools.partial(triton_linear.int8_matmul, x, layer.qweight, layer.scales)
    else:
        layer = Int4Linear.from_float(weight, group_size=32, kernel="triton")
        run = functools.partial(triton_linear.int4_matmul, x, layer.qweight, layer.scales_and_zeros, 32)
    plain = run(split=split)
    assert torch.equal(run(bias=bias, split=split), plain + bias.float())
    rounded, exact = run(bias=bias, out_dtype=torch.bfloat16, split=split), plain + bias.float()
    assert rounded.dtype == torch.bfloat16 and torch.equal(rounded, to_bfloat16_as_triton(exact))


def to_bfloat16_as_triton(x: torch.Tensor) -> torch.Tensor:
    """float32 to bfloat16 as the kernel rounds: to nearest even on a GPU, toward zero in Triton's interpreter."""
    if DEVICE == "cuda":
        return x.to(torch.bfloat16)
    return (x.view(torch.int32) & -65536).view(torch.float32).to(torch.bfloat16)  # the low 16 bits dropped: exact


@pytest.mark.parametrize("bits", [4, 8])
def test_q_k_v_stacked_into_one_call(bits):
    """Layers of one format on the kernel (q, k and v with their biases) become one layer whose output is theirs side
    by side, bit for bit; layers of other formats or group sizes are left apart."""
    from quickdraft.loading.quant_groups import stacked

    g = torch.Generator().manual_seed(bits)
    make = (functools.partial(Int4Linear.from_float, group_size=32, kernel="triton") if bits == 4 else
            functools.partial(Int8Linear.from_float, kernel="triton"))
    layers = [make(randn(n, 128, generator=g), randn(n, generator=g).to(torch.bfloat16)) for n in (64, 16, 16)]
    x = randn(3, 128, generator=g).to(torch.bfloat16)
    one = stacked(layers)
    assert type(one) is type(layers[0]) and one.backend == "triton" and one.out_features == 96
    assert torch.equal(one(x), torch.cat([layer(x) for layer in layers], dim=-1))
    other = (Int8Linear.from_float(randn(16, 128, generator=g), kernel="triton") if bits == 4 else
             Int4Linear.from_float(randn(16, 128, generator=g), kernel="triton"))
    assert stacked(layers[:2] + [other]) is None
    if bits == 4:
        assert stacked(layers[:2] + [Int4Linear.from_float(randn(16, 128, generator=g), group_size=64,
                                                           kernel="triton")]) is None


def test_a_bfloat16_layer_on_the_kernel():
    """``TritonLinear`` (``gpu_linears='triton'``): up to ``max_rows`` rows a call on the kernel, bias and rounding
    in it, a row's bits whatever the rows beside it; longer calls on the wrapped linear (cuBLAS on a GPU)."""
    g = torch.Generator().manual_seed(5)
    linear = torch.nn.Linear(96, 40, dtype=torch.bfloat16).to(DEVICE)
    with torch.no_grad():
        linear.weight.copy_(randn(40, 96, generator=g))
        linear.bias.copy_(randn(40, generator=g))
    layer = triton_linear.TritonLinear(linear, max_rows=64)
    assert layer.weight is linear.weight and (layer.in_features, layer.out_features) == (96, 40)
    x = randn(70, 96, generator=g).to(torch.bfloat16)
    rows = layer(x[:64])
    assert rows.dtype == torch.bfloat16
    assert torch.equal(rows, triton_linear.float_matmul(x[:64], linear.weight, linear.bias, torch.bfloat16))
    assert torch.equal(torch.cat([layer(x[i:i + 1]) for i in range(64)]), rows)
    assert torch.equal(layer(x[None, :3]), rows[None, :3])  # leading dims kept
    assert torch.equal(layer(x), linear(x))  # 70 rows: the wrapped linear
    with pytest.raises(ValueError, match="bfloat16 linear"):
        triton_linear.TritonLinear(torch.nn.Linear(8, 8), max_rows=64)


@pytest.mark.parametrize("bits", [4, 8, 16])
@pytest.mark.parametrize("split", [True, False])
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_the_gate_in_the_kernel_gives_the_bits_of_the_gated_kernel_after_it(monkeypatch, bits, split, activation):
    """A gate/up projection that applies its activation in the kernel's last step (split or not; an output half that
    is not a multiple of a tile; a bias; rows of a decode step, a verify pass and a chunk) gives the bits of the
    projection followed by the gated activation's own kernel, in bfloat16 and in float32."""
    from quickdraft.models import triton_ops

    monkeypatch.setattr(triton_ops, "KERNEL_ON_CPU", True)
    g = torch.Generator().manual_seed(bits + 2 * split)
    in_features = 2 * triton_linear.CHUNK_K + 64
    weight, bias = randn(80, in_features, generator=g), randn(80, generator=g).to(torch.bfloat16)
    run, _ = kernel_call(bits, weight, bias)
    for rows, dtype in [(1, torch.bfloat16), (5, torch.bfloat16), (17, torch.float32)]:
        x = randn(rows, in_features, generator=g)
        gated = run(x, out_dtype=dtype, split=split, gate=activation)
        assert gated.shape == (rows, 40) and gated.dtype == dtype
        assert torch.equal(gated, triton_ops.gated(run(x, out_dtype=dtype, split=split), activation))
    with pytest.raises(ValueError, match="gate must be one of silu, gelu_tanh"):
        run(x, gate="relu")


def test_a_bfloat16_gate_up_projection_on_the_kernel(monkeypatch):
    """``GatedProjection`` over a ``TritonLinear``: the kernel's gated rows up to ``max_rows``, longer calls the
    wrapped linear's output gated with the same arithmetic; an MLP fused with it runs it as its whole gate/up."""
    from quickdraft.config import ModelConfig
    from quickdraft.models import triton_ops
    from quickdraft.models.feed_forward import MLP

    monkeypatch.setattr(triton_ops, "KERNEL_ON_CPU", True)
    g = torch.Generator().manual_seed(6)
    linear = torch.nn.Linear(96, 48, dtype=torch.bfloat16).to(DEVICE)
    with torch.no_grad():
        linear.weight.copy_(randn(48, 96, generator=g))
        linear.bias.copy_(randn(48, generator=g))
    gated = triton_linear.GatedProjection(triton_linear.TritonLinear(linear, max_rows=8), "silu")
    assert (gated.in_features, gated.out_features) == (96, 24)
    x = randn(12, 96, generator=g).to(torch.bfloat16)
    assert torch.equal(gated(x[:8]), triton_ops.gated(triton_linear.float_matmul(x[:8], linear.weight, linear.bias,
                                                                                 torch.bfloat16), "silu"))
    assert torch.equal(gated(x), triton_ops.gated(linear(x), "silu"))  # 12 rows: past max_rows
    signed = torch.tensor([[-0.0, 0.5, 1.0, 2.0]], dtype=torch.bfloat16, device=DEVICE)  # a gate of -0.0 keeps its sign
    assert torch.equal(triton_linear.gate_rows(signed, "silu").view(torch.int16),
                       triton_ops.gated(signed, "silu").view(torch.int16))
    assert torch.equal(gated(x[None, :3]), gated(x[:3])[None])
    cfg = ModelConfig(architecture="llama", vocab_size=8, hidden_size=96, intermediate_size=24, num_layers=1,
                      num_heads=2, num_kv_heads=2, head_dim=48)
    mlp = MLP(cfg)
    mlp.fuse(gated, activation="silu")
    assert mlp.activated and not hasattr(mlp, "gate_proj")
    with pytest.raises(ValueError, match="applies gelu_tanh cannot serve an MLP of silu"):
        MLP(cfg).fuse(gated, activation="gelu_tanh")
    with pytest.raises(ValueError, match="even number of outputs"):
        triton_linear.GatedProjection(triton_linear.TritonLinear(torch.nn.Linear(96, 7, dtype=torch.bfloat16)
                                                                 .to(DEVICE), max_rows=8), "silu")


def test_float_matmul_refuses_other_weights():
    x = torch.randn(2, 32)
    for weight in (torch.randn(8, 32), torch.randn(32, 8).to(torch.bfloat16).T):
        with pytest.raises(ValueError, match="contiguous bfloat16"):
            triton_linear.float_matmul(x, weight)


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


@pytest.mark.skipif(DEVICE == "cuda", reason="on a GPU every quantized model runs the kernel (tests/test_cuda.py)")
def test_a_models_stacked_projections_give_its_tokens(tiny_dir, monkeypatch):
    """A whole model on the kernel (the CPU running it under the interpreter, as a GPU runs it): each decoder layer's
    q/k/v and gate/up become one call each, and the greedy tokens are those of the layers left apart. In int8: int4's
    stacking is test_q_k_v_stacked_into_one_call's, and an int4 model's stacked layers run in
    test_triton_linear_norm.py (int4's tiles take the interpreter five times int8's time)."""
    weights = "int8"
    from quickdraft import LLM, SamplingParams
    from quickdraft.loading import quant_groups, quantize
    from quickdraft.models import quant_backends

    monkeypatch.setattr(quant_backends, "default_backend", lambda device: "triton")
    model = str(tiny_dir(arch="qwen2", vocab_size=64, layers=2))  # q/k/v with biases
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = [[5, 9, 13, 2, 7], [3, 3, 8]]

    def tokens() -> tuple[list[list[int]], LLM]:
        llm = LLM(model, dtype="float32", weights=weights, kv_cache_memory="16MiB")
        return [o.token_ids for o in llm.generate(prompts, params)], llm

    stacked_tokens, llm = tokens()
    attn, mlp = llm.model.model.layers[0].self_attn, llm.model.model.layers[0].mlp
    assert isinstance(mlp.gate_up_proj, triton_linear.GatedProjection) and mlp.activated  # SwiGLU in the kernel
    assert attn.qkv_proj.backend == mlp.gate_up_proj.projection.backend == "triton"
    monkeypatch.setattr(quantize, "fuse_quant_linears", lambda model: 0)
    apart_tokens, apart = tokens()
    assert apart.model.model.layers[0].self_attn.qkv_proj is None
    assert stacked_tokens == apart_tokens
