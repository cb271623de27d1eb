"""ruff (lint and format) and mypy over the project, as CI runs them (pyproject.toml: [tool.ruff],
[tool.mypy]). Run by hand: `ruff check . && ruff format --check . && mypy`."""

from __future__ import annotations

import subprocess
import sys

from conftest import ROOT


def tool(*args: str) -> subprocess.CompletedProcess:
    """The tool installed beside this Python (the dev extra), as `python -m TOOL ARGS`."""
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_ruff_finds_nothing_to_fix():
    out = tool("ruff", "check", ".")
    assert out.returncode == 0, out.stdout[-4000:]


def test_the_code_is_as_ruff_formats_it():
    out = tool("ruff", "format", "--check", ".")
    assert out.returncode == 0, out.stdout[-4000:]


def test_mypy_finds_no_type_error():
    out = tool("mypy")
    assert out.returncode == 0, out.stdout[-4000:]


def test_functions_and_classes_stay_small():
    """The brief's sizes: every function under 60 lines and every class under 200, in the package,
    the analysis and the experiments' scripts (tests may be longer)."""
    import ast

    too_long = []
    for folder in ("fldp", "analysis", "experiments"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                limit = {ast.FunctionDef: 60, ast.AsyncFunctionDef: 60, ast.ClassDef: 200}.get(type(node))
                if limit and node.end_lineno - node.lineno + 1 > limit:
                    too_long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}")
    assert not too_long, too_long
