"""Mirostat (Basu et al., 2021, as llama.cpp runs it): a sampler that steers the output's surprise towards a target.

Its state is one number, ``mu``, the most surprise a kept token may have, which starts at ``2 * tau``. Each step
keeps part of the vocabulary (version 2: the tokens whose surprise ``-log2 p`` is at most ``mu``; version 1: the
top k, k estimated from mu and the Zipf exponent of the 100 most probable tokens), samples from what it kept,
renormalized, and moves mu by ``eta`` times the gap between the sampled token's surprise there and ``tau``.

Exact speculation: the distribution at a position depends on mu, and mu on every earlier token and the distribution
it was drawn from. A verify pass computes its rows in order, row i with the mu its drafts before i lead to
(``rows``); the mu that the committed tokens lead to is advanced from the same rows with the same function
(``next_mu``), so a row sees the mu plain sampling would have had there. A drafter's rows keep what mirostat keeps at
its first mu, 2 * tau, whatever the committed one: a draft may come from any distribution, and one that depends on
the tokens alone is the same whether it was drafted before the target's rows were committed (run-ahead) or after.
Everything is a torch op on the logits' device, mu included: nothing here waits for the device.
"""
from __future__ import annotations

import copy
import math
from collections.abc import Sequence

import torch
from torch import Tensor

from quickdraft.sampling.params import SamplingParams

TOP_M = 100  # llama.cpp's m: the most probable tokens whose probabilities estimate the Zipf exponent
NEG_INF = float("-inf")
_LN2 = math.log(2.0)
_ZERO_EXPONENT = 1e-6  # |s_hat - 1| below this: k's limit as the exponent tends to 1
# a step moves mu by at most eta * (150 + tau) bits (a float32 probability's surprise is below 150): a real output
# stays far inside this, and float32 arithmetic on it stays finite
MAX_MU = 1e30


def checked_mu(value: object, what: str) -> float:
    """``value`` as a mu to continue from; raises ValueError naming ``what`` unless it is a number in
    [-MAX_MU, MAX_MU]."""
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and -MAX_MU <= value <= MAX_MU
    if not ok:  # (NaN fails the comparison; a huge int compares without overflowing)
        shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:40] + "..."
        raise ValueError(f"{what} is {shown}; it must be a number in [-{MAX_MU:g}, {MAX_MU:g}]")
    return float(value)


def next_mu(mu: Tensor, row: Tensor, token: int, tau: float, eta: float) -> Tensor:
    """mu after ``token`` was sampled from the kept, renormalized ``row`` [V] (what ``keep`` returned)."""
    if eta == 0:
        return mu
    surprise = -torch.log_softmax(row, dim=-1)[token] / _LN2
    return mu - eta * (surprise - tau)


def keep(row: Tensor, mu: Tensor, version: int, vocab_size: int) -> Tensor:
    """``row`` [V] (logits after the temperature) with what mirostat drops at -inf. The most probable token is
    always kept; ties are kept together (at the top, and at version 1's k-th value, as top-k here), where llama.cpp
    keeps one or k in its sort's order."""
    probs = torch.softmax(row, dim=-1)
    top = row == row.max()
    if version == 2:
        kept = (-torch.log2(probs) <= mu) | top
    else:
        kept = (row >= kth_largest(row, _top_k(probs, mu, vocab_size), row.device.type == "cpu")) | top
    return row.masked_fill(~kept, NEG_INF)


def _top_k(probs: Tensor, mu: Tensor, vocab_size: int) -> Tensor:
    """Version 1's k (a 0-d long tensor in [1, V]): s_hat is the least-squares Zipf exponent of the most probable
    tokens' probability ratios, k = (e * 2^mu / (1 - N^-e))^(1 / s_hat) with e = s_hat - 1. Pairs with a zero
    probability are left out (llama.cpp's log ratio would be infinite there); none left: k = 1."""
    width = probs.shape[-1]
    top = torch.topk(probs, min(TOP_M, width)).values.double()
    i = torch.arange(top.numel() - 1, dtype=torch.float64, device=probs.device)
    t = torch.log((i + 2) / (i + 1))
    valid = top[1:] > 0
    b = torch.where(valid, torch.log(top[:-1] / torch.where(valid, top[1:], 1.0)), 0.0)
    t_sq = (t * t * valid).sum()
    s_hat = (t * b).sum() / torch.where(t_sq > 0, t_sq, 1.0)
    e = s_hat - 1
    n = float(max(vocab_size, 2))
    near_one = e.abs() < _ZERO_EXPONENT
    # e / (1 - N^-e) tends to 1 / ln N as e tends to 0
    ratio = torch.where(near_one, 1 / math.log(n), e / (1 - n ** -torch.where(near_one, 1.0, e)))
    k = (ratio * torch.exp2(mu.double())) ** (1 / s_hat)
    k = torch.nan_to_num(k, nan=1.0, posinf=float(width))
    k = torch.where(t_sq > 0, k, 1.0)
    return k.clamp(1, width).long()


