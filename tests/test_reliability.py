"""Checkpoint and resume, failures that end cleanly, inputs that cannot corrupt a run, disk faults and
signals during a run."""

import contextlib
import gzip
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import cli, compose_cfg, read_rows, run_world, train_world
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from fldp import checkpoint
from fldp.checkpoint import group_bytes, latest, prune
from fldp.config import load
from fldp.launch import WorkerError
from fldp.mesh import mesh_shape
from fldp.model import build_model, llama_config

RUN = [
    "algorithm=fl_hsdp",
    "topology=local_8",
    "trainer.steps=12",
    "algorithm.every=3",
    "trainer.checkpoint_every=2",
    "wandb.mode=disabled",
    "trainer.progress=false",
    "trainer.eval_batches=1",
]


def final_params(run_dir: Path, tmp: Path) -> dict:
    """Every federation group's final parameters and optimiser state, from the last checkpoint."""
    out = {}
    for group in sorted((latest(run_dir)).glob("group_*")):
        dcp_to_torch_save(group, tmp / f"{run_dir.name}-{group.name}.pt")
        out[group.name] = torch.load(tmp / f"{run_dir.name}-{group.name}.pt", weights_only=False)
    return out


def flatten(state, prefix=""):
    if isinstance(state, dict):
        return {k: v for key, sub in state.items() for k, v in flatten(sub, f"{prefix}{key}.").items()}
    return {prefix: state}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("uninterrupted")
    out = cli(*RUN, f"hydra.run.dir={run_dir}", cwd=run_dir)
    assert out.returncode == 0, out.stderr[-3000:]
    return run_dir


def _children(pid: int) -> list[int]:
    kids = []
    for p in os.listdir("/proc"):
        try:
            with open(f"/proc/{p}/stat") as f:
                if p.isdigit() and int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                    kids.append(int(p))
        except (OSError, IndexError, ValueError):
            pass
    return kids


def test_async_save_kill_a_worker_and_resume_equals_an_uninterrupted_run(tmp_path, uninterrupted):
    """trainer.async_save: DCP writes in a background thread; COMPLETE only once every rank's write
    ended, so the checkpoint resumed from is whole. A worker is killed (its launcher ends the run);
    keep_last=2 keeps the two newest (one run for both: CI's time; the launcher's kill, with
    synchronous saves, is the test below)."""
    kill_and_resume(tmp_path, [*RUN, "trainer.async_save=true", "trainer.keep_last=2"], uninterrupted, "worker")
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["step_00000010", "step_00000012"]


def test_kill_the_launcher_resume_and_keep_last_keeps_the_newest_complete_checkpoint(tmp_path, uninterrupted):
    kill_and_resume(tmp_path, [*RUN, "trainer.keep_last=1"], uninterrupted, "launcher")
    checkpoints = tmp_path / "run" / "checkpoints"
    assert [p.name for p in checkpoints.iterdir()] == ["step_00000012"]
    # the dry run's size formula against the bytes DCP wrote (fp32 weights + AdamW's 2 moments)
    cfg = compose_cfg(*RUN)
    model = build_model(llama_config(cfg.model, 4096), "meta")  # the shipped tokenizer's 4,096 tokens
    expected, _ = group_bytes(load(cfg), mesh_shape(cfg), [(n, p.numel()) for n, p in model.named_parameters()])
    written = sum(f.stat().st_size for f in (checkpoints / "step_00000012" / "group_0").iterdir())
    # DCP adds ~1 kB per tensor and its .metadata: 4% of this tiny model, nothing for the 8B one
    assert expected <= written < expected * 1.05, (written, expected)


# DiLoCo's outer optimiser: Nesterov momentum and the anchor are state that must survive too
DILOCO = [*RUN, "algorithm.outer.lr=0.7", "algorithm.outer.momentum=0.9", "algorithm.outer.nesterov=true"]


# quantised in int4 with error feedback: each rank's residual (what its last quantisation lost) is
# state too (one run for both: CI's time; plain FedAvg's resume is the test above). The first
# checkpoint, where the run is killed, comes after an aggregation (step 3 after step 2): before one,
# momentum and residual are zeros, and a resume that lost them would still be exact
DILOCO_INT4 = [
    *(o for o in DILOCO if not o.startswith(("algorithm.every=", "trainer.checkpoint_every="))),
    "algorithm.every=2",
    "trainer.checkpoint_every=3",
    "algorithm.outer.quantize=int4",
    "algorithm.outer.error_feedback=true",
]


