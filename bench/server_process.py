"""`quickdraft serve` as a subprocess on a free port of 127.0.0.1, its output in a log file: the benchmarks that
measure a real server (serve.py, soak.py) start it this way."""
from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """``serve_args``: what follows ``quickdraft serve`` (the model and flags); host and port are added here."""

    def __init__(self, serve_args: list[str], log_path: Path, port: int = 0) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [sys.executable, "-m", "quickdraft.cli", "serve", *serve_args, "--host", "127.0.0.1",
                    "--port", str(self.port)]
        self.log_path = log_path
        self.log = open(log_path, "wb")
        self.proc = subprocess.Popen(self.cmd, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited ({self.proc.returncode}):\n{self.log_text()[-4000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"server not ready after {timeout:.0f}s:\n{self.log_text()[-4000:]}")
            time.sleep(0.5)

    def metrics(self) -> dict[str, float]:
        out = {}
        for line in httpx.get(f"{self.url}/metrics", timeout=30).text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                out[name] = float(value)
        return out

    def wait_idle(self, timeout: float) -> tuple[dict[str, float], float]:
        """Metrics once nothing runs or waits and no KV block is held (or at the timeout), and the seconds waited:
        aborts and finishes reach the engine thread asynchronously."""
        t0 = time.monotonic()
        while True:
            m = self.metrics()
            busy = sum(m.get(k, 0.0) for k in ("quickdraft_kv_blocks_used", "quickdraft_draft_kv_blocks_used",
                                               "quickdraft_num_requests_running", "quickdraft_num_requests_waiting"))
            if busy == 0 or time.monotonic() - t0 > timeout:
                return m, time.monotonic() - t0
            time.sleep(0.2)

    def reset_prefix_cache(self) -> None:
        httpx.post(f"{self.url}/reset_prefix_cache", timeout=60).raise_for_status()

    def log_text(self) -> str:
        if not self.log.closed:
            self.log.flush()
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
