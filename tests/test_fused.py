"""The fused decoder layer (models/fused.py, one C call per layer for batches of single tokens) computes exactly
what the module path computes: the same logits and the same keys/values in the cache, bit for bit, for every
weight format it runs and every family's layer (q/k norms, sandwich norms, GELU-tanh, attention scale, sliding
window, per-layer RoPE), so a token's result does not depend on which path a step took (a decode token batched
beside a prompt chunk takes the module path, alone it takes the fused one)."""
from __future__ import annotations

import pytest
import torch

from quickdraft import LLM
from quickdraft.config import ModelConfig
from quickdraft.kv import ForwardItem, SequenceKV, attention
from quickdraft.kv.pool import KVPool
from quickdraft.loading.pack_float import pack_float_linears
from quickdraft.loading.quant_convert import quantizable_linears, set_module
from quickdraft.loading.quant_groups import fuse_quant_linears
from quickdraft.models import native
from quickdraft.models.fused import FusedLayer, FusedStack, SingleTokens
from quickdraft.models.quant import Int4Linear, Int8Linear
from quickdraft.models.transformer import DecoderLayer, Transformer

pytestmark = pytest.mark.skipif(not native.available(), reason="quickdraft's CPU kernels not built on this CPU")
KV = "64MiB"  # a few hundred tokens of cache are used here; LLM's default pool is 1 GiB per model, zeroed up front


