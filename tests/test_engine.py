"""Engine behaviour: batching, chunked prefill, prefix cache, copy-on-write samples, preemption, policies."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from quickdraft import LLM, SamplingParams
from quickdraft.errors import InvalidParameterError, PromptTooLongError
from quickdraft.kv import SequenceKV
from quickdraft.kv.attention import exact_positions


def prompts(vocab: int, count: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (int(n),), generator=g).tolist()
            for n in torch.randint(5, 60, (count,), generator=g)]


GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
TINY_KV = "16MiB"  # thousands of blocks for these tiny models; LLM's default pool is 1 GiB per model, zeroed when built


@pytest.fixture(scope="module")
def target(tiny_dir):
    return tiny_dir(arch="qwen2", vocab_size=64, layers=3)


def alone(llm: LLM, ps: list[list[int]], params) -> list[list[int]]:
    plist = params if isinstance(params, list) else [params] * len(ps)
    return [llm.generate([p], q)[0].token_ids for p, q in zip(ps, plist)]


@pytest.mark.parametrize("spec", [None, "ngram", "draft"])
def test_batch_of_16_mixed_requests_equals_alone(target, tiny_dir, spec):
    kwargs = {} if spec is None else {"speculative": "ngram"} if spec == "ngram" else {
        "draft": str(tiny_dir(arch="llama", vocab_size=64, seed=4))}
    llm = LLM(str(target), dtype="float32", kv_cache_memory=TINY_KV, **kwargs)
    ps = prompts(64, 16)
    mixed = [GREEDY if i % 3 else SamplingParams(max_tokens=10 + i, temperature=0.8, seed=i) for i in range(16)]
    together = [o.token_ids for o in llm.generate(ps, mixed)]
    greedy_idx = [i for i in range(16) if i % 3]
    single = alone(llm, [ps[i] for i in greedy_idx], GREEDY)
    assert [together[i] for i in greedy_idx] == single
    assert llm.target.allocator.num_used == 0



def test_reset_prefix_cache_recomputes_prompts_in_target_and_draft(target, tiny_dir):
    llm = LLM(str(target), dtype="float32", block_size=8, draft=str(tiny_dir(arch="llama", vocab_size=64, seed=4)),
              num_speculative_tokens=2, kv_cache_memory=TINY_KV)
    shared = prompts(64, 1, seed=6)[0] * 2
    first = llm.generate([shared], GREEDY)[0]
    draft_pool = llm.drafter.runner.allocator
    draft_hits = draft_pool.prefix_hit_blocks
    llm.reset_prefix_cache()
    again = llm.generate([shared], GREEDY)[0]
    assert again.token_ids == first.token_ids
    assert llm.engine.prefix_cache_hits == 0 and draft_pool.prefix_hit_blocks == draft_hits
    assert llm.target.allocator.num_used == 0
    llm.generate([shared], GREEDY)  # without a reset the cache serves the prompt again
    assert llm.engine.prefix_cache_hits > 0

def test_chunked_prefill_equals_one_pass(target):
    long_prompt = prompts(64, 1, seed=3)[0] * 6
    whole = LLM(str(target), dtype="float32", kv_cache_memory=TINY_KV, max_num_batched_tokens=4096).generate(
        [long_prompt], GREEDY)[0]
    chunked = LLM(str(target), dtype="float32", kv_cache_memory=TINY_KV, max_num_batched_tokens=16).generate(
        [long_prompt], GREEDY)[0]
    assert chunked.token_ids == whole.token_ids


def test_prefix_cache_reuses_blocks_and_keeps_output(target):
    llm = LLM(str(target), dtype="float32", block_size=8, kv_cache_memory=TINY_KV)
    shared = prompts(64, 1, seed=5)[0] * 2  # > 8 full blocks... of 8 tokens
    first = llm.generate([shared + [7]], GREEDY)[0]
    assert llm.engine.prefix_cache_hits == 0
    again = llm.generate([shared + [7]], GREEDY)[0]
    assert again.token_ids == first.token_ids
    assert llm.engine.prefix_cache_hits >= (len(shared) // 8) * 8 - 8
    fresh = LLM(str(target), dtype="float32", block_size=8, kv_cache_memory=TINY_KV).generate([shared + [9]], GREEDY)[0]
    assert llm.generate([shared + [9]], GREEDY)[0].token_ids == fresh.token_ids
    assert llm.target.allocator.num_used == 0


def test_a_follow_up_resumed_mid_cell_from_the_prefix_cache_gets_a_cold_runs_bits(target):
    """Where quickdraft's CPU attention kernel runs, a token below ``attention.EXACT_POSITIONS`` attends alone in a
    prompt too, so a cached prefix may end at any block there, not only at a 64-token cell: a follow-up holding the
    earlier answer reuses the answer's blocks as well, and its tokens and logprobs are a cold run's, bit for bit."""
    llm = LLM(str(target), dtype="float32", block_size=8, kv_cache_memory=TINY_KV)
    if not exact_positions(llm.target.pool, llm.target.dtype):
        pytest.skip("quickdraft's CPU attention kernel does not run here")
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2)
    first_prompt = prompts(64, 1, seed=7)[0][:37]
    answer = llm.generate([first_prompt], params)[0].token_ids
    follow_up = first_prompt + answer + [5, 9, 11]  # 64 tokens: under one cell, nothing was reused before
    probe = SequenceKV()
    assert llm.target.match_prefix(probe, follow_up) >= 48  # full blocks of the prompt and the answer
    llm.target.free(probe)
    warm = llm.generate([follow_up], params)[0]
    llm.reset_prefix_cache()
    cold = llm.generate([follow_up], params)[0]
    assert warm.token_ids == cold.token_ids and warm.outputs[0].logprobs == cold.outputs[0].logprobs
    assert llm.target.allocator.num_used == 0


def test_n_samples_share_prompt_blocks_copy_on_write(target):
    llm = LLM(str(target), dtype="float32", block_size=8, kv_cache_memory=TINY_KV)
    prompt = prompts(64, 1, seed=6)[0][:21]
    params = SamplingParams(n=4, max_tokens=12, temperature=1.0, seed=100, ignore_eos=True)
    rid = llm.engine.add_request(prompt, params)
    llm.engine.step()  # parent prefills; the other samples fork onto its blocks
    parent, *children = llm.engine.sequences(rid)
    shared = set(parent.kv["target"].block_table) & set(children[0].kv["target"].block_table)
    assert shared and all(llm.target.allocator.ref_counts[b] >= 2 for b in shared)
    while llm.engine.has_unfinished():
        llm.engine.step()
    outs = [s.output_ids for s in llm.engine.sequences(rid)]
    llm.engine.release(rid)
    # each sample equals a single request seeded like it (seed + index), so sharing changed nothing
    solo = [llm.generate([prompt], dataclasses.replace(params, n=1, seed=100 + i))[0].token_ids for i in range(4)]
    assert outs == solo and len({tuple(o) for o in outs}) > 1
    assert llm.target.allocator.num_used == 0


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
@pytest.mark.parametrize("spec", [None, "draft"])
def test_preemption_keeps_outputs(target, tiny_dir, preemption, spec):
    kwargs = {} if spec is None else {"draft": str(tiny_dir(arch="llama", vocab_size=64, seed=4)),
                                      "num_speculative_tokens": 2}
    ps = prompts(64, 8, seed=9)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    roomy = LLM(str(target), dtype="float32", kv_cache_memory=TINY_KV, **kwargs)
    expected = alone(roomy, ps, params)
    # 2 layers*... a pool of ~12 blocks of 8 tokens cannot hold 8 sequences of ~70 tokens at once
    per_block = 2 * 3 * 8 * 2 * 16 * 4
    tight = LLM(str(target), dtype="float32", block_size=8, kv_cache_memory=per_block * 14, preemption=preemption,
                max_model_len=100,
                **kwargs)
    got = [o.token_ids for o in tight.generate(ps, params)]
    assert tight.engine.scheduler.num_preemptions > 0
    assert got == expected
    assert tight.target.allocator.num_used == 0


@pytest.mark.parametrize("policy,order", [("fcfs", [0, 1, 2]), ("sjf", [2, 1, 0]), ("priority", [1, 2, 0]),
                                          ("deadline", [2, 0, 1])])
def test_policies_order_admission(target, policy, order):
    llm = LLM(str(target), dtype="float32", max_num_seqs=1, policy=policy, kv_cache_memory=TINY_KV)
    ps = prompts(64, 3, seed=2)
    plist = [SamplingParams(max_tokens=12, temperature=0.0, priority=3, deadline_s=5.0, ignore_eos=True),
             SamplingParams(max_tokens=8, temperature=0.0, priority=0, deadline_s=9.0, ignore_eos=True),
             SamplingParams(max_tokens=2, temperature=0.0, priority=1, deadline_s=1.0, ignore_eos=True)]
    ids = [llm.engine.add_request(p, q) for p, q in zip(ps, plist)]
    finished = []
    while llm.engine.has_unfinished():
        for chunk in llm.engine.step():
            if chunk.finished:
                finished.append(ids.index(chunk.request_id))
    if policy == "sjf":  # shortest job = prompt + max_tokens
        order = sorted(range(3), key=lambda i: len(ps[i]) + plist[i].max_tokens)
    assert finished == order


def test_bad_requests_rejected_before_model_work(target):
    llm = LLM(str(target), dtype="float32", max_model_len=64, kv_cache_memory=TINY_KV)
    with pytest.raises(PromptTooLongError, match="64"):
        llm.generate([[1] * 64], GREEDY)
    with pytest.raises(InvalidParameterError, match="token ids"):
        llm.generate([[1, 2, 999]], GREEDY)
    with pytest.raises(InvalidParameterError, match="logit_bias"):
        llm.generate([[1, 2]], SamplingParams(logit_bias={500: 1.0}))
    with pytest.raises(InvalidParameterError, match="temperature"):
        llm.generate([[1, 2]], SamplingParams(temperature=-1))
    with pytest.raises(InvalidParameterError, match="speculative"):
        LLM(str(target), speculative="medusa")
    assert not llm.engine.has_unfinished() and llm.target.allocator.num_used == 0
    # a bad request in a batch queues nothing
    with pytest.raises(InvalidParameterError):
        llm.generate([[1, 2], [3, 4]], [GREEDY, SamplingParams(top_p=2.0)])
    assert not llm.engine.has_unfinished()


@pytest.mark.slow
def test_stop_strings_and_finish_reasons(smollm2):
    # int4 weights (the CPU default): stop handling does not depend on the weight format, and a float32 SmolLM2
    # decode step reads ~7x the bytes and took ~7x as long (~100 tokens are generated here)
    llm = LLM(str(smollm2), weights="int4", kv_cache_memory="64MiB")
    base = llm.generate(["def add(a, b):\n"], SamplingParams(max_tokens=24, temperature=0.0))[0]
    assert base.finish_reason == "length" and len(base.token_ids) == 24
    stop = base.text[5:9]
    cut = llm.generate(["def add(a, b):\n"], SamplingParams(max_tokens=24, temperature=0.0, stop=[stop]))[0]
    assert cut.finish_reason == "stop" and cut.text == base.text[:base.text.index(stop)]
    streamed = "".join(c.text for c in llm.stream("def add(a, b):\n",
                                                   SamplingParams(max_tokens=24, temperature=0.0, stop=[stop])))
    assert streamed == cut.text
    chat = llm.chat([{"role": "user", "content": "Say hi."}], SamplingParams(max_tokens=64, temperature=0.0))[0]
    assert chat.finish_reason == "stop" and chat.token_ids[-1] in llm.tokenizer.eos_token_ids
    assert chat.metrics.prompt_tokens > 0 and chat.metrics.ttft_s > 0 and chat.metrics.tokens_per_s > 0


def test_context_that_cannot_fit_in_kv_cache_is_refused(target):
    with pytest.raises(InvalidParameterError, match="kv_cache_memory"):
        LLM(str(target), dtype="float32", max_model_len=512, kv_cache_memory=64 * 1024)
    capped = LLM(str(target), dtype="float32", kv_cache_memory=64 * 1024)
    assert capped.max_model_len < 512


def test_chunks_say_which_text_each_token_wrote(smollm2):
    """Each chunk's spans cover its text exactly, one per token (empty where the detokenizer waited), marked as the
    token's provenance; with a stop string (text held back) they still cover the text."""
    # a fixed k: the adaptive controller, timed on the host, may stop drafting on a loaded CI host (seen: none)
    llm = LLM(str(smollm2), speculative="ngram", num_speculative_tokens=3, kv_cache_memory="64MiB")
    prompt = "Count: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 1, 2, 3, 4, 5, 6, 7,"
    for stop in (None, [" 11"]):
        chunks = list(llm.stream(prompt, SamplingParams(max_tokens=40, temperature=0, stop=stop)))
        text = "".join(c.text for c in chunks)
        assert all(sum(n for n, _ in c.spans) == len(c.text) for c in chunks)
        drafted_spans = sum(d for c in chunks for _, d in c.spans)
        accepted = sum(sum(c.from_draft) for c in chunks)
        assert accepted > 5
        if stop is None:
            assert drafted_spans == accepted and sum(len(c.spans) for c in chunks) == sum(len(c.token_ids)
                                                                                          for c in chunks)
        else:
            assert chunks[-1].stop_string == " 11" and not text.endswith(" 11")


