"""The Ray Serve application: an ingress and N engine replicas behind a prefix-aware router.

``build_app(model, ...)`` returns the application (``serve.run(build_app(...))``, or composed into your own).
The ingress (0 CPUs) answers HTTP: it reads the request, hashes its prompt's KV blocks with the model's tokenizer
(``kv.blocks.block_hash``, the prefix cache's own keys) for the router, and forwards the request to the replica the
router picks, streaming the replica's answer back. A replica that dies before anything was sent is retried once on
another; a failure after that ends the response (a stream with an error event). ``/metrics``, ``/health`` and
``/reset_prefix_cache`` are broadcast to every replica: the expositions merged with a ``replica`` label, 200 while a
replica is healthy, every replica's cache reset.
"""
from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import ray
from ray import serve
from ray.serve.config import AutoscalingConfig, RequestRouterConfig
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from quickdraft.errors import InvalidParameterError
from quickdraft.serving.guard import ServerLimits, error_body
from quickdraft.serving.metrics import CONTENT_TYPE, merge_expositions
from quickdraft.serving.ray.prefix import MAX_ANSWER_BYTES, answer_text, block_hashes, prompt_ids
from quickdraft.serving.ray.replica import REPLICA_HEADER, EngineReplica, HttpCall
from quickdraft.serving.ray.router import POLICIES, PrefixAffinity, PrefixAwareRouter, Route

log = logging.getLogger("quickdraft.serving")
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages")
SESSION_HEADER = "x-session-id"
BROADCAST_TIMEOUT_S = 10.0


class Ingress:
    """The HTTP front of the application (see the module docstring)."""

    def __init__(self, engine: Any, model: str, limits: ServerLimits, block_size: int, policy: str) -> None:
        from quickdraft.engine.build import tokenizer_for
        from quickdraft.loading.load import load_checkpoint
        from quickdraft.loading.registry import resolve_model

        self.engine, self.limits, self.block_size = engine, limits, block_size
        self.tokenizer = tokenizer_for(load_checkpoint(resolve_model(model)))
        self.affinity = PrefixAffinity() if policy == "prefix" else None

    async def _broadcast(self, method: str) -> list[Any]:
        """Every live replica's answer (a replica that died meanwhile is left out)."""
        try:
            results = await self.engine.broadcast(method).results_async(return_exceptions=True,
                                                                        timeout_s=BROADCAST_TIMEOUT_S)
        except (TimeoutError, ray.exceptions.RayError, RuntimeError) as exc:
            log.warning("broadcast %s failed: %s", method, exc)
            return []
        return [r for r in results if not isinstance(r, BaseException)]

    async def __call__(self, request: Request) -> Response:
        path = request.url.path
        if path == "/metrics":
            statuses = await self._broadcast("status")
            return PlainTextResponse(merge_expositions({s.replica: s.metrics for s in statuses}),
                                     media_type=CONTENT_TYPE)
        if path == "/health":
            alive = sum(s.alive for s in await self._broadcast("status"))
            if alive:
                return JSONResponse({"status": "ok", "replicas": alive})
            return JSONResponse(error_body("no engine replica is ready", "service_unavailable_error"), 503)
        if path == "/reset_prefix_cache" and request.method == "POST":
            await self._broadcast("reset_prefix_cache")
            return JSONResponse({"status": "ok"})
        if path == "/lora-adapters" and request.method == "POST":  # one replica's defaults would differ from the rest
            return JSONResponse(error_body("POST /lora-adapters is not served across replicas: give each request its "
                                           "adapters (`model`, or llama-server's `lora` field)"), 400)
        body = await self._body(request)
        if body is None:
            return JSONResponse(error_body(f"the request body is larger than this server takes (at most "
                                           f"{self.limits.max_body_bytes} bytes)", code="request_too_large"), 413)
        call = HttpCall(request.method, path, request.url.query, list(request.headers.items()), body)
        route, parsed = await asyncio.to_thread(self._route, request, body)
        return await self._forward(call, route, parsed)

    async def _body(self, request: Request) -> bytes | None:
        """The body, read up to the cap whatever Content-Length says (None past it): a chunked upload must not
        grow the ingress's memory without bound before a replica's guard would refuse it."""
        cap, parts, size = self.limits.max_body_bytes, [], 0
        async for part in request.stream():
            size += len(part)
            if size > cap:
                return None
            parts.append(part)
        return b"".join(parts)

    def _route(self, request: Request, body: bytes) -> tuple[Route, dict | None]:
        route = Route(session=request.headers.get(SESSION_HEADER))
        parsed = None
        if request.url.path in GENERATION_PATHS and request.method == "POST":
            try:
                parsed = json.loads(body)
                route.hashes = block_hashes(prompt_ids(self.tokenizer, request.url.path, parsed), self.block_size)
            except Exception:  # noqa: BLE001 - a bad body routes anywhere; the replica answers its 400
                parsed = None
        if self.affinity is not None:
            route.preferred = self.affinity.preferred(route)
        return route, parsed

    def _answered(self, replica: str, path: str, parsed: dict, response: bytes, events: bool) -> None:
        """The replica now also holds the conversation with its answer: the next turn's prompt starts with it."""
        answer = answer_text(path, response, events)
        if answer is not None and self.affinity is not None:
            ids = prompt_ids(self.tokenizer, path, parsed, answer)
            self.affinity.routed(replica, block_hashes(ids, self.block_size))

    async def _forward(self, call: HttpCall, route: Route, parsed: dict | None) -> Response:
        for attempt in (1, 2):
            stream = self.engine.options(stream=True).remote(call, prefer=route.preferred)
            try:
                head = await stream.__anext__()
                first = await _next_or_none(stream)
                break
            except ray.exceptions.RayError as exc:  # the replica died or went away before answering
                log.warning("replica failed before answering (attempt %d): %s", attempt, exc)
                if attempt == 2:
                    return JSONResponse(error_body(f"the engine replica serving this request stopped "
                                                   f"({type(exc).__name__}); it was retried once",
                                                   "service_unavailable_error"), 503)
        headers = {k: v for k, v in head["headers"] if k.lower() not in ("content-length", "transfer-encoding")}
        events = "text/event-stream" in headers.get("content-type", "")
        replica = headers.get(REPLICA_HEADER)
        done = None
        if self.affinity is not None and replica is not None:
            self.affinity.routed(replica, route.hashes, route.session)
            if parsed is not None and head["status"] == 200:
                def done(response: bytes) -> None:
                    self._answered(replica, call.path, parsed, response, events)
        return StreamingResponse(_relay(first, stream, events, done), status_code=head["status"], headers=headers)


