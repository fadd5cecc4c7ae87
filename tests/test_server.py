"""The OpenAI-compatible server, end to end: a real uvicorn server on 127.0.0.1, the official client and raw HTTP."""
from __future__ import annotations

import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from quickdraft import LLM
from quickdraft.serving import create_app
from quickdraft.serving.metrics import parse_metrics

KV = "16MiB"  # tiny models need little; the default 1GiB would be allocated per server


class ServerThread:
    """uvicorn serving ``app`` on a free port of 127.0.0.1 from a background thread."""

    def __init__(self, app) -> None:
        import uvicorn

        self.app = app
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()

    @property
    def engine(self):
        return self.app.state.engine

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=60)

    def async_client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=60)

    def metrics(self) -> dict[str, float]:
        return parse_metrics(httpx.get(f"{self.url}/metrics", timeout=10).text)

    def wait_idle(self, timeout: float = 30.0) -> dict[str, float]:
        """Metrics once nothing runs or waits and no KV block is held."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            idle = (m["quickdraft_kv_blocks_used"] == 0 and m["quickdraft_num_requests_running"] == 0
                    and m["quickdraft_num_requests_waiting"] == 0)
            if idle or time.monotonic() > deadline:
                return m
            time.sleep(0.05)


def serve(model: str | Path, name: str, **llm_kwargs) -> ServerThread:
    llm_kwargs.setdefault("dtype", "float32")
    llm_kwargs.setdefault("kv_cache_memory", KV)
    return ServerThread(create_app(LLM(str(model), **llm_kwargs), name))


def words(rng: random.Random, count: int, vocab: int = 64) -> str:
    """A prompt for the tiny word-level tokenizer (tokens 't1'..'t63'), repetitive so n-grams match."""
    base = [f"t{rng.randrange(1, vocab)}" for _ in range(max(1, count // 2))]
    return " ".join((base * 3)[:count])


@pytest.fixture(scope="module")
def tiny_model(tiny_dir) -> Path:
    return tiny_dir(arch="qwen2", vocab_size=64, layers=2)


@pytest.fixture(scope="module")
def plain(tiny_model):
    with serve(tiny_model, "tiny") as server:
        yield server


@pytest.fixture(scope="module")
def spec(tiny_model):
    # a fixed k: the adaptive controller, timed on the host, may draft nothing on a loaded machine
    with serve(tiny_model, "tiny-spec", speculative="ngram", num_speculative_tokens=4) as server:
        yield server


@pytest.fixture(scope="module", params=["plain", "ngram"])
def any_server(request, plain, spec):
    return plain if request.param == "plain" else spec


def model_of(server: ServerThread) -> str:
    return server.app.state.model_name


# ---- completions and chat ----------------------------------------------------------------------------
def test_completion_greedy_usage(any_server):
    client = any_server.client()
    prompt = "t1 t2 t3 t4 t1 t2 t3 t4 t1 t2"
    r = client.completions.create(model=model_of(any_server), prompt=prompt, max_tokens=24, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.object == "text_completion" and r.model == model_of(any_server)
    (choice,) = r.choices
    assert choice.finish_reason == "length" and len(choice.text.split()) == 24
    assert r.usage.prompt_tokens == 10 and r.usage.completion_tokens == 24 and r.usage.total_tokens == 34
    s = r.usage.speculative
    assert set(s) == {"drafted_tokens", "accepted_tokens", "acceptance_rate", "target_passes", "forced_tokens"}
    assert 1 <= s["target_passes"] <= 24 and 0 <= s["accepted_tokens"] <= s["drafted_tokens"]
    if model_of(any_server) == "tiny":
        assert s == {"drafted_tokens": 0, "accepted_tokens": 0, "acceptance_rate": 0.0, "target_passes": 24,
                     "forced_tokens": 0}
    else:
        assert s["drafted_tokens"] > 0 and s["target_passes"] + s["accepted_tokens"] == 24
        assert s["acceptance_rate"] == pytest.approx(s["accepted_tokens"] / s["drafted_tokens"], abs=1e-3)
    again = client.completions.create(model=model_of(any_server), prompt=prompt, max_tokens=24, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert again.choices[0].text == choice.text


def test_streaming_matches_non_streaming(any_server):
    client = any_server.client()
    kwargs = dict(model=model_of(any_server), prompt="t9 t8 t7 t9 t8 t7", max_tokens=20, temperature=0,
                  extra_body={"ignore_eos": True})
    whole = client.completions.create(**kwargs).choices[0].text
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert all(c.usage is None for c in chunks[:-1])

    chat_kwargs = dict(model=model_of(any_server), messages=[{"role": "user", "content": "t5 t6 t7"}],
                       max_completion_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**chat_kwargs)
    assert whole.choices[0].message.role == "assistant" and whole.usage.completion_tokens == 12
    chunks = list(client.chat.completions.create(stream=True, **chat_kwargs))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_n_seed_and_batch_prompts(plain):
    client = plain.client()
    kwargs = dict(model="tiny", prompt="t3 t4 t5", max_tokens=16, temperature=1.0, n=3, seed=1234,
                  extra_body={"ignore_eos": True})
    a = client.completions.create(**kwargs)
    b = client.completions.create(**kwargs)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # seeded: reproducible
    assert len({c.text for c in a.choices}) > 1  # samples of one request differ (seed + index)
    other = client.completions.create(**{**kwargs, "seed": 99})
    assert [c.text for c in other.choices] != [c.text for c in a.choices]
    assert a.usage.completion_tokens == 48 and a.usage.prompt_tokens == 3

    # a list of prompts: choices are grouped per prompt (index = prompt * n + sample)
    multi = client.completions.create(model="tiny", prompt=["t3 t4 t5", "t1 t1"], max_tokens=16, temperature=1.0,
                                      n=3, seed=1234, extra_body={"ignore_eos": True})
    assert [c.index for c in multi.choices] == list(range(6))
    assert [c.text for c in multi.choices[:3]] == [c.text for c in a.choices]
    assert multi.usage.prompt_tokens == 5
    streamed = {}
    for chunk in client.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert [streamed[i] for i in range(3)] == [c.text for c in a.choices]
    # token-id prompts
    ids = client.completions.create(model="tiny", prompt=[3, 4, 5], max_tokens=16, temperature=1.0, n=3, seed=1234,
                                    extra_body={"ignore_eos": True})
    assert [c.text for c in ids.choices] == [c.text for c in a.choices]


def test_stop_strings(plain):
    client = plain.client()
    kwargs = dict(model="tiny", prompt="t11 t12 t13", max_tokens=30, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(**kwargs).choices[0].text
    stop = full.split()[5]
    r = client.completions.create(stop=[stop, "never-appears"], **kwargs)
    assert r.choices[0].text == full[:full.find(stop)] and r.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(stop=stop, stream=True, **kwargs))
    assert streamed == r.choices[0].text


def test_logprobs(plain):
    client = plain.client()
    r = client.completions.create(model="tiny", prompt="t2 t3", max_tokens=8, temperature=0, logprobs=3,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert lp.tokens == r.choices[0].text.split() and len(lp.token_logprobs) == 8
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 3 and chosen <= 0
        assert chosen == pytest.approx(max(top.values()))  # greedy without processors picks the argmax
    assert lp.text_offset == sorted(lp.text_offset)

    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "t4"}], max_tokens=6,
                                          temperature=0, logprobs=True, top_logprobs=2,
                                          extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 6 and all(len(c.top_logprobs) == 2 for c in content)
    assert "".join(c.token for c in content) == chat.choices[0].message.content.replace(" ", "")
    assert content[0].bytes == list(content[0].token.encode())


def test_default_max_tokens_fills_the_context(plain):
    r = plain.client().completions.create(model="tiny", prompt=" ".join(["t5"] * 500), temperature=0,
                                          extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 12 and r.choices[0].finish_reason == "length"  # 512 - 500


def test_echo_and_extensions(plain):
    client = plain.client()
    r = client.completions.create(model="tiny", prompt="t7 t8", max_tokens=4, temperature=0, echo=True,
                                  extra_body={"ignore_eos": True, "top_k": 5, "min_p": 0.01,
                                              "repetition_penalty": 1.1, "priority": 3})
    assert r.choices[0].text.startswith("t7 t8")
    biased = client.completions.create(model="tiny", prompt="t7 t8", max_tokens=5, temperature=0,
                                       logit_bias={"42": 100}, extra_body={"ignore_eos": True})
    assert biased.choices[0].text.split() == ["t42"] * 5


def test_llama_cpp_samplers_and_allowed_token_ids(plain, spec):
    prompt = words(random.Random(5), 24)
    greedy = dict(model="tiny", prompt=prompt, max_tokens=16, temperature=0)
    dry = {"ignore_eos": True, "dry_multiplier": 1.0, "dry_allowed_length": 1}
    damped = plain.client().completions.create(**greedy, extra_body=dry).choices[0].text
    drafted = spec.client().completions.create(**{**greedy, "model": "tiny-spec"}, extra_body=dry)
    assert drafted.choices[0].text == damped
    assert plain.client().completions.create(**greedy, extra_body={"ignore_eos": True}).choices[0].text != damped
    only = plain.client().completions.create(**greedy, extra_body={"ignore_eos": True, "allowed_token_ids": [42]})
    assert only.choices[0].text.split() == ["t42"] * 16
    banned = plain.client().completions.create(**greedy, logit_bias={"42": 100},
                                               extra_body={"ignore_eos": True, "bad_words": ["t42"]})
    assert banned.usage.completion_tokens == 16 and "t42" not in banned.choices[0].text.split()
    sampled = spec.client().chat.completions.create(
        model="tiny-spec", messages=[{"role": "user", "content": prompt}], max_tokens=8, seed=3,
        extra_body={"ignore_eos": True, "typical_p": 0.9, "top_n_sigma": 1.5, "xtc_probability": 0.5,
                    "xtc_threshold": 0.05, "dry_multiplier": 0.8, "dry_sequence_breakers": ["t5"]})
    assert sampled.usage.completion_tokens == 8
    # mirostat with tau 0 and eta 0 keeps only the most probable token: greedy, at any temperature, drafted or not
    pinned = {"ignore_eos": True, "mirostat": 2, "mirostat_tau": 0, "mirostat_eta": 0}
    expected = plain.client().completions.create(**greedy, extra_body={"ignore_eos": True}).choices[0].text
    for server, model in ((plain, "tiny"), (spec, "tiny-spec")):
        got = server.client().completions.create(**{**greedy, "model": model, "temperature": 1.5}, seed=4,
                                                 extra_body=pinned)
        assert got.choices[0].text == expected


def test_models_health_metrics(plain):
    client = plain.client()
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert client.models.retrieve("tiny").id == "tiny"
    assert httpx.get(f"{plain.url}/health", timeout=60).json() == {"status": "ok"}
    client.completions.create(model="tiny", prompt="t1", max_tokens=3, extra_body={"ignore_eos": True})
    response = httpx.get(f"{plain.url}/metrics", timeout=60)
    assert response.headers["content-type"].startswith("text/plain")
    text = response.text
    for name in ("quickdraft_requests_total", "quickdraft_time_to_first_token_seconds",
                 "quickdraft_inter_token_latency_seconds", "quickdraft_num_requests_running",
                 "quickdraft_num_requests_waiting", "quickdraft_kv_blocks_used", "quickdraft_kv_blocks_free",
                 "quickdraft_prefix_cache_hits_total", "quickdraft_num_preemptions_total",
                 "quickdraft_spec_decode_num_drafts_total", "quickdraft_spec_decode_num_draft_tokens_total",
                 "quickdraft_spec_decode_num_accepted_tokens_total"):
        assert f"# TYPE {name} " in text
    m = parse_metrics(text)
    assert m['quickdraft_requests_total{status="ok"}'] >= 1
    assert m["quickdraft_time_to_first_token_seconds_count"] >= 1
    assert m['quickdraft_time_to_first_token_seconds_bucket{le="+Inf"}'] == m[
        "quickdraft_time_to_first_token_seconds_count"]
    assert m["quickdraft_inter_token_latency_seconds_count"] >= 2
    assert m["quickdraft_kv_blocks_free"] > 0
    # vLLM's names, which gateways read: the same figures
    assert m["vllm:num_requests_waiting"] == m["quickdraft_num_requests_waiting"]
    assert m["vllm:num_requests_running"] == m["quickdraft_num_requests_running"]
    used, free = m["quickdraft_kv_blocks_used"], m["quickdraft_kv_blocks_free"]
    assert m["vllm:kv_cache_usage_perc"] == pytest.approx(used / (used + free))


def test_reset_prefix_cache(spec):
    """A repeated prompt is served from the prefix cache; after POST /reset_prefix_cache it is computed again."""
    prompt = words(random.Random(7), 150)

    def hits_of_one_request() -> float:
        before = spec.metrics()["quickdraft_prefix_cache_hits_total"]
        spec.client().completions.create(model="tiny-spec", prompt=prompt, max_tokens=2, temperature=0)
        return spec.wait_idle()["quickdraft_prefix_cache_hits_total"] - before

    hits_of_one_request()
    assert hits_of_one_request() >= 128  # 9 full blocks of the 150-token prompt found in the cache
    assert httpx.post(f"{spec.url}/reset_prefix_cache", timeout=60).json() == {"status": "ok"}
    assert hits_of_one_request() == 0
    assert spec.wait_idle()["quickdraft_kv_blocks_used"] == 0


def test_usage_says_how_many_prompt_tokens_were_cached(spec):
    """usage.prompt_tokens_details.cached_tokens: 0 for a new prompt, the cached full blocks when it comes again (chat
    and completions, streaming or not)."""
    httpx.post(f"{spec.url}/reset_prefix_cache", timeout=60)
    client = spec.client()
    prompt = words(random.Random(11), 150)
    first = client.completions.create(model="tiny-spec", prompt=prompt, max_tokens=2, temperature=0)
    again = client.completions.create(model="tiny-spec", prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    # 9 full 16-token blocks (below kv/attention.py's EXACT_POSITIONS a hit may end at any block)
    assert again.usage.prompt_tokens_details.cached_tokens == 144
    messages = [{"role": "user", "content": words(random.Random(12), 150)}]
    client.chat.completions.create(model="tiny-spec", messages=messages, max_tokens=2)
    stream = client.chat.completions.create(model="tiny-spec", messages=messages, max_tokens=2, stream=True,
                                            stream_options={"include_usage": True})
    (last,) = [event for event in stream if event.usage is not None]
    assert last.usage.prompt_tokens_details.cached_tokens >= 128


def test_spec_metrics_count_drafts(spec):
    spec.client().completions.create(model="tiny-spec", prompt="t1 t2 t1 t2 t1 t2", max_tokens=20, temperature=0,
                                     extra_body={"ignore_eos": True})
    m = spec.metrics()
    assert m["quickdraft_spec_decode_num_drafts_total"] > 0
    assert 0 < m["quickdraft_spec_decode_num_accepted_tokens_total"] <= m[
        "quickdraft_spec_decode_num_draft_tokens_total"]


def test_per_request_speculation_and_its_usage(spec):
    """`speculative: false` decodes a request without drafts, an object caps them; the output is the same and usage
    says what was drafted, also in the last chunk of a stream."""
    client = spec.client()
    kwargs = dict(model="tiny-spec", prompt="t1 t2 t3 t1 t2 t3 t1 t2 t3", max_tokens=24, temperature=0)
    runs = {}
    for name, value in {"on": True, "off": False, "capped": {"max_draft_tokens": 1}}.items():
        r = client.completions.create(**kwargs, extra_body={"ignore_eos": True, "speculative": value})
        runs[name] = (r.choices[0].text, r.usage.speculative)
    assert runs["on"][0] == runs["off"][0] == runs["capped"][0]
    assert runs["on"][1]["drafted_tokens"] > 0 and runs["on"][1]["target_passes"] < 24
    assert runs["off"][1] == {"drafted_tokens": 0, "accepted_tokens": 0, "acceptance_rate": 0.0, "target_passes": 24,
                              "forced_tokens": 0}
    capped = runs["capped"][1]
    assert 0 < capped["drafted_tokens"] <= capped["target_passes"] < 24
    chunks = list(client.chat.completions.create(
        model="tiny-spec", messages=[{"role": "user", "content": "t4 t5 t4 t5 t4 t5"}], max_completion_tokens=16,
        temperature=0, stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    usage = chunks[-1].usage
    assert usage.completion_tokens == 16 and usage.speculative["target_passes"] + \
        usage.speculative["accepted_tokens"] == 16


def test_smollm2_chat(smollm2):
    with serve(smollm2, "smollm2", dtype="auto", speculative="ngram", kv_cache_memory="64MiB",
               max_model_len=1024) as server:
        client = server.client()
        messages = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
        r = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=16, temperature=0)
        text = r.choices[0].message.content
        assert "Paris" in text and r.choices[0].finish_reason in ("stop", "length")
        assert r.usage.completion_tokens <= 16 and r.usage.prompt_tokens > 10
        streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model="smollm2", messages=messages, max_tokens=16, temperature=0, stream=True))
        assert streamed == text


# ---- bad requests -------------------------------------------------------------------------------------
BAD_REQUESTS = [
    # (body, status, param, words in the message)
    ('{"model": "tiny", "prompt": "t1", ', 400, None, "malformed JSON"),
    ('[1, 2, 3]', 400, None, "JSON object"),
    ({"prompt": "t1", "max_tokens": "abc"}, 400, "max_tokens", "valid integer"),
    ({"prompt": "t1", "temperature": "hot"}, 400, "temperature", "valid number"),
    ({"prompt": "t1", "max_tokens": -5}, 400, "max_tokens", "max_tokens must be an int >= 1, got -5"),
    ({"prompt": "t1", "max_tokens": 0}, 400, "max_tokens", "max_tokens must be at least 1, or 0 with echo"),
    ({"prompt": "t1", "max_tokens": 10 ** 9}, 400, "max_tokens", "maximum context length is 512 tokens"),
    ({"prompt": " ".join(["t1"] * 600)}, 400, "prompt", "600 tokens"),
    ({"prompt": " ".join(["t1"] * 600), "max_tokens": 5}, 400, "prompt", "maximum context length is 512"),
    ({"prompt": "t1", "model": "gpt-4"}, 404, "model", "`tiny`"),
    ({"prompt": "t1", "logit_bias": {"64": 1}}, 400, "logit_bias", "[0, 64)"),
    ({"prompt": "t1", "logit_bias": {"5": 101}}, 400, "logit_bias", "[-100, 100]"),
    ({"prompt": "t1", "logit_bias": {"abc": 1}}, 400, "logit_bias", "token id"),
    ({"prompt": "t1", "temperature": -0.5}, 400, "temperature", "0 (greedy) or a number in"),
    ({"prompt": "t1", "n": 0}, 400, "n", "n must be an int in [1, 128], got 0"),
    ({"prompt": "t1", "top_p": 0}, 400, "top_p", "(0, 1]"),
    ({"prompt": "t1", "max_tokens": 4, "min_tokens": 5}, 400, "min_tokens", "[0, max_tokens] (max_tokens is 4)"),
    ({"prompt": "t1", "min_tokens": -1}, 400, "min_tokens", "min_tokens must be an int in [0, max_tokens]"),
    ({"prompt": "t1", "logprobs": 50}, 400, "logprobs", "[0, 20]"),
    ({"prompt": "t1", "stop": 7}, 400, "stop", "stop must be"),
    ({"prompt": []}, 400, "prompt", "prompt must be"),
    ({"max_tokens": 3}, 400, "prompt", "prompt is required"),
    ({"prompt": [70, 1]}, 400, None, "token ids must be in [0, 64)"),
    ({"prompt": "t1", "speculative": "fast"}, 400, "speculative", 'true, false or {"max_draft_tokens"'),
    ({"prompt": "t1", "speculative": {"max_draft_tokens": 99}}, 400, "speculative", "[0, 32], got 99"),
    ('{"prompt": "t1", "speculative": ' + '{"a": ' * 900 + '1' + '}' * 900 + '}', 400, "speculative",
     'speculative must be true, false or {"max_draft_tokens"'),
    ({"prompt": "t1", "speculative": {"max_draft_tokens": [0] * 100_000}}, 400, "speculative", "an int in [0, 32]"),
    ({"prompt": "t1", "speculative": {"max_draft_tokens": True}}, 400, "speculative", "an int in [0, 32]"),
    ({"prompt": "t1", "dry_multiplier": -1}, 400, "dry_multiplier", "dry_multiplier must be >= 0"),
    ({"prompt": "t1", "dry_sequence_breakers": ["x"] * 100}, 400, "dry_sequence_breakers", "at most 16"),
    ({"prompt": "t1", "xtc_probability": "high"}, 400, "xtc_probability", "a number in [0, 1]"),
    ({"prompt": "t1", "typical_p": 1e38}, 400, "typical_p", "(0, 1]"),
    ({"prompt": "t1", "allowed_token_ids": [64]}, 400, "allowed_token_ids", "a token id in [0, 64), got 64"),
    ({"prompt": "t1", "mirostat": 3}, 400, "mirostat", "mirostat must be 0 (off), 1 or 2"),
    ({"prompt": "t1", "mirostat": 2, "mirostat_tau": 1e38}, 400, "mirostat_tau", "mirostat_tau must be in [0, 100]"),
]


@pytest.mark.parametrize("body,status,param,words", BAD_REQUESTS, ids=[str(i) for i in range(len(BAD_REQUESTS))])
def test_bad_completion_requests(plain, body, status, param, words):
    content = body if isinstance(body, str) else json.dumps(body)
    r = httpx.post(f"{plain.url}/v1/completions", content=content, headers={"content-type": "application/json"},
                   timeout=60)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and words in error["message"]
    if param is not None:
        assert error["param"] == param
    ok = httpx.post(f"{plain.url}/v1/completions", json={"prompt": "t1", "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1


BAD_CHAT = [
    ({"messages": []}, "messages", "messages"),
    ({"messages": [{"role": "bot", "content": "x"}]}, "messages", "role"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages", "content must be"),
    ({"messages": [{"role": "user", "content": "t1"}], "top_logprobs": 2}, "top_logprobs", "requires logprobs"),
    ({"messages": [{"role": "user", "content": "t1"}], "logprobs": True, "top_logprobs": 30}, "top_logprobs",
     "[0, 20]"),
    ({"messages": [{"role": "user", "content": "t1"}], "max_completion_tokens": 10 ** 6}, "max_tokens",
     "maximum context length"),
    ({"messages": [{"role": "user", "content": "t1"}], "response_format": {"type": "xml"}},
     "response_format", "'text', 'json_object' or 'json_schema'"),
    ({"messages": [{"role": "user", "content": "t1"}], "response_format": {"type": "json_object"}},
     "structured_outputs", "needs the bytes each token writes"),  # the tiny model's word-level vocabulary
]


@pytest.mark.parametrize("body,param,words", BAD_CHAT, ids=[str(i) for i in range(len(BAD_CHAT))])
def test_bad_chat_requests(plain, body, param, words):
    r = httpx.post(f"{plain.url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"]


def test_openai_client_errors(plain):
    client = plain.client()
    with pytest.raises(openai.BadRequestError, match="n must be an int"):
        client.completions.create(model="tiny", prompt="t1", n=0)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="nope", prompt="t1")
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "t1"}], temperature=-1)
    # the server still answers after the refusals (ignore_eos: a sampled first token may be the end of text)
    answer = client.completions.create(model="tiny", prompt="t1", max_tokens=2, extra_body={"ignore_eos": True})
    assert answer.choices[0].text


# ---- batching: outputs do not depend on what else runs --------------------------------------------------
def test_outputs_identical_alone_and_in_a_batch(any_server):
    rng = random.Random(5)
    name = model_of(any_server)
    requests = []
    for i in range(16):
        kind = ("greedy", "seeded", "greedy", "sampled")[i % 4]
        body = {"model": name, "prompt": words(rng, rng.randrange(3, 40)), "max_tokens": rng.randrange(4, 40),
                "temperature": 0.0 if kind == "greedy" else 0.8, "ignore_eos": True, "stream": i % 3 == 0}
        if kind == "seeded":
            body["seed"] = 1000 + i
            body["top_p"] = 0.9
        requests.append((kind, body))

    async def one(client: httpx.AsyncClient, body: dict) -> str:
        if not body["stream"]:
            r = await client.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]
        text = ""
        async with client.stream("POST", "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    text += json.loads(line[6:])["choices"][0]["text"]
        return text

    async def run() -> tuple[list[str], list[str]]:
        async with httpx.AsyncClient(base_url=any_server.url, timeout=120) as client:
            alone = [await one(client, body) for kind, body in requests if kind != "sampled"]
            batch = await asyncio.gather(*(one(client, body) for _, body in requests))
        return alone, [t for (kind, _), t in zip(requests, batch) if kind != "sampled"]

    alone, batched = asyncio.run(run())
    assert batched == alone
    assert all(alone)


# ---- failures and disconnects ----------------------------------------------------------------------------
def test_engine_wide_failure_turns_health_503_and_fails_everything_at_once(tiny_model):
    """A failure of the engine as a whole (here its target pass) is not one request's: every request in flight and
    every new one gets 503 at once, and /health says so, instead of anything hanging."""
    with serve(tiny_model, "tiny") as server:
        llm = server.app.state.llm
        real = llm.target.forward
        started = threading.Event()

        def failing_forward(items):
            if started.is_set():
                raise MemoryError("injected: out of memory")
            return real(items)
        llm.target.forward = failing_forward
        client = server.client()
        with httpx.stream("POST", f"{server.url}/v1/completions", timeout=60,
                          json={"prompt": "t1 t2", "max_tokens": 400, "ignore_eos": True, "stream": True}) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line).startswith("data: {")
            started.set()
            rest = [line for line in lines if line]
        error = json.loads(rest[-2][6:])["error"]
        assert error["type"] == "service_unavailable_error" and "out of memory" in error["message"]
        assert rest[-1] == "data: [DONE]"
        health = httpx.get(f"{server.url}/health", timeout=60)
        assert health.status_code == 503 and "MemoryError" in health.json()["error"]["message"]
        with pytest.raises(openai.InternalServerError) as info:
            client.completions.create(model="tiny", prompt="t1 t2", max_tokens=5)
        assert info.value.status_code == 503
        assert server.metrics()["quickdraft_num_requests_running"] == 0


def test_non_streaming_disconnect_aborts(plain):
    before = plain.metrics()['quickdraft_requests_total{status="aborted"}']
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{plain.url}/v1/completions", timeout=httpx.Timeout(5, read=0.1),
                   json={"prompt": "t1 t2", "max_tokens": 500, "ignore_eos": True})
    m = plain.wait_idle()
    assert m["quickdraft_kv_blocks_used"] == 0
    assert m['quickdraft_requests_total{status="aborted"}'] == before + 1


def start_cli_server(model, *flags: str, timeout: float = 120) -> tuple[subprocess.Popen, str]:
    """`quickdraft serve MODEL FLAGS` in a subprocess on a free port, once its /health answers: (process, url)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "quickdraft.cli", "serve", str(model), "--port", str(port),
                             "--dtype", "float32", "--log-level", "warning", *flags],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise AssertionError(proc.stdout.read().decode())
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError("server did not come up")
        time.sleep(0.2)


def test_cli_serve(tiny_model):
    proc, url = start_cli_server(tiny_model, "--kv-cache-memory", "8MiB", "--served-model-name", "cli-tiny",
                                 "--speculative", "ngram", "--k", "2", "--policy", "sjf", "--max-num-seqs", "4")
    try:
        r = httpx.post(f"{url}/v1/completions", timeout=60,
                       json={"model": "cli-tiny", "prompt": "t1 t2 t1 t2", "max_tokens": 6, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 6
    finally:
        proc.terminate()
        proc.wait(20)
