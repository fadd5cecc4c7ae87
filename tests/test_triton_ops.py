"""The GPU's one-kernel RMSNorm (alone and after the residual add), q/k rotation, gated activation and cache write
(models/triton_ops.py), on the CPU under Triton's interpreter (on a GPU where there is one): each must give torch's
operations' values in float32 and bfloat16, at sizes that are not powers of two, on views of a fused projection's
output; and a model whose small operations all run on them must give the tokens of the same model on torch's
operations."""
from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from quickdraft import LLM, SamplingParams
from quickdraft.models import native, transformer, triton_ops
from quickdraft.models.rope import rope_tables

try:
    from test_families import family_dir, prompt as family_prompt  # noqa: F401 (a fixture)
    from test_moe import moe_dir  # noqa: F401 (a fixture)
    from test_parity import our_logits
    from test_speculative import TINY_KV, tiny_prompts
except ImportError:  # tests/ imported as a package
    from tests.test_families import family_dir, prompt as family_prompt  # noqa: F401
    from tests.test_moe import moe_dir  # noqa: F401
    from tests.test_parity import our_logits
    from tests.test_speculative import TINY_KV, tiny_prompts

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16]
# bfloat16: both round a float32 result once; they may differ by one unit in the last place (2^-8 relative)
TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=8e-3, atol=8e-3)}


@pytest.fixture(autouse=True)
def interpreted(monkeypatch):
    monkeypatch.setattr(triton_ops, "KERNEL_ON_CPU", True)


def randn(*shape: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype=dtype, device=DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,dim", [(1, 576), (5, 64), (3, 100)])
def test_rms_norm_equals_torch(rows, dim, dtype):
    x, w = randn(rows, dim, dtype=dtype), randn(dim, dtype=dtype, seed=1)
    assert triton_ops.runs_rms_norm(x, w)
    want = F.rms_norm(x.float(), (dim,), w.float(), 1e-6).to(dtype)
    got = triton_ops.rms_norm(x, w, 1e-6)
    assert got.dtype == dtype and got.shape == x.shape
    torch.testing.assert_close(got, want, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_rounds_the_sum_as_torchs_add(dtype):
    x, r, w = randn(3, 100, dtype=dtype), randn(3, 100, dtype=dtype, seed=1), randn(100, dtype=dtype, seed=2)
    total, normed = triton_ops.add_rms_norm(x, r, w, 1e-5)
    if dtype == torch.float32 or DEVICE == "cuda":
        assert torch.equal(total, x + r)
    else:  # Triton's interpreter rounds float32 to bfloat16 toward zero; a GPU to nearest, as torch does
        torch.testing.assert_close(total, x + r, **TOLERANCE[dtype])
    torch.testing.assert_close(normed, F.rms_norm((x + r).float(), (100,), w.float(), 1e-5).to(dtype),
                               **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_kv_write_stores_the_rows_of_a_fused_output_at_their_slots(dtype):
    tokens, kv_heads, dim = 4, 3, 32
    qkv = randn(tokens, 5 * kv_heads * dim, dtype=dtype)  # q of 3 kv_heads' width, then k, then v
    k = qkv[:, 3 * kv_heads * dim:4 * kv_heads * dim].reshape(tokens, kv_heads, dim)
    v = qkv[:, 4 * kv_heads * dim:].reshape(tokens, kv_heads, dim)
    cache_k, cache_v = (torch.zeros(20, kv_heads, dim, dtype=dtype, device=DEVICE) for _ in range(2))
    slots = torch.tensor([7, 0, 19, 8], device=DEVICE, dtype=torch.int32)  # int32 slots widen in the kernel
    assert triton_ops.runs_kv_write(k, cache_k) and triton_ops.runs_kv_write(v, cache_v)
    triton_ops.kv_write(k, v, slots, cache_k, cache_v)
    slots = slots.long()
    assert torch.equal(cache_k[slots], k) and torch.equal(cache_v[slots], v)
    untouched = [i for i in range(20) if i not in slots.tolist()]
    assert not cache_k[untouched].any() and not cache_v[untouched].any()
    assert not triton_ops.runs_kv_write(k, cache_k.to(torch.int8))  # an int8 cache quantizes on its own path


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,dim,rotary", [(9, 3, 64, 64), (4, 2, 32, 32), (3, 1, 48, 48), (4, 2, 32, 24),
                                                       (3, 1, 48, 0)])
def test_rope_rotates_q_and_k_in_place_inside_a_fused_output(heads, kv_heads, dim, rotary, dtype):
    """x is the q/k part of a q/k/v projection's output (rows longer than the heads rotated); v stays as it was, and
    so do the dims past ``rotary`` (partial rotary; 0: a layer without RoPE)."""
    tokens = 5
    qkv = randn(tokens, (heads + 2 * kv_heads) * dim, dtype=dtype)
    before = qkv.clone()
    qk = qkv[:, :(heads + kv_heads) * dim].reshape(tokens, heads + kv_heads, dim)
    positions = torch.tensor([0, 7, 3, 200, 31], device=DEVICE)
    cos, sin = (t.to(DEVICE) for t in rope_tables(rotary, 10000.0, None, 256))
    assert triton_ops.runs_rope(qk)
    x1, x2, rest = before[:, :(heads + kv_heads) * dim].reshape(tokens, heads + kv_heads, dim).float().split(
        (rotary // 2, rotary // 2, dim - rotary), dim=-1)
    c, s = cos[positions][:, None, :], sin[positions][:, None, :]
    want = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s, rest), dim=-1).to(dtype)
    assert triton_ops.rope_(qk, positions, cos, sin) is qk
    torch.testing.assert_close(qk, want, **TOLERANCE[dtype])
    assert torch.equal(qk[..., rotary:], want[..., rotary:])
    assert torch.equal(qkv[:, (heads + kv_heads) * dim:], before[:, (heads + kv_heads) * dim:])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (4, 2, 32), (3, 1, 48)])
