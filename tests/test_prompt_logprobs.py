"""Prompt logprobs (vLLM's ``prompt_logprobs``, OpenAI's ``echo`` with ``logprobs``): what evaluation harnesses score
a continuation with. Each prompt token's logprob must be the model's own, computed in the same forward as the prompt
(chunked, batched, after a preemption) and equal, bit for bit, to the logprob the same position gets when it is the
last prompt token and the next token is sampled."""
from __future__ import annotations

import json
import random

import httpx
import pytest
import torch

from quickdraft import LLM, SamplingParams
from quickdraft.engine.outputs import StreamChunk
from quickdraft.errors import InvalidParameterError
from quickdraft.serving import create_app
from quickdraft.serving.guard import ServerLimits
from quickdraft.serving.streams import _merge
from test_server import ServerThread, serve, words

TINY_KV = "8MiB"


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return tiny_dir(arch="qwen2", vocab_size=64, layers=2)


@pytest.fixture(scope="module")
def chunked(tiny) -> LLM:
    """Prompts computed 64 tokens a step, so a long one is scored over several forwards."""
    return LLM(str(tiny), dtype="float32", kv_cache_memory=TINY_KV, max_num_batched_tokens=64)


def prompt_ids(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 64) for _ in range(length)]


def test_prompt_logprobs_are_the_models_own(tiny, chunked):
    """Against transformers' float32 forward of the whole prompt at once: every position's logprob and its top 3."""
    import transformers

    ids = prompt_ids(0, 150)
    out = chunked.generate([ids], SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=3))[0]
    got = out.prompt_logprobs
    assert len(got) == len(ids) and got[0] is None
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    with torch.no_grad():
        want = torch.log_softmax(hf(torch.tensor([ids])).logits[0].double(), -1)
    for p in range(1, len(ids)):
        entry, row = got[p], want[p - 1]
        assert entry["token_id"] == ids[p]
        assert entry["logprob"] == pytest.approx(row[ids[p]].item(), abs=2e-4)
        assert entry["rank"] == 1 + int((row > row[ids[p]] + 1e-4).sum())
        assert [t for t, _ in entry["top"]] == row.topk(3).indices.tolist()
    assert out.outputs[0].token_ids == [int(want[-1].argmax())] + out.outputs[0].token_ids[1:]


def test_each_position_equals_sampling_there(chunked):
    """Bit for bit the logprob a position gets as the last token of a prompt, where the next token is sampled (forced
    to the prompt's own by allowed_token_ids): the prompt's rows come out of the same computation, chunk or not."""
    ids = prompt_ids(1, 140)
    scored = chunked.generate([ids], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=4))[0].prompt_logprobs
    positions = [1, 2, 63, 64, 65, 100, 128, 139]
    forced = chunked.generate([ids[:p] for p in positions],
                              [SamplingParams(max_tokens=1, temperature=0, logprobs=4, allowed_token_ids=[ids[p]])
                               for p in positions])
    for p, out in zip(positions, forced):
        assert out.outputs[0].logprobs[0] == scored[p], p


