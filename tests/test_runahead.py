"""Run-ahead drafting (the draft drafts round t+1 while the target verifies round t) and cancellation.

Run-ahead must not change anything but speed: greedy output equals plain greedy, sampled output follows the
target's distribution (the chi-square test of test_distribution.py), seeded output equals the same request
without run-ahead, and the draft cache holds exactly the committed tokens after every round. Cancellation
from another thread stops a request within one step.
"""
from __future__ import annotations

import dataclasses
import os
import threading
import time

import pytest

from quickdraft import LLM, SamplingParams
from quickdraft.speculative.controller import SpeculationController
from quickdraft.speculative.cost import CostModel
from quickdraft.speculative.run_ahead import RunAheadDrafter
from test_distribution import SAMPLES, chi_square_pvalue, exact_distribution, make_llm, models, sample_engine  # noqa: F401
from test_speculative import SMOLLM2_KV, TINY_KV, assert_cache_matches_fresh_prefill, bench_prompts, tiny_prompts

GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def target(tiny_dir):
    return tiny_dir(arch="qwen2", vocab_size=64, layers=4)


def drafter_kwargs(tiny_dir, target, kind: str) -> dict:
    if kind == "self":
        return {"speculative": "self"}
    if kind == "draft-same":  # the target's own weights (the default int4 draft would differ a little)
        return {"draft": str(target), "draft_weights": "float32"}
    return {"draft": str(tiny_dir(arch="llama", vocab_size=64, seed=3))}


@pytest.mark.parametrize("kind", ["self", "draft-poor", "draft-same"])
@pytest.mark.parametrize("k", ["auto", 3])
def test_greedy_identity_tiny(tiny_dir, target, tiny_plain_greedy, kind, k):
    llm = LLM(str(target), dtype="float32", kv_cache_memory=TINY_KV, num_speculative_tokens=k, run_ahead=True,
              **drafter_kwargs(tiny_dir, target, kind))
    assert isinstance(llm.drafter, RunAheadDrafter)
    assert [o.token_ids for o in llm.generate(tiny_prompts(64, 6), GREEDY)] == tiny_plain_greedy
    # adaptive k may rightly not draft: a tiny model's drafts are poor, and a draft equal to the target costs
    # a target pass per token (break-even until run-ahead has been measured), so only a fixed k must draft
    if k == 3:
        assert llm.spec_stats.draft_tokens > 0 and llm.drafter.rounds_ahead > 0


def test_run_ahead_reuses_work(target, tiny_plain_greedy):
    """Draft == target accepts everything: nearly every round after the first starts from run-ahead tokens."""
    llm = LLM(str(target), draft=str(target), draft_weights="float32", dtype="float32", num_speculative_tokens=3,
              run_ahead=True, kv_cache_memory=TINY_KV)
    assert [o.token_ids for o in llm.generate(tiny_prompts(64, 6), GREEDY)] == tiny_plain_greedy
    stats = llm.spec_stats
    assert stats.acceptance_rate > 0.95
    assert stats.run_ahead_rounds > stats.drafting_rounds / 2
    assert stats.run_ahead_tokens >= stats.run_ahead_rounds
    assert llm.drafter.rounds_kept == stats.run_ahead_rounds
    assert llm.engine.cost.run_ahead_depth is not None
    assert llm.drafter.runner.allocator.num_used == 0  # finished sequences gave every draft block back


@pytest.mark.parametrize("kind", ["self", "draft-same"])
@pytest.mark.parametrize("sampler", [{"top_p": 0.95}, {"mirostat": 2, "mirostat_tau": 2.0, "mirostat_eta": 1.0},
                                     {"mirostat": 1, "mirostat_tau": 2.0, "mirostat_eta": 1.0}], ids=str)