async def _next_or_none(stream: Any) -> bytes | None:
    try:
        return await stream.__anext__()
    except StopAsyncIteration:
        return None


async def _relay(first: bytes | None, stream: Any, events: bool,
                 done: Callable[[bytes], None] | None) -> AsyncIterator[bytes]:
    """The replica's body to the client; ``done`` gets the whole body (up to MAX_ANSWER_BYTES) at its end."""
    if first is None:
        return
    kept, size = [first], len(first)
    yield first
    try:
        async for chunk in stream:
            if size + len(chunk) <= MAX_ANSWER_BYTES:
                kept.append(chunk)
            size += len(chunk)
            yield chunk
    except ray.exceptions.RayError as exc:  # the replica died mid-response: say so where the format allows
        log.warning("replica failed mid-response: %s", exc)
        if events:
            error = error_body(f"the engine replica serving this request stopped ({type(exc).__name__})",
                               "service_unavailable_error")
            yield f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode()
        return
    if done is not None and size <= MAX_ANSWER_BYTES:
        try:
            await asyncio.to_thread(done, b"".join(kept))
        except Exception:  # noqa: BLE001 - routing memory is best effort
            log.exception("could not record the answered conversation for routing")


@dataclass
class ReplicaOptions:
    """How many engine replicas, what each takes, and how requests are spread over them."""

    num_replicas: int = 1
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    min_replicas: int | None = None  # with max_replicas: autoscale on requests in flight per replica
    max_replicas: int | None = None
    target_ongoing_requests: float = 8.0
    policy: str = "prefix"
    max_imbalance: int = 4
    max_ongoing_requests: int = 256
    web: bool = True  # each replica serves the chat page at / (through the ingress)

    def __post_init__(self) -> None:
        problems = []
        if self.num_replicas < 1:
            problems.append(f"replicas must be at least 1, got {self.num_replicas}")
        if not self.num_cpus > 0 or not self.num_gpus >= 0:
            problems.append(f"CPUs per replica must be > 0 and GPUs >= 0, got {self.num_cpus} and {self.num_gpus}")
        low, high = self.min_replicas, self.max_replicas
        if (low is not None and low < 0) or (high is not None and high < 1) or \
                (low is not None and high is not None and low > high):
            problems.append(f"autoscaling needs 0 <= min_replicas <= max_replicas and max_replicas >= 1, got "
                            f"{low} and {high}")
        if self.policy not in POLICIES:
            problems.append(f"routing must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if problems:
            raise InvalidParameterError("; ".join(problems))


def build_app(model: str, llm_options: dict[str, Any] | None = None, served_name: str | None = None,
              limits: ServerLimits | None = None, replicas: ReplicaOptions | None = None) -> serve.Application:
    """The Ray Serve application serving ``model`` (``llm_options``: ``LLM``'s keyword arguments) from replicas."""
    replicas = replicas or ReplicaOptions()
    limits = limits or ServerLimits()
    options = {"threads": max(1, int(replicas.num_cpus)), **(llm_options or {})}
    scaling: dict[str, Any] = {"num_replicas": replicas.num_replicas}
    if replicas.min_replicas is not None or replicas.max_replicas is not None:
        low = replicas.min_replicas if replicas.min_replicas is not None else 1
        high = replicas.max_replicas if replicas.max_replicas is not None else max(low, replicas.num_replicas)
        scaling = {"autoscaling_config": AutoscalingConfig(
            min_replicas=low, max_replicas=high, initial_replicas=min(max(replicas.num_replicas, low), high),
            target_ongoing_requests=replicas.target_ongoing_requests)}
    if replicas.policy != "power_of_two":  # else Ray Serve's default router
        scaling["request_router_config"] = RequestRouterConfig(
            request_router_class=f"{PrefixAwareRouter.__module__}:{PrefixAwareRouter.__name__}",
            request_router_kwargs={"policy": replicas.policy, "max_imbalance": replicas.max_imbalance})
    engine = serve.deployment(
        EngineReplica, name="engine", ray_actor_options={"num_cpus": replicas.num_cpus,
                                                         "num_gpus": replicas.num_gpus},
        max_ongoing_requests=replicas.max_ongoing_requests, health_check_period_s=5, health_check_timeout_s=60,
        **scaling).bind(model, options, served_name or model, limits, replicas.web)
    block_size = int(options.get("block_size", 16))
    return serve.deployment(Ingress, name="ingress", ray_actor_options={"num_cpus": 0},
                            max_ongoing_requests=4096).bind(engine, model, limits, block_size, replicas.policy)
