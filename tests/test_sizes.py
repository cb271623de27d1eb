"""The sizes fldp's code aims for (issue 32), read from the source: the training loop's `train` in
at most 60 lines, no function longer than 60 lines, no class longer than 200."""

from __future__ import annotations

import ast

from conftest import ROOT

LIMITS = {"function": 60, "class": 200}


def definitions():
    for path in sorted((ROOT / "fldp").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                kind = "class" if isinstance(node, ast.ClassDef) else "function"
                yield path.relative_to(ROOT), node.name, kind, node.end_lineno - node.lineno + 1


def test_no_function_over_60_lines_and_no_class_over_200():
    found = list(definitions())
    assert len(found) > 300  # the walk saw the package
    over = [f"{path}:{name} ({size} lines)" for path, name, kind, size in found if size > LIMITS[kind]]
    assert not over, "longer than fldp aims for: " + ", ".join(over)


def test_the_training_loop_reads_on_one_screen():
    (size,) = [size for path, name, _, size in definitions() if path.name == "trainer.py" and name == "train"]
    assert size <= 60
