"""One step's drafts: how many tokens each sequence drafts (the controller, from the drafter's forecast or the
sequence's history), the drafter's proposals, and drafter failures kept to the sequences they hit."""
from __future__ import annotations

import logging
from typing import Any, Protocol, Sequence

import torch

from quickdraft.speculative.controller import SpeculationController
from quickdraft.speculative.cost import CostModel
from quickdraft.speculative.drafters import DraftableSequence, Drafter, Proposal

log = logging.getLogger("quickdraft.engine")


class PlannedSequence(DraftableSequence, Protocol):
    request_id: str
    spec: Any  # the engine's SpeculationState: acceptance history, draft_failed

    @property
    def output_ids(self) -> list[int]: ...

    def draft_room(self) -> int:
        """The most tokens a round may draft for it (its context, max_tokens, its request's cap)."""


class DraftPlanner:
    def __init__(self, drafter: Drafter, controller: SpeculationController, cost: CostModel, vocab_size: int) -> None:
        self.drafter, self.controller, self.cost, self.vocab_size = drafter, controller, cost, vocab_size

    def propose(self, seqs: Sequence[PlannedSequence], base_tokens: int) -> list[Proposal]:
        """A proposal per sequence (empty where it drafts nothing). A sequence without room to draft (its request
        turned speculation off, or the drafter failed for it) is left out of the plan and the drafter's work."""
        drafting = [s for s in seqs if s.draft_room() > 0]
        proposals = {id(s): p for s, p in zip(drafting, self._propose(drafting, base_tokens))} if drafting else {}
        return [proposals.get(id(s), Proposal([])) for s in seqs]

    def _propose(self, seqs: list[PlannedSequence], base_tokens: int) -> list[Proposal]:
        try:
            forecast = self.drafter.forecast(seqs)
        except Exception:  # noqa: BLE001 - a forecast only guides k: plan from the sequences' histories
            log.exception("the drafter's forecast failed on a batch of %d sequences", len(seqs))
            forecast = None
        ks = self.controller.choose(seqs, base_tokens, catch_up=[self.drafter.lag(s) for s in seqs],
                                    remaining=[s.params.max_tokens - len(s.output_ids) for s in seqs],
                                    forecast=forecast)
        ks = [min(k, s.draft_room()) for s, k in zip(seqs, ks)]
        if not any(ks):
            return [Proposal([]) for _ in seqs]
        try:
            proposals = self._checked(seqs, self.drafter.propose(seqs, ks))
        except Exception:  # noqa: BLE001 - drafting is an optimisation: find the sequence, it decodes plainly
            log.exception("the drafter failed on a batch of %d sequences; drafting for each alone", len(seqs))
            return [self._alone(s, k) for s, k in zip(seqs, ks)]
        for num_seqs, fed, seconds in self.drafter.forward_costs():
            if fed == num_seqs:
                self.cost.draft.record(num_seqs, seconds)
            else:
                self.cost.draft_catch_up.record(fed, seconds)
        return proposals

    def _checked(self, seqs: Sequence[PlannedSequence], proposals: list[Proposal]) -> list[Proposal]:
        """A proposal must be one per sequence, of ids the target can embed."""
        if len(proposals) != len(seqs):
            raise RuntimeError(f"the drafter returned {len(proposals)} proposals for {len(seqs)} sequences")
        for p in proposals:
            if any(not 0 <= t < self.vocab_size for t in p.tokens):
                raise ValueError(f"the drafter proposed ids outside [0, {self.vocab_size}): {p.tokens}")
        return proposals

    def _alone(self, seq: PlannedSequence, k: int) -> Proposal:
        """Draft for one sequence after a batched proposal failed; if it fails alone, it decodes plainly from now
        on (its output is the same: speculation is exact), and its draft state is released."""
        if k <= 0 or seq.spec.draft_failed:
            return Proposal([])
        self.drafter.rewind(seq)  # the failed batch may have fed part of a round into the draft cache
        try:
            return self._checked([seq], self.drafter.propose([seq], [k]))[0]
        except Exception:  # noqa: BLE001
            log.exception("the drafter failed for request %s; it decodes without speculation", seq.request_id)
            seq.spec.draft_failed = True
            self.drafter.release(seq)
            return Proposal([])


def fit_to_grammar(seq: PlannedSequence, proposal: Proposal, room: int) -> Proposal:
    """A constrained sequence's proposal cut at its first token the grammar forbids (n-gram and suffix drafts are
    not masked), then extended by the tokens the grammar forces next, up to ``room`` tokens in all. Forced tokens
    are verified with the drafts in the same target pass (as deterministic drafts: q is one-hot on them)."""
    legal = seq.processor.legal_drafts(proposal.tokens)
    tokens = list(proposal.tokens[:legal])
    q = None if proposal.q is None else proposal.q[:legal]
    forced = seq.processor.forced_tokens(tokens, room - legal)
    if legal == len(proposal.tokens) and not forced:
        return proposal
    if forced and q is None and not seq.params.greedy:
        # a run-ahead continues this proposal and lines its q rows up with its tokens: every token gets its row
        # (no q meant one-hot on each draft anyway)
        q = _one_hot(tokens, seq.processor.vocab_size)
    if forced and q is not None:
        q = torch.cat([q, _one_hot(forced, q.shape[-1]).to(dtype=q.dtype, device=q.device)])
    return Proposal(tokens + forced, q, reused=min(proposal.reused, legal), forced=len(forced))


def _one_hot(tokens: list[int], width: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(tokens, dtype=torch.long), width).float()
