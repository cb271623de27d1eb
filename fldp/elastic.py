"""Elastic federation on torchft: a federation group's failure costs only that group.

With `algorithm.elastic=true` each federation group is its own process-group world (FSDP or HSDP
inside it, unchanged) and a torchft replica group. Between aggregations the groups share nothing;
at each aggregation torchft's Manager forms a quorum of the groups alive (through the lighthouse),
FedAvg's all-reduce runs over them and averages over those participants, and the result is applied
only if every group's ranks commit. A failed group is restarted by the launcher: its new ranks join
the next aggregation, fetch everything a group holds from a live peer over torchft's checkpoint
transport (model shards, AdamW state, the outer anchor and state, scheduler, step; the data
position follows from the step), receive that aggregation's average like the others, and train on.

Why a restarted group contributes nothing to the aggregation it heals at (torchft's async-quorum
participation: only groups at the highest committed step take part): it did no inner steps since
that aggregation, and sending its peer's copy would count the peer twice.

The launcher starts the lighthouse and each group, restarts a failed group up to
`cluster.max_restarts` times, and ends the run clearly when the lighthouse dies, a group fails more
often than that, or no group finishes; a group that fails, or comes back, after every other group
has finished ends early, recorded, and the run is theirs: `run_local` forks each group's
ranks (on emulated nodes too); under SLURM, `run_slurm`, the one task of the run's job, starts each
group as a job step of that job (fldp.group_step).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import wait
from pathlib import Path
from urllib.parse import urlsplit

import torch

from . import faults
from .config import ClusterConfig, load, section_of
from .errors import Interrupted, NoPeerToHealFrom, WorkerError
from .roster import FAILED, Roster, answer, serve

# A group whose manager has not been heard from for this long is dead to the lighthouse: the
# survivors' next aggregation waits at most this long for a group that just died.
HEARTBEAT_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class Member:
    """What a rank of an elastic run knows besides its group's own world."""

    group: int
    restart: int  # 0: the group's first incarnation
    lighthouse: str  # the lighthouse's address
    roster: str  # the roll call's store, host:port (fldp.roster)


