"""One experiment as ONE SLURM job: topology.nodes x topology.procs_per_node tasks, every task a
rank. The job's shape comes from the topology and the cluster config (conf/cluster/slurm.yaml,
leonardo.yaml); submission, and following the job to its end, go through submitit. Every SLURM run
takes this one path: a single run, and each point of a multirun (Hydra's own launcher calls the
run once per point; with cluster.wait the points' jobs are followed together once all are
submitted), so finished points are skipped and a time-limited job requeues alike. Light to import:
checkpoint and preflight, which import torch, are imported where they are used.

Inside the job, fldp.launch.from_environment turns the srun task's SLURM variables into the
torch.distributed world, with the rendezvous from `fldp.launch.rendezvous()`."""

from __future__ import annotations

import functools
import json
import logging
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import cast

from omegaconf import OmegaConf

from .config import ClusterConfig, Config, load
from .errors import WorkerError
from .mesh import MeshShape
from .schedule import schedule_text
from .setting import differences, paper_config

log = logging.getLogger("fldp")


def submits(cluster: ClusterConfig) -> bool:
    """True when this process should submit the run rather than train: a SLURM cluster config,
    and not already a task of a SLURM job step (then it is a rank, or forks the workers)."""
    return cluster.launcher == "slurm" and "SLURM_STEP_ID" not in os.environ


# --- inside the job ---------------------------------------------------------------------------


def run_rank(cfg, run_dir: str, run):
    """What every task of a submitted job runs (pickled by submitit): run(cfg, run_dir), fldp.train's
    entry point, passed in so that this module needs nothing of it. With cluster.max_requeue, the
    job resumes from its newest checkpoint in the same run directory (a requeued job starts here
    again), and SLURM's warning signal before the time limit makes it checkpoint and requeue."""
    from . import checkpoint

    conf = load(cfg)
    if conf.cluster.master_addr:
        os.environ["MASTER_ADDR"] = str(conf.cluster.master_addr)
    if conf.cluster.master_port:
        os.environ["MASTER_PORT"] = str(conf.cluster.master_port)
    if os.environ.get("TORCH_NCCL_DUMP_ON_TIMEOUT") == "1":  # the flight recorder's dumps: in the run dir
        Path(run_dir, "flight_recorder").mkdir(parents=True, exist_ok=True)
        os.environ.setdefault("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", str(Path(run_dir, "flight_recorder", "rank_")))
    if not requeues(conf):
        return run(cfg, run_dir)
    cfg.trainer.resume = "auto"  # the composed config: what run() validates and the records keep
    checkpoint.stop_on(WARNING_SIGNAL)  # replaces submitit's handler, which requeues without a checkpoint
    try:
        return run(cfg, run_dir)
    except checkpoint.Stopped as stopped:
        requeue(conf.cluster.max_requeue, run_dir, stopped.step)


# submitit asks SLURM for this signal cluster.signal_s before the time limit (sbatch --signal)
WARNING_SIGNAL = signal.SIGUSR2


def requeues(conf: Config) -> bool:
    """Whether the job checkpoints and requeues itself before its time limit: cluster.max_requeue,
    but not for elastic federation, which keeps no checkpoints (a failed group heals from a peer)."""
    return bool(conf.cluster.max_requeue) and not conf.algorithm.elastic


def requeue(max_requeue: int, run_dir: str, step: int):
    """Rank 0 requeues the job (SLURM kills it and starts it again, same job id and run directory),
    up to cluster.max_requeue times; every rank then leaves without a result, so the job is not
    taken for ended. Past the limit the job fails, saying how to continue."""
    job, restarts = os.environ["SLURM_JOB_ID"], int(os.environ.get("SLURM_RESTART_COUNT", 0))
    if restarts >= max_requeue:
        raise WorkerError(
            f"SLURM job {job} was warned of its end after {restarts} requeues (cluster.max_requeue="
            f"{max_requeue}); its checkpoint after step {step} is in {run_dir}: continue "
            f"with trainer.resume=auto hydra.run.dir={run_dir}"
        )
    if int(os.environ.get("SLURM_PROCID", 0)) == 0:
        subprocess.run(["scontrol", "requeue", job], check=True, capture_output=True, timeout=60)
        log.warning(
            "SLURM job %s: checkpoint after step %d, requeued (%d of cluster.max_requeue=%d)",
            job,
            step,
            restarts + 1,
            max_requeue,
        )
    raise SystemExit(0)  # no result pickle: the submitter keeps following the job


