"""Measured step costs the speculation controller plans with.

Times are kept per number of tokens in a target forward and per number of
sequences in a draft step, as exponential moving averages, and interpolated
between measured points. Start-up calibration fills them; every engine step
refines them, so the plan follows the machine, the weight format and the load.
"""
from __future__ import annotations

import bisect
import statistics


class CostTable:
    """Seconds as a function of a size (tokens or sequences), from measurements."""

    def __init__(self, smoothing: float = 0.2) -> None:
        self.smoothing = smoothing
        self.points: dict[int, float] = {}

    def record(self, size: int, seconds: float) -> None:
        old = self.points.get(size)
        self.points[size] = seconds if old is None else old + self.smoothing * (seconds - old)

    def __call__(self, size: int) -> float:
        if not self.points:
            return 0.0
        sizes = sorted(self.points)
        if size in self.points:
            return self.points[size]
        i = bisect.bisect_left(sizes, size)
        if i == 0:
            return self.points[sizes[0]] * size / sizes[0]
        if i == len(sizes):
            # beyond the largest measurement: in proportion to size, at the median seconds per unit of the sizes of
            # at least half the largest. The slope of the last two points would let one slow measurement (a first
            # catch-up paying page faults) price a long prompt's catch-up at many times its cost
            # (tests/test_controller.py has the case)
            return size * statistics.median(self.points[s] / s for s in sizes if 2 * s >= sizes[-1])
        lo, hi = sizes[i - 1], sizes[i]
        y_lo, y_hi = self.points.get(lo, 0.0), self.points[hi]
        return y_lo + (y_hi - y_lo) * (size - lo) / (hi - lo)


class CostModel:
    def __init__(self) -> None:
        self.target = CostTable()  # seconds of one target forward, by tokens in the batch
        self.draft = CostTable()  # seconds of one draft step, by sequences in the batch
        # seconds of a draft forward that catches caches up, by tokens fed: a prompt costs the draft what its
        # prefill costs, which is not the step ratio times the target's prefill (an int4 draft's one-token step
        # streams its int4 weights at memory speed; a catch-up of many tokens is bound by arithmetic)
        self.draft_catch_up = CostTable()
        # with a run-ahead drafter: draft tokens past the guess it gets ahead during a target pass (moving
        # average); None without run-ahead
        self.run_ahead_depth: float | None = None

    def record_run_ahead(self, depth: int, smoothing: float = 0.2) -> None:
        old = self.run_ahead_depth
        self.run_ahead_depth = float(depth) if old is None else old + smoothing * (depth - old)

    @classmethod
    def from_weight_bytes(cls, target_bytes: int, draft_bytes: int, max_tokens: int = 64,
                          experts: tuple[int, float] = (0, 0.0)) -> "CostModel":
        """A deterministic estimate for seeded requests: a pass costs the bytes of weights it reads.

        Seeded requests must give the same tokens on every run, so the k they use may not
        depend on timings; the measured model would make their random draws run-dependent.
        ``experts``: a mixture target's (bytes of all its experts, share a token chooses); ``target_bytes`` holds
        all of them. A pass of n tokens reads the union of their experts, expected ``1 - (1 - share) ** n`` of them
        for independent choices, so a verify pass of an MoE target costs more than a decode step.
        """
        model = cls()
        expert_bytes, share = experts
        dense = target_bytes - expert_bytes
        one = dense + expert_bytes * share
        for n in range(1, max_tokens + 1):
            union = dense + expert_bytes * (1 - (1 - share) ** n)
            model.target.record(n, union / one + 0.01 * (n - 1))
        model.draft.record(1, draft_bytes / one)
        return model

    @property
    def calibrated(self) -> bool:
        return bool(self.target.points)
