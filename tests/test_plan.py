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
import yaml
from conftest import compose_cfg

from fldp.config import load
from fldp.mesh import MeshShape
from fldp.plan import layouts
from fldp.schema import check
from fldp.steptime import efficiency_for, hardware_for, phases, workload_for

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


def _steps(cfg, rows: list[dict]) -> list[float]:
    """Each row's step time as fldp/steptime.py predicts it for the config's topology."""
    conf = load(cfg)
    work, hw, eff = workload_for(conf), hardware_for(conf.topology), efficiency_for(conf.topology)
    return [
        sum(phases(work, MeshShape(r["federation"], r["replicate"], r["shard"]), r["every"], hw, eff).values())
        for r in rows
    ]


def test_the_plan_builds_no_model():
    """Its start-up (issue 31: the paper's table in under 5 s): the parameters from the config
    (cost.config_shapes, checked against the model in tests/test_memory.py), so neither transformers
    nor DTensor (seconds of imports) is imported for a model whose vocabulary the config gives."""
    code = (
        "import sys; from fldp.plan import candidates, compose; "
        f"candidates(compose({PAPER!r}), [8]); "
        "print(sorted(m for m in ('transformers', 'torch.distributed.tensor') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


def test_the_fitting_layouts_are_ranked_by_their_predicted_step(plan_json):
    fitting = [r for r in plan_json if r["fits"]]
    steps = _steps(compose_cfg(*PAPER), fitting)
    assert steps == sorted(steps) and len(steps) > 10  # fastest predicted first
    assert all(sum(r["phases"].values()) == pytest.approx(s, rel=1e-12) for r, s in zip(fitting, steps))
    assert set(fitting[0]["phases"]) == {"forward", "backward", "optimizer", "aggregation"}


def test_a_calibration_profile_is_what_the_plan_predicts_with(tmp_path):
    """A node measured far slower across nodes than Leonardo's figures: the plan's times are the
    profile's (steptime.MEASURED on its hardware), not the published figures'."""
    profile = {
        "format": 1,
        "topology": {"procs_per_node": 4},
        "machine": {"backend": "nccl"},
        "compute": {"flop_s_train": 1.5e14, "flop_s_model": 1.5e14, "optimizer_bytes_s": 1e12},
        "tiers": {
            "node": {"alpha_s": 1e-5, "beta_bytes_s": 1e11},
            "inter-node": {"alpha_s": 1e-4, "beta_bytes_s": 1e8},
            "inter-node-shared": {"alpha_s": 1e-4, "beta_bytes_s": 2.5e7, "groups_at_once": 4},
        },
    }
    path = tmp_path / "slow.yaml"
    path.write_text(yaml.safe_dump(profile))
    out = fldp_plan(*PAPER, f"+topology.profile={path}", "--json")
    assert out.returncode == 0, out.stderr[-2000:]
    fitting = [r for r in json.loads(out.stdout) if r["fits"]]
    steps = _steps(compose_cfg(*PAPER, f"+topology.profile={path}"), fitting)
    assert all(sum(r["phases"].values()) == pytest.approx(s, rel=1e-12) for r, s in zip(fitting, steps))
    assert steps == sorted(steps)
    published = _steps(compose_cfg(*PAPER), fitting)
    assert all(s > p for s, p in zip(steps, published))  # a 100 MB/s link is slower than HDR100


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