def test_kill_then_resume_keeps_the_outer_optimiser_state(tmp_path):
    uninterrupted_dir = tmp_path / "uninterrupted"
    out = cli(*DILOCO_INT4, f"hydra.run.dir={uninterrupted_dir}", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    kill_and_resume(tmp_path, DILOCO_INT4, uninterrupted_dir, "launcher")
    saved = flatten(final_params(uninterrupted_dir, tmp_path))
    for kept in ("momentum_buffer", "residual"):  # by parameter name: outer.rank_0.<name>.<kind>
        assert any(".outer.rank_0.model." in k and k.endswith(f".{kept}.") for k in saved), (kept, sorted(saved)[:5])


def kill_and_resume(tmp_path, run, uninterrupted, victim):
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "fldp.train", *run, f"hydra.run.dir={run_dir}"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 240
    while latest(run_dir) is None:  # wait for the first complete checkpoint
        assert proc.poll() is None and time.monotonic() < deadline, "no checkpoint before the run ended"
        time.sleep(0.05)
    workers = _children(proc.pid)
    os.kill(workers[3] if victim == "worker" else proc.pid, signal.SIGKILL)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode != 0
    if victim == "worker":
        assert "died (signal SIGKILL)" in stderr, stderr[-2000:]
    time.sleep(1)
    assert not [w for w in workers if os.path.exists(f"/proc/{w}") and _state(w) != "Z"], "orphan workers"
    killed_at = latest(run_dir).name
    assert killed_at != "step_00000012", "the run finished before it was killed"
    assert_resume_is_exact(run, run_dir, uninterrupted, tmp_path)


def assert_resume_is_exact(run, run_dir: Path, uninterrupted: Path, tmp_path: Path, in_process=False) -> None:
    """trainer.resume=auto in run_dir finishes the run, and its losses and final state (every group's
    parameters and optimiser state) equal the uninterrupted run's, bit for bit. in_process: the
    same trainer on workers forked from this process, without the ~5 s a command spends importing."""
    if in_process:
        train_world(compose_cfg(*run, "trainer.resume=auto"), run_dir)
    else:
        out = cli(*run, "trainer.resume=auto", f"hydra.run.dir={run_dir}", cwd=tmp_path)
        assert out.returncode == 0, out.stderr[-3000:]
    assert [r["loss"] for r in read_rows(run_dir)] == [r["loss"] for r in read_rows(uninterrupted)]
    assert [r["step"] for r in read_rows(run_dir)] == list(range(1, len(read_rows(uninterrupted)) + 1))
    a, b = flatten(final_params(run_dir, tmp_path)), flatten(final_params(uninterrupted, tmp_path))
    assert a.keys() == b.keys() and len(a) > 20
    for key in a:
        if isinstance(a[key], torch.Tensor):
            assert torch.equal(a[key], b[key]), key
        else:
            assert a[key] == b[key], key


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def test_a_half_written_checkpoint_is_never_picked(tmp_path, uninterrupted):
    run_dir = tmp_path / "run"
    shutil.copytree(uninterrupted, run_dir)
    newest = latest(run_dir)
    partial = run_dir / "checkpoints" / "step_00000099"
    shutil.copytree(newest, partial)
    (partial / "COMPLETE").unlink()
    for f in (partial / "group_0").iterdir():
        f.write_bytes(f.read_bytes()[:10])  # truncated shards
    assert latest(run_dir) == newest
    out = cli(*RUN, "trainer.resume=auto", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert len(read_rows(run_dir)) == 12 and len(read_rows(run_dir, "eval")) == 1


def test_resume_with_another_mesh_is_refused(tmp_path, uninterrupted):
    run_dir = tmp_path / "run"
    shutil.copytree(uninterrupted, run_dir)
    out = cli(
        *RUN,
        "mesh.federation=4",
        "mesh.replicate=1",
        "trainer.resume=auto",
        f"hydra.run.dir={run_dir}",
        cwd=tmp_path,
        timeout=60,
    )
    assert out.returncode == 2
    assert "saved with mesh 2x2x2, this run has 4x1x2" in out.stderr


def test_resume_with_another_schedule_is_refused(tmp_path, uninterrupted):
    """Saved with A=3: another schedule is refused, naming algorithm.every, and so are other streaming
    fragments; the same schedule spelled as a schedule resumes."""
    run_dir = tmp_path / "run"
    shutil.copytree(uninterrupted, run_dir)
    out = cli(
        *RUN,
        "algorithm.every=[[0,3],[6,4]]",
        "trainer.resume=auto",
        f"hydra.run.dir={run_dir}",
        cwd=tmp_path,
        timeout=60,
    )
    assert out.returncode == 2, out.stderr[-3000:]
    assert "saved with algorithm.every=[[0, 3]], this run has algorithm.every=[[0, 3], [6, 4]]" in out.stderr
    fragments = cli(
        *RUN,
        "algorithm.streaming.fragments=3",
        "trainer.resume=auto",
        f"hydra.run.dir={run_dir}",
        cwd=tmp_path,
        timeout=60,
    )  # other fragments: other outer state
    assert fragments.returncode == 2, fragments.stderr[-3000:]
    assert "saved with algorithm.streaming.fragments=1, this run has 3" in fragments.stderr
    same = cli(*RUN, "algorithm.every=[[0,3]]", "trainer.resume=auto", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert same.returncode == 0, same.stderr[-3000:]


STREAMED = [
    "algorithm=fl_fsdp",
    "topology=local_2",
    "mesh.federation=2",
    "mesh.shard=1",
    "trainer.steps=8",
    "algorithm.every=4",
    "algorithm.streaming.fragments=2",
    "algorithm.outer.lr=0.7",
    "algorithm.outer.momentum=0.9",
    "trainer.checkpoint_every=4",
    "trainer.progress=false",
    "trainer.eval_batches=1",
    "wandb.mode=offline",
]


def fldp_train(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["fldp-train", *args], cwd=cwd, capture_output=True, text=True, timeout=600)


def test_resume_that_changes_what_a_saved_bucket_holds_is_refused_or_exact(tmp_path):
    """DiLoCo with 2 strided fragments keeps an anchor and momentum per bucket, saved by parameter
    name. A resume with another layout (the steps before aggregated other layers together) or other
    federated parameters would make the run neither configuration: each is refused with exit 2
    naming its key, and the checkpoint is left as it was. Other buckets (bucket_mb 0.01: about one
    per parameter, was one per fragment) re-assemble the state per parameter: the resumed run equals
    the uninterrupted one bit for bit."""
    run_dir, uninterrupted = tmp_path / "run", tmp_path / "uninterrupted"
    first = fldp_train(*STREAMED, f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    shutil.copytree(run_dir, uninterrupted)
    shutil.rmtree(run_dir / "checkpoints" / "step_00000008")  # as if stopped after step 4's checkpoint
    saved = latest(run_dir)
    assert saved.name == "step_00000004"
    kept = {p: p.read_bytes() for p in sorted(saved.rglob("*")) if p.is_file()}
    for override, named in (
        (
            "algorithm.streaming.layout=contiguous",
            "algorithm.streaming.layout=strided, this run has algorithm.streaming.layout=contiguous",
        ),
        (
            "algorithm.federate=[model\\.layers\\..*]",
            "algorithm.federate=['.*'], this run has algorithm.federate=['model\\\\.layers\\\\..*']",
        ),
    ):
        out = fldp_train(*STREAMED, override, "trainer.resume=auto", f"hydra.run.dir={run_dir}", cwd=tmp_path)
        assert out.returncode == 2, (override, out.stderr[-3000:])
        assert "fldp: config error" in out.stderr and named in out.stderr, out.stderr[-3000:]
        assert latest(run_dir) == saved
        assert {p: p.read_bytes() for p in sorted(saved.rglob("*")) if p.is_file()} == kept
    assert_resume_is_exact([*STREAMED, "algorithm.fedavg.bucket_mb=0.01"], run_dir, uninterrupted, tmp_path)


def test_a_quantised_run_or_state_saved_by_bucket_number_refuses_other_buckets(tmp_path):
    """Quantised, each bucket is what is quantised: the checkpoint records bucket_mb and a resume
    with another is refused, naming it. A checkpoint from before state was kept by parameter name
    (its meta.json names bucket_mb without saying how the state is keyed) is refused, naming that."""
    from types import SimpleNamespace

    from fldp.aggregation import FedAvgConfig, OuterConfig, saved_with

    config = FedAvgConfig(every=2, outer=OuterConfig(quantize="int4"))
    keys = saved_with(SimpleNamespace(config=config, fragments=1, quantizer=object()))
    assert keys == {"algorithm.federate": [".*"], "algorithm.fedavg.bucket_mb": 25.0}
    assert "algorithm.fedavg.bucket_mb" not in saved_with(SimpleNamespace(config=config, fragments=1, quantizer=None))
    other = FedAvgConfig(every=2, bucket_mb=1.0, outer=OuterConfig(quantize="int4"))
    for marker, named in (
        ({"fedavg_state": checkpoint.STATE_KEYS}, "algorithm.fedavg.bucket_mb=25.0, this run has algorithm.fedavg"),
        ({}, "kept FedAvg's outer state (anchor, reference, residual) by bucket number"),
    ):
        (tmp_path / "meta.json").write_text(json.dumps({"schedule": [[0, 2]], "saved_with": keys, **marker}))
        with pytest.raises(checkpoint.ConfigError, match=re.escape(named)):
            checkpoint.check_schedule(tmp_path, config.schedule, 1, other)
    (tmp_path / "meta.json").write_text(
        json.dumps({"schedule": [[0, 2]], "saved_with": keys, "fedavg_state": checkpoint.STATE_KEYS})
    )
    checkpoint.check_schedule(tmp_path, config.schedule, 1, config)  # the same buckets resume


def test_non_finite_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path):
    out = cli(
        "algorithm=fsdp",
        "optimizer.name=sgd",
        "optimizer.lr=1e38",
        "optimizer.warmup=0",
        "trainer.steps=6",
        "trainer.checkpoint_every=1",
        "wandb.mode=disabled",
        f"hydra.run.dir={tmp_path}",
        cwd=tmp_path,
    )
    assert out.returncode == 1
    assert "non-finite loss" in out.stderr
    good = latest(tmp_path)
    assert good is not None and not (tmp_path / "summary.json").exists()
    assert int(good.name.split("_")[1]) == len(read_rows(tmp_path))  # the step before the bad one


def _hang_on_rank_1(device):
    if dist.get_rank() == 1:
        time.sleep(300)  # never joins the collective
    dist.barrier()


@pytest.mark.timeout(120)  # rank 1 sleeps 300 s: only the collective's 5 s timeout ends the run before this
def test_a_rank_hung_in_a_collective_ends_the_run_within_the_timeout():
    with pytest.raises(WorkerError, match=r"failed first(.|\n)*([Tt]imed out|timeout)"):
        run_world(_hang_on_rank_1, 4, timeout_s=5)


def test_existing_records_are_not_overwritten(tmp_path, uninterrupted):
    run_dir = tmp_path / "run"
    shutil.copytree(uninterrupted, run_dir)
    before = (run_dir / "metrics.jsonl").read_bytes()
    out = cli(*RUN, f"hydra.run.dir={run_dir}", cwd=tmp_path, timeout=60)
    assert out.returncode == 2 and "already holds a run's metrics.jsonl" in out.stderr
    assert (run_dir / "metrics.jsonl").read_bytes() == before


@pytest.mark.parametrize("corpus", ["empty", "corrupt"])
def test_empty_or_corrupt_corpus_is_named(tmp_path, corpus):
    bad = tmp_path / "train.jsonl.gz"
    bad.write_bytes(gzip.compress(b"") if corpus == "empty" else b"\x1f\x8b not really gzip")
    out = cli(
        f"dataset.data_files.train={bad}",
        f"dataset.cache_dir={tmp_path}/cache",
        f"hydra.run.dir={tmp_path}/run",
        cwd=tmp_path,
        timeout=60,
    )
    assert out.returncode == 2
    assert "dataset." in out.stderr and ("no full block" in out.stderr or str(bad) in out.stderr), out.stderr[-1500:]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.parametrize(
    "outer",
    [[], ["algorithm.outer.momentum=0.9", "algorithm.outer.nesterov=true", "algorithm.outer.lr=0.7"]],
    ids=["fedavg", "diloco"],
)
def test_the_dry_runs_checkpoint_size_counts_what_a_casting_reduce_keeps(tmp_path, outer):
    """bf16 weights summed in fp32: every replica keeps the weights of the last aggregation (the
    reference, bf16), which is also the outer optimiser's anchor on the replica that leads. The
    dry run's formula against the bytes DCP wrote for one federation group (2 replicas)."""
    cfg = compose_cfg(
        "algorithm=fl_hsdp",
        "topology=local_4",
        "trainer.steps=2",
        "algorithm.every=2",
        "trainer.precision=bf16",
        "algorithm.outer.reduce_dtype=fp32",
        "trainer.checkpoint_every=2",
        "wandb.mode=disabled",
        "trainer.progress=false",
        "trainer.eval_batches=1",
        *outer,
    )
    assert (mesh_shape(cfg).federation, mesh_shape(cfg).replicate, mesh_shape(cfg).shard) == (2, 2, 1)
    train_world(cfg, tmp_path / "run")
    model = build_model(llama_config(cfg.model, 4096), "meta")
    expected, held = group_bytes(load(cfg), mesh_shape(cfg), [(n, p.numel()) for n, p in model.named_parameters()])
    written = sum(f.stat().st_size for f in (tmp_path / "run" / "checkpoints" / "step_00000002" / "group_0").iterdir())
    assert expected <= written < expected * 1.05, (written, expected, held)


def test_prune_keeps_the_newest_complete_and_every_incomplete_checkpoint(tmp_path):
    for step, done in ((2, True), (4, True), (6, True), (8, False)):
        path = tmp_path / "checkpoints" / f"step_{step:08d}"
        path.mkdir(parents=True)
        if done:
            (path / "COMPLETE").write_text(str(step))
    assert [p.name for p in prune(tmp_path, 2)] == ["step_00000002"]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "step_00000004",
        "step_00000006",
        "step_00000008",
    ]
    assert prune(tmp_path, 1) == [tmp_path / "checkpoints" / "step_00000004"]
    assert latest(tmp_path).name == "step_00000006"


STALE = "step_00000010"  # a complete checkpoint of a higher step, left by an earlier run


@pytest.fixture(scope="module")
def synced_run(tmp_path_factory):
    """FL+FSDP 2x1x1, a checkpoint after each of 2 steps, keep_last=1, in a run directory that holds
    a complete checkpoint of step 10; os.fsync spied on in every rank: per call, the inode it
    flushed and which checkpoints were COMPLETE at that moment (appended to a file the ranks share)."""
    run_dir = tmp_path_factory.mktemp("synced") / "run"
    stale = run_dir / "checkpoints" / STALE
    stale.mkdir(parents=True)
    (stale / "meta.json").write_text("{}")
    (stale / "COMPLETE").write_text("10")
    log = run_dir.parent / "fsync.jsonl"
    real = os.fsync

    def spy(fd):
        done = sorted(p.parent.name for p in (run_dir / "checkpoints").glob("step_*/COMPLETE"))
        with open(log, "a") as f:
            f.write(json.dumps({"inode": os.fstat(fd).st_ino, "complete": done}) + "\n")
        return real(fd)

    cfg = compose_cfg(
        "algorithm=fl_fsdp", "topology=local_2", "trainer.steps=2", "trainer.checkpoint_every=1", "trainer.keep_last=1"
    )
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(os, "fsync", spy)  # the forked ranks inherit it
        train_world(cfg, run_dir)
    return run_dir, [json.loads(line) for line in log.read_text().splitlines()]


def test_a_checkpoint_is_on_the_disk_before_it_is_marked_complete(synced_run):
    """Every file of the checkpoint and every directory holding them is fsynced before COMPLETE
    exists (else a node crash can leave COMPLETE beside a truncated file), and COMPLETE's own entry
    and the checkpoint's (the parent directory) after."""
    run_dir, calls = synced_run
    path = run_dir / "checkpoints" / "step_00000002"
    before = {c["inode"] for c in calls if path.name not in c["complete"]}
    after = {c["inode"] for c in calls if path.name in c["complete"]}
    files = [p for p in path.rglob("*") if p.name != "COMPLETE"]
    assert {p.name for p in files} >= {"rank_0.pt", "rank_1.pt", "meta.json", "group_0", "group_1", ".metadata"}
    for p in [path, *files]:
        assert p.stat().st_ino in before, f"{p.relative_to(run_dir)} not fsynced before COMPLETE"
    assert (path / "COMPLETE").stat().st_ino in before  # its data, before its name appears
    assert path.stat().st_ino in after and path.parent.stat().st_ino in after


def test_keep_last_never_deletes_the_checkpoint_just_written(synced_run):
    """The stale checkpoint of step 10 was completed before this run's: it is the older one."""
    run_dir, _ = synced_run
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == ["step_00000002"]
    assert latest(run_dir).name == "step_00000002"


class WarnAt:
    """on_step: installs the warning handler on every rank (step 0), then signals one rank after
    `step`, as SLURM's warning reaches the ranks of a job at different moments."""

    def __init__(self, step: int, rank: int):
        self.step, self.rank = step, rank

    def __call__(self, step, state, aggregated):
        if step == 0:
            checkpoint.stop_on(signal.SIGUSR2)
        elif step == self.step and dist.get_rank() == self.rank:
            os.kill(os.getpid(), signal.SIGUSR2)


def test_the_warning_signal_checkpoints_all_ranks_and_resume_is_exact(tmp_path, uninterrupted):
    """What a SLURM job does on its time-limit warning (tests/test_slurm.py runs it on the cluster):
    every rank stops after the same step with a complete checkpoint, and the resumed run equals an
    uninterrupted one."""
    run_dir = tmp_path / "run"
    with pytest.raises(WorkerError, match="stopped on the warning signal after step 5, checkpoint saved"):
        train_world(compose_cfg(*RUN, "trainer.resume=auto"), run_dir, on_step=WarnAt(5, rank=3))
    assert latest(run_dir).name == "step_00000005"  # not a checkpoint_every=2 step: saved on the signal
    train_world(compose_cfg(*RUN, "trainer.resume=auto"), run_dir)
    assert [r["loss"] for r in read_rows(run_dir)] == [r["loss"] for r in read_rows(uninterrupted)]


def test_with_an_all_reduce_in_flight_a_checkpoint_waits_for_its_merge_and_resume_is_exact(tmp_path):
    """Streaming overlap (fragment p sent the step before its merge, every 2 steps): checkpoint_every=3
    falls on step 3, while fragment 1 is in flight, and is written after step 4, its merge; the
    time-limit warning after step 5 (fragment 0 in flight) stops the run after step 6. Resumed from
    there, the run equals an uninterrupted one bit for bit (losses, weights, AdamW and outer state)."""
    run = [
        "algorithm=fl_fsdp",
        "topology=local_2",
        "trainer.steps=12",
        "algorithm.every=4",
        "algorithm.outer.lr=0.7",
        "algorithm.outer.momentum=0.9",
        "algorithm.streaming.fragments=2",
        "algorithm.streaming.overlap=1",
        "algorithm.streaming.alpha=0.5",
        "trainer.checkpoint_every=3",
        "wandb.mode=disabled",
        "trainer.progress=false",
        "trainer.eval_batches=1",
    ]
    uninterrupted = tmp_path / "uninterrupted"
    train_world(compose_cfg(*run), uninterrupted)
    run_dir = tmp_path / "run"
    with pytest.raises(WorkerError, match="stopped on the warning signal after step 6, checkpoint saved"):
        train_world(compose_cfg(*run, "trainer.resume=auto"), run_dir, on_step=WarnAt(5, rank=1))
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step_*")) == ["step_00000004", "step_00000006"]
    assert_resume_is_exact(run, run_dir, uninterrupted, tmp_path, in_process=True)


# --- Faults during a run: a disk that fills or turns read-only, SIGTERM and Ctrl-C to the launcher.
# A short run: 2 ranks, 2 federation groups (each saves its own DCP checkpoint), checkpoints at 4, 8, 12, 16.
SHORT = [
    "algorithm=fl_fsdp",
    "topology=local_2",
    "trainer.steps=16",
    "algorithm.every=4",
    "trainer.checkpoint_every=4",
    "wandb.mode=disabled",
    "trainer.progress=false",
    "trainer.eval_batches=1",
]
PAGE = 4096  # tmpfs allocates whole pages


@pytest.fixture(scope="module")
def short_uninterrupted(tmp_path_factory):
    """The reference, and the resumes below, run in this process (train_world): the faults hit real
    launchers started as commands; what is compared after is the trainer's, and a command costs
    ~5 s of imports each time."""
    run_dir = tmp_path_factory.mktemp("short_uninterrupted")
    train_world(compose_cfg(*SHORT), run_dir)
    return run_dir


@contextlib.contextmanager
def tmpfs(path: Path, size: int):
    """A tmpfs of `size` bytes mounted at `path` (a small disk to fill, or to remount read-only);
    unmounted at the end, whatever happened."""
    if os.geteuid() != 0:
        pytest.skip("needs root: mounts a small tmpfs to fill up or make read-only")
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        if subprocess.run(["umount", str(path)]).returncode != 0:
            subprocess.run(["umount", "-l", str(path)])  # still in use: detach now, freed when released


def remount(path: Path, options: str) -> bool:
    return subprocess.run(["mount", "-o", f"remount,{options}", str(path)], capture_output=True).returncode == 0


def start(run_dir: Path, cwd: Path) -> subprocess.Popen:
    """The launcher as a user starts it, in a process group of its own (as a terminal's job), which
    its workers join: Ctrl-C is SIGINT to that group; after the run nothing of the group may live."""
    return subprocess.Popen(
        [sys.executable, "-m", "fldp.train", *SHORT, f"hydra.run.dir={run_dir}"],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def wait_for(proc: subprocess.Popen, ready, what: str, limit_s: float = 120) -> None:
    deadline = time.monotonic() + limit_s
    while not ready():
        assert proc.poll() is None, f"the run ended before {what}: {proc.communicate()[1][-2000:]}"
        assert time.monotonic() < deadline, f"no {what} within {limit_s} s"
        time.sleep(0.02)


@contextlib.contextmanager
def frozen(proc: subprocess.Popen):
    """The launcher and its workers stopped (SIGSTOP) for a moment: the disk changes between two
    checkpoints, not while a fast run races past them."""
    os.killpg(proc.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.killpg(proc.pid, signal.SIGCONT)


def survivors(group: int) -> list[int]:
    """Processes of a process group still running (a zombie has exited; its parent reaps it)."""
    found = []
    for p in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == group and fields[0] != "Z":
            found.append(int(p))
    return found


def assert_nothing_half_done(run_dir: Path) -> None:
    """Every line of metrics.jsonl whole; every checkpoint left is complete (one cut short is deleted)."""
    text = (run_dir / "metrics.jsonl").read_text()
    assert text.endswith("\n"), f"a torn last line: {text[-200:]!r}"
    for line in text.splitlines():
        json.loads(line)
    left = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    complete = sorted(p.parent.name for p in (run_dir / "checkpoints").glob("step_*/COMPLETE"))
    assert left == complete, f"incomplete checkpoints left: {set(left) - set(complete)}"
    assert not (run_dir / "summary.json").exists()


def assert_one_clear_line(stderr: str, expected: str) -> None:
    assert expected in stderr, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]


def checkpoint_bytes(run_dir: Path) -> int:
    """What one checkpoint takes on a tmpfs: its files, each rounded up to whole pages."""
    return sum(-(-f.stat().st_size // PAGE) * PAGE for f in latest(run_dir).rglob("*") if f.is_file())


@pytest.mark.timeout(120)
def test_a_disk_full_during_a_checkpoint_stops_the_run_naming_it_and_resume_is_exact(tmp_path, short_uninterrupted):
    """Room for one checkpoint and a half: the first (step 4) is written, the second runs out of space."""
    size = checkpoint_bytes(short_uninterrupted)
    with tmpfs(tmp_path / "run", size * 3 // 2 + 2**20) as run_dir:
        out = cli(*SHORT, f"hydra.run.dir={run_dir}", cwd=tmp_path)
        assert out.returncode == 1, out.stderr[-3000:]
        assert_one_clear_line(
            out.stderr, f"cannot write checkpoint {run_dir}/checkpoints/step_00000008: No space left on device"
        )
        assert f"continue from {run_dir}/checkpoints/step_00000004 (step 4) with trainer.resume=auto" in out.stderr
        assert latest(run_dir).name == "step_00000004"
        assert_nothing_half_done(run_dir)  # the partial step_00000008 was deleted
        assert len(read_rows(run_dir)) == 8
        assert remount(run_dir, f"size={size * 6}")  # room for the 3 checkpoints still to come: continue
        assert_resume_is_exact(SHORT, run_dir, short_uninterrupted, tmp_path, in_process=True)


@pytest.mark.timeout(120)
def test_a_disk_full_while_writing_metrics_leaves_no_torn_line_and_resume_is_exact(tmp_path, short_uninterrupted):
    """The records on a disk of one page (without Hydra's .hydra/ and train.log: metrics.jsonl
    alone), the checkpoints on another with room: the row that crosses the page's end (row 9 or 10,
    rows are ~410-480 bytes) is written in part, then ENOSPC; that part is taken back."""
    size = checkpoint_bytes(short_uninterrupted)
    run_dir = tmp_path / "run"
    with tmpfs(run_dir, PAGE), tmpfs(run_dir / "checkpoints", size * 5):
        out = cli(
            *SHORT, f"hydra.run.dir={run_dir}", "hydra.output_subdir=null", "hydra/job_logging=none", cwd=tmp_path
        )
        assert out.returncode == 1, out.stderr[-3000:]
        assert_one_clear_line(out.stderr, f"cannot write {run_dir}/metrics.jsonl: No space left on device")
        assert_nothing_half_done(run_dir)
        assert 4 <= len(read_rows(run_dir)) < 16 and latest(run_dir) is not None
        assert remount(run_dir, "size=1m")
        assert_resume_is_exact(SHORT, run_dir, short_uninterrupted, tmp_path, in_process=True)


@pytest.mark.timeout(120)
def test_a_checkpoint_directory_turned_read_only_mid_run_stops_it_naming_it(tmp_path, short_uninterrupted):
    """(As root, permission bits do not stop a write: a read-only remount does.)"""
    size = checkpoint_bytes(short_uninterrupted)
    run_dir = tmp_path / "run"
    with tmpfs(run_dir / "checkpoints", size * 5) as checkpoints:
        proc = start(run_dir, tmp_path)
        wait_for(proc, lambda: latest(run_dir) is not None, "a complete checkpoint")
        for _ in range(100):  # refused (busy) while a save has a file open: let it go on a moment
            with frozen(proc):
                if remount(checkpoints, "ro"):
                    break
            time.sleep(0.01)
        else:
            pytest.fail("could not remount the checkpoint directory read-only")
        _, stderr = proc.communicate(timeout=60)
        assert proc.returncode == 1, stderr[-3000:]
        saved = latest(run_dir)
        after = f"step_{int(saved.name.split('_')[1]) + 4:08d}"
        assert_one_clear_line(stderr, f"cannot write checkpoint {checkpoints}/{after}: Read-only file system")
        assert_nothing_half_done(run_dir)
        assert remount(checkpoints, "rw")
        assert_resume_is_exact(SHORT, run_dir, short_uninterrupted, tmp_path, in_process=True)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["SIGTERM to the launcher", "Ctrl-C twice, a worker stuck"])
def test_sigterm_or_ctrl_c_stops_every_worker_and_resume_is_exact(tmp_path, short_uninterrupted, how):
    """SLURM's pre-kill or `kill`: SIGTERM to the launcher. A terminal's Ctrl-C: SIGINT to the whole
    process group, workers included; here one worker does not stop (SIGSTOP: as one stuck in native
    code), which the launcher would SIGKILL after 10 s, and a second Ctrl-C kills it at once. Sent as
    the second checkpoint starts, so that one is often cut short."""
    run_dir = tmp_path / "run"
    proc = start(run_dir, tmp_path)
    wait_for(proc, lambda: (run_dir / "checkpoints" / "step_00000008").exists(), "a second checkpoint")
    workers = _children(proc.pid)
    assert len(workers) == 2, workers
    if how == "SIGTERM to the launcher":
        name = "SIGTERM"
        proc.send_signal(signal.SIGTERM)
    else:
        name = "SIGINT"
        os.kill(workers[1], signal.SIGSTOP)
        os.killpg(proc.pid, signal.SIGINT)
        time.sleep(0.5)
        assert _state(workers[1]) in "Tt", "the stuck worker is gone before the second Ctrl-C"
        os.killpg(proc.pid, signal.SIGINT)
        second = time.monotonic()
        while os.path.exists(f"/proc/{workers[1]}") and _state(workers[1]) != "Z":
            # which mechanism killed it, not a speed: the launcher's own SIGKILL would come only after
            # its 10 s patience (launch._stop)
            assert time.monotonic() - second < 8, "the second Ctrl-C did not kill the stuck worker"
            time.sleep(0.02)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 128 + getattr(signal, name), stderr[-3000:]
    assert_one_clear_line(
        stderr, f"interrupted by {name}: the workers were stopped; continue from {run_dir}/checkpoints/"
    )
    assert not survivors(proc.pid), "workers outlived their launcher"
    assert not [w for w in workers if os.path.exists(f"/proc/{w}") and _state(w) != "Z"]
    assert_nothing_half_done(run_dir)
    assert latest(run_dir).name in ("step_00000004", "step_00000008")
    assert_resume_is_exact(SHORT, run_dir, short_uninterrupted, tmp_path, in_process=True)
