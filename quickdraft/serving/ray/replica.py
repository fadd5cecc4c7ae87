"""One engine replica of a Ray Serve deployment: the single-process server's app, called in process.

Each replica builds the same FastAPI app ``quickdraft serve`` runs (``serving.app.create_app``: the same routes, limits
and error bodies) and answers the ingress's calls by driving that app through ASGI, without a socket. A call is an
async generator: first ``{"status", "headers"}``, then the body's chunks as the app sends them (a stream's events
one by one). The replica adds its id as the ``x-quickdraft-replica`` header. ``status`` and
``reset_prefix_cache`` are what the ingress broadcasts to every replica for /health, /metrics and
/reset_prefix_cache.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from ray import serve

from quickdraft.serving.app import create_app
from quickdraft.serving.guard import ServerLimits

log = logging.getLogger("quickdraft.serving")
REPLICA_HEADER = "x-quickdraft-replica"


@dataclass
class ReplicaStatus:
    replica: str
    alive: bool
    metrics: str  # the replica's Prometheus exposition


@dataclass
class HttpCall:
    """An HTTP request as the ingress forwards it."""

    method: str
    path: str
    query: str
    headers: list[tuple[str, str]]
    body: bytes


async def run_asgi(app: Any, call: HttpCall, extra_headers: list[tuple[bytes, bytes]]) -> AsyncIterator[Any]:
    """Drive ``app`` with ``call``: yields ``{"status", "headers"}`` then each body chunk. Closing the generator early
    (the client left) tells the app the client disconnected, as uvicorn would."""
    messages: asyncio.Queue = asyncio.Queue()
    disconnected = asyncio.Event()
    delivered = False

    async def receive() -> dict:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": call.body, "more_body": False}
        await disconnected.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        await messages.put(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": call.method,
             "scheme": "http", "path": call.path, "raw_path": call.path.encode(), "root_path": "",
             "query_string": call.query.encode(), "client": ("127.0.0.1", 0), "server": ("replica", 0),
             "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in call.headers]}
    task = asyncio.create_task(app(scope, receive, send))
    try:
        while True:
            getter = asyncio.ensure_future(messages.get())
            done, _ = await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
            if getter not in done:
                getter.cancel()
                task.result()  # the app ended without a complete response: its error, if it raised
                return
            message = getter.result()
            if message["type"] == "http.response.start":
                headers = [(k.decode("latin-1"), v.decode("latin-1"))
                           for k, v in list(message.get("headers", [])) + extra_headers]
                yield {"status": message["status"], "headers": headers}
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield message["body"]
                if not message.get("more_body", False):
                    return
    finally:
        disconnected.set()
        if not task.done():
            try:
                await asyncio.wait_for(task, timeout=10)
            except Exception:  # noqa: BLE001 - a timeout, or the app's error (its own handlers logged it)
                task.cancel()


class EngineReplica:
    """A Ray Serve replica holding one LLM and its server app (see the module docstring)."""

    def __init__(self, model: str, llm_options: dict[str, Any], served_name: str, limits: ServerLimits,
                 web: bool = True) -> None:
        from quickdraft.llm import LLM

        self.llm = LLM(model, **llm_options)
        self.app = create_app(self.llm, served_name, limits=limits, web=web)
        self.engine = self.app.state.engine
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self._header = [(REPLICA_HEADER.encode(), self.replica_id.encode("latin-1", "replace"))]

    async def __call__(self, call: HttpCall, prefer: str | None = None) -> AsyncIterator[Any]:
        """One HTTP request through this replica's app (``prefer`` is the router's: unused here)."""
        async for item in run_asgi(self.app, call, self._header):
            yield item

    async def status(self) -> ReplicaStatus:
        """What the ingress's /health and /metrics read from every replica (a broadcast)."""
        alive = self.engine.alive
        stats = await self.engine.stats_async() if alive else self.engine.stats()
        return ReplicaStatus(self.replica_id, alive, self.engine.metrics.render(stats))

    async def reset_prefix_cache(self) -> str:
        await self.engine.reset_prefix_cache()
        return self.replica_id

    async def check_health(self) -> None:
        """Ray Serve's health check: a replica whose engine failed is replaced."""
        if not self.engine.alive:
            raise RuntimeError(self.engine.failure or "the engine stopped")

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown(timeout=2.0)
