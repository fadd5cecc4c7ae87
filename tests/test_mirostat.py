"""Mirostat (llama.cpp's versions 1 and 2): each step keeps what a naive float64 reading of llama.cpp's sampler keeps
and moves mu as it does; a verify pass's rows after drafted tokens equal plain sampling's rows after the same tokens
committed, and mu ends where plain sampling's does; bad values are refused by name; the state survives fork and
state_dict; with tau 0 and eta 0 it is greedy, through the engine and under speculation."""
from __future__ import annotations

import math
import re

import pytest
import torch

from quickdraft import LLM
from quickdraft.errors import InvalidParameterError
from quickdraft.sampling import LogitsProcessor, SamplingParams
from quickdraft.sampling.mirostat import kth_largest


def naive_keep(logits: list[float], mu: float, version: int, vocab: int) -> set[int]:
    """The ids llama.cpp's mirostat keeps at ``mu``, read off its definition in float64 (a sort, then a cut)."""
    m = max(logits)
    weights = [math.exp(x - m) for x in logits]
    total = sum(weights)
    order = sorted(range(len(logits)), key=lambda i: -logits[i])
    p = [weights[i] / total for i in order]
    if version == 2:
        cut = next((i for i, q in enumerate(p) if -math.log2(q) > mu), len(p)) if p[0] > 0 else 1
        return set(order[:max(cut, 1)])
    pairs = [(math.log((i + 2) / (i + 1)), math.log(p[i] / p[i + 1]))
             for i in range(min(99, len(p) - 1)) if p[i + 1] > 0]
    s_hat = sum(t * b for t, b in pairs) / sum(t * t for t, _ in pairs)
    e = s_hat - 1
    k = (e * 2 ** mu / (1 - vocab ** -e)) ** (1 / s_hat)
    return set(order[:min(max(int(k), 1), len(p))])


def next_mu(logits: list[float], kept: set[int], token: int, mu: float, tau: float, eta: float) -> float:
    m = max(logits[i] for i in kept)
    total = sum(math.exp(logits[i] - m) for i in kept)
    surprise = -math.log2(math.exp(logits[token] - m) / total)
    return mu - eta * (surprise - tau)


def processor(version: int, tau: float, eta: float, vocab: int, temperature: float = 1.0) -> LogitsProcessor:
    return LogitsProcessor(SamplingParams(temperature=temperature, mirostat=version, mirostat_tau=tau,
                                          mirostat_eta=eta), [1, 2], vocab)


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("vocab,scale,tau,eta", [(50, 3.0, 3.0, 0.5), (300, 1.5, 5.0, 0.1), (1000, 4.0, 2.0, 1.0)])
def test_each_step_keeps_what_llama_cpp_keeps_and_moves_mu_as_it_does(version, vocab, scale, tau, eta):
    gen = torch.Generator().manual_seed(vocab + version)
    proc = processor(version, tau, eta, vocab, temperature=0.8)
    mu = 2 * tau
    for step in range(12):
        logits = (torch.randn(vocab, generator=gen) * scale).tolist()
        scaled = [x / 0.8 for x in logits]
        probs = proc.probs(torch.tensor(logits))
        kept = {i for i, q in enumerate(probs.tolist()) if q > 0}
        assert kept == naive_keep(scaled, mu, version, vocab), step
        assert sum(probs.tolist()) == pytest.approx(1.0, abs=1e-5)
        token = sorted(kept)[step % len(kept)]
        proc.accept([token])
        mu = next_mu(scaled, kept, token, mu, tau, eta)
        assert proc.mirostat.mu == pytest.approx(mu, rel=1e-4, abs=1e-4)


@pytest.mark.parametrize("version", [1, 2])
def test_verify_rows_are_plain_rows_and_mu_ends_where_plain_sampling_leaves_it(version):
    vocab, gen = 200, torch.Generator().manual_seed(7)
    rows = torch.randn(5, vocab, generator=gen) * 3
    drafts = [int(r.argmax()) for r in rows[:4]]  # the most probable token is always kept
    for accepted in range(5):
        committed = drafts[:accepted] + ([int(rows[accepted].argsort()[-2])] if accepted < 4 else [int(rows[4].argmax())])
        verifier = processor(version, 3.0, 0.7, vocab)
        verified = verifier.probs(rows, drafted=drafts)
        verifier.accept(committed)
        plain = processor(version, 3.0, 0.7, vocab)
        for i, token in enumerate(committed):
            assert torch.equal(plain.probs(rows[i]), verified[i]), (accepted, i)
            plain.accept([token])
        assert verifier.mirostat.mu == plain.mirostat.mu
    # a drafter's rows keep what mirostat keeps at its first mu, whatever the committed one (any q is exact, and one
    # of the tokens alone is the same whenever it is drafted)
    moved = processor(version, 3.0, 0.7, vocab)
    moved.probs(rows[0])
    moved.accept([drafts[0]])
    assert moved.mirostat.mu != 6.0
    first = processor(version, 3.0, 0.7, vocab).process(rows[2])
    assert torch.equal(moved.process(rows[2], drafted=drafts[1:2], offset=1, draft=True), first)
    assert not torch.equal(moved.process(rows[2]), first)


