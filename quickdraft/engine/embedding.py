"""Embeddings from the loaded model: each input's final hidden states pooled, read in batches the size of the
engine's token budget (``batch_calls``). ``LLM.embed`` runs them in the caller's thread; the server runs each batch
between two engine steps (``serving/extra_routes.py``), so generation never waits for more than one batch."""
from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from quickdraft.errors import InvalidParameterError
from quickdraft.kv.runner import ModelRunner

POOLINGS = ("last", "mean")


@dataclass(frozen=True)
class EmbeddingOptions:
    """``pooling``: "last" (the last token's hidden state: in a causal model the only position that has seen the
    whole input, and what decoder embedding models such as Qwen3-Embedding are trained to pool) or "mean";
    ``normalize``: scaled to unit length, so a dot product is the cosine similarity."""

    pooling: str = "last"
    normalize: bool = True

    def __post_init__(self) -> None:
        if self.pooling not in POOLINGS:
            raise InvalidParameterError(f"pooling must be one of {', '.join(POOLINGS)}, got {self.pooling!r}")
        if not isinstance(self.normalize, bool):
            raise InvalidParameterError(f"normalize must be true or false, got {self.normalize!r}")


def check_inputs(token_lists: list[list[int]], vocab_size: int, max_model_len: int) -> None:
    """Every input non-empty, within the context, with ids the model knows: refused before any model work."""
    for i, ids in enumerate(token_lists):
        if not ids:
            raise InvalidParameterError(f"input[{i}] is empty: each input needs at least one token")
        if len(ids) > max_model_len:
            raise InvalidParameterError(f"input[{i}] has {len(ids)} tokens but this model's maximum context length "
                                        f"is {max_model_len} tokens")
        bad = next((t for t in ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise InvalidParameterError(f"input[{i}] holds the token id {bad}, outside this model's vocabulary "
                                        f"0..{vocab_size - 1}")


def batches(token_lists: list[list[int]], budget: int) -> list[list[int]]:
    """Indices of the inputs read together: consecutive inputs up to ``budget`` tokens (a longer one alone)."""
    out: list[list[int]] = []
    used = budget
    for i, ids in enumerate(token_lists):
        if used + len(ids) > budget:
            out.append([])
            used = 0
        out[-1].append(i)
        used += len(ids)
    return out


def embed_batch(runner: ModelRunner, token_lists: list[list[int]], options: EmbeddingOptions,
                chunk: int) -> torch.Tensor:
    """The pooled (and normalized) embeddings of one batch, ``[n, hidden]`` float32 on the CPU."""
    out = runner.embed(token_lists, options.pooling, chunk)
    if options.normalize:
        out = torch.nn.functional.normalize(out, dim=-1)
    return out.cpu()


def batch_calls(runner: ModelRunner, token_lists: list[list[int]], options: EmbeddingOptions,
                budget: int) -> list[tuple[list[int], Callable[[], torch.Tensor]]]:
    """The work of embedding ``token_lists``: per batch, the indices of its inputs and the call that reads it."""
    return [(batch, functools.partial(embed_batch, runner, [token_lists[i] for i in batch], options, budget))
            for batch in batches(token_lists, budget)]
