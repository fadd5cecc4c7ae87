"""Choosing the Triton linears' tiles on the device (models/triton_tuning.py, kv/tile_tuning.py), run on the CPU under
Triton's interpreter (and on a GPU by bench/gpu_check.sh): every choice gives the defaults' bits in every format,
gated or not, with a norm or a bias, for a decode step's rows; the tuner keeps the fastest choice whose step kept
its bits, group by group; a whole model tuned on its own static step gives the tokens it gave before."""
from __future__ import annotations

import importlib.util

import pytest
import torch

from quickdraft.models import triton_linear, triton_ops, triton_tuning
from quickdraft.models.triton_linear import DEFAULT_TILES, AddNorm, Tiles
from quickdraft.models.triton_tuning import TILE_SHAPES, choices, default_programs, tune
from test_triton_linear import kernel_call

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
IN_FEATURES = triton_linear.CHUNK_K + 64  # two chunks of K, the second partly outside: split choices too
OUT_FEATURES = 40  # a part of one 64-column tile, three of 16


@pytest.fixture(autouse=True)
def interpreted(monkeypatch):
    monkeypatch.setattr(triton_linear, "KERNEL_ON_CPU", True)
    monkeypatch.setattr(triton_ops, "KERNEL_ON_CPU", True)


def every_choice() -> list[Tiles]:
    return [Tiles(block_n, warps, split) for block_n, warps in TILE_SHAPES for split in (False, True)]


@pytest.mark.parametrize("bits", [4, 8, 16])
@pytest.mark.parametrize("gate,norm", [(None, False), ("silu", False), (None, True), ("silu", True)])
def test_every_choice_gives_the_defaults_bits(bits, gate, norm):
    """One row, and the most rows a tile holds: the bits of the default tiles, whatever the columns a program, the
    warps, or K's chunks apart (a call with a norm never splits, whatever its tiles say)."""
    g = torch.Generator().manual_seed(bits)
    out_features = 2 * OUT_FEATURES if gate else OUT_FEATURES
    bias = torch.randn(out_features, generator=g).to(DEVICE)
    run, _ = kernel_call(bits, torch.randn(out_features, IN_FEATURES, generator=g).to(DEVICE), bias)
    for rows in (1, triton_linear.BLOCK_M):
        x = torch.randn(rows, IN_FEATURES, generator=g).to(DEVICE)
        add_norm = AddNorm(torch.randn(rows, IN_FEATURES, generator=g).to(DEVICE),
                           torch.rand(IN_FEATURES, generator=g).to(DEVICE) + 0.5, 1e-6) if norm else None
        if norm and not triton_linear.takes_norm(OUT_FEATURES, IN_FEATURES):
            pytest.skip("this shape keeps the norm's own kernel")
        expected = run(x, gate=gate, norm=add_norm)
        for tiles in every_choice():
            got = run(x, gate=gate, norm=add_norm, tiles=tiles)
            for a, b in zip(got if norm else [got], expected if norm else [expected]):
                assert torch.equal(a, b), (rows, tiles)


def test_tiles_are_checked_and_longer_calls_take_the_defaults():
    with pytest.raises(ValueError, match="16, 32, 64 or 128 output columns"):
        Tiles(block_n=48)
    with pytest.raises(ValueError, match="1, 2, 4 or 8 warps"):
        Tiles(warps=3)
    with pytest.raises(ValueError, match="split is None"):
        Tiles(split=1.5)
    g = torch.Generator().manual_seed(1)
    run, _ = kernel_call(8, torch.randn(OUT_FEATURES, IN_FEATURES, generator=g).to(DEVICE))
    x = torch.randn(triton_linear.BLOCK_M + 1, IN_FEATURES, generator=g).to(DEVICE)
    assert torch.equal(run(x, tiles=Tiles(16, 4, True)), run(x))


class Layer(triton_linear.TiledLayer):
    """A layer as the tuner sees it: its shape and tiles (the tuner's own logic, with the times and bits given)."""

    def __init__(self, in_features: int) -> None:
        self.in_features, self.out_features = in_features, 64

    def tile_key(self) -> tuple:
        return ("int8", self.out_features, self.in_features, False)


def test_the_tuner_keeps_the_fastest_choice_that_keeps_the_bits():
    wide, narrow = [Layer(4096), Layer(4096)], [Layer(256)]
    assert len(choices(wide[0])) == 2 * len(TILE_SHAPES) and len(choices(narrow[0])) == len(TILE_SHAPES)
    assert default_programs(wide[0]) == 8 and default_programs(narrow[0]) == 1  # K's 8 chunks apart; one tile
    gate_up = Layer(256)
    gate_up.out_features = 4 * 64
    assert default_programs(gate_up) == 4 and default_programs(gate_up, gated=True) == 2  # a column of each half
    fastest_split = Tiles(16, 4, True)  # the fastest of all, but its bits differ: never kept
    times = {fastest_split: 0.1, Tiles(32, 4, True): 0.5, Tiles(32, 4, False): 0.9}

    def same_bits() -> bool:
        if narrow[0].tiles.block_n == 32:
            raise RuntimeError("out of resources")  # as a compiler refuses a tile on some card
        return wide[0].tiles != fastest_split

    def measure() -> float:
        if wide[0].tiles == Tiles(64, 4, False):
            raise RuntimeError("capture failed")  # a trial's timing fails: the choice is passed over
        return times.get(wide[0].tiles, 1.0) + (0.2 if narrow[0].tiles == Tiles(16, 4, False) else 0.0)

    report = tune({"wide": wide, "narrow": narrow}, measure, same_bits)
    assert all(layer.tiles == Tiles(32, 4, True) for layer in wide)
    assert narrow[0].tiles == DEFAULT_TILES  # nothing ran faster than the defaults
    assert report[0]["seconds"] == 1.0 and report[-1]["seconds"] == 0.5
    rejected = [row for row in report if not row["same_bits"]]
    assert len(rejected) == 3 and all("seconds" not in row for row in rejected)
    assert [row.get("error") for row in rejected] == ["RuntimeError: capture failed", None,
                                                       "RuntimeError: out of resources"]
    assert len(report) == 2 + len(choices(wide[0])) + len(choices(narrow[0]))