def test_batches_prefix_cache_and_samples_change_nothing(chunked):
    """Scored beside other requests, after the same prompt was cached (a request with prompt logprobs recomputes
    every prompt token: a cached block has no rows to give), and with n=3: the values of a request alone."""
    ids = prompt_ids(2, 130)
    params = SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=2)
    alone = chunked.generate([ids], params)[0]
    chunked.generate([ids], SamplingParams(max_tokens=3, temperature=0))  # now its blocks are in the prefix cache
    others = [prompt_ids(s, n) for s, n in ((3, 90), (4, 7), (5, 200))]
    batch = chunked.generate([others[0], ids, others[1], others[2]],
                             [SamplingParams(max_tokens=5, temperature=0), params,
                              SamplingParams(max_tokens=5, temperature=0, prompt_logprobs=1), params])
    assert batch[1].prompt_logprobs == alone.prompt_logprobs and batch[1].token_ids == alone.token_ids
    assert batch[0].prompt_logprobs is None and len(batch[2].prompt_logprobs) == 7
    assert len(batch[3].prompt_logprobs) == 200
    assert batch[1].outputs[0].metrics.cached_tokens == 0
    sampled = chunked.generate([ids], SamplingParams(n=3, max_tokens=3, temperature=1.0, seed=7, prompt_logprobs=2))[0]
    assert len(sampled.outputs) == 3 and sampled.prompt_logprobs == alone.prompt_logprobs


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_preempted_prompts_are_scored_once(tiny, preemption):
    """A KV pool too small for every sequence at once (24 blocks of 8 tokens): the 150-token prompt is preempted
    after its first 64-token chunk, while the first sequence decodes, and recomputed (or swapped back); every
    prompt's logprobs are still each position's one entry, equal to the request's alone."""
    llm = LLM(str(tiny), dtype="float32", kv_cache_memory="96KiB", block_size=8, max_num_batched_tokens=128,
              preemption=preemption)
    prompts = [prompt_ids(10 + i, n) for i, n in enumerate([60, 150, 100, 120])]
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, prompt_logprobs=1)
    together = llm.generate(prompts, params)
    assert llm.engine.scheduler.num_preemptions > 0
    for ids, out in zip(prompts, together):
        alone = llm.generate([ids], params)[0]
        assert out.prompt_logprobs == alone.prompt_logprobs and out.token_ids == alone.token_ids


def test_speculation_scores_the_same(tiny, chunked):
    ids = prompt_ids(6, 120) * 2  # repeats, so n-gram drafts
    params = SamplingParams(max_tokens=20, temperature=0, prompt_logprobs=2)
    plain = chunked.generate([ids], params)[0]
    spec = LLM(str(tiny), dtype="float32", kv_cache_memory=TINY_KV, max_num_batched_tokens=64, speculative="ngram",
               num_speculative_tokens=4).generate([ids], params)[0]
    assert spec.prompt_logprobs == plain.prompt_logprobs and spec.token_ids == plain.token_ids


def test_prompt_chunks_on_the_static_step_score_the_same(tiny, chunked):
    """Where prompt chunks run on the static step's forward (a GPU's default), beside decodes in its bucket: the
    logprobs of the dynamic path, within float32 rounding of the two paths (``test_static_step``)."""
    llm = LLM(str(tiny), dtype="float32", kv_cache_memory=TINY_KV, static_step="eager", max_num_batched_tokens=64)
    runner = llm.loaded.engine.target
    runner.chunks_on_static = True
    prompts = [prompt_ids(40, 10), prompt_ids(41, 150)]  # the first decodes while the second's chunks run
    params = [SamplingParams(max_tokens=30, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=2)]
    got = llm.generate(prompts, params)
    want = chunked.generate(prompts, params)
    assert runner.static.chunk_forwards >= 3
    assert got[0].token_ids == want[0].token_ids and got[1].token_ids == want[1].token_ids
    for a, b in zip(got[1].prompt_logprobs[1:], want[1].prompt_logprobs[1:]):
        assert a["logprob"] == pytest.approx(b["logprob"], abs=1e-4) and a["rank"] == b["rank"]


@pytest.mark.parametrize("where", ["logprobs", "head"])
def test_a_scoring_failure_fails_its_request_alone(chunked, monkeypatch, where):
    """Scoring runs inside the step's shared forward: where it raises (computing the logprobs, or the LM head over the
    prompt's rows: a device out of memory, say), that request fails at its first token with the reason, and the
    others of the same steps finish as they do alone."""
    import quickdraft.engine.sequence as sequence
    from quickdraft.errors import RequestFailedError

    others = [prompt_ids(50, 70), prompt_ids(51, 20)]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    alone = [o.token_ids for o in chunked.generate(others, params)]

    def broken(*args):
        raise MemoryError("no room for the logprobs")

    if where == "logprobs":
        monkeypatch.setattr(sequence, "top_logprobs", broken)
    else:
        monkeypatch.setattr(chunked.loaded.engine.target, "_head", lambda model: broken)
    with pytest.raises(RequestFailedError) as failed:
        chunked.generate([others[0], prompt_ids(52, 100), others[1]],
                         [params, SamplingParams(max_tokens=6, prompt_logprobs=1), params])
    outputs = failed.value.outputs
    assert outputs[1].finish_reason == "error" and "MemoryError: no room for the logprobs" in outputs[1].outputs[0].error
    assert [outputs[0].token_ids, outputs[2].token_ids] == alone


