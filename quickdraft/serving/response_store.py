"""The conversations ``/v1/responses`` can continue by ``previous_response_id``: kept in memory, bounded."""
from __future__ import annotations

import collections
import json
import reprlib

from quickdraft.serving.errors import NotFoundError


class ResponseStore:
    """The last responses' turns (input messages and output), each pointing at the one it continued: a
    conversation is rebuilt by walking back. Bounded by count and by the characters kept (Python holds a few times
    that in memory); the oldest go first."""

    def __init__(self, max_responses: int = 1024, max_chars: int = 16 << 20) -> None:
        self.max_responses, self.max_chars = max_responses, max_chars
        self._turns: collections.OrderedDict[str, tuple[str | None, list[dict], int]] = collections.OrderedDict()
        self._chars = 0

    def put(self, response_id: str, previous: str | None, messages: list[dict]) -> None:
        size = len(json.dumps(messages, ensure_ascii=False))
        if size > self.max_chars:
            return
        self._turns[response_id] = (previous, messages, size)
        self._chars += size
        while len(self._turns) > self.max_responses or self._chars > self.max_chars:
            _, (_, _, old) = self._turns.popitem(last=False)
            self._chars -= old

    def conversation(self, response_id: str) -> list[dict]:
        """The messages up to and including ``response_id``'s output; 404 if any turn of it is gone."""
        turns, at = [], response_id
        while at is not None:
            turn = self._turns.get(at)
            if turn is None:
                raise PreviousResponseNotFound(
                    f"Previous response with id '{reprlib.repr(at)[1:-1]}' not found: this server keeps the last "
                    f"{self.max_responses} responses in memory (not those sent with store: false); send the whole "
                    "conversation as input instead")
            turns.append(turn[1])
            at = turn[0]
        return [m for messages in reversed(turns) for m in messages]


class PreviousResponseNotFound(NotFoundError):
    def __init__(self, message: str) -> None:
        super().__init__(message, "previous_response_id", "previous_response_not_found")
