"""How many CPU threads a step runs on: the cores other processes leave free, re-read as the step loop goes.

Every parallel kernel call ends at a barrier that waits for its slowest thread. When another process keeps a core
busy, the thread that shares that core runs in the time slices the OS gives it, and every barrier waits for it:
a decode step of a few hundred kernel calls then takes several times longer, far more than the share of the CPU
that was lost. Running one thread fewer per busy core avoids the wait (the kernels give the same results whatever
the thread count, see models/native.py).

The load of other processes is the CPU time the whole machine spent (``/proc/stat``) less the time this process
spent (``/proc/self/stat``), over the last ``interval_s``; where ``/proc`` cannot be read, the count stays fixed.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from quickdraft.errors import InvalidParameterError

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
# the thread count before any budget lowered it, and the count a budget last set: a budget made while another one
# has lowered the count (a second LLM in a process under load) must still be allowed the cores it had
_before_budgets: int | None = None
_last_set: int | None = None


def _configured_threads() -> int:
    current = torch.get_num_threads()
    return _before_budgets if _before_budgets is not None and current == _last_set else current


def _set_threads(n: int) -> None:
    global _before_budgets, _last_set
    if _before_budgets is None or torch.get_num_threads() != _last_set:
        _before_budgets = torch.get_num_threads()  # the count the caller chose, not one a budget set
    torch.set_num_threads(n)
    _last_set = n


def _machine_busy_s() -> float | None:
    """CPU seconds all cores have spent outside idle and iowait since boot."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    except OSError:
        return None
    values = [int(v) for v in fields]
    idle = values[3] + (values[4] if len(values) > 4 else 0)
    return (sum(values[:8]) - idle) / _TICKS


def _own_busy_s() -> float | None:
    """CPU seconds this process (every thread) has spent."""
    try:
        stat = Path("/proc/self/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS


def check_threads(threads: int | str) -> None:
    """Refuse what is not 'auto' or a count of this machine's CPUs (a million OpenMP threads would not end well)."""
    cores = os.cpu_count() or 1
    if threads != "auto" and (isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= cores):
        raise InvalidParameterError(
            f"threads must be 'auto' or a positive int, at most the {cores} CPUs here, got {threads!r}")


class ThreadBudget:
    """Sets torch's (and so the kernels') thread count for the calling thread to the cores not busy elsewhere.

    ``threads``: ``'auto'`` follows the free cores, between 1 and the count at start; an int fixes it."""

    def __init__(self, threads: int | str = "auto", interval_s: float = 0.25) -> None:
        check_threads(threads)
        self.max_threads = _configured_threads()
        self.fixed = None if threads == "auto" else int(threads)
        self.interval_s = interval_s
        self.threads = self.fixed or self.max_threads
        self._last: tuple[float, float, float] | None = None  # (wall, machine busy, own busy)

    def apply(self) -> int:
        """Called at each step's start: re-reads the load once per interval and sets the thread count."""
        if self.fixed is not None:
            if torch.get_num_threads() != self.fixed:
                _set_threads(self.fixed)
            return self.fixed
        now = time.monotonic()
        if self._last is not None and now - self._last[0] < self.interval_s:
            return self.threads
        if self._last is not None and now - self._last[0] > 4 * self.interval_s:
            self._last, self.threads = None, self.max_threads  # after a pause, the load then says nothing of now
        machine, own = _machine_busy_s(), _own_busy_s()
        if machine is None or own is None:
            return self.threads
        if self._last is not None:
            wall = now - self._last[0]
            others = max(0.0, (machine - self._last[1]) - (own - self._last[2])) / wall  # cores busy elsewhere
            self.threads = max(1, min(self.max_threads, round(os.cpu_count() - others)))
        self._last = (now, machine, own)
        if torch.get_num_threads() != self.threads:
            _set_threads(self.threads)
        return self.threads