def test_mu_steers_and_the_state_survives_fork_and_state_dict():
    proc = processor(2, 3.0, 0.5, 100)
    gen = torch.Generator().manual_seed(3)
    rows = torch.randn(6, 100, generator=gen) * 3
    for row in rows[:3]:
        proc.probs(row)
        proc.accept([int(row.argmax())])  # the least surprising token: mu rises above 2 * tau
    assert proc.mirostat.mu > 6.0
    fork = proc.fork()
    fork.probs(rows[3])
    fork.accept([int(rows[3].argmax())])
    state = proc.state_dict()
    assert state["mirostat_mu"] == proc.mirostat.mu != fork.mirostat.mu
    fresh = processor(2, 3.0, 0.5, 100)
    fresh.load_state_dict(state)
    assert torch.equal(fresh.probs(rows[4]), proc.probs(rows[4]))
    assert not torch.equal(processor(2, 3.0, 0.5, 100).probs(rows[4]), proc.probs(rows[4]))
    for bad in (float("nan"), 1e31, 10**400, "6", True):
        with pytest.raises(ValueError, match=r"mirostat's mu is .*; it must be a number in \[-1e\+30, 1e\+30\]"):
            fresh.mirostat.restart(bad)


def test_the_kth_largest_value_is_the_same_read_on_the_host_or_sorted_on_the_device():
    row = torch.tensor([0.5, 2.0, 1.9, -1.0, 2.0, 0.0])
    for k in range(1, 7):
        assert kth_largest(row, torch.tensor(k), True) == kth_largest(row, torch.tensor(k), False) == sorted(
            row.tolist(), reverse=True)[k - 1]


def test_tau_zero_keeps_only_the_most_probable_token_and_greedy_ignores_it():
    row = torch.tensor([0.5, 2.0, 1.9, -1.0])
    for version in (1, 2):
        assert processor(version, 0.0, 0.0, 4).probs(row).tolist() == [0.0, 1.0, 0.0, 0.0]
    greedy = LogitsProcessor(SamplingParams(temperature=0.0, mirostat=2), [1], 4)
    assert greedy.mirostat is None and int(greedy.process(row).argmax()) == 1
    masked = processor(1, 5.0, 0.1, 4).probs(torch.tensor([0.0, float("-inf"), float("-inf"), float("-inf")]))
    assert masked.tolist() == [1.0, 0.0, 0.0, 0.0]  # one token with mass: no Zipf pair, k = 1


@pytest.mark.parametrize("field,value,words", [
    ("mirostat", 3, "mirostat must be 0 (off), 1 or 2 (the version), got 3"), ("mirostat", True, "mirostat must be"),
    ("mirostat", 1.0, "mirostat must be"), ("mirostat_tau", -0.1, "mirostat_tau must be in [0, 100]"),
    ("mirostat_tau", 1e38, "mirostat_tau"), ("mirostat_eta", float("nan"), "mirostat_eta must be a number"),
    ("mirostat_eta", 11, "mirostat_eta must be in [0, 10]"),
])
def test_bad_values_are_refused_by_name(field, value, words):
    with pytest.raises(InvalidParameterError, match=re.escape(words)):
        SamplingParams(temperature=1.0, **{field: value})


def test_tau_zero_is_greedy_through_the_engine_plain_and_speculative(tiny_dir):
    target = tiny_dir(arch="llama", vocab_size=64, layers=2, seed=5)
    prompt = [[3, 9, 4, 3, 9, 4, 3, 9], [7, 1, 7, 1, 7]]
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    pinned = SamplingParams(max_tokens=12, temperature=1.3, seed=1, ignore_eos=True, mirostat=2, mirostat_tau=0.0,
                            mirostat_eta=0.0)
    plain = LLM(str(target), dtype="float32", kv_cache_memory="8MiB")
    expected = [o.token_ids for o in plain.generate(prompt, greedy)]
    assert [o.token_ids for o in plain.generate(prompt, pinned)] == expected
    spec = LLM(str(target), dtype="float32", kv_cache_memory="8MiB", speculative="ngram")
    assert [o.token_ids for o in spec.generate(prompt, pinned)] == expected
    assert spec.spec_stats.draft_tokens > 0
