"""Chooses how many tokens to draft for each sequence in a step.

Expected tokens from a round with k drafts at per-token acceptance a is
(1 - a^(k+1)) / (1 - a). The controller picks the k that maximises expected
tokens per second of the whole step, using measured costs at the current
batch size, so speculation switches itself off where verification costs more
than it returns (quantized weights on CPU, big batches) or returns less than
``min_gain`` times plain decoding, and comes back, after a probe, when it pays
again. A probe drafts one token and first makes the draft catch up on what was
generated without it, so probes are made only while their cost stays within
``probe_budget`` of the sequence's decoding time.

With a run-ahead drafter, a round that accepts all k drafts and whose bonus
token the draft guessed (probability about a^(k+1)) starts its next proposal
with the tokens drafted during the target pass, so those draft steps are not
paid again: the rate counts a draft step at depth s < d (d = the measured
run-ahead depth, ``CostModel.run_ahead_depth``) only with probability
1 - a^(k+1). Seeded requests plan without it (their plan may not depend on timings).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

from quickdraft.speculative.cost import CostModel


class HasAcceptance(Protocol):
    spec: "SpeculationStateLike"
    params: "SamplingParamsLike"


class SamplingParamsLike(Protocol):
    seed: int | None


class SpeculationStateLike(Protocol):
    acceptance: float
    rounds_off: int


@dataclass
class AcceptanceCounts:
    """Decayed counts of accepted draft tokens and of rounds that ended in a rejection: the per-token acceptance
    of a geometric model, kept per sequence (the controller) or per match band (the suffix drafter)."""

    accepted: float = 3.0  # prior: acceptance 0.75 until measured
    rejected: float = 1.0

    @property
    def acceptance(self) -> float:
        return self.accepted / (self.accepted + self.rejected)

    def record(self, drafted: int, accepted: int, decay: float = 0.9) -> None:
        if drafted == 0:
            return
        self.accepted = self.accepted * decay + accepted
        self.rejected = self.rejected * decay + (1 if accepted < drafted else 0)

    def as_prior(self, weight: float = 4.0) -> "AcceptanceCounts":
        """A new history with this one's acceptance and the weight of the default prior (so a few rounds of its
        own outweigh it)."""
        a = self.acceptance
        return type(self)(accepted=weight * a, rejected=weight * (1.0 - a))


def expected_tokens(acceptance: float, k: int) -> float:
    if acceptance >= 0.999:
        return k + 1.0
    return (1.0 - acceptance ** (k + 1)) / (1.0 - acceptance)


@dataclass
class SpeculationController:
    cost: CostModel
    max_k: int = 8
    fixed_k: int | None = None  # a fixed k disables adaptation
    probe_every: int = 16  # rounds a switched-off sequence waits before drafting one probe token
    probe_budget: float = 0.02  # most a switched-off sequence's probes may cost, as a share of its decoding time
    # expected speed-up below which a sequence (or the batch) decodes plainly: the measured costs drift by several
    # percent over minutes, so a plan that expects to gain 2% loses as often as it wins (int4 weights on CPU)
    min_gain: float = 1.05
    # a catch-up is paid only if drafting is expected to save this many times its price: before its first rounds a
    # sequence's acceptance is the pool's (other requests, other tasks), which a given prompt may fall far short of
    # (docs/MEASUREMENTS.md)
    catch_up_margin: float = 2.0
    draft_is_free: bool = False  # n-gram lookup: no draft model to pay for
    seeded_cost: CostModel | None = None  # deterministic plan for seeded requests (see CostModel.from_weight_bytes)

    def choose(self, seqs: Sequence[HasAcceptance], base_tokens: int, catch_up: Sequence[int] | None = None,
               remaining: Sequence[int] | None = None, forecast: Sequence[float | None] | None = None) -> list[int]:
        """k per sequence; ``base_tokens`` is the number of tokens the step processes without any drafts.

        ``forecast[i]``: the drafter's own per-token acceptance for ``seqs[i]``'s round (a suffix match knows
        whether the text repeats), used instead of the sequence's history; None: the history.

        ``catch_up[i]``: tokens the draft must process before it can draft for ``seqs[i]`` (its prompt, or what
        was generated while speculation was off); ``remaining[i]``: tokens ``seqs[i]`` may still generate. A
        sequence whose expected savings over its remaining tokens do not repay its catch-up does not draft."""
        if self.fixed_k is not None:
            return [self.fixed_k] * len(seqs)
        if not seqs or not self.cost.calibrated:
            return [1] * len(seqs)
        seeded = [self.seeded_cost is not None and s.params.seed is not None for s in seqs]
        forecast = forecast or [None] * len(seqs)
        acceptance = [s.spec.acceptance if f is None else f for s, f in zip(seqs, forecast)]
        costs = [self.seeded_cost if fixed else self.cost for fixed in seeded]
        passes = {id(c): [c.target(1 + k) for k in range(self.max_k + 1)] for c in costs}  # priced once a step
        own = [self._best_alone(a, c, passes[id(c)]) for a, c in zip(acceptance, costs)]
        held = set()  # sequences kept from drafting by their catch-up: no probing either
        if catch_up is not None and remaining is not None and not self.draft_is_free:
            for i, s in enumerate(seqs):
                if own[i] and not seeded[i] and not self._repays(acceptance[i], own[i], catch_up[i], remaining[i],
                                                                 base_tokens):
                    own[i] = 0
                    held.add(i)
        best_ks, best_rate, best_cap = list(own), -1.0, 0
        for cap in range(max(own, default=0) + 1):  # one batch-wide cap: at high load verification gets dearer
            ks = [k if fixed else min(cap, k) for k, fixed in zip(own, seeded)]
            rate = self._throughput(acceptance, ks, base_tokens)
            if rate > best_rate * (self.min_gain if cap and not best_cap else 1.0001):
                best_ks, best_rate, best_cap = ks, rate, cap
        # a sequence whose own acceptance switched speculation off probes now and then, so a better acceptance
        # can be noticed; one switched off by the load alone does not (its acceptance is not in question, and
        # the plan turns it back on as soon as the costs allow)
        for i, s in enumerate(seqs):
            if own[i] == 0 and i not in held and forecast[i] is None:
                s.spec.rounds_off += 1
                lag = catch_up[i] if catch_up is not None else 0
                if (self.max_k >= 1 and s.spec.rounds_off >= self.probe_every
                        and self._probe_pays(costs[i], lag, s.spec.rounds_off)):
                    s.spec.rounds_off = 0
                    best_ks[i] = 1
            else:
                s.spec.rounds_off = 0
        return best_ks

    def _probe_pays(self, cost: CostModel, catch_up: int, rounds_off: int) -> bool:
        """A probe (one drafted token) costs a verify row, a draft step and the draft's catch-up on the tokens
        generated since the sequence stopped drafting; it is made only while that stays
        within ``probe_budget`` of the time those ``rounds_off`` plain steps took, so probing a drafter that
        rarely hits never costs a sequence more than that share."""
        step = cost.target(1)
        if step <= 0:
            return True
        price = cost.target(2) - step
        if not self.draft_is_free:
            price += cost.draft(1) + (self._catch_up_cost(cost, catch_up) if catch_up > 1 else 0.0)
        return price <= self.probe_budget * rounds_off * step

    @staticmethod
    def _catch_up_cost(cost: CostModel, catch_up: int) -> float:
        """Seconds the draft takes to process ``catch_up`` tokens: measured catch-up forwards where there are any,
        else a target pass of that many tokens scaled by the draft/target step ratio."""
        if cost.draft_catch_up.points:
            return cost.draft_catch_up(catch_up)
        return cost.target(catch_up) * cost.draft(1) / cost.target(1)

    def _repays(self, acceptance: float, k: int, catch_up: int, remaining: int, batch: int) -> bool:
        """Drafting ``k`` per round saves ``catch_up_margin`` times what the draft's catch-up costs over ``remaining``
        tokens.

        In a decode batch of ``batch`` sequences a plain token costs the machine its share of the step,
        target(batch) / batch; a round with drafts costs that share plus what the drafts add to the step, and
        yields expected_tokens. The catch-up is a forward of its own, so it costs its whole time: under load a
        prompt catch-up is rarely repaid."""
        if catch_up <= 1:
            return True
        step = self.cost.target(batch)
        if step <= 0:
            return True
        plain = step / batch
        spec = (plain + self.cost.target(batch + k) - step + k * self.cost.draft(1)) / expected_tokens(acceptance, k)
        return remaining * (plain - spec) > self.catch_up_margin * self._catch_up_cost(self.cost, catch_up)

    def _best_alone(self, acceptance: float, cost: CostModel, passes: list[float] | None = None) -> int:
        """The k this sequence would use on its own (batch of one); ``passes[k]``: cost.target(1 + k) (``choose``
        prices them once per step for all of its sequences)."""
        if self.max_k < 1:  # drafting capped at nothing
            return 0
        passes = passes or [cost.target(1 + k) for k in range(self.max_k + 1)]

        def rate(k: int) -> float:
            seconds = passes[k]
            if not self.draft_is_free:
                seconds += cost.draft(1) * sum(1.0 - self._drafted_ahead(cost, acceptance, k, s) for s in range(k))
            return expected_tokens(acceptance, k) / seconds if seconds > 0 else 0.0

        best, best_rate = 1, rate(1)
        for k in range(2, self.max_k + 1):
            if rate(k) > best_rate * 1.0001:
                best, best_rate = k, rate(k)
        return best if best_rate > rate(0) * self.min_gain else 0

    def _throughput(self, acceptance: Sequence[float], ks: list[int], base_tokens: int) -> float:
        tokens = sum(expected_tokens(a, k) for a, k in zip(acceptance, ks))
        seconds = self.cost.target(base_tokens + sum(ks))
        if not self.draft_is_free:
            for step in range(max(ks, default=0)):
                seconds += self.cost.draft(sum(1.0 - self._drafted_ahead(self.cost, a, k, step)
                                               for a, k in zip(acceptance, ks) if k > step))
        return tokens / seconds if seconds > 0 else 0.0

    @staticmethod
    def _drafted_ahead(cost: CostModel, acceptance: float, k: int, step: int) -> float:
        """Probability that draft step ``step`` of a k-token round was already run ahead (0 without run-ahead)."""
        depth = cost.run_ahead_depth
        if depth is None:
            return 0.0
        return min(1.0, acceptance) ** (k + 1) * min(1.0, max(0.0, depth - step))
