"""Error types users can catch. Every message says what was wrong and what is allowed."""


class QuickdraftError(Exception):
    """Base class for errors raised by quickdraft."""


class InvalidParameterError(QuickdraftError, ValueError):
    """A sampling or engine parameter is out of its allowed range."""


class ModelLoadError(QuickdraftError, ValueError):
    """A model file or directory cannot be loaded (missing, corrupt, unsupported)."""


class PromptTooLongError(QuickdraftError, ValueError):
    """A prompt does not fit in the model's context window."""


class SessionError(QuickdraftError, ValueError):
    """A session snapshot cannot be saved or resumed (missing, damaged, or made with other models/options)."""