@pytest.mark.parametrize("bad", [21, -1, True, 2.0, "3"])
def test_bad_prompt_logprobs_are_refused_by_name(bad):
    with pytest.raises(InvalidParameterError, match="prompt_logprobs must be an int in"):
        SamplingParams(prompt_logprobs=bad)


def test_a_session_refuses_prompt_logprobs(chunked):
    with chunked.session() as session, pytest.raises(InvalidParameterError, match="prompt_logprobs"):
        session.generate([5, 6, 7], SamplingParams(max_tokens=2, prompt_logprobs=1))


# ---- the server -----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tiny):
    with serve(tiny, "tiny", max_num_batched_tokens=64) as srv:
        yield srv


def lm_eval_loglikelihood(choice, context_len: int) -> tuple[float, bool]:
    """What lm-evaluation-harness's OpenAI-compatible backend reads of a scored choice (echo, logprobs=1,
    max_tokens=1): the continuation's summed logprob, and whether each of its tokens was the top one."""
    token_lps = choice.logprobs.token_logprobs[context_len:-1]
    tops = choice.logprobs.top_logprobs[context_len:-1]
    return sum(token_lps), all(lp == max(top.values()) for lp, top in zip(token_lps, tops))


def test_echo_with_logprobs_scores_continuations_as_evaluation_harnesses_read_them(server, chunked):
    """The official client, token-id prompts in one request as lm-evaluation-harness sends them: each choice's
    logprobs lead with its prompt's tokens (None for the first), then the generated one."""
    contexts = [prompt_ids(20, 40), prompt_ids(21, 90)]
    continuations = [prompt_ids(22, 5), prompt_ids(23, 1)]
    prompts = [c + t for c, t in zip(contexts, continuations)]
    r = server.client().completions.create(model="tiny", prompt=prompts, max_tokens=1, temperature=0, logprobs=1,
                                           echo=True)
    reference = chunked.generate(prompts, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1))
    for choice, context, ids, ref in zip(sorted(r.choices, key=lambda c: c.index), contexts, prompts, reference):
        lp = choice.logprobs
        assert len(lp.tokens) == len(ids) + 1 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert lp.tokens[:len(ids)] == [f"t{t}" for t in ids]
        assert lp.token_logprobs[1:len(ids)] == [e["logprob"] for e in ref.prompt_logprobs[1:]]
        assert lp.text_offset == sorted(lp.text_offset)
        total, greedy = lm_eval_loglikelihood(choice, len(context))
        assert total == pytest.approx(sum(e["logprob"] for e in ref.prompt_logprobs[len(context):]))
        assert greedy == all(e["rank"] == 1 for e in ref.prompt_logprobs[len(context):])
        assert choice.text.startswith(" ".join(f"t{t}" for t in ids))


def test_prompt_logprobs_in_vllms_shape(server, chunked):
    ids = prompt_ids(30, 70)
    ref = chunked.generate([ids], SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=2))[0].prompt_logprobs
    body = httpx.post(f"{server.url}/v1/completions", json={"prompt": ids, "max_tokens": 2, "temperature": 0,
                                                            "prompt_logprobs": 2}, timeout=60).json()
    got = body["choices"][0]["prompt_logprobs"]
    assert got[0] is None and len(got) == len(ids) and body["choices"][0]["logprobs"] is None
    for entry, want in zip(got[1:], ref[1:]):
        assert entry[str(want["token_id"])] == {"logprob": want["logprob"], "rank": want["rank"],
                                                "decoded_token": f"t{want['token_id']}"}
        assert {int(t) for t in entry} == {want["token_id"], *(t for t, _ in want["top"])}
    chat = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "t5 t6 t7"}], "max_tokens": 2, "prompt_logprobs": 0}).json()
    assert chat["prompt_logprobs"][0] is None and all(len(e) == 1 for e in chat["prompt_logprobs"][1:])
    assert chat["usage"]["prompt_tokens"] == len(chat["prompt_logprobs"])
    refused = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "t5"}], "stream": True, "prompt_logprobs": 0})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "prompt_logprobs"


