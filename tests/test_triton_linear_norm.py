"""A decoder layer's residual add and RMSNorm inside Triton's linear kernel (``triton_linear.AddNorm``), run on the
CPU under Triton's interpreter: the projection of ``rms_norm(x + residual)`` against a float64 reference for every
weight format, gated or not; the sum it hands on equal to the add's; a row's bits alike alone and in a batch; a call
that would split K refused, and left to the norm's own kernel by the layers; a whole model's tokens with the norms in
its projections equal to its tokens without, plain and speculating. tests/test_cuda.py runs the same models on a
GPU."""
from __future__ import annotations

import functools
import importlib.util

import pytest
import torch
import torch.nn.functional as F

from quickdraft.models import triton_linear, triton_ops
from quickdraft.models.quant import Int8Linear
from test_triton_linear import kernel_call

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# float32 activations: the interpreter's products are float32 (a GPU's bfloat16, the reference rounds what it rounds)
TOLERANCE = dict(rtol=1e-2, atol=5e-2) if DEVICE == "cuda" else dict(rtol=1e-4, atol=1e-3)
IN_FEATURES = 2 * triton_linear.CHUNK_K + 64  # three chunks of K, the last partly outside: one program each
EPS = 1e-6


@pytest.fixture(autouse=True)
def interpreted(monkeypatch):
    monkeypatch.setattr(triton_linear, "KERNEL_ON_CPU", True)
    monkeypatch.setattr(triton_ops, "KERNEL_ON_CPU", True)


def randn(*shape: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, generator=generator).to(DEVICE)


def projection(bits: int, out_features: int, generator: torch.Generator, bias: torch.Tensor | None = None
               ) -> tuple[functools.partial, torch.Tensor]:
    """The kernel's call for a random weight in ``bits`` (16: bfloat16), and the float64 weight it multiplies (on a
    GPU an int4 weight rounded to bfloat16, as its products take it; int8's values are exact there)."""
    run, weight = kernel_call(bits, randn(out_features, IN_FEATURES, generator=generator), bias)
    return run, (weight.to(torch.bfloat16) if DEVICE == "cuda" and bits == 4 else weight).double()


def reference(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, weight: torch.Tensor,
              bias: torch.Tensor | None, gate: str | None) -> torch.Tensor:
    """``projection(rms_norm(x + residual))`` in float64 with the kernel's roundings: the sum rounded to x's dtype,
    its product with the norm's weight rounded to x's dtype (and on a GPU to bfloat16, as its products take it), the
    reciprocal RMS applied to the sums."""
    total = (x + residual).double()
    h = (total * norm_weight.double()).to(x.dtype)
    h = (h.to(torch.bfloat16) if DEVICE == "cuda" else h).double()
    y = h @ weight.T * torch.rsqrt(total.pow(2).mean(-1, keepdim=True) + EPS) + (0 if bias is None else bias.double())
    if gate is None:
        return y.float()
    first, second = y.chunk(2, dim=-1)
    return (F.silu(first) * second).float()


@pytest.mark.parametrize("bits", [4, 8, 16])
@pytest.mark.parametrize("gate", [None, "silu"])
def test_the_norm_in_the_kernel_equals_the_reference(bits, gate):
    g = torch.Generator().manual_seed(bits + 4 * (gate is None))
    bias = randn(80, generator=g).to(torch.bfloat16)
    run, weight = projection(bits, 80, g, bias)
    norm_weight = (1 + 0.1 * randn(IN_FEATURES, generator=g))
    for rows in (1, 5, 17):
        x, residual = randn(rows, IN_FEATURES, generator=g), randn(rows, IN_FEATURES, generator=g)
        norm = triton_linear.AddNorm(residual, norm_weight, EPS)
        total, out = run(x, gate=gate, norm=norm)
        assert torch.equal(total, x + residual)
        assert out.shape == (rows, 40 if gate else 80)
        torch.testing.assert_close(out, reference(x, residual, norm_weight, weight, bias, gate), **TOLERANCE)
        if rows == 5:  # a row's bits do not depend on the rows beside it
            alone = torch.cat([run(x[i:i + 1], gate=gate,
                                   norm=triton_linear.AddNorm(residual[i:i + 1], norm_weight, EPS))[1]
                               for i in range(rows)])
            assert torch.equal(alone, out)


