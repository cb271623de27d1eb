"""The package as a user installs it: a wheel built from this checkout, installed into a fresh
directory, used from a directory that is not the checkout (the configs must come from the wheel)."""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT

SOURCES = ("pyproject.toml", "README.md", "fldp", "analysis", "conf")


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """`pip wheel` of a copy of the sources (the build writes build/ and *.egg-info beside them),
    then `pip install --target`; the dependencies come from this environment."""
    base = tmp_path_factory.mktemp("install")
    src = base / "src"
    for name in SOURCES:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            src.mkdir(exist_ok=True)
            shutil.copy2(source, src / name)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(base / "dist"), str(src)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = (base / "dist").glob("fldp-*.whl")
    target = base / "site"
    subprocess.run(
        [*pip, "install", "--no-deps", "--target", str(target), str(wheel)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    return target


def outside(target: Path, cwd: Path, *command: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """A command run from `cwd` with only the installed package on PYTHONPATH (not this checkout)."""
    environ = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    environ.update(PYTHONPATH=str(target), FLDP_CACHE=str(cwd / "cache"), **(env or {}))
    exe = target / "bin" / command[0]
    argv = [str(exe), *command[1:]] if exe.exists() else [sys.executable, *command]
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=300, env=environ)


def test_the_wheel_carries_the_configs_and_runs_outside_the_checkout(installed, tmp_path):
    where = outside(installed, tmp_path, "-c", "import fldp; print(fldp.__file__); print(fldp.CONF)")
    assert where.returncode == 0, where.stderr[-2000:]
    module, conf = where.stdout.split()
    assert Path(module).is_relative_to(installed) and Path(conf) == installed / "fldp" / "conf"

    job = outside(installed, tmp_path, "fldp-train", "--cfg", "job", "algorithm=fsdp", "topology=local_2")
    assert job.returncode == 0, job.stderr[-2000:]
    assert "name: fsdp" in job.stdout and "name: local_2" in job.stdout

    run_dir = tmp_path / "run"
    run = outside(
        installed,
        tmp_path,
        "fldp-train",
        "algorithm=fl_fsdp",
        "topology=local_2",
        "trainer.steps=1",
        "trainer.eval_batches=1",
        "trainer.progress=false",
        "wandb.mode=disabled",
        f"hydra.run.dir={run_dir}",
    )
    assert run.returncode == 0, run.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["algorithm"], summary["world_size"], summary["steps"]) == ("fl_fsdp", 2, 1)

    # the same through `python -m`, and the other two commands
    assert outside(installed, tmp_path, "-m", "fldp.train", "--cfg", "job").returncode == 0
    cost = outside(installed, tmp_path, "fldp-cost", "--json")
    assert cost.returncode == 0 and json.loads(cost.stdout), cost.stderr[-2000:]
    report = outside(installed, tmp_path, "fldp-report", str(run_dir), "--out", str(tmp_path / "report"))
    assert report.returncode == 0, report.stderr[-2000:]
    assert (tmp_path / "report" / "report.md").exists()


def test_help_lists_the_groups_and_examples(installed, tmp_path):
    out = outside(installed, tmp_path, "fldp-train", "--help")
    assert out.returncode == 0, out.stderr[-2000:]
    (algorithms,) = [line for line in out.stdout.splitlines() if line.startswith("algorithm: ")]
    assert {"fsdp", "hsdp", "fl_fsdp", "fl_hsdp"} <= set(algorithms.removeprefix("algorithm: ").split(", "))
    assert (
        "topology: " in out.stdout
        and "model: ladder_1, ladder_2, ladder_3, ladder_4, llama3_1_8b, tiny_llama" in out.stdout
    )
    examples = out.stdout.split("== Examples ==")[1].split("==")[0]
    assert sum(line.strip().startswith("fldp-train") for line in examples.splitlines()) >= 5


def test_each_command_has_its_own_help(installed, tmp_path):
    cost = outside(installed, tmp_path, "fldp-cost", "--help")
    assert cost.returncode == 0 and cost.stdout.startswith("fldp-cost (or python -m fldp.cost)"), cost.stdout[:500]
    assert "fldp-train (or" not in cost.stdout and "fldp-cost topology=leonardo_512" in cost.stdout
    report = outside(installed, tmp_path, "fldp-report", "--help")
    assert report.returncode == 0 and report.stdout.startswith("usage: fldp-report "), report.stdout[:500]
    calibrate = outside(installed, tmp_path, "fldp-calibrate", "--help")
    assert calibrate.returncode == 0 and calibrate.stdout.startswith("fldp-calibrate: "), calibrate.stdout[:500]
    assert outside(installed, tmp_path, "-m", "fldp.analysis.report", "--help").stdout.startswith(
        "usage: python -m fldp.analysis.report "
    )


def test_the_wheel_installs_one_top_level_package(installed):
    """analysis/ ships as fldp.analysis: a top-level `analysis` would collide with any other."""
    tops = {p.name for p in installed.iterdir() if p.name != "bin" and not p.name.endswith(".dist-info")}
    assert tops == {"fldp"}, tops
    assert (installed / "fldp" / "analysis" / "report.py").exists()
    assert (installed / "fldp" / "analysis" / "paper_values.json").exists()


def test_shell_completion(installed, tmp_path):
    script = outside(installed, tmp_path, "fldp-train", "--shell-completion", "install=bash")
    assert script.returncode == 0, script.stderr[-2000:]
    assert "hydra_bash_completion" in script.stdout and script.stdout.strip().endswith("fldp-train")
    # what bash asks when the user presses TAB after `fldp-train algo`
    query = outside(
        installed, tmp_path, "fldp-train", "-sc", "query=bash", env={"COMP_LINE": "fldp-train algo", "COMP_POINT": "15"}
    )
    assert query.returncode == 0 and "algorithm=" in query.stdout.split(), query.stdout + query.stderr[-2000:]


# import name -> distribution name, where they differ
DISTRIBUTIONS = {"PIL": "pillow", "hydra": "hydra-core", "torchft": "torchft-nightly", "yaml": "pyyaml"}


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_every_imported_library_is_declared():
    """Every third-party module that fldp, analysis, the tests or the experiments import is a
    dependency (or a dev extra) in pyproject.toml: a fresh `pip install -e .[dev]` has them all."""
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = [*project["dependencies"], *sum(project["optional-dependencies"].values(), [])]
    declared = {_normal(re.split(r"[<>=!~ \[;]", r)[0]) for r in requirements}
    files = [p for d in ("fldp", "analysis", "tests", "experiments") for p in (ROOT / d).glob("*.py")]
    local = {"fldp", "analysis", "__future__"} | {p.stem for p in files}
    undeclared = {}
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module]
            else:
                continue
            for top in {n.split(".")[0] for n in names} - local - set(sys.stdlib_module_names):
                if _normal(DISTRIBUTIONS.get(top, top)) not in declared:
                    undeclared.setdefault(top, str(path.relative_to(ROOT)))
    assert not undeclared, f"imported but not in pyproject.toml: {undeclared}"


