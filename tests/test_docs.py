"""The docs: the MkDocs site builds with --strict, README.md stays a short front page whose commands CI
reads, no page names a path of one machine, and the generated configuration reference has every key."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from collections import Counter

import pytest
from conftest import ROOT

from fldp.schema import KEYS
from fldp.schema_doc import reference_markdown

README = ROOT / "README.md"
SETUP = 'python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 && pip install -e ".[dev]"'
CPU_WHEEL = "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
TESTS = "python -m pytest -q"
README_MAX_LINES = 200
# An absolute path of a machine: one of these prefixes, not inside a longer path or a URL
MACHINE_PATH = re.compile(r"(?<![\w.~/-])/(?:work|tmp|root|home|check|opt)/")
CHECKED = ("docs", "README.md", "experiments", "analysis")


def sections(markdown: str) -> dict[str, list[str]]:
    """Heading text -> the lines under it, up to the next heading (fenced code is not a heading)."""
    out: dict[str, list[str]] = {}
    current, fenced = "", False
    for line in markdown.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        if not fenced and re.match(r"#{1,6} ", line):
            current = line.lstrip("#").strip()
            out[current] = []
        else:
            out.setdefault(current, []).append(line)
    return out


def relative_links(markdown: str) -> list[str]:
    """The targets of the Markdown links and images that are not URLs or same-page anchors, outside
    fenced code and code spans."""
    text = re.sub(r"^```.*?^```", "", markdown, flags=re.S | re.M)
    text = re.sub(r"`[^`\n]*`", "", text)
    targets = re.findall(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)", text)
    return [t for t in targets if not re.match(r"[a-z][a-z0-9+.-]*:", t, re.I) and not t.startswith("#")]


def test_site_builds_strict(tmp_path):
    if importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("material") is None:
        pytest.skip("mkdocs or mkdocs-material is not installed (the dev extra installs both)")
    site = tmp_path / "site"
    build = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"), "-d", str(site)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert build.returncode == 0, f"mkdocs build --strict failed:\n{build.stdout[-3000:]}{build.stderr[-5000:]}"
    page = site / "reference" / "config" / "index.html"
    assert page.is_file(), "the generated configuration reference is missing from the site"
    assert "algorithm.every" in page.read_text()


def test_readme_is_a_front_page_with_the_commands_ci_reads():
    text = README.read_text()
    lines = text.splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines, at most {README_MAX_LINES}: move the detail into docs/"
    )
    parts = sections(text)
    assert SETUP in parts.get("Setup", []), f"README.md's Setup section must hold the setup command:\n{SETUP}"
    assert any(CPU_WHEEL in line for line in text.splitlines()), f"README.md must give {CPU_WHEEL!r}"
    assert TESTS in parts.get("Tests", []), f"README.md needs {TESTS!r} on its own line under a 'Tests' heading"


def test_readme_relative_links_exist():
    links = relative_links(README.read_text())
    assert any(link.startswith("docs/") for link in links), "README.md should link into docs/"
    missing = [link for link in links if not (ROOT / link.split("#")[0]).exists()]
    assert not missing, f"README.md links to files that do not exist: {missing}"


def test_no_machine_paths_in_docs_and_reports():
    try:
        listed = subprocess.run(
            ["git", "ls-files", "-z", "--", *CHECKED], cwd=ROOT, capture_output=True, check=True
        ).stdout.split(b"\0")
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: no list of tracked files")
    found = []
    for name in filter(None, listed):
        path = ROOT / name.decode()
        if not path.is_file():
            continue
        data = path.read_bytes()
        if b"\0" in data:  # binary (figures)
            continue
        for number, line in enumerate(data.decode("utf-8", "replace").splitlines(), 1):
            if MACHINE_PATH.search(line):
                found.append(f"{name.decode()}:{number}: {line.strip()[:120]}")
    assert not found, "absolute paths of a machine (use a path relative to the repository, or OUT):\n" + "\n".join(
        found
    )


def test_machine_path_pattern():
    """The pattern above finds a machine's path and leaves relative paths and URLs alone."""
    assert MACHINE_PATH.search("see /work/fldp/outputs/x") and MACHINE_PATH.search("(`/tmp/run`)")
    assert not MACHINE_PATH.search("outputs/tmp/x https://example.org/home/ /var/tmp/x `/nonexistent`")


def test_reference_has_a_row_for_every_key():
    rows = re.findall(r"^\| `([^`]+)` \|", reference_markdown(), flags=re.M)
    twice = [k for k, n in Counter(rows).items() if n > 1]
    assert not twice, f"keys listed more than once: {twice}"
    assert set(rows) == set(KEYS), (
        f"missing from the reference: {sorted(set(KEYS) - set(rows))}; not in KEYS: {sorted(set(rows) - set(KEYS))}"
    )
