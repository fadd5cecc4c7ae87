"""Launch-ahead decoding (engine/launch_ahead.py) on the CPU, with the static step run eagerly: the next decode step
is queued with its token ids taken from this step's decisions where they are, before they are read. What a GPU adds
(the overlap itself) is timed by bench/cuda_decode.py; here the tokens must be the usual step's in every way a
sequence can end or be interrupted mid-flight, and the cache it leaves must serve later prompts unchanged."""
from __future__ import annotations

import pytest

from quickdraft import LLM, SamplingParams
from quickdraft.errors import InvalidParameterError

try:
    from test_speculative import GREEDY, TINY_KV, tiny_prompts
except ImportError:  # tests/ imported as a package
    from tests.test_speculative import GREEDY, TINY_KV, tiny_prompts


@pytest.fixture(scope="module")
def target(tiny_dir) -> str:
    return str(tiny_dir(arch="qwen2", vocab_size=64, layers=4))


def make(model: str, ahead: str, **options) -> LLM:
    return LLM(model, dtype="float32", kv_cache_memory=TINY_KV, static_step="eager", launch_ahead=ahead, **options)


def tokens_of(llm: LLM, prompts, params) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params)]


def test_greedy_tokens_equal_the_usual_steps(target, tiny_plain_greedy):
    llm = make(target, "on")
    assert [o.token_ids for o in llm.generate(tiny_prompts(64, 6), GREEDY)] == tiny_plain_greedy
    ahead = llm.loaded.engine.ahead
    # 6 prompts of 40 tokens: every decode step but each run's first is launched ahead
    assert ahead.launches >= 30 and ahead.in_flight is None


def test_auto_is_off_without_graphs(target):
    assert not make(target, "auto").loaded.engine.ahead.enabled
    assert make(target, "on").loaded.engine.ahead.enabled


PARAMS = [SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True),
          SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True),  # ends while others run ahead
          SamplingParams(max_tokens=30, temperature=0.8, top_k=20, min_p=0.05, seed=5, ignore_eos=True),
          SamplingParams(max_tokens=19, temperature=1.1, top_p=0.8, seed=6, ignore_eos=True),
          None,  # greedy, ended by a stop token mid-flight (its id picked from the output below)
          SamplingParams(max_tokens=30, temperature=0.0, n=2, ignore_eos=True),  # forked samples, then ahead
          SamplingParams(max_tokens=8, temperature=0.0, repetition_penalty=1.3, ignore_eos=True),  # never ahead
          SamplingParams(max_tokens=12, temperature=0.0, logprobs=2, ignore_eos=True)]  # never ahead


@pytest.mark.parametrize("mixed", [False, True])
def test_greedy_sampled_and_every_ending_equal_the_usual_steps(target, mixed):
    """Seeded sampling draws its uniforms in the same order; sequences end at different steps (length, stop token)
    while the rest run ahead. ``mixed``: sequences that launch-ahead cannot take (penalties, logprobs) share the
    batch, which takes the usual step until they finish; a greedy one holding its stop token back (min_tokens) is
    taken ahead once it may end."""
    params = list(PARAMS if mixed else PARAMS[:6]) + ([None] if mixed else [])
    prompts = tiny_prompts(64, len(params))
    off, on = make(target, "off"), make(target, "on")
    unstopped = tokens_of(off, [prompts[4]], PARAMS[0])[0][0]
    params[4] = SamplingParams(max_tokens=30, temperature=0.0, stop_token_ids=[unstopped[9]])
    if mixed:
        free = tokens_of(off, [prompts[-1]], PARAMS[0])[0][0]
        params[-1] = SamplingParams(max_tokens=30, temperature=0.0, min_tokens=6, stop_token_ids=[free[2]])
    expected = tokens_of(off, prompts, params)
    assert tokens_of(on, prompts, params) == expected
    assert on.loaded.engine.ahead.launches > 0 and off.loaded.engine.ahead.launches == 0
    assert len(expected[4][0]) <= 10  # the stop token did end that one early


def test_stop_strings_end_the_same(target):
    llm_off, llm_on = make(target, "off"), make(target, "on")
    prompt = tiny_prompts(64, 1)[0]
    text = llm_off.generate([prompt], GREEDY)[0].outputs[0].text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop=[stop])
    off, on = llm_off.generate([prompt], params)[0].outputs[0], llm_on.generate([prompt], params)[0].outputs[0]
    assert (on.text, on.token_ids, on.finish_reason) == (off.text, off.token_ids, off.finish_reason)
    assert on.finish_reason == "stop" and len(on.text) < len(text)


