"""Rotary position tables: cos and sin of every position's angles, for plain RoPE and each scaling a checkpoint
may ask for (``config.RopeScaling``). The model and the C kernels read rows of these tables by position, so a
scaling is only a different table, and a token's rotation depends on its position alone, never on the batch."""
from __future__ import annotations

import math

import torch

from quickdraft.config import RopeScaling


def _inverse_frequencies(head_dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))


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


def _yarn(inv_freq: torch.Tensor, head_dim: int, theta: float, s: RopeScaling) -> torch.Tensor:
    """YaRN (gpt-oss): frequencies that turn fewer than ``beta_slow`` times over the original context are divided by
    ``factor``, those that turn more than ``beta_fast`` times kept, a linear ramp between (HF's
    ``_compute_yarn_parameters``)."""
    original = s.original_max_position_embeddings

    def dimension(rotations: float) -> float:  # the dimension whose frequency turns ``rotations`` times
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dimension(s.beta_fast), dimension(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # as HF: no division by zero
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    kept = 1 - ramp  # the share of each frequency left as it is
    return inv_freq / s.factor * (1 - kept) + inv_freq * kept


def _angles(head_dim: int, theta: float, scaling: RopeScaling | None, pos: torch.Tensor) -> tuple[torch.Tensor, float]:
    """[len(pos), head_dim / 2] angles (float64) of positions ``pos`` and the factor cos and sin are scaled by."""
    inv_freq = _inverse_frequencies(head_dim, theta)
    kind = scaling.type if scaling is not None else "default"
    if kind == "default":
        return torch.outer(pos, inv_freq), 1.0
    if kind == "linear":
        return torch.outer(pos, inv_freq / scaling.factor), 1.0
    if kind == "llama3":
        return torch.outer(pos, _llama3(inv_freq, scaling)), 1.0
    if kind == "yarn":
        return torch.outer(pos, _yarn(inv_freq, head_dim, theta, scaling)), scaling.attention
    original = scaling.original_max_position_embeddings
    if kind == "dynamic":
        # HF raises the base from the length a forward reaches; position p is first computed in a forward of
        # length p + 1 when decoding, so each position gets the base of that length (plain up to the original)
        length = torch.clamp(pos + 1, min=original)
        f = scaling.factor
        bases = theta * ((f * length / original) - (f - 1)) ** (head_dim / (head_dim - 2))
        exponents = torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim
        return pos[:, None] / bases[:, None] ** exponents[None, :], 1.0
    # longrope: short factors up to the original context, long ones from there
    short = inv_freq / torch.tensor(scaling.short_factor, dtype=torch.float64)
    long = inv_freq / torch.tensor(scaling.long_factor, dtype=torch.float64)
    angles = torch.where((pos >= original)[:, None], torch.outer(pos, long), torch.outer(pos, short))
    return angles, scaling.attention


CHUNK = 4096  # positions computed at a time: the float64 intermediates stay small beside the float32 tables


def rope_tables(head_dim: int, theta: float, scaling: RopeScaling | None, positions: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 cos and sin, ``[positions, head_dim / 2]`` (rotate-half layout: entry i rotates dims i and i + D/2);
    ``ModelConfig`` has checked the settings (longrope: one factor per frequency)."""
    cos, sin = torch.empty(positions, head_dim // 2), torch.empty(positions, head_dim // 2)
    for start in range(0, positions, CHUNK):
        pos = torch.arange(start, min(positions, start + CHUNK), dtype=torch.float64)
        angles, attention = _angles(head_dim, theta, scaling, pos)
        cos[start:start + len(pos)] = angles.cos() * attention
        sin[start:start + len(pos)] = angles.sin() * attention
    return cos, sin