# --- elastic federation: each federation group a job step of the one job (fldp/elastic.py) ------


def group_step_command(shape, topology, group: int, restart: int, spec, lighthouse: str, roster: str) -> list[str]:
    """The srun that starts group `group`'s ranks as a job step: on the nodes of its ranks' places in
    the whole run (node-major), sharing the allocation with the other groups and the supervisor;
    srun ends the step, and only it, when one of its tasks dies."""
    ppn = topology.procs_per_node
    first, last = group * shape.group_size // ppn, ((group + 1) * shape.group_size - 1) // ppn
    return [
        "srun",
        "--overlap",
        f"--nodes={last - first + 1}",
        f"--relative={first}",
        f"--ntasks={shape.group_size}",
        f"--ntasks-per-node={min(shape.group_size, ppn)}",
        "--kill-on-bad-exit=1",
        f"--job-name=fldp-group{group}",
        sys.executable,
        "-u",
        "-m",
        "fldp.group_step",
        str(spec),
        str(group),
        str(restart),
        lighthouse,
        roster,
    ]


def group_step_port(shape, job_id: int, group: int, restart: int) -> int:
    """A rendezvous port for each group and incarnation, derived from the job id as the run's own is."""
    from .launch import _PORT_BASE, _PORT_SPAN

    return _PORT_BASE + job_id % _PORT_SPAN + 1 + group + shape.federation * restart


def elastic_plan(conf: Config, shape: MeshShape, run_dir: str) -> str:
    """What the dry run shows of an elastic run's job: the supervisor's part and each group's step."""
    spec = Path(run_dir).absolute() / "elastic_logs" / "run.pkl"
    steps = "\n".join(
        shlex.join(group_step_command(shape, conf.topology, g, 0, spec, "http://FIRST_NODE:PORT", "FIRST_NODE:PORT"))
        for g in range(shape.federation)
    )
    return (
        f"--- elastic federation: the job's one task (first node) runs the torchft lighthouse and starts "
        f"each group as a job step, again when it fails (cluster.max_restarts="
        f"{conf.cluster.max_restarts}); MASTER_PORT per group and restart ---\n{steps}"
    )


# --- the job's shape --------------------------------------------------------------------------


def job_setup(setup, cpus_per_task) -> list[str]:
    """The cluster's setup lines, plus what every fldp job needs: one BLAS/OpenMP pool per rank
    sized to its CPUs, and srun ending the whole step when one task dies (no rank waits for a
    dead peer until the collective timeout)."""
    return [*(setup or []), f"export OMP_NUM_THREADS={cpus_per_task or 1}", "export SLURM_KILL_BAD_EXIT=1"]


def extra_sbatch(sbatch, exclusive) -> dict:
    """sbatch options submitit has no parameter for (cluster.sbatch), and --exclusive."""
    extra = dict(
        cast(dict, OmegaConf.to_container(sbatch, resolve=True)) if OmegaConf.is_config(sbatch) else sbatch or {}
    )
    if exclusive:
        extra["exclusive"] = True
    return extra


def _unless_from_env(value, variable: str):
    """None when the value is the environment's: sbatch reads SBATCH_ACCOUNT / SBATCH_QOS itself, so
    the account never has to be written into the job script, its log or the dry run."""
    return None if value is not None and value == os.environ.get(variable) else value


