"""The fused decoder layer (models/fused.py, one C call per layer for batches of single tokens) computes exactly
what the module path computes: the same logits and the same keys/values in the cache, bit for bit, for every
weight format it runs, so a token's result does not depend on which path a step took (a decode token batched
beside a prompt chunk takes the module path, alone it takes the fused one)."""
from __future__ import annotations

import pytest
import torch

from quickdraft import LLM
from quickdraft.kv import ForwardItem, SequenceKV
from quickdraft.models import native
from quickdraft.models.fused import FusedLayer, FusedStack
from quickdraft.models.transformer import DecoderLayer

pytestmark = pytest.mark.skipif(not native.available(), reason="quickdraft's CPU kernels not built on this CPU")
KV = "64MiB"  # a few hundred tokens of cache are used here; LLM's default pool is 1 GiB per model, zeroed up front


def _contents(runner, kv: SequenceKV) -> tuple[torch.Tensor, torch.Tensor]:
    bs = runner.block_size
    slots = torch.tensor([kv.block_table[i // bs] * bs + i % bs for i in range(kv.num_cached)])
    return runner.pool.k[:, slots].clone(), runner.pool.v[:, slots].clone()


def _count_fused_layers(monkeypatch, calls: list) -> None:
    """Append 1 to ``calls`` for every layer a fused call runs (one layer's call or a whole stack's)."""
    layer_call, stack_call = FusedLayer.__call__, FusedStack.__call__
    monkeypatch.setattr(FusedLayer, "__call__", lambda self, x, t: (calls.append(1), layer_call(self, x, t))[1])
    monkeypatch.setattr(FusedStack, "__call__",
                        lambda self, x, t: (calls.extend([1] * len(self.layers)), stack_call(self, x, t))[1])


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


def test_decode_token_beside_a_prompt_chunk_equals_it_alone(smollm2, monkeypatch):
    """A step with a prompt chunk runs every layer on the module path; a decode token in it gets the logits it
    gets alone on the fused path."""
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
    assert len(calls) == llm.model.config.num_layers  # the mixed step ran the module path
    assert torch.equal(alone, beside)
