"""The samplers that keep part of the vocabulary, row by row: top_n_sigma, top-k, typical_p, top-p, min-p (masked
entries become -inf), then XTC.

llama.cpp's order of these (top-n-sigma, top-k, typical, top-p, min-p, XTC), with the temperature first as vLLM
applies it, or last as llama-server's default chain does (``SamplingParams.temperature_last``: the cuts and XTC's
choice of tokens read the untempered distribution, which is then tempered). Each row's result depends on that row alone, so plain sampling and every row of a verification see the
same distribution. XTC is random in llama.cpp (a coin each step): here a row becomes the mixture it samples from,
so a draft is verified against the distribution plain sampling draws from.
"""
from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from quickdraft.sampling.params import SamplingParams

NEG_INF = float("-inf")
# top-p first looks for its cut among this many most probable tokens (full sort if not found).
_TOP_P_CANDIDATES = 1024


def truncate(x: Tensor, p: SamplingParams, temper: Callable[[Tensor], Tensor] | None = None) -> Tensor:
    """``x`` [n, V] logits -> the same with the truncations of ``p`` applied; ``temper``: the temperature, applied
    after the cuts (llama.cpp's default chain) where given, else already applied to ``x`` (vLLM's order)."""
    width = x.shape[-1]
    if p.top_n_sigma > 0:
        x = top_n_sigma(x, p.top_n_sigma)
    if 0 < p.top_k < width:
        # Ties with the k-th value are kept (deterministic, as vLLM).
        kth = torch.topk(x, p.top_k, dim=-1).values[:, -1:]
        x = x.masked_fill(x < kth, NEG_INF)
    if p.typical_p < 1.0:
        x = typical(x, p.typical_p)
    if p.top_p < 1.0:
        x = top_p(x, p.top_p, p.top_k)
    if p.min_p > 0.0:
        # prob >= min_p * max_prob  <=>  logit >= max_logit + log(min_p)
        top = x.amax(dim=-1, keepdim=True)
        x = x.masked_fill(x < top + math.log(p.min_p), NEG_INF)
    chosen_by = x
    if temper is not None:
        x = temper(x)
    if p.xtc_probability > 0 and p.xtc_threshold <= 0.5:
        x = xtc_mixture(x, p.xtc_probability, p.xtc_threshold, chosen_by)
    return x


def top_n_sigma(x: Tensor, n: float) -> Tensor:
    """Keep the logits within ``n`` standard deviations of the row's largest (mean and deviation over the row's
    finite logits, as llama.cpp's over the candidates it holds)."""
    finite = torch.isfinite(x)
    count = finite.sum(-1, keepdim=True).clamp(min=1)
    values = torch.where(finite, x, 0.0)
    mean = values.sum(-1, keepdim=True) / count
    std = (torch.where(finite, x - mean, 0.0).square().sum(-1, keepdim=True) / count).sqrt()
    return x.masked_fill(x < x.amax(-1, keepdim=True) - n * std, NEG_INF)


def _cut(sorted_scores: Tensor, sorted_probs: Tensor, mass: float) -> Tensor:
    """The score of the last token taken when tokens are taken in their sorted order until ``mass`` of probability
    is reached (at least one); the caller keeps the ties with it too."""
    before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # mass strictly before each sorted position
    return sorted_scores.gather(-1, (before < mass).sum(dim=-1, keepdim=True).clamp(min=1) - 1)


def top_p(x: Tensor, mass: float, top_k: int) -> Tensor:
    """The smallest set of most probable tokens holding ``mass`` of the probability (ties with the last kept)."""
    probs = torch.softmax(x, dim=-1)
    width = x.shape[-1]
    candidates = min(_TOP_P_CANDIDATES, top_k) if top_k > 0 else _TOP_P_CANDIDATES
    if width > candidates and x.device.type == "cpu":  # elsewhere the check would wait for the device
        # Usually the top few hundred tokens (or the top-k) already hold the mass: avoid sorting the whole row.
        sorted_probs = torch.topk(probs, candidates, dim=-1).values
        if not bool((torch.cumsum(sorted_probs, dim=-1)[:, -1] < mass).any()):  # (_cut's own sums)
            return x.masked_fill(probs < _cut(sorted_probs, sorted_probs, mass), NEG_INF)
    sorted_probs = torch.sort(probs, dim=-1, descending=True).values
    return x.masked_fill(probs < _cut(sorted_probs, sorted_probs, mass), NEG_INF)


def typical(x: Tensor, mass: float) -> Tensor:
    """Locally typical sampling: the tokens whose surprise, -log p, is nearest the row's entropy, taken until they
    hold ``mass`` of the probability."""
    logp = torch.log_softmax(x, dim=-1)
    probs = logp.exp()
    entropy = -torch.where(probs > 0, probs * logp, 0.0).sum(-1, keepdim=True)
    distance = torch.where(probs > 0, (-logp - entropy).abs(), math.inf)
    if x.shape[-1] > _TOP_P_CANDIDATES and x.device.type == "cpu":  # elsewhere the check would wait for the device
        # The cut is usually among the most probable tokens: every other token is at least as surprising as the
        # last of them, so where that is farther from the entropy than the cut, sorting them alone decides it.
        top_logp, top = torch.topk(logp, _TOP_P_CANDIDATES, dim=-1)
        last = _nearest_cut(distance.gather(-1, top), probs.gather(-1, top), mass)
        if bool((last < -top_logp[:, -1:] - entropy).all()):
            return x.masked_fill((distance > last) | (probs == 0), NEG_INF)
    last = _nearest_cut(distance, probs, mass)
    return x.masked_fill((distance > last) | (probs == 0), NEG_INF)


def _nearest_cut(distance: Tensor, probs: Tensor, mass: float) -> Tensor:
    """The distance of the last token taken when tokens are taken nearest first until ``mass`` is reached."""
    sorted_distance, order = torch.sort(distance, dim=-1)
    return _cut(sorted_distance, probs.gather(-1, order), mass)


def xtc_mixture(x: Tensor, probability: float, threshold: float, chosen_by: Tensor | None = None) -> Tensor:
    """XTC ("exclude top choices") as the distribution it samples from: with ``probability`` every token of
    probability >= ``threshold`` but the least likely of them is removed (rows where fewer than two reach it stay
    as they are), so the row becomes log((1 - probability) p + probability p_excluded). Tokens tied at the least
    likely probability above the threshold all stay. ``chosen_by``: the logits whose probabilities choose the
    tokens (the untempered ones where the temperature comes last; default ``x``)."""
    chooser = torch.softmax(x if chosen_by is None else chosen_by, dim=-1)
    above = (chooser >= threshold) & (chooser > 0)
    least = torch.where(above, chooser, math.inf).amin(-1, keepdim=True)
    removed = above & (chooser > least)
    applies = above.sum(-1, keepdim=True) >= 2
    probs = torch.softmax(x, dim=-1)
    excluded = torch.softmax(x.masked_fill(removed, NEG_INF), dim=-1)
    mixture = torch.log((1 - probability) * probs + probability * excluded)
    return torch.where(applies, mixture, x)
