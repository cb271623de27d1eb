"""The sizes fldp's code aims for (issue 32), read from the source: the training loop's `train` in
at most 60 lines (every function's and class's limits: tests/test_lint.py)."""

from __future__ import annotations

import ast

from conftest import ROOT


def definitions():
    for path in sorted((ROOT / "fldp").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                kind = "class" if isinstance(node, ast.ClassDef) else "function"
                yield path.relative_to(ROOT), node.name, kind, node.end_lineno - node.lineno + 1


def test_the_training_loop_reads_on_one_screen():
    (size,) = [size for path, name, _, size in definitions() if path.name == "trainer.py" and name == "train"]
    assert size <= 60
