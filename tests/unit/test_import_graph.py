"""No import circles in ``lightning_5d``: the module-level imports form a DAG, and no
function-local import stands in for one that would close a circle at module level.

Read from the source (ast), not by importing: a cycle that happens to import in today's order
still breaks the first time someone imports the modules the other way round. Counted as
module-level: every import outside a function body, including ``if TYPE_CHECKING:`` blocks
(a type-only circle is still two modules that each need the other) and class bodies.
Importing ``a.b.c`` also runs ``a/__init__`` and ``a/b/__init__``, so those are edges too,
except towards the importer's own packages (which are already importing).

A function-local import is fine for an optional or heavy dependency, or to keep a command's
start-up light; one that dodges a circle only hides it (the two modules still need each other),
so each is checked as if it stood at module level.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parents[2] / "lightning_5d"  # read, not imported: no torch start-up


def _module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


Import = ast.Import | ast.ImportFrom
_FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)


def _imports(tree: ast.Module) -> tuple[list[Import], list[Import]]:
    """(imports outside function bodies, imports inside them)."""
    module_level: list[Import] = []
    local: list[Import] = []
    stack: list[tuple[ast.AST, bool]] = [(node, False) for node in tree.body]
    while stack:
        node, in_function = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            (local if in_function else module_level).append(node)
        inside = in_function or isinstance(node, _FUNCTIONS)
        stack.extend((child, inside) for child in ast.iter_child_nodes(node))
    return module_level, local


def _module_level(tree: ast.Module) -> list[Import]:
    return _imports(tree)[0]


def _ancestors(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _edges(name: str, is_package: bool, nodes: list[Import], modules: set[str]) -> set[str]:
    """The package's modules that ``nodes``, run in module ``name``, import."""
    targets: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
            continue
        if node.level:  # relative: from the importer's package, one level up per extra dot
            base = name.split(".") if is_package else name.split(".")[:-1]
            base = base[: len(base) - node.level + 1]
            source = ".".join(base + ([node.module] if node.module else []))
        else:
            source = node.module or ""
        submodules = {f"{source}.{alias.name}" for alias in node.names} & modules
        targets.update(submodules)
        if len(submodules) < len(node.names):  # some names come from the package's __init__ itself
            targets.add(source)
    edges = set()
    for target in targets & modules:
        edges.add(target)
        edges.update(a for a in _ancestors(target) if a in modules and a not in _ancestors(name))
    edges.discard(name)
    return edges


@functools.lru_cache(maxsize=None)  # both package tests read the same files: parse them once
def _parsed(root: Path) -> dict[str, tuple[bool, list[Import], list[Import]]]:
    """Module -> (is a package __init__, module-level imports, function-local imports)."""
    paths = {_module_name(root, p): p for p in root.rglob("*.py")}
    return {name: (p.name == "__init__.py", *_imports(ast.parse(p.read_text(), str(p)))) for name, p in paths.items()}


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the package's modules its module-level imports run."""
    parsed = _parsed(root)
    return {name: _edges(name, package, level, parsed.keys()) for name, (package, level, _) in parsed.items()}


def _path(graph: dict[str, set[str]], start: str, goal: str) -> list[str] | None:
    """A shortest chain of module-level imports from ``start`` to ``goal`` (breadth-first), or None."""
    came_from: dict[str, str | None] = {start: None}
    queue = [start]
    for node in queue:
        if node == goal:
            chain = [node]
            while (prev := came_from[chain[-1]]) is not None:
                chain.append(prev)
            return chain[::-1]
        for nxt in sorted(graph[node]):
            if nxt not in came_from:
                came_from[nxt] = node
                queue.append(nxt)
    return None


def hidden_cycles(root: Path) -> list[str]:
    """Each function-local import that would close an import cycle if it stood at module level,
    as "module:line: module -> ... -> module"."""
    parsed = _parsed(root)
    graph = import_graph(root)
    found = []
    for name, (package, _, local) in sorted(parsed.items()):
        for node in sorted(local, key=lambda n: n.lineno):
            for target in sorted(_edges(name, package, [node], parsed.keys())):
                back = _path(graph, target, name)
                if back is not None:
                    found.append(f"{name}:{node.lineno}: " + " -> ".join([name, *back]))
    return found


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


def test_no_function_local_import_hides_an_import_cycle():
    hidden = hidden_cycles(PACKAGE_ROOT)
    assert not hidden, (
        "function-local imports that would form an import cycle at module level:\n  " + "\n  ".join(hidden) + "\n"
        "Move the names the function needs into a module below both, and import it at module level."
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


def test_a_function_local_import_that_closes_a_circle_is_found(tmp_path):
    root = _write(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/ckpt/__init__.py": "from pkg.ckpt.export import export\n",
            "pkg/ckpt/errors.py": "class CheckpointError(Exception): ...\n",
            # export -> pkg.ckpt (the __init__) -> export, dodged by importing inside the function
            "pkg/ckpt/export.py": "def export():\n    from pkg.ckpt import CheckpointError\n",
            # a lower module: no circle, local or not
            "pkg/ckpt/load.py": "def load():\n    from pkg.ckpt.errors import CheckpointError\n",
            "pkg/cli.py": "def main():\n    import pkg.ckpt.export\n",  # lazy, and nothing imports cli
        },
    )
    assert find_cycle(import_graph(root)) is None  # the module-level graph alone hides it
    assert hidden_cycles(root) == ["pkg.ckpt.export:2: pkg.ckpt.export -> pkg.ckpt -> pkg.ckpt.export"]
