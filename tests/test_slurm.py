"""fldp on a real SLURM cluster: the single-host one of slurm/test-cluster.sh (two slurmd "nodes",
n1 and n2), which .ci/run starts before the tests and stops after them. Without SLURM the tests
that submit are skipped, saying how to start it; with FLDP_REQUIRE_SLURM=1 (CI) they fail instead.

Covered: a run submitted through cluster=slurm and one through slurm/generic.sbatch write the same
records as the same run on local processes; a sweep (-m cluster=slurm) submits one job per point
the way a single run is submitted: a finished point is not submitted, a point past its time limit
requeues and ends as an uninterrupted run, all points are submitted before any is followed, and a
failing point is reported with its cause while the others finish; a rank that raises or a
cancelled job is reported as failed, with its error, in bounded time; the leonardo cluster's dry
run renders the paper's 128-node, 512-task jobs; without SLURM a SLURM run fails at once."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import cloudpickle
import pytest
from conftest import QUICK, ROOT, cli, compose_cfg, read_rows, train_world
from omegaconf import OmegaConf

from fldp import launch, slurm
from fldp.config import load
from fldp.launch import WorkerError
from fldp.mesh import ConfigError, mesh_shape
from fldp.sweep import point_dirname
from fldp.validation import validate


def _slurm_up() -> bool:
    if shutil.which("sbatch") is None:
        return False
    return subprocess.run(["sinfo", "-h"], capture_output=True, timeout=30).returncode == 0


SLURM_UP = _slurm_up()
if os.environ.get("FLDP_REQUIRE_SLURM") == "1" and not SLURM_UP:
    raise RuntimeError("FLDP_REQUIRE_SLURM=1 but no SLURM answers here: slurm/test-cluster.sh start")
needs_slurm = pytest.mark.skipif(
    not SLURM_UP, reason="no SLURM here: start the single-host test cluster with `slurm/test-cluster.sh start` (root)"
)

# The same tiny FL+HSDP run everywhere: 2x2x2 mesh, 4 steps, FedAvg every 2.
RUN = ["algorithm=fl_hsdp", "trainer.steps=4", "algorithm.every=2", *QUICK]
NO_SLURM_ENV = {"PATH": "/nonexistent"}  # no sbatch/srun (Python is started by its full path)
# The pre-flight refuses run directories in /tmp, node-local on a real cluster; the test cluster's two
# "nodes" are this one host, and pytest's run directories are in /tmp.
SHARED_TMP = "cluster.node_local_dirs=[]"
LEONARDO = {"fsdp": "1x1x512", "hsdp": "1x128x4", "fl_fsdp": "128x1x4", "fl_hsdp": "16x8x4"}


def same_records(a: Path, b: Path) -> None:
    """Every value of every row equal, except wall times."""
    for split in (None, "eval"):
        ra, rb = read_rows(a, split), read_rows(b, split)
        assert len(ra) == len(rb) > 0
        for x, y in zip(ra, rb):
            assert {k: v for k, v in x.items() if not k.startswith(("time_", "critical_"))} == {
                k: v for k, v in y.items() if not k.startswith(("time_", "critical_"))
            }


def final_state(job, timeout_s: float = 60) -> str:
    """The job's state once SLURM has finished it (no task left running): nothing hangs."""
    deadline = time.monotonic() + timeout_s
    while (state := slurm.job_state(job)) in ("PENDING", "RUNNING", "COMPLETING"):
        assert time.monotonic() < deadline, f"job {job.job_id} still {state} after {timeout_s} s"
        time.sleep(0.5)
    return state


def cancel_jobs_from(directory: Path) -> None:
    """scancel the jobs still queued or running that were submitted from `directory` (a test's)."""
    if not SLURM_UP:
        return
    # %A: the array's job id for an array task (pending tasks print as "7_[3-5%3]", which scancel refuses)
    out = subprocess.run(["squeue", "-h", "-t", "PD,R,CG,S", "-o", "%A %Z"], capture_output=True, text=True).stdout
    ids = {
        line.split()[0] for line in out.splitlines() if line.split()[1:] and line.split()[1].startswith(str(directory))
    }
    if ids:
        subprocess.run(["scancel", *sorted(ids)])


def cluster_report() -> str:
    """What SLURM says of its nodes and jobs: printed by a SLURM test that fails."""
    out = []
    for cmd in (["sinfo", "-N", "-o", "%N %T %E"], ["squeue", "-t", "all", "-o", "%i %j %T %r %M %Z"]):
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
        out.append(f"$ {' '.join(cmd)}\n{r.stdout}{r.stderr}")
    return "\n".join(out)