def test_streamed_echo_carries_the_prompts_logprobs_once_per_choice(server):
    body = {"prompt": words(random.Random(3), 30), "max_tokens": 6, "temperature": 0.8, "seed": 5, "n": 2,
            "logprobs": 2, "echo": True, "prompt_logprobs": 1}
    whole = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()["choices"]
    events = []
    with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "stream": True}, timeout=60) as s:
        for line in s.iter_lines():
            if line.startswith("data: {"):
                events.append(json.loads(line[6:])["choices"][0])
    for choice in whole:
        mine = [e for e in events if e["index"] == choice["index"]]
        assert "".join(e["text"] for e in mine) == choice["text"]
        assert [t for e in mine for t in e["logprobs"]["tokens"]] == choice["logprobs"]["tokens"]
        assert [t for e in mine for t in e["logprobs"]["token_logprobs"]] == choice["logprobs"]["token_logprobs"]
        offsets = [o for e in mine for o in e["logprobs"]["text_offset"]]
        assert offsets == choice["logprobs"]["text_offset"] and offsets == sorted(offsets)
        assert [e["prompt_logprobs"] for e in mine if "prompt_logprobs" in e] == [choice["prompt_logprobs"]]


def test_each_field_gets_what_it_asked_for(server):
    """echo with logprobs alone gives no vLLM field; each shape keeps its own number of top tokens when both are
    asked with different ones."""
    body = {"prompt": words(random.Random(4), 20), "max_tokens": 2, "temperature": 0, "echo": True, "logprobs": 1}
    legacy = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()["choices"][0]
    assert "prompt_logprobs" not in legacy and legacy["logprobs"]["token_logprobs"][0] is None
    for echo_top, field_top in ((1, 4), (4, 1)):
        both = httpx.post(f"{server.url}/v1/completions", timeout=60,
                          json={**body, "logprobs": echo_top, "prompt_logprobs": field_top}).json()["choices"][0]
        tops = both["logprobs"]["top_logprobs"]
        assert max(len(t) for t in tops[1:]) == echo_top + 1 and min(len(t) for t in tops[1:]) >= echo_top
        assert max(len(e) for e in both["prompt_logprobs"][1:]) == field_top + 1
        assert both["logprobs"]["token_logprobs"][:20] == legacy["logprobs"]["token_logprobs"][:20]


def test_echo_with_max_tokens_0_scores_the_prompt_alone(server):
    """OpenAI's legacy scoring call: the prompt back with its logprobs, nothing generated, streamed or not."""
    prompt = words(random.Random(5), 24)
    body = {"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 2, "temperature": 0}
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
    choice = r["choices"][0]
    assert choice["text"] == prompt and choice["logprobs"]["tokens"] == prompt.split()
    assert choice["finish_reason"] == "length" and r["usage"]["completion_tokens"] == 0
    one = httpx.post(f"{server.url}/v1/completions", json={**body, "max_tokens": 1}, timeout=60).json()["choices"][0]
    assert one["logprobs"]["token_logprobs"][:-1] == choice["logprobs"]["token_logprobs"]
    events = []
    with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "stream": True}, timeout=60) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    assert "".join(e["choices"][0]["text"] for e in events) == prompt
    assert [t for e in events for t in e["choices"][0]["logprobs"]["tokens"]] == prompt.split()
    refused = httpx.post(f"{server.url}/v1/completions", json={**body, "echo": False}, timeout=60)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "max_tokens"
    refused = httpx.post(f"{server.url}/v1/completions", json={**body, "min_tokens": 2}, timeout=60)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "min_tokens"
    # the hidden token's own ending (here it completes a stop string) is not the answer's
    hidden = one["text"][len(prompt):]
    stopped = httpx.post(f"{server.url}/v1/completions", json={**body, "stop": [hidden]}, timeout=60).json()
    assert stopped["choices"][0]["finish_reason"] == "length" and stopped["choices"][0]["text"] == prompt


