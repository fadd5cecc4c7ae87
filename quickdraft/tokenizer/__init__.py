"""Tokenizer layer: text <-> token ids, streaming detokenization and chat templates.

Sits below `quickdraft.loading` and must not import it: GGUF metadata arrives as a plain dict.
"""
from quickdraft.tokenizer.chat import CHATML_TEMPLATE, ChatTemplateError, render_chat_template, validate_messages
from quickdraft.tokenizer.detokenizer import StreamingDetokenizer
from quickdraft.tokenizer.gguf_vocab import PRE_TOKENIZERS, SUPPORTED_TOKENIZER_MODELS
from quickdraft.tokenizer.tokenizer import Tokenizer

__all__ = [
    "CHATML_TEMPLATE",
    "ChatTemplateError",
    "PRE_TOKENIZERS",
    "SUPPORTED_TOKENIZER_MODELS",
    "StreamingDetokenizer",
    "Tokenizer",
    "render_chat_template",
    "validate_messages",
]
