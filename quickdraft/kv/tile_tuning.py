"""Tuning the Triton linears' tiles (``models/triton_tuning``) on one model's static step, at load.

A trial's time is the device's for one sequence's decode step: the bucket's graph, captured again with the trial's
tiles, replayed back to back (``StaticStep.device_seconds``). Its bits are checked on that step and on a forward of
up to 16 rows (the most a tile of the kernel holds, in a bucket of no more), each after a few tokens of context, on
blocks lent by the allocator and given back, against the logits the same forwards gave with the defaults.

A model is tuned once, by the first of its runners to warm up: those that share it (self-speculation's first
layers) take its tiles as they are, so no graph holds other tiles than the layers'. Tuning that cannot run (too few
free blocks) or fails leaves the defaults, and the load goes on (unless the failure left the device itself broken).
"""
from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from quickdraft.kv.blocks import ForwardItem, SequenceKV
from quickdraft.models.triton_linear import BLOCK_M, DEFAULT_TILES
from quickdraft.models.triton_tuning import set_tiles, tile_groups, tune

if TYPE_CHECKING:
    from quickdraft.kv.runner import ModelRunner

log = logging.getLogger(__name__)

CONTEXT = 5  # tokens each probe sequence holds before its checked forward (at position 0 attention returns v alone)
_tuned: weakref.WeakSet = weakref.WeakSet()  # models whose tiles a runner has chosen


def tune_tiles(runner: ModelRunner, measure: Callable[[], float] | None = None) -> list[dict]:
    """Tune the tiles of ``runner``'s model on its static step (``triton_tuning.tune``'s report; empty where no layer
    runs on Triton's kernel or another runner tuned the model; one row with the reason where tuning could not run).
    ``measure``: seconds of a step, by default the device's time of a one-sequence decode step, which needs the
    step's graphs (tests on the CPU give their own)."""
    step = runner.static
    if step is None or runner.model in _tuned:
        return []
    # two programs a multiprocessor: past that a one-row call is bound by its bytes whatever its tiles, and trying
    # choices there would only compile kernels at load
    groups = tile_groups(runner.model, 2 * torch.cuda.get_device_properties(runner.device).multi_processor_count
                         if runner.device.type == "cuda" else None)
    if not groups:
        return []
    if measure is None and not step.graphs:
        raise ValueError("tuning the tiles times the step's graphs: static_step='graphs', or a measure of its own")
    _tuned.add(runner.model)  # (whatever comes of it: another runner's graphs may be captured on these tiles next)
    seqs = max(s for s in step.seq_sizes if s <= 4)
    shapes = [(1, 1), (seqs, max(q for q in step.query_sizes if q <= BLOCK_M // seqs))]
    blocks = sum(count * -(-(CONTEXT + queries) // runner.block_size) for count, queries in shapes)
    if runner.allocator.num_free < blocks:
        return [dict(error=f"not tuned: its probes need {blocks} free KV blocks, {runner.allocator.num_free} free")]
    vocab = runner.logit_columns
    layers = [layer for group in groups.values() for layer in group]
    captured_with: list[list] = [[]]  # the layers' tiles when the step's graphs were last dropped and captured anew

    def forget_stale_graphs() -> None:
        tiles = [layer.tiles for layer in layers]
        if captured_with[0] != tiles:  # (a trial's probe captured the graphs with the tiles its timing runs)
            step.forget_graphs()
            captured_with[0] = tiles

    def probe() -> list[torch.Tensor]:
        forget_stale_graphs()
        logits = []
        for count, queries in shapes:
            kvs = [SequenceKV() for _ in range(count)]
            try:
                for tokens, wanted in ((CONTEXT, 0), (queries, queries)):  # the context, then the checked forward
                    rows = runner.forward([ForwardItem(kv, [(97 * b + 31 * i + 1) % vocab for i in range(tokens)],
                                                       wanted) for b, kv in enumerate(kvs)])
                logits += rows
            finally:
                for kv in kvs:
                    runner.free(kv)
        return logits

    def device_seconds() -> float:
        forget_stale_graphs()
        return min(step.device_seconds(1, 1, runner.logit_columns, repeats=20) for _ in range(2))

    counts = step.forwards, step.replays, step.chunk_forwards
    try:
        reference = probe()
        report = tune(groups, measure or device_seconds,
                      lambda: all(torch.equal(a, b) for a, b in zip(probe(), reference)))
    except Exception as exc:  # noqa: BLE001 - the defaults serve: a load must not fail for want of tuning
        log.warning("the Triton linears keep their default tiles: tuning them failed (%s: %s)", type(exc).__name__, exc)
        set_tiles(layers, DEFAULT_TILES)
        report = [dict(error=f"not tuned: {type(exc).__name__}: {exc}"[:500])]
    step.forget_graphs()
    step.forwards, step.replays, step.chunk_forwards = counts  # (counts of the engine's forwards)
    runner.release_memory()  # the probes' blocks hold nothing
    return report
