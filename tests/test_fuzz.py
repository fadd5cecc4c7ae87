"""Schema-driven fuzzing of the HTTP server: schemathesis sends valid and schema-violating requests built from the
app's own ``/openapi.json`` to a real uvicorn server over a tiny random-weight model.

A request may be rejected (4xx) but never crash the server (5xx, or an internal error inside a 200 stream), never
hang, and never leak KV blocks. ``max_tokens``/``max_completion_tokens`` and ``n`` are capped before sending so the
run stays bounded (the schema allows any int, and a missing ``max_tokens`` fills the context); the other fields
keep their generated, possibly hostile, values. Run alone: ``.venv/bin/python -m pytest tests/test_fuzz.py``.
"""
from __future__ import annotations

import json
import time
from collections import Counter

import httpx
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

from test_server import ServerThread, serve

MAX_TOKENS = 8  # keeps each generation to a few engine steps
MAX_N = 2
RESPONSE_BOUND_S = 20.0  # a response slower than this counts as a hang (tiny model, at most MAX_N * 8 tokens)
# (method, path, examples): the generation endpoints get the most; the GETs have little to vary
OPERATIONS = [("POST", "/v1/completions", 600), ("POST", "/v1/chat/completions", 400), ("GET", "/v1/models", 20),
              ("GET", "/v1/models/{name}", 30), ("GET", "/health", 20), ("POST", "/v1/responses", 300),
              ("POST", "/v1/messages", 300), ("POST", "/v1/messages/count_tokens", 100), ("POST", "/tokenize", 100),
              ("POST", "/detokenize", 100), ("POST", "/v1/embeddings", 150)]
LENGTH_FIELDS = {"/v1/chat/completions": ("max_tokens", "max_completion_tokens"), "/v1/completions": ("max_tokens",),
                 "/v1/responses": ("max_output_tokens",), "/v1/messages": ("max_tokens",)}
PROMPT_FIELDS = {"/v1/chat/completions": "messages", "/v1/messages": "messages", "/v1/messages/count_tokens": "messages",
                 "/v1/completions": "prompt", "/v1/responses": "input", "/v1/embeddings": "input"}

sent: Counter = Counter()  # status codes of the fuzzed requests, for the final report and the KV check


@pytest.fixture(scope="module")
def server(tiny_dir) -> ServerThread:
    with serve(tiny_dir(arch="qwen2", vocab_size=64, layers=2), "tiny", speculative="ngram") as srv:
        yield srv


@pytest.fixture(scope="module")
def api_schema(server: ServerThread):
    loaded = schemathesis.openapi.from_url(f"{server.url}/openapi.json", timeout=30)
    loaded.config.update(base_url=server.url)
    loaded.config.max_stream_events = 256  # read every stream to its end (the default stops after 20 events)
    loaded.config.output.sanitization.update(enabled=False)  # it masks "max_tokens" in reproductions as a secret
    return loaded


def cap(body: object, operation_path: str) -> None:
    """Bound the work a generated body asks for, in place; only ints above the caps or an absent length change,
    so wrong types, negatives and every other field reach the server as generated."""
    keys = LENGTH_FIELDS.get(operation_path)
    if not isinstance(body, dict) or keys is None:
        return
    for key in keys:
        value = body.get(key)
        if type(value) is int and value > MAX_TOKENS:
            body[key] = MAX_TOKENS
    if all(body.get(k) is None for k in keys):  # absent or null: the server would fill the whole context
        body[keys[0]] = MAX_TOKENS
    n = body.get("n")
    if type(n) is int and n > MAX_N:
        body["n"] = MAX_N


def bounded_in_time(ctx, response, case) -> None:
    """No hang: every answer, streamed or not, arrives within the bound."""
    elapsed = response.elapsed
    assert elapsed < RESPONSE_BOUND_S, f"response took {elapsed:.1f}s (bound {RESPONSE_BOUND_S}s)"


STREAM_ENDS = {"/v1/responses": ('"type":"response.completed"', '"type":"response.incomplete"'),
               "/v1/messages": ('"type":"message_stop"',)}  # the others end with [DONE]


def no_hidden_server_error(ctx, response, case) -> None:
    """A 200 stream must finish as its API finishes one and carry no internal error event (a 5xx in disguise)."""
    if response.status_code != 200 or not response.headers.get("content-type", [""])[0].startswith(
            "text/event-stream"):
        return
    assert not response.stream_cut_short, "the stream was longer than max_stream_events or the request timeout"
    lines = [l for l in response.content.decode("utf-8", "replace").splitlines() if l.startswith("data: ")]
    ends = STREAM_ENDS.get(case.operation.path)
    if ends is None:
        assert lines and lines[-1] == "data: [DONE]", f"stream did not end with [DONE]: {lines[-3:]}"
        lines = lines[:-1]
    else:
        assert lines and any(end in lines[-1] for end in ends), f"stream did not end as its API ends: {lines[-3:]}"
    for line in lines:
        event = json.loads(line[6:])
        error = event.get("error")
        assert not isinstance(error, dict) or error.get("type") not in ("internal_server_error", "api_error"), event


