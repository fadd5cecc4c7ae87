"""The converted-weight caches stay under $QUICKDRAFT_CACHE_MAX_GB: the least recently used entries are dropped, the
entry in use never is, a dropped model loads again to the same logits, and a bad bound is refused before any
model work."""
from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from fixtures_loading import cache_dir, one_torch_thread, write_tiny_gguf  # noqa: F401
from gguf import GGMLQuantizationType as QT
from quickdraft.cli import main
from quickdraft.errors import InvalidParameterError
from quickdraft.kv import ForwardItem, ModelRunner, SequenceKV
from quickdraft.loading import cache_budget, load_checkpoint
from quickdraft.loading import quantize as qz

IDS = list(range(1, 30))


@pytest.fixture
def files(tmp_path) -> dict[str, Path]:
    """Four tiny GGUF models of one shape (so their cache entries are the same size), different weights."""
    made = {}
    for seed, name in enumerate("abcd"):
        made[name] = tmp_path / f"{name}.gguf"
        write_tiny_gguf(made[name], "qwen2", QT.Q8_0, seed=seed)
    return made


def _logits(path: Path, fmt: str = "int8") -> torch.Tensor:
    model = qz.load_model(load_checkpoint(path, dtype=torch.bfloat16), fmt)
    runner = ModelRunner("t", model, 32 << 20)
    kv = SequenceKV()
    (out,) = runner.forward([ForwardItem(kv, IDS, len(IDS))])
    runner.free(kv)
    return out


def _cached(cache: Path, files: dict[str, Path]) -> dict[str, list[str]]:
    """Per model, the folders holding a cache file of it."""
    owner = {load_checkpoint(p, use_cache=False).fingerprint: name for name, p in files.items()}
    held: dict[str, list[str]] = {}
    for entry in cache_budget.entries(cache):
        held.setdefault(owner[entry.path.name.split("-")[0]], []).append(entry.path.parent.name)
    return {name: sorted(folders) for name, folders in sorted(held.items())}


def test_the_least_recently_used_model_goes_first(cache_dir, files, monkeypatch):
    first = {name: _logits(files[name]) for name in "ab"}
    both = sum(e.size for e in cache_budget.entries())
    one = both / 2  # a model's header record and quantized entry
    # room for two models and a half: the third's entry pushes one out
    monkeypatch.setenv(cache_budget.LIMIT_ENV, str((both + one / 2) / 1e9))
    assert torch.equal(_logits(files["a"]), first["a"])  # a is used again: b is now the least recently used
    _logits(files["c"])
    assert _cached(cache_dir, files) == {"a": ["quantized", "weights"], "c": ["quantized", "weights"]}
    assert torch.equal(_logits(files["b"]), first["b"])  # rebuilt from its file; now a is the oldest
    assert _cached(cache_dir, files) == {"b": ["quantized", "weights"], "c": ["quantized", "weights"]}


def test_a_target_read_before_its_draft_keeps_its_entry(cache_dir, files, monkeypatch):
    """As an engine loads: the target's checkpoint, then the draft's (converted and cached), then the target's model
    from its entry, which the draft's new entry must not have pushed out, however long ago the target last ran."""
    for name in "cab":  # c's entries are the least recently used
        _logits(files[name])
    monkeypatch.setenv(cache_budget.LIMIT_ENV, str(sum(e.size for e in cache_budget.entries()) / 1e9))
    target = load_checkpoint(files["c"], dtype=torch.bfloat16)
    qz.load_model(load_checkpoint(files["d"], dtype=torch.bfloat16), "int8")  # the draft
    monkeypatch.setattr(qz, "quantized_layers", _converts)
    qz.load_model(target, "int8")
    assert _cached(cache_dir, files) == {name: ["quantized", "weights"] for name in "bcd"}


def _converts(*args, **kwargs):
    raise AssertionError("the target was converted again: its cache entry was dropped")


