"""One HTTP generation request as the engine sees it: one engine request per prompt, each with ``n`` samples."""
from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

from starlette.requests import Request

from quickdraft.engine.outputs import StreamChunk
from quickdraft.errors import QuickdraftError
from quickdraft.sampling import SamplingParams
from quickdraft.serving.async_engine import AsyncEngine
from quickdraft.serving.openai_format import Choice
from quickdraft.serving.streams import RequestStream, merge_streams


T = TypeVar("T")


class ClientGone(Exception):
    """The client disconnected before its (non-streaming) response was ready."""


@dataclass
class Job:
    """One HTTP generation request: its engine requests (one per prompt) and their streams."""

    id: str
    created: int
    prompts: list[tuple[list[int], str | None]]  # token ids, and the text when the prompt was sent as text
    params: list[SamplingParams]
    n: int
    shows_output: bool = True  # False: what the engine generates is not returned (an echo with max_tokens 0)
    streams: list[RequestStream] = field(default_factory=list)

    @classmethod
    def new(cls, id_prefix: str, prompts: list[tuple[list[int], str | None]],
            params: list[SamplingParams], shows_output: bool = True) -> "Job":
        return cls(f"{id_prefix}-{uuid.uuid4().hex}", int(time.time()), prompts, params, params[0].n, shows_output)

    async def chunks(self) -> AsyncIterator[tuple[int, StreamChunk]]:
        """(prompt index, chunk) as the engine sends them, every prompt's interleaved; without ``shows_output``,
        each chunk emptied of what was generated (its end, metrics and prompt logprobs kept)."""
        async for p, chunk in merge_streams(self.streams):
            if not self.shows_output:  # (the hidden token's own ending is not the answer's: its length is)
                chunk = dataclasses.replace(chunk, text="", token_ids=[], from_draft=[], spans=[], stop_string=None,
                                            logprobs=None if chunk.logprobs is None else [],
                                            finish_reason="length" if chunk.finish_reason == "stop" else
                                            chunk.finish_reason)
            yield p, chunk

    @property
    def prompt_tokens(self) -> int:
        return sum(len(ids) for ids, _ in self.prompts)

    def choice_index(self, prompt_index: int, chunk: StreamChunk) -> int:
        """Choices are numbered prompt by prompt, ``n`` per prompt, as OpenAI numbers them."""
        return prompt_index * self.n + chunk.index

    def prompt_text(self, prompt_index: int, tokenizer) -> str:
        """The prompt as text (for echo): as sent, or decoded when it was sent as token ids."""
        ids, text = self.prompts[prompt_index]
        return text if text is not None else tokenizer.decode(ids)

    async def start(self, engine: AsyncEngine) -> None:
        """Queue every prompt; if one is refused, abort those already queued."""
        try:
            for p, ((ids, text), params) in enumerate(zip(self.prompts, self.params)):
                self.streams.append(await engine.generate(ids, params, text, request_id=f"{self.id}-{p}"))
        except BaseException as exc:
            if isinstance(exc, QuickdraftError):
                exc.counted = True  # AsyncEngine.generate counted it in the metrics already
            self.close()
            raise

    def close(self) -> None:
        """Abort whatever has not finished (frees its KV blocks); a no-op for finished streams."""
        for s in self.streams:
            s.close()

    async def gather(self) -> list[Choice]:
        """Every choice, whole, in index order."""
        choices: dict[int, Choice] = {}
        async for p, chunk in self.chunks():
            idx = self.choice_index(p, chunk)
            c = choices.setdefault(idx, Choice(idx))
            c.text.append(chunk.text)
            if chunk.logprobs:
                c.logprobs.extend(chunk.logprobs)
            if chunk.prompt_logprobs is not None:
                c.prompt_logprobs = chunk.prompt_logprobs
            c.count(chunk)
        for c in choices.values():  # a prompt's first sample computed it for all of its samples
            c.prompt_logprobs = choices.get(c.index - c.index % self.n, c).prompt_logprobs
        return [choices[i] for i in sorted(choices)]

    async def gather_or_abort(self, request: Request) -> list[Choice]:
        """Wait for the outputs, aborting the engine requests if the client goes away first (ClientGone)."""
        return await self.wait_or_abort(self.gather(), request)

    async def wait_or_abort(self, reading: Coroutine[Any, Any, T], request: Request) -> T:
        """Run ``reading`` (what reads this job's streams), aborting the engine requests if the client goes away
        first (ClientGone)."""
        work = asyncio.ensure_future(reading)
        watcher = asyncio.ensure_future(_until_disconnect(request))
        try:
            await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not work.done():
                work.cancel()
                self.close()
            watcher.cancel()
        if not work.done() or work.cancelled():
            raise ClientGone()
        return work.result()


async def _until_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