def test_embeddings_in_batches_equal_each_input_alone(smollm2):
    """LLM.embed reads inputs in batches of the token budget (a long one in pieces, as a prompt): each vector is
    what the input gives alone, unit length, and another pooling gives another vector."""
    llm = LLM(str(smollm2), kv_cache_memory="64MiB", max_num_batched_tokens=8)
    texts = ["hello there friend", "a much longer sentence that spans more than one batch of eight tokens", "x"]
    together = torch.tensor(llm.embed(texts))
    alone = torch.tensor([llm.embed(t)[0] for t in texts])
    assert together.shape == (3, llm.model.config.hidden_size) and torch.allclose(together, alone, atol=1e-5)
    assert torch.allclose(together.norm(dim=-1), torch.ones(3), atol=1e-5)
    assert not torch.allclose(torch.tensor(llm.embed(texts[1], pooling="mean")[0]), together[1], atol=1e-3)
    with pytest.raises(InvalidParameterError, match="pooling must be one of last, mean"):
        llm.embed("x", pooling="max")


def test_spec_metrics_add_every_counter():
    """``SpecMetrics.add`` names its counters one by one: a counter added later must be summed too."""
    from quickdraft.engine.outputs import SpecMetrics

    total, one = SpecMetrics(), SpecMetrics(**{f.name: i + 1 for i, f in enumerate(dataclasses.fields(SpecMetrics))})
    total.add(one)
    total.add(one)
    assert total == SpecMetrics(**{f.name: 2 * (i + 1) for i, f in enumerate(dataclasses.fields(SpecMetrics))})


