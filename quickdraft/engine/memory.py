"""How much memory an engine will hold, decided before any weight is loaded: the weights, each KV cache's cap, and
the runtime, checked against ``max_memory`` and the memory the machine has free.

The KV caches grow block by block as sequences need them (``kv/blocks.py``), so a cap costs nothing until used; by
default it is what ``max_num_seqs`` sequences of ``max_model_len`` tokens need, bounded by half the memory left free
once the weights are in (as vLLM's ``gpu_memory_utilization`` bounds the GPU cache).
"""
from __future__ import annotations

import ctypes
import gc
import logging
import re
from dataclasses import dataclass
from pathlib import Path

from quickdraft.errors import InvalidParameterError

log = logging.getLogger(__name__)

GiB = 1 << 30
MiB = 1 << 20
RUNTIME_BYTES = 400 * MiB  # python, torch and the step's buffers: what a process holds besides weights and KV
KV_FREE_FRACTION = 0.5  # of the memory left free after the weights, the most a default KV cap takes


def parse_size(size: int | str, what: str = "kv_cache_memory") -> int:
    """'2GiB', '512MB', '1.5G' or a byte count; a clear error for anything else."""
    if isinstance(size, int) and not isinstance(size, bool) and 0 < size < 1 << 60:
        return size
    m = re.fullmatch(r"\s*(\d{1,20}(?:\.\d{1,20})?)\s*([KMGT]?)(i?B)?\s*", str(size)[:100], re.IGNORECASE)
    value = int(float(m.group(1)) * 1024 ** "_KMGT".index(m.group(2).upper() or "_")) if m else 0
    if not m or not 0 < value < 1 << 60 or isinstance(size, (bool, int)):
        raise InvalidParameterError(f"{what} must be a positive size like '2GiB' or '512MB', got {size!r}")
    return value


def available_memory() -> int:
    """Bytes this process can still take: MemAvailable, and no more than a cgroup (container) limit leaves."""
    free = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                free = int(line.split()[1]) * 1024
    except OSError:
        pass
    for limit_file, used_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),  # cgroup v2, v1
                                  ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                   "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            limit = Path(limit_file).read_text().strip()
            if limit != "max" and int(limit) < 1 << 60:  # v1 writes a huge number for "no limit"
                left = int(limit) - int(Path(used_file).read_text())
                free = min(free if free is not None else 1 << 62, left)
        except (OSError, ValueError):
            pass
    return max(0, free) if free is not None else 8 * GiB


def return_freed_heap() -> None:
    """Hand the heap memory freed while loading (conversion temporaries, a parsed header's objects) back to the
    system: glibc keeps freed chunks for reuse, which would otherwise stay in the process's resident memory."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def fmt_bytes(n: float) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / MiB:.0f} MiB"


@dataclass
class KVNeed:
    """One model's KV cache: bytes per block and the blocks its sequences may hold at once."""

    name: str
    bytes_per_block: int
    blocks: int  # max_num_seqs sequences of a full context plus drafts


@dataclass
class MemoryPlan:
    weights: dict[str, int]  # planned weight bytes by model
    kv_caps: dict[str, int]  # KV cap bytes by model (reserved, filled as used)
    runtime: int = RUNTIME_BYTES

    @property
    def total(self) -> int:
        return sum(self.weights.values()) + sum(self.kv_caps.values()) + self.runtime

    def describe(self) -> str:
        """e.g. 'weights 1.05 GiB, KV up to 0.30 GiB, total up to 1.74 GiB with the runtime'."""
        return (f"weights {fmt_bytes(sum(self.weights.values()))}, KV up to {fmt_bytes(sum(self.kv_caps.values()))}, "
                f"total up to {fmt_bytes(self.total)} with the runtime")


def plan_memory(weights: dict[str, int], kv: list[KVNeed], kv_cache_memory: int | str, min_blocks: int,
                max_memory: int | str | None = None, free: int | None = None) -> MemoryPlan:
    """The KV caps for these weights: ``kv_cache_memory`` bytes for each cache when given, else each cache's need,
    scaled down to fit ``KV_FREE_FRACTION`` of the memory free after the weights (and ``max_memory``), in whole
    blocks. Raises InvalidParameterError when the weights, the runtime and ``min_blocks`` (one sequence) of KV for
    each cache exceed ``max_memory``, before anything is loaded."""
    fixed = sum(weights.values()) + RUNTIME_BYTES
    limit = parse_size(max_memory, "max_memory") if max_memory is not None else None
    if kv_cache_memory != "auto":
        caps = {need.name: parse_size(kv_cache_memory) for need in kv}
        if limit is not None and fixed + sum(caps.values()) > limit:
            raise InvalidParameterError(
                f"kv_cache_memory={kv_cache_memory} for {len(caps)} cache(s) and {fmt_bytes(fixed)} of weights "
                f"and runtime exceed max_memory={max_memory}; lower kv_cache_memory or leave it 'auto'")
        room = (available_memory() if free is None else free) - fixed
        if sum(caps.values()) > room:
            log.warning("kv_cache_memory=%s for %d cache(s) is more than the %s this machine has free: the caches can "
                        "grow past it under load (pass max_memory to refuse such a configuration)",
                        kv_cache_memory, len(caps), fmt_bytes(max(0, room)))
        return MemoryPlan(weights, caps)
    smallest = sum(need.bytes_per_block * min_blocks for need in kv)
    if limit is not None and fixed + smallest > limit:
        raise InvalidParameterError(
            f"max_memory={max_memory} is too small: the weights take {fmt_bytes(sum(weights.values()))}, the runtime "
            f"about {fmt_bytes(RUNTIME_BYTES)} and one sequence's KV cache {fmt_bytes(smallest)}; "
            f"allow at least {fmt_bytes(fixed + smallest)} or lower max_model_len")
    budget = KV_FREE_FRACTION * max(0, (available_memory() if free is None else free) - fixed)
    if limit is not None:
        budget = min(budget, limit - fixed)
    wanted = sum(need.bytes_per_block * need.blocks for need in kv)
    scale = min(1.0, budget / wanted) if wanted else 1.0
    caps = {need.name: max(int(need.blocks * scale), min_blocks) * need.bytes_per_block for need in kv}
    return MemoryPlan(weights, caps)