def run_engine(llm: LLM, prompts, params, interrupt) -> dict[str, list[int]]:
    """Drive the engine by hand; ``interrupt(engine, step, ids)`` acts between steps (adds, cancels, aborts)."""
    engine = llm.loaded.engine
    ids = [engine.add_request(p, params) for p in prompts]
    step = 0
    while engine.has_unfinished():
        engine.step()
        step += 1
        interrupt(engine, step, ids)
    return {rid: engine.sequences(rid)[0].output_ids if engine.sequences(rid) else None for rid in ids}


@pytest.mark.parametrize("event", ["add", "cancel", "abort"])
def test_interruptions_between_steps_land_the_step_in_flight(target, event):
    """A prompt arriving, a cancel and an abort between two steps: the step in flight lands, nothing is lost, and
    every other sequence's tokens are the usual step's."""
    prompts = tiny_prompts(64, 3)
    late = tiny_prompts(64, 4)[3]

    def interrupt(engine, step, ids):
        if step != 6:
            return
        if event == "add":
            ids.append(engine.add_request(late, GREEDY))
        elif event == "cancel":
            engine.cancel(ids[1])
        else:
            engine.abort(ids[1])

    results = {}
    for ahead in ("off", "on"):
        llm = make(target, ahead)
        results[ahead] = run_engine(llm, prompts, GREEDY, interrupt)
        if ahead == "on":
            assert llm.loaded.engine.ahead.launches > 0
    off, on = (list(r.values()) for r in (results["off"], results["on"]))
    assert on == off
    if event == "cancel":  # the tokens delivered before the cancel, the same with or without launch-ahead
        assert 0 < len(on[1]) < GREEDY.max_tokens
    if event == "add":
        assert len(on[3]) == GREEDY.max_tokens


def test_the_cache_it_leaves_serves_later_prompts(target):
    """A finished sequence's blocks (published to the prefix cache, one position written ahead) give a later prompt
    that extends its output the same tokens as a fresh engine without launch-ahead."""
    prompt = tiny_prompts(64, 1, length=45)[0]
    params = SamplingParams(max_tokens=21, temperature=0.0, ignore_eos=True)
    on, off = make(target, "on"), make(target, "off")
    first = on.generate([prompt], params)[0].outputs[0].token_ids
    assert first == off.generate([prompt], params)[0].outputs[0].token_ids
    longer = prompt + first[:19]
    assert on.generate([longer], params)[0].outputs[0].token_ids == \
        make(target, "off").generate([longer], params)[0].outputs[0].token_ids
    assert on.loaded.engine.prefix_cache_hits > 0


def test_short_of_blocks_it_lands_instead(target):
    """A cache of a few blocks: launch-ahead never takes a block the scheduler did not see, and the tokens (with the
    scheduler's preemptions) are the usual step's."""
    prompts = tiny_prompts(64, 4)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    off = LLM(target, dtype="float32", kv_cache_memory="48KiB", static_step="eager", launch_ahead="off")
    on = LLM(target, dtype="float32", kv_cache_memory="48KiB", static_step="eager", launch_ahead="on")
    assert tokens_of(on, prompts, params) == tokens_of(off, prompts, params)


def test_bad_modes_are_refused(target):
    with pytest.raises(InvalidParameterError, match="launch_ahead must be one of auto, on, off"):
        LLM(target, dtype="float32", kv_cache_memory=TINY_KV, launch_ahead="always")
    with pytest.raises(InvalidParameterError, match="needs the target's static step"):
        LLM(target, dtype="float32", kv_cache_memory=TINY_KV, static_step="off", launch_ahead="on")


def test_a_request_waiting_for_a_slot_does_not_stop_it(target):
    """With every running slot taken (max_num_seqs=2, three prompts), the third waits and launch-ahead goes on; the
    tokens are the usual step's."""
    prompts = tiny_prompts(64, 3)
    on, off = make(target, "on", max_num_seqs=2), make(target, "off", max_num_seqs=2)
    assert tokens_of(on, prompts, GREEDY) == tokens_of(off, prompts, GREEDY)
    assert on.loaded.engine.ahead.launches >= 70  # about 39 steps of the first two, then 39 of the third