def wait_until_idle(timeout_s: float = 60) -> None:
    """Every SLURM test starts on idle nodes with no job left: a drained node or an earlier test's
    job fails this test at once, saying so, instead of leaving its jobs pending until CI's end."""
    deadline = time.monotonic() + timeout_s
    while True:
        states = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], capture_output=True, text=True).stdout.split()
        jobs = subprocess.run(["squeue", "-h", "-t", "PD,R,CG,S"], capture_output=True, text=True).stdout.strip()
        if states and all(st.rstrip("*~#") == "idle" for st in states) and not jobs:
            return
        if time.monotonic() > deadline:
            pytest.fail(f"the SLURM test cluster is not idle after {timeout_s:g} s:\n{cluster_report()}")
        time.sleep(1)


@pytest.fixture
def idle_cluster(tmp_path):
    wait_until_idle()
    yield
    cancel_jobs_from(tmp_path)


# --- no SLURM needed --------------------------------------------------------------------------
@pytest.mark.parametrize("accounting", ["none", "sacct"])
def test_a_job_that_requeues_itself_is_followed_until_it_ends(monkeypatch, tmp_path, accounting):
    """Between its time-limit signal and its restart a job passes through SIGNALING, REQUEUED,
    REQUEUE_HOLD and PENDING (what squeue printed in CI when a job requeued itself): follow() waits
    through them all and asks for the outcome only at COMPLETED. Also sacct's "CANCELLED by 0" ends.
    accounting=none: sacct fails and squeue answers; sacct: sacct answers, a header line first and
    maybe more columns and rows than asked (the test cluster's stand-in answers as submitit asks)."""
    states = iter(
        [
            "RUNNING",
            "SIGNALING",
            "REQUEUED",
            "REQUEUE_HOLD",
            "PENDING",
            "CONFIGURING",
            "RUNNING",
            "COMPLETING",
            "COMPLETED",
        ]
    )
    asked = []

    def run(command, **kwargs):
        if command[0] == "sacct" and accounting == "none":
            return subprocess.CompletedProcess(command, 1, "", "Slurm accounting storage is disabled")
        asked.append(state := next(states))
        if command[0] == "sacct":
            return subprocess.CompletedProcess(
                command, 0, f"JobID|State|NodeList\n13|{state}|n[1-2]\n13.batch|COMPLETED|n1\n", ""
            )
        return subprocess.CompletedProcess(command, 0, state + "\n", "")

    class Job:  # what follow() may use of a submitit Job, in the state submitit's watcher would give
        job_id = "13"
        paths = type("Paths", (), {"folder": tmp_path})
        watcher = type("Watcher", (), {"get_state": lambda self, job_id, mode: "UNKNOWN"})()
        done = staticmethod(lambda: False)

    monkeypatch.setattr(slurm.subprocess, "run", run)
    monkeypatch.setattr(slurm, "outcome", lambda job, run_dir: {"outcome at": asked[-1]})
    assert slurm.follow(Job(), str(tmp_path), poll_s=0) == {"outcome at": "COMPLETED"}
    assert slurm.ended("CANCELLED by 0") and slurm.ended("TIMEOUT") and not slurm.ended("SIGNALING")


def test_topology_leonardo_512_brings_cluster_leonardo():
    assert compose_cfg("topology=leonardo_512").cluster.name == "leonardo"
    assert compose_cfg("topology=leonardo_512", "cluster=local").cluster.name == "local"
    assert compose_cfg().cluster.name == "local"


def test_leonardo_dry_run_renders_the_paper_jobs(tmp_path):
    """The four paper_512 runs, dry: 128 nodes x 4 tasks, 4 GPUs and 8 CPUs per task, the authors'
    meshes and hyper-parameters; nothing submitted (no sbatch on PATH)."""
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "fldp.train",
            "-m",
            "+experiment=paper_512",
            "cluster.dry_run=true",
            f"hydra.sweep.dir={tmp_path}",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **NO_SLURM_ENV},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    runs = out.stdout.split("fldp: dry run (cluster=leonardo): nothing submitted")[1:]
    assert len(runs) == 4, out.stdout[-3000:]
    seen = set()
    for text in runs:
        algorithm, mesh = re.search(r"^mesh: (\w+) (\d+x\d+x\d+) .* = 512 ranks", text, re.M).groups()
        assert LEONARDO[algorithm] == mesh
        seen.add(algorithm)
        assert "job: 128 nodes x 4 tasks = 512 tasks, one rank each (NCCL), partition boost_usr_prod" in text
        for flag in (
            "--nodes=128",
            "--ntasks-per-node=4",
            "--gpus-per-node=4",
            "--cpus-per-task=8",
            "--partition=boost_usr_prod",
            "--exclusive",
        ):
            assert f"#SBATCH {flag}\n" in text, flag
        assert (
            "run: model llama3_1_8b, dataset clean_mc4_it, bf16, batch 2 per rank, 64 steps, "
            "adamw lr 0.0003, seed 42" in text
        )
        assert "setting: the paper's (paper.md, Section 5)" in text
        assert ("FedAvg every 8 steps" in text) == algorithm.startswith("fl_")
        assert "export NCCL_IB_DISABLE=0" in text and "srun " in text
        assert "TORCH_NCCL_DUMP_ON_TIMEOUT=1" in text
    assert seen == set(LEONARDO)
    assert not list(tmp_path.rglob("metrics.jsonl"))


