"""Imports point one way: no module of fldp or analysis imports, directly or through others, a
module that imports it back. Function-level imports count too (a lazy import hides a circle, it
does not remove it). Read from the source with ast: nothing is imported to check it."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections import Counter

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


def test_forked_workers_do_not_import_the_models_forward_again(tmp_path):
    """fldp.train imports what the model's forward imports lazily (fldp.model.import_forward)
        before forking: each worker importing transformers' masks (and torch._dynamo) again cost ~2 s
        of CPU per worker. Read from `python -X importtime`: each process lists the modules its `import`
    statements loaded, so a module listed once per worker was imported again by each."""
    out = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "fldp.train", "algorithm=fsdp", "topology=local_4"]
        + ["trainer.steps=1", "trainer.eval_batches=1", "trainer.progress=false", "wandb.mode=disabled"]
        + [f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    imports = Counter(
        line.rsplit("|", 1)[1].strip() for line in out.stderr.splitlines() if line.startswith("import time:")
    )
    # the parent lists a few modules twice (circular imports): 4 listings are the 4 workers'
    again = sorted(m for m, n in imports.items() if n >= 4 and m.startswith(("transformers", "torch._dynamo")))
    assert not again, again
