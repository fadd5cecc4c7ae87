"""The graph-ready step (kv/static_step.py) run eagerly on the CPU: the decode and verify forwards a GPU replays as
CUDA graphs, over the same static buffers and buckets, with the paged attention that reads block tables in place.
It must give the dynamic path's tokens: plain, batched into padded buckets, and under every drafter (verify passes
of k+1 queries); with the Triton kernel itself (under the interpreter) inside the step; with an int8 cache. What
needs a GPU (the capture and replay) is tests/test_cuda.py."""
from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from quickdraft import LLM, SamplingParams
import quickdraft.engine.verify_step as verify_step
from quickdraft.engine.build import EngineOptions
from quickdraft.errors import InvalidParameterError
from quickdraft.kv import ForwardItem, SequenceKV
from quickdraft.kv import paged_attention as paged
from quickdraft.kv.static_step import Bucket, buckets_up_to

try:
    from test_speculative import GREEDY, TINY_KV, tiny_prompts
except ImportError:  # tests/ imported as a package
    from tests.test_speculative import GREEDY, TINY_KV, tiny_prompts


@pytest.fixture(scope="module")
def target(tiny_dir) -> str:
    return str(tiny_dir(arch="qwen2", vocab_size=64, layers=4))


def generate(model: str, prompts, params=GREEDY, **options) -> tuple[list[list[int]], LLM]:
    llm = LLM(model, dtype="float32", kv_cache_memory=TINY_KV, **options)
    return [o.token_ids for o in llm.generate(prompts, params)], llm


def test_buckets():
    assert buckets_up_to(16) == [1, 2, 4, 8, 16] and buckets_up_to(9) == [1, 2, 4, 8, 9] and buckets_up_to(1) == [1]


@pytest.mark.parametrize("drafter", [None, "ngram", "self", "draft"])
def test_static_step_gives_the_dynamic_paths_tokens(target, tiny_plain_greedy, drafter):
    """6 prompts (bucket of 8 sequences, two of them padding, then smaller buckets as they finish); verify passes of
    k + 1 = 4 queries, some sequences with fewer (the drafters' k varies per sequence)."""
    options = {} if drafter is None else {"num_speculative_tokens": 3} | (
        {"draft": target} if drafter == "draft" else {"speculative": drafter})
    tokens, llm = generate(target, tiny_prompts(64, 6), static_step="eager", **options)
    assert tokens == tiny_plain_greedy
    static = llm.loaded.engine.target.static
    assert static.forwards > 0 and static.replays == 0  # eager: no graph on a CPU
    if drafter is not None:
        assert llm.spec_stats.draft_tokens > 0
    if drafter == "draft":
        assert llm.loaded.engine.drafter.runner.static.forwards > 0  # the draft's own steps are static too


MIXED = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
         SamplingParams(max_tokens=24, temperature=0.0, repetition_penalty=1.3, presence_penalty=0.4, ignore_eos=True),
         SamplingParams(max_tokens=24, temperature=0.0, logit_bias={7: 3.0, 9: -2.0}, ignore_eos=True),
         SamplingParams(max_tokens=24, temperature=0.8, top_k=20, min_p=0.05, seed=5, ignore_eos=True),
         SamplingParams(max_tokens=24, temperature=1.1, top_p=0.8, frequency_penalty=0.3, seed=6, ignore_eos=True)]


@pytest.mark.parametrize("drafter", [None, "ngram", "draft"])
def test_the_gpu_step_on_the_cpu_gives_the_cpu_steps_tokens(target, drafter, monkeypatch):
    """A GPU's whole step on the CPU: the static forward, then every decision made where the logits are (greedy
    choices from one argmax, penalties and bias as torch ops, seeded sampling from uniforms drawn ahead).
    One batch mixes raw greedy, transformed greedy and seeded sampling; it must give the CPU step's tokens, and
    (k fixed) accept the same drafts."""
    options = {} if drafter is None else {"num_speculative_tokens": 3} | (
        {"draft": target} if drafter == "draft" else {"speculative": drafter})
    prompts = tiny_prompts(64, len(MIXED))

    def run(**step) -> tuple[list[list[int]], tuple[int, int, int]]:
        llm = LLM(target, dtype="float32", kv_cache_memory=TINY_KV, **options, **step)
        out = [o.outputs[0].token_ids for o in llm.generate(prompts, MIXED)]
        stats = llm.spec_stats
        assert drafter is None or stats.accepted_tokens > 0
        return out, (stats.rounds, stats.draft_tokens, stats.accepted_tokens)

    cpu = run()
    monkeypatch.setattr(verify_step, "CPU_GREEDY_ON_HOST", False)
    assert run(static_step="eager") == cpu


