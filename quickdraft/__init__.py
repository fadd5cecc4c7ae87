"""quickdraft: LLM inference built around exact speculative decoding."""
from quickdraft.engine.outputs import CompletionOutput, RequestOutput, StreamChunk
from quickdraft.errors import InvalidParameterError, ModelLoadError, PromptTooLongError, QuickdraftError, SessionError
from quickdraft.llm import LLM
from quickdraft.sampling import SamplingParams
from quickdraft.session import Session

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "StreamChunk", "QuickdraftError",
           "InvalidParameterError", "ModelLoadError", "PromptTooLongError", "Session", "SessionError"]