def test_seeded_sampling_same_with_and_without_run_ahead(tiny_dir, target, kind, sampler):
    """Draft randomness is keyed by position, so keeping run-ahead drafts changes nothing for seeded requests; a
    draft's rows depend on the tokens alone (mirostat's on its first mu, not on the target's rows not yet committed
    when run-ahead drafts)."""
    params = SamplingParams(max_tokens=30, temperature=0.5, seed=1234, ignore_eos=True, **sampler)
    kwargs = dict(dtype="float32", kv_cache_memory=TINY_KV, num_speculative_tokens=3,
                  **drafter_kwargs(tiny_dir, target, kind))
    plain = LLM(str(target), **kwargs).generate(tiny_prompts(64, 4), params)
    llm = LLM(str(target), run_ahead=True, **kwargs)
    ahead = llm.generate(tiny_prompts(64, 4), params)
    assert [o.token_ids for o in ahead] == [o.token_ids for o in plain]
    if kind == "draft-same":
        assert llm.spec_stats.run_ahead_rounds > 0


def test_draft_cache_holds_committed_tokens_after_every_round(target):
    """Kept run-ahead tokens stay hidden past the committed prefix until the next proposal takes them."""
    llm = LLM(str(target), draft=str(target), draft_weights="float32", dtype="float32", num_speculative_tokens=3,
              run_ahead=True, kv_cache_memory=TINY_KV)
    rid = llm.engine.add_request(tiny_prompts(64, 1)[0], SamplingParams(max_tokens=60, temperature=0.3, seed=3,
                                                                         ignore_eos=True))
    (seq,) = llm.engine.sequences(rid)
    runner = llm.drafter.runner
    for _ in range(10):
        llm.engine.step()
        kv = seq.kv[llm.drafter.key]
        assert kv.num_cached <= seq.num_tokens - 1
        assert_cache_matches_fresh_prefill(runner, kv, seq.token_ids)
    assert seq.metrics.spec.run_ahead_rounds > 0
    llm.engine.abort(rid)
    assert llm.target.allocator.num_used == 0 and runner.allocator.num_used == 0


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["self", "draft"])
def test_greedy_identity_smollm2(smollm2, smollm2_plain_greedy, kind):
    prompts = bench_prompts(1)
    params = SamplingParams(max_tokens=32, temperature=0.0)
    plain = smollm2_plain_greedy("float32", prompts, 32)  # float weights, as test_speculative (its reference too)
    kwargs = {"speculative": "self"} if kind == "self" else {"draft": str(smollm2), "num_speculative_tokens": 3}
    llm = LLM(str(smollm2), weights="float32", run_ahead=True, kv_cache_memory=SMOLLM2_KV, **kwargs)
    spec = llm.generate(prompts, params)
    assert len(spec) == len(plain) == 3
    for (ids, text), b in zip(plain, spec):
        assert ids == b.token_ids and text == b.text
    if kind == "draft":
        assert llm.spec_stats.run_ahead_rounds > 0


# k = 1 and 4 tokens: round one drafts 1 (+ the guess and 1 ahead), round two can start from the run-ahead
RUN_AHEAD_CASES = [("draft-same", 1.0, "penalties"), ("self", 0.7, "topk_topp")]
if os.environ.get("QUICKDRAFT_FULL_DIST"):
    RUN_AHEAD_CASES += [("draft-poor", 1.0, "plain"), ("draft-same", 1.5, "topk_topp"), ("self", 1.0, "penalties")]


@pytest.mark.parametrize("drafter,temperature,transform", RUN_AHEAD_CASES)
def test_run_ahead_sampling_matches_target_distribution(models, drafter, temperature, transform):
    from test_distribution import TRANSFORMS
    llm = make_llm(models, drafter, num_speculative_tokens=1, run_ahead=True)
    params = SamplingParams(max_tokens=4, temperature=temperature, ignore_eos=True, **TRANSFORMS[transform])
    dist = exact_distribution(llm, params, length=4)
    samples = sample_engine(llm, params, SAMPLES)
    assert llm.spec_stats.run_ahead_rounds > 0
    assert chi_square_pvalue(samples, dist) > 0.001


def test_controller_counts_run_ahead_draft_steps_as_hidden():
    cost = CostModel()
    for n in range(1, 10):
        cost.target.record(n, 1.0 + 0.05 * n)
    cost.draft.record(1, 0.4)
    controller = SpeculationController(cost, max_k=8)
    without = controller._best_alone(0.9, cost)
    cost.record_run_ahead(4)
    with_run_ahead = controller._best_alone(0.9, cost)
    assert with_run_ahead >= without
    assert SpeculationController._drafted_ahead(cost, 0.9, 3, 0) == pytest.approx(0.9 ** 4)
    assert SpeculationController._drafted_ahead(cost, 0.9, 3, 5) == 0.0


