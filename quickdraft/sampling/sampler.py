"""Token selection: multinomial sampling, greedy argmax, generators and logprobs."""
from __future__ import annotations

import os

import torch
from torch import Tensor

from quickdraft.models import native

_SEED_MOD = 2**64
NOT_A_DISTRIBUTION = "probabilities must be finite and non-negative with a positive sum per row"


def make_generator(seed: int | None, device: str | torch.device = "cpu") -> torch.Generator:
    """A torch.Generator on ``device``: seeded with ``seed`` (any int, taken mod 2**64), else from os.urandom."""
    g = torch.Generator(device=torch.device(device))
    if seed is None:
        seed = int.from_bytes(os.urandom(8), "little")
    g.manual_seed(int(seed) % _SEED_MOD)
    return g


def sample(probs: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """One token per row of ``probs`` [n, V] (or [V] -> 0-d), drawn exactly from the row's distribution.

    Rows need not be normalised but must be non-negative and finite with a positive sum;
    zero-probability tokens are never drawn. The draw runs where the generator lives: ``probs`` on
    another device (a GPU's logits, the engine's CPU generators) are copied there first, so a seeded
    request draws the same tokens from the same probabilities on any device.
    On CPU this is inverse-CDF sampling with a float64 cumulative sum (one uniform per row,
    several times faster than torch.multinomial on 150k-token rows); elsewhere torch.multinomial.
    """
    if probs.dim() == 1:
        return sample(probs.unsqueeze(0), generator)[0]
    if generator is not None and generator.device != probs.device:
        probs = probs.to(generator.device)
    if probs.device.type != "cpu":
        return torch.multinomial(probs.float(), 1, generator=generator).squeeze(-1)
    return _sample_inverse_cdf(probs, generator)


def _sample_inverse_cdf(probs: Tensor, generator: torch.Generator | None) -> Tensor:
    return sample_with_uniforms(probs, torch.rand((probs.shape[0], 1), generator=generator, dtype=torch.float64))


def sample_with_uniforms(probs: Tensor, uniforms: Tensor | list[float]) -> Tensor:
    """Inverse-CDF sampling of one token per row of ``probs`` [n, V] from given uniforms in [0, 1) (one per row).

    The draw is a pure function of (probs, uniform): drafters use it with uniforms keyed by the token's position,
    so a draft is the same whichever thread or round computes it (see ``ModelDrafter``).
    """
    u = torch.as_tensor(uniforms, dtype=torch.float64, device=probs.device)
    idx, valid = draw(probs, u)
    if not bool(valid.all()):
        raise ValueError(NOT_A_DISTRIBUTION)
    return idx


def draw(probs: Tensor, uniforms: Tensor) -> tuple[Tensor, Tensor]:
    """``sample_with_uniforms`` without reading anything back to the host: (token ids [n], valid [n] bool).

    A row that is not a distribution (a NaN, a negative entry, no mass) gets ``valid`` False and an arbitrary id;
    the caller learns it with the ids, in the same copy to the host.
    """
    cdf = probs.cumsum(dim=-1, dtype=torch.float64)
    total = cdf[:, -1:]
    valid = ((total > 0) & torch.isfinite(total)).squeeze(-1) & ~(probs < 0).any(dim=-1)
    u = uniforms.to(torch.float64).reshape(-1, 1) * total
    # First index whose cumulative mass exceeds u: a zero-probability token never is.
    idx = torch.searchsorted(cdf, u, right=True).squeeze(-1)
    over = idx >= probs.shape[-1]
    if probs.device.type != "cpu" or bool(over.any()):  # (a host read is free on the CPU, and saves a flip there)
        # u rounded up to the total: take the last token with mass.
        last = probs.shape[-1] - 1 - (probs.flip(-1) > 0).int().argmax(dim=-1)
        idx = torch.where(over, last, idx)
    return idx, valid


def to_device(tensor: Tensor, device: torch.device) -> Tensor:
    """``tensor`` (on the host) on ``device`` without waiting for the device's queued work: a GPU gets it from
    pinned memory asynchronously; the CPU takes it as it is."""
    if device.type == "cpu":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)


def greedy(logits: Tensor) -> list[int]:
    """Argmax per row of ``logits`` [n, V] (first index on ties), on quickdraft's kernel where it runs (torch's
    argmax reads a 150k-wide row one value at a time)."""
    return native.argmax_rows(logits)


def top_logprobs(logits: Tensor, chosen: Tensor, k: int) -> list[dict]:
    """Per row: the chosen token's logprob and rank and the top-k of log_softmax(logits), on quickdraft's kernel
    where it runs (``native.row_logprobs``: two passes over a row where torch takes half a dozen).

    Returns ``[{"token_id": int, "logprob": float, "rank": int, "top": [(token_id, logprob), ...]}]``
    where rank is 1 + the number of tokens with a strictly higher logit.
    Masked tokens have logprob -inf (not JSON serialisable as is).
    """
    if logits.dim() == 1:
        logits = logits.unsqueeze(0)
    chosen = torch.as_tensor(chosen, device=logits.device).reshape(-1).long()
    if chosen.numel() != logits.shape[0]:
        raise ValueError(f"chosen has {chosen.numel()} entries for {logits.shape[0]} logits rows")
    k = max(0, min(int(k), logits.shape[-1]))
    found = native.row_logprobs(logits, chosen, k)
    if found is None:
        found = _torch_logprobs(logits, chosen, k)
    elif bool((found[1] < 0).any()):  # rows the kernel leaves to torch (a NaN, an infinite largest logit, none finite)
        left = (found[1] < 0).nonzero().squeeze(1)
        for mine, theirs in zip(found, _torch_logprobs(logits[left], chosen[left], k)):
            mine[left] = theirs.to(mine.dtype)
    chosen_lp, rank, top_i, top_v = found
    # Host copies only at the end.
    chosen_l, lp_l, rank_l, tv_l, ti_l = (chosen.tolist(), chosen_lp.tolist(), rank.tolist(), top_v.tolist(),
                                          top_i.tolist())
    return [
        {"token_id": c, "logprob": lp, "rank": r, "top": list(zip(ti, tv))}
        for c, lp, r, tv, ti in zip(chosen_l, lp_l, rank_l, tv_l, ti_l)
    ]


def _torch_logprobs(logits: Tensor, chosen: Tensor, k: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``native.row_logprobs``'s four results from torch's operations: any device and dtype."""
    logits = logits.float()
    logp = torch.log_softmax(logits, dim=-1)
    chosen_lp = logp.gather(-1, chosen.unsqueeze(-1)).squeeze(-1)
    rank = (logits > logits.gather(-1, chosen.unsqueeze(-1))).sum(dim=-1) + 1
    top_v, top_i = torch.topk(logp, k, dim=-1) if k else (logp[:, :0], chosen.new_zeros((logp.shape[0], 0)))
    return chosen_lp, rank, top_i, top_v