def job_parameters(conf: Config, shape: MeshShape) -> dict:
    """submitit.SlurmExecutor parameters of the one job that runs the config."""
    c, t = conf.cluster, conf.topology  # checked: fldp.validation.check_slurm
    params = {
        "job_name": f"fldp-{conf.algorithm.name}-{t.name}",
        "nodes": t.nodes,
        "ntasks_per_node": t.procs_per_node,
        "cpus_per_task": c.cpus_per_task,
        "gpus_per_node": c.gpus_per_node if t.device == "cuda" else None,
        "mem": f"{c.mem_gb}GB" if c.mem_gb else None,
        "time": c.time_min,
        "partition": c.partition,
        "account": _unless_from_env(c.account, "SBATCH_ACCOUNT"),
        "qos": _unless_from_env(c.qos, "SBATCH_QOS"),
        "setup": job_setup(c.setup, c.cpus_per_task),
        "additional_parameters": extra_sbatch(c.sbatch, c.exclusive),
    }
    if requeues(conf):  # checkpoint and requeue on the warning signal, signal_s before the limit
        params["signal_delay_s"] = c.signal_s
        params["additional_parameters"]["requeue"] = True
    if conf.algorithm.elastic:  # submitit's step: the supervisor alone, on the first node
        params["srun_args"] = ["--nodes=1", "--ntasks=1"]
    assert shape.world == t.nodes * t.procs_per_node  # validate() checked it
    return {k: v for k, v in params.items() if v is not None}


def job_folder_of(cluster: ClusterConfig, run_dir: str) -> Path:
    """submitit's folder: pickles and per-task logs, one subfolder per job id; RUN_DIR/slurm/ unless
    cluster.folder says otherwise. sbatch reads '%' in its log paths as a file-name pattern and drops
    it, so a log in a run directory whose path holds one (a sweep point named by a value with a
    '/', escaped '%2F') could not be opened and the job would fail at launch: such a run's jobs go
    to slurm-jobs/ in the nearest directory above it without a '%' (the sweep's), apart by job id."""
    if cluster.folder:  # without a '%' (fldp.validation.check_slurm)
        return Path(cluster.folder).absolute() / "%j"
    run = Path(run_dir).absolute()
    if "%" not in str(run):
        return run / "slurm" / "%j"
    return next(p for p in run.parents if "%" not in str(p)) / "slurm-jobs" / "%j"


def sbatch_script(params: dict, job_folder: Path) -> str:
    """The script submit_job() hands to sbatch for these parameters, written out for the dry run.
    submitit has no public renderer, so it is rendered here the way submitit writes it (its log
    paths, its 90 s warning signal, append mode, its wckey); tests/test_slurm.py compares it with the
    script submitit really submitted for a job."""
    log_file = str(job_folder / "%j_%t_log")  # submitit's per-task logs; sbatch's own are task 0's
    options = {
        k: v for k, v in params.items() if k not in ("setup", "signal_delay_s", "additional_parameters", "srun_args")
    }
    options.update(
        signal=f"USR2@{params.get('signal_delay_s', 90)}",
        output=log_file.replace("%t", "0") + ".out",
        error=log_file.replace("%t", "0") + ".err",
        open_mode="append",
        wckey="submitit",
    )
    options.update(params.get("additional_parameters") or {})
    flags = sorted((key.replace("_", "-"), value) for key, value in options.items())
    srun = [
        "srun",
        "--unbuffered",
        "--output",
        f"{log_file}.out",
        "--error",
        f"{log_file}.err",
        *params.get("srun_args", []),
    ]
    return "\n".join(
        [
            "#!/bin/bash",
            "",
            "# Parameters",
            *(
                f"#SBATCH --{flag}" if value is True else f"#SBATCH --{flag}={shlex.quote(str(value))}"
                for flag, value in flags
            ),
            *(["", "# setup", *params["setup"]] if params.get("setup") is not None else []),
            "",
            "# command",
            "export SUBMITIT_EXECUTOR=slurm",
            f"{shlex.join(srun)} {sys.executable} -u -m submitit.core._submit {job_folder}",
            "",
        ]
    )


def planned_steps(conf: Config, world: int):
    """trainer.steps, or one pass when the training block count is known from the config alone
    (clean_mc4_it: 65,536 blocks / (512 ranks x 2) = 64); None when only the data can tell."""
    blocks, trainer = conf.dataset.train_blocks, conf.trainer
    if trainer.steps is not None or blocks is None:
        return trainer.steps
    return blocks // (world * trainer.batch_size)


def _from_env(variable: str, otherwise: str) -> str:
    return f"(from {variable})" if os.environ.get(variable) else otherwise


