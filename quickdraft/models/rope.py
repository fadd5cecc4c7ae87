"""Rotary position tables: cos and sin of every position's angles, for plain RoPE and each scaling a checkpoint
may ask for (``config.RopeScaling``). The model and the C kernels read rows of these tables by position, so a
scaling is only a different table, and a token's rotation depends on its position alone, never on the batch."""
from __future__ import annotations

import math
import threading

import torch
from torch import nn

from quickdraft.config import RopeScaling
from quickdraft.models import native, triton_ops


def _inverse_frequencies(dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))


def _llama3(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """Llama 3.1: wavelengths longer than original/low_freq_factor are stretched by ``factor``, shorter than
    original/high_freq_factor kept, the band between blended (HF's ``_compute_llama3_parameters``)."""
    original = s.original_max_position_embeddings
    wavelength = 2 * math.pi / inv_freq
    scaled = torch.where(wavelength > original / s.low_freq_factor, inv_freq / s.factor, inv_freq)
    smooth = (original / wavelength - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    blended = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelength >= original / s.high_freq_factor) & (wavelength <= original / s.low_freq_factor)
    return torch.where(medium, blended, scaled)


def _yarn(inv_freq: torch.Tensor, dim: int, theta: float, s: RopeScaling) -> torch.Tensor:
    """YaRN (gpt-oss): frequencies that turn fewer than ``beta_slow`` times over the original context are divided by
    ``factor``, those that turn more than ``beta_fast`` times kept, a linear ramp between (HF's
    ``_compute_yarn_parameters``)."""
    original = s.original_max_position_embeddings

    def dimension(rotations: float) -> float:  # the dimension whose frequency turns ``rotations`` times
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dimension(s.beta_fast), dimension(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as HF: no division by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    kept = 1 - ramp  # the share of each frequency left as it is
    return inv_freq / s.factor * (1 - kept) + inv_freq * kept


def _angles(dim: int, theta: float, scaling: RopeScaling | None, pos: torch.Tensor) -> tuple[torch.Tensor, float]:
    """[len(pos), dim / 2] angles (float64) of positions ``pos`` and the factor cos and sin are scaled by."""
    inv_freq = _inverse_frequencies(dim, theta)
    kind = scaling.type if scaling is not None else "default"
    if kind == "default":
        return torch.outer(pos, inv_freq), 1.0
    if kind == "linear":
        return torch.outer(pos, inv_freq / scaling.factor), 1.0
    if kind == "llama3":
        return torch.outer(pos, _llama3(inv_freq, scaling)), 1.0
    if kind == "yarn":
        return torch.outer(pos, _yarn(inv_freq, dim, theta, scaling)), scaling.attention
    original = scaling.original_max_position_embeddings
    if kind == "dynamic":
        # HF raises the base from the length a forward reaches; position p is first computed in a forward of
        # length p + 1 when decoding, so each position gets the base of that length (plain up to the original)
        length = torch.clamp(pos + 1, min=original)
        f = scaling.factor
        bases = theta * ((f * length / original) - (f - 1)) ** (dim / (dim - 2))
        exponents = torch.arange(0, dim, 2, dtype=torch.float64) / dim
        return pos[:, None] / bases[:, None] ** exponents[None, :], 1.0
    # longrope: short factors up to the original context, long ones from there
    short = inv_freq / torch.tensor(scaling.short_factor, dtype=torch.float64)
    long = inv_freq / torch.tensor(scaling.long_factor, dtype=torch.float64)
    angles = torch.where((pos >= original)[:, None], torch.outer(pos, long), torch.outer(pos, short))
    return angles, scaling.attention


CHUNK = 4096  # positions computed at a time: the float64 intermediates stay small beside the float32 tables


def rope_tables(rotary_dim: int, theta: float, scaling: RopeScaling | None, positions: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 cos and sin, ``[positions, rotary_dim / 2]`` (rotate-half layout over the head's first ``rotary_dim``
    dims: entry i rotates dims i and i + rotary_dim / 2; frequencies from ``rotary_dim`` as HF's partial rotary
    computes them); ``ModelConfig`` has checked the settings (longrope: one factor per frequency)."""
    cos, sin = torch.empty(positions, rotary_dim // 2), torch.empty(positions, rotary_dim // 2)
    if rotary_dim == 0:
        return cos, sin
    for start in range(0, positions, CHUNK):
        pos = torch.arange(start, min(positions, start + CHUNK), dtype=torch.float64)
        angles, attention = _angles(rotary_dim, theta, scaling, pos)
        cos[start:start + len(pos)] = angles.cos() * attention
        sin[start:start + len(pos)] = angles.sin() * attention
    return cos, sin


class RotaryEmbedding(nn.Module):
    """Rotate-half (NeoX) layout, as HF stores q/k projections; a table row per position (``rope.py``). It rotates
    the first ``rotary_dim`` dims of each head (partial rotary; the kernels read that width off the tables); one of
    ``rotary_dim`` 0 leaves heads as they are (a layer without RoPE).

    The tables grow with the positions a forward reaches (``reach``), doubling, up to the engine's context (``limit``):
    Gemma 3 270M's two tables for its whole 32k context, 256-wide heads, are 64 MiB beside 270M parameters, and a
    short conversation needs a few hundred rows."""

    def __init__(self, head_dim: int, theta: float, max_positions: int, scaling: RopeScaling | None = None,
                 device: str | torch.device = "cpu", rotary_dim: int | None = None) -> None:
        super().__init__()
        self.head_dim, self.theta, self.scaling, self.max_positions = head_dim, theta, scaling, max_positions
        self.rotary_dim = head_dim if rotary_dim is None else rotary_dim
        self.device = torch.device(device)
        self._tables: tuple[torch.Tensor, torch.Tensor] | None = None  # float32 cos, sin [rows, rotary_dim / 2]
        self._grow = threading.Lock()
        self._rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # (positions, cos, sin)

    def limit(self, positions: int) -> None:
        """Keep rows for the first ``positions`` positions only (at most the model's own context)."""
        positions = min(positions, self.max_positions)
        if positions != self.max_positions:
            self.max_positions, self._tables, self._rows = positions, None, None

    def reach(self, end: int) -> None:
        """Rows for positions below ``end`` (at most ``max_positions``) from now on. Tables only ever grow (under a
        lock: run-ahead drafting shares the model between threads), so every thread keeps rows for the positions it
        reached itself whenever another grows them; a fused layer keeps the tables it was built on alive."""
        tables = self._tables
        if tables is not None and len(tables[0]) >= end:
            return
        with self._grow:
            tables = self._tables
            if tables is None or len(tables[0]) < end:
                rows = min(self.max_positions, max(end, 256, 2 * len(tables[0]) if tables is not None else 0))
                cos, sin = rope_tables(self.rotary_dim, self.theta, self.scaling, rows)
                self._tables = (cos.to(self.device), sin.to(self.device))

    def tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        self.reach(1)
        return self._tables

    @property
    def cos(self) -> torch.Tensor:
        return self.tables()[0]

    @property
    def sin(self) -> torch.Tensor:
        return self.tables()[1]

    def rows(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of ``positions`` as ``[T, 1, rotary_dim / 2]``, gathered once per step: every layer of a forward
        passes the same positions tensor (on a GPU each gather is a kernel launch, and decoding is launch-bound)."""
        cached = self._rows  # one read: threads that share the model (run-ahead self-drafting) each see a whole tuple
        if cached is None or cached[0] is not positions:
            cached = self._rows = (positions, self.cos[positions][:, None, :], self.sin[positions][:, None, :])
        return cached[1], cached[2]

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: [T, heads, head_dim]; may rotate x in place (x is a fresh projection output)."""
        if self.rotary_dim == 0:
            return x
        if native.runs_rope(x):
            cos, sin = self.tables()
            return native.rope_(x, positions, cos, sin)
        if triton_ops.runs_rope(x):
            cos, sin = self.tables()
            return triton_ops.rope_(x, positions, cos, sin)
        cos, sin = self.rows(positions)
        x1, x2, rest = x.float().split((self.rotary_dim // 2, self.rotary_dim // 2, self.head_dim - self.rotary_dim),
                                       dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest), dim=-1).to(x.dtype)

    def rotate_pair(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k rotated (maybe in place); in one call (one launch) where k's heads follow q's in one buffer."""
        t, heads, d = q.shape
        one_buffer = q.untyped_storage().data_ptr() == k.untyped_storage().data_ptr() and q.dtype == k.dtype
        if (one_buffer and k.shape[0] == t and k.shape[2] == d and q.stride() == k.stride() == (q.stride(0), d, 1)
                and k.data_ptr() == q.data_ptr() + heads * d * q.element_size()):
            qk = self(q.as_strided((t, heads + k.shape[1], d), q.stride()), positions)
            return qk[:, :heads], qk[:, heads:]
        return self(q, positions), self(k, positions)
