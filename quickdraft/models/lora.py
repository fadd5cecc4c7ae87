"""LoRA adapters applied at run time, several per model, chosen per sequence.

An adapter adds ``scale * B @ (A @ x)`` (A ``[r, in]``, B ``[out, r]``) to the output of some of a layer's linear
projections. The base weights are never changed, so one model serves its base and every adapter at once, in any
weight format: a forward's rows of the base model and of each adapter share the base projections' call, and each
adapter's rows get its low-rank term added after it (``LoraRows.add``), in the model's dtype.

A projection site is where quickdraft calls one projection, possibly several stacked (``qkv``: q, k and v side by
side; ``gate_up``: gate and up before the activation); an adapter's module is a column range of its site.
"""
from __future__ import annotations

import math
import reprlib
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from quickdraft.errors import InvalidParameterError, require_unicode

MAX_NAME_CHARS, MAX_MIXED, MAX_SCALE = 256, 64, 100.0
Mix = tuple[tuple[int, float], ...]  # (slot, scale) of each adapter a sequence runs; () for the base model alone

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

    def __init__(self, names: list[str], parts: dict[tuple[int, int, str], list[LoraPart]], sources: list[str]
                 ) -> None:
        """``parts``: by (slot, layer, site), the adapted modules of that site; ``sources``: where each adapter was
        read from."""
        self.names, self.parts, self.sources = list(names), parts, list(sources)

    def mix(self, choice: str | Mapping[str, float] | None) -> Mix:
        """A request's choice (an adapter's name, or names with scales; see ``check_choice``) as slots and scales,
        adapters of scale 0 left out. Raises KeyError for a name it does not serve."""
        if choice is None:
            return ()
        scales = {choice: 1.0} if isinstance(choice, str) else choice
        for name in scales:
            if name not in self.names:
                raise KeyError(name)
        return tuple((self.names.index(name) + 1, scale) for name, scale in sorted(scales.items()) if scale)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for parts in self.parts.values() for p in parts for t in (p.a, p.b))


def check_choice(value: object) -> str | dict[str, float] | None:
    """A request's adapters: None (the base model), an adapter's name, or ``{name: scale}`` (llama-server's per-request
    scales: each adapter's term times its scale, the terms summed). Raises InvalidParameterError."""
    allowed = (f"an adapter's name (1 to {MAX_NAME_CHARS} characters), or at most {MAX_MIXED} names with a scale "
               f"in [-{MAX_SCALE:g}, {MAX_SCALE:g}] each, or None")
    names = [value] if isinstance(value, str) else list(value) if isinstance(value, Mapping) else None
    if value is None:
        return None
    if names is None or len(names) > MAX_MIXED or not all(isinstance(n, str) and 0 < len(n) <= MAX_NAME_CHARS
                                                           for n in names):
        raise InvalidParameterError(f"lora must be {allowed}, got {reprlib.repr(value)}")
    for name in names:
        require_unicode("lora", name)
    if isinstance(value, str):
        return value
    scales = {}
    for name, scale in value.items():
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) \
                or abs(scale) > MAX_SCALE:
            raise InvalidParameterError(f"lora's scale of {name!r} must be a number in [-{MAX_SCALE:g}, "
                                        f"{MAX_SCALE:g}], got {reprlib.repr(scale)}")
        scales[name] = float(scale)
    return scales


class LoraRows:
    """Which rows of one forward's flat token vector run which adapters: per mix in the forward (the base's
    excepted), its rows as one slice where they are contiguous (no gather), else an index."""

    def __init__(self, weights: LoraWeights, groups: list[tuple[Mix, slice | torch.Tensor]]) -> None:
        self.weights, self.groups = weights, groups

    @classmethod
    def of(cls, weights: LoraWeights | None, mixes: list[Mix], lengths: list[int], device: torch.device
           ) -> LoraRows | None:
        """The rows of items of ``lengths`` tokens each, in order, running ``mixes``; None where every item runs the
        base model (the forward then takes its usual path: fused layers and all)."""
        if weights is None or not any(mixes):
            return None
        ranges: dict[Mix, list[tuple[int, int]]] = {}
        start = 0
        for mix, length in zip(mixes, lengths):
            if mix and length:
                spans = ranges.setdefault(mix, [])
                if spans and spans[-1][1] == start:
                    spans[-1] = (spans[-1][0], start + length)
                else:
                    spans.append((start, start + length))
            start += length
        groups: list[tuple[Mix, slice | torch.Tensor]] = []
        for mix, spans in ranges.items():
            if len(spans) == 1:
                groups.append((mix, slice(*spans[0])))
            else:
                groups.append((mix, torch.cat([torch.arange(a, b) for a, b in spans]).to(device)))
        return cls(weights, groups)

    def add(self, out: torch.Tensor, x: torch.Tensor, layer: int, site: str) -> torch.Tensor:
        """``out`` (the site's base output for the input ``x``, both ``[T, ...]``) with each adapter's term (times
        its scale) added to its rows, in place."""
        for mix, rows in self.groups:
            inputs = None
            for slot, scale in mix:
                for part in self.weights.parts.get((slot, layer, site), ()):
                    inputs = x[rows] if inputs is None else inputs
                    term = (inputs @ part.a.T) @ part.b.T
                    out[rows, part.offset:part.offset + part.b.shape[0]] += term if scale == 1.0 else term * scale
        return out
