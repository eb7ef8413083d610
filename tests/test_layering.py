"""The house's arrows (ARCHITECTURE.md, "Rooms and arrows"), read from the source with ``ast``: every
import of every module, at the top or inside a function, points only to its own room or to rooms to
its right, ``lowbit -> evals -> runtime -> {quant, kvquant}`` (kvquant reads quant; quant reads
neither); ``bench`` and ``lowbit_testing`` sit outside the package and may read all of it, and
nothing in the package reads them or the tests. Inside a room no modules import each other in a
circle. Imports under ``if TYPE_CHECKING:`` never run and are left out (names for annotations)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# each room and the other rooms it may import
PACKAGE = {
    "lowbit": {"evals", "runtime", "quant", "kvquant"},
    "evals": {"runtime", "quant", "kvquant"},
    "runtime": {"quant", "kvquant"},
    "kvquant": {"quant"},
    "quant": set(),
}
OUTSIDE = {  # in the checkout, not in the wheel
    "lowbit_testing": set(PACKAGE),
    "bench": set(PACKAGE) | {"lowbit_testing"},
}
ROOMS = {**PACKAGE, **OUTSIDE}
REPO_TOP_LEVEL = set(ROOMS) | {"tests", "tiny"}  # tests' `from tiny import ...`


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def repo_modules() -> dict[str, Path]:
    return {module_name(p): p for room in ROOMS for p in sorted((ROOT / room).rglob("*.py"))}


def under_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports_of(source: str, module: str, is_package: bool, known: set[str]) -> list[tuple[str, int]]:
    """(imported module, line) for every import statement that can run: ``from a import b`` names
    ``a.b`` where that is a module in ``known``, else ``a``; relative imports resolved."""
    found = []

    def visit(node):
        if isinstance(node, ast.If) and under_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.extend((alias.name, node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module.split(".") if is_package else module.split(".")[:-1]
                package = package[:len(package) - node.level + 1]
                base = ".".join(package + ([node.module] if node.module else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                found.append((full if full in known else base, node.lineno))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(source))
    return found


def import_graph(modules: dict[str, str]) -> dict[str, list[tuple[str, int]]]:
    """{module: [(imported repo module or top-level name, line)]} from {module: source} (package
    ``__init__`` modules are the ones some other module's name extends)."""
    known = set(modules)
    graph = {}
    for name, source in modules.items():
        is_package = any(other.startswith(name + ".") for other in known)
        targets = []
        for target, line in imports_of(source, name, is_package, known):
            while target not in known and "." in target:  # an attribute of a module, or a third-party name
                target = target.rpartition(".")[0]
            targets.append((target, line))
        graph[name] = targets
    return graph


def wrong_way(graph: dict) -> list[str]:
    """Each import that points where its room may not look."""
    out = []
    for module, targets in graph.items():
        room = module.split(".")[0]
        for target, line in targets:
            other = target.split(".")[0]
            if other in REPO_TOP_LEVEL and other != room and other not in ROOMS[room]:
                allowed = ", ".join(sorted(ROOMS[room])) or "no other room"
                out.append(f"{module}:{line} imports {target} ({room} may import {allowed})")
    return out


def circles(graph: dict, room: str) -> list[list[str]]:
    """The strongly connected groups of more than one module among ``room``'s own imports (Tarjan)."""
    nodes = [m for m in graph if m.split(".")[0] == room]
    edges = {m: sorted({t for t, _ in graph[m] if t in graph and t.split(".")[0] == room and t != m})
             for m in nodes}
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in nodes:
        if v not in index:
            visit(v)
    return found


@pytest.fixture(scope="module")
def graph():
    return import_graph({name: path.read_text() for name, path in repo_modules().items()})


def test_every_room_imports_only_rooms_to_its_right(graph):
    assert len(graph) > 100  # every module of every room was read
    assert wrong_way(graph) == []


@pytest.mark.parametrize("room", sorted(ROOMS))
def test_no_modules_of_a_room_import_each_other_in_a_circle(graph, room):
    assert circles(graph, room) == []


def test_the_checks_see_function_level_imports_and_catch_both_faults():
    """On made-up modules: an import inside a function counts, a TYPE_CHECKING one does not, a
    relative import is resolved; an arrow the wrong way and a circle are both reported."""
    modules = {
        "quant": "",
        "quant.a": "def f():\n    from runtime import engine\n",
        "runtime": "",
        "runtime.engine": "from .model import Decoder\n",
        "runtime.model": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from runtime.engine import E\n"
                         "def build():\n    import runtime.moe\n",
        "runtime.moe": "import torch\nfrom runtime import model\n",
    }
    g = import_graph(modules)
    assert ("runtime.model", 1) in g["runtime.engine"] and ("torch", 1) in g["runtime.moe"]
    assert wrong_way(g) == ["quant.a:2 imports runtime.engine (quant may import no other room)"]
    assert circles(g, "runtime") == [["runtime.model", "runtime.moe"]]  # the TYPE_CHECKING import is no edge
    assert circles(g, "quant") == []
