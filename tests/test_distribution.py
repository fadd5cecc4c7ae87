"""Speculative sampling follows the target's distribution exactly.

On a tiny random model with a small vocabulary we enumerate the exact joint
distribution of the first three generated tokens (after every sampling
transform), sample 4,000 generations through the real engine with each
drafter, and run a chi-square test. A deliberately broken verifier must fail
the same test, so the test is known to be able to fail.

Why 4,000: with the classic bug (resample from p instead of the residual) the
p-value at 4,000 samples was at most 1.7e-12 in every CI case where a draft
can be rejected, against the 0.001 threshold (measured 2026-11-25 with the
seeds sample_engine uses): 1.7e-12 for the n-gram draft on int4 weights with
penalties (an n-gram draft is a point mass: the least power), 1.8e-15 for
n-gram on float32, below 1e-57 for every draft model and self-speculation.
(10,000 samples, the size before, spent two minutes of the suite on a 2-core
machine for margins beyond 1e-40.) The broken verifier test runs that weakest
case and a draft model at SAMPLES, so a QUICKDRAFT_DIST_SAMPLES too small to
catch the bug makes it fail.
"""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

import quickdraft.engine.verify_step as verify_step
from quickdraft import LLM, SamplingParams
from quickdraft.kv import ForwardItem, SequenceKV
from quickdraft.sampling import LogitsProcessor, mirostat, sequence_breakers
from quickdraft.sampling.sampler import draw
from quickdraft.speculative.verify import verify_with_uniforms

VOCAB = 8
SAMPLES = int(os.environ.get("QUICKDRAFT_DIST_SAMPLES", "4000"))
PROMPT = [3, 5, 2, 3, 5, 2, 3, 5]  # repeats, so n-gram lookup proposes tokens
TRANSFORMS = {
    "plain": {},
    "topk_topp": {"top_k": 5, "top_p": 0.9},
    "penalties": {"presence_penalty": 0.6, "frequency_penalty": 0.4, "repetition_penalty": 1.3},
    # token 3, the prompt's most repeated (what n-gram lookup drafts), ends the output but is held back for 2 tokens
    "min_tokens": {"min_tokens": 2, "stop_token_ids": [3]},
    # llama.cpp's samplers: XTC is a coin each step, the target its mixture; DRY penalizes the prompt's repeats,
    # which are what n-gram lookup drafts
    "llama_samplers": {"typical_p": 0.9, "top_n_sigma": 2.0, "xtc_probability": 0.5, "xtc_threshold": 0.1},
    "dry": {"dry_multiplier": 0.8, "dry_allowed_length": 2},
    # mirostat's state follows each token and the row it came from: a draft's row must see the mu its drafts lead to
    "mirostat_v1": {"mirostat": 1, "mirostat_tau": 1.5, "mirostat_eta": 1.0},
    "mirostat_v2": {"mirostat": 2, "mirostat_tau": 1.5, "mirostat_eta": 1.0},
    # llama.cpp's penalties: the last 4 tokens of prompt and output (what n-gram lookup drafts from)
    "penalties_window": {"presence_penalty": 0.6, "frequency_penalty": 0.4, "repetition_penalty": 1.3,
                         "repeat_last_n": 4},
    # llama-server's chain: the cuts read the untempered row, then the temperature
    "temperature_last": {"top_p": 0.8, "min_p": 0.05, "xtc_probability": 0.5, "xtc_threshold": 0.1,
                         "temperature_last": True},
}


def exact_distribution(llm: LLM, params: SamplingParams, length: int = 3) -> dict[tuple[int, ...], float]:
    """P(t1, ..., t_length) by enumeration with the same transforms the request asks for, one token at a time (each
    prefix's processor has committed it, as plain sampling's has)."""
    def next_probs(outputs: tuple[int, ...], proc: LogitsProcessor) -> torch.Tensor:
        kv = SequenceKV()
        (logits,) = llm.target.forward([ForwardItem(kv, PROMPT + list(outputs), 1)])
        llm.target.free(kv)
        return proc.probs(logits)[0].double()

    dist = {}

    def walk(prefix: tuple[int, ...], prob: float, proc: LogitsProcessor) -> None:
        p = next_probs(prefix, proc)
        for t in range(VOCAB):
            if p[t] > 0:
                if len(prefix) + 1 == length:
                    dist[prefix + (t,)] = float(prob * p[t])
                else:
                    child = proc.fork()
                    child.accept([t])
                    walk(prefix + (t,), prob * p[t], child)

    breakers = sequence_breakers(llm.tokenizer, params.dry_sequence_breakers) if params.uses_dry else None
    walk((), 1.0, LogitsProcessor(params, PROMPT, VOCAB, breakers=breakers))
    return dist


