"""What the ingress hashes for routing: a request's prompt tokens, and once answered the conversation with the
answer (the prefix the next turn's prompt starts with), cut into the KV cache's chained block hashes."""
from __future__ import annotations

import json
from typing import Any

from quickdraft.kv.blocks import block_hash
from quickdraft.serving import anthropic_api, responses_api
from quickdraft.serving.protocol import ChatMessage

MAX_ANSWER_BYTES = 1 << 20  # a longer response is not read back for routing
CHAT_PATHS = ("/v1/chat/completions", "/v1/responses", "/v1/messages")  # the routes whose prompt is a conversation


def block_hashes(ids: list[int], block_size: int) -> list[bytes]:
    """The chained hashes of the full blocks a replica's prefix cache could hold for ``ids`` (as match_prefix)."""
    hashes, parent = [], b""
    for i in range((len(ids) - 1) // block_size):
        parent = block_hash(parent, ids[i * block_size:(i + 1) * block_size])
        hashes.append(parent)
    return hashes


def _messages(path: str, body: dict) -> list[dict]:
    """The request's messages as the server reads them (text parts joined, no content as ""), roles and text only;
    a Responses or Anthropic Messages body as the chat request it becomes (tools and calls left out: routing needs
    the leading text only)."""
    if path == "/v1/responses":
        system = [{"role": "system", "content": body["instructions"]}] if body.get("instructions") else []
        chat = system + responses_api.input_messages(body["input"], _AnyCall())
    elif path == "/v1/messages":
        chat = anthropic_api.chat_messages(anthropic_api.CountTokensRequest.model_validate(body))
    else:
        chat = body["messages"]
    return [{k: v for k, v in ChatMessage.model_validate(m).for_template().items() if k in ("role", "content", "name")}
            for m in chat if m.get("content") is not None]


class _AnyCall(set):
    """Every call id counts as known: routing hashes what the replica will check."""

    def __contains__(self, item: object) -> bool:
        return True


def prompt_ids(tokenizer: Any, path: str, body: dict, answer: str | None = None) -> list[int]:
    """The token ids the replica computes for the request's (first) prompt, as far as routing needs them; with
    ``answer``, the conversation continued by it."""
    if path in CHAT_PATHS:
        messages = _messages(path, body)
        if answer is None:
            return tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False)
        text = tokenizer.apply_chat_template(messages + [{"role": "assistant", "content": answer}],
                                             add_generation_prompt=False)
        return tokenizer.encode(text, add_special_tokens=False)
    prompt = body["prompt"]
    if isinstance(prompt, list):
        prompt = prompt[0] if prompt and not isinstance(prompt[0], int) else prompt
    if isinstance(prompt, list):
        return list(prompt) + (tokenizer.encode(answer, add_special_tokens=False) if answer else [])
    return tokenizer.encode(prompt + (answer or ""))


def answer_text(path: str, response: bytes, events: bool) -> str | None:
    """The first choice's text of a whole response or of a stream's events (None if it cannot be read)."""
    key = "message" if path == "/v1/chat/completions" else None
    try:
        if not events:
            choice = json.loads(response)["choices"][0]
            return choice[key]["content"] if key else choice["text"]
        parts = []
        for line in response.decode("utf-8", "replace").splitlines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[6:]).get("choices", []):
                if choice.get("index") == 0:
                    piece = choice.get("delta", {}).get("content") if key else choice.get("text")
                    parts.append(piece or "")
        return "".join(parts)
    except (ValueError, KeyError, IndexError, TypeError):
        return None