def kth_largest(row: Tensor, k: Tensor, on_host: bool) -> Tensor:
    """The k-th largest value of ``row``; ``on_host``: read k (free on the CPU: a top-k of k is far cheaper than a
    sort), else sort (nothing waits for the device)."""
    if on_host:
        return torch.topk(row, int(k)).values[-1]
    return torch.sort(row, descending=True).values.gather(0, (k - 1).reshape(1))[0]


def rows(x: Tensor, mu: Tensor, drafted: Sequence[int], offset: int, version: int, tau: float, eta: float,
         vocab_size: int) -> Tensor:
    """Mirostat over ``x`` [n, V] (after the temperature): row 0 with ``mu``, row i with the mu that
    drafted[offset:offset + i] lead to from there (the caller checked there are enough)."""
    out = []
    for i in range(x.shape[0]):
        out.append(keep(x[i], mu, version, vocab_size))
        if i + 1 < x.shape[0]:
            mu = next_mu(mu, out[-1], drafted[offset + i], tau, eta)
    return torch.stack(out)


class Mirostat:
    """One output's mirostat: mu after its committed tokens, and the target's rows those tokens are drawn from
    (``drawn_from``), kept until they are committed (``accept``)."""

    def __init__(self, params: SamplingParams, vocab_size: int) -> None:
        self.version, self.tau, self.eta = params.mirostat, params.mirostat_tau, params.mirostat_eta
        self.vocab_size = vocab_size
        self._start = 2.0 * self.tau  # mu before the first token (or where a resumed output left it)
        self._mu: Tensor | None = None  # on the logits' device; None: self._start
        self._rows: tuple[Tensor, list[int], int] | None = None  # (rows, their drafts, the next token's row)

    @property
    def mu(self) -> float:
        """mu after the committed tokens (a read from the device)."""
        return self._start if self._mu is None else float(self._mu)

    def restart(self, mu: float | None) -> None:
        """Continue from ``mu`` (the ``mu`` of an earlier run of the same output; None: the initial one)."""
        start = 2.0 * self.tau if mu is None else checked_mu(mu, "mirostat's mu")
        self._start, self._mu, self._rows = start, None, None

    def fork(self) -> "Mirostat":
        return copy.copy(self)  # its tensors are never changed in place

    def _mu_on(self, device: torch.device) -> Tensor:
        if self._mu is None:  # a fill on the device: no copy from the host to wait for
            self._mu = torch.full((), self._start, dtype=torch.float32, device=device)
        return self._mu if self._mu.device == device else self._mu.to(device)

    def rows(self, x: Tensor, drafted: Sequence[int], offset: int) -> Tensor:
        """``x`` [n, V] after the temperature, row i with what mirostat drops after drafted[:offset + i] at -inf."""
        return rows(x, self._mu_on(x.device), drafted, offset, self.version, self.tau, self.eta, self.vocab_size)

    def draft_rows(self, x: Tensor) -> Tensor:
        """A drafter's rows: ``x`` with what mirostat drops at its first mu (2 * tau) at -inf."""
        mu = torch.full((), 2.0 * self.tau, dtype=torch.float32, device=x.device)
        return torch.stack([keep(row, mu, self.version, self.vocab_size) for row in x])

    def drawn_from(self, rows: Tensor, drafted: list[int]) -> None:
        """The target's rows of this step (``rows`` above, row i after drafted[:i]): its tokens are drawn from them."""
        self._rows = (rows, drafted, 0)

    def accept(self, ids: Sequence[int]) -> None:
        """Advance mu over committed tokens, each drawn from its row of the step's rows: the drafts while they match,
        then the token the verification chose, which ends those rows' use. Tokens without rows (a resumed output's,
        whose mu ``restart`` gives) leave mu as it is."""
        for token in ids:
            if self._rows is None:
                return
            rows, drafted, at = self._rows
            self._mu = next_mu(self._mu_on(rows.device), rows[at], token, self.tau, self.eta)
            self._rows = (rows, drafted, at + 1) if at < len(drafted) and token == drafted[at] else None