def sample_engine(llm: LLM, params: SamplingParams, n: int) -> list[tuple[int, ...]]:
    import dataclasses
    per_request = [dataclasses.replace(params, seed=10_000 + i) for i in range(n)]
    outs = llm.generate([PROMPT] * n, per_request)
    return [tuple(o.token_ids) for o in outs]


def chi_square_pvalue(samples: list[tuple[int, ...]], dist: dict[tuple[int, ...], float]) -> float:
    keys = sorted(dist, key=dist.get, reverse=True)
    counts = {k: 0 for k in keys}
    unexpected = 0
    for s in samples:
        if s in counts:
            counts[s] += 1
        else:
            unexpected += 1
    if unexpected:
        return 0.0  # a sequence with probability 0 under the target
    n = len(samples)
    observed, expected, pool_o, pool_e = [], [], 0, 0.0
    for k in keys:  # pool rare outcomes so every expected count is >= 5
        if dist[k] * n >= 5:
            observed.append(counts[k])
            expected.append(dist[k] * n)
        else:
            pool_o += counts[k]
            pool_e += dist[k] * n
    if pool_e > 0:
        observed.append(pool_o)
        expected.append(pool_e)
    expected = np.array(expected) * (n / sum(expected))
    return float(chisquare(observed, expected).pvalue)


@pytest.fixture(scope="module")
def models(tiny_dir):
    target = tiny_dir(arch="llama", vocab_size=VOCAB, layers=3, hidden=32, heads=4, kv_heads=2, seed=11)
    poor = tiny_dir(arch="qwen2", vocab_size=VOCAB, layers=1, hidden=32, heads=4, kv_heads=2, seed=12)
    return target, poor


def make_llm(models, drafter: str, weights: str = "float32", **options) -> LLM:
    target, poor = models
    kwargs = {"ngram": {"speculative": "ngram"}, "suffix": {"speculative": "suffix"}, "self": {"speculative": "self", "self_draft_layers": 1},
              "draft-poor": {"draft": str(poor)},  # the default int4 draft weights
              "draft-same": {"draft": str(target), "draft_weights": "float32"},
              # the target as its own draft, proposing among the first 5 of 8 tokens only: q is 0 where p is not
              "draft-vocab": {"draft": str(target), "draft_weights": "float32", "draft_vocab": 5}}[drafter]
    options = {"num_speculative_tokens": 3, **options}
    # 32 MiB holds 1024 sequences of these tiny models several times over (a pool is zeroed up front, per model)
    return LLM(str(target), weights=weights, max_num_seqs=1024, max_num_batched_tokens=16384,
               kv_cache_memory="32MiB", **kwargs, **options)


FULL = [(d, t, x) for d in ("ngram", "suffix", "self", "draft-poor", "draft-same") for t in (0.7, 1.0, 1.5) for x in TRANSFORMS]
# CI runs a subset that still covers every drafter, temperature and transform; QUICKDRAFT_FULL_DIST=1 runs all 150.
CI_SUBSET = [("draft-poor", 1.0, "plain"), ("draft-poor", 0.7, "topk_topp"), ("draft-poor", 1.5, "penalties"),
             ("ngram", 1.0, "penalties"), ("self", 0.7, "plain"), ("draft-same", 1.5, "topk_topp"),
             ("suffix", 1.0, "plain"), ("ngram", 1.0, "min_tokens"), ("draft-poor", 0.7, "min_tokens"),
             ("ngram", 1.0, "dry"), ("draft-poor", 1.0, "llama_samplers"), ("self", 1.5, "dry"),
             ("draft-poor", 1.0, "mirostat_v2"), ("ngram", 1.5, "mirostat_v1"), ("draft-poor", 1.5, "temperature_last"),
             ("ngram", 1.0, "penalties_window")]
CASES = FULL if os.environ.get("QUICKDRAFT_FULL_DIST") else CI_SUBSET
# quantized weights: the reference is the quantized target's own distribution
CASES = [(*c, "float32") for c in CASES] + [("draft-poor", 1.0, "topk_topp", "int8"), ("ngram", 0.7, "penalties", "int4"),
                                           ("draft-vocab", 1.0, "plain", "float32")]


