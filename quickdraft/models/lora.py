"""LoRA adapters applied at run time, several per model, chosen per sequence.

An adapter adds ``scale * B @ (A @ x)`` (A ``[r, in]``, B ``[out, r]``) to the output of some of a layer's linear
projections. The base weights are never changed, so one model serves its base and every adapter at once, in any
weight format: a forward's rows of the base model and of each adapter share the base projections' call, and each
adapter's rows get its low-rank term added after it (``LoraRows.add``), in the model's dtype.

A projection site is where quickdraft calls one projection, possibly several stacked (``qkv``: q, k and v side by
side; ``gate_up``: gate and up before the activation); an adapter's module is a column range of its site.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

# a target module's site, and which of the site's stacked outputs it is
MODULE_SITES = {"q_proj": ("qkv", 0), "k_proj": ("qkv", 1), "v_proj": ("qkv", 2), "o_proj": ("o", 0),
                "gate_proj": ("gate_up", 0), "up_proj": ("gate_up", 1), "down_proj": ("down", 0)}


@dataclass(frozen=True)
class LoraPart:
    """One adapted module: its A ``[r, in]``, its B already scaled ``[out, r]``, and the first column of its output
    in its site's output."""

    offset: int
    a: torch.Tensor
    b: torch.Tensor


class LoraWeights:
    """The adapters a model serves. Slot 0 is the base model; adapter ``i`` of ``names`` is slot ``i + 1``."""

    def __init__(self, names: list[str], parts: dict[tuple[int, int, str], list[LoraPart]]) -> None:
        """``parts``: by (slot, layer, site), the adapted modules of that site."""
        self.names = list(names)
        self.parts = parts

    def slot(self, name: str | None) -> int:
        """The slot of the adapter called ``name`` (0 for None: the base model)."""
        if name is None:
            return 0
        if name not in self.names:
            raise KeyError(name)
        return self.names.index(name) + 1

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for parts in self.parts.values() for p in parts for t in (p.a, p.b))


class LoraRows:
    """Which rows of one forward's flat token vector run which adapter: per slot in the forward (the base's
    excepted), its rows as one slice where they are contiguous (no gather), else an index."""

    def __init__(self, weights: LoraWeights, groups: list[tuple[int, slice | torch.Tensor]]) -> None:
        self.weights, self.groups = weights, groups

    @classmethod
    def of(cls, weights: LoraWeights | None, slots: list[int], lengths: list[int], device: torch.device
           ) -> LoraRows | None:
        """The rows of items of ``lengths`` tokens each, in order, running ``slots``; None where every item runs the
        base model (the forward then takes its usual path: fused layers and all)."""
        if weights is None or not any(slots):
            return None
        ranges: dict[int, list[tuple[int, int]]] = {}
        start = 0
        for slot, length in zip(slots, lengths):
            if slot and length:
                spans = ranges.setdefault(slot, [])
                if spans and spans[-1][1] == start:
                    spans[-1] = (spans[-1][0], start + length)
                else:
                    spans.append((start, start + length))
            start += length
        groups: list[tuple[int, slice | torch.Tensor]] = []
        for slot, spans in ranges.items():
            if len(spans) == 1:
                groups.append((slot, slice(*spans[0])))
            else:
                groups.append((slot, torch.cat([torch.arange(a, b) for a, b in spans]).to(device)))
        return cls(weights, groups)

    def add(self, out: torch.Tensor, x: torch.Tensor, layer: int, site: str) -> torch.Tensor:
        """``out`` (the site's base output for the input ``x``, both ``[T, ...]``) with each adapter's term added to
        its rows, in place."""
        for slot, rows in self.groups:
            parts = self.weights.parts.get((slot, layer, site))
            if not parts:
                continue
            inputs = x[rows]
            for part in parts:
                end = part.offset + part.b.shape[0]
                out[rows, part.offset:end] += (inputs @ part.a.T) @ part.b.T
        return out