def test_rope_kv_write_gives_the_bits_of_rope_then_the_write(heads, kv_heads, dim, dtype):
    """One kernel rotates q in place and writes k rotated, with v, at the slots: q and the cache as ``rope_`` then
    ``kv_write`` leave them, bit for bit; k itself is left unrotated."""
    tokens = 5
    qkv = randn(tokens, (heads + 2 * kv_heads) * dim, dtype=dtype)
    positions = torch.tensor([0, 7, 3, 200, 31], device=DEVICE)
    slots = torch.tensor([7, 0, 19, 8, 3], device=DEVICE, dtype=torch.int32)
    cos, sin = (t.to(DEVICE) for t in rope_tables(dim, 10000.0, None, 256))

    def views(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        qk = x[:, :(heads + kv_heads) * dim].reshape(tokens, heads + kv_heads, dim)
        return qk[:, :heads], qk[:, heads:], x[:, (heads + kv_heads) * dim:].reshape(tokens, kv_heads, dim)

    caches = {way: [torch.zeros(20, kv_heads, dim, dtype=dtype, device=DEVICE) for _ in range(2)]
              for way in ("fused", "apart")}
    fused, apart = qkv.clone(), qkv.clone()
    q, k, v = views(fused)
    assert triton_ops.runs_rope_kv_write(q, k, v, caches["fused"][0])
    triton_ops.rope_kv_write(q, k, v, positions, cos, sin, slots, *caches["fused"])
    q2, k2, v2 = views(apart)
    triton_ops.rope_(q2, positions, cos, sin)
    triton_ops.rope_(k2, positions, cos, sin)
    triton_ops.kv_write(k2, v2, slots, *caches["apart"])
    assert torch.equal(q, q2) and torch.equal(k, views(qkv)[1])
    assert all(torch.equal(a, b) for a, b in zip(caches["fused"], caches["apart"]))
    assert not triton_ops.runs_rope_kv_write(q, k, v, caches["fused"][0].to(torch.int8))


def test_rotate_pair_rotates_a_fused_outputs_q_and_k_in_one_call(monkeypatch):
    """Where the attention rotates q and k itself off the static step's kernel (an int8 cache, the dynamic path):
    views of one q/k/v output are rotated in one kernel, as the model did before it handed the rotation over; q and
    k apart, in two; the same values either way."""
    cpu_kernels_off(monkeypatch)
    rope = transformer.RotaryEmbedding(32, 10000.0, 256, device=DEVICE)
    positions = torch.tensor([0, 7, 3, 200, 31], device=DEVICE)
    qkv = randn(5, 8 * 32, dtype=torch.float32)
    calls, real = [], triton_ops.rope_
    monkeypatch.setattr(triton_ops, "rope_", lambda *args: calls.append(args[0].shape) or real(*args))

    def views(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        qk = x[:, :6 * 32].reshape(5, 6, 32)
        return qk[:, :4], qk[:, 4:]

    q, k = rope.rotate_pair(*views(qkv.clone()), positions)
    assert calls == [(5, 6, 32)]
    q2, k2 = views(qkv.clone())
    q2, k2 = rope.rotate_pair(q2.clone(), k2.clone(), positions)  # not adjacent: one call each
    assert calls[1:] == [(5, 4, 32), (5, 2, 32)]
    assert torch.equal(q, q2) and torch.equal(k, k2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("rows,width", [(1, 1536), (4, 100), (2, 3000)])
def test_gated_equals_torch(rows, width, act, dtype):
    gate_up = randn(rows, 2 * width, dtype=dtype) * 3  # reach where silu and gelu bend
    gate, up = gate_up.float().chunk(2, dim=-1)
    want = ((F.silu(gate) if act == "silu" else F.gelu(gate, approximate="tanh")) * up).to(dtype)
    assert triton_ops.runs_gated(gate_up, act)
    torch.testing.assert_close(triton_ops.gated(gate_up, act), want, **TOLERANCE[dtype])


def test_what_the_kernels_do_not_take():
    x = torch.randn(2, 8, device=DEVICE)
    assert not triton_ops.runs_gated(x, "clamped_swiglu")  # gpt-oss's activation stays torch's
    assert not triton_ops.runs_rope(torch.randn(2, 3, 8, device=DEVICE)[:, :, :4])  # heads not contiguous
    assert not triton_ops.runs_rms_norm(x.to(torch.int8), torch.ones(8, device=DEVICE))
    assert not triton_ops.runs_rms_norm(x, torch.ones(16, device=DEVICE)[::2])  # a weight the kernel cannot index
    assert not triton_ops.runs_rms_norm(x, torch.ones(4, device=DEVICE))


def cpu_kernels_off(monkeypatch) -> None:
    """The CPU's own C kernels and fused C layers off: a model runs its layers module by module, as on a GPU."""
    for name in ("runs_rms_norm", "runs_rope", "runs_gated"):
        monkeypatch.setattr(native, name, lambda *args: False)
    monkeypatch.setattr(transformer.DecoderLayer, "fused", lambda self, rope: None)


def perturb_norms(model: torch.nn.Module) -> None:
    """Norm weights away from 1, as trained ones are (a norm swapped for another must change the tokens)."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn(p.shape, generator=g) * 0.2)


@pytest.mark.skipif(DEVICE == "cuda", reason="on a GPU every model runs these kernels (tests/test_cuda.py)")
@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_a_model_on_the_kernels_gives_torchs_tokens(tiny_dir, arch, monkeypatch):
    """A model runs its norms, residual adds, rotations, activations and cache writes on these kernels (as on a GPU)
    or on torch's operations, prompt and decode steps alike: the same greedy tokens, float32."""
    model = str(tiny_dir(arch=arch, vocab_size=64))
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = tiny_prompts(64, 3)
    cpu_kernels_off(monkeypatch)
    calls = []
    names = ("rms_norm", "add_rms_norm", "rope_", "gated", "kv_write")
    for name in names:
        real = getattr(triton_ops, name)
        monkeypatch.setattr(triton_ops, name, lambda *args, real=real, name=name: calls.append(name) or real(*args))

    def run() -> list[list[int]]:
        llm = LLM(model, dtype="float32", kv_cache_memory=TINY_KV)
        perturb_norms(llm.model)
        return [o.token_ids for o in llm.generate(prompts, params)]

    on_kernels = run()
    assert set(calls) == set(names)
    assert calls.count("rope_") >= 2 * 12  # 2 layers, q and k in one call, every forward: decode steps too
    monkeypatch.setattr(triton_ops, "KERNEL_ON_CPU", False)
    calls.clear()
    assert run() == on_kernels and not calls


@pytest.mark.skipif(DEVICE == "cuda", reason="on a GPU every model runs these kernels (tests/test_cuda.py)")
def test_the_static_step_rotates_as_it_writes_the_keys(tiny_dir, monkeypatch):
    """The GPU's static step with every kernel it runs there (Triton's interpreter here): the rotation of q and k
    and the write of the keys are one kernel a layer, and the tokens (prompt chunks, decode steps, n-gram verify
    passes) are those of the rotation and the write apart."""
    from quickdraft.kv import paged_attention, pool

    model = str(tiny_dir(arch="qwen2", vocab_size=64))
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    cpu_kernels_off(monkeypatch)
    monkeypatch.setattr(paged_attention, "KERNEL_ON_CPU", True)
    calls, apart = [], []
    real = pool.KVPool.write_rotated
    monkeypatch.setattr(pool.KVPool, "write_rotated",
                        lambda self, *args: not apart and real(self, *args) and not calls.append(1))

    def run() -> list[list[int]]:
        llm = LLM(model, dtype="float32", kv_cache_memory=TINY_KV, static_step="eager", speculative="ngram",
                  num_speculative_tokens=3)
        llm.target.chunks_on_static = True
        return [o.token_ids for o in llm.generate(tiny_prompts(64, 2), params)]

    fused = run()
    assert len(calls) >= 2 * 4  # 2 layers, every forward
    apart.append(True)
    assert run() == fused


@pytest.mark.skipif(DEVICE == "cuda", reason="on a GPU every model runs these kernels (tests/test_cuda.py)")
@pytest.mark.parametrize("name,rotating_layers", [("phi4-mini-partial", set()), ("smollm3", {0, 1, 2}),
                                                  ("gemma2", {0, 1, 2})])
def test_the_static_step_with_partial_and_no_rope(family_dir, name, rotating_layers, monkeypatch):
    """The GPU's static step (Triton's interpreter here) on RoPE over part of each head (Phi-4-mini: rotated, then
    written, apart), on layers without RoPE (SmolLM3: its three rotating layers of four rotate as they write) and on
    Gemma 2's soft-capped scores (the paged kernel's cap) gives the CPU's greedy tokens, n-gram verify passes among
    them."""
    from quickdraft.kv import paged_attention, pool

    path = str(family_dir(name)[0])
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    prompts = [family_prompt(20), family_prompt(9, seed=4) * 2]
    want = [o.token_ids for o in LLM(path, dtype="float32", kv_cache_memory=TINY_KV).generate(prompts, params)]
    cpu_kernels_off(monkeypatch)
    monkeypatch.setattr(paged_attention, "KERNEL_ON_CPU", True)
    writes, real = [], pool.KVPool.write_rotated
    monkeypatch.setattr(pool.KVPool, "write_rotated",
                        lambda self, layer, *args: real(self, layer, *args) and not writes.append(layer))
    llm = LLM(path, dtype="float32", kv_cache_memory=TINY_KV, static_step="eager", speculative="ngram",
              num_speculative_tokens=3)
    assert [o.token_ids for o in llm.generate(prompts, params)] == want
    assert set(writes) == rotating_layers  # each rotating layer, every forward
    assert all(writes.count(layer) == writes.count(0) for layer in rotating_layers)


@pytest.mark.skipif(DEVICE == "cuda", reason="on a GPU every model runs these kernels (tests/test_cuda.py)")
def test_gemma2_soft_capped_scores_on_the_static_step(family_dir, monkeypatch):
    """Gemma 2's soft-capped scores in the paged kernel of the GPU's static step (Triton's interpreter here): a decode
    row and a verify pass's rows past the window give the dynamic path's logits (within 1e-5 of the largest; the
    test model's cap moves them by ~3e-2)."""
    from quickdraft.kv import ForwardItem, SequenceKV, paged_attention

    path = str(family_dir("gemma2")[0])
    cpu_kernels_off(monkeypatch)
    monkeypatch.setattr(paged_attention, "KERNEL_ON_CPU", True)
    rows = {}
    for mode in ("eager", "off"):
        runner = LLM(path, dtype="float32", kv_cache_memory=TINY_KV, static_step=mode).loaded.engine.target
        kvs = [SequenceKV(), SequenceKV()]
        runner.forward([ForwardItem(kv, family_prompt(30, seed=s), 0) for s, kv in enumerate(kvs)])
        rows[mode] = torch.cat(runner.forward([ForwardItem(kvs[0], [5], 1), ForwardItem(kvs[1], [6, 7, 8], 3)]))
        assert mode == "off" or runner.static.forwards == 1
    assert (rows["eager"] - rows["off"]).abs().max().item() < 1e-5 * rows["off"].abs().max().item()


@pytest.mark.skipif(DEVICE == "cuda", reason="on a GPU every model runs these kernels (tests/test_cuda.py)")
@pytest.mark.parametrize("kind,name", [("dense", n) for n in ("qwen3", "gemma3", "mistral", "phi4-mini-partial",
                                                               "smollm3", "granite", "olmo2", "gemma2")] +
                         [("moe", n) for n in ("qwen3_moe", "mixtral", "olmoe")])
def test_every_layer_kind_on_the_kernels_gives_torchs_logits(family_dir, moe_dir, kind, name, monkeypatch):
    """Per-head q/k norms (Qwen3), sandwich norms, GeGLU and an embedding multiplier (Gemma 3), a window (Mistral),
    RoPE over part of each head (Phi-4-mini) or none in some layers (SmolLM3), Granite's multipliers, OLMo 2's layers
    with no norm before their blocks (the residual adds left pending, as on a GPU), mixtures with a dense layer among them, whole q/k norms and clamps (OLMoE): a prompt's logits on the kernels are
    torch's (float32, within 1e-6 of the largest logit)."""
    path, _ = (family_dir if kind == "dense" else moe_dir)(name)
    cpu_kernels_off(monkeypatch)
    pending = []
    real = transformer.DecoderLayer.forward_pending
    monkeypatch.setattr(transformer.DecoderLayer, "forward_pending", lambda self, *a: pending.append(1) or real(self, *a))
    llm = LLM(str(path), dtype="float32", kv_cache_memory=TINY_KV)
    ids = family_prompt(40)
    on_kernels = our_logits(llm, ids)
    assert pending
    monkeypatch.setattr(triton_ops, "KERNEL_ON_CPU", False)
    # within 1e-6 of the largest logit (1e-5 at the ~10 of most families; Granite's test model's reach ~90)
    assert (on_kernels - our_logits(llm, ids)).abs().max().item() < 1e-6 * on_kernels.abs().max().item()
