"""Checks the package's layering: imports go downward only, no import circle, no module over 400 lines, no
function over 100 lines.

Run by the test suite (tests/test_layout.py) and by hand: ``python tools/check_layout.py`` prints each problem and
exits 1 if there is one. Every import counts, also one inside a function (a lazy import still ties the modules
together); only imports under ``if TYPE_CHECKING:`` are left out, since they never run.
"""
from __future__ import annotations

import ast
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
    return found + layer_problems(graph)


def main() -> int:
    root = Path(__file__).resolve().parents[1]
    found = problems(root)
    for line in found:
        print(line)
    print(f"{len(found)} layout problem(s)" if found else "layout ok: imports go downward, no import circle, no "
          f"module over {MAX_MODULE_LINES} lines, no function over {MAX_FUNCTION_LINES} lines")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
