"""A hostile client cannot hurt the others: each crafted request below is sent while two greedy requests stream on
the real server; it gets a 4xx (or fails alone), the two finish with the text they have alone, /health stays 200.

The model pads its embedding beyond its tokenizer (72 rows, 64 tokens, as Qwen2.5 does), the server speculates
with n-gram lookup, and every engine step is slowed a little so the two requests are surely in flight.
"""
from __future__ import annotations

import asyncio
import json
import signal
import time

import httpx
import openai
import pytest

from quickdraft import LLM
from quickdraft.sampling import LogitsProcessor
from quickdraft.serving import create_app
from quickdraft.serving.guard import ServerLimits

try:
    from conftest import make_tiny_checkpoint, write_word_tokenizer
    from test_server import ServerThread, start_cli_server
except ImportError:  # tests/ imported as a package
    from tests.conftest import make_tiny_checkpoint, write_word_tokenizer
    from tests.test_server import ServerThread, start_cli_server

BESIDE = ["t3 t4 t5 t3 t4 t5 t6", "t9 t8 t7 t9 t8"]  # the two greedy requests that run beside each hostile one
BESIDE_TOKENS = 96
STEP_DELAY_S = 0.005


@pytest.fixture(scope="module")
def padded_model(tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("hostile") / "m", arch="qwen2", vocab_size=72, layers=2)
    write_word_tokenizer(path, 64)
    return path


def slowed(llm: LLM) -> LLM:
    real = llm.engine.step

    def step():
        time.sleep(STEP_DELAY_S)
        return real()
    llm.engine.step = step
    return llm


def start(model, limits: ServerLimits | None = None, **llm_kwargs) -> ServerThread:
    llm = LLM(str(model), dtype="float32", kv_cache_memory="16MiB", speculative="ngram", **llm_kwargs)
    return ServerThread(create_app(slowed(llm), "tiny", limits=limits))


@pytest.fixture(scope="module")
def server(padded_model):
    with start(padded_model) as s:
        yield s


async def stream_text(client: httpx.AsyncClient, url: str, prompt: str, started: asyncio.Event) -> str:
    body = {"prompt": prompt, "max_tokens": BESIDE_TOKENS, "temperature": 0, "ignore_eos": True, "stream": True}
    text = []
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                assert "error" not in event, event
                text.append(event["choices"][0]["text"])
                started.set()
    return "".join(text)


@pytest.fixture(scope="module")
def alone(server) -> list[str]:
    async def run() -> list[str]:
        async with httpx.AsyncClient(timeout=60) as client:
            return [await stream_text(client, server.url, p, asyncio.Event()) for p in BESIDE]
    texts = asyncio.run(run())
    assert all(texts)
    return texts


def beside_hostile(server: ServerThread, send) -> tuple[httpx.Response, list[str], bool]:
    """Start the two greedy streams, send the hostile request once both produce tokens, then let them finish."""
    async def run():
        async with httpx.AsyncClient(timeout=60) as client:
            events = [asyncio.Event() for _ in BESIDE]
            tasks = [asyncio.create_task(stream_text(client, server.url, p, e)) for p, e in zip(BESIDE, events)]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), 60)
            response = await asyncio.wait_for(send(client, server.url), 60)
            in_flight = not all(t.done() for t in tasks)
            return response, await asyncio.gather(*tasks), in_flight
    return asyncio.run(run())


def post(path: str, body: dict | bytes, headers: dict | None = None):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return lambda client, url: client.post(f"{url}{path}", content=content,
                                           headers={"content-type": "application/json", **(headers or {})})


def chunked(path: str, size: int):
    """A body streamed without Content-Length (the cap must hold while it is read, not only from the header)."""
    async def body():
        yield b'{"prompt": "'
        for _ in range(size >> 16):
            yield b"t" * (1 << 16)
        yield b'"}'
    return lambda client, url: client.post(f"{url}{path}", content=body(), headers={"content-type": "application/json"})


