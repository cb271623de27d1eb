"""W&B, offline (no network): a resumed run continues its W&B run, sweep points are grouped and
labelled, and the offline reader refuses a log it cannot read, naming the versions."""
from __future__ import annotations

import shutil
import struct
import zlib
from importlib.metadata import version

import pytest

from analysis.records import RecordError
from analysis.wandb_records import TESTED_WANDB, read_offline, run_record
from conftest import cli

TINY = ["topology=local_2", "trainer.steps=2", "trainer.eval_batches=1", "trainer.progress=false",
        "wandb.mode=offline"]


def offline_runs(run_dir):
    return sorted(run_dir.glob("wandb/offline-run-*"))


def test_a_resumed_run_continues_its_wandb_run(tmp_path):
    run = [*TINY, "algorithm=fsdp", "trainer.checkpoint_every=1", f"hydra.run.dir={tmp_path}"]
    first = cli(*run, cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    shutil.rmtree(tmp_path / "checkpoints" / "step_00000002")  # as if killed during step 2
    again = cli(*run, "trainer.resume=auto", cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    runs = offline_runs(tmp_path)
    assert len(runs) == 2, runs
    kept = (tmp_path / "wandb_id").read_text().strip()
    assert [run_record(r).run_id for r in runs] == [kept, kept]
    assert all(r.name.endswith(f"-{kept}") for r in runs)  # `wandb sync` sends both to run `kept`


def test_multirun_points_get_group_job_type_and_tags(tmp_path):
    sweep = tmp_path / "2026-01-02" / "03-04-05"
    out = cli("-m", *TINY, "trainer.steps=1", "algorithm=fsdp,fl_fsdp", f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    points = {}
    for point in sorted(p for p in sweep.iterdir() if p.is_dir()):
        (folder,) = offline_runs(point)
        record = run_record(folder)
        points[record.job_type] = (record.run_group, sorted(record.tags))
        # the run's name ends in its point's directory, which names the point's overrides
        assert record.display_name == f"{record.job_type}-local_2-{point.name}"
        assert f"algorithm={record.job_type}," in point.name
    assert points == {
        "fsdp": ("2026-01-02_03-04-05", ["topology=local_2"]),
        "fl_fsdp": ("2026-01-02_03-04-05", ["A=8", "F=2", "topology=local_2"]),
    }
    # a group set by the user (as +experiment=paper_512 does) wins over the sweep's name
    named = tmp_path / "named"
    out = cli("-m", *TINY, "trainer.steps=1", "algorithm=fsdp", "wandb.group=mine", f"hydra.sweep.dir={named}",
              cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    (folder,) = offline_runs(named / "algorithm=fsdp,topology=local_2,trainer.eval_batches=1,trainer.steps=1")
    assert run_record(folder).run_group == "mine"


def _log(*payloads: bytes, log_version: int = 0) -> bytes:
    """A `.wandb` log: W&B's file header, then one FULL record per payload (LevelDB framing)."""
    data = struct.pack("<4sHB", b":W&B", 0xBEE1, log_version)
    for payload in payloads:
        data += struct.pack("<IHB", zlib.crc32(payload, zlib.crc32(bytes([1]))) & 0xFFFFFFFF, len(payload), 1)
        data += payload
    return data


@pytest.mark.parametrize("broken", ["log version", "record"])
def test_an_unreadable_log_names_the_wandb_versions(tmp_path, broken):
    folder = tmp_path / "offline-run-20260101_000000-abcdefgh"
    folder.mkdir()
    garbage = b"\xff\xff\xff\xff"  # not a protobuf message
    (folder / "run-abcdefgh.wandb").write_bytes(_log(garbage) if broken == "record" else _log(log_version=9))
    with pytest.raises(RecordError) as error:
        read_offline(folder)
    message = str(error.value)
    assert f"wandb {version('wandb')} installed" in message and f"tested with wandb {TESTED_WANDB}" in message
    assert ("log format version 9" if broken == "log version" else "does not parse") in message
