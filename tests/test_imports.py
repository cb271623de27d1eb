"""Imports point one way: no module of fldp or analysis imports, directly or through others, a
module that imports it back. Function-level imports count too (a lazy import hides a circle, it
does not remove it). Read from the source with ast: nothing is imported to check it."""

from __future__ import annotations

import ast

from conftest import ROOT

PACKAGES = ("fldp", "analysis")


def module_name(path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path, name: str, modules: set[str]) -> set[str]:
    """The project modules the file imports anywhere in it (relative imports resolved)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            found.add(base)
            found |= {f"{base}.{alias.name}" for alias in node.names}  # `from . import slurm`
    return {m for m in found if m in modules and m != name}


def import_graph() -> dict[str, set[str]]:
    files = {module_name(p): p for package in PACKAGES for p in (ROOT / package).glob("*.py")}
    return {name: imported(path, name, set(files)) for name, path in files.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle through each module that is on one (depth-first search)."""
    found, state = [], {}

    def visit(node, path):
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                found.append(path[path.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return found


def test_cycles_finds_a_circle_and_none_in_a_tree():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []


def test_the_import_graph_is_read_from_the_source():
    graph = import_graph()
    assert {"fldp.train", "fldp.aggregation", "analysis.report"} <= set(graph)
    assert "fldp.slurm" in graph["fldp.train"] and "fldp.schedule" in graph["fldp.aggregation"]


def test_imports_point_one_way():
    found = cycles(import_graph())
    assert not found, "import circles:\n" + "\n".join(" -> ".join(c) for c in found)
