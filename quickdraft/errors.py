"""Error types users can catch. Every message says what was wrong and what is allowed."""


class QuickdraftError(Exception):
    """Base class for errors raised by quickdraft."""


class InvalidParameterError(QuickdraftError, ValueError):
    """A sampling or engine parameter is out of its allowed range."""


class ModelLoadError(QuickdraftError, ValueError):
    """A model file or directory cannot be loaded (missing, corrupt, unsupported)."""


class PromptTooLongError(QuickdraftError, ValueError):
    """A prompt does not fit in the model's context window."""


class RequestFailedError(QuickdraftError, RuntimeError):
    """Generating one request raised (a bug, not a bad parameter); the requests beside it were not affected.

    ``outputs`` holds every request's output of the call that raised it (``LLM.generate``), the failed ones with
    finish_reason "error", so no finished result is lost."""

    def __init__(self, message: str, outputs: list | None = None) -> None:
        super().__init__(message)
        self.outputs = outputs or []


class SessionError(QuickdraftError, ValueError):
    """A session snapshot cannot be saved or resumed (missing, damaged, or made with other models/options)."""


def require_unicode(name: str, text: str) -> None:
    """Refuse text with a lone surrogate (JSON's "\\ud800" decodes to one): it has no UTF-8 bytes to tokenize."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidParameterError(
            f"{name} must be valid Unicode text, got a lone surrogate {text[exc.start]!r} at character {exc.start}"
        ) from None
