"""Tuning the Triton linears' tiles (``models/triton_tuning``) on one model's static step, at load.

A trial's time is the device's for one sequence's decode step: the bucket's graph, captured again with the trial's
tiles, replayed back to back (``StaticStep.device_seconds``). Its bits are checked on that step and on a forward of
up to 16 rows (the most a tile of the kernel holds), on blocks lent by the allocator and given back, against the
logits the same forwards gave with the defaults.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from quickdraft.kv.blocks import ForwardItem, SequenceKV
from quickdraft.models.triton_linear import BLOCK_M
from quickdraft.models.triton_tuning import tile_groups, tune

if TYPE_CHECKING:
    from quickdraft.kv.runner import ModelRunner


def tune_tiles(runner: ModelRunner, measure: Callable[[], float] | None = None) -> list[dict]:
    """Tune the tiles of ``runner``'s model on its static step (``triton_tuning.tune``'s report; empty where no layer
    runs on Triton's kernel). ``measure``: seconds of a step, by default the device's time of a one-sequence decode
    step, which needs the step's graphs (tests on the CPU give their own)."""
    step = runner.static
    on_gpu = runner.device.type == "cuda"
    # two programs a multiprocessor: past that a one-row call is bound by its bytes whatever its tiles, and trying
    # choices there would only compile kernels at load
    groups = tile_groups(runner.model, 2 * torch.cuda.get_device_properties(runner.device).multi_processor_count
                         if on_gpu else None)
    if step is None or not groups:
        return []
    if measure is None and not step.graphs:
        raise ValueError("tuning the tiles times the step's graphs: static_step='graphs', or a measure of its own")
    seqs = min(step.seq_sizes[-1], 4)
    shapes = [(1, 1), (seqs, min(step.query_sizes[-1], BLOCK_M // seqs))]
    vocab = runner.logit_columns

    def probe() -> list[torch.Tensor]:
        step.forget_graphs()  # (captured with the last trial's tiles)
        logits = []
        for count, queries in shapes:
            kvs = [SequenceKV() for _ in range(count)]
            items = [ForwardItem(kv, [(97 * b + 31 * i + 1) % vocab for i in range(queries)], queries)
                     for b, kv in enumerate(kvs)]
            try:
                logits += runner.forward(items)
            finally:
                for kv in kvs:
                    runner.free(kv)
        return logits

    def device_seconds() -> float:
        step.forget_graphs()  # captured again with the tiles as they are now
        return min(step.device_seconds(1, 1, runner.logit_columns, repeats=20) for _ in range(2))

    reference = probe()
    report = tune(groups, measure or device_seconds,
                  lambda: all(torch.equal(a, b) for a, b in zip(probe(), reference)))
    step.forget_graphs()
    return report
