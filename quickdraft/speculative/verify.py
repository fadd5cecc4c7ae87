"""Exact verification of drafted tokens (Leviathan et al. 2023; Chen et al. 2023).

Greedy: accept the longest prefix of drafts equal to the target argmax, then emit
the target argmax at the first mismatch (or the bonus position).

Sampled: draft ``d_i`` (drawn from ``q_i``) is accepted with probability
``min(1, p_i(d_i) / q_i(d_i))``; at the first rejection the emitted token is drawn
from ``norm(max(p_i - q_i, 0))``; if all k drafts are accepted a bonus token is
drawn from ``p_k``. Every emitted token is then distributed exactly as plain
sampling from ``p`` would give. All randomness comes from the request's generator, drawn before the step
(``draw_uniforms``), so the verification itself runs on the device and reads nothing back.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from quickdraft.sampling.sampler import NOT_A_DISTRIBUTION, draw


def _as_list(x: Sequence[int] | Tensor) -> list[int]:
    if isinstance(x, Tensor):
        return [int(v) for v in x.reshape(-1).tolist()]
    return [int(v) for v in x]


def verify_greedy(target_argmax: Sequence[int] | Tensor, drafts: Sequence[int] | Tensor) -> tuple[int, int]:
    """(num_accepted, next_token): the longest prefix with drafts[i] == target_argmax[i], then
    next_token = target_argmax[num_accepted]. ``target_argmax`` has len(drafts) + 1 entries."""
    t = _as_list(target_argmax)
    d = _as_list(drafts)
    if len(t) != len(d) + 1:
        raise ValueError(f"target_argmax needs len(drafts) + 1 = {len(d) + 1} entries, got {len(t)}")
    n = 0
    while n < len(d) and d[n] == t[n]:
        n += 1
    return n, t[n]


def draw_uniforms(generator: torch.Generator | None, batch: int, k: int) -> Tensor:
    """The uniforms a verification of ``k`` drafts per row consumes, [batch, k+1] float64 on the generator's device:
    k acceptance uniforms (float32 values) then the one the emitted token is drawn with.

    They do not depend on the probabilities, so a step can draw them before its forward and send them to the device
    with its inputs; a seeded request consumes its generator in the same order on any device.
    """
    device = generator.device if generator is not None else torch.device("cpu")
    accept = torch.rand((batch, k), generator=generator, device=device, dtype=torch.float32)
    emit = torch.rand((batch, 1), generator=generator, device=device, dtype=torch.float64)
    return torch.cat([accept.double(), emit], dim=1)


def verify_with_uniforms(p: Tensor, q: Tensor | None, drafts: Tensor, uniforms: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Exact speculative sampling on p's device with nothing read back to the host.

    p: [B, k+1, V] target probabilities; q: [B, k, V'] draft probabilities or None (a deterministic drafter);
    drafts: [B, k] ids below max(V, V'); uniforms: [B, k+1] from :func:`draw_uniforms`.
    Returns (num_accepted [B], next_token [B], valid [B] bool), where ``valid`` is False for a row whose
    distribution was not one (a NaN in the logits): the caller reads all three in one copy.
    """
    batch, k1, vp = p.shape
    k = k1 - 1
    device = p.device
    p = p.float()
    uniforms = uniforms.to(device)
    if q is not None:
        q = q[:, :k].float().to(device)
        width = max(vp, q.shape[-1])
        q = F.pad(q, (0, width - q.shape[-1]))
        p = F.pad(p, (0, width - vp))
    if k == 0:
        nxt, valid = draw(p[:, 0], uniforms[:, 0])
        return torch.zeros(batch, dtype=torch.long, device=device), nxt, valid
    d = drafts.to(device=device, dtype=torch.long).reshape(batch, k)
    u = uniforms[:, :k].float()
    idx = d.unsqueeze(-1)
    p_d = p[:, :k].gather(-1, idx).squeeze(-1)
    if q is None:
        accept = u < p_d  # q(d) = 1: accept with probability p(d)
    else:
        q_d = q.gather(-1, idx).squeeze(-1)
        accept = u * q_d < p_d  # u < p/q without dividing; q(d) = 0 < p(d) accepts, p(d) = 0 never does
    num_accepted = accept.long().cumprod(dim=-1).sum(dim=-1)

    # Only the row at the first rejection (or the bonus row) is needed: gather it, one draw per sequence.
    rejected = num_accepted < k
    pos = num_accepted.clamp(max=k - 1)
    rows = torch.arange(batch, device=device)
    p_row = p[rows, num_accepted]  # [B, width]; p_k where all were accepted
    if q is None:
        # residual max(p - onehot(d), 0) = p with d zeroed
        residual = p_row.scatter(-1, d[rows, pos].unsqueeze(-1), 0.0)
    else:
        residual = (p_row - q[rows, pos]).clamp_(min=0.0)
    # Zero residual mass (p <= q everywhere, i.e. p == q up to rounding): rejection has
    # probability ~0 there; fall back to p so the draw is still well defined.
    use_residual = rejected.unsqueeze(-1) & (residual.sum(dim=-1, keepdim=True) > 0)
    nxt, valid = draw(torch.where(use_residual, residual, p_row), uniforms[:, k])
    return num_accepted, nxt, valid