def test_the_constraints_file_pins_every_dependency_within_its_range():
    """experiments/constraints.txt (the versions the committed studies used) pins each dependency
    of pyproject.toml, the dev extra's included, to one version that its range allows."""
    import tomllib
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
    from packaging.version import Version

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins = {}
    for line in (ROOT / "experiments" / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, version = line.split("==")
            pins[canonicalize_name(name)] = Version(version)
    for text in [*project["dependencies"], *project["optional-dependencies"]["dev"]]:
        req = Requirement(text)
        pinned = pins.get(canonicalize_name(req.name))
        assert pinned is not None, f"{req.name} is not pinned in experiments/constraints.txt"
        assert req.specifier.contains(pinned, prereleases=True), f"{req.name}=={pinned} outside {req.specifier}"


def test_the_commit_recorded_is_the_one_imported(tmp_path):
    """A run records the commit of the code it imported, not what the checkout holds when it ends
    (a study's sweep ran for an hour while the checkout moved on: its runs named 11 commits)."""
    import importlib.util

    repo = tmp_path / "repo"
    (repo / "fldp").mkdir(parents=True)
    shutil.copy(ROOT / "fldp" / "provenance.py", repo / "fldp" / "provenance.py")
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]

    def commit(message):
        subprocess.run([*git, "add", "-A"], check=True)
        subprocess.run([*git, "commit", "-qm", message], check=True)
        return subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()

    def load():
        spec = importlib.util.spec_from_file_location("provenance_copy", repo / "fldp" / "provenance.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    first = commit("first")
    imported = load()
    (repo / "fldp" / "provenance.py").write_text((repo / "fldp" / "provenance.py").read_text() + "\n# later\n")
    assert load().source_commit() == first + "-dirty"
    second = commit("second")
    assert imported.source_commit() == first
    assert load().source_commit() == second != first
    # an fldp installed inside another checkout (a venv in it) has no commit: not that checkout's
    inner = repo / "venv" / "site-packages" / "fldp"
    inner.mkdir(parents=True)
    shutil.copy(ROOT / "fldp" / "provenance.py", inner / "provenance.py")
    spec = importlib.util.spec_from_file_location("provenance_installed", inner / "provenance.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.source_commit() is None
