"""A token embedding that reads the rows a forward looks up from the file's own blocks.

A step looks up one row per token, so the table need not exist in float: Gemma 2's 256,000 x 2,304 table is 0.46 GB
of Q6_K blocks in its GGUF and would be 1.2 GB more in bfloat16 (2.4 GB in float32) in every converted-weight cache
entry. The rows are dequantized when read, by the same code that would have dequantized the whole table, so they
are the same bits.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


class BlockEmbedding(nn.Module):
    """``nn.Embedding``'s lookup over a table held elsewhere: ``rows_of(ids)`` gives the rows of the unique ids
    ``[n]`` as ``[n, embedding_dim]`` in the activations' dtype."""

    def __init__(self, rows_of: Callable[[torch.Tensor], torch.Tensor], num_embeddings: int,
                 embedding_dim: int) -> None:
        super().__init__()
        self.rows_of = rows_of
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if tokens.numel() and not 0 <= int(tokens.min()) <= int(tokens.max()) < self.num_embeddings:
            raise IndexError(f"token ids must be in 0..{self.num_embeddings - 1}")
        unique, inverse = torch.unique(tokens, return_inverse=True)
        rows = self.rows_of(unique.cpu())
        return rows.to(tokens.device)[inverse]

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, rows read from the file's blocks"
