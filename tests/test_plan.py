"""fldp-plan as a user runs it (issue 31, item 5): every layout of the topology, those that do not
fit in memory dropped with the reason, the rest ranked, and the top ones as commands fldp-train
accepts; bad options exit 2."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import compose_cfg

from fldp.mesh import MeshShape
from fldp.plan import layouts
from fldp.schema import check

PAPER = ["topology=leonardo_512", "model=llama3_1_8b"]
# the authors' layouts (F, R, S, A): all four fit in the A100's 64 GB
AUTHORS = {(1, 1, 512, None), (1, 128, 4, None), (128, 1, 4, 8), (16, 8, 4, 8)}


def fldp_plan(*args: str) -> subprocess.CompletedProcess:
    command = Path(sys.executable).parent / "fldp-plan"
    assert command.exists(), f"fldp-plan is not installed beside {sys.executable}"
    env = {**os.environ, "COLUMNS": "120"}
    return subprocess.run([str(command), *args], capture_output=True, text=True, env=env, timeout=300)


def test_every_layout_of_the_ranks():
    found = layouts(8)
    assert len(found) == len(set(found)) == 10  # ordered (F, R, S) with F R S = 8
    assert all(s.world == 8 for s in found) and MeshShape(2, 2, 2) in found


@pytest.fixture(scope="module")
def plan_json():
    out = fldp_plan(*PAPER, "--json")
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout)


def test_the_paper_layouts_fit_and_those_without_sharding_do_not(plan_json):
    rows = {(r["federation"], r["replicate"], r["shard"], r["every"]): r for r in plan_json}
    assert len({(r["federation"], r["replicate"], r["shard"]) for r in plan_json}) == len(layouts(512))
    assert all(rows[k]["fits"] for k in AUTHORS)
    unsharded = [r for r in plan_json if r["shard"] == 1]
    assert unsharded and not any(r["fits"] for r in unsharded)
    assert all("GB > 64 GB" in r["why_not"] for r in unsharded)
    fitting = [r["communication_s"] for r in plan_json if r["fits"]]
    assert fitting == sorted(fitting)  # ranked


def test_the_table_and_the_top_commands_are_runnable_configs():
    out = fldp_plan(*PAPER, "--top", "2", "--every", "8")
    assert out.returncode == 0, out.stderr[-2000:]
    commands = [line.strip() for line in out.stdout.splitlines() if line.strip().startswith("fldp-train -m")]
    assert len(commands) == 2
    assert "Dropped, not fitting in memory" in out.stdout
    for line in commands:
        overrides = [a for a in shlex.split(line)[2:] if not a.startswith("seed=")]
        check(compose_cfg(*overrides))  # the schema fldp-train applies


@pytest.mark.parametrize("bad", [["--every", "0"], ["--top", "x"], ["topology=nowhere"], ["trainer.stepz=3"]])
def test_bad_input_exits_2_naming_it(bad):
    out = fldp_plan(*PAPER, *bad)
    assert out.returncode == 2, out.stderr[-2000:]
    assert bad[-1].split("=")[0] in out.stderr or bad[0] in out.stderr
