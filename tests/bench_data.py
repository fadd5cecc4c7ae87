"""The public prompt sets the tests read (bench/data, shipped in the repository).

A test that needs one of them fails naming the file when it is missing, instead of checking something else.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

BENCH_DATA = Path(__file__).resolve().parents[1] / "bench" / "data"


def bench_file(name: str) -> Path:
    """``bench/data/<name>``; fails the calling test when the file is not there."""
    path = BENCH_DATA / name
    if not path.is_file():
        pytest.fail(f"{path} is missing: the tests read the prompt sets shipped in bench/data (see its README)",
                    pytrace=False)
    return path


def bench_records(name: str) -> list[dict]:
    """Every JSON record of ``bench/data/<name>``."""
    return [json.loads(line) for line in bench_file(name).read_text(encoding="utf-8").splitlines() if line.strip()]
