"""Shared benchmark pieces: the machine, its memory bandwidth, public prompt samples, HF timing, output."""
from __future__ import annotations

import json
import math
import os
import platform
import time
from pathlib import Path

import torch

BENCH_DATA = Path(__file__).resolve().parent / "data"  # the public prompt sets (bench/data/README.md)
RESULTS = Path(__file__).resolve().parent / "results"


def machine() -> dict:
    cpu = "unknown"
    if Path("/proc/cpuinfo").exists():
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return {"cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(), "memory_gib": round(mem_gb, 1),
            "torch": torch.__version__, "python": platform.python_version(),
            "load_average": os.getloadavg()[0], "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None}


def memory_bandwidth_gbs(size_mib: int = 1024, repeats: int = 5) -> float:
    """Read bandwidth: the best of a few full passes summing a buffer much larger than the caches."""
    x = torch.ones(size_mib * 2**20 // 4, dtype=torch.float32)
    x.sum()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return x.numel() * 4 / best / 1e9


def weight_bytes_per_token(model: torch.nn.Module) -> int:
    """Bytes of weights one decode step of a quickdraft model reads (``quickdraft.models.step_weight_bytes``)."""
    from quickdraft.models import step_weight_bytes
    return step_weight_bytes(model)


def gguf_step_bytes(path: Path) -> int:
    """Bytes of a GGUF's tensors one decode step reads when each runs in the file's own type (as llama.cpp runs it):
    every tensor but the embedding table, unless the head is tied to it and reads it whole; of a block's stacked
    experts, the ``expert_used_count`` a token chooses."""
    from quickdraft.loading.ggml_types import BY_NAME, ggml_type
    from quickdraft.loading.gguf_families import is_stacked
    from quickdraft.loading.gguf_metadata import tensor_shapes
    from quickdraft.loading.quantize import experts_used
    table = tensor_shapes(path)
    used = experts_used(path) if any(is_stacked(name) for name in table) else 0
    total = 0
    for name, (kind, shape) in table.items():
        if name == "token_embd.weight" and "output.weight" in table:
            continue
        t = ggml_type(BY_NAME[kind])
        nbytes = math.prod(shape) // t.block * t.type_size
        total += nbytes * used // shape[0] if is_stacked(name) else nbytes
    return total


def humaneval_prompts(count: int) -> list[str]:
    """The first ``count`` public HumanEval prompts (a fixed, stated sample)."""
    lines = (BENCH_DATA / "humaneval.public.jsonl").read_text().splitlines()
    return [json.loads(l)["prompt"] for l in lines[:count]]


def spec_bench_prompts(per_category: int, categories: tuple[str, ...] | None = None) -> list[tuple[str, str]]:
    """(category, first turn) for the first ``per_category`` public records of each Spec-Bench category."""
    records = [json.loads(l) for l in (BENCH_DATA / "spec_bench.public.jsonl").read_text().splitlines()]
    out: dict[str, list[str]] = {}
    for r in records:
        cat = r["category"]
        if categories is not None and cat not in categories:
            continue
        bucket = out.setdefault(cat, [])
        if len(bucket) < per_category:
            bucket.append(r["turns"][0])
    return [(c, t) for c, ts in out.items() for t in ts]


class TimingStreamer:
    """HF streamer that timestamps every generated token, so decode speed excludes the prefill."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass

    def decode_tokens_per_s(self) -> float:
        if len(self.times) < 2:
            return 0.0
        return (len(self.times) - 1) / (self.times[-1] - self.times[0])


def save(name: str, payload: dict) -> Path:
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2))
    return path


def table(rows: list[dict], columns: list[str]) -> str:
    widths = [max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in columns]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths)),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(_fmt(r.get(c)).ljust(w) for c, w in zip(columns, widths)) for r in rows]
    return "\n".join(lines)


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.2f}"
    return "" if v is None else str(v)
