"""Choosing how the Triton linears run a decode step's calls (``triton_linear.Tiles``) on the device itself.

A batch-1 decode step calls each projection on one row. The kernel's programs are then its output tiles (and K's
chunks, where they run apart): a mid-sized weight (a 1.5B's o projection, 24 tiles of 64 columns; a 135M's, 9) runs
on a few of a GPU's 132 multiprocessors, each program waiting on its own loads. Narrower tiles, or K's chunks in
programs of their own, make more programs; which of them pays depends on the shape and the
card, and only the card can say. So where the step replays CUDA graphs, every group of layers of one shape
(``TiledLayer.tile_key``) tries each choice in turn at load, the other groups held, and keeps the one whose whole
step ran fastest on the device (``tune``).

A choice is kept only where the step's logits with it are, bit for bit, those with the defaults (``same_bits``):
tiles change which program sums which outputs, not the order of one output's sums, by design; the check, on the
probes' inputs, holds the card and compiler at hand to that, so a choice that changed any bit there is never kept.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict

from torch import nn

from quickdraft.models.triton_linear import CHUNK_K, DEFAULT_TILES, GatedProjection, TiledLayer, Tiles, splits

# (output columns, warps) a program: the default, and narrower tiles (with fewer warps an int4 tile's registers
# spill more, compiled for sm_90)
TILE_SHAPES = ((64, 4), (32, 4), (16, 4))


def tile_groups(model: nn.Module, fewer_programs_than: int | None = None) -> dict[tuple, list[TiledLayer]]:
    """The model's layers whose calls run on Triton's linear kernel, by ``tile_key``, the largest weights first;
    with ``fewer_programs_than``, only those whose one-row call runs fewer programs than that with the defaults (a
    call with a program or two for each multiprocessor already is bound by the bytes, whatever its tiles)."""
    groups: dict[tuple, list[TiledLayer]] = {}
    gated = {id(module.projection) for module in model.modules() if isinstance(module, GatedProjection)}
    for module in model.modules():
        key = module.tile_key() if isinstance(module, TiledLayer) else None
        if key is not None and (fewer_programs_than is None
                                or default_programs(module, id(module) in gated) < fewer_programs_than):
            groups.setdefault(key, []).append(module)
    return dict(sorted(groups.items(), key=lambda item: -len(item[1]) * item[1][0].out_features
                       * item[1][0].in_features))


def default_programs(layer: TiledLayer, gated: bool = False) -> int:
    """The programs of a one-row call of ``layer`` with the defaults; ``gated``: its calls are a gate/up projection's
    (``GatedProjection``), whose programs each write a column of the output's half."""
    width = layer.out_features // 2 if gated else layer.out_features
    tiles = -(-width // DEFAULT_TILES.block_n)
    if not splits(1, width, layer.in_features):
        return tiles
    return -(-layer.out_features // DEFAULT_TILES.block_n) * -(-layer.in_features // CHUNK_K)  # (split: every column)


def choices(layer: TiledLayer) -> list[Tiles]:
    """The tiles to try on a layer: each shape unsplit, and split where K has more than one chunk."""
    split_or_not = (False, True) if layer.in_features > CHUNK_K else (False,)
    return [Tiles(block_n, warps, split) for block_n, warps in TILE_SHAPES for split in split_or_not]


def tune(groups: dict[tuple, list[TiledLayer]], measure: Callable[[], float], same_bits: Callable[[], bool]
         ) -> list[dict]:
    """Give each group the tiles under which ``measure`` (seconds of a step) was least, among those under which
    ``same_bits`` held (a choice whose check or timing raises, one the card or its compiler cannot run, is passed
    over), one group at a time, the others as chosen so far; each choice is timed on one row (a decode step at
    batch 1) and serves every call of up to 16 rows. Returns a row per trial: the defaults' step first, then each
    group's choices, then the chosen step's (measured again)."""
    for layers in groups.values():
        set_tiles(layers, DEFAULT_TILES)
    best = measure()
    report = [dict(group="every layer", tiles=asdict(DEFAULT_TILES), same_bits=True, seconds=best)]
    for key, layers in groups.items():
        chosen = DEFAULT_TILES
        try:
            for tiles in choices(layers[0]):
                set_tiles(layers, tiles)
                row = dict(group=list(key), layers=len(layers), tiles=asdict(tiles), same_bits=False)
                try:
                    row["same_bits"] = same_bits()
                    if row["same_bits"]:
                        row["seconds"] = measure()
                except Exception as exc:  # noqa: BLE001 - a choice this card or compiler cannot run is not taken
                    row.update(same_bits=False, error=f"{type(exc).__name__}: {exc}"[:500])
                if "seconds" in row and row["seconds"] < best:
                    chosen, best = tiles, row["seconds"]
                report.append(row)
        finally:
            set_tiles(layers, chosen)
    report.append(dict(group="every layer, as chosen", tiles=None, same_bits=True, seconds=measure()))
    return report


def set_tiles(layers: list[TiledLayer], tiles: Tiles) -> None:
    """Give every layer of ``layers`` the same ``tiles``."""
    for layer in layers:
        layer.tiles = tiles
