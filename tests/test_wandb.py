"""W&B, offline (no network): a resumed run continues its W&B run, sweep points are grouped and
labelled. What W&B holds is read through its public Run attributes, which every run's summary.json
records (`wandb`); nothing reads W&B's binary log."""
from __future__ import annotations

import json
import shutil

from conftest import cli

TINY = ["topology=local_2", "trainer.steps=2", "trainer.eval_batches=1", "trainer.progress=false",
        "wandb.mode=offline"]


def offline_runs(run_dir):
    return sorted(run_dir.glob("wandb/offline-run-*"))


def wandb_of(run_dir):
    return json.loads((run_dir / "summary.json").read_text())["wandb"]


def test_a_resumed_run_continues_its_wandb_run(tmp_path):
    run = [*TINY, "algorithm=fsdp", "trainer.checkpoint_every=1", f"hydra.run.dir={tmp_path}"]
    first = cli(*run, cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    kept = (tmp_path / "wandb_id").read_text().strip()
    assert wandb_of(tmp_path)["id"] == kept
    shutil.rmtree(tmp_path / "checkpoints" / "step_00000002")  # as if killed during step 2
    again = cli(*run, "trainer.resume=auto", cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    runs = offline_runs(tmp_path)
    assert len(runs) == 2, runs
    assert all(r.name.endswith(f"-{kept}") for r in runs)  # `wandb sync` sends both to run `kept`
    identity = wandb_of(tmp_path)
    assert identity["id"] == kept and identity["mode"] == "offline"
    assert (tmp_path / identity["folder"]) == runs[-1]  # the resumed run's own folder


def test_multirun_points_get_group_job_type_and_tags(tmp_path):
    sweep = tmp_path / "2026-01-02" / "03-04-05"
    out = cli("-m", *TINY, "trainer.steps=1", "algorithm=fsdp,fl_fsdp", f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    points = {}
    for point in sorted(p for p in sweep.iterdir() if p.is_dir()):
        identity = wandb_of(point)
        (folder,) = offline_runs(point)
        assert point / identity["folder"] == folder and folder.name.endswith("-" + identity["id"])
        points[identity["job_type"]] = (identity["group"], identity["tags"])
        # the run's name ends in its point's directory, which names the point's overrides
        assert identity["name"] == f"{identity['job_type']}-local_2-{point.name}"
        assert f"algorithm={identity['job_type']}," in point.name
    assert points == {
        "fsdp": ("2026-01-02_03-04-05", ["topology=local_2"]),
        "fl_fsdp": ("2026-01-02_03-04-05", ["A=8", "F=2", "topology=local_2"]),
    }
    # a group set by the user (as +experiment=paper_512 does) wins over the sweep's name
    named = tmp_path / "named"
    out = cli("-m", *TINY, "trainer.steps=1", "algorithm=fsdp", "wandb.group=mine", f"hydra.sweep.dir={named}",
              cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert wandb_of(named / "algorithm=fsdp,topology=local_2,trainer.eval_batches=1,trainer.steps=1")["group"] == "mine"