# Llama 3.1 8B by hand: embeddings and lm_head 128,256 x 4,096 each; per layer q, o 4,096^2, k, v
# 4,096 x 1,024, the MLP 3 x 4,096 x 14,336, two norms; the final norm
PARAMS_8B = 2 * 128256 * 4096 + 32 * (2 * 4096**2 + 2 * 4096 * 1024 + 3 * 4096 * 14336 + 2 * 4096) + 4096


@pytest.mark.parametrize(
    "algorithm,outer,per_param",
    [
        ("fl_fsdp", [], 2 * 3),  # bf16 weights + AdamW's 2 moments, in bf16
        (
            "fl_fsdp",
            ["algorithm.outer.lr=0.7", "algorithm.outer.momentum=0.9"],
            2 * 3 + 4 * 2,
        ),  # + fp32 anchor, momentum
        ("hsdp", [], 2 * 3),
    ],
)
def test_dry_run_prints_the_checkpoint_size(algorithm, outer, per_param):
    assert PARAMS_8B == 8_030_261_248
    cfg = compose_cfg(
        "topology=leonardo_512", f"algorithm={algorithm}", "trainer.checkpoint_every=8", "trainer.keep_last=2", *outer
    )
    shape = mesh_shape(cfg)
    text = slurm.describe(cfg, shape, slurm.job_parameters(load(cfg), shape))
    (line,) = [x for x in text.splitlines() if x.startswith("checkpoint:")]
    m = re.fullmatch(
        r"checkpoint: ([\d.]+ GB) per federation group x (\d+) = ([\d.]+ [GT]B) \(8.03 G parameters: "
        r"bf16 weights \+ adamw 2 moment\(s\).*\); every 8 steps, the newest 2 kept \(up to ([\d.]+ [GT]B) .*",
        line,
    )
    assert m, line
    group, groups, total, disk = m.groups()
    in_bytes = {"GB": 1e9, "TB": 1e12}
    group, total, disk = (float(x.split()[0]) * in_bytes[x.split()[1]] for x in (group, total, disk))
    assert int(groups) == shape.federation == (128 if algorithm == "fl_fsdp" else 1)
    assert group == pytest.approx(PARAMS_8B * per_param, rel=5e-3)  # 48.2 GB plain, 112 GB DiLoCo
    assert total == pytest.approx(PARAMS_8B * per_param * int(groups), rel=5e-3)  # 6.17 TB for FL+FSDP
    assert disk == pytest.approx(PARAMS_8B * per_param * int(groups) * 3, rel=5e-3)  # 2 kept + 1 being written