def verify_sampled_batch(
    p: Tensor,
    q: Tensor | None,
    drafts: Tensor | Sequence[Sequence[int]],
    generator: torch.Generator | None,
) -> tuple[Tensor, Tensor]:
    """Batched exact speculative sampling with one shared generator.

    p: [B, k+1, Vp] target probabilities (already processed, rows summing to 1).
    q: [B, k, Vq] (or [B, k+1, Vq], the last row ignored) draft probabilities, or None
       for a deterministic drafter (q is then one-hot at the draft).
    drafts: [B, k] drafted token ids.
    Different widths are handled by zero-padding the narrower of p and q.
    Returns (num_accepted [B] long, next_token [B] long) on p's device; the emitted tokens of row b are
    drafts[b, :num_accepted[b]] followed by next_token[b]. The uniforms come from the generator (on its device,
    in the order of :func:`draw_uniforms`), so a seeded call gives the same tokens from the same probabilities
    on any device.
    """
    if p.dim() != 3:
        raise ValueError(f"p must be [B, k+1, V], got shape {tuple(p.shape)}")
    batch, k1, vp = p.shape
    k = k1 - 1
    if k < 0:
        raise ValueError("p needs at least one row")
    if isinstance(drafts, Tensor):
        d = drafts.to(dtype=torch.long)
    else:
        d = torch.tensor([_as_list(row) for row in drafts] if batch else [], dtype=torch.long)
    d = d.reshape(batch, k)
    width = vp
    if q is not None:
        if q.dim() != 3 or q.shape[0] != batch or q.shape[1] not in (k, k + 1):
            raise ValueError(f"q must be [B={batch}, k={k}, V], got shape {tuple(q.shape)}")
        width = max(vp, q.shape[-1])
    if k and d.numel() and bool(((d < 0) | (d >= width)).any()):
        raise ValueError(f"drafted token ids must be in [0, {width})")
    num_accepted, nxt, valid = verify_with_uniforms(p, q, d, draw_uniforms(generator, batch, k))
    if not bool(valid.all()):
        raise ValueError(NOT_A_DISTRIBUTION)
    return num_accepted, nxt


def verify_sampled(
    p: Tensor,
    q: Tensor | None,
    drafts: Sequence[int] | Tensor,
    generator: torch.Generator | None,
) -> tuple[int, int]:
    """(num_accepted, next_token) for one sequence; see :func:`verify_sampled_batch`.

    p: [k+1, V] target probs, q: [k, V] draft probs or None (deterministic drafter).
    """
    if p.dim() != 2:
        raise ValueError(f"p must be [k+1, V], got shape {tuple(p.shape)}")
    d = drafts if isinstance(drafts, Tensor) else torch.tensor(_as_list(drafts), dtype=torch.long)
    if d.numel() != p.shape[0] - 1:
        raise ValueError(f"p has {p.shape[0]} rows, needs len(drafts) + 1 = {d.numel() + 1}")
    if q is not None and q.dim() != 2:
        raise ValueError(f"q must be [k, V], got shape {tuple(q.shape)}")
    n, nxt = verify_sampled_batch(
        p.unsqueeze(0), None if q is None else q.unsqueeze(0), d.reshape(1, -1), generator
    )
    n_l, t_l = torch.stack([n[0], nxt[0]]).tolist()
    return int(n_l), int(t_l)