class Federation:
    """The cross-group side of FedAvg over torchft's Manager, on one rank: the quorum of live
    groups, a mean over its participants, and the commit. `track` names what a peer's heal copies."""

    def __init__(
        self, member: Member, rank: int, shape, store: tuple[str, int], timeout_s: float, join_timeout_s: float
    ):
        """store: the group's rendezvous store (host, port), torchft's too; join_timeout_s: how long
        an aggregation waits for a live group that is late (the lighthouse's wait, the roll call's)."""
        from torchft import Manager, ProcessGroupGloo

        self.member, self.groups = member, shape.federation
        self.tracked: tuple = ()  # (model, optimizer, scheduler, fedavg, position): track()
        self.healed_from: int | None = None  # the peer group whose state this group last loaded
        self.healed = False  # whether it loaded one in the last aggregation
        self.left_out: dict[str, str] = {}  # the last aggregation's absent groups: why (fldp.roster)
        self.roster = Roster(member.roster, shape.federation, join_timeout_s)
        timeout = timedelta(seconds=timeout_s)
        self.manager = Manager(
            pg=ProcessGroupGloo(timeout=timeout),
            load_state_dict=self._load,
            state_dict=self._state,
            min_replica_size=1,
            use_async_quorum=True,
            timeout=timeout,
            quorum_timeout=timedelta(seconds=max(timeout_s, 2 * join_timeout_s)),
            rank=rank,
            world_size=shape.group_size,
            store_addr=store[0],
            store_port=store[1],
            lighthouse_addr=member.lighthouse,
            replica_id=f"group_{member.group}",
            init_sync=False,  # every group starts from the same weights (fldp.init: the seed alone)
        )
        self.quorums = _Quorums(self.manager._client)  # torchft keeps no quorum's members: we note them
        self.manager._client = self.quorums
        if member.restart == 0:  # a restarted group heals, behind the others: no roll call
            self._roll_call(rank, store)

    def _roll_call(self, rank: int, store: tuple[str, int]) -> None:
        """Say this group is here once the lighthouse has heard from it, then wait for every group."""
        if rank == 0:
            from torch.distributed import TCPStore
            from torchft._torchft import LighthouseClient
            from torchft.manager import REPLICA_ID_KEY

            own = TCPStore(store[0], store[1], is_master=False, wait_for_workers=False)
            replica_id = own.get(REPLICA_ID_KEY).decode()  # torchft's: ours with a uuid
            LighthouseClient(self.member.lighthouse, timedelta(seconds=60)).heartbeat(replica_id)
            self.roster.here(self.member.group)
        missing = self.roster.wait()
        if missing:
            logging.getLogger(__name__).warning(
                "federation groups %s had not started after cluster.join_timeout_s=%s s: training without them",
                missing,
                self.roster.wait_s,
            )

    def track(self, model, optimizer, scheduler, fedavg, position: dict) -> None:
        """What a group holds: `position` is {"step": the last step trained}, kept current by the trainer."""
        self.tracked = (model, optimizer, scheduler, fedavg, position)

    def quorum(self) -> int:
        """Join this aggregation's quorum (a group behind the others heals in it: one restarted,
        or one cut off from them for a while); the participants."""
        self.healed = False
        first_asked = self.roster.arrive(self.tracked[4]["step"])
        self.manager.start_quorum()
        participants = self.manager.num_participants()
        quorum = self.quorums.last
        assert quorum is not None  # num_participants() waited for it
        present = {int(r.split(":", 1)[0].removeprefix("group_")) for r in quorum.replica_ids}
        missing = [g for g in range(self.groups) if g not in present]
        why = self.roster.why_left_out(first_asked) if missing else ""
        self.left_out = {str(g): why for g in missing}
        return participants

    def all_reduce_mean(self, flat: torch.Tensor):
        """The participants' mean into `flat` once the returned work is waited on (a group that
        does not participate sends zeros)."""
        faults.strike(self.member.group, self.member.restart, self.tracked[4]["step"], "allreduce")
        return self.manager.allreduce(flat)

    def commit(self) -> bool:
        """Whether every rank of every participating group completed the aggregation; a healing
        group loads its peer's state here, before the average is applied."""
        return self.manager.should_commit()

    def shutdown(self) -> None:
        self.manager.shutdown(wait=False)

    # what torchft's checkpoint transport sends a healing peer: plain local tensors (this rank's
    # shards), so the receiver's rank with the same position in its group copies them in place
    def _state(self) -> dict:
        model, optimizer, scheduler, fedavg, position = self.tracked
        names = {p: n for n, p in model.named_parameters()}
        return {
            "group": self.member.group,
            "step": position["step"],
            "model": {n: _local(p) for n, p in model.named_parameters()},
            "optimizer": {names[p]: {k: _local(v) for k, v in s.items()} for p, s in optimizer.state.items()},
            "scheduler": scheduler.state_dict(),
            "fedavg": fedavg.state_dict(),
        }

    @torch.no_grad()
    def _load(self, state: dict) -> None:
        model, optimizer, scheduler, fedavg, position = self.tracked
        params = dict(model.named_parameters())
        for name, value in state["model"].items():
            _local(params[name]).copy_(value)
        for name, entries in state["optimizer"].items():
            mine = optimizer.state[params[name]]
            for key, value in entries.items():
                if key in mine:
                    _local(mine[key]).copy_(value)
                else:  # a group restarted before its first step has no optimiser state yet
                    mine[key] = value.clone() if key == "step" else _like(params[name], value)
        scheduler.load_state_dict(state["scheduler"])
        fedavg.load_state_dict(state["fedavg"])
        position["step"] = state["step"]
        self.healed_from, self.healed = state["group"], True


class _Quorums:
    """torchft's ManagerClient, noting the last quorum it was given (`replica_ids`: its members)."""

    def __init__(self, client):
        self.client, self.last = client, None

    def _quorum(self, *args, **kwargs):
        self.last = self.client._quorum(*args, **kwargs)
        return self.last

    def __getattr__(self, name):
        return getattr(self.client, name)


def _local(t):
    return t._local_tensor if hasattr(t, "_local_tensor") else t


def _like(param, local: torch.Tensor):
    """An optimiser state tensor shaped like `param` (a DTensor's: same mesh and placements)."""
    if hasattr(param, "_local_tensor"):
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(
            local.clone(), param.device_mesh, param.placements, shape=param.shape, stride=param.stride()
        )
    return local.clone()


