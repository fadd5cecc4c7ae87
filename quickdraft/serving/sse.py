"""The one server-sent-event writer of both streaming endpoints (/v1/completions and /v1/chat/completions).

The endpoints differ only in what a chunk becomes inside its choice (text and completion logprobs, or a chat
delta and chat logprobs) and in the chat's opening events (one per choice, announcing the assistant's role);
each passes those as ``choice_fields`` (see ``openai_format.ChoiceFields``) and ``opening``. Usage, errors,
``[DONE]`` and aborting a stream whose client left are the same for both.
"""
from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator

from fastapi.responses import StreamingResponse

from quickdraft.serving.jobs import Job
from quickdraft.serving.openai_format import Choice, ChoiceFields, describe_error, usage

log = logging.getLogger("quickdraft.serving")

_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def stream_response(job: Job, head: dict, include_usage: bool, choice_fields: ChoiceFields,
                    opening: list[dict] | None = None, draft_info: bool = False) -> StreamingResponse:
    """``job``'s chunks as events that start with ``head``; ``opening``: choices sent before any chunk;
    ``draft_info``: each choice also carries ``draft_info`` (``stream_options.include_draft_info``)."""
    events = _events(job, head, include_usage, choice_fields, opening or [], draft_info)
    return StreamingResponse(events, media_type="text/event-stream", headers=_HEADERS)


async def _events(job: Job, head: dict, include_usage: bool, choice_fields: ChoiceFields,
                  opening: list[dict], draft_info: bool) -> AsyncIterator[str]:
    extra = {"usage": None} if include_usage else {}
    choices: dict[int, Choice] = {}
    try:
        for choice in opening:
            yield sse({**head, "choices": [choice], **extra})
        async for p, chunk in job.chunks():
            idx = job.choice_index(p, chunk)
            c = choices.setdefault(idx, Choice(idx))
            c.count(chunk)
            fields = choice_fields(p, idx, chunk)
            if fields is None:
                continue
            if draft_info:
                fields = {**fields, "draft_info": draft_spans(chunk, fields.get("text"), fields.get("delta"))}
            # fields may name their own finish_reason (a chat choice that ended in tool calls)
            yield sse({**head, "choices": [{"index": idx, "finish_reason": c.finish_reason, **fields}], **extra})
        if include_usage:
            yield sse({**head, "choices": [], "usage": usage(job.prompt_tokens, list(choices.values()), job.n)})
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001 - reported in the stream
        yield error_event(exc)
    finally:  # closed or cancelled early (client gone): abort what is unfinished
        job.close()
    yield sse("[DONE]")


def event_stream(events: AsyncIterator[str], job: Job) -> StreamingResponse:
    """Events another API writes for ``job`` (Responses, Anthropic Messages); whatever ends them early (the client
    left) aborts the job, which frees its KV blocks."""
    async def closing() -> AsyncIterator[str]:
        try:
            async for e in events:
                yield e
        finally:
            job.close()
    return StreamingResponse(closing(), media_type="text/event-stream", headers=_HEADERS)


def draft_spans(chunk, sent: str | None = None, delta: dict | None = None) -> dict:
    """The chunk's text cut by the token that wrote each piece, each marked whether that token was an accepted
    draft, and how many of its tokens were: what a page needs to colour speculation. ``sent``: the text the event
    carries when it starts with more than the chunk's (an echoed prompt: the target's, not a draft's). ``delta``: a
    chat event's; where its content is not the chunk's text (thinking read apart, a tool call held back), one span
    of that content, so the spans always spell what the event carries."""
    if delta is not None and delta.get("content", "") != chunk.text:
        content = delta.get("content", "")
        return {"spans": [{"text": content, "draft": False}] if content else [], "accepted": sum(chunk.from_draft)}
    prefix = sent[:len(sent) - len(chunk.text)] if sent and len(sent) > len(chunk.text) else ""
    spans, at = ([{"text": prefix, "draft": False}] if prefix else []), 0
    for chars, drafted in chunk.spans:
        spans.append({"text": chunk.text[at:at + chars], "draft": drafted})
        at += chars
    return {"spans": spans, "accepted": sum(chunk.from_draft)}


def sse(obj: dict | str) -> str:
    """One server-sent event: a JSON object (compact) or a bare string such as ``[DONE]``."""
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, separators=(',', ':'))}\n\n"


def error_event(exc: BaseException) -> str:
    """A failure after the 200 went out can only be told in the stream, as an OpenAI error body."""
    status, body = describe_error(exc)
    if status >= 500:
        log.error("request failed mid-stream: %s", exc)
    return sse(body)
