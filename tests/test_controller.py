"""The adaptive controller's probes and the engine's acceptance prior: what exploration a drafter that rarely hits
may cost."""
from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from quickdraft import LLM, SamplingParams
from quickdraft.engine.sequence import SpeculationState
from quickdraft.speculative.controller import SpeculationController
from quickdraft.speculative.cost import CostModel


@dataclass
class Seq:
    spec: SpeculationState = field(default_factory=lambda: SpeculationState(accepted=0.0, rejected=10.0))
    params: SimpleNamespace = field(default_factory=lambda: SimpleNamespace(seed=None))


def costs(step: float = 0.1, per_token: float = 0.01, draft: float = 0.01) -> CostModel:
    """A target pass of n tokens costs step + per_token * (n - 1); a draft step costs ``draft``."""
    model = CostModel()
    for n in range(1, 2049):
        model.target.record(n, step + per_token * (n - 1))
    model.draft.record(1, draft)
    return model


def first_probe(controller: SpeculationController, lag_before: int, rounds: int = 3000) -> int | None:
    """Rounds a never-accepting sequence waits for its first probe; its draft cache lags ``lag_before`` tokens plus
    one per round without drafting."""
    seq = Seq()
    for r in range(1, rounds + 1):
        if controller.choose([seq], 1, catch_up=[lag_before + r], remaining=[10 ** 6])[0]:
            return r
    return None


def test_speculation_needs_an_expected_gain_of_min_gain():
    # target step 0.1 s (+0.01 s per extra token), draft step 0.02 s: one drafted token at acceptance a returns
    # (1 + a) tokens in 0.13 s against 1 token in 0.1 s plainly, an expected speed-up of (1 + a) / 1.3
    cost = costs(draft=0.02)
    marginal = Seq(spec=SpeculationState(accepted=36.0, rejected=64.0))  # 1.046x: within the costs' noise
    paying = Seq(spec=SpeculationState(accepted=45.0, rejected=55.0))  # 1.115x
    assert SpeculationController(cost).choose([marginal], 1) == [0]
    assert SpeculationController(cost, min_gain=1.0).choose([marginal], 1) == [1]
    assert SpeculationController(cost).choose([paying], 1) == [1]


def test_cheap_probes_keep_their_schedule():
    # a verify row, a draft step and a ~16-token catch-up at draft speed cost ~0.0066 s: within 2% of 16 steps
    cheap = SpeculationController(costs(per_token=0.002, draft=0.002), probe_every=16)
    assert first_probe(cheap, lag_before=0) == 16
    ngram = SpeculationController(costs(), probe_every=16, draft_is_free=True)  # a probe costs one verify row
    assert first_probe(ngram, lag_before=1000) == 16


def test_a_probe_waits_until_its_catch_up_fits_the_budget():
    # the draft cache lags a whole prompt (500 tokens): its catch-up (~0.53 s) is repaid by 2% of ~530 plain steps
    waited = first_probe(SpeculationController(costs(), probe_every=16), lag_before=500)
    assert waited is not None and 400 < waited < 700
    # a catch-up that grows faster than the budget (each round adds more catch-up than 2% of a step): no probe
    assert first_probe(SpeculationController(costs(per_token=0.05, draft=0.05), probe_every=16), lag_before=0) is None


def test_seeded_probes_use_the_deterministic_cost():
    # the measured cost would never let this sequence probe (previous test); a seeded one plans with the
    # byte-count model, independent of timings, and probes on schedule
    controller = SpeculationController(costs(per_token=0.05, draft=0.05), probe_every=16,
                                       seeded_cost=CostModel.from_weight_bytes(100, 10))
    seeded = Seq(params=SimpleNamespace(seed=7))
    probes = [r for r in range(1, 50) if controller.choose([seeded], 1, catch_up=[r], remaining=[10 ** 6])[0]]
    assert probes == [16, 32, 48]


TINY_KV = "16MiB"  # plenty for tiny models; LLM's default pool is 1 GiB per model, zeroed when it is built


@pytest.fixture(scope="module")
def pair(tiny_dir):
    return tiny_dir(arch="qwen2", vocab_size=64, layers=3), tiny_dir(arch="llama", vocab_size=64, seed=4)