def quiet_torchft() -> None:
    """torchft's quorum and commit logs (its Rust side's and its Python loggers') are INFO lines for
    every rank at every aggregation; fldp records what they say (participants, commits, heals)."""
    import logging
    import warnings
    from http.server import BaseHTTPRequestHandler

    os.environ.setdefault("RUST_LOG", "warn")  # read when torchft's native side starts logging
    for name in ("torchft", "torchft_quorums", "torchft_commits", "torchft_errors"):
        logging.getLogger(name).setLevel(logging.ERROR)  # WARNING: "no NCCL flight recorder" on CPU, each quorum
    # the checkpoint transport's HTTP server logs each request; no other HTTP server runs in fldp's processes
    BaseHTTPRequestHandler.log_message = lambda *args: None  # type: ignore[method-assign]
    # torch reading a received checkpoint from a read-only buffer; the tensors are copied into place at once
    warnings.filterwarnings("ignore", message="The given buffer is not writable")


# ---- the launchers: the lighthouse and the groups, each group restarted when it fails ----


@dataclass(frozen=True)
class Coordinator:
    """Where a run's groups meet: the lighthouse, and the roll call's store beside it (fldp.roster)."""

    lighthouse: str
    roster: str  # host:port


def _lighthouse(out, failures, parent: int, network, groups: int, join_timeout_s: float) -> None:
    """The lighthouse's process: torchft's lighthouse and the roll call's store; the supervisor's
    word on each group that failed (from `failures`) goes into the roll call."""
    from . import launch

    signal.signal(signal.SIGTERM, launch._exit_on_signal)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    launch._die_with_parent(parent)
    if network is not None:  # on the first node, as under SLURM
        network.enter(0)
    from torchft.coordination import LighthouseServer

    server = LighthouseServer(
        bind="[::]:0",
        min_replicas=1,
        join_timeout_ms=int(join_timeout_s * 1000),
        heartbeat_timeout_ms=int(HEARTBEAT_TIMEOUT_S * 1000),
    )
    store = serve()
    address = server.address()
    out.put(Coordinator(address, f"{urlsplit(address).hostname}:{store.port}"))
    for group in iter(failures.get, None):
        answer(store, group, FAILED, groups)


class _Group:
    """One federation group's processes (its forked ranks, or the srun of its job step): started,
    watched, stopped and restarted together. `cause()`: what its failure said. `ended_early`: why
    it ended before the run's last step while the others finished it (it failed after they had
    finished, or came back from a restart after they had: NoPeerToHealFrom), else None."""

    def __init__(self, index: int):
        self.index, self.restart = index, 0
        self.procs: list = []
        self.cause: Callable[[], str | None] = lambda: None
        self.ended_early: str | None = None

    @property
    def finished(self) -> bool:
        return bool(self.procs) and all(p.exitcode == 0 for p in self.procs)

    @property
    def came_back_alone(self) -> bool:
        return any(p.exitcode == NoPeerToHealFrom.EXIT_CODE for p in self.procs)

    @property
    def over(self) -> bool:
        """Nothing more to wait for: it finished, or ended early."""
        return self.finished or self.ended_early is not None

    def alive(self):
        return [p for p in self.procs if p.exitcode is None]


def run_local(fn, args: tuple, shape, cluster_cfg, run_dir: str, network=None) -> None:
    """Fork the lighthouse and every group's ranks; fn(*args, member, device) on each rank, whose
    process group is its own group's world. A group that fails is stopped, recorded in
    run_dir/elastic_events.jsonl and restarted (cluster.max_restarts times at most) while another
    group is still training; raises WorkerError when it cannot be, or the lighthouse dies.

    `network` (fldp.netns.Network): emulated nodes, created here and removed when this returns or
    raises; the lighthouse runs on node 0, each rank on the node of its place in the whole run."""
    from . import launch

    ctx = launch.mp.get_context("fork")

    def start(group: _Group, meet: Coordinator) -> None:
        place = group.index * shape.group_size  # the group's first rank in the whole run
        if network is None:
            addr = cluster_cfg.master_addr
            port = launch.RankZeroPort(ctx, shape.group_size)
        else:  # the group's first node, a port no other group or incarnation has used there
            addr = network.address(network.node_of(place))
            port = network.port + 1 + group.index + shape.federation * group.restart
        member = Member(group.index, group.restart, meet.lighthouse, meet.roster)
        errors = ctx.SimpleQueue()
        group.procs = [
            ctx.Process(
                target=launch._local_worker,
                name=f"fldp-group{group.index}-rank{i}",
                args=(
                    i,
                    fn,
                    (*args, member),
                    shape.group_size,
                    addr,
                    port,
                    "cpu",
                    cluster_cfg.timeout_s,
                    cluster_cfg.threads_per_worker,
                    errors,
                    os.getpid(),
                    network,
                    place,
                ),
            )
            for i in range(shape.group_size)
        ]
        for p in group.procs:
            p.start()
        group.cause = lambda: _first_report(errors)

    if network is not None:  # else cluster.master_addr, checked (fldp.validation.check_launch)
        network.create()
    try:
        _supervise(start, shape, cluster_cfg, run_dir, network)
    finally:
        if network is not None:
            network.destroy()