def test_responses_past_the_servers_limit_are_refused_before_any_work(tiny):
    llm = LLM(str(tiny), dtype="float32", kv_cache_memory=TINY_KV)
    with ServerThread(create_app(llm, "tiny", limits=ServerLimits(max_prompt_logprobs=1000))) as srv:
        ids = prompt_ids(60, 100)
        ok = httpx.post(f"{srv.url}/v1/completions", timeout=60,
                        json={"prompt": ids, "max_tokens": 1, "prompt_logprobs": 4, "n": 2})  # 100 x 5 x 2
        assert ok.status_code == 200
        for body in ({"prompt": ids, "max_tokens": 1, "prompt_logprobs": 4, "n": 3},
                     {"prompt": [ids, ids], "max_tokens": 1, "prompt_logprobs": 4, "n": 2},
                     {"prompt": ids, "max_tokens": 1, "echo": True, "logprobs": 4, "prompt_logprobs": 5}):
            r = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=60)
            assert r.status_code == 400 and "more than the 1000 a response of this server may carry" in r.text
        chat = httpx.post(f"{srv.url}/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": " ".join(["t3"] * 400)}], "max_tokens": 1, "prompt_logprobs": 2})
        assert chat.status_code == 400 and chat.json()["error"]["param"] == "prompt_logprobs"
        assert srv.wait_idle()["quickdraft_kv_blocks_used"] == 0


def test_merged_stream_chunks_keep_the_prompt_logprobs():
    """A slow reader's queued chunks are merged: the first one's prompt logprobs must survive."""
    first = StreamChunk("r", 0, "a", [1], [False], prompt_logprobs=[None, {"token_id": 1}])
    second = StreamChunk("r", 0, "b", [2], [False])
    assert _merge(first, second).prompt_logprobs == [None, {"token_id": 1}]
    assert _merge(second, first).prompt_logprobs == [None, {"token_id": 1}]


@pytest.mark.parametrize("bad", [21, -1, True, 1.5, "3", 10**30])
def test_server_refuses_bad_prompt_logprobs(server, bad):
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "t1 t2", "max_tokens": 1, "prompt_logprobs": bad},
                   timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"


def test_real_weights_score_each_position_as_sampling_there(smollm2):
    """SmolLM2-135M in its file's own formats, on the CPU kernels, prompts cut into 64-token cells: a code prompt's
    logprobs equal, bit for bit, each position's as the last prompt token."""
    llm = LLM(str(smollm2), kv_cache_memory="32MiB", max_num_batched_tokens=128)
    ids = llm.tokenizer.encode("def is_prime(n):\n    if n < 2:\n        return False\n    for i in range(2, int(n ** "
                               "0.5) + 1):\n        if n % i == 0:\n            return False\n    return True\n\n"
                               "def primes_below(limit):\n    return [n for n in range(limit) if is_prime(n)]\n" * 2)
    assert len(ids) > 130
    scored = llm.generate([ids], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=3))[0].prompt_logprobs
    positions = [1, 63, 64, 65, 127, 128, len(ids) - 1]
    forced = llm.generate([ids[:p] for p in positions],
                          [SamplingParams(max_tokens=1, temperature=0, logprobs=3, allowed_token_ids=[ids[p]])
                           for p in positions])
    for p, out in zip(positions, forced):
        assert out.outputs[0].logprobs[0] == scored[p], p
    later = [e for e in scored[70:] if e is not None]  # the second copy of the code: the model has read it
    assert sum(e["rank"] == 1 for e in later) > 0.8 * len(later)
