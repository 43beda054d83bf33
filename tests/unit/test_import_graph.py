"""No import circles in ``lightning_5d``: the module-level imports form a DAG.

Read from the source (ast), not by importing: a cycle that happens to import in today's order
still breaks the first time someone imports the modules the other way round. Counted as
module-level: every import outside a function body, including ``if TYPE_CHECKING:`` blocks
(a type-only circle is still two modules that each need the other) and class bodies.
Importing ``a.b.c`` also runs ``a/__init__`` and ``a/b/__init__``, so those are edges too,
except towards the importer's own packages (which are already importing).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parents[2] / "lightning_5d"  # read, not imported: no torch start-up


def _module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _module_level(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Imports outside function bodies."""
    found: list[ast.Import | ast.ImportFrom] = []
    stack: list[ast.AST] = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        stack.extend(ast.iter_child_nodes(node))
    return found


def _ancestors(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the package's modules its module-level imports run."""
    paths = {_module_name(root, p): p for p in root.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        is_package = path.name == "__init__.py"
        targets: set[str] = set()
        for node in _module_level(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
                continue
            if node.level:  # relative: from the importer's package, one level up per extra dot
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            submodules = {f"{source}.{alias.name}" for alias in node.names} & paths.keys()
            targets.update(submodules)
            if len(submodules) < len(node.names):  # some names come from the package's __init__ itself
                targets.add(source)
        edges = set()
        for target in targets:
            if target not in paths:
                continue
            edges.add(target)
            edges.update(a for a in _ancestors(target) if a in paths and a not in _ancestors(name))
        edges.discard(name)
        graph[name] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [m0, m1, ..., m0], or None (iterative depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: finished
    for start in sorted(graph):
        if start in state:
            continue
        path = [start]
        todo = [iter(sorted(graph[start]))]
        state[start] = 1
        while todo:
            nxt = next(todo[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                todo.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            elif nxt not in state:
                state[nxt] = 1
                path.append(nxt)
                todo.append(iter(sorted(graph[nxt])))
    return None


def test_lightning_5d_has_no_import_cycle():
    graph = import_graph(PACKAGE_ROOT)
    assert len(graph) > 50  # the walk saw the package, not an empty folder
    cycle = find_cycle(graph)
    assert cycle is None, (
        "import cycle: " + " -> ".join(cycle) + ". Move the names both sides need into a module below both "
        "(not into a function-local import)."
    )


def _write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "pkg"


def test_a_type_only_circle_through_a_relative_import_is_found(tmp_path):
    root = _write(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/sub/__init__.py": "",
            "pkg/sub/a.py": "from .b import B\n",
            "pkg/sub/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.sub.a import A\n",
        },
    )
    assert find_cycle(import_graph(root)) == ["pkg.sub.a", "pkg.sub.b", "pkg.sub.a"]


def test_a_circle_through_a_package_init_is_found_and_local_imports_are_not_edges(tmp_path):
    root = _write(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/config.py": "from pkg.dim.rules import check\n",
            "pkg/dim/__init__.py": "from pkg.dim.engine import Engine\n",
            "pkg/dim/rules.py": "def check():\n    from pkg.dim.engine import Engine\n",
            "pkg/dim/engine.py": "from pkg import config\n",
        },
    )
    graph = import_graph(root)
    assert graph["pkg.dim.rules"] == set()  # the function-local import is not an edge
    assert find_cycle(graph) == ["pkg.config", "pkg.dim", "pkg.dim.engine", "pkg.config"]