def describe(cfg, shape: MeshShape, params: dict) -> str:
    """The dry run's and the submission log's account of the job (cfg: composed, for its
    differences from the paper's setting)."""
    from .checkpoint import size_line

    conf = load(cfg)
    t, tr, alg = conf.topology, conf.trainer, conf.algorithm
    group_nodes = shape.group_size / t.procs_per_node
    steps = planned_steps(conf, shape.world)
    lines = [
        f"mesh: {alg.name} {shape} (federation x replicate x shard) = {shape.world} ranks; "
        f"a federation group is {shape.group_size} ranks ({group_nodes:g} node(s)), a sharding group "
        f"{shape.shard} ranks"
        + (f"; FedAvg {schedule_text(alg.every)}" if shape.federation > 1 else "")
        + (f", {alg.fedavg.mode if alg.fedavg else None}" if shape.federation > 1 and shape.replicate > 1 else ""),
        f"run: model {conf.model.name}, dataset {conf.dataset.name}, {tr.precision}, batch {tr.batch_size} per "
        f"rank, {steps if steps is not None else 'one pass of'} steps, {conf.optimizer.name} lr {conf.optimizer.lr}, "
        f"seed {conf.seed}",
        f"job: {t.nodes} nodes x {t.procs_per_node} tasks = {shape.world} tasks, one rank each"
        f" ({'NCCL' if t.device == 'cuda' else 'gloo'}), partition {params.get('partition', '(default)')}, "
        f"account {params.get('account', _from_env('SBATCH_ACCOUNT', '(not set)'))}, "
        f"qos {params.get('qos', _from_env('SBATCH_QOS', '(default)'))}, "
        f"{params['time']} min",
        size_line(conf, shape),
    ]
    if t.paper_setting:
        differ = differences(conf, paper_config(alg.name, t.name))
        lines.append(
            "setting: the paper's (paper.md, Section 5)"
            if not differ
            else "setting: NOT the paper's; differs in " + "; ".join(differ)
        )
    return "\n".join(lines)


# --- submission -------------------------------------------------------------------------------


def submit(cfg, run_dir: str, shape: MeshShape, run, sweep_point: bool = False) -> dict | None:
    """Submit the run as one job whose every task calls run(cfg, run_dir) (run_rank). With
    cluster.wait, follow it and return rank 0's summary, or raise WorkerError with the first failing
    rank's error; a sweep point's job is followed later, with the sweep's others (follow_submitted).
    Without cluster.wait, return once it is queued."""
    from . import preflight

    conf = load(cfg)
    params = job_parameters(conf, shape)
    if conf.cluster.dry_run:
        found = preflight.problems(cfg, run_dir)  # what the job would find out only after its wait in the queue
        print(
            f"fldp: dry run (cluster={conf.cluster.name}): nothing submitted\n{describe(cfg, shape, params)}\n"
            f"records: {Path(run_dir).absolute()}\n--- sbatch script ---\n"
            f"{sbatch_script(params, job_folder_of(conf.cluster, run_dir))}\n"
            + (f"{elastic_plan(conf, shape, run_dir)}\n" if conf.algorithm.elastic else "")
            + preflight.report(found),
            flush=True,
        )
        return None
    # here sbatch is, and the job's nodes can run it: fldp.validation.check_submission has said so
    job = submit_job(cfg, run_dir, shape, functools.partial(run_rank, run=run))
    if conf.cluster.wait and sweep_point:
        _submitted.append((job, run_dir, conf.cluster.poll_s))
        return None
    if not conf.cluster.wait:
        print(
            f"fldp: submitted SLURM job {job.job_id} ({shape.world} ranks on {conf.topology.nodes} nodes); "
            f"records in {run_dir}; follow with `squeue -j {job.job_id}`, cancel with `scancel {job.job_id}`",
            flush=True,
        )
        return None
    try:
        return follow(job, run_dir, conf.cluster.poll_s)
    except KeyboardInterrupt:
        log.warning("stopped following job %s; it keeps running (scancel %s to stop it)", job.job_id, job.job_id)
        raise