def test_min_tokens_holds_back_the_end_and_stop_strings(smollm2):
    """vLLM's min_tokens: no EOS may be sampled and no stop string end the output before min_tokens tokens; under
    speculation the tokens are plain decoding's."""
    llm = LLM(str(smollm2), weights="int4", kv_cache_memory="64MiB")
    chat = [{"role": "user", "content": "Say hi."}]
    short = llm.chat(chat, SamplingParams(max_tokens=64, temperature=0.0))[0]
    assert short.finish_reason == "stop" and short.token_ids[-1] in llm.tokenizer.eos_token_ids
    need = len(short.token_ids) + 6
    held = llm.chat(chat, SamplingParams(max_tokens=64, min_tokens=need, temperature=0.0))[0]
    assert len(held.token_ids) >= need and not set(held.token_ids[:need]) & set(llm.tokenizer.eos_token_ids)
    assert held.token_ids[:len(short.token_ids) - 1] == short.token_ids[:-1]
    spec = LLM(str(smollm2), weights="int4", kv_cache_memory="64MiB", speculative="ngram", num_speculative_tokens=3)
    assert spec.chat(chat, SamplingParams(max_tokens=64, min_tokens=need, temperature=0.0))[0].token_ids == \
        held.token_ids
    prompt, greedy = "def add(a, b):\n", dict(max_tokens=24, temperature=0.0)
    base = llm.generate([prompt], SamplingParams(**greedy))[0]
    before_last = len(llm.generate([prompt], SamplingParams(**{**greedy, "max_tokens": 23}))[0].text)
    stop = base.text[5:9]
    assert base.text.index(stop) + len(stop) <= before_last  # it first ends before the 24th token
    cut = llm.generate([prompt], SamplingParams(**greedy, min_tokens=24, stop=[stop]))[0]
    late = [i for i in range(len(base.text)) if base.text.startswith(stop, i) and i + len(stop) > before_last]
    if late:  # it also ends in the last token's text: there, and only there, it ends the output
        assert cut.finish_reason == "stop" and cut.text == base.text[:late[0]]
    else:
        assert cut.finish_reason == "length" and cut.text == base.text