def test_seeded_sampling_is_unchanged(target):
    params = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.9, seed=11, ignore_eos=True)
    prompts = tiny_prompts(64, 3)
    assert generate(target, prompts, params, static_step="eager", speculative="ngram")[0] == \
        generate(target, prompts, params, speculative="ngram")[0]


def test_int8_cache_logits_match_the_dynamic_path(tiny_dir):
    """Both paths read the same int8 cache: their logits agree to float32 rounding."""
    target = str(tiny_dir(arch="qwen2", vocab_size=64, hidden=128))  # head_dim 32: one int8 scale group
    rows = {}
    for mode in ("eager", "off"):
        llm = LLM(target, dtype="float32", kv_cache_memory=TINY_KV, kv_cache_dtype="int8", static_step=mode)
        runner = llm.loaded.engine.target
        kvs = [SequenceKV() for _ in range(3)]
        prompts = tiny_prompts(64, 3, length=30)
        runner.forward([ForwardItem(kv, p, 0) for kv, p in zip(kvs, prompts)])  # prompts: the dynamic path
        out = runner.forward([ForwardItem(kvs[0], [5], 1), ForwardItem(kvs[1], [6, 7, 8], 3),
                              ForwardItem(kvs[2], [9, 10], 2)])
        rows[mode] = torch.cat(out)
        if mode == "eager":
            assert runner.static.forwards == 1
    assert rows["eager"].shape == (6, 64)
    assert (rows["eager"] - rows["off"]).abs().max().item() < 1e-4


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton (pip install triton)")
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="Triton's interpreter is on only without a GPU (conftest.py); tests/test_cuda.py runs it there")
def test_the_triton_kernel_inside_the_step(target, tiny_plain_greedy, monkeypatch):
    """The step with the kernel a GPU runs (Triton's interpreter here): the dynamic path's tokens, plain and
    verifying n-gram drafts."""
    monkeypatch.setattr(paged, "KERNEL_ON_CPU", True)  # in Triton's interpreter (see conftest.py)
    calls = []
    kernel = paged._triton_attention
    monkeypatch.setattr(paged, "_triton_attention", lambda *args: calls.append(1) or kernel(*args))
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    prompts = tiny_prompts(64, 2)
    want = [t[:10] for t in tiny_plain_greedy[:2]]
    for options in ({}, {"speculative": "ngram", "num_speculative_tokens": 3}):
        assert generate(target, prompts, params, static_step="eager", **options)[0] == want
    assert len(calls) >= 40  # 4 layers x (9 plain steps, or the verify passes)


def test_a_fixed_k_past_the_default_limit_verifies_on_the_static_step(target, tiny_plain_greedy):
    """A fixed ``num_speculative_tokens`` is the engine's limit, above ``max_speculative_tokens`` too: the step's
    buckets (and the rows a GPU's Triton linears serve) hold its verify passes of k + 1 queries."""
    tokens, llm = generate(target, tiny_prompts(64, 6), static_step="eager", speculative="ngram",
                           num_speculative_tokens=12)
    assert tokens == tiny_plain_greedy
    static = llm.loaded.engine.target.static
    assert static.query_sizes[-1] == 13 and static.forwards > 0
    with pytest.raises(InvalidParameterError, match="num_speculative_tokens must be 'auto' or an int in 0..32"):
        EngineOptions(num_speculative_tokens=33)  # refused before anything is loaded