def _contents(runner, kv: SequenceKV) -> tuple[torch.Tensor, torch.Tensor]:
    bs = runner.block_size
    slots = torch.tensor([kv.block_table[i // bs] * bs + i % bs for i in range(kv.num_cached)])
    return runner.pool.k[:, slots].clone(), runner.pool.v[:, slots].clone()


def _count_fused_layers(monkeypatch, calls: list) -> None:
    """Append 1 to ``calls`` for every layer a fused call runs (one layer's call or a whole stack's)."""
    layer_call, stack_call = FusedLayer.__call__, FusedStack.__call__
    monkeypatch.setattr(FusedLayer, "__call__", lambda self, *a: (calls.append(1), layer_call(self, *a))[1])
    monkeypatch.setattr(FusedStack, "__call__",
                        lambda self, *a: (calls.extend([1] * len(self.layers)), stack_call(self, *a))[1])


def _verify_step(llm: LLM, prompt: list[int], drafts: list[int], fused: bool, monkeypatch) -> tuple[list, int]:
    """Prefill two sequences, then one step of single tokens: a verify pass of ``drafts`` beside one decode token.
    Returns (logits, caches) of that step and how many layers ran fused."""
    runner, calls = llm.target, []
    real_fused = DecoderLayer.fused
    _count_fused_layers(monkeypatch, calls)
    monkeypatch.setattr(DecoderLayer, "fused", real_fused if fused else (lambda self, rope: None))
    kv_a, kv_b = SequenceKV(), SequenceKV()
    runner.forward([ForwardItem(kv_a, prompt, 1)])
    runner.forward([ForwardItem(kv_b, prompt[:5], 1)])
    calls.clear()
    logits = runner.forward([ForwardItem(kv_a, drafts, len(drafts)), ForwardItem(kv_b, drafts[:1], 1)])
    out = [*logits, *_contents(runner, kv_a), *_contents(runner, kv_b)]
    runner.free(kv_a)
    runner.free(kv_b)
    return out, len(calls)


@pytest.mark.parametrize("weights,dtype", [("int4", "auto"), ("int8", "auto"), ("bfloat16", "auto"),
                                           ("int4", "float32")])
def test_fused_layers_equal_module_path_bitwise_smollm2(smollm2, weights, dtype, monkeypatch):
    llm = LLM(str(smollm2), weights=weights, dtype=dtype, kv_cache_memory=KV)
    prompt = llm.tokenizer.encode("def fibonacci(n):\n    if n")
    drafts = [29, 308, 4811, 28, 476, 44]
    fused, fused_calls = _verify_step(llm, prompt, drafts, True, monkeypatch)
    modules, module_calls = _verify_step(llm, prompt, drafts, False, monkeypatch)
    assert fused_calls == llm.model.config.num_layers and module_calls == 0
    for a, b in zip(fused, modules):
        assert torch.equal(a, b)


def test_fused_layers_equal_module_path_with_qkv_bias(tiny_dir, monkeypatch):
    llm = LLM(str(tiny_dir(arch="qwen2")), weights="int8", dtype="bfloat16", kv_cache_memory=KV)
    fused, fused_calls = _verify_step(llm, [3, 9, 27, 5, 17, 40, 2], [11, 12, 13], True, monkeypatch)
    modules, _ = _verify_step(llm, [3, 9, 27, 5, 17, 40, 2], [11, 12, 13], False, monkeypatch)
    assert fused_calls == llm.model.config.num_layers
    for a, b in zip(fused, modules):
        assert torch.equal(a, b)


def test_float32_weights_keep_the_module_path(smollm2, monkeypatch):
    """float32 weights run oneDNN's kernel, which the fused layer does not call: the module path runs them."""
    llm = LLM(str(smollm2), weights="float32", kv_cache_memory=KV)
    _, fused_calls = _verify_step(llm, llm.tokenizer.encode("def f(x):"), [29, 308], True, monkeypatch)
    assert fused_calls == 0


@pytest.mark.parametrize("pieces", [True, False], ids=["chunk in pieces", "chunk token by token"])
def test_decode_token_beside_a_prompt_chunk_equals_it_alone(smollm2, monkeypatch, pieces):
    """A step whose prompt chunk attends in pieces (past ``attention.EXACT_POSITIONS``, here moved to 0) runs every
    layer on the module path, one whose chunk attends token by token (below it) on the fused path; a decode token in
    either gets the logits it gets alone on the fused path."""
    if pieces:
        monkeypatch.setattr(attention, "EXACT_POSITIONS", 0)
    llm = LLM(str(smollm2), weights="int4", kv_cache_memory=KV)
    runner, calls = llm.target, []
    _count_fused_layers(monkeypatch, calls)
    prompt = llm.tokenizer.encode("def fibonacci(n):\n    if n")
    chunk = llm.tokenizer.encode("Write a long story about a dragon who learns to code. " * 6)[:120]
    kv_a, kv_b, kv_long = SequenceKV(), SequenceKV(), SequenceKV()
    runner.forward([ForwardItem(kv_a, prompt, 1)])
    runner.forward([ForwardItem(kv_b, prompt, 1)])
    calls.clear()
    (alone,) = runner.forward([ForwardItem(kv_a, [29], 1)])
    assert len(calls) == llm.model.config.num_layers
    beside = runner.forward([ForwardItem(kv_long, chunk, 1), ForwardItem(kv_b, [29], 1)])[1]
    # the mixed step ran the module path, or the fused one again
    assert len(calls) == llm.model.config.num_layers * (1 if pieces else 2)
    assert torch.equal(alone, beside)


# ---- each family's layer, built here: one step of single tokens over a pool, module path against fused --------------
FAMILY = {
    # q/k norms, SwiGLU (applied inside a quantized gate/up call)
    "qwen3": dict(architecture="qwen3", qk_norm=True),
    # sandwich norms, GELU-tanh, attention scale from query_pre_attn_scalar, sliding and full layers, each with its
    # own RoPE base
    "gemma3": dict(architecture="gemma3", qk_norm=True, sandwich_norms=True, hidden_act="gelu_tanh",
                   query_pre_attn_scalar=24.0, sliding_window=24, rope_theta=1e6, local_rope_theta=1e4,
                   layer_types=("sliding_attention", "full_attention", "sliding_attention")),
}
# cached tokens and new tokens per sequence: a verify pass over more than one partition (1024 positions), a decode
# step, and a verify pass whose queries' windows start on either side of position 0
STEP = [(1100, 4), (30, 1), (22, 3)]
BLOCK = 16


def _model(family: str, weights: str, dtype: torch.dtype) -> Transformer:
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_layers=3, num_heads=4, num_kv_heads=2,
                      head_dim=32, max_position_embeddings=2048, **FAMILY[family])
    model = Transformer(cfg).eval().requires_grad_(False)
    for name, p in model.named_parameters():
        if "norm" in name:  # norm weights away from 1, as trained ones are
            p.copy_(1 + torch.randn_like(p) * 0.3)
        p.data = p.data.to(dtype)  # the RoPE tables stay float32, as the loader builds them
    if weights == "bfloat16":
        pack_float_linears(model)
    else:
        quantized = Int4Linear if weights == "int4" else Int8Linear
        for name, linear in quantizable_linears(model).items():
            set_module(model, name, quantized.from_float(linear.weight.float(), linear.bias))
        fuse_quant_linears(model)
    return model


class _Step:
    """The attention protocol for one step of single tokens (kv/attention.py's native path, without the engine):
    each sequence's new tokens attend as one verify group, through native.attend, over a pool holding random keys
    and values for the cached tokens."""

    lora = None

    def __init__(self, model: Transformer, kv_dtype: torch.dtype) -> None:
        cfg = model.config
        width = max(before + new for before, new in STEP)
        blocks = -(-width // BLOCK)
        self.pool = KVPool(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, blocks * len(STEP) + 1, BLOCK, kv_dtype,
                           "cpu")
        order = torch.randperm(blocks * len(STEP), generator=torch.Generator().manual_seed(1)) + 1
        tables = [order[s * blocks:(s + 1) * blocks] for s in range(len(STEP))]
        slots = [(t[:, None] * BLOCK + torch.arange(BLOCK)).flatten() for t in tables]  # scattered blocks
        act, gen = model.model.embed_tokens.weight.dtype, torch.Generator().manual_seed(3)
        rows, lengths, group_first = [], [], [0]
        for s, (before, new) in enumerate(STEP):
            shape = (before, cfg.num_kv_heads, cfg.head_dim)
            for layer in range(cfg.num_layers):
                k, v = torch.randn(shape, generator=gen).to(act), torch.randn(shape, generator=gen).to(act)
                self.pool.write(layer, slots[s][:before], k, v)
            rows += [slots[s]] * new
            lengths += range(before + 1, before + new + 1)
            group_first.append(len(lengths))
        self.positions = torch.tensor(lengths) - 1
        self.end = max(lengths)
        self.slot_mapping = torch.stack([row[p] for row, p in zip(rows, self.positions.tolist())])
        self.items = native.AttnItems(torch.arange(len(lengths)), torch.stack(rows), torch.tensor(lengths),
                                      torch.tensor(group_first))

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None,
               window: int | None = None, sinks: torch.Tensor | None = None,
               softcap: float | None = None) -> torch.Tensor:
        assert sinks is None  # no family of these tests has attention sinks
        self.pool.write(layer, self.slot_mapping, k, v)
        out = torch.empty_like(q)
        native.attend(q, self.pool.layer(layer), self.items, out, scale, window or 0, softcap=softcap)
        return out

    def single_tokens(self, layer: int) -> SingleTokens:
        return SingleTokens(self.positions, self.slot_mapping, self.items, self.pool.layer(layer),
                            self.pool.k.stride(0), self.pool.scale_layer_stride)


def _run(model: Transformer, kv_dtype: torch.dtype, path: str, monkeypatch) -> tuple[list[torch.Tensor], int]:
    """The step's hidden states and new cache entries on one path (module, layer: one fused call per layer, stack:
    one for all), and how many layers ran fused."""
    calls = []
    with monkeypatch.context() as patch:
        _count_fused_layers(patch, calls)
        if path == "module":
            patch.setattr(DecoderLayer, "fused", lambda self, rope: None)
        if path != "stack":
            patch.setattr(Transformer, "fused_stack", lambda self, num_layers: None)
        step = _Step(model, kv_dtype)
        tokens = torch.randint(1, 64, (len(step.positions),), generator=torch.Generator().manual_seed(2))
        hidden = model(tokens, step)
    pool, new = step.pool, step.slot_mapping
    cache = [pool.k[:, new], pool.v[:, new]] + ([pool.k_scale[:, new], pool.v_scale[:, new]] if pool.quantized else [])
    return [hidden, *cache], len(calls)


@pytest.mark.parametrize("family", list(FAMILY))
@pytest.mark.parametrize("weights,dtype,kv", [
    ("int4", torch.float32, None), ("int8", torch.float32, None), ("int4", torch.bfloat16, None),
    ("int8", torch.bfloat16, torch.int8), ("bfloat16", torch.bfloat16, None)])
def test_family_layers_fused_equal_module_path_bitwise(family, weights, dtype, kv, monkeypatch):
    model = _model(family, weights, dtype)
    layers = model.config.num_layers
    modules, module_calls = _run(model, kv or dtype, "module", monkeypatch)
    assert module_calls == 0
    for path in ("layer", "stack"):
        fused, fused_calls = _run(model, kv or dtype, path, monkeypatch)
        assert fused_calls == layers, path
        for a, b in zip(fused, modules):
            assert torch.equal(a, b), path