def test_an_elastic_runs_dry_run_shows_the_supervisor_and_each_groups_job_step(tmp_path):
    """One job; submitit's step is the supervisor alone (one task, first node), which starts each
    federation group as a job step on its own nodes; no time-limit requeue (no checkpoints)."""
    run = cli(
        "algorithm=fl_hsdp",
        "topology=slurm_2x4",
        "algorithm.elastic=true",
        *QUICK,
        "cluster=slurm",
        "cluster.dry_run=true",
        SHARED_TMP,
        f"hydra.run.dir={tmp_path / 'run'}",
        cwd=tmp_path,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    out = run.stdout
    assert re.search(r"^srun .* --nodes=1 --ntasks=1 \S+python\S* -u -m submitit.core._submit", out, re.M), out
    assert "#SBATCH --requeue" not in out and "#SBATCH --nodes=2" in out and "#SBATCH --ntasks-per-node=4" in out
    steps = re.findall(
        r"^srun --overlap (.*) -m fldp.group_step \S+ (\d) 0 http://FIRST_NODE:PORT FIRST_NODE:PORT$", out, re.M
    )
    assert [(g, opts.split()[:4]) for opts, g in steps] == [
        (str(g), ["--nodes=1", f"--relative={g}", "--ntasks=4", "--ntasks-per-node=4"]) for g in (0, 1)
    ], out


def test_without_slurm_a_slurm_run_fails_at_once(tmp_path):
    out = cli(
        "algorithm=fl_hsdp",
        "topology=leonardo_512",
        f"hydra.run.dir={tmp_path}",
        cwd=tmp_path,
        timeout=120,
        env=NO_SLURM_ENV,
    )
    assert out.returncode == 2
    assert "cluster=leonardo: no SLURM reachable from here (sbatch/srun not on PATH)" in out.stderr, out.stderr[-2000:]
    assert not (tmp_path / "metrics.jsonl").exists()


@pytest.mark.parametrize("launcher", ["fldp_slurm", "submitit_slurm"])
def test_a_sweep_launcher_for_slurm_is_refused_naming_the_one_path(tmp_path, launcher):
    out = cli(
        "-m",
        f"hydra/launcher={launcher}",
        "cluster=slurm",
        "seed=1,2",
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
        cwd=tmp_path,
        timeout=60,
    )
    assert out.returncode == 2, out.stderr[-2000:]
    assert f"fldp: config error: hydra/launcher={launcher}: SLURM runs take one path, cluster=slurm" in out.stderr
    assert not (tmp_path / "sweep").exists()


def test_a_run_directory_with_a_percent_sign_keeps_it_out_of_sbatchs_log_paths(tmp_path):
    """sbatch drops a '%' it cannot read as a pattern ('%2F' -> '2F'), so a job logging into such a
    directory failed at launch (JobLaunchFailure: "Could not open stdout file"); sweep points named
    by a value with '/' hold '%2F'."""
    cfg = compose_cfg("cluster=slurm")
    point = tmp_path / "sweep" / "dataset.cache_dir=%2Fwork%2Fcache,seed=1"
    assert slurm.job_folder_of(load(cfg).cluster, str(tmp_path / "run")) == tmp_path / "run" / "slurm" / "%j"
    assert slurm.job_folder_of(load(cfg).cluster, str(point)) == tmp_path / "sweep" / "slurm-jobs" / "%j"
    with pytest.raises(ConfigError, match="cluster.folder=/work/100%: sbatch reads '%'"):
        validate(compose_cfg("cluster=slurm", "cluster.folder=/work/100%"))


def test_local_sweep_an_invalid_point_fails_alone(tmp_path):
    """Hydra's basic launcher, one point after another: F=3 cannot fit 2 ranks and fails, logged
    as it fails; F=2 still runs; the sweep exits non-zero at the end."""
    out = cli(
        "-m",
        "algorithm=fl_fsdp",
        "topology=local_2",
        "trainer.steps=1",
        "mesh.federation=3,2",
        *QUICK,
        f"hydra.sweep.dir={tmp_path}",
        cwd=tmp_path,
        timeout=300,
    )
    assert out.returncode == 1
    assert re.search(
        r"sweep point #0 \(.*mesh.federation=3.*\) failed: mesh.federation x mesh.replicate x "
        r"mesh.shard = 3x1x1 = 3 ranks, but topology=local_2 has 2",
        out.stdout + out.stderr,
    )
    assert [p.parent.name for p in tmp_path.glob("*/summary.json")] == [
        "algorithm=fl_fsdp,mesh.federation=2,topology=local_2,trainer.eval_batches=1,trainer.steps=1"
    ]


def test_rendezvous_from_the_allocation():
    assert launch.first_node("lrdn[0012-0015,0100],lrdn0200") == "lrdn0012"
    assert launch.first_node("n1,n2") == "n1" and launch.first_node("gpu7") == "gpu7"
    env = {"SLURM_JOB_NODELIST": "n[1-2]", "SLURM_JOB_ID": "42"}
    assert launch.rendezvous(env) == ("n1", 12042)
    assert launch.rendezvous({**env, "MASTER_ADDR": "h", "MASTER_PORT": "7"}) == ("h", 7)


# --- on the SLURM cluster ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def two_by_four(tmp_path_factory, token_cache):
    """The tiny FL+HSDP run three ways, the two SLURM jobs side by side: submitted through
    cluster=slurm, through slurm/generic.sbatch, and on 8 local processes; all read the token cache
    that `python -m fldp.data` made (the pre-flight of the submitted run requires it)."""
    base = tmp_path_factory.mktemp("two_by_four")
    wait_until_idle()
    submitted, scripted, local = base / "submitted", base / "sbatch", base / "local"
    cache = f"dataset.cache_dir={token_cache}"
    start = time.monotonic()
    procs = {
        "submitted": subprocess.Popen(
            [
                sys.executable,
                "-m",
                "fldp.train",
                *RUN,
                cache,
                "topology=slurm_2x4",
                "cluster=slurm",
                SHARED_TMP,
                "cluster.poll_s=1",
                "cluster.time_min=10",
                f"hydra.run.dir={submitted}",
            ],
            cwd=base,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        ),
        "sbatch": subprocess.Popen(
            [
                "sbatch",
                "--wait",
                "--output",
                str(base / "sbatch.out"),
                str(ROOT / "slurm" / "generic.sbatch"),
                *RUN,
                cache,
                f"hydra.run.dir={scripted}",
            ],
            cwd=base,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "FLDP_VENV": sys.prefix},
        ),
    }
    train_world(compose_cfg(*RUN, cache, "topology=local_8"), local)
    outcomes = {}
    try:
        for name, p in procs.items():
            stdout, stderr = p.communicate(timeout=480)
            outcomes[name] = (p.returncode, stdout + stderr, time.monotonic() - start)
    finally:
        for p in procs.values():
            p.kill()
        cancel_jobs_from(base)
    return {"submitted": submitted, "sbatch": scripted, "local": local, "base": base, "outcomes": outcomes}


