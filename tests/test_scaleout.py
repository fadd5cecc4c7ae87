"""``quickdraft serve --replicas 2`` on a local Ray instance, end to end: two SmolLM2 replicas (1 CPU each) behind one
endpoint, prefix-aware routing, replicas' metrics, a killed replica replaced while the endpoint answers, and no Ray
process left once the server is stopped."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

pytest.importorskip("ray.serve")

from quickdraft.serving.metrics import parse_metrics  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from server_process import free_port  # noqa: E402

RAY_PROCESSES = ("raylet", "gcs_server", "ray::", "ray/dashboard", "plasma_store", "monitor.py", "log_monitor")


def ray_processes() -> list[str]:
    """Command lines of Ray's own processes on this machine (its daemons and workers)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if any(p in cmdline for p in RAY_PROCESSES):
            found.append(f"{entry.name}: {cmdline[:120]}")
    return found


def engine_replica_pids() -> list[int]:
    """The worker processes of the engine replicas (Ray names them ``ray::ServeReplica:quickdraft:engine``)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if "ServeReplica:quickdraft:engine" in cmdline:
                pids.append(int(entry.name))
    return pids


class Fleet:
    def __init__(self, log_path: Path) -> None:
        assert not ray_processes(), f"Ray is already running here: {ray_processes()}"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(log_path, "wb")
        self.log_path = log_path
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "quickdraft.cli", "serve", "smollm2-135m", "--replicas", "2",
             "--num-cpus-per-replica", "1", "--port", str(self.port), "--max-model-len", "2048",
             "--kv-cache-memory", "128MiB", "--served-model-name", "smol"],
            stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})

    def health(self) -> dict:
        try:
            r = httpx.get(f"{self.url}/health", timeout=5)
            return r.json() if r.status_code == 200 else {}
        except httpx.TransportError:
            return {}

    def wait_replicas(self, count: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.health().get("replicas", 0) < count:
            assert self.proc.poll() is None, self.log_path.read_text(errors="replace")[-3000:]
            assert time.monotonic() < deadline, f"not {count} replicas after {timeout}s: " + \
                self.log_path.read_text(errors="replace")[-3000:]
            time.sleep(1)

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=120)

    def chat(self, messages: list[dict], **kwargs):
        kwargs.setdefault("max_tokens", 48)  # turn 1 + answer fill a 64-token prefill cell: turn 2 can hit it
        raw = self.client().chat.completions.with_raw_response.create(model="smol", messages=messages,
                                                                       temperature=0, **kwargs)
        return raw.parse(), raw.headers["x-quickdraft-replica"]

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(90)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            self.log.close()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    fleet = Fleet(tmp_path_factory.mktemp("fleet") / "serve.log")
    try:
        fleet.wait_replicas(2, timeout=240)
        yield fleet
    finally:
        fleet.stop()
        deadline = time.monotonic() + 60
        while ray_processes() and time.monotonic() < deadline:
            time.sleep(1)
        assert not ray_processes(), f"Ray processes left behind: {ray_processes()}"


QUESTIONS = ["Describe the city of Paris for a first-time visitor.", "Describe how a train works.",
             "Describe the life cycle of a butterfly.", "Explain why the sky is blue.",
             "Describe a typical day of a farmer.", "Explain how bread is made."]


def test_both_replicas_serve_and_conversations_stay_on_their_replica(fleet):
    seen = set()
    for question in QUESTIONS:
        history = [{"role": "user", "content": question}]
        first, replica = fleet.chat(history)
        seen.add(replica)
        history += [{"role": "assistant", "content": first.choices[0].message.content},
                    {"role": "user", "content": "Explain your answer in one sentence."}]
        second, again = fleet.chat(history)
        assert again == replica, "turn 2 went to another replica than turn 1"
        assert second.usage.prompt_tokens_details.cached_tokens > 0
        assert second.usage.prompt_tokens_details.cached_tokens >= 64
    assert len(seen) == 2, f"one replica served everything: {seen}"


def test_metrics_name_each_replica_with_vllm_gauges(fleet):
    fleet.chat([{"role": "user", "content": "Hello!"}])
    time.sleep(2)  # replicas report once a second
    m = parse_metrics(httpx.get(f"{fleet.url}/metrics", timeout=30).text)
    for name in ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
                 "quickdraft_kv_blocks_used"):
        replicas = {k for k in m if k.startswith(name + "{replica=")}
        assert len(replicas) == 2, (name, replicas)


def test_errors_keep_the_single_server_format(fleet):
    r = httpx.post(f"{fleet.url}/v1/chat/completions", timeout=60,
                   json={"model": "smol", "messages": [{"role": "user", "content": "hi"}], "temperature": -1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        fleet.client().chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])


def test_the_page_and_the_agent_apis_go_through_the_ingress(fleet):
    page = httpx.get(f"{fleet.url}/", timeout=30)
    assert page.status_code == 200 and "/web/app.js" in page.text
    assert httpx.get(f"{fleet.url}/web/app.js", timeout=30).status_code == 200
    r = httpx.post(f"{fleet.url}/v1/responses", timeout=60,
                   json={"model": "smol", "input": "Hello!", "max_output_tokens": 4, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["output_tokens"] == 4
    body = {"model": "smol", "max_tokens": 4, "messages": [{"role": "user", "content": "Hello!"}], "stream": True}
    events = httpx.post(f"{fleet.url}/v1/messages", json=body, timeout=60).text
    assert events.rstrip().endswith('data: {"type":"message_stop"}')
    r = httpx.post(f"{fleet.url}/v1/messages", json={**body, "max_tokens": 0}, timeout=60)
    assert r.status_code == 400 and r.json()["type"] == "error"


def test_a_killed_replica_is_replaced_while_the_endpoint_answers(fleet):
    pids = engine_replica_pids()
    assert len(pids) == 2, pids
    os.kill(pids[0], signal.SIGKILL)
    t0 = time.monotonic()
    answered = 0
    while time.monotonic() - t0 < 120 and answered < 3:
        try:
            response, _ = fleet.chat([{"role": "user", "content": f"Say a word number {answered}."}])
            answered += response.choices[0].finish_reason in ("stop", "length")
        except openai.APIStatusError as exc:
            assert exc.status_code == 503, exc  # only an in-flight request of the dead replica may fail, clearly
    assert answered == 3, "the endpoint stopped answering after a replica died"
    fleet.wait_replicas(2, timeout=120)  # Serve started a new replica


def test_a_body_past_the_cap_is_refused_at_the_ingress_whatever_its_length_header(fleet):
    def chunks():
        for _ in range(40):  # 40 MiB, chunked: no Content-Length to trust
            yield b"x" * (1 << 20)

    r = httpx.post(f"{fleet.url}/v1/completions", content=chunks(), timeout=120,
                   headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    r = httpx.post(f"{fleet.url}/v1/completions", content=b"{}", timeout=60,
                   headers={"content-type": "application/json", "content-length": "2", "x-session-id": "s" * 5000})
    assert r.status_code == 400  # the replica's own answer to a body with no prompt
    assert fleet.health().get("replicas") == 2
