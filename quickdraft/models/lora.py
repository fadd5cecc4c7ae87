"""LoRA adapters applied at run time, several per model, chosen per sequence.

An adapter adds ``scale * B @ (A @ x)`` (A ``[r, in]``, B ``[out, r]``) to the output of some of a layer's linear
projections. The base weights are never changed, so one model serves its base and every adapter at once, in any
weight format: a forward's rows of the base model and of each adapter share the base projections' call, and each
adapter's rows get its low-rank term added after it (``LoraRows.add``: summed in float32, added to the output once).

A projection site is where quickdraft calls one projection, possibly several stacked (``qkv``: q, k and v side by
side; ``gate_up``: gate and up before the activation); an adapter's module is a column range of its site.
"""
from __future__ import annotations

import ctypes
import math
import reprlib
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from quickdraft.errors import InvalidParameterError, require_unicode
from quickdraft.models import native

MAX_NAME_CHARS, MAX_MIXED, MAX_SCALE = 256, 64, 100.0
MAX_CACHED_MIXES = 512  # (more than a step's sequences: a step's mixes never evict each other)
Mix = tuple[tuple[int, float], ...]  # (slot, scale) of each adapter a sequence runs; () for the base model alone

SITES = ("qkv", "o", "gate_up", "down")  # a layer's projection sites, in qd_lora_site's order (layer.c)
# a target module's site (where in it: loading/lora.py's _offset)
MODULE_SITES = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "o_proj": "o", "gate_proj": "gate_up",
                "up_proj": "gate_up", "down_proj": "down"}


@dataclass(frozen=True)
class LoraPart:
    """One adapted module: its A ``[r, in]`` and its B already scaled, transposed ``[r, out]`` (float32), and the
    first column of its output in its site's output."""

    offset: int
    a: torch.Tensor
    bt: torch.Tensor


class SiteCall:
    """One site's parts of a mix of adapters, each with its adapter's scale, ready for ``native.lora_add`` (the
    adapters' own tensors: no copy per mix)."""

    def __init__(self, parts: list[tuple[LoraPart, float]]) -> None:
        self.parts = parts
        n = len(parts)
        ints = ctypes.c_int * n
        self.arrays = (n, ints(*[p.offset for p, _ in parts]), ints(*[p.a.shape[0] for p, _ in parts]),
                       ints(*[p.bt.shape[1] for p, _ in parts]), (ctypes.c_float * n)(*[s for _, s in parts]),
                       (ctypes.c_void_p * n)(*[p.a.data_ptr() for p, _ in parts]),
                       (ctypes.c_void_p * n)(*[p.bt.data_ptr() for p, _ in parts]))

    def add(self, out: torch.Tensor, x: torch.Tensor, rows: slice | torch.Tensor) -> None:
        """``out[rows] += scale B (A x[rows])`` of every part, in place: on the CPU by ``qd_lora_add`` (a row's bits
        never depend on the rows beside it), elsewhere by torch in float32."""
        if native.runs_lora(out, x):
            if isinstance(rows, slice):
                native.lora_add(out[rows], x[rows], None, self.arrays)
            else:
                native.lora_add(out, x, rows, self.arrays)
            return
        inputs = x[rows].float()
        for part, scale in self.parts:
            end = part.offset + part.bt.shape[1]
            out[rows, part.offset:end] += ((inputs @ part.a.T * scale) @ part.bt).to(out.dtype)


class _Site(ctypes.Structure):  # qd_lora_site (layer.c)
    _fields_ = [("nparts", ctypes.c_int), ("offsets", ctypes.c_void_p), ("ranks", ctypes.c_void_p),
                ("outs", ctypes.c_void_p), ("scales", ctypes.c_void_p), ("a", ctypes.c_void_p),
                ("bt", ctypes.c_void_p)]


class _Lora(ctypes.Structure):  # qd_lora (layer.c)
    _fields_ = [("ngroups", ctypes.c_int), ("rows", ctypes.c_void_p), ("nrows", ctypes.c_void_p),
                ("sites", ctypes.c_void_p)]