@needs_slurm
def test_fl_hsdp_2x4_through_the_cluster_config_matches_a_local_run(two_by_four):
    rc, output, elapsed = two_by_four["outcomes"]["submitted"]
    assert rc == 0, output[-3000:]
    assert re.search(r"submitted SLURM job \d+: mesh: fl_hsdp 2x2x2 .* job: 2 nodes x 4 tasks = 8 tasks", output)
    summary = json.loads((two_by_four["submitted"] / "summary.json").read_text())
    assert (summary["world_size"], summary["topology"], summary["every"]) == (8, "slurm_2x4", 2)
    same_records(two_by_four["submitted"], two_by_four["local"])
    print(f"cluster=slurm run: {elapsed:.0f} s")


@needs_slurm
def test_fl_hsdp_2x4_through_the_sbatch_script_matches_a_local_run(two_by_four):
    rc, output, elapsed = two_by_four["outcomes"]["sbatch"]
    log = (two_by_four["base"] / "sbatch.out").read_text() if (two_by_four["base"] / "sbatch.out").exists() else ""
    assert rc == 0, (output + log)[-3000:]
    summary = json.loads((two_by_four["sbatch"] / "summary.json").read_text())
    assert (summary["world_size"], summary["federation"], summary["replicate"], summary["shard"]) == (8, 2, 2, 2)
    same_records(two_by_four["sbatch"], two_by_four["local"])
    print(f"sbatch run: {elapsed:.0f} s")


@needs_slurm
def test_the_dry_runs_script_is_the_one_submitted(two_by_four, token_cache):
    """fldp renders the dry run's sbatch script itself (submitit's renderer is private): it must be
    byte for byte the script submitit wrote and sbatch ran for the same run."""
    (real,) = two_by_four["submitted"].glob("slurm/*/*_submission.sh")
    cfg = compose_cfg(
        *RUN,
        f"dataset.cache_dir={token_cache}",
        "topology=slurm_2x4",
        "cluster=slurm",
        SHARED_TMP,
        "cluster.poll_s=1",
        "cluster.time_min=10",
    )
    params = slurm.job_parameters(load(cfg), mesh_shape(cfg))
    assert slurm.sbatch_script(params, two_by_four["submitted"] / "slurm" / "%j") == real.read_text()


def _fail_on_rank_2(cfg, run_dir):
    """Rank 2 raises while its peers are busy for 10 minutes in something that does not notice
    (a long computation, a collective of another group): they write no result of their own."""
    env = launch.from_environment()
    launch.init_process_group(env, "cpu", timeout_s=600)
    if env.rank == 2:
        raise ValueError("injected failure on rank 2")
    time.sleep(600)


def _sleep(cfg, run_dir):
    time.sleep(600)


cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the job unpickles these test functions


def _small_job_cfg():
    cfg = compose_cfg(
        "cluster=slurm",
        "topology=slurm_2x4",
        "topology.procs_per_node=2",
        "mesh.federation=2",
        "mesh.replicate=1",
        "mesh.shard=2",
    )
    return cfg, mesh_shape(cfg)


# sacct on a site without an accounting database
NO_ACCOUNTING = "#!/bin/sh\necho 'sacct: error: Slurm accounting storage is disabled' >&2\nexit 1\n"


@needs_slurm
@pytest.mark.parametrize("accounting", ["sacct", "none"])
def test_a_rank_that_raises_fails_the_job_at_once_with_its_error(tmp_path, idle_cluster, accounting, monkeypatch):
    """srun kills rank 2's peers before they write a result; with accounting=none, where sacct has no
    answer, only squeue says that the job ended, and follow() still reports it at once."""
    if accounting == "none":
        (tmp_path / "bin").mkdir()
        (tmp_path / "bin" / "sacct").write_text(NO_ACCOUNTING)
        (tmp_path / "bin" / "sacct").chmod(0o755)
        monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    cfg, shape = _small_job_cfg()
    start = time.monotonic()
    job = slurm.submit_job(cfg, str(tmp_path), shape, fn=_fail_on_rank_2)
    try:
        # srun ended the busy peers (SLURM_KILL_BAD_EXIT): had they waited their 600 s sleep, follow
        # would give up at its 300 s without this error (a bound on the peers, not on the machine)
        with pytest.raises(WorkerError, match=r"rank 2 failed first:(.|\n)*ValueError: injected failure on rank 2"):
            slurm.follow(job, str(tmp_path), poll_s=1, timeout_s=300)
        assert final_state(job) == "FAILED"
    finally:
        job.cancel(check=False)
    print(f"failing rank reported after {time.monotonic() - start:.0f} s")


