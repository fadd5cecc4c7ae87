"""Suffix decoding: the match and the walk, the bounded cache of earlier outputs, exactness through the engine, and
per-request speculation control and figures."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from quickdraft import LLM, SamplingParams
from quickdraft.errors import InvalidParameterError
from quickdraft.speculative.suffix import OutputCache, SuffixDrafter, most_frequent_walk, suffix_matches
from test_speculative import GREEDY, SMOLLM2_KV, TINY_KV, bench_prompts, tiny_prompts


def walk(stream: list[int], context: list[int], limit: int = 8, min_prob: float = 0.1, max_match: int = 32):
    s, c = np.array(stream, dtype=np.int32), np.array(context, dtype=np.int32)
    ends, length = suffix_matches(s, c, max_match)
    return length, most_frequent_walk(s, ends, limit, min_prob).tokens


# ---- the match and the walk -------------------------------------------------------------------------------------
def test_the_longest_match_wins_over_more_frequent_shorter_ones():
    # "2 3" is followed by 7 twice, but "1 2 3" (the longer match) by 9
    stream = [1, 2, 3, 9, 4, 2, 3, 7, 5, 2, 3, 7]
    assert walk(stream, [0, 1, 2, 3], limit=3) == (3, [9, 4, 2])
    assert walk(stream, [0, 2, 3], limit=1) == (2, [7])  # "0 2 3" never occurs: "2 3" is followed by 7 twice in 3


def test_the_most_frequent_continuation_is_drafted_and_ties_go_to_the_latest():
    stream = [5, 6, 1, 5, 6, 2, 5, 6, 2, 5, 6, 3]
    assert walk(stream, [5, 6], limit=1) == (2, [2])  # 2 follows "5 6" twice, 1 and 3 once each
    assert walk([5, 6, 1, 5, 6, 2], [5, 6], limit=1) == (2, [2])  # a tie: the latest occurrence's continuation


def test_the_draft_stops_where_the_continuations_disagree():
    # "8 9" continues "4 4 4" once and "5 5 5" once: 0.5 each, then each branch is unanimous
    stream = [8, 9, 4, 4, 4, 0, 8, 9, 5, 5, 5]
    assert walk(stream, [8, 9], min_prob=0.6) == (2, [])
    assert walk(stream, [8, 9], min_prob=0.4) == (2, [5, 5, 5])  # the tie goes to the latest; 0.5 x 1 x 1 >= 0.4


def test_a_match_never_crosses_a_gap_between_outputs():
    cache = OutputCache(100)
    cache.add(list(range(1, 9)))
    cache.add(list(range(11, 19)))
    stream = cache.stream()
    assert walk(stream.tolist(), [7, 8]) == (2, [])  # 8 ends the first output: nothing follows it
    assert walk(stream.tolist(), [9, 8, 11]) == (1, list(range(12, 19)))  # "8 11" never occurs across the gap


def test_short_outputs_are_not_kept():
    cache = OutputCache(100)
    cache.add([1, 2, 3])
    assert len(cache) == 0 and cache.tokens == 0


def test_no_match_drafts_nothing():
    assert walk([1, 2, 3], [7]) == (0, [])
    assert walk([], [1]) == (0, [])


def test_spec_factor_limits_the_draft_by_the_match_length():
    drafter = SuffixDrafter(scope="request", spec_factor=1.0)
    stream = np.array([1, 2, 3, 4, 5, 6, 7, 8, 9, 1], dtype=np.int32)
    assert drafter._walk(stream, stream, 8).tokens == [2]  # a one-token match drafts one token
    stream = np.array([1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3], dtype=np.int32)
    assert drafter._walk(stream, stream, 8).tokens == [4, 5, 6]


# ---- the cache of earlier outputs ---------------------------------------------------------------------------------
def test_the_cache_stays_within_its_tokens_over_ten_thousand_outputs():
    rng = np.random.default_rng(0)
    cache = OutputCache(capacity=5_000)
    peak = 0
    for i in range(10_000):
        cache.add(rng.integers(0, 50_000, rng.integers(1, 300)).tolist())
        peak = max(peak, cache.tokens)
        if i % 1000 == 0:
            cache.stream()
    assert peak <= 5_000 and cache.tokens == sum(len(o) for o in cache._outputs.values())
    assert cache.nbytes <= 2 * 4 * (5_000 + len(cache))  # the outputs and one stream of int32 tokens with gaps
    cache.add(list(range(9_000)))  # an output longer than the cache keeps its end
    assert cache.tokens == 5_000 and len(cache) == 1


def test_outputs_drafted_from_are_evicted_last():
    cache = OutputCache(capacity=33)  # three outputs of 10 tokens, each with its gap
    cache.add([1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    cache.add([11] * 10)
    stream = cache.stream()
    ends, _ = suffix_matches(stream, np.array([2, 3], dtype=np.int32), 8)
    cache.touch(ends)  # the first output was used
    cache.add([12] * 10)
    cache.add([13] * 10)  # over capacity: the second output (least recently used) goes, the first stays
    kept = cache.stream().tolist()
    assert 11 not in kept and 1 in kept and 12 in kept and 13 in kept


def test_one_token_repeated_everywhere_stays_cheap():
    """Every position of a long run of one token matches: the search keeps only the latest occurrences."""
    cache = OutputCache(1 << 18)
    for _ in range(60):
        cache.add([7] * 4000)
    drafter = SuffixDrafter()
    drafter.cache = cache
    context = np.array([7] * 20_000, dtype=np.int32)
    ends, length = suffix_matches(cache.stream(), context, 32)
    assert length == 32 and len(ends) <= 4096
    draft = drafter._walk(cache.stream(), context, 8)
    assert draft.tokens == [7] * 8


# ---- options and per-request control --------------------------------------------------------------------------------
@pytest.mark.parametrize("value,message", [
    ("yes", "speculative must be true, false or"), ({"max_draft_tokens": 33}, "in [0, 32]"),
    ({"max_draft_tokens": True}, "speculative.max_draft_tokens"), ({"max_draft_tokens": 1.5}, "an int"),
    ({"draft": 2}, "speculative must be"), ({}, "speculative must be"), (None, "speculative must be"),
    ({"max_draft_tokens": -1}, "in [0, 32]"), ({"max_draft_tokens": 10**30}, "in [0, 32]")])
def test_bad_per_request_speculation_is_refused_by_name(value, message):
    with pytest.raises(InvalidParameterError, match=message.replace("[", r"\[").replace("]", r"\]")):
        SamplingParams(speculative=value)


def test_per_request_speculation_values():
    assert SamplingParams().max_draft_tokens is None
    assert SamplingParams(speculative=False).max_draft_tokens == 0
    assert SamplingParams(speculative={"max_draft_tokens": 3}).max_draft_tokens == 3


@pytest.mark.parametrize("options,message", [({"speculative": "suffix", "suffix_scope": "tenant"}, "one of"),
                                             ({"speculative": "suffix", "suffix_cache_tokens": 0}, "must be an int"),
                                             ({"speculative": "suffix", "suffix_cache_tokens": "1"}, "must be an int"),
                                             ({"speculative": "ngram", "draft": "x"}, "not both"),
                                             ({"suffix_scope": "request"}, "need speculative='suffix'"),
                                             ({"speculative": "ngram", "suffix_cache_tokens": 1000},
                                              "need speculative='suffix'")])
def test_bad_suffix_options_are_refused_before_loading(tiny_dir, options, message):
    with pytest.raises(InvalidParameterError, match=message):
        LLM(str(tiny_dir(arch="qwen2", vocab_size=64, layers=4)), **options)


# ---- through the engine ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_target(tiny_dir):
    return tiny_dir(arch="qwen2", vocab_size=64, layers=4)


@pytest.mark.parametrize("scope", ["request", "global"])
@pytest.mark.parametrize("k", ["auto", 3])
def test_greedy_identity_over_repeated_rounds(tiny_target, tiny_plain_greedy, scope, k):
    llm = LLM(str(tiny_target), dtype="float32", kv_cache_memory=TINY_KV, speculative="suffix", suffix_scope=scope,
              num_speculative_tokens=k)
    prompts = tiny_prompts(64, 6)
    first = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    again = [o.token_ids for o in llm.generate(prompts, GREEDY)]  # the same requests: their outputs are cached
    alone = [llm.generate([p], GREEDY)[0].token_ids for p in prompts[:2]]
    assert first == again == tiny_plain_greedy and alone == tiny_plain_greedy[:2]
    assert llm.spec_stats.draft_tokens > 0
    if scope == "global":
        assert len(llm.drafter.cache) == 14
    else:
        assert llm.drafter.cache is None


def test_a_repeated_request_drafts_its_earlier_output(tiny_target):
    llm = LLM(str(tiny_target), dtype="float32", kv_cache_memory=TINY_KV, speculative="suffix")
    prompt = list(range(1, 20))  # no repetition inside the prompt: only the earlier output can be matched
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    first = llm.generate([prompt], params)[0]
    second = llm.generate([prompt], params)[0]
    assert second.token_ids == first.token_ids
    s = second.metrics.speculative
    assert s["accepted_tokens"] >= 36 and s["target_passes"] <= 12, s  # 48 tokens in a quarter of the passes


def test_the_suffix_drafter_with_a_draft_model_is_exact(tiny_dir, tiny_target, tiny_plain_greedy):
    draft = tiny_dir(arch="llama", vocab_size=64, seed=3)
    llm = LLM(str(tiny_target), dtype="float32", kv_cache_memory=TINY_KV, speculative="suffix", draft=str(draft),
              num_speculative_tokens=3)
    assert llm.drafter.name == "suffix+draft"
    prompts = tiny_prompts(64, 6)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == tiny_plain_greedy
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == tiny_plain_greedy
    assert llm.spec_stats.draft_tokens > 0


def test_per_request_control_changes_drafts_not_tokens(tiny_target, tiny_plain_greedy):
    llm = LLM(str(tiny_target), dtype="float32", kv_cache_memory=TINY_KV, speculative="suffix")
    prompts = tiny_prompts(64, 6)
    llm.generate(prompts, GREEDY)
    off = llm.generate(prompts, dataclasses.replace(GREEDY, speculative=False))
    capped = llm.generate(prompts, dataclasses.replace(GREEDY, speculative={"max_draft_tokens": 1}))
    assert [o.token_ids for o in off] == [o.token_ids for o in capped] == tiny_plain_greedy
    assert all(o.metrics.speculative["drafted_tokens"] == 0 for o in off)
    assert all(o.metrics.speculative["target_passes"] == len(o.token_ids) for o in off)
    for o in capped:  # at most one drafted token per target pass
        s = o.metrics.speculative
        assert s["drafted_tokens"] <= s["target_passes"] and s["target_passes"] + s["accepted_tokens"] == 40
    assert sum(o.metrics.speculative["drafted_tokens"] for o in capped) > 0


def test_a_seeded_request_samples_the_same_tokens_whatever_the_cache_holds(tiny_target):
    params = SamplingParams(max_tokens=32, temperature=1.0, seed=5, ignore_eos=True)
    prompt = tiny_prompts(64, 1)[0]
    fresh = LLM(str(tiny_target), dtype="float32", kv_cache_memory=TINY_KV, speculative="suffix")
    alone = fresh.generate([prompt], params)[0].token_ids
    busy = LLM(str(tiny_target), dtype="float32", kv_cache_memory=TINY_KV, speculative="suffix")
    busy.generate(tiny_prompts(64, 6), SamplingParams(max_tokens=40, temperature=1.0, ignore_eos=True))
    assert len(busy.drafter.cache) == 6
    assert busy.generate([prompt], params)[0].token_ids == alone


@pytest.mark.slow
def test_greedy_identity_smollm2_benchmark_prompts(smollm2, smollm2_plain_greedy):
    prompts = bench_prompts(1)  # code, summarization and RAG
    plain = smollm2_plain_greedy("int8", prompts, 32)
    llm = LLM(str(smollm2), weights="int8", kv_cache_memory=SMOLLM2_KV, speculative="suffix")
    params = SamplingParams(max_tokens=32, temperature=0.0)
    for _ in range(2):  # the second round drafts from the first's outputs
        out = llm.generate(prompts, params)
        assert [(o.token_ids, o.text) for o in out] == plain
    assert llm.spec_stats.accepted_tokens > 0


def test_the_suffix_drafter_with_a_draft_model_calibrates_and_is_exact(tiny_dir, tiny_target, tiny_plain_greedy):
    """With k "auto" the engine times the draft model through the suffix drafter, then plans with it."""
    draft = tiny_dir(arch="llama", vocab_size=64, seed=3)
    llm = LLM(str(tiny_target), dtype="float32", kv_cache_memory=TINY_KV, speculative="suffix", draft=str(draft))
    assert llm.engine.cost.draft_catch_up.points and llm.engine.cost.draft.points
    assert [o.token_ids for o in llm.generate(tiny_prompts(64, 6), GREEDY)] == tiny_plain_greedy


def test_sessions_with_the_suffix_drafter_are_exact_and_resume(tiny_target, tmp_path):
    """Turn 2 asks turn 1's question again: its answer is drafted from turn 1's (in the session's own tokens), and
    a snapshot taken in between resumes to the same tokens."""
    prompt = list(range(1, 16))
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    plain = LLM(str(tiny_target), dtype="float32", kv_cache_memory=TINY_KV)
    with plain.session() as s:
        expected = [s.generate(prompt, params).token_ids for _ in range(2)]
    llm = LLM(str(tiny_target), dtype="float32", kv_cache_memory=TINY_KV, speculative="suffix")
    with llm.session() as s:
        first = s.generate(prompt, params)
        s.save(tmp_path / "turn1.qds")
        second = s.generate(prompt, params)
    assert [first.token_ids, second.token_ids] == expected
    assert second.metrics.speculative["accepted_tokens"] > 0
    with llm.load_session(tmp_path / "turn1.qds") as s:
        assert s.generate(prompt, params).token_ids == expected[1]


def test_a_suffix_server_answers_repeated_requests_from_earlier_outputs(tiny_target):
    from test_server import serve
    with serve(tiny_target, "tiny-suffix", speculative="suffix") as server:
        client = server.client()
        kwargs = dict(model="tiny-suffix", prompt=" ".join(f"t{i}" for i in range(1, 16)), max_tokens=32,
                      temperature=0, extra_body={"ignore_eos": True})
        first, second = (client.completions.create(**kwargs) for _ in range(2))
        assert first.choices[0].text == second.choices[0].text
        assert second.usage.speculative["accepted_tokens"] >= 20, second.usage.speculative
        assert second.usage.speculative["target_passes"] <= 12