@pytest.mark.parametrize("bits", [4, 16])
def test_bfloat16_rows_match_the_add_and_norm_kernel_before_the_projection(bits):
    """With bfloat16 activations the sum handed on has the bits of ``triton_ops.add_rms_norm``'s, and the output is
    that of the norm's own kernel followed by the projection, within bfloat16's rounding of the normed input."""
    g = torch.Generator().manual_seed(bits)
    run, _ = projection(bits, 64, g)
    norm_weight = (1 + 0.1 * randn(IN_FEATURES, generator=g)).to(torch.bfloat16)
    x, residual = (randn(3, IN_FEATURES, generator=g).to(torch.bfloat16) for _ in range(2))
    total, out = run(x, out_dtype=torch.float32, norm=triton_linear.AddNorm(residual, norm_weight, EPS))
    want_total, normed = triton_ops.add_rms_norm(x, residual, norm_weight, EPS)
    assert torch.equal(total, want_total)
    torch.testing.assert_close(out, run(normed, out_dtype=torch.float32), rtol=2e-2, atol=0.3)


def test_the_layers_take_the_norm_and_refuse_what_does_not_fit():
    g = torch.Generator().manual_seed(3)
    linear = torch.nn.Linear(IN_FEATURES, 48, dtype=torch.bfloat16).to(DEVICE)
    with torch.no_grad():
        linear.weight.copy_(randn(48, IN_FEATURES, generator=g))
    on_kernel = triton_linear.TritonLinear(linear, max_rows=8)
    x, residual = randn(2, 4, IN_FEATURES, generator=g), randn(2, 4, IN_FEATURES, generator=g)
    norm = triton_linear.AddNorm(residual, torch.ones(IN_FEATURES, device=DEVICE), EPS)
    assert on_kernel.fuses_norm(x) and not on_kernel.fuses_norm(torch.cat([x, x]))  # 16 rows: past max_rows
    total, out = on_kernel.forward_normed(x, norm)
    assert total.shape == x.shape and out.shape == (2, 4, 48)
    gated = triton_linear.GatedProjection(on_kernel, "silu")
    gated_total, gated_out = gated.forward_normed(x, norm)
    assert torch.equal(gated_total, total) and gated_out.shape == (2, 4, 24)
    int8 = Int8Linear.from_float(torch.randn(16, IN_FEATURES), kernel="triton").to(DEVICE)
    assert int8.fuses_norm(x) and int8.forward_normed(x, norm)[1].shape == (2, 4, 16)
    elsewhere = Int8Linear.from_float(torch.randn(16, IN_FEATURES), kernel="reference")
    assert not elsewhere.fuses_norm(x)
    with pytest.raises(ValueError, match="runs on the triton backend"):
        elsewhere.forward_normed(x, norm)
    x2 = x.reshape(8, IN_FEATURES)
    with pytest.raises(ValueError, match="the residual must be x's"):
        triton_linear.float_matmul(x2, linear.weight, norm=triton_linear.AddNorm(residual, norm.weight, EPS))
    with pytest.raises(ValueError, match="the residual must be x's"):
        triton_linear.float_matmul(x2, linear.weight, norm=triton_linear.AddNorm(x2.double(), norm.weight, EPS))
    with pytest.raises(ValueError, match=r"the norm's weight must be a float \[1088\]"):
        triton_linear.float_matmul(x2, linear.weight, norm=triton_linear.AddNorm(x2, norm.weight[:-1], EPS))
    total, out = triton_linear.float_matmul(x2[:0], linear.weight, norm=triton_linear.AddNorm(x2[:0], norm.weight, EPS))
    assert total.shape == (0, IN_FEATURES) and out.shape == (0, 48)
    with pytest.raises(ValueError, match="a norm runs in unsplit calls"):
        triton_linear.float_matmul(x2, linear.weight, split=True, norm=triton_linear.AddNorm(x2, norm.weight, EPS))
    # K of four chunks, a narrow output: the kernel would split K, so the layer leaves the norm to its own kernel
    wide = torch.nn.Linear(4 * triton_linear.CHUNK_K, 48, dtype=torch.bfloat16).to(DEVICE)
    x_wide = torch.zeros(1, 4 * triton_linear.CHUNK_K, device=DEVICE)
    assert triton_linear.splits(1, 48, 4 * triton_linear.CHUNK_K)
    assert not triton_linear.TritonLinear(wide, max_rows=8).fuses_norm(x_wide)
    assert not Int8Linear.from_float(wide.weight.float(), kernel="triton").fuses_norm(x_wide)
    with pytest.raises(ValueError, match="a norm runs in unsplit calls"):
        triton_linear.float_matmul(x_wide, wide.weight,
                                   norm=triton_linear.AddNorm(x_wide, torch.ones(x_wide.shape[1]), EPS))


