"""The int8 KV cache (kv_cache_dtype="int8") on real weights: what it stores, that speculation stays exact within it,
that it stays close to the exact cache, that sessions save and restore it, and the errors for formats a model
cannot use."""
from __future__ import annotations

import pytest
import torch

from quickdraft import LLM, SamplingParams
from quickdraft.errors import InvalidParameterError
from quickdraft.kv import ForwardItem, SequenceKV

KV = "256MiB"
PROMPTS = ["def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
           "The capital of France is Paris. The capital of Germany is", "for i in range(10):\n    print(i"]
GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def int8_llm(smollm2):
    return LLM(str(smollm2), weights="int4", kv_cache_memory=KV, kv_cache_dtype="int8")


def test_the_cache_stores_int8_with_a_scale_per_32_values(int8_llm, smollm2):
    pool = int8_llm.target.pool
    assert pool.k.dtype == torch.int8 and pool.k_scale.dtype == torch.float32
    assert pool.k_scale.shape[-1] == pool.k.shape[-1] // 32
    exact = LLM(str(smollm2), weights="int4", kv_cache_memory=KV)  # bfloat16, or float32 on a CPU without bf16
    ratio = (1 + 4 / 32) / exact.target.pool.k.element_size()
    assert int8_llm.target.bytes_per_block / exact.target.bytes_per_block == pytest.approx(ratio)


@pytest.mark.parametrize("speculative", ["ngram", "self"])
def test_greedy_speculation_equals_plain_greedy_on_an_int8_cache(int8_llm, smollm2, speculative):
    plain = [o.token_ids for o in int8_llm.generate(PROMPTS, GREEDY)]
    spec = LLM(str(smollm2), weights="int4", kv_cache_memory=KV, kv_cache_dtype="int8", speculative=speculative,
               num_speculative_tokens=3)
    assert [o.token_ids for o in spec.generate(PROMPTS, GREEDY)] == plain
    assert spec.spec_stats.draft_tokens > 0


def logits_through_decode_path(llm: LLM, ids: list[int]) -> torch.Tensor:
    kv = SequenceKV()
    try:
        return torch.cat([llm.target.forward([ForwardItem(kv, ids[i:i + 32], len(ids[i:i + 32]))])[0]
                          for i in range(0, len(ids), 32)])
    finally:
        llm.target.free(kv)


def test_int8_stays_close_to_the_exact_cache(int8_llm, smollm2):
    exact = LLM(str(smollm2), weights="int4", kv_cache_memory=KV)
    ids = exact.tokenizer.encode(" ".join(PROMPTS) * 6)[:384]
    a, b = logits_through_decode_path(exact, ids), logits_through_decode_path(int8_llm, ids)
    top_agreement = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
    kl = torch.nn.functional.kl_div(b.log_softmax(-1), a.log_softmax(-1), log_target=True, reduction="none").sum(-1)
    assert top_agreement >= 0.95 and kl.mean().item() < 0.02, (top_agreement, kl.mean().item())


def test_an_int8_session_is_saved_and_resumed(int8_llm, tmp_path):
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    with int8_llm.session() as s:
        first = s.generate("def add(a, b):", params).token_ids
        s.save(tmp_path / "s.qds")
        second = s.generate(" # and now subtract", params).token_ids
    with int8_llm.load_session(tmp_path / "s.qds") as resumed:
        assert resumed.num_cached > len(first)
        assert resumed.generate(" # and now subtract", params).token_ids == second


def test_cache_formats_a_model_cannot_use_are_refused_before_loading(tiny_dir, smollm2):
    tiny = str(tiny_dir(arch="qwen2", vocab_size=64))  # head_dim 16
    with pytest.raises(InvalidParameterError, match="head_dim divisible by 32; this model's is 16"):
        LLM(tiny, dtype="float32", kv_cache_memory="16MiB", kv_cache_dtype="int8")
    with pytest.raises(InvalidParameterError, match="kv_cache_dtype='float32' needs a model computing in float32"):
        LLM(str(smollm2), weights="int4", dtype="bfloat16", kv_cache_dtype="float32")
    with pytest.raises(InvalidParameterError, match="kv_cache_dtype must be one of auto, bfloat16, float32, int8"):
        LLM(str(smollm2), kv_cache_dtype="fp8")


@pytest.mark.parametrize("case,message", [
    ("scale NaN", r"target key scales hold NaN or infinite numbers"),
    ("scale inf", r"target value scales hold NaN or infinite numbers"),
    ("scales missing", r"tensors \[.*\], expected \[.*'kv.target.k_scale'.*\]"),
    ("keys as bfloat16", r"target keys are .*'torch.bfloat16'\), expected \(30, \d+, 3, 64\) torch.int8"),
])
def test_a_hostile_int8_snapshot_is_refused_before_any_block_is_taken(int8_llm, tmp_path, case, message):
    from quickdraft.errors import SessionError
    try:
        from test_session import read_snapshot, write_snapshot
    except ImportError:  # tests/ imported as a package
        from tests.test_session import read_snapshot, write_snapshot
    with int8_llm.session() as s:
        s.generate("def add(a, b):", SamplingParams(max_tokens=4, temperature=0.0))
        path = s.save(tmp_path / "s.qds")
    record, tensors = read_snapshot(path.read_bytes())
    if case == "scale NaN":
        tensors["kv.target.k_scale"].view(-1)[7] = float("nan")
    elif case == "scale inf":
        tensors["kv.target.v_scale"].view(-1)[3] = float("inf")
    elif case == "scales missing":
        del tensors["kv.target.k_scale"]
    else:
        tensors["kv.target.k"] = tensors["kv.target.k"].to(torch.bfloat16)
    free = int8_llm.target.allocator.num_free
    with pytest.raises(SessionError, match=message):
        int8_llm.load_session(write_snapshot(tmp_path / "bad.qds", record, tensors))
    assert int8_llm.target.allocator.num_free == free
