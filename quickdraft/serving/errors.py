"""The server's own errors: why a request could not run or finish, each mapped to one HTTP status by
:func:`quickdraft.serving.openai_format.describe_error`."""
from __future__ import annotations

from quickdraft.errors import InvalidParameterError, QuickdraftError


class EngineError(QuickdraftError, RuntimeError):
    """The engine failed while generating this request (an internal bug, not the request's fault)."""


class EngineStoppedError(EngineError):
    """The server is shutting down."""


class EngineDeadError(EngineStoppedError):
    """The engine failed as a whole (not one request): it accepts no more requests and /health says so."""


class QueueFullError(QuickdraftError):
    """The server's queue of waiting requests is full: the client should retry later."""


class RequestTimeoutError(QuickdraftError):
    """The request ran longer than the server's per-request timeout and was aborted."""


class NotFoundError(QuickdraftError, LookupError):
    """A request names something this server does not have (404): ``param`` names the field, ``code`` the case."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param, self.code = param, code


def invalid_parameter(message: str, param: str | None = None, code: str | None = None) -> InvalidParameterError:
    """A 400 error that names the offending field (``param``) and, where OpenAI has one, its ``code``."""
    err = InvalidParameterError(message)
    err.param, err.code = param, code
    return err