@pytest.mark.parametrize("bound", ["0", "1e-300"])
@pytest.mark.parametrize("fmt", ["int8", "bfloat16"])
def test_a_zero_bound_keeps_only_the_entry_in_use(cache_dir, files, monkeypatch, bound, fmt):
    expected = _logits(files["a"], fmt)
    monkeypatch.setenv(cache_budget.LIMIT_ENV, bound)
    for name in "ab":
        _logits(files[name], fmt)
    folder = "quantized" if fmt == "int8" else "weights"  # a float model maps its dequantized tensors
    assert _cached(cache_dir, files) == {"b": [folder]}
    assert torch.equal(_logits(files["a"], fmt), expected)
    assert _cached(cache_dir, files) == {"a": [folder]}


@pytest.mark.parametrize("bound", ["nan", "-1", "inf", "1e400", "1e300", "ten", "0x10", "-0.5"])
def test_a_bad_bound_is_refused_before_any_model_work(cache_dir, files, monkeypatch, capsys, bound):
    monkeypatch.setenv(cache_budget.LIMIT_ENV, bound)
    with pytest.raises(InvalidParameterError, match=f"{cache_budget.LIMIT_ENV}=.*number of GB >= 0.*'none'"):
        load_checkpoint(files["a"])
    assert cache_budget.usage(cache_dir) == {}
    assert main(["cache"]) == 2 and cache_budget.LIMIT_ENV in capsys.readouterr().err
    (cache_dir / "weights").mkdir()
    (cache_dir / "weights" / f"{'0' * 32}-header-v3.json").write_text("{}")
    assert main(["cache", "--clear"]) == 2  # refused before anything is removed
    assert cache_budget.usage(cache_dir) == {"weights": (1, 2)}


def test_no_bound_keeps_everything(cache_dir, files, monkeypatch):
    monkeypatch.setenv(cache_budget.LIMIT_ENV, "none")
    for path in files.values():
        _logits(path)
    assert _cached(cache_dir, files) == {name: ["quantized", "weights"] for name in "abcd"}


def test_cache_command_lists_and_clears_only_converted_weights(cache_dir, files, capsys):
    _logits(files["a"])
    (cache_dir / "models").mkdir()
    (cache_dir / "models" / "assembled.gguf").write_bytes(b"x" * 1000)  # an assembled package: kept
    assert main(["cache"]) == 0
    listing = capsys.readouterr().out
    assert str(cache_dir) in listing and "64 GB" in listing
    assert [line.split()[:2] for line in listing.splitlines()[1:]] == [["models", "1"], ["quantized", "1"],
                                                                      ["weights", "1"]]
    assert main(["cache", "--clear"]) == 0
    assert capsys.readouterr().out.startswith("removed 2 converted-weight files")
    assert cache_budget.usage(cache_dir) == {"models": (1, 1000), "quantized": (0, 0), "weights": (0, 0)}


def test_only_its_own_entries_are_removed_and_never_one_being_written(cache_dir, files, monkeypatch):
    """Entries another process is still writing stay, one abandoned goes; files quickdraft did not name stay."""
    monkeypatch.setenv(cache_budget.LIMIT_ENV, "0")
    (cache_dir / "quantized").mkdir()
    writing = cache_dir / "quantized" / f"{'0' * 32}-int8-0123456789abcdef.safetensors.x1_y2.tmp"
    abandoned = cache_dir / "quantized" / f"{'1' * 32}-int8-0123456789abcdef.safetensors.z3w4.tmp"
    foreign = [cache_dir / "quantized" / "my-model.safetensors", cache_dir / "quantized" / "notes.json"]
    for path in (writing, abandoned, *foreign):
        path.write_bytes(b"\0" * 4096)
    hour_ago = time.time() - cache_budget.ABANDONED_S - 1
    for path in (abandoned, *foreign):
        os.utime(path, (hour_ago, hour_ago))
    _logits(files["a"])
    assert writing.exists() and not abandoned.exists() and all(path.exists() for path in foreign)
    assert _cached(cache_dir, files) == {"a": ["quantized"]}
    assert main(["cache", "--clear"]) == 0
    assert writing.exists() and all(path.exists() for path in foreign) and _cached(cache_dir, files) == {}