def test_prompt_chunks_take_the_dynamic_path(target):
    llm = LLM(target, dtype="float32", kv_cache_memory=TINY_KV, static_step="eager")
    runner = llm.loaded.engine.target
    kv = SequenceKV()
    runner.forward([ForwardItem(kv, tiny_prompts(64, 1)[0], 1)])
    assert runner.static.forwards == 0
    runner.forward([ForwardItem(kv, [3], 1)])
    assert runner.static.forwards == 1
    assert runner.static.bucket([1] * 17) is None  # more sequences than max_num_seqs: the dynamic path
    assert runner.static.bucket([1, 10]) is None  # more queries than max_speculative_tokens + 1
    assert runner.static.bucket([1, 9, 3]) == Bucket(4, 9)
    with pytest.raises(ValueError, match="captured graph"):
        runner.static.device_seconds(1, 1, 64)  # no graphs on a CPU


def test_bad_static_step_options_are_refused(target):
    with pytest.raises(InvalidParameterError, match="static_step must be one of auto, graphs, eager, off"):
        LLM(target, static_step="fast")
    with pytest.raises(InvalidParameterError, match="static_step='graphs' needs device='cuda'"):
        LLM(target, static_step="graphs")
    with pytest.raises(InvalidParameterError, match="gpu_linears must be one of cublas, triton, got 'fast'"):
        LLM(target, gpu_linears="fast")
    with pytest.raises(InvalidParameterError, match="gpu_linears='triton' needs device='cuda'"):
        LLM(target, gpu_linears="triton")


def test_prompt_chunks_on_the_static_step(target, tiny_plain_greedy):
    """Where prompt chunks run on the static step's forward (a GPU's default, ``chunks_on_static``): a batch of
    prompts, each chunk's last rows of logits (none, one, several) equal the dynamic path's, and whole generations
    (prompts cut into chunks by a small token budget, then decoding and n-gram verify passes) give its tokens."""
    logits = {}
    for on_static in (False, True):
        llm = LLM(target, dtype="float32", kv_cache_memory=TINY_KV, static_step="eager")
        runner = llm.loaded.engine.target
        runner.chunks_on_static = on_static
        kvs = [SequenceKV() for _ in range(3)]
        prompts = tiny_prompts(64, 3, length=30)
        before = runner.static.forwards
        first = runner.forward([ForwardItem(kvs[0], prompts[0][:17], 0), ForwardItem(kvs[1], prompts[1], 1),
                                ForwardItem(kvs[2], prompts[2][:20], 3)])
        second = runner.forward([ForwardItem(kvs[0], prompts[0][17:], 2), ForwardItem(kvs[2], prompts[2][20:], 1)])
        assert [len(r) for r in first + second] == [0, 1, 3, 2, 1]
        kv = SequenceKV()  # a prompt longer than a step's budget: its first pieces want no logits at all
        assert [len(r) for r in runner.forward([ForwardItem(kv, prompts[0] * 3, 0)])] == [0]
        assert runner.static.forwards == before  # chunks are not the step's decode/verify forwards
        assert runner.static.chunk_forwards == (3 if on_static else 0)
        logits[on_static, "after"] = runner.forward([ForwardItem(kv, [7], 1)])[0]
        logits[on_static] = torch.cat(first + second)
    assert (logits[True] - logits[False]).abs().max().item() < 1e-4
    assert (logits[True, "after"] - logits[False, "after"]).abs().max().item() < 1e-4
    for options in ({}, {"speculative": "ngram", "num_speculative_tokens": 3}):
        llm = LLM(target, dtype="float32", kv_cache_memory=TINY_KV, static_step="eager",
                  max_num_batched_tokens=32, **options)
        runner = llm.loaded.engine.target
        runner.chunks_on_static = True
        assert [o.token_ids for o in llm.generate(tiny_prompts(64, 6), GREEDY)] == tiny_plain_greedy
        assert runner.static.chunk_forwards >= 3  # 144 prompt tokens, 32 a step


def test_chunk_buckets(target):
    """Prompt chunks pad to a sequence bucket x the longest chunk rounded up to a power of two, and go to the dynamic
    path where a chunk is over 512 tokens or padding would be most of the rows."""
    static = LLM(target, dtype="float32", kv_cache_memory=TINY_KV, static_step="eager").loaded.engine.target.static
    assert static.chunk_bucket([24]) == Bucket(1, 32) and static.chunk_bucket([17, 30, 20]) == Bucket(4, 32)
    assert static.chunk_bucket([512]) == Bucket(1, 512) and static.chunk_bucket([513]) is None
    assert static.chunk_bucket([256, 1, 1, 1]) is None and static.chunk_bucket([]) is None
