"""The modules of `models/` import one another without a circle (an ast-based import graph).

Every import statement counts, those inside functions too (a deferred import
that closes a circle still makes the modules depend on each other).
"""

from __future__ import annotations

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "models"


def import_graph() -> dict[str, set[str]]:
    """module name -> the modules of the package it imports (``from models import x`` names models.x if x is one)."""
    modules = {("models." + p.stem if p.stem != "__init__" else "models"): p for p in PACKAGE.glob("*.py")}
    graph = {}
    for name, path in modules.items():
        graph[name] = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from . / from .x (within the package)
                    base = "models" + (f".{base}" if base else "")
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                           for alias in node.names]
            else:
                continue
            graph[name].update(t for t in targets if t in modules and t != name)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of `graph` as [a, b, ..., a], or None (depth-first search)."""
    state: dict[str, str] = {}
    stack: list[str] = []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_find_cycle_finds_a_circle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_models_package_has_no_import_circle():
    graph = import_graph()
    assert {"models", "models.loading", "models.registry", "models.nemotron_h"} <= set(graph)
    assert "models.registry" in graph["models.nemotron_h"]  # `from models import registry` is an edge to it
    cycle = find_cycle(graph)
    assert cycle is None, "import circle in models/: " + " -> ".join(cycle)
