"""Sweeps: each point's directory names its overrides, and re-running a multirun into the same
hydra.sweep.dir skips the finished points (summary.json) and runs only the others."""

from __future__ import annotations

import json
import re

from conftest import QUICK, ROOT, cli, compose_cfg, read_rows
from omegaconf import OmegaConf

from fldp import schema
from fldp.records import Recorder, wandb_name
from fldp.setting import defining
from fldp.sweep import NAME_MAX, NO_OVERRIDES, point_dirname

SWEEP = ["-m", "topology=local_2", "algorithm=fl_fsdp", "trainer.steps=2", *QUICK]
# QUICK's trainer.progress and wandb.mode are excluded from the name: they change no point
POINT = "algorithm.every={},algorithm=fl_fsdp,topology=local_2,trainer.eval_batches=1,trainer.steps=2"


def state(run_dir):
    """What a run that starts in run_dir would change: its records and the config they came from."""
    return {
        f: (run_dir / f).stat().st_mtime_ns
        for f in ("metrics.jsonl", "summary.json", ".hydra/config.yaml")
        if (run_dir / f).exists()
    }


def test_rerunning_a_sweep_skips_its_finished_points(tmp_path):
    sweep = tmp_path / "sweep"
    at = f"hydra.sweep.dir={sweep}"
    out = cli(*SWEEP, "algorithm.every=1,2", at, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    one, two = sweep / POINT.format(1), sweep / POINT.format(2)
    assert sorted(p for p in sweep.iterdir() if p.is_dir()) == [one, two]
    assert [json.loads((d / "summary.json").read_text())["every"] for d in (one, two)] == [1, 2]
    before = {d: state(d) for d in (one, two)}

    # the same sweep, its values in the other order, progress bars on: the same directories, both
    # finished, so no worker starts and nothing in them is written
    again = cli(*SWEEP, "algorithm.every=2,1", "trainer.progress=true", at, cwd=tmp_path)
    log = again.stdout + again.stderr
    assert again.returncode == 0, log[-3000:]
    for d in (one, two):
        assert f"skipped: {d} already finished" in log
        assert f"records in {d}" not in log  # what fldp.train logs as it forks the workers
        assert state(d) == before[d]

    # point 2 unfinished: refused unless trainer.resume=auto (it may still be running); and with
    # trainer.skip_finished=false finished point 1 is not skipped but met alike, refused too
    (two / "summary.json").unlink()
    del before[two]["summary.json"]
    refused = cli(*SWEEP, "algorithm.every=1,2", "trainer.skip_finished=false", at, cwd=tmp_path)
    log = refused.stdout + refused.stderr
    assert refused.returncode != 0 and "skipped" not in log
    for d in (one, two):
        assert (
            f"hydra.run.dir={d} already holds a run's metrics.jsonl or checkpoints/: continue it with trainer.resume=auto"
            in log
        )
        assert state(d) == before[d]  # nor its .hydra/ written over

    # with trainer.resume=auto only point 2 runs (skip_finished back to its default)
    resumed = cli(*SWEEP, "algorithm.every=1,2", "trainer.resume=auto", at, cwd=tmp_path)
    log = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, log[-3000:]
    assert f"skipped: {one} already finished" in log and state(one) == before[one]
    assert f"records in {two}" in log and (two / "summary.json").exists()
    # no checkpoint to continue from: trained again from step 1, its old rows replaced
    assert [r["step"] for r in read_rows(two)] == [1, 2] and len(read_rows(two, "eval")) == 1
    assert sorted(p for p in sweep.iterdir() if p.is_dir()) == [one, two]


def test_a_single_run_into_a_finished_directory_is_refused_as_before(tmp_path):
    """Skipping is for sweep points: a single run (no -m) into a finished run's directory is refused,
    naming trainer.resume=auto, and leaves the config of its records in .hydra/ as it was."""
    for name, text in (("metrics.jsonl", "{}\n"), ("summary.json", "{}"), (".hydra/config.yaml", "old: 1\n")):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    out = cli("topology=local_2", *QUICK, f"hydra.run.dir={tmp_path}", cwd=tmp_path, timeout=120)
    assert out.returncode == 2 and "skipped" not in out.stdout + out.stderr
    assert "already holds a run's metrics.jsonl or checkpoints/: continue it with trainer.resume=auto" in out.stderr
    assert (tmp_path / ".hydra" / "config.yaml").read_text() == "old: 1\n"


def test_a_long_point_name_is_cut_with_a_hash(tmp_path):
    """Past 255 bytes (the file systems' limit on one path component, where Hydra's own name
    would fail), the name keeps its head and ends in a hash of the whole; a `/` in a value is
    escaped, not a subdirectory. The points fail fast (F=3 does not fit 2 ranks): only their
    directories matter here."""
    long_name = "tiny/" + "x" * 300
    out = cli(
        "-m",
        "topology=local_2",
        "mesh.federation=3",
        f"model.name={long_name}",
        "seed=1,2",
        *QUICK,
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
        cwd=tmp_path,
        timeout=120,
    )
    log = out.stdout + out.stderr
    assert "File name too long" not in log
    assert log.count("failed: mesh.federation x mesh.replicate x mesh.shard = 3x") == 2, log[-3000:]
    points = sorted(p.name for p in (tmp_path / "sweep").iterdir() if p.is_dir())
    assert len(points) == 2
    heads = set()
    for name in points:
        assert len(name.encode()) <= NAME_MAX
        head, digest = name.rsplit("#", 1)
        assert re.fullmatch(r"[0-9a-f]{16}", digest)
        assert head.startswith("mesh.federation=3,model.name=tiny%2Fxxx")  # seed=... sorts last, cut off
        heads.add(head)
    assert len(heads) == 1  # the two points differ only in the hash of what was cut


def test_point_names():
    """The name is a function of the overrides a point has, not of their order or repetition, and
    two different override lists never share one."""
    assert point_dirname(["b=2", "a=1"]) == point_dirname(["a=1", "b=2"]) == "a=1,b=2"
    # Hydra applies the last of a key's values; +key and key are one key
    assert point_dirname(["a=2", "b=1", "a=1"]) == "a=1,b=1"
    assert point_dirname(["+a=1", "a=2"]) == "a=2"
    assert point_dirname(["a=1", "wandb.mode=offline"], ["wandb.mode"]) == "a=1"
    assert point_dirname([]) == point_dirname(["wandb.mode=offline"], ["wandb.mode"]) == NO_OVERRIDES
    # escapes are reversible: what would otherwise read alike stays apart
    names = [point_dirname([o]) for o in ("a=x/y", "a=x%2Fy", "a=x%252Fy", "a='x#y'", "a='x%23y'")]
    assert len(set(names)) == len(names) and not any("/" in n for n in names)
    assert point_dirname(["a=../../etc"]) == "a=..%2F..%2Fetc"
    # cut on a character boundary: 2-byte characters, an odd number of bytes left for them
    cut = point_dirname([f"a='{'é' * 200}'"])
    assert len(cut.encode()) <= NAME_MAX and cut.startswith("a='é") and "\ufffd" not in cut
    assert point_dirname([f"a='{'é' * 200}'"]) == cut and point_dirname([f"a='{'é' * 201}'"]) != cut


def test_excluded_keys_define_no_experiment():
    """Two points differing only in an excluded key share a directory, so the second is skipped:
    right only if they compute the same thing. Each excluded key is a setting (the schema knows
    it) that does not define an experiment (fldp.setting) and is not the seed."""
    excluded = OmegaConf.load(ROOT / "conf" / "config.yaml").hydra.job.config.override_dirname.exclude_keys
    assert "trainer.skip_finished" in excluded and "trainer.resume" in excluded
    config = OmegaConf.to_container(compose_cfg(), resolve=False)
    for key in excluded:
        assert key in schema.KEYS, key
        assert key not in defining(config) and key != "seed", key


def test_a_run_continuing_in_a_finished_directory_is_unfinished_until_it_ends(tmp_path):
    """trainer.resume=auto in a directory holding summary.json: the summary goes when the run starts
    writing records, so a run that dies before its own is not taken for finished (and skipped)."""
    (tmp_path / "summary.json").write_text("{}")
    recorder = Recorder(tmp_path, compose_cfg("topology=local_2"), 2, progress=False, resume_from=0)
    assert not (tmp_path / "summary.json").exists()
    recorder.finish({"steps": 2})
    assert json.loads((tmp_path / "summary.json").read_text()) == {"steps": 2}


def test_wandb_names_are_short_whatever_the_sweep_point():
    """The run list names what tells runs apart at a glance; the point's overrides are in the config."""
    assert (
        wandb_name(compose_cfg("topology=local_2", "algorithm=fl_fsdp", "seed=2")) == "fl_fsdp local_2 F=2 A=8 seed=2"
    )
    assert (
        wandb_name(compose_cfg("topology=local_4", "algorithm=fsdp", f"wandb.group={'x' * 300}"))
        == "fsdp local_4 seed=42"
    )
