"""The import graph of ``src/distmoe``: no import circle, no private name taken from another module.

Read with :mod:`ast`, without importing anything. Every import counts, at module level or inside
a function (an import placed in a function to dodge a circle is still a circle). An edge goes to
the module named: ``from pkg import sub`` to ``pkg.sub`` where that is a module, else to ``pkg``
(its ``__init__``); the implicit import of a parent package is not an edge (a package's
``__init__`` re-exporting its own modules is no circle).
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "distmoe"



def _modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package."""
    out = {}
    for path in sorted((SRC / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def _imports(name: str, path: Path, modules: dict[str, Path]):
    """``(target module, imported name or None, line)`` for every import in the file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = name if _is_package(path) else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                while parts and ".".join(parts) not in modules:
                    parts.pop()
                if parts:
                    yield ".".join(parts), None, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")
                if node.level > 1:
                    base_parts = base_parts[: len(base_parts) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            if base != PACKAGE and not base.startswith(PACKAGE + "."):
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                if sub in modules:
                    yield sub, None, node.lineno
                elif base in modules:
                    yield base, alias.name, node.lineno


def _graph():
    modules = _modules()
    edges: dict[str, set[str]] = {m: set() for m in modules}
    private = []
    for name, path in modules.items():
        for target, imported, line in _imports(name, path, modules):
            if target != name:
                edges[name].add(target)
            if (imported is not None and imported.startswith("_")
                    and not imported.startswith("__") and target != name):
                private.append(f"{path.relative_to(SRC)}:{line} imports {imported} from {target}")
    return edges, private


def _find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import circle as ``[a, b, ..., a]``, or ``None``."""
    state: dict[str, int] = {}  # 1: on the DFS stack, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_graph_sees_the_package():
    edges, _ = _graph()
    assert "distmoe.kernels.base.device" in edges, sorted(edges)
    assert any(edges.values()), "no import found: the walk is broken"


def test_no_import_cycle():
    edges, _ = _graph()
    cycle = _find_cycle(edges)
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_no_private_name_across_modules():
    _, private = _graph()
    assert not private, "private names imported across modules:\n" + "\n".join(private)