@needs_slurm
def test_an_elastic_runs_failed_group_is_a_job_step_started_again_that_heals_and_rejoins(
    tmp_path, idle_cluster, token_cache
):
    """algorithm.elastic=true under SLURM: one job, whose one task (first node) runs the torchft
    lighthouse and starts each federation group as a job step. Every rank of group 1 SIGKILLed after
    step 3: srun ends that step alone, group 0 trains on; the step is started again, heals from
    group 0 and trains with it to the end; the job completes. Groups of 2 ranks on 2 nodes: a
    restarted step spends ~15 s importing and joining, which group 0 outlasts with 400 short steps."""
    steps = 400
    run = cli(
        "algorithm=fl_fsdp",
        "topology=slurm_2x4",
        "topology.procs_per_node=2",
        "mesh.federation=2",
        "mesh.shard=2",
        "algorithm.elastic=true",
        f"trainer.steps={steps}",
        "algorithm.every=8",
        *QUICK,
        f"dataset.cache_dir={token_cache}",
        "cluster=slurm",
        SHARED_TMP,
        "cluster.poll_s=1",
        "cluster.time_min=10",
        f"hydra.run.dir={tmp_path / 'run'}",
        cwd=tmp_path,
        timeout=400,
        env={"FLDP_FAULT": "group=1,step=3"},
    )
    assert run.returncode == 0, run.stderr[-3000:] + cluster_report()
    records = tmp_path / "run"
    events = [json.loads(line) for line in (records / "elastic_events.jsonl").read_text().splitlines()]
    assert [(e["group"], e["incarnation"], e["exit"], e["restarted"]) for e in events] == [
        (1, 0, "exit code 137", True)
    ]
    logs = records / "elastic_logs"
    assert "FLDP_FAULT kills group 1 at step 3" in (logs / "group_1.restart_0.log").read_text()
    assert (logs / "group_1.restart_1.log").exists() and not (logs / "group_0.restart_1.log").exists()
    survivor = read_rows(records)
    assert [r["step"] for r in survivor] == list(range(1, steps + 1))
    participants = [r["participants"] for r in survivor if "participants" in r]
    assert participants[-1] == 2 and 1 in participants, participants
    rejoined = [json.loads(line) for line in (records / "group_1" / "metrics.jsonl").read_text().splitlines()]
    heal = next(r for r in rejoined if r.get("split") == "heal")
    print(f"group 1 healed at step {heal['step']} of {steps}")  # the margin left (shown if the test fails)
    assert heal["restart"] == 1 and heal["healed_from"] == [0, 0] and heal["step"] < steps
    assert [r["step"] for r in rejoined if "split" not in r] == [1, 2, 3, *range(heal["step"] + 1, steps + 1)]
    summary = json.loads((records / "summary.json").read_text())
    assert summary["steps"] == steps and summary["eval_perplexity"] > 0


@needs_slurm
def test_a_cancelled_job_is_reported_failed(tmp_path, idle_cluster):
    cfg, shape = _small_job_cfg()
    job = slurm.submit_job(cfg, str(tmp_path), shape, fn=_sleep)
    try:
        deadline = time.monotonic() + 120
        while job.watcher.get_state(job.job_id, mode="force") != "RUNNING":
            assert time.monotonic() < deadline, "the job never started"
            time.sleep(0.5)
        subprocess.run(["scancel", job.job_id], check=True)
        with pytest.raises(WorkerError, match=rf"SLURM job {job.job_id} ended CANCELLED"):  # not follow's timeout
            slurm.follow(job, str(tmp_path), poll_s=1, timeout_s=120)
        assert final_state(job).startswith("CANCELLED")
    finally:
        job.cancel(check=False)