def test_whether_the_norm_runs_inside_never_depends_on_the_rows(monkeypatch):
    """A shape whose single row splits K but whose 17 rows would not (a threshold lowered to show it on a small
    weight; a 7B's gate/up at 49 rows and more): the norm stays in its own kernel at every row count, so a row's
    output has the same bits alone as in a verify pass or a batch."""
    from quickdraft.models.norms import RMSNorm, add_norm_project

    monkeypatch.setattr(triton_linear, "SPLIT_BELOW", 2)
    g = torch.Generator().manual_seed(8)
    k = 4 * triton_linear.CHUNK_K
    layer = Int8Linear.from_float(torch.randn(64, k, generator=g), kernel="triton")
    assert triton_linear.splits(1, 64, k) and not triton_linear.splits(17, 64, k)
    norm = RMSNorm(k, EPS)
    x, pending = randn(17, k, generator=g), randn(17, k, generator=g)
    assert not layer.fuses_norm(x[:1]) and not layer.fuses_norm(x)
    one, batch = add_norm_project(x[:1], pending[:1], norm, layer), add_norm_project(x, pending, norm, layer)
    assert torch.equal(one[0], batch[0][:1]) and torch.equal(one[1], batch[1][:1])
    with pytest.raises(ValueError, match="a norm runs in unsplit calls"):
        triton_linear.int8_matmul(x, layer.qweight, layer.scales, norm=triton_linear.AddNorm(pending, norm.weight, EPS))


def test_a_bad_norm_is_refused():
    weight = torch.zeros(8, IN_FEATURES, dtype=torch.bfloat16, device=DEVICE)
    x = torch.ones(2, IN_FEATURES, device=DEVICE)
    for eps in (float("nan"), -1e-6, float("inf")):
        with pytest.raises(ValueError, match="eps must be a finite number >= 0"):
            triton_linear.float_matmul(x, weight, norm=triton_linear.AddNorm(x, torch.ones(IN_FEATURES), eps))
    with pytest.raises(ValueError, match="the norm's weight must be a float"):
        triton_linear.float_matmul(x, weight, norm=triton_linear.AddNorm(x, torch.ones(IN_FEATURES, dtype=torch.int32),
                                                                         EPS))
    with pytest.raises(ValueError, match="a norm runs in unsplit calls"):  # no output columns: nothing writes the sum
        triton_linear.float_matmul(x, weight[:0], norm=triton_linear.AddNorm(x, torch.ones(IN_FEATURES), EPS))


@pytest.mark.skipif(DEVICE == "cuda", reason="on a GPU every quantized model runs the kernel (tests/test_cuda.py)")
@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_a_model_with_its_norms_in_the_projections_gives_its_tokens(tiny_dir, monkeypatch, weights):
    """A whole model's static step as a GPU runs it (the CPU under the interpreter): q/k/v and gate/up take the
    residual add and the norm before them, every layer but the first's q/k/v (nothing pending there). The greedy
    tokens equal those with the add and norm in a kernel of their own, and speculating (n-gram) gives the plain
    tokens."""
    from quickdraft import LLM, SamplingParams
    from quickdraft.kv import paged_attention
    from quickdraft.models import quant, quant_backends

    monkeypatch.setattr(quant_backends, "default_backend", lambda device: "triton")
    monkeypatch.setattr(paged_attention, "KERNEL_ON_CPU", True)
    model = str(tiny_dir(arch="qwen2", vocab_size=64, layers=2))
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = [[5, 9, 13, 2, 7, 5, 9, 13], [3, 3, 8]]
    calls = []
    normed = quant._QuantLinearBase.forward_normed
    monkeypatch.setattr(quant._QuantLinearBase, "forward_normed",
                        lambda self, *args: calls.append(1) or normed(self, *args))

    def tokens(**options) -> list[list[int]]:
        llm = LLM(model, dtype="float32", weights=weights, kv_cache_memory="16MiB", static_step="eager", **options)
        return [o.token_ids for o in llm.generate(prompts, params)]

    fused = tokens()
    assert len(calls) >= 3 * 7  # (layer 1: q/k/v, gate/up; layer 0: gate/up) x decode steps
    assert tokens(speculative="ngram", num_speculative_tokens=3) == fused
    monkeypatch.setattr(quant._QuantLinearBase, "fuses_norm", lambda self, x, gate=None: False)
    calls.clear()
    assert tokens() == fused and not calls
