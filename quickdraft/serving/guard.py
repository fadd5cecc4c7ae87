"""What the server lets in: its limits, the API key and the request-body cap (pure ASGI, before any route runs).

Every refusal is an OpenAI-shaped error body, so clients report it as they report any API error.
"""
from __future__ import annotations

import hmac
import json
import os
from dataclasses import dataclass

API_KEY_ENV = "QUICKDRAFT_API_KEY"
OPEN_PATHS = ("/health", "/metrics")  # probes and scrapers need no key (as vLLM)


@dataclass
class ServerLimits:
    """How much one client may ask of the server (flag names follow vLLM's where it has them)."""

    api_key: str | None = None  # Bearer key every route but OPEN_PATHS requires; None: no key
    max_body_bytes: int = 16 << 20  # 413 past this: a body is read into memory before it is parsed
    max_waiting_requests: int | None = 256  # 429 while this many sequences wait to start
    request_timeout_s: float | None = 600.0  # a request running longer is aborted (504 or an error event)
    max_prompts_per_request: int = 64  # /v1/completions with a list of prompts
    max_queued_chunks: int = 64  # unread chunks per request before new ones are merged into them
    retry_after_s: int = 1  # the Retry-After of a 429
    max_stored_responses: int = 1024  # /v1/responses kept for previous_response_id (the oldest evicted first)
    max_prompt_logprobs: int = 2_000_000  # prompt logprobs one response may carry (about 150 MB of JSON)

    def __post_init__(self) -> None:
        if self.api_key is not None and not self.api_key:
            raise ValueError(f"the API key (--api-key or ${API_KEY_ENV}) must not be empty; leave both unset for no key")
        for name in ("max_body_bytes", "max_prompts_per_request", "max_queued_chunks", "retry_after_s",
                     "max_stored_responses", "max_prompt_logprobs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_waiting_requests is not None and self.max_waiting_requests < 1:
            raise ValueError(f"max_waiting_requests must be >= 1 or None, got {self.max_waiting_requests}")
        if self.request_timeout_s is not None and not self.request_timeout_s > 0:
            raise ValueError(f"request_timeout_s must be > 0 or None, got {self.request_timeout_s}")

    @classmethod
    def with_env_key(cls, api_key: str | None = None, **kwargs) -> "ServerLimits":
        """``api_key``, else $QUICKDRAFT_API_KEY when set. An empty key is refused, never taken as "no key": an unset
        shell variable in a deployment must not open the server."""
        return cls(api_key=api_key if api_key is not None else os.environ.get(API_KEY_ENV), **kwargs)


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
                   429: "rate_limit_error", 503: "overloaded_error"}


def speaks_anthropic(path: str) -> bool:
    """Routes of Anthropic's Messages API answer errors in its shape."""
    return path == "/v1/messages" or path.startswith("/v1/messages/")


def anthropic_error_body(status: int, message: str) -> dict:
    return {"type": "error", "error": {"type": ANTHROPIC_TYPES.get(status, "api_error"), "message": message}}


def shaped_error_body(path: str, status: int, body: dict) -> dict:
    """An OpenAI-shaped error body in the shape the route's API uses."""
    return anthropic_error_body(status, body["error"]["message"]) if speaks_anthropic(path) else body


async def _send_error(send, path: str, status: int, message: str, type_: str, code: str | None,
                      headers: list[tuple[bytes, bytes]] = ()) -> None:
    body = json.dumps(shaped_error_body(path, status, error_body(message, type_, code=code))).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": body})


class GuardMiddleware:
    """Checks the API key, then reads the body up to the cap (413 beyond it, before the app parses anything)."""

    def __init__(self, app, limits: ServerLimits, on_refused=None, open_paths: tuple[str, ...] = OPEN_PATHS) -> None:
        """``open_paths``: what needs no key (the probes, and the chat page's files, which hold no secret)."""
        self.app, self.limits, self.open_paths = app, limits, open_paths
        self.on_refused = on_refused or (lambda status: None)
        self._key = limits.api_key.encode() if limits.api_key else None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self._key is not None and scope["path"] not in self.open_paths and not self._authorized(scope):
            self.on_refused(401)
            await _send_error(send, scope["path"], 401, "Incorrect or missing API key: send it as the header "
                              "'Authorization: Bearer <key>' or 'x-api-key: <key>'", "authentication_error",
                              "invalid_api_key",
                              [(b"www-authenticate", b"Bearer")])
            return
        if scope["method"] in ("POST", "PUT", "PATCH"):
            receive = await self._buffered(scope, receive, send)
            if receive is None:
                return
        await self.app(scope, receive, send)

    def _authorized(self, scope) -> bool:
        """A Bearer token (OpenAI's clients) or an ``x-api-key`` header (Anthropic's) equal to the key."""
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self._key):
                    return True
            elif name == b"x-api-key" and hmac.compare_digest(value.strip(), self._key):
                return True
        return False

    async def _buffered(self, scope, receive, send):
        """The whole body (at most the cap), replayed to the app; then the client's own messages (disconnects)."""
        cap = self.limits.max_body_bytes
        for name, value in scope.get("headers", ()):
            if name == b"content-length" and value.isdigit() and int(value) > cap:
                await self._too_large(send, scope["path"], cap)
                return None
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > cap:
                await self._too_large(send, scope["path"], cap)
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        replay = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replayed():
            return replay.pop() if replay else await receive()
        return replayed

    async def _too_large(self, send, path: str, cap: int) -> None:
        self.on_refused(413)
        await _send_error(send, path, 413, f"the request body is larger than this server accepts ({cap:,} bytes, "
                          f"--max-request-body-bytes)", "invalid_request_error", "request_too_large")
