"""The command line's LoRA arguments, as vLLM and llama-server users give them (what they mean: ``lora_api.py``)."""
from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from pathlib import Path

from quickdraft.errors import InvalidParameterError
from quickdraft.models.lora import check_choice


@dataclass
class LoraSetup:
    """The adapters the command line names (name -> path), and the scales of those every request runs by default."""

    adapters: dict[str, str]
    scales: dict[str, float]

    def default_choice(self) -> dict[str, float] | None:
        """``SamplingParams.lora`` of a request that names no adapter."""
        return {name: scale for name, scale in self.scales.items() if scale} or None


def add_lora_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lora-modules", nargs="+", action="extend", default=[], metavar="NAME=PATH",
                   help="LoRA adapters (PEFT directories or GGUF LoRAs) a request runs where its `model` names them")
    p.add_argument("--lora", action="append", default=[], metavar="PATH",
                   help="a LoRA adapter every request runs (named by its file's stem; several: repeat, or commas)")
    p.add_argument("--lora-scaled", action="append", default=[], metavar="PATH:SCALE",
                   help="as --lora, with its term scaled")
    p.add_argument("--lora-init-without-apply", action="store_true",
                   help="--lora adapters start at scale 0 (POST /lora-adapters or a request's `lora` sets them)")


def lora_setup(args: argparse.Namespace) -> LoraSetup:
    """The adapters and default scales ``add_lora_arguments``' arguments ask for; raises InvalidParameterError."""
    adapters: dict[str, str] = {}
    for spec in args.lora_modules:
        name, sep, path = spec.partition("=")
        if not (sep and name and path) or name in adapters:
            raise InvalidParameterError(f"--lora-modules takes NAME=PATH, each name once, got {spec!r}")
        adapters[name] = path
    scales: dict[str, float] = {}
    given = [(path, "1") for spec in args.lora for path in spec.split(",")]
    given += [spec.rpartition(":")[::2] for spec in args.lora_scaled]
    for path, scale in given:
        try:
            value = float(scale)
        except ValueError:
            value = math.nan
        if not path or not math.isfinite(value):
            raise InvalidParameterError(f"--lora-scaled takes PATH:SCALE, got {path}:{scale}")
        name, n = Path(path).stem or "lora", 1
        while (f"{name}-{n}" if n > 1 else name) in adapters:  # a second adapter of the same file name
            n += 1
        name = f"{name}-{n}" if n > 1 else name
        adapters[name], scales[name] = path, 0.0 if args.lora_init_without_apply else value
    check_choice(scales or None)  # each scale in range
    return LoraSetup(adapters, scales)