# The jobs of a multirun's points (cluster.wait=true), followed once the last point is submitted:
# SLURM runs them side by side, where following each before submitting the next would queue them
# one after another.
_submitted: list = []  # (submitit Job, run_dir, poll_s)


def follow_submitted(wait: bool = True) -> int:
    """Follow the sweep's submitted jobs to their ends, reporting each; the number that failed.
    Ctrl-C stops the following, not the jobs; wait=False (the sweep was stopped) only names them."""
    pending = _submitted[:]
    _submitted.clear()
    if not pending:
        return 0
    ids = " ".join(str(job.job_id) for job, _, _ in pending)
    if not wait:
        print(f"fldp: the sweep's SLURM jobs keep running (scancel {ids} to stop them)", file=sys.stderr, flush=True)
        return 0
    _detach_file_logs()
    print(f"fldp: following the sweep's {len(pending)} SLURM jobs: {ids}", file=sys.stderr, flush=True)
    failed = 0
    for i, (job, run_dir, poll_s) in enumerate(pending):
        try:
            summary = follow(job, run_dir, poll_s)
            print(
                f"fldp: SLURM job {job.job_id} finished: {run_dir}: eval perplexity {summary['eval_perplexity']:.2f}",
                file=sys.stderr,
                flush=True,
            )
        except WorkerError as e:
            failed += 1
            print(f"fldp: sweep point {run_dir} failed: {e}", file=sys.stderr, flush=True)
        except KeyboardInterrupt:
            left = " ".join(str(j.job_id) for j, _, _ in pending[i:])
            print(
                f"fldp: stopped following; the jobs keep running (scancel {left} to stop them)",
                file=sys.stderr,
                flush=True,
            )
            raise
    return failed


def _detach_file_logs() -> None:
    """Hydra's log file handler is the last point's train.log: what follows concerns every point."""
    root = logging.getLogger()
    for handler in [h for h in root.handlers if isinstance(h, logging.FileHandler)]:
        root.removeHandler(handler)
        handler.close()


def submit_job(cfg, run_dir: str, shape: MeshShape, fn):
    """sbatch the job that runs fn(cfg, run_dir) on every task; the submitit Job."""
    import submitit

    conf = load(cfg)
    params = job_parameters(conf, shape)
    executor = submitit.SlurmExecutor(folder=job_folder_of(conf.cluster, run_dir), max_num_timeout=0)
    executor.update_parameters(**params)
    try:
        job = executor.submit(fn, cfg, str(Path(run_dir).absolute()))
    except Exception as e:  # sbatch refused it: EnforcePartLimits, bad account/qos/partition
        raise WorkerError(f"sbatch refused the job: {e}") from None
    log.info(
        "submitted SLURM job %s: %s; records in %s, logs in %s",
        job.job_id,
        describe(cfg, shape, params).replace("\n", "; "),
        run_dir,
        job.paths.folder,
    )
    return job


# SLURM's states of a job that has ended (squeue(1) "JOB STATE CODES"); every other state, e.g.
# SIGNALING or REQUEUE_HOLD while a job requeues itself, means it may still run. Listing the
# ended ones, not the running ones, keeps a state we did not foresee from ending the wait early.
_ENDED = (
    "BOOT_FAIL",
    "CANCELLED",
    "COMPLETED",
    "DEADLINE",
    "FAILED",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "REVOKED",
    "TIMEOUT",
    "ENDED",
)


def ended(state: str) -> bool:
    """Whether a job in this state has ended for good (sacct writes e.g. "CANCELLED by 0")."""
    return (state.split() or [""])[0] in _ENDED


