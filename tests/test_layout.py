"""The package's layering stays checkable: imports go downward, no import circle, no module over 400 lines, no
function over 100."""
from __future__ import annotations

import importlib.util
import textwrap
from pathlib import Path

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
