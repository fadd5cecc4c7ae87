"""quickdraft: LLM inference built around exact speculative decoding."""
from quickdraft.engine.outputs import CompletionOutput, RequestOutput, StreamChunk
from quickdraft.errors import InvalidParameterError, ModelLoadError, PromptTooLongError, QuickdraftError, SessionError
from quickdraft.llm import LLM
from quickdraft.sampling import SamplingParams, StructuredOutputs
from quickdraft.session import Session

__all__ = ["LLM", "SamplingParams", "StructuredOutputs", "RequestOutput", "CompletionOutput", "StreamChunk", "QuickdraftError",
           "InvalidParameterError", "ModelLoadError", "PromptTooLongError", "Session", "SessionError"]