def follow(job, run_dir: str, poll_s: float, timeout_s: float | None = None) -> dict:
    """Wait for the job to end, asking SLURM every poll_s (submitit alone would back off to minutes
    between checks), then its outcome. With timeout_s, a job not ended by then raises WorkerError
    with its state and SLURM's reason (it keeps running: the caller decides whether to cancel it)."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    state = None
    while True:
        now = job_state(job)
        if now != state:
            state = now
            log.info("job %s: %s%s", job.job_id, state, waiting_reason(job.job_id) if state == "PENDING" else "")
        # only SLURM's state: a task killed by srun before it wrote its result has no other trace,
        # and submitit's job.done() takes a requeueing job (SIGNALING) for a finished one
        if ended(state):
            return outcome(job, run_dir)
        if deadline is not None and time.monotonic() > deadline:
            raise WorkerError(
                f"SLURM job {job.job_id} still {state} after {timeout_s:g} s"
                f"{waiting_reason(job.job_id)}; logs: {job.paths.folder}"
            )
        time.sleep(poll_s)


def job_state(job) -> str:
    """The job's SLURM state: sacct's; where sacct has no answer (a site without accounting),
    squeue's, and ENDED once squeue has forgotten the job. Asked of SLURM on every call: submitit's
    watcher stops asking about a job once it thinks it done, which a requeue proves wrong."""
    if (state := _sacct_state(str(job.job_id))) is not None:
        return state
    if (r := _squeue(job.job_id, "%T")) is None:
        return "UNKNOWN"
    states = sorted(set(r.stdout.split()))
    if r.returncode == 0 and states:  # one line per array task; any not ended keeps the job going
        return next((s for s in states if not ended(s)), states[0])
    return "ENDED" if "Invalid job id" in r.stderr else "UNKNOWN"


def _sacct_state(job_id: str) -> str | None:
    """sacct's State of the job, read by its header (as submitit asks: --parsable2 with a header);
    None where sacct has no answer or no row for the job."""
    r = _slurm_query(["sacct", "-X", "--parsable2", "-j", job_id, "-o", "JobID,State"])
    lines = r.stdout.splitlines() if r is not None and r.returncode == 0 else []
    if not lines or not {"JobID", "State"} <= set(header := lines[0].split("|")):
        return None
    rows = [dict(zip(header, line.split("|"))) for line in lines[1:]]
    return next((row["State"] for row in rows if row["JobID"] == job_id), None)


def waiting_reason(job_id: str) -> str:
    """SLURM's reason a job is not running, e.g. ' (Resources)', ' (ReqNodeNotAvail)'; '' if none."""
    out = (r := _squeue(job_id, "%r")) and r.stdout.split()
    return f" ({out[0]})" if out and out[0] != "None" else ""


def _squeue(job_id: str, field: str) -> subprocess.CompletedProcess | None:
    """`squeue` on one job (finished ones included) for one field; None if squeue cannot be run."""
    return _slurm_query(["squeue", "-h", "-t", "all", "-j", str(job_id), "-o", field])


def _slurm_query(command: list[str]) -> subprocess.CompletedProcess | None:
    """A SLURM client command's result; None if it cannot be run."""
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None


def outcome(job, run_dir: str) -> dict:
    """The summary of a job that completed, else WorkerError naming the FIRST rank that failed
    (the others fail after it, of lost peers, or are killed by srun) or how SLURM ended the job."""
    from submitit.core.utils import pickle_load

    tasks = [job.task(t) for t in range(job.num_tasks)] if job.num_tasks > 1 else [job]
    results, failures = {}, []
    for rank, task in enumerate(tasks):
        path = task.paths.result_pickle
        if path.exists():
            results[rank] = kind, payload = pickle_load(path)
            if kind == "error":
                failures.append((path.stat().st_mtime, rank, payload))
    logs = f"logs: {job.paths.folder}"
    if failures:
        _, rank, tb = min(failures)  # earliest: the cause; later ones are its consequences
        others = f"\n({len(failures) - 1} other ranks failed after it)" if len(failures) > 1 else ""
        raise WorkerError(f"SLURM job {job.job_id}: rank {rank} failed first:\n{tb}{others}\n{logs}")
    summary = Path(run_dir) / "summary.json"
    if results.get(0, ("",))[0] == "success" and summary.exists():
        return json.loads(summary.read_text())
    state = job_state(job)
    tail = "\n".join((tasks[0].stderr() or "").strip().splitlines()[-15:])
    raise WorkerError(
        f"SLURM job {job.job_id} ended {state} without a Python error and without records"
        + (f"; end of rank 0's stderr:\n{tail}" if tail else "")
        + f"\n{logs}"
    )