def test_new_requests_start_from_the_drafters_measured_acceptance(pair):
    target, poor_draft = pair
    llm = LLM(str(target), dtype="float32", draft=str(poor_draft), num_speculative_tokens=3, kv_cache_memory=TINY_KV)
    greedy = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    llm.generate([[1, 2, 3, 4, 5], [9, 8, 7, 6]], greedy)
    pooled = llm.engine.pooled.acceptance
    assert pooled < 0.5  # a random draft of another seed rarely matches
    fresh = llm.engine.add_request([3, 4, 5], greedy)
    assert llm.engine.sequences(fresh)[0].spec.acceptance == pytest.approx(pooled)
    seeded = llm.engine.add_request([3, 4, 5], SamplingParams(max_tokens=4, temperature=0.8, seed=3))
    assert llm.engine.sequences(seeded)[0].spec.acceptance == SpeculationState().acceptance
    for rid in (fresh, seeded):
        llm.engine.abort(rid)


def test_a_catch_up_is_priced_by_the_drafts_measured_catch_ups():
    # a sequence that accepts 75% but whose draft cache lags a 700-token prompt, 128 tokens to go
    seq = Seq(spec=SpeculationState())
    catch_up, remaining = [700], [128]
    # priced as a target prefill scaled by the step ratio (0.1 * 7.09 s = 0.71 s), the savings of drafting repay it
    estimated = SpeculationController(costs())
    assert estimated.choose([seq], 1, catch_up=catch_up, remaining=remaining)[0] > 0
    # a measured catch-up of 64 tokens in 0.8 s (a quantized draft's prefill runs far below its step's speed) prices
    # the 700 tokens at ~8.8 s, more than drafting saves over 128 tokens (~5.2 s): the sequence decodes plainly
    measured = costs()
    measured.draft_catch_up.record(64, 0.8)
    assert SpeculationController(measured).choose([seq], 1, catch_up=catch_up, remaining=remaining)[0] == 0


def test_one_slow_measurement_does_not_set_the_price_of_a_long_catch_up():
    # catch-ups measured on a Zen 5 (int4 0.5B draft, ms): ~1.9 ms a token, and one first catch-up of 147 tokens at
    # 767 ms; a 700-token prompt is priced from the typical rate (~1.3 s), not from the slope 138 -> 147 (~30 s)
    cost = costs()
    for tokens, ms in {19: 43.2, 56: 120.2, 64: 120.2, 108: 204.2, 138: 260.7, 147: 767.6}.items():
        cost.draft_catch_up.record(tokens, ms / 1000)
    assert 1.2 < cost.draft_catch_up(700) < 1.4
    assert cost.draft_catch_up(100) == pytest.approx(0.2042 - (0.2042 - 0.1202) * 8 / 44)  # inside: interpolated
    seq = Seq(spec=SpeculationState())  # acceptance 0.75, 128 tokens to go: drafting saves ~5 s, repaying 1.3 s
    assert SpeculationController(cost).choose([seq], 1, catch_up=[700], remaining=[128])[0] > 0


def test_a_catch_up_must_be_repaid_twice_over():
    # acceptance 0.75 (the prior), k=3: a token costs ~0.0585 s against 0.1 s plainly, ~4.15 s saved over 100 tokens
    seq = Seq(spec=SpeculationState())
    for price, drafts_by_margin in ((1.5, {1.0: True, 2.0: True}), (3.0, {1.0: True, 2.0: False})):
        cost = costs()
        cost.draft_catch_up.record(64, price)
        for margin, drafts in drafts_by_margin.items():
            k = SpeculationController(cost, catch_up_margin=margin).choose([seq], 1, catch_up=[64], remaining=[100])[0]
            assert (k > 0) == drafts, (price, margin, k)


def test_calibration_measures_the_drafts_catch_up(pair):
    target, poor_draft = pair
    llm = LLM(str(target), dtype="float32", draft=str(poor_draft), kv_cache_memory=TINY_KV)
    (tokens, seconds), = llm.engine.cost.draft_catch_up.points.items()
    assert tokens == 64 and seconds > 0


def test_a_catch_up_is_priced_against_the_savings_at_the_current_batch():
    # cheap verification (1 ms per extra token) and drafts: drafting pays at batch 1 and at batch 16
    cost = costs(per_token=0.001, draft=0.001)
    cost.draft_catch_up.record(64, 0.8)  # a 100-token catch-up: ~1.25 s
    controller = SpeculationController(cost)
    alone = Seq(spec=SpeculationState())
    batch = [Seq(spec=SpeculationState()) for _ in range(16)]
    assert all(controller.choose(batch, 16, catch_up=[0] * 16, remaining=[64] * 16))
    # alone, a token costs the whole 0.1 s step and drafting saves ~3.9 s over 64 tokens: the catch-up is repaid
    assert controller.choose([alone], 1, catch_up=[100], remaining=[64])[0] > 0
    # in a batch of 16 a token costs 1/16 of a 0.115 s step and drafting saves ~0.15 s: it is not
    assert not any(controller.choose(batch, 16, catch_up=[100] * 16, remaining=[64] * 16))