def _first_report(errors) -> str | None:
    """The earliest error a group's ranks reported: its peers fail after it, of the lost connection."""
    from . import launch

    reports = sorted(launch._drain(errors))  # (time, rank, report, plain)
    return reports[0][2] if reports else None


def _supervise(start, shape, cluster_cfg, run_dir: str, network=None) -> None:
    """Fork the lighthouse, start(group, Coordinator) every group, and watch them to the end:
    a group that fails is stopped, recorded and started again while it may be."""
    from . import launch

    quiet_torchft()
    launch.stop_tqdm_monitors()
    ctx = launch.mp.get_context("fork")
    events = Path(run_dir) / "elastic_events.jsonl"
    out, failures = ctx.SimpleQueue(), ctx.SimpleQueue()
    cluster = section_of(ClusterConfig, cluster_cfg)  # typed, or composed (tests)
    join_timeout_s = cluster.join_timeout_s
    lighthouse = ctx.Process(
        target=_lighthouse,
        name="fldp-lighthouse",
        args=(out, failures, os.getpid(), network, shape.federation, join_timeout_s),
        daemon=True,
    )
    groups = [_Group(g) for g in range(shape.federation)]
    every = [lighthouse]  # every process started, for the interrupt handler
    restart_failed, max_restarts = cluster.restart_failed_groups, cluster.max_restarts

    def begin(group: _Group, meet: Coordinator) -> None:
        start(group, meet)
        every.extend(group.procs)

    with launch._Interrupts(every) as interrupts:
        try:
            lighthouse.start()
            meet = out.get()
            for group in groups:
                begin(group, meet)
            while not interrupts.signum:
                if lighthouse.exitcode is not None:
                    raise WorkerError(
                        f"the torchft lighthouse died (exit code {lighthouse.exitcode}): "
                        "the groups can no longer form a quorum"
                    )
                for g in groups:
                    if g.came_back_alone and g.ended_early is None:
                        launch._stop(g.alive())
                        _ended_early(g, "it came back from a restart after every other group had ended", events)
                live = [g for g in groups if g.ended_early is None]
                failed = next(((g, p) for g in live for p in g.procs if p.exitcode not in (None, 0)), None)
                if failed:
                    failures.put(failed[0].index)  # the roll call waits no longer for it
                    if _failed(*failed, groups, events, restart_failed, max_restarts, launch):
                        begin(failed[0], meet)
                    continue
                if all(g.over for g in groups):
                    break
                wait([lighthouse.sentinel, *(p.sentinel for g in groups for p in g.alive() if p.sentinel)], timeout=1.0)
        finally:
            launch._stop([p for p in every if p.pid is not None])
    if interrupts.signum:
        raise Interrupted(interrupts.signum)
    if not any(g.finished for g in groups):
        raise WorkerError(
            "no federation group finished the run: " + "; ".join(f"group {g.index} {g.ended_early}" for g in groups)
        )


def _ended_early(group: _Group, why: str, events: Path) -> None:
    """Records that `group` ended before the run's last step while others finish it: the run's
    result is theirs (the aggregations it missed name it in `left_out`)."""
    group.ended_early = why
    logging.getLogger(__name__).warning(
        "federation group %d ended early (%s): the run's result is the other groups'", group.index, why
    )
    _record(events, {"event": "ended early", "time": time.time(), "group": group.index, "why": why})


def _record(events: Path, event: dict) -> None:
    """One line of events.jsonl. A disk that refuses it loses the line only: the event is still
    reported (logged, raised, or seen in a heal row)."""
    with contextlib.suppress(OSError):
        with events.open("a") as f:
            f.write(json.dumps(event) + "\n")