@needs_slurm
def test_a_sweeps_points_are_all_submitted_then_followed_and_a_failing_one_reports_its_cause(
    tmp_path, idle_cluster, token_cache
):
    """Two points (-m cluster=slurm): a vocabulary too small for the tokenizer, which passes the
    pre-flight and is found by the ranks inside the job, and a good one. Both are submitted before
    either is followed; the sweep exits 1 with the failing point's first rank's error, no rank
    waits, and the good point finishes with its records."""
    try:
        out = subprocess.run(  # one stream, so the order of what it says is the order it happened in
            [
                sys.executable,
                "-m",
                "fldp.train",
                "-m",
                "cluster=slurm",
                "topology=slurm_2x4",
                "topology.procs_per_node=2",
                "mesh.replicate=1",
                "cluster.poll_s=1",
                "model.vocab_size=1000,null",
                "trainer.steps=2",
                f"dataset.cache_dir={token_cache}",
                SHARED_TMP,
                *QUICK,
                f"hydra.sweep.dir={tmp_path}",
            ],
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=400,
        )
    finally:
        cancel_jobs_from(tmp_path)
    output = out.stdout
    assert out.returncode == 1, output[-3000:]
    submitted = [m.start() for m in re.finditer(r"submitted SLURM job \d+", output)]
    following = output.index("following the sweep's 2 SLURM jobs")
    assert len(submitted) == 2 and max(submitted) < following, output[-3000:]
    assert re.search(r"sweep point \S*model.vocab_size=1000\S* failed: SLURM job \d+: rank \d+ failed first", output)
    assert "has 4096 tokens but model.vocab_size=1000" in output
    assert re.search(r"SLURM job \d+ finished: \S*model.vocab_size=null\S*: eval perplexity", output), output[-3000:]
    (done,) = tmp_path.glob("*/summary.json")
    assert "model.vocab_size=null" in done.parent.name


@needs_slurm
def test_sbatch_refuses_an_impossible_job_at_once(tmp_path, idle_cluster):
    """3 nodes on a 2-node cluster: EnforcePartLimits makes sbatch refuse it instead of queueing it."""
    cfg = compose_cfg(
        "cluster=slurm",
        "topology=slurm_2x4",
        "topology.nodes=3",
        "topology.procs_per_node=1",
        "mesh.federation=3",
        "mesh.replicate=1",
        "mesh.shard=1",
    )
    with pytest.raises(WorkerError, match="sbatch refused the job"):
        slurm.submit_job(cfg, str(tmp_path), mesh_shape(cfg), fn=_sleep)


def _seconds(elapsed: str) -> int:
    """squeue's %M: [days-][hours:]minutes:seconds."""
    days, _, clock = elapsed.rpartition("-")
    seconds = 0
    for part in clock.split(":"):
        seconds = seconds * 60 + int(part)
    return seconds + 86400 * int(days or 0)


LONG_LIMIT_MIN = 20  # a slot no run of this test outlasts on any machine that runs the suite
SLEEP_S = 180  # the emulated link's sleeps in the time-limited job: more than the <= ~90 s to its warning
EMULATION_SCALE = 0.001


def _requeued_point(run: list[str], federation_bytes: float) -> list[str]:
    """The time-limited sweep point: fl_fsdp 2x1x1 with one rank per node, so FedAvg crosses the
    inter-node tier, whose bandwidth makes what FedAvg sends (`federation_bytes`, metered in the same
    run on local processes) take SLEEP_S: bytes / (gbit_s * 1e9 / 8 * comm.scale). The sleeps change
    no record. Spelled as Hydra writes a sweep point's overrides (True), which name its directory."""
    gbit_s = max(1, int(federation_bytes * 8 / (1e9 * EMULATION_SCALE * SLEEP_S)))
    slow = [
        "comm.emulate=True",
        f"comm.scale={EMULATION_SCALE}",
        f"topology.network=[{{tier:node,ranks:1,gbit_s:800}},{{tier:inter-node,ranks:2,gbit_s:{gbit_s}}}]",
    ]
    return [
        *run,
        "cluster=slurm",
        "topology=slurm_2x4",
        "topology.procs_per_node=1",
        "mesh.federation=2",
        "mesh.replicate=1",
        "mesh.shard=1",
        f"cluster.time_min={LONG_LIMIT_MIN}",
        "cluster.signal_s=30",
        "cluster.max_requeue=1",
        "cluster.poll_s=1",
        *slow,
        SHARED_TMP,
    ]


def _steer_time_limit(job: str, state: str, reason: str, elapsed: str, trains: bool, steered: dict) -> None:
    """The job's time limit is long while it starts (however slow the machine, the warning cannot
    come before its handler is installed) and is cut once it trains, to the next whole minute past
    now (SLURM counts limits in minutes): the warning comes within ~90 s, in the midst of a run that
    sleeps SLEEP_S. Held after its requeue (BeginTime; SLURM would hold it ~2 min), it gets the
    long limit back and is released, as an idle site's queue would start it: the rest of the run
    ends in that slot. Released 3 s into the hold, not at once: a batch started while slurmd still
    kills the requeued one is refused ("Job 9 already killed, do not launch batch job") and the job
    ends FAILED. `steered[job]`: "cut", then ("held", since), then "released"."""
    stage = steered.get(job)
    if state == "RUNNING" and trains and stage is None:
        limit = _seconds(elapsed) // 60 + 2
        subprocess.run(["scontrol", "update", f"JobId={job}", f"TimeLimit={limit}"], check=True)
        steered[job] = "cut"
    elif state == "PENDING" and reason == "BeginTime" and stage == "cut":
        steered[job] = ("held", time.monotonic())
    elif isinstance(stage, tuple) and time.monotonic() - stage[1] >= 3:
        subprocess.run(
            ["scontrol", "update", f"JobId={job}", f"TimeLimit={LONG_LIMIT_MIN}", "StartTime=now"], check=True
        )
        steered[job] = "released"


