"""Drive the (single-threaded) engine from asyncio: one background thread steps it, requests stream out.

Threading model
---------------
``LLMEngine`` is not thread-safe, so every call into it (``add_request``, ``abort``, ``step``, ``sequences``,
``release``) happens under one lock. The engine thread holds the lock while it steps; another thread that wants the
lock announces itself first (``_waiters``) and the engine thread, after its current step, waits on the condition
until every announced caller has had its turn, so an ``add_request`` waits at most one step (a plain
``threading.Lock`` is not fair and could starve it). ``add_request`` runs in a worker thread (``run_in_executor``),
so the event loop keeps streaming while it waits for that step; validation errors still reach the caller of
:meth:`AsyncEngine.generate` before any model work. Chunks go back to the event loop through
``loop.call_soon_threadsafe`` into a per-request
``ChunkQueue`` (``streams.py``: bounded by merging chunks, so the engine thread never waits for a slow reader).
Aborts never block the event loop: they are applied at once when the engine is idle, otherwise right after the
running step.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from quickdraft.engine.outputs import StreamChunk
from quickdraft.errors import InvalidParameterError, QuickdraftError
from quickdraft.sampling import SamplingParams
from quickdraft.serving.errors import (EngineDeadError, EngineError, EngineStoppedError, QueueFullError,
                                       RequestTimeoutError)
from quickdraft.serving.metrics import ServerMetrics
from quickdraft.serving.streams import END_OF_STREAM, ChunkQueue, RequestStream, put_all

T = TypeVar("T")

log = logging.getLogger("quickdraft.serving")


@dataclass
class _Request:
    """What the engine thread keeps about a request in flight: where its chunks go and its token timings."""

    request_id: str
    loop: asyncio.AbstractEventLoop
    queue: ChunkQueue
    num_samples: int
    arrival_s: float
    finished_samples: int = 0
    first_token_s: float | None = None
    last_token_s: dict[int, float] = field(default_factory=dict)  # per sample index


class AsyncEngine:
    """The engine on its own thread, so the event loop stays free to stream while the model computes."""

    def __init__(self, llm, metrics: ServerMetrics | None = None, idle_poll_s: float = 0.1,
                 stall_timeout_s: float = 60.0, max_waiting_requests: int | None = None,
                 request_timeout_s: float | None = None, max_queued_chunks: int = 64,
                 release_idle_s: float = 60.0) -> None:
        """``stall_timeout_s``: fail the queued requests when the engine has had work but scheduled nothing for
        this long (a scheduler that can never admit them would otherwise leave their clients hanging).
        ``max_waiting_requests``: refuse new requests (QueueFullError) while this many sequences wait to start.
        ``request_timeout_s``: abort a request (RequestTimeoutError) that has run this long.
        ``max_queued_chunks``: chunks a request's consumer may leave unread before new ones are merged into the
        last (the engine thread never waits for a reader, and a slow reader's backlog stays this long).
        ``release_idle_s``: after this long without a request, give the KV memory (cached prefixes included) back."""
        self.llm = llm
        self.engine = llm.engine
        self.metrics = metrics or ServerMetrics()
        self._cond = threading.Condition(threading.Lock())
        self._waiters = 0
        self._waiters_lock = threading.Lock()
        self._requests: dict[str, _Request] = {}  # touched under self._cond only
        self._pending_aborts: collections.deque[str] = collections.deque()
        self._idle_poll_s, self._stall_timeout_s, self._release_idle_s = idle_poll_s, stall_timeout_s, release_idle_s
        self._stalled_since: float | None = None
        self._idle_since: float | None = None  # last step's end; None once the memory was given back
        self._stopping = self._started = False
        self._dead: BaseException | None = None  # the engine-wide failure that stopped the engine thread
        self._max_waiting, self._request_timeout_s = max_waiting_requests, request_timeout_s
        self._max_queued_chunks = max_queued_chunks
        self._ids = self.step_errors = 0
        self._thread = threading.Thread(target=self._run, name="quickdraft-engine", daemon=True)

    # ---- lifecycle ------------------------------------------------------------------------------
    def start(self) -> "AsyncEngine":
        if not self._started:
            self._started = True
            self._thread.start()
        return self

    def shutdown(self, timeout: float = 10.0) -> None:
        with self._locked():
            self._stopping = True
            for rid in list(self._requests):
                self._fail(rid, EngineStoppedError("the server is shutting down"), status="aborted")
            self._cond.notify_all()
        if self._started:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping and self._dead is None

    @property
    def failure(self) -> str | None:
        """Why the engine stopped serving, when it did."""
        if self._dead is not None:
            return f"the engine failed: {type(self._dead).__name__}: {self._dead}"
        if self._started and not self._thread.is_alive() and not self._stopping:
            return "the engine thread is not running"
        return None

    def _check_accepting(self) -> None:
        if self._stopping:
            raise EngineStoppedError("the server is shutting down")
        failure = self.failure
        if failure is not None:
            raise EngineDeadError(f"{failure}; this server accepts no more requests and must be restarted")

    # ---- the lock --------------------------------------------------------------------------------
    class _Turn:
        def __init__(self, owner: "AsyncEngine") -> None:
            self.owner = owner

        def __enter__(self) -> None:
            o = self.owner
            with o._waiters_lock:
                o._waiters += 1
            o._cond.acquire()
            with o._waiters_lock:
                o._waiters -= 1

        def __exit__(self, *exc) -> None:
            self.owner._cond.notify_all()
            self.owner._cond.release()

    def _locked(self) -> "_Turn":
        """Take the engine lock from a thread other than the engine's; waits at most one step."""
        return AsyncEngine._Turn(self)

    # ---- requests --------------------------------------------------------------------------------
    async def generate(self, prompt_ids: list[int], params: SamplingParams, prompt_text: str | None = None,
                       request_id: str | None = None) -> RequestStream:
        """Queue a request and return its chunk stream.

        Raises :class:`InvalidParameterError` / :class:`PromptTooLongError` here, before any model work,
        when the request cannot run. Iterate the result with ``async for``; ``aclose()`` it to abort.
        """
        if not self._started:
            self.start()
        self._check_accepting()
        loop = asyncio.get_running_loop()
        queue = ChunkQueue(self._max_queued_chunks)
        fut = loop.run_in_executor(None, self._add, loop, queue, list(prompt_ids), params, prompt_text, request_id)
        try:
            rid = await asyncio.shield(fut)
        except asyncio.CancelledError:
            # The caller went away while the request was being queued: abort it once it is in.
            fut.add_done_callback(lambda f: None if f.cancelled() or f.exception() else self.abort(f.result()))
            raise
        except QuickdraftError:
            self.metrics.count_request("error")
            raise
        return RequestStream(rid, queue, self.abort)

    def _add(self, loop, queue, prompt_ids, params, prompt_text, request_id) -> str:
        with self._locked():
            self._check_accepting()
            if self._max_waiting is not None and len(self.engine.scheduler.waiting) >= self._max_waiting:
                raise QueueFullError(f"the server has {len(self.engine.scheduler.waiting)} requests waiting to start "
                                     f"(--max-waiting-requests {self._max_waiting}); retry later")
            self._check_fits(len(prompt_ids), params)
            if request_id is None:
                self._ids += 1
                request_id = f"aeng-{self._ids}"
            rid = self.engine.add_request(prompt_ids, params, prompt=prompt_text, request_id=request_id)
            self._requests[rid] = _Request(rid, loop, queue, params.n, time.perf_counter())
            return rid

    def _check_fits(self, prompt_len: int, params: SamplingParams) -> None:
        """A sequence that can never fit in the KV cache would wait forever: reject it up front."""
        runner = self.llm.target
        room = self.engine.controller.max_k if self.engine.drafter is not None else 0
        tokens = min(prompt_len + params.max_tokens, self.engine.config.max_model_len) + room
        capacity = runner.allocator.num_blocks * runner.block_size
        if tokens > capacity:
            raise InvalidParameterError(
                f"this request needs up to {tokens} tokens of KV cache (prompt {prompt_len} + max_tokens "
                f"{params.max_tokens}{f' + {room} draft slots' if room else ''}) but the server's KV cache holds "
                f"{capacity} tokens; lower max_tokens or shorten the prompt")

    def abort(self, request_id: str) -> None:
        """Abort a request from any thread without blocking: at once if the engine is idle, else after its step."""
        self._pending_aborts.append(request_id)
        if self._cond.acquire(blocking=False):
            try:
                self._drain_aborts()
                self._cond.notify_all()
            finally:
                self._cond.release()
        # else: the engine thread (or a caller holding the lock) drains the deque before its next step

    def _drain_aborts(self) -> None:
        while self._pending_aborts:
            rid = self._pending_aborts.popleft()
            req = self._requests.pop(rid, None)
            self.engine.abort(rid)  # frees KV blocks; a no-op for unknown / already released ids
            if req is not None:
                self.metrics.count_request("aborted")

    # ---- the engine thread --------------------------------------------------------------------------
    def _has_work(self) -> bool:
        return bool(self._pending_aborts) or self.engine.has_unfinished()

    def _run(self) -> None:
        try:
            self._serve()
        except BaseException as exc:  # noqa: BLE001 - the thread is ending: nobody may be left waiting
            self._die(exc)
            if not isinstance(exc, Exception):
                raise
        finally:
            if not self._stopping and self._dead is None:
                self._die(RuntimeError("the engine thread ended"))

    def _die(self, exc: BaseException) -> None:
        """An engine-wide failure: fail every request in flight at once; new ones are refused (503)."""
        self._dead = exc
        log.error("the engine failed as a whole (%s: %s): failing every request; /health reports 503",
                  type(exc).__name__, exc)
        error = EngineDeadError(f"the engine failed while generating: {type(exc).__name__}: {exc}")
        error.__cause__ = exc
        if self._cond.acquire(timeout=5.0):  # a caller may hold it for a moment (an add, an abort, shutdown)
            try:
                for rid in list(self._requests):
                    self._fail(rid, error)
            finally:
                self._cond.release()

    def _serve(self) -> None:
        cond = self._cond
        while True:
            with cond:
                while not self._stopping and (self._waiters or not self._has_work()):
                    cond.wait(None if self._waiters else self._idle_poll_s)
                    self._release_when_idle()
                if self._stopping:
                    self._drain_aborts()
                    return
                self._drain_aborts()
                if not self.engine.has_unfinished():
                    continue
                try:
                    chunks = self.engine.step()
                except Exception:  # not one request's fault (that is isolated inside the step): the engine's.
                    self.step_errors += 1  # _run fails every request once this releases the lock
                    log.exception("engine step failed")
                    raise
                now = self._idle_since = time.perf_counter()
                deliveries: dict[asyncio.AbstractEventLoop, list] = {}
                for chunk in chunks:
                    self._route(chunk, now, deliveries)
                for loop, items in deliveries.items():
                    self._deliver(loop, items)
                if self._request_timeout_s is not None:
                    self._expire(now)
                if chunks or self.engine.scheduler.running:
                    self._stalled_since = None
                else:  # nothing could be scheduled (waiting for KV blocks): don't spin, and don't wait forever
                    self._check_stall()
                    if not self._waiters:
                        cond.wait(0.005)

    def _release_when_idle(self) -> None:
        """Give the KV memory back once the engine has had nothing to do for ``release_idle_s``."""
        idle = self._idle_since is not None and time.perf_counter() - self._idle_since >= self._release_idle_s
        if idle and not self.engine.has_unfinished():
            self.llm.release_memory()
            self._idle_since = None
            log.info("idle: gave the KV cache memory back (%s)", self.llm.memory_summary)

    def _check_stall(self) -> None:
        now = time.perf_counter()
        if self._stalled_since is None:
            self._stalled_since = now
            return
        if now - self._stalled_since < self._stall_timeout_s:
            return
        waiting = {s.request_id for s in self.engine.scheduler.waiting}
        log.error("the engine scheduled nothing for %.0fs with %d sequences waiting; failing their requests",
                  now - self._stalled_since, len(self.engine.scheduler.waiting))
        error = EngineError(f"the engine could not schedule this request for {self._stall_timeout_s:.0f}s "
                            f"(KV cache blocks: {self.llm.target.allocator.num_free} free)")
        for rid in waiting:
            self._fail(rid, error)
        self._stalled_since = None

    def _expire(self, now: float) -> None:
        limit = self._request_timeout_s
        for rid, req in list(self._requests.items()):
            if now - req.arrival_s > limit:
                self._fail(rid, RequestTimeoutError(f"the request ran longer than this server's per-request timeout "
                                                    f"of {limit:g} s and was aborted"), status="aborted")

    def _route(self, chunk: StreamChunk, now: float, deliveries: dict) -> None:
        req = self._requests.get(chunk.request_id)
        if req is None:  # aborted meanwhile
            return
        if chunk.error is not None:  # it failed alone: its consumer gets the error, its other samples stop
            self._requests.pop(req.request_id, None)
            self.engine.abort(req.request_id)
            self.metrics.count_request("error")
            error = EngineError(f"internal error while generating this request: {chunk.error}")
            deliveries.setdefault(req.loop, []).append((req.queue, error))
            return
        n_tokens = len(chunk.token_ids)
        if n_tokens:
            if req.first_token_s is None:
                req.first_token_s = now
                self.metrics.observe_ttft(now - req.arrival_s)
            last = req.last_token_s.get(chunk.index)
            if last is not None:  # the gap since this sample's previous tokens, split over the new ones
                self.metrics.observe_itl((now - last) / n_tokens, n_tokens)
            req.last_token_s[chunk.index] = now
        items = deliveries.setdefault(req.loop, [])
        items.append((req.queue, chunk))
        if chunk.finished:
            req.finished_samples += 1
            if req.finished_samples >= req.num_samples:
                self._requests.pop(req.request_id, None)
                self.engine.release(req.request_id)
                self.metrics.count_request("ok")
                items.append((req.queue, END_OF_STREAM))

    def _deliver(self, loop: asyncio.AbstractEventLoop, items: list) -> None:
        try:
            loop.call_soon_threadsafe(put_all, items)
        except RuntimeError:  # that event loop is closed: nobody will read these requests
            for queue, _ in items:
                for rid, req in list(self._requests.items()):
                    if req.queue is queue:
                        self._requests.pop(rid, None)
                        self.engine.abort(rid)
                        self.metrics.count_request("aborted")

    def _fail(self, rid: str, error: BaseException, status: str = "error") -> None:
        """Abort ``rid`` in the engine and hand ``error`` to its consumer (lock held)."""
        try:
            self.engine.abort(rid)
        except Exception:
            log.exception("aborting %s after a failure also failed", rid)
        req = self._requests.pop(rid, None)
        if req is not None:
            self.metrics.count_request(status)
            self._deliver(req.loop, [(req.queue, error)])

    # ---- introspection ------------------------------------------------------------------------------
    async def call_between_steps(self, fn: Callable[[], T]) -> T:
        """``fn()`` under the engine lock in a worker thread, between two engine steps (off the event loop)."""
        def locked() -> T:
            with self._locked():
                return fn()
        return await asyncio.get_running_loop().run_in_executor(None, locked)

    async def reset_prefix_cache(self) -> None:
        """:meth:`LLM.reset_prefix_cache` between two engine steps; running requests keep their blocks."""
        await self.call_between_steps(self.llm.reset_prefix_cache)

    async def stats_async(self) -> dict[str, int]:
        """:meth:`stats` read under the engine lock (consistent)."""
        return await self.call_between_steps(self.stats)

    def stats(self) -> dict[str, int]:
        """Engine gauges and counters for /metrics. Lock-free (plain ints and list lengths), so a value may be
        caught mid-step (e.g. while the scheduler sorts a queue); use :meth:`stats_async` for a consistent view."""
        engine = self.engine
        sched = engine.scheduler
        alloc = self.llm.target.allocator
        spec = engine.stats
        out = {
            "num_requests_running": len(sched.running),
            "num_requests_waiting": len(sched.waiting),
            "kv_blocks_used": alloc.num_used,
            "kv_blocks_free": alloc.num_free,
            "num_preemptions": sched.num_preemptions,
            "prefix_cache_hits": engine.prefix_cache_hits,
            "spec_num_rounds": spec.rounds,
            "spec_num_drafts": spec.drafting_rounds,
            "spec_num_draft_tokens": spec.draft_tokens,
            "spec_num_accepted_tokens": spec.accepted_tokens,
            "num_tracked_requests": len(self._requests),
            **self.llm.loaded.kv_bytes(),
        }
        draft_runner = engine.drafter.runner if engine.drafter is not None else None
        if draft_runner is not None and draft_runner is not self.llm.target:
            out["draft_kv_blocks_used"] = draft_runner.allocator.num_used
        return out