def api_error_shape(ctx, response, case) -> None:
    """Rejections use the API's own error body (Anthropic's on /v1/messages, OpenAI's elsewhere), so clients can
    show the reason."""
    if response.status_code < 400:
        return
    body = json.loads(response.content)
    assert isinstance(body.get("error"), dict) and isinstance(body["error"].get("message"), str), body
    if case.operation.path.startswith("/v1/messages"):
        assert body.get("type") == "error" and isinstance(body["error"].get("type"), str), body


# Schema-generated prompts are almost never valid (``prompt`` is untyped in the schema, ``messages`` content too),
# so most generated bodies would stop at validation. These replace the prompt of a generated body, so the other
# generated (possibly hostile) fields reach the sampler and the engine.
WORDS = st.lists(st.sampled_from([f"t{i}" for i in range(1, 64)]), min_size=1, max_size=30).map(" ".join)
TEXT = st.one_of(
    WORDS,
    st.text(max_size=200),
    st.text(alphabet=st.one_of(st.characters(), st.integers(0xD800, 0xDFFF).map(chr)), max_size=20),  # lone surrogates
    st.sampled_from(["\ud800 x", "\udfff", "\x00", "\ufeff", "\u202e t1", " ", "\n" * 50, "t1 " * 600]),
)
PROMPT = st.one_of(
    TEXT,
    st.lists(st.integers(-3, 70), max_size=40),  # token ids, some outside the 64-token vocabulary
    st.lists(TEXT, min_size=1, max_size=4),  # a batch of prompts
    st.lists(st.lists(st.integers(0, 63), min_size=1, max_size=10), min_size=1, max_size=3),
)
ROLES = st.sampled_from(["system", "developer", "user", "assistant", "tool"])
MESSAGES = st.lists(st.fixed_dictionaries({"role": ROLES, "content": st.one_of(TEXT, st.none())}), min_size=1,
                    max_size=4)


def with_prompt(case, prompt):
    """The generated case with a plausible prompt (or messages) in place of the generated one."""
    if isinstance(case.body, dict):
        case.body[PROMPT_FIELDS[case.operation.path]] = prompt
    return case


def cases_for(operation):
    """Valid and schema-violating cases as schemathesis generates them, plus valid ones with a plausible prompt."""
    positive = operation.as_strategy(GenerationMode.POSITIVE)
    negative = operation.as_strategy(GenerationMode.NEGATIVE)
    if operation.method.upper() != "POST":
        return st.one_of(positive, negative)
    if operation.path not in PROMPT_FIELDS:
        return st.one_of(positive, negative)
    prompts = MESSAGES if PROMPT_FIELDS[operation.path] == "messages" else PROMPT
    plausible = st.builds(with_prompt, positive, prompts)
    return st.one_of(positive, negative, plausible, plausible)


def send(case) -> None:
    """One generated request, capped, sent and checked."""
    cap(case.body, case.operation.path)
    t0 = time.monotonic()
    try:
        response = case.call(timeout=RESPONSE_BOUND_S + 10)
    except requests.Timeout:
        pytest.fail(f"no response within {RESPONSE_BOUND_S + 10}s (hang):\n{case.as_curl_command()}")
    response.elapsed = time.monotonic() - t0  # wall time including a streamed body, not just the headers
    sent[response.status_code] += 1
    case.validate_response(response, checks=[not_a_server_error, bounded_in_time, no_hidden_server_error,
                                             api_error_shape])


# The schemathesis pytest plugin's @schema.parametrize() fails under pytest 9 ('Function' object has no attribute
# '_nodeid'), so each operation gets a plain Hypothesis test over the operation's case strategy instead.
@pytest.mark.parametrize("method,path,examples", OPERATIONS)
def test_fuzz_api(api_schema, method: str, path: str, examples: int) -> None:
    operation = api_schema[path][method]

    @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(case=cases_for(operation))
    def run(case) -> None:
        send(case)

    run()


def test_fuzzing_leaks_no_kv_blocks_and_keeps_serving(server: ServerThread) -> None:
    """After everything the fuzzer sent (disconnect-free, so every request ran to its end or was rejected), the
    engine is idle with no KV block held, and still answers a normal request."""
    if not sent:
        pytest.skip("run with test_fuzz_api (the fuzz run did not happen in this session)")
    print(f"fuzzed requests by status: {dict(sorted(sent.items()))}")
    m = server.wait_idle(timeout=30)
    assert m["quickdraft_kv_blocks_used"] == 0, m
    assert m["quickdraft_num_requests_running"] == 0 and m["quickdraft_num_requests_waiting"] == 0, m
    assert server.engine.stats()["num_tracked_requests"] == 0
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    r = httpx.post(f"{server.url}/v1/completions", timeout=30,
                   json={"prompt": "t1 t2 t3", "max_tokens": 4, "ignore_eos": True, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