@needs_slurm
@pytest.mark.timeout(1500)
def test_a_sweep_skips_its_finished_point_and_its_point_past_the_time_limit_requeues(
    tmp_path, idle_cluster, token_cache
):
    """A sweep over two seeds through cluster=slurm, the one path of every SLURM run. Seed 0 has
    finished before (its records from a local run): nothing is submitted for it. Seed 1's job is
    warned of its time limit mid-run (_steer_time_limit: the limit is cut once it trains): it stops
    with a checkpoint, requeues itself, resumes in the same run directory, and its records equal an
    uninterrupted local run's. Whatever the machine's speed it requeues exactly once: a fixed
    1-minute limit gave a loaded machine (load ~10 on 2 cores) a few steps a slot, past
    cluster.max_requeue=8, and a fast one could finish inside it. The job's FedAvg sleeps as over a
    slow link (_requeued_point), so it outlasts the cut limit however fast the machine. No
    assertion on time: pytest's timeout only stops a test that hangs."""
    # 200 steps: the job's length is its FedAvg sleeps (SLEEP_S), not its steps; the two local runs
    # beside it cost their steps (600 took ~34 s each on an idle 2-core machine)
    run = ["algorithm=fl_fsdp", "trainer.steps=200", "algorithm.every=4", *QUICK, f"dataset.cache_dir={token_cache}"]
    sweep_dir, local = tmp_path / "sweep", tmp_path / "local"
    train_world(compose_cfg(*run, "topology=local_2", "seed=1"), local)  # uninterrupted
    point = _requeued_point(run, sum(r["bytes_federation"] for r in read_rows(local)))
    excluded = OmegaConf.load(ROOT / "conf" / "config.yaml").hydra.job.config.override_dirname.exclude_keys
    finished, requeued = (sweep_dir / point_dirname([*point, f"seed={s}"], excluded) for s in (0, 1))
    train_world(compose_cfg(*run, "topology=local_2", "seed=0"), finished)  # fl_fsdp 2x1x1, done before
    records = [finished / "metrics.jsonl", finished / "summary.json"]
    before = [p.stat().st_mtime_ns for p in records]
    proc = subprocess.Popen(
        [sys.executable, "-m", "fldp.train", "-m", *point, "seed=0,1", f"hydra.sweep.dir={sweep_dir}"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    steered: dict = {}
    try:
        while proc.poll() is None:
            jobs = subprocess.run(["squeue", "-h", "-o", "%i %T %r %M %Z"], capture_output=True, text=True).stdout
            for job, state, reason, elapsed, workdir in (line.split() for line in jobs.splitlines()):
                if workdir.startswith(str(tmp_path)):  # rank 0 has written a row: the job trains
                    trains = (requeued / "metrics.jsonl").is_file() and (requeued / "metrics.jsonl").stat().st_size > 0
                    _steer_time_limit(job, state, reason, elapsed, trains, steered)
            time.sleep(1)
        output = proc.stdout.read()
    finally:
        proc.kill()
        cancel_jobs_from(tmp_path)
    assert proc.returncode == 0, output[-4000:] + cluster_report()
    assert f"skipped: {finished} already finished" in output, output[-4000:]
    assert [p.stat().st_mtime_ns for p in records] == before
    (job,) = re.findall(r"submitted SLURM job (\d+)", output)
    restarts = int(
        re.search(
            r"Restarts=(\d+)", subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True).stdout
        ).group(1)
    )
    assert restarts == 1 and steered == {job: "released"}, (restarts, steered)
    logs = "".join(p.read_text() for p in sweep_dir.rglob(f"{job}_0_log.err"))  # in slurm-jobs/: '%2F' in the name
    assert len(re.findall(r"checkpoint after step \d+, requeued", logs)) == 1, logs[-3000:]
    same_records(requeued, local)
    slept = sum(r["time_aggregation"] for r in read_rows(requeued))
    print(f"time-limited sweep point: requeued once; FedAvg took {slept:.0f} s of the job's steps")


def test_gpu_topology_needs_one_gpu_per_rank():
    cfg = compose_cfg("topology=leonardo_512", "cluster.gpus_per_node=2")
    with pytest.raises(ConfigError, match="cluster.gpus_per_node=2 but topology.procs_per_node=4"):
        validate(cfg)