def _failed(group: _Group, proc, groups: list, events: Path, restart_failed: bool, max_restarts: int, launch) -> bool:
    """A process of `group` died: stop the group's others and record it. True: restart it; False:
    every other group has finished, so the run ends with theirs; raises when it can go on neither way."""
    rank, noticed = group.procs.index(proc), time.time()
    time.sleep(launch._GRACE_S)  # its peers in the group fail next: let the first error arrive
    launch._stop(group.alive())
    how = launch.ended(proc.exitcode)
    # how every process ended comes first: a rank killed outright leaves no error, and the first
    # error reported may be a peer's lost connection, raised before that rank's death was seen
    ends = (
        ", ".join(f"rank {r} {launch.ended(p.exitcode)}" for r, p in enumerate(group.procs) if p.exitcode is not None)
        if len(group.procs) > 1
        else f"its job step ended with {how}"
    )
    report = group.cause()
    cause = f"{ends}; the first error reported:\n{report}" if report else f"{ends}, without a Python error"
    others_running = any(not g.over for g in groups if g is not group)
    restarting = restart_failed and group.restart < max_restarts and others_running
    event = {
        "event": "failure",
        "time": noticed,
        "group": group.index,
        "incarnation": group.restart,
        "rank": rank if len(group.procs) > 1 else None,
        "exit": how,
        "restarted": restarting,
    }
    _record(events, event)
    if not restarting and restart_failed and not others_running and group.restart < max_restarts:
        _ended_early(group, f"it failed after every other group had finished ({how})", events)
        return False
    if not restarting:
        why = (
            "cluster.restart_failed_groups=false"
            if not restart_failed
            else f"it failed {group.restart + 1} times (cluster.max_restarts={max_restarts})"
        )
        raise WorkerError(f"federation group {group.index} failed and is not restarted ({why}):\n{cause}")
    group.restart += 1
    return True


# ---- under SLURM: each group a job step of the run's one job, the lighthouse on its first node ----


class _Step:
    """A group's job step, as the supervisor watches a process: its srun."""

    def __init__(self, popen):
        self.popen, self.pid = popen, popen.pid
        try:  # readable when srun exits: the supervisor waits on it with the lighthouse's sentinel
            self.sentinel: int | None = os.pidfd_open(popen.pid)
        except (AttributeError, OSError):
            self.sentinel = None  # polled every second instead

    @property
    def exitcode(self):
        code = self.popen.poll()
        if code is not None:
            self._close()
        return code

    def _close(self) -> None:
        if self.sentinel is not None:
            os.close(self.sentinel)
            self.sentinel = None

    def is_alive(self) -> bool:
        return self.exitcode is None

    def terminate(self) -> None:
        self.popen.terminate()  # srun passes SIGTERM to the step's tasks and ends the step

    def kill(self) -> None:
        self.popen.kill()

    def join(self, timeout: float | None = None) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout)
            self._close()


def run_slurm(cfg, run_dir: str, shape) -> None:
    """Inside the run's SLURM job, on its first node (the one task of the step submitit started):
    the lighthouse here, each federation group one job step (`srun`, fldp.group_step), a failed
    step started again. Each step's output goes to RUN_DIR/elastic_logs/."""
    import pickle

    from .slurm import group_step_command, group_step_port

    logs = Path(run_dir) / "elastic_logs"
    logs.mkdir(parents=True, exist_ok=True)
    spec = logs / "run.pkl"  # what every group step trains: this run's config and directory
    spec.write_bytes(pickle.dumps((cfg, run_dir)))
    job_id = int(os.environ["SLURM_JOB_ID"])

    def start(group: _Group, meet: Coordinator) -> None:
        log_path = logs / f"group_{group.index}.restart_{group.restart}.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_STEP_", "SLURM_NTASKS", "MASTER_"))}
        # each group's store on its own first node (fldp.launch.rendezvous), at a port of its own
        env["MASTER_PORT"] = str(group_step_port(shape, job_id, group.index, group.restart))
        with log_path.open("w") as out:
            popen = subprocess.Popen(
                group_step_command(shape, cfg.topology, group.index, group.restart, spec, meet.lighthouse, meet.roster),
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        group.procs = [_Step(popen)]
        group.cause = lambda: _tail(log_path)

    _supervise(start, shape, load(cfg).cluster, run_dir)


def _tail(path: Path, lines: int = 30) -> str | None:
    with contextlib.suppress(OSError):
        text = path.read_text(errors="replace").strip()
        return "\n".join(text.splitlines()[-lines:]) or None
    return None