class LoraWeights:
    """The adapters a model serves. Slot 0 is the base model; adapter ``i`` of ``names`` is slot ``i + 1``."""

    def __init__(self, names: list[str], parts: dict[tuple[int, int, str], list[LoraPart]], sources: list[str],
                 layers: int) -> None:
        """``parts``: by (slot, layer, site), the adapted modules of that site; ``sources``: where each adapter was
        read from; ``layers``: the model's decoder layers."""
        self.names, self.parts, self.sources, self.layers = list(names), parts, list(sources), layers
        self._calls: OrderedDict[Mix, dict[tuple[int, str], SiteCall | None]] = OrderedDict()

    def mix(self, choice: str | Mapping[str, float]) -> Mix:
        """A request's choice (an adapter's name, or names with scales, each one it serves; see ``check_choice``) as
        slots and scales, adapters of scale 0 left out."""
        scales = {choice: 1.0} if isinstance(choice, str) else choice
        return tuple((self.names.index(name) + 1, scale) for name, scale in sorted(scales.items()) if scale)

    def site_call(self, mix: Mix, layer: int, site: str) -> SiteCall | None:
        """The parts ``mix`` adds at a layer's site (each B scaled by its adapter's scale), made on first use; the
        calls of the MAX_CACHED_MIXES mixes used last are kept."""
        calls = self._calls.get(mix)
        if calls is None:
            calls = self._calls[mix] = {}
            while len(self._calls) > MAX_CACHED_MIXES:
                self._calls.popitem(last=False)
        else:
            self._calls.move_to_end(mix)
        key = (layer, site)
        if key not in calls:
            parts = [(p, scale) for slot, scale in mix for p in self.parts.get((slot, layer, site), ())]
            calls[key] = SiteCall(parts) if parts else None
        return calls[key]

    def site_table(self, mix: Mix, layers: int) -> tuple[ctypes.Array, list[SiteCall | None]]:
        """``mix``'s sites of layers 0 .. ``layers`` - 1 as the fused layer reads them (4 a layer: qkv, o, gate_up,
        down), and the calls whose arrays it points into (whoever holds the table holds them); made on first use and
        kept with the mix's calls."""
        calls = self._calls.get(mix)
        table = calls.get(("table", layers)) if calls is not None else None
        if table is not None:
            self._calls.move_to_end(mix)
        else:
            held = [self.site_call(mix, layer, site) for layer in range(layers) for site in SITES]
            sites = [_Site(0) if call is None else _Site(call.arrays[0], *map(ctypes.addressof, call.arrays[1:]))
                     for call in held]
            table = ((_Site * len(sites))(*sites), held)
            self._calls[mix][("table", layers)] = table
        return table


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
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not abs(scale) <= MAX_SCALE:
            raise InvalidParameterError(f"lora's scale of {name!r} must be a number in [-{MAX_SCALE:g}, "
                                        f"{MAX_SCALE:g}], got {reprlib.repr(scale)}")
        scales[name] = float(scale)
    return scales


class LoraRows:
    """Which rows of one forward's flat token vector run which adapters: per mix in the forward (the base's
    excepted), its rows as one slice where they are contiguous (no gather), else an index."""

    def __init__(self, weights: LoraWeights, groups: list[tuple[Mix, slice | torch.Tensor]]) -> None:
        self.weights, self.groups = weights, groups
        self._fused: tuple | None = None

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

    def fused(self) -> object:
        """The groups as the fused layers take them (``qd_lora``, every layer of the model); made once per forward."""
        if self._fused is None:
            layers = self.weights.layers
            rows = [torch.arange(r.start, r.stop) if isinstance(r, slice) else r.to(torch.int64).contiguous()
                    for _, r in self.groups]
            tables = [self.weights.site_table(mix, layers) for mix, _ in self.groups]
            n = len(self.groups)
            arrays = ((ctypes.c_void_p * n)(*[r.data_ptr() for r in rows]), (ctypes.c_int * n)(*map(len, rows)),
                      (ctypes.c_void_p * n)(*[ctypes.addressof(table) for table, _ in tables]))
            desc = _Lora(n, *[ctypes.addressof(a) for a in arrays])
            self._fused = (ctypes.byref(desc), desc, rows, tables, arrays)
        return self._fused[0]

    def add(self, out: torch.Tensor, x: torch.Tensor, layer: int, site: str) -> torch.Tensor:
        """``out`` (the site's base output for the input ``x``, both ``[T, ...]``) with each adapter's term (times
        its scale) added to its rows, in place."""
        for mix, rows in self.groups:
            call = self.weights.site_call(mix, layer, site)
            if call is not None:
                call.add(out, x, rows)
        return out
