"""Deciding a step's tokens: what each sequence accepts of its drafts, and the token it emits after them.

On the CPU a greedy sequence is decided on the host as its rows are read (quickdraft's argmax kernel reads a
150k-wide row faster than torch's). Everywhere else, and for every sampled sequence, the decision is made where the
logits are, with nothing read back until the end of the step: greedy choices come from one argmax over the rows of
every greedy sequence; a sampled sequence's transforms, acceptance test and residual draw run as torch ops on
uniforms its generator drew on the host beforehand (in the order plain verification consumes them, so a seeded
request gives the same tokens on any device). The choices and the sampled decisions of the whole step come to the
host in one copy; there a greedy sequence's choices are compared with its drafts (a few ints: on the device that
comparison was a dozen small kernels a step).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from quickdraft.engine.sequence import Sequence
from quickdraft.sampling.sampler import NOT_A_DISTRIBUTION, greedy, to_device
from quickdraft.speculative.drafters import Proposal
from quickdraft.speculative.verify import draw_uniforms, verify_greedy, verify_with_uniforms

# Runs one sequence's part of the step, ending that sequence alone if it raises (LLMEngine._isolated).
Isolated = Callable[..., Any]

# On the CPU, greedy sequences are decided on the host; tests turn this off to run the device path there.
CPU_GREEDY_ON_HOST = True


def decide(picked: list[tuple[Sequence, torch.Tensor, Proposal]], isolated: Isolated) -> dict[int, tuple[int, int]]:
    """(accepted drafts, next token) per ``id(seq)`` for each (sequence, its logits rows, its proposal); a sequence
    whose part fails is ended by ``isolated`` and has no entry."""
    return launch(picked, isolated, CPU_GREEDY_ON_HOST).read(isolated)


def launch(picked: list[tuple[Sequence, torch.Tensor, Proposal]], isolated: Isolated, host_greedy: bool) -> Decisions:
    """Queue the step's decisions where the logits are and return them unread (``Decisions.read``). ``host_greedy``:
    a greedy sequence whose rows are on the CPU is decided on the host at once."""
    decisions = Decisions()
    sampled: list[tuple[Sequence, torch.Tensor, Proposal]] = []
    for seq, rows, proposal in picked:
        if seq.finished:  # ended earlier in this step (a sibling sample's failure): nothing more to decide
            continue
        if not seq.params.greedy:
            sampled.append((seq, rows, proposal))
        elif rows.device.type == "cpu" and host_greedy:
            result = isolated(seq, _greedy_on_host, seq, rows, proposal)
            if result is not None:
                decisions.decided[id(seq)] = result
        else:
            choice_rows = isolated(seq, _greedy_rows, seq, rows, proposal)
            if choice_rows is not None:
                decisions.greedy.append((seq, choice_rows, proposal))
    if sampled:
        # every sampled sequence's uniforms, drawn from its own generator, reach the device in one copy
        counts = [len(proposal.tokens) + 1 for _, _, proposal in sampled]
        uniforms = torch.cat([draw_uniforms(seq.generator, 1, n - 1).reshape(-1) for (seq, _, _), n
                              in zip(sampled, counts)])
        uniforms = to_device(uniforms, sampled[0][1].device).split(counts)
        for (seq, rows, proposal), u in zip(sampled, uniforms):
            result = isolated(seq, _sampled, seq, rows, proposal, u)
            if result is not None:
                decisions.sampled.append((seq, result))
    decisions.gather()
    return decisions


class Decisions:
    """A step's decisions queued on the device: every greedy row's choice (one argmax), then every sampled sequence's
    (accepted, token, valid), in one tensor that comes to the host in one copy."""

    def __init__(self) -> None:
        self.decided: dict[int, tuple[int, int]] = {}  # made on the host already
        self.greedy: list[tuple[Sequence, torch.Tensor, Proposal]] = []  # (sequence, rows to argmax, proposal)
        self.sampled: list[tuple[Sequence, torch.Tensor]] = []  # (sequence, [3] on the device)
        self.values: torch.Tensor | None = None
        self._host: torch.Tensor | None = None
        self._copied: torch.cuda.Event | None = None

    def gather(self) -> None:
        parts = [torch.cat([rows for _, rows, _ in self.greedy]).argmax(dim=-1)] if self.greedy else []
        parts += [torch.stack([t for _, t in self.sampled]).reshape(-1)] if self.sampled else []
        self.values = None if not parts else parts[0] if len(parts) == 1 else torch.cat(parts)

    def next_tokens(self) -> tuple[list[Sequence], torch.Tensor | None]:
        """The sequences decided on the device and, where none had drafts, the token each emits next, still on the
        device (what a launch-ahead step feeds the next forward; greedy sequences first, then sampled ones)."""
        seqs = [seq for seq, _, _ in self.greedy] + [seq for seq, _ in self.sampled]
        if self.values is None:
            return seqs, None
        greedy_rows = sum(len(rows) for _, rows, _ in self.greedy)
        if greedy_rows != len(self.greedy):
            raise ValueError("next_tokens needs a step without drafts: one row per greedy sequence")
        return seqs, torch.cat([self.values[:greedy_rows], self.values[greedy_rows + 1::3]])

    def start_copy(self) -> None:
        """Start the copy to the host now (into pinned memory, without waiting): work queued after this call does
        not delay ``read``."""
        if self.values is None or self.values.device.type != "cuda":
            return
        self._host = torch.empty(self.values.shape, dtype=self.values.dtype, pin_memory=True)
        self._host.copy_(self.values, non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record(torch.cuda.current_stream(self.values.device))  # the copy's stream, on its device

    def read(self, isolated: Isolated) -> dict[int, tuple[int, int]]:
        """(accepted drafts, next token) per ``id(seq)``, as ``decide`` returns them."""
        decided = dict(self.decided)
        if self.values is None:
            return decided
        if self._copied is not None:
            self._copied.synchronize()
            values = self._host.tolist()
        else:
            values = self.values.tolist()
        start = 0
        for seq, rows, proposal in self.greedy:  # a few ints each: compared with the drafts on the host
            decided[id(seq)] = verify_greedy(values[start:start + len(rows)], proposal.tokens)
            start += len(rows)
        for (seq, _), at in zip(self.sampled, range(start, len(values), 3)):
            accepted, token, valid = values[at:at + 3]
            if valid:
                decided[id(seq)] = (accepted, token)
            else:
                isolated(seq, _fail_with, ValueError(NOT_A_DISTRIBUTION))
        return decided


def _greedy_on_host(seq: Sequence, rows: torch.Tensor, proposal: Proposal) -> tuple[int, int]:
    choices = greedy(seq.processor.process(rows, proposal.tokens))
    return verify_greedy(choices, proposal.tokens)


def _greedy_rows(seq: Sequence, rows: torch.Tensor, proposal: Proposal) -> torch.Tensor:
    """The rows a greedy sequence's choices are the argmax of (checked here: one argmax serves the whole step, and one
    sequence's bad shape must end that sequence alone)."""
    _check_rows(rows, proposal.tokens)
    return rows if seq.processor.greedy_on_raw_logits else seq.processor.process(rows, proposal.tokens)