@pytest.mark.skipif(DEVICE == "cuda", reason="on a GPU every load tunes its step (tests/test_cuda.py)")
def test_a_model_tuned_on_its_own_step_gives_its_tokens(tiny_dir, monkeypatch):
    """An int8 model's static step as a GPU runs it (the CPU under the interpreter, where times say nothing: each
    trial's is given, the narrowest unsplit tiles fastest). Every group of layers tried every choice (of the widest
    and the narrowest tiles: every choice's bits are test_every_choice_gives_the_defaults_bits'), each kept the
    step's bits, each group took the fastest, the probes' blocks went back, and the greedy tokens after are those
    before."""
    from quickdraft import LLM, SamplingParams
    from quickdraft.kv import paged_attention
    from quickdraft.kv.tile_tuning import tune_tiles
    from quickdraft.models import quant_backends
    from quickdraft.models.triton_tuning import tile_groups

    monkeypatch.setattr(quant_backends, "default_backend", lambda device: "triton")
    monkeypatch.setattr(paged_attention, "KERNEL_ON_CPU", True)
    monkeypatch.setattr(triton_tuning, "TILE_SHAPES", (TILE_SHAPES[0], TILE_SHAPES[-1]))  # (the interpreter is slow)
    llm = LLM(str(tiny_dir(arch="qwen2", vocab_size=64, layers=1)), dtype="float32", weights="int8",
              kv_cache_memory="16MiB", static_step="eager", max_num_seqs=4)
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    prompts = [[5, 9, 13, 2, 7, 5, 9, 13], [3, 3, 8]]
    before = [o.token_ids for o in llm.generate(prompts, params)]
    runner = llm.loaded.engine.target
    groups = tile_groups(runner.model)
    assert len(groups) >= 4  # q/k/v, o, gate/up, down (and the head where it is int8)
    assert tile_groups(runner.model, fewer_programs_than=1) == {}
    with pytest.raises(ValueError, match="times the step's graphs"):
        tune_tiles(runner)
    narrowest = Tiles(16, 4, False)
    layers = [layer for group in groups.values() for layer in group]
    step, allocator = runner.static, runner.allocator
    before_state = allocator.num_free, allocator.trim(), step.forwards, step.chunk_forwards
    report = tune_tiles(runner, measure=lambda: sum(layer.tiles != narrowest for layer in layers))
    assert (allocator.num_free, allocator.high_water, step.forwards, step.chunk_forwards) == before_state
    assert len(report) == 2 + sum(len(choices(group[0])) for group in groups.values())
    assert all(row["same_bits"] for row in report) and report[-1]["seconds"] == 0
    assert all(layer.tiles == narrowest for layer in layers)
    assert tune_tiles(runner, measure=lambda: 0.0) == []  # a model is tuned once (runners may share it)
    assert [o.token_ids for o in llm.generate(prompts, params)] == before


@pytest.mark.skipif(DEVICE == "cuda", reason="on a GPU every load tunes its step (tests/test_cuda.py)")
def test_a_pool_too_small_for_the_probes_keeps_the_defaults(tiny_dir, monkeypatch):
    """Three KV blocks load and generate; the probes would need more: the model keeps its default tiles, the reason
    in the report, nothing raises, and no other runner of the model tunes it later."""
    from quickdraft import LLM
    from quickdraft.kv.tile_tuning import tune_tiles
    from quickdraft.models import quant_backends
    from quickdraft.models.triton_tuning import tile_groups

    monkeypatch.setattr(quant_backends, "default_backend", lambda device: "triton")
    llm = LLM(str(tiny_dir(arch="qwen2", vocab_size=64, layers=1)), dtype="float32", weights="int8",
              kv_cache_memory="12KiB", static_step="eager", max_num_seqs=4)
    runner = llm.loaded.engine.target
    assert runner.allocator.num_free == 3
    report = tune_tiles(runner, measure=lambda: 0.0)
    assert len(report) == 1 and "free KV blocks" in report[0]["error"]
    assert tune_tiles(runner, measure=lambda: 0.0) == []  # marked all the same: a runner sharing it must not tune it
    assert all(layer.tiles == DEFAULT_TILES for group in tile_groups(runner.model).values() for layer in group)