@pytest.mark.parametrize("drafter,temperature,transform,weights", CASES)
def test_speculative_sampling_matches_target_distribution(models, drafter, temperature, transform, weights):
    llm = make_llm(models, drafter, weights)
    params = SamplingParams(max_tokens=3, temperature=temperature, ignore_eos=True, **TRANSFORMS[transform])
    dist = exact_distribution(llm, params)
    samples = sample_engine(llm, params, SAMPLES)
    assert llm.spec_stats.draft_tokens > 0
    assert chi_square_pvalue(samples, dist) > 0.001


def broken_verify_residual_is_p(p, q, drafts, uniforms):
    """The classic bug: on rejection, resample from p instead of norm(max(p - q, 0))."""
    accepted, _, valid = verify_with_uniforms(p, q, drafts, uniforms)
    token, _ = draw(p[torch.arange(p.shape[0]), accepted].float(), uniforms[:, -1])
    return accepted, token, valid


# a draft model, and the CI case where the broken verifier is hardest to catch (an n-gram draft is a point mass)
@pytest.mark.parametrize("drafter,temperature,transform,weights", [("draft-poor", 1.0, "plain", "float32"),
                                                                   ("ngram", 0.7, "penalties", "int4")])
def test_broken_verifier_fails_the_same_test(models, monkeypatch, drafter, temperature, transform, weights):
    assert (drafter, temperature, transform, weights) in CASES  # the very case the test above runs
    monkeypatch.setattr(verify_step, "verify_with_uniforms", broken_verify_residual_is_p)
    llm = make_llm(models, drafter, weights)
    params = SamplingParams(max_tokens=3, temperature=temperature, ignore_eos=True, **TRANSFORMS[transform])
    dist = exact_distribution(llm, params)
    assert chi_square_pvalue(sample_engine(llm, params, SAMPLES), dist) < 0.001


def mirostat_without_drafts(x, mu, drafted, offset, version, tau, eta, vocab_size):
    """The bug mirostat invites: every row of a verify pass kept with the committed mu, as if no draft came before."""
    return torch.stack([mirostat.keep(x[i], mu, version, vocab_size) for i in range(x.shape[0])])


def test_mirostat_that_ignores_the_drafts_fails_the_same_test(models, monkeypatch):
    assert ("draft-poor", 1.0, "mirostat_v2", "float32") in CASES
    llm = make_llm(models, "draft-poor")
    params = SamplingParams(max_tokens=3, temperature=1.0, ignore_eos=True, **TRANSFORMS["mirostat_v2"])
    dist = exact_distribution(llm, params)
    monkeypatch.setattr(mirostat, "rows", mirostat_without_drafts)
    assert chi_square_pvalue(sample_engine(llm, params, SAMPLES), dist) < 0.001


def sample_unseeded(llm: LLM, params: SamplingParams, n: int, waves: int = 4) -> list[tuple[int, ...]]:
    """``n`` samples in ``waves`` batches: from the second on, the suffix drafter drafts from earlier outputs."""
    out: list[tuple[int, ...]] = []
    for _ in range(waves):
        out += [tuple(o.token_ids) for o in llm.generate([PROMPT] * (n // waves), params)]
    return out


@pytest.mark.parametrize("transform", ["plain", "topk_topp"])
def test_suffix_drafts_from_earlier_outputs_keep_the_target_distribution(models, transform):
    """Unseeded requests draft from the outputs of the requests before them (a seeded one only from its own
    tokens): the drafts change with what ran before, the distribution must not."""
    llm = make_llm(models, "suffix")
    llm.drafter.cache.min_tokens = 1  # keep these 3-token outputs (the default leaves out outputs this short)
    params = SamplingParams(max_tokens=3, temperature=1.0, ignore_eos=True, **TRANSFORMS[transform])
    dist = exact_distribution(llm, params)
    samples = sample_unseeded(llm, params, SAMPLES)
    assert llm.drafter.cache.tokens > 0 and llm.spec_stats.draft_tokens > 0
    assert chi_square_pvalue(samples, dist) > 0.001


def test_broken_verifier_fails_with_suffix_drafts_from_earlier_outputs(models, monkeypatch):
    monkeypatch.setattr(verify_step, "verify_with_uniforms", broken_verify_residual_is_p)
    llm = make_llm(models, "suffix")
    llm.drafter.cache.min_tokens = 1
    params = SamplingParams(max_tokens=3, temperature=1.0, ignore_eos=True)
    dist = exact_distribution(llm, params)
    assert chi_square_pvalue(sample_unseeded(llm, params, SAMPLES), dist) < 0.001
