"""Checks the package's layering: imports go downward only, no import circle, no module over 400 lines, no
function over 100 lines; and that no Python file of the repository reads a path outside it.

Run by the test suite (tests/test_layout.py) and by hand: ``python tools/check_layout.py`` prints each problem and
exits 1 if there is one. Every import counts, also one inside a function (a lazy import still ties the modules
together); only imports under ``if TYPE_CHECKING:`` are left out, since they never run.

A clone stands alone: a path built from ``__file__`` that climbs above the repository root, a ``..`` path segment
in a string, or an absolute path into a user's folders (``/work/``, ``/home/``...) is a problem wherever it is
(library, tests, benchmarks, tools). The user's cache directory and temporary files are reached through the
library's own functions, never by a literal path.
"""
from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 100
PACKAGE = "quickdraft"
# the layers, lowest first: a module may import its own layer and the ones before it (docs/ARCHITECTURE.md)
LAYERS = (
    ("config", "errors", "paths"),
    ("models",),
    ("tokenizer", "sampling"),
    ("loading",),
    ("kv",),
    ("speculative",),
    ("engine",),
    ("snapshot_checks", "snapshot", "session"),
    ("llm",),
    ("serving",),
    ("cli",),
)
RANK = {part: rank for rank, parts in enumerate(LAYERS) for part in parts}
# folders of the repository that are not its own code: environments, build outputs, version control
SKIPPED_FOLDERS = {".git", ".venv", "venv", "build", "dist", "node_modules", "__pycache__"}
PARENT_SEGMENT = re.compile(r"(^|[/\\])\.\.([/\\]|$)")
USER_FOLDERS = tuple(f"/{name}/" for name in ("work", "home", "root", "mnt", "media", "srv", "Users", "shared"))


def layer_problems(graph: dict[str, set[str]]) -> list[str]:
    """Imports from a higher layer (the package's own __init__, its front door, may import anything)."""
    found = []
    for name, targets in sorted(graph.items()):
        part = name.split(".")[1] if "." in name else None
        if part is None:
            continue
        if part not in RANK:
            found.append(f"{name}: its layer is not in LAYERS (tools/check_layout.py)")
            continue
        for target in sorted(targets):
            other = target.split(".")[1] if "." in target else None
            if other is not None and RANK.get(other, -1) > RANK[part]:
                found.append(f"{name} imports {target}, a layer above it")
    return found


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _under_type_checking(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return True
    return False


def imports_of(tree: ast.Module, name: str, is_package: bool, known: set[str]) -> set[str]:
    """The package's modules this module imports (``from a.b import c`` counts a.b.c when that is a module)."""
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    base = name if is_package else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Import, ast.ImportFrom)) or _under_type_checking(node, parents):
            continue
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            source = node.module or ""
            if node.level:
                anchor = base.split(".")[: len(base.split(".")) - node.level + 1]
                source = ".".join(anchor + ([source] if source else []))
            targets = [f"{source}.{alias.name}" for alias in node.names] + [source]
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _climb(node: ast.AST, names: dict[str, int]) -> int | None:
    """How many folders up from its own file a path expression anchored at ``__file__`` reaches (``Path(__file__)``
    is 0, its ``.parent`` 1, ``.parents[k]`` k + 1); None for anything else."""
    if isinstance(node, ast.Name):
        return names.get(node.id)
    if isinstance(node, ast.Call):
        func = node.func
        callee = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        if callee.endswith("Path") and node.args and isinstance(node.args[0], ast.Name) and node.args[0].id == "__file__":
            return 0
        if isinstance(func, ast.Attribute) and func.attr in ("resolve", "absolute"):
            return _climb(func.value, names)
        return None
    if isinstance(node, ast.Attribute) and node.attr == "parent":
        below = _climb(node.value, names)
        return None if below is None else below + 1
    if (isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) and node.value.attr == "parents"
            and isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, int)):
        below = _climb(node.value.value, names)
        return None if below is None else below + node.slice.value + 1
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
        return _climb(node.left, names)  # joining names below a folder stays in it (".." is caught as a string)
    return None


def outside_path_problems(tree: ast.Module, relative: Path) -> list[str]:
    """References in one file to a path outside the repository (``relative``: the file's path inside it)."""
    found: dict[int, str] = {}
    depth = len(relative.parts)  # climbing this many folders from the file reaches the repository root
    names: dict[str, int] = {}
    nodes = sorted((n for n in ast.walk(tree) if hasattr(n, "lineno")), key=lambda n: (n.lineno, n.col_offset))
    for node in nodes:
        where = f"{relative.as_posix()}:{node.lineno}"
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            level = _climb(node.value, names)
            if level is not None:
                names[node.targets[0].id] = level
        elif isinstance(node, (ast.Attribute, ast.Subscript)) and (_climb(node, names) or 0) > depth:
            found.setdefault(node.lineno, f"{where}: {ast.unparse(node)} is above the repository root")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if PARENT_SEGMENT.search(node.value):
                found.setdefault(node.lineno, f"{where}: {node.value[:60]!r} names a parent folder ('..')")
            elif node.value.startswith(USER_FOLDERS):
                found.setdefault(node.lineno, f"{where}: {node.value[:60]!r} is an absolute path outside the "
                                              f"repository")
    return [found[line] for line in sorted(found)]


def repository_files(root: Path) -> list[Path]:
    """The repository's own Python files: everything under ``root`` but environments and build outputs."""
    return sorted(f for f in root.rglob("*.py")
                  if not SKIPPED_FOLDERS.intersection(f.relative_to(root).parts[:-1]))


def problems(root: Path) -> list[str]:
    """Every layout problem of the package under ``root`` (the folder that holds ``quickdraft/``)."""
    files = sorted((root / PACKAGE).rglob("*.py"))
    known = {module_name(f, root) for f in files}
    graph, found = {}, []
    for f in files:
        text = f.read_text()
        name = module_name(f, root)
        lines = text.count("\n") + (not text.endswith("\n"))
        if lines > MAX_MODULE_LINES:
            found.append(f"{f.relative_to(root)}: {lines} lines (at most {MAX_MODULE_LINES})")
        tree = ast.parse(text)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    found.append(f"{f.relative_to(root)}:{node.lineno}: function {node.name} has {length} lines "
                                 f"(at most {MAX_FUNCTION_LINES})")
        graph[name] = imports_of(tree, name, f.name == "__init__.py", known)
    # a package's __init__ re-exporting its own modules is not a circle through them
    for name in graph:
        graph[name] = {t for t in graph[name] if not (name + ".").startswith(t + ".")}
    for cycle in find_cycles(graph):
        found.append("import circle: " + " <-> ".join(cycle))
    found += layer_problems(graph)
    for f in repository_files(root):
        found += outside_path_problems(ast.parse(f.read_text()), f.relative_to(root))
    return found


def main() -> int:
    root = Path(__file__).resolve().parents[1]
    found = problems(root)
    for line in found:
        print(line)
    print(f"{len(found)} layout problem(s)" if found else "layout ok: imports go downward, no import circle, no "
          f"module over {MAX_MODULE_LINES} lines, no function over {MAX_FUNCTION_LINES} lines, no path outside the "
          f"repository")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
