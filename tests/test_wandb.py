"""W&B, offline (no network): a resumed run continues its W&B run, sweep points are grouped and
labelled. What W&B holds is read through its public Run attributes, which every run's summary.json
records (`wandb`); nothing reads W&B's binary log."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

from conftest import ROOT, cli
from wandb_log import exit_codes, history_steps, records

TINY = ["topology=local_2", "trainer.steps=2", "trainer.eval_batches=1", "trainer.progress=false", "wandb.mode=offline"]


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
        assert f"algorithm={identity['job_type']}," in point.name
    assert points == {
        "fsdp": ("2026-01-02_03-04-05", ["topology=local_2"]),
        "fl_fsdp": ("2026-01-02_03-04-05", ["A=8", "F=2", "topology=local_2"]),
    }
    # a group set by the user (as +experiment=paper_512 does) wins over the sweep's name
    named = tmp_path / "named"
    out = cli(
        "-m", *TINY, "trainer.steps=1", "algorithm=fsdp", "wandb.group=mine", f"hydra.sweep.dir={named}", cwd=tmp_path
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert wandb_of(named / "algorithm=fsdp,topology=local_2,trainer.eval_batches=1,trainer.steps=1")["group"] == "mine"


def test_ctrl_c_keeps_the_wandb_history_and_the_resumed_run_adds_each_step_once(tmp_path):
    """A terminal's Ctrl-C (SIGINT to the process group) after step 15, checkpoints every 4: the
    offline W&B log holds the steps that ran (before the fix: its 7-byte header only), the run ends
    with the workers' exit code; the resumed run (from step 12) sends only what W&B lacks."""
    run_dir, steps = tmp_path / "run", 24
    run = [*TINY, "algorithm=fsdp", f"trainer.steps={steps}", "trainer.checkpoint_every=4", f"hydra.run.dir={run_dir}"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "fldp.train", *run],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 15):
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "no step 15"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGINT)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGINT, stderr[-3000:]
    ran = len(metrics.read_text().splitlines())  # no eval before the last step: one row a step
    (first,) = logs(run_dir)
    assert history_steps(first) == list(range(1, ran + 1))
    assert exit_codes(first) == [128 + signal.SIGTERM]  # how the worker was stopped
    again = cli(*run, "trainer.resume=auto", cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    first_again, second = logs(run_dir)
    assert first_again == first
    assert history_steps(first) + history_steps(second) == list(range(1, steps + 1))
    assert exit_codes(second) == [0]


# One segment of a run directory in a process of its own: `stop` logs steps 1-3 and is stopped
# (SIGTERM, as the launcher stops a worker) while W&B takes step 3; `resume` continues from step 2.
SEGMENT = """
import os, signal, sys
sys.path.insert(0, sys.argv[3])
from conftest import compose_cfg
from fldp import stopping
from fldp.records import Recorder

class StoppedWhileSending:
    def __init__(self, run):
        self.run = run
    def __getattr__(self, name):
        return getattr(self.run, name)
    def log(self, *args, **kwargs):
        self.run.log(*args, **kwargs)
        if kwargs["step"] == 3:
            os.kill(os.getpid(), signal.SIGTERM)

signal.signal(signal.SIGTERM, stopping.on_signal)
stop = sys.argv[2] == "stop"
recorder = Recorder(sys.argv[1], compose_cfg("wandb.mode=offline"), 4, progress=False, resume_from=0 if stop else 2)
if stop:
    recorder.wandb = StoppedWhileSending(recorder.wandb)
for step in range(1 if stop else 3, 5):
    recorder.log({"step": step, "loss": 1.0, "time_step": 0.1})
recorder.finish({"steps": 4})
"""


def test_a_stop_while_wandb_takes_a_row_counts_that_row_as_delivered(tmp_path):
    """The stop waits for W&B's call, then closes the run: the count of rows W&B holds must include
    the row it just took, or the resumed segment sends it again (a fresh-clone CI saw step 15 twice
    when Ctrl-C landed there)."""
    tests = str(ROOT / "tests")
    stopped = subprocess.run(
        [sys.executable, "-c", SEGMENT, str(tmp_path), "stop", tests], capture_output=True, text=True
    )
    assert stopped.returncode == 128 + signal.SIGTERM, stopped.stderr[-3000:]
    assert (tmp_path / "wandb_rows").read_text().strip() == "3"
    resumed = subprocess.run(
        [sys.executable, "-c", SEGMENT, str(tmp_path), "resume", tests], capture_output=True, text=True
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    first, second = logs(tmp_path)
    assert (history_steps(first), history_steps(second)) == ([1, 2, 3], [4])


def test_wandb_names_are_short_and_the_overrides_are_in_the_config(tmp_path):
    """W&B's run list shows ALGORITHM TOPOLOGY F A seed; the point's overrides are in its config;
    the charts are against the training step."""
    sweep = tmp_path / "sweep"
    out = cli(
        "-m",
        *TINY,
        "trainer.steps=1",
        "algorithm=fl_fsdp",
        "seed=3",
        "algorithm.every=1",
        f"hydra.sweep.dir={sweep}",
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    (point,) = [p for p in sweep.iterdir() if p.is_dir()]
    assert wandb_of(point)["name"] == "fl_fsdp local_2 F=2 A=1 seed=3"
    (log,) = logs(point)
    config = next(r.run.config for r in records(log) if r.WhichOneof("record_type") == "run")
    values = {item.key: json.loads(item.value_json) for item in config.update}
    assert {"seed=3", "algorithm.every=1", "trainer.steps=1"} <= set(values["overrides"])
    defined = {
        r.metric.glob_name or r.metric.name: r.metric.step_metric
        for r in records(log)
        if r.WhichOneof("record_type") == "metric"
    }
    assert defined["train/*"] == defined["eval/*"] == "step"


def logs(run_dir):
    return [next(folder.glob("run-*.wandb")) for folder in offline_runs(run_dir)]


def test_a_failed_run_keeps_its_wandb_history(tmp_path):
    """A worker that fails (here a non-finite loss) exits through os._exit, which skips W&B's own
    teardown: it closes its W&B run first, so the rows before the failure are in the offline log."""
    out = cli(
        *TINY,
        "algorithm=fsdp",
        "optimizer.name=sgd",
        "optimizer.lr=1e38",
        "optimizer.warmup=0",
        "trainer.steps=6",
        f"hydra.run.dir={tmp_path}",
        cwd=tmp_path,
    )
    assert out.returncode == 1 and "non-finite loss" in out.stderr, out.stderr[-3000:]
    ran = len((tmp_path / "metrics.jsonl").read_text().splitlines())
    (log,) = logs(tmp_path)
    assert ran >= 1 and history_steps(log) == list(range(1, ran + 1))
    assert exit_codes(log) == [1]