HOSTILE = {
    # sampling values that would make logits inf or NaN
    "repetition_penalty=1e-300": (post("/v1/completions", {"prompt": "t1", "repetition_penalty": 1e-300}), 400),
    "temperature=1e-30": (post("/v1/completions", {"prompt": "t1", "temperature": 1e-30}), 400),
    "temperature=NaN": (post("/v1/completions", b'{"prompt": "t1", "temperature": NaN}'), 400),
    "presence_penalty=1e38": (post("/v1/completions", {"prompt": "t1", "presence_penalty": 1e38}), 400),
    "logit_bias=1e30": (post("/v1/completions", {"prompt": "t1", "logit_bias": {"5": 1e30}}), 400),
    # ids of padding rows and past the vocabulary
    "logit_bias on a padding row": (post("/v1/completions", {"prompt": "t1", "logit_bias": {"70": 100}}), 400),
    "prompt id of a padding row": (post("/v1/completions", {"prompt": [1, 70]}), 400),
    "prompt id 10**12": (post("/v1/completions", {"prompt": [1, 10 ** 12]}), 400),
    "stop_token_ids past the vocabulary": (post("/v1/completions", {"prompt": "t1", "stop_token_ids": [99]}), 400),
    # text that cannot be tokenized
    "lone surrogate in a prompt": (post("/v1/completions", b'{"prompt": "t1 \\ud800 t2"}'), 400),
    "lone surrogate in a chat message": (post("/v1/chat/completions",
                                              b'{"messages": [{"role": "user", "content": "\\udfff"}]}'), 400),
    "lone surrogate in a stop string": (post("/v1/completions", b'{"prompt": "t1", "stop": ["\\ud800"]}'), 400),
    # sizes
    "a million stop_token_ids": (post("/v1/completions", {"prompt": "t1", "stop_token_ids": [1] * 10 ** 6}), 400),
    "a stop string of a million characters": (post("/v1/completions", {"prompt": "t1", "stop": "x" * 10 ** 6}), 400),
    "2,000 prompts": (post("/v1/completions", {"prompt": ["t1 t2"] * 2000, "max_tokens": 2}), 400),
    "n=10**9": (post("/v1/completions", {"prompt": "t1", "n": 10 ** 9}), 400),
    "max_tokens=10**12": (post("/v1/completions", {"prompt": "t1", "max_tokens": 10 ** 12}), 400),
    "a 20 MiB body": (post("/v1/completions", b'{"prompt": "' + b"t" * (20 << 20) + b'"}'), 413),
    "a 20 MiB chunked body": (chunked("/v1/completions", 20 << 20), 413),
    "JSON nested 100,000 deep": (post("/v1/completions", b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
                                 400),
    "20,000 chat messages": (post("/v1/chat/completions",
                                  {"messages": [{"role": "user", "content": "t1"}] * 20_000}), 400),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_request_beside_two_greedy_ones(server, alone, name):
    send, status = HOSTILE[name]
    response, texts, in_flight = beside_hostile(server, send)
    assert response.status_code == status, response.text[:300]
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert texts == alone
    assert in_flight  # the hostile request was answered while the two were still generating
    assert httpx.get(f"{server.url}/health", timeout=60).status_code == 200
    assert server.wait_idle(timeout=30)["quickdraft_kv_blocks_used"] == 0


def test_a_request_that_fails_in_the_engine_fails_alone(server, alone, monkeypatch):
    """An error raised inside the engine step for one request (not a bad parameter) gives that request a 500 in
    OpenAI's format; the requests in the same steps go on unchanged."""
    real = LogitsProcessor.process
    victim = [1, 2, 3, 1, 2, 3]

    def process(self, logits, *args, **kwargs):
        if self._prompt_ids == victim and len(self._output_ids) >= 3:
            raise RuntimeError("injected failure")
        return real(self, logits, *args, **kwargs)
    monkeypatch.setattr(LogitsProcessor, "process", process)
    body = {"prompt": victim, "max_tokens": 50, "temperature": 0, "ignore_eos": True}
    response, texts, _ = beside_hostile(server, post("/v1/completions", body))
    assert response.status_code == 500 and "injected failure" in response.json()["error"]["message"]
    assert response.json()["error"]["type"] == "internal_server_error"
    assert texts == alone
    assert httpx.get(f"{server.url}/health", timeout=60).status_code == 200


# ---- access and limits -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("flag,env", [("", None), (None, "")])
def test_an_empty_api_key_is_refused_not_taken_as_no_key(flag, env, monkeypatch):
    if env is None:
        monkeypatch.delenv("QUICKDRAFT_API_KEY", raising=False)
    else:
        monkeypatch.setenv("QUICKDRAFT_API_KEY", env)
    with pytest.raises(ValueError, match="must not be empty"):
        ServerLimits.with_env_key(flag)


def test_api_key(padded_model, monkeypatch):
    monkeypatch.setenv("QUICKDRAFT_API_KEY", "sekrit")
    with start(padded_model, ServerLimits.with_env_key()) as s:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekrit"}):
            r = httpx.post(f"{s.url}/v1/completions", json={"prompt": "t1"}, headers=headers, timeout=60)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(f"{s.url}/v1/models", timeout=60).status_code == 401
        assert httpx.get(f"{s.url}/health", timeout=60).status_code == 200
        assert httpx.get(f"{s.url}/metrics", timeout=60).status_code == 200
        client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="sekrit", max_retries=0, timeout=60)
        assert client.completions.create(model="tiny", prompt="t1", max_tokens=2,
                                         extra_body={"ignore_eos": True}).choices[0].text
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{s.url}/v1", api_key="nope", max_retries=0).models.list()


def test_full_queue_answers_429_with_retry_after(padded_model):
    limits = ServerLimits(max_waiting_requests=1)
    with start(padded_model, limits, max_num_seqs=1) as s:
        async def run():
            async with httpx.AsyncClient(timeout=60) as client:
                body = {"prompt": "t1 t2", "max_tokens": 200, "ignore_eos": True}
                running = asyncio.create_task(client.post(f"{s.url}/v1/completions", json=body))
                while s.metrics()["quickdraft_num_requests_running"] < 1:
                    await asyncio.sleep(0.01)
                waiting = asyncio.create_task(client.post(f"{s.url}/v1/completions", json=body))
                while s.metrics()["quickdraft_num_requests_waiting"] < 1:
                    await asyncio.sleep(0.01)
                refused = await client.post(f"{s.url}/v1/completions", json=body)
                return refused, await running, await waiting
        refused, *served = asyncio.run(run())
        assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["type"] == "rate_limit_error"
        assert [r.status_code for r in served] == [200, 200]
        assert s.wait_idle()["quickdraft_kv_blocks_used"] == 0


def test_request_timeout(padded_model):
    with start(padded_model, ServerLimits(request_timeout_s=0.3)) as s:
        body = {"prompt": "t1 t2", "max_tokens": 400, "ignore_eos": True}
        r = httpx.post(f"{s.url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 504 and r.json()["error"]["code"] == "request_timeout"
        with httpx.stream("POST", f"{s.url}/v1/completions", json={**body, "stream": True}, timeout=60) as r:
            lines = [line for line in r.iter_lines() if line]
        assert json.loads(lines[-2][6:])["error"]["code"] == "request_timeout" and lines[-1] == "data: [DONE]"
        ok = httpx.post(f"{s.url}/v1/completions", json={"prompt": "t1", "max_tokens": 2}, timeout=60)
        assert ok.status_code == 200
        assert s.wait_idle()["quickdraft_kv_blocks_used"] == 0


def test_a_slow_reader_stalls_only_itself(server, alone):
    """A client that stops reading its stream holds no one up; its backlog is merged, and it still gets every
    token once it reads again."""
    async def run():
        async with httpx.AsyncClient(timeout=60) as client:
            body = {"prompt": BESIDE[0], "max_tokens": BESIDE_TOKENS, "temperature": 0, "ignore_eos": True,
                    "stream": True}
            async with client.stream("POST", f"{server.url}/v1/completions", json=body) as slow:
                lines = slow.aiter_lines()
                first = await lines.__anext__()
                others = await stream_text(client, server.url, BESIDE[1], asyncio.Event())  # meanwhile, unread
                rest = [first] + [line async for line in lines]
            text = "".join(json.loads(line[6:])["choices"][0]["text"] for line in rest if line.startswith("data: {"))
            return text, others
    slow_text, other_text = asyncio.run(run())
    assert [slow_text, other_text] == alone


@pytest.mark.slow
def test_sigterm_finishes_or_aborts_in_flight_requests_within_the_deadline(padded_model):
    proc, url = start_cli_server(padded_model, "--kv-cache-memory", "8MiB", "--shutdown-timeout", "2")
    try:
        body = {"prompt": "t1 t2", "max_tokens": 500, "ignore_eos": True, "stream": True, "temperature": 0}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            next(line for line in lines if line)
            signalled = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            try:
                for _ in lines:  # the stream ends: finished, or cut when the deadline passes
                    pass
            except httpx.TransportError:
                pass
        # uvicorn raises the signal again once its graceful shutdown is done, so the exit status is SIGTERM's
        assert proc.wait(30) in (0, -signal.SIGTERM)
        assert time.monotonic() - signalled < 20
        assert "Traceback" not in proc.stdout.read().decode()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
