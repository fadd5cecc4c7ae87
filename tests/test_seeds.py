"""Sampling randomness across requests: a seeded request repeats its tokens whatever the caches hold, and unseeded
requests (and session turns) never share the draft's uniforms."""
from __future__ import annotations

import pytest

from quickdraft import LLM, SamplingParams

try:
    from test_speculative import tiny_prompts
except ImportError:  # tests/ imported as a package
    from tests.test_speculative import tiny_prompts


@pytest.fixture(scope="module")
def llm(tiny_dir) -> LLM:
    """Adaptive k: the plan of an unseeded request may depend on timings and caches, a seeded one's may not."""
    target = tiny_dir(arch="qwen2", vocab_size=64, layers=8, hidden=128)  # a draft step must be cheap by its bytes
    draft = tiny_dir(arch="llama", vocab_size=64, layers=1, seed=3)
    return LLM(str(target), draft=str(draft), dtype="float32", draft_weights="float32", kv_cache_memory="16MiB")


def test_seeded_tokens_do_not_depend_on_the_prefix_cache(llm):
    prompt = tiny_prompts(64, 1, length=60)[0]
    params = SamplingParams(max_tokens=32, temperature=0.9, seed=1234, ignore_eos=True)
    llm.reset_prefix_cache()
    cold = llm.generate([prompt], params)[0].token_ids
    warm = llm.generate([prompt], params)[0].token_ids  # the prompt's full blocks now come from both prefix caches
    assert llm.engine.prefix_cache_hits > 0
    llm.generate([prompt[:40] + [5, 6, 7]], params)  # a neighbour that caches part of the prefix with other tokens
    partial = llm.generate([prompt], params)[0].token_ids
    assert cold == warm == partial
    assert llm.engine.stats.draft_tokens > 0


def test_unseeded_requests_and_session_turns_draw_fresh_draft_nonces(llm):
    engine = llm.engine
    params = SamplingParams(max_tokens=2, temperature=1.0)
    rids = [engine.add_request([1, 2, 3], params) for _ in range(8)]
    nonces = {engine.sequences(rid)[0].draft_nonce for rid in rids}
    for rid in rids:
        engine.abort(rid)
    assert len(nonces) == 8
    seeded = [engine.add_request([1, 2, 3], SamplingParams(max_tokens=2, seed=7, n=2)) for _ in range(2)]
    assert [s.draft_nonce for rid in seeded for s in engine.sequences(rid)] == [7, 8, 7, 8]
    for rid in seeded:
        engine.abort(rid)
    seen = []
    real = engine.add_request

    def record(*args, **kwargs):
        rid = real(*args, **kwargs)
        seen.append(engine.sequences(rid)[0].draft_nonce)
        return rid
    engine.add_request = record
    try:
        with llm.session() as session:
            session.generate([1, 2, 3], params)
            session.generate([4, 5], params)
    finally:
        del engine.add_request
    assert len(seen) == 2 and seen[0] != seen[1]