def _sampled(seq: Sequence, rows: torch.Tensor, proposal: Proposal, uniforms: torch.Tensor) -> torch.Tensor:
    drafted, q = proposal.tokens, proposal.q
    # checked here, on the host: on a GPU a bad index is a device fault, and torch's own errors name no drafter
    if q is not None and (q.dim() != 2 or q.shape[0] not in (len(drafted), len(drafted) + 1)):
        raise ValueError(f"the drafter's q has shape {tuple(q.shape)}; it needs a row per draft ({len(drafted)})")
    _check_rows(rows, drafted)
    width = max(rows.shape[-1], 0 if q is None else q.shape[-1])
    if any(not 0 <= t < width for t in drafted):
        raise ValueError(f"drafted token ids must be in [0, {width})")
    p = seq.processor.probs(rows, drafted=drafted)
    q = None if q is None else q.unsqueeze(0)
    drafts = to_device(torch.tensor([drafted], dtype=torch.long), p.device)
    accepted, token, valid = verify_with_uniforms(p.unsqueeze(0), q, drafts, uniforms.unsqueeze(0))
    return torch.stack([accepted[0], token[0], valid[0].long()])


def _check_rows(rows: torch.Tensor, drafted: list[int]) -> None:
    if len(rows) != len(drafted) + 1:
        raise ValueError(f"{len(rows)} logits rows for {len(drafted)} drafts; a verify pass has drafts + 1")


def _fail_with(exc: Exception) -> None:
    raise exc
