"""The package's layering stays checkable: imports go downward, no import circle, no module over 400 lines, no
function over 100; and a clone stands alone: nothing reads a path outside the repository."""
from __future__ import annotations

import importlib.util
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("check_layout", ROOT / "tools" / "check_layout.py")
check_layout = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check_layout)


def test_quickdraft_layout_is_clean():
    assert check_layout.problems(ROOT) == []


def test_the_check_finds_circles_long_modules_and_long_functions(tmp_path):
    pkg = tmp_path / "quickdraft"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from quickdraft.sub import b\n")
    (pkg / "models.py").write_text("import quickdraft.engine\n")  # a lower layer importing a higher one
    (pkg / "engine.py").write_text("")
    (pkg / "sub" / "b.py").write_text("def f():\n    from quickdraft import a  # a lazy import still ties them\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from quickdraft import a\n")
    (pkg / "long.py").write_text("x = 1\n" * 401)
    body = textwrap.indent("y = 1\n" * 100, "    ")
    (pkg / "func.py").write_text(f"def g():\n{body}")
    found = check_layout.problems(tmp_path)
    assert found == ["quickdraft/func.py:1: function g has 101 lines (at most 100)",
                     "quickdraft/long.py: 401 lines (at most 400)",
                     "import circle: quickdraft.a <-> quickdraft.sub.b",
                     "quickdraft.a: its layer is not in LAYERS (tools/check_layout.py)",
                     "quickdraft.c: its layer is not in LAYERS (tools/check_layout.py)",
                     "quickdraft.func: its layer is not in LAYERS (tools/check_layout.py)",
                     "quickdraft.long: its layer is not in LAYERS (tools/check_layout.py)",
                     "quickdraft.models imports quickdraft.engine, a layer above it",
                     "quickdraft.sub: its layer is not in LAYERS (tools/check_layout.py)",
                     "quickdraft.sub.b: its layer is not in LAYERS (tools/check_layout.py)"]


def test_the_check_finds_paths_outside_the_repository(tmp_path):
    """The paths a fresh clone lacks: above the root through __file__, '..' segments, a user's absolute folders."""
    (tmp_path / "quickdraft").mkdir()
    (tmp_path / "quickdraft" / "__init__.py").write_text("")
    (tmp_path / "bench").mkdir()
    dots = "." * 2  # written out, this file would be a finding itself
    (tmp_path / "bench" / "data.py").write_text(textwrap.dedent(f"""\
        from pathlib import Path
        HERE = Path(__file__).resolve().parents[1] / "bench" / "data"  # the root: fine
        ABOVE = Path(__file__).resolve().parents[2] / "sibling" / "prompts"
        ROOT = Path(__file__).parent.parent
        BESIDE = ROOT.parent / "sibling"
        FIXED = "/work/sibling/prompts/spec_bench.public.jsonl"
        ROUTE = "/v1/chat/completions"  # not a file
        UP = "data/{dots}/{dots}/x"
        """))
    (tmp_path / ".venv" / "lib").mkdir(parents=True)
    (tmp_path / ".venv" / "lib" / "site.py").write_text(f'X = "{dots}/outside"\n')  # an environment is not the project
    assert check_layout.problems(tmp_path) == [
        "bench/data.py:3: Path(__file__).resolve().parents[2] is above the repository root",
        "bench/data.py:5: ROOT.parent is above the repository root",
        "bench/data.py:6: '/work/sibling/prompts/spec_bench.public.jsonl' is an absolute path outside the repository",
        f"bench/data.py:8: 'data/{dots}/{dots}/x' names a parent folder ('{dots}')"]


def test_missing_prompt_data_fails_naming_the_file(monkeypatch, tmp_path):
    """A clone without bench/data fails the tests that read it, naming the file, instead of checking less."""
    import conftest

    assert conftest.bench_records("humaneval.public.jsonl")  # shipped in the repository
    monkeypatch.setattr(conftest, "BENCH_DATA", tmp_path)
    with pytest.raises(pytest.fail.Exception, match=f"{tmp_path}/spec_bench.public.jsonl is missing"):
        conftest.bench_records("spec_bench.public.jsonl")
