"""How a request's chunks travel from the engine thread to the asyncio code that reads them.

The engine thread never waits for a reader: it hands chunks to a :class:`ChunkQueue` through the event loop,
and the queue merges chunks when its reader falls behind. A :class:`RequestStream` reads one request's queue;
:func:`merge_streams` reads several (one HTTP request with a list of prompts).
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
from collections.abc import AsyncIterator, Callable

from quickdraft.engine.outputs import StreamChunk

END_OF_STREAM = object()  # queue sentinel: every sample of the request has finished


class ChunkQueue:
    """A request's chunks on their way to its consumer, bounded by merging: past ``limit`` unread items, a new
    chunk joins the last one of its sample, so a slow reader costs memory for its text only, never a chunk
    per step, and the engine thread never waits for it."""

    def __init__(self, limit: int) -> None:
        self._items: collections.deque = collections.deque()
        self._limit = max(1, limit)
        self._ready = asyncio.Event()

    def put_nowait(self, item) -> None:
        if isinstance(item, StreamChunk) and len(self._items) >= self._limit:
            for i in range(len(self._items) - 1, -1, -1):
                last = self._items[i]
                if isinstance(last, StreamChunk) and last.index == item.index and not last.finished:
                    self._items[i] = _merge(last, item)
                    self._ready.set()
                    return
        self._items.append(item)
        self._ready.set()

    async def get(self):
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        return self._items.popleft()


def _merge(a: StreamChunk, b: StreamChunk) -> StreamChunk:
    """One chunk with ``a``'s content followed by ``b``'s."""
    logprobs = None if a.logprobs is None and b.logprobs is None else (a.logprobs or []) + (b.logprobs or [])
    return dataclasses.replace(b, text=a.text + b.text, token_ids=a.token_ids + b.token_ids, spans=a.spans + b.spans,
                               from_draft=a.from_draft + b.from_draft, logprobs=logprobs,
                               prompt_logprobs=a.prompt_logprobs if a.prompt_logprobs is not None else b.prompt_logprobs)


def put_all(items: list[tuple[ChunkQueue, object]]) -> None:
    """Hand one engine step's items to their queues (runs on the event loop, called from the engine thread)."""
    for queue, item in items:
        queue.put_nowait(item)


class RequestStream:
    """Async iterator over one request's :class:`StreamChunk` s (all samples interleaved).

    Stopping early -- ``aclose()``, cancellation while waiting, or dropping the object -- aborts the
    request, which frees its KV blocks.
    """

    def __init__(self, request_id: str, queue: ChunkQueue, abort: Callable[[str], None]) -> None:
        self.request_id, self._queue, self._abort = request_id, queue, abort
        self._done = False

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> StreamChunk:
        if self._done:
            raise StopAsyncIteration
        try:
            item = await self._queue.get()
        except BaseException:  # cancelled: the consumer is gone
            self._abandon()
            raise
        if item is END_OF_STREAM:
            self._done = True
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            self._done = True
            raise item
        return item

    async def aclose(self) -> None:
        self._abandon()

    def close(self) -> None:
        """Synchronous ``aclose`` (safe inside cancelled scopes, where awaiting is not)."""
        self._abandon()

    @property
    def finished(self) -> bool:
        return self._done

    def _abandon(self) -> None:
        if not self._done:
            self._done = True
            self._abort(self.request_id)

    def __del__(self) -> None:
        try:
            self._abandon()
        except Exception:  # interpreter shutdown
            pass


async def merge_streams(streams: list[RequestStream]) -> AsyncIterator[tuple[int, StreamChunk]]:
    """Chunks of several engine requests as ``(prompt index, chunk)``; closing it aborts what is unfinished."""
    if len(streams) == 1:
        try:
            async for chunk in streams[0]:
                yield 0, chunk
        finally:
            streams[0].close()
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(p: int, stream: RequestStream) -> None:
        try:
            async for chunk in stream:
                queue.put_nowait((p, chunk))
            queue.put_nowait((p, None))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            queue.put_nowait((p, exc))

    tasks = [asyncio.ensure_future(pump(p, s)) for p, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            p, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield p, item
    finally:  # no awaits here: this may run inside a cancelled scope
        for task in tasks:
            task.cancel()
        for s in streams:
            s.close()


async def collect(stream: AsyncIterator[StreamChunk]) -> list[StreamChunk]:
    """Every chunk of a stream (tests and simple callers)."""
    return [chunk async for chunk in stream]