# ---- cancellation ------------------------------------------------------------------------------------
def test_cancel_from_another_thread_stops_stream_within_one_step(target):
    k = 3
    llm = LLM(str(target), draft=str(target), draft_weights="float32", dtype="float32", num_speculative_tokens=k,
              run_ahead=True, kv_cache_memory=TINY_KV)
    params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    tokens: list[int] = []
    reached, at_cancel = threading.Event(), []
    rid = []

    def canceller() -> None:
        reached.wait(30)
        llm.cancel(rid[0])
        at_cancel.append(len(tokens))  # read after cancel() returned

    thread = threading.Thread(target=canceller)
    thread.start()
    final = None
    for chunk in llm.stream(tiny_prompts(64, 1)[0], params):
        rid[:] = [chunk.request_id]
        tokens.extend(chunk.token_ids)
        if len(tokens) >= 20:
            reached.set()
        final = chunk
    thread.join()
    assert final.finished and final.finish_reason == "abort"
    assert 20 <= len(tokens) < 400
    assert len(tokens) - at_cancel[0] <= k + 1  # at most the step in progress completed
    assert llm.target.allocator.num_used == 0 and llm.drafter.runner.allocator.num_used == 0


def test_cancelled_request_gets_no_further_draft_forwards(tiny_dir, target):
    """A cancel that arrives while the drafter runs stops its draft forwards at once (the run-ahead worker
    skips it too); the next step ends it. A poor draft: no round starts from kept run-ahead tokens."""
    llm = LLM(str(target), dtype="float32", num_speculative_tokens=4, run_ahead=True, kv_cache_memory=TINY_KV,
              **drafter_kwargs(tiny_dir, target, "draft-poor"))
    rid = llm.engine.add_request(tiny_prompts(64, 1)[0], SamplingParams(max_tokens=200, temperature=0.0,
                                                                         ignore_eos=True))
    for _ in range(3):
        llm.engine.step()
    (seq,) = llm.engine.sequences(rid)
    runner = llm.drafter.runner
    forward, calls = runner.forward, []

    def forward_then_cancel(items):
        calls.append(len(items))
        llm.cancel(rid)  # as if another thread cancelled during this draft forward
        return forward(items)

    runner.forward = forward_then_cancel
    before = len(seq.output_ids)
    llm.engine.step()
    assert calls == [1]  # no further draft forward, and no run-ahead, for the cancelled sequence
    assert seq.metrics.spec.draft_tokens > 0 and not seq.finished
    assert len(seq.output_ids) - before <= 2  # the step in progress completed with its one draft
    chunks = llm.engine.step()
    assert seq.finished and seq.finish_reason == "abort"
    assert [c.finish_reason for c in chunks] == ["abort"] and calls == [1]
    assert not llm.engine.has_unfinished()


@pytest.mark.slow
def test_cancel_all_from_timer_during_long_generate(smollm2):
    llm = LLM(str(smollm2), speculative="self", run_ahead=True)
    params = SamplingParams(max_tokens=3000, temperature=0.0, ignore_eos=True)
    llm.generate(["Hi"], SamplingParams(max_tokens=2))  # load and warm up outside the timed part
    delay = 1.0
    timer = threading.Timer(delay, llm.cancel)
    t0 = time.perf_counter()
    timer.start()
    outs = llm.generate(["Write a long story about a dragon.", "Count from one to a thousand."], params)
    elapsed = time.perf_counter() - t0
    assert [o.finish_reason for o in outs] == ["abort", "abort"]
    assert all(0 < len(o.token_ids) < 3000 for o in outs)
    assert elapsed < delay + 5.0  # one step is well under a second; 5 s of slack for a loaded machine
    again = llm.generate(["Hi"], dataclasses.replace(params, max_tokens=3))  # later requests are not affected
    assert again[0].finish_reason == "length"
