"""Getting a process group: either this process is one rank of a world someone else started
(torchrun, srun), or it forks the world's workers on this machine itself."""

from __future__ import annotations

import contextlib
import faulthandler
import gc
import os
import re
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import wait

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from . import stopping
from .errors import ConfigError, Interrupted, NoPeerToHealFrom, WorkerError, WriteError  # noqa: F401  (fldp.launch.WorkerError)

# Ports for the rendezvous, below Linux's ephemeral range (32768+) so no outgoing socket holds one.
_PORT_BASE, _PORT_SPAN = 12000, 20000


@dataclass(frozen=True)
class RankEnv:
    rank: int
    world: int
    local_rank: int
    master_addr: str
    master_port: int


def from_environment() -> RankEnv | None:
    """The rank this process already is: torchrun's variables, or a task of a multi-task srun step
    (a submitted fldp job, an sbatch script), whose rendezvous is
    MASTER_ADDR/MASTER_PORT if exported, else derived from the allocation. None when started by hand."""
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return RankEnv(
            int(env["RANK"]),
            int(env["WORLD_SIZE"]),
            int(env.get("LOCAL_RANK", 0)),
            env.get("MASTER_ADDR", "127.0.0.1"),
            int(env.get("MASTER_PORT", 29500)),
        )
    if "SLURM_STEP_ID" in env and int(env.get("SLURM_NTASKS", 1)) > 1:
        return RankEnv(int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]), int(env["SLURM_LOCALID"]), *rendezvous(env))
    return None


def first_node(nodelist: str) -> str:
    """The first host of a SLURM node list: 'lrdn[0012-0015,0100],lrdn0200' -> 'lrdn0012'."""
    m = re.match(r"([^,\[]*)(?:\[([^\]]+)\])?", nodelist.strip())
    if not m or not (m.group(1) or m.group(2)):
        raise ValueError(f"cannot read a host from the SLURM node list {nodelist!r}")
    prefix, ranges = m.group(1), m.group(2)
    return prefix + re.split(r"[-,]", ranges)[0] if ranges else prefix


def rendezvous(environ=os.environ) -> tuple[str, int]:
    """MASTER_ADDR/MASTER_PORT when the job script exports them; otherwise the allocation's first
    node, and a port every task derives alike from the job id (no communication needed)."""
    addr = environ.get("MASTER_ADDR") or first_node(environ.get("SLURM_STEP_NODELIST") or environ["SLURM_JOB_NODELIST"])
    port = environ.get("MASTER_PORT") or _PORT_BASE + int(environ["SLURM_JOB_ID"]) % _PORT_SPAN
    return addr, int(port)


def init_process_group(env: RankEnv, device_type: str, timeout_s: float, store=None) -> torch.device:
    """gloo on CPU, NCCL on CUDA (one GPU per local rank); `store`: the rendezvous already made
    (RankZeroPort), else tcp:// at env's address, whose port rank 0 binds."""
    if device_type == "cuda":
        device = torch.device("cuda", env.local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    meet = {"store": store} if store is not None else {"init_method": f"tcp://{env.master_addr}:{env.master_port}"}
    dist.init_process_group(backend, rank=env.rank, world_size=env.world, timeout=timedelta(seconds=timeout_s), **meet)
    return device


class RankZeroPort:
    """The rendezvous port of forked workers when none is configured: rank 0 binds port 0 (the
    kernel's choice, held from that moment) and hands the number to the others. A port found
    free by the launcher and bound by rank 0 later could be taken in between by any other
    process: a fresh-clone CI run failed so, EADDRINUSE, beside another test's workers."""

    def __init__(self, ctx, world: int):
        self.world, self.ports = world, ctx.SimpleQueue()

    def meet(self, rank: int, addr: str, timeout_s: float):
        """(the store, its port) for `rank`; the others wait for rank 0's number (a rank 0 that
        dies first is seen by the launcher, which stops them)."""
        from torch.distributed import TCPStore

        timeout = timedelta(seconds=timeout_s)
        if rank == 0:
            store = TCPStore(addr, 0, self.world, is_master=True, wait_for_workers=False, timeout=timeout)
            for _ in range(self.world - 1):
                self.ports.put(store.port)
            return store, store.port
        port = self.ports.get()
        return TCPStore(addr, port, self.world, is_master=False, timeout=timeout), port


def _die_with_parent(parent: int) -> None:
    """Linux: a worker whose launcher is killed, even by SIGKILL, is killed too: no orphans."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the launcher died before prctl took effect
        os._exit(1)


def ended(code: int) -> str:
    """How a process with this exit code ended, in words: "signal SIGKILL" or "exit code 1"."""
    return f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"


def _exit_on_signal(signum, frame):
    os._exit(128 + signum)


FORKED = False  # True in a worker run_local forked (summary.json: which network joined the ranks)


def _local_worker(
    index, fn, args, world, addr, port, device_type, timeout_s, threads, errors, parent, network, place=0
):
    """Rank `index` of a world of `world`; on emulated nodes it runs on the node of rank
    `place + index` of the whole run (an elastic run's group is a world of its own)."""
    global FORKED
    FORKED = True
    # The launcher stops a worker with SIGTERM. Exiting from a Python handler, which runs between
    # the main thread's bytecodes, never cuts a write short (a metrics row; the default action
    # could, at a page boundary), and it closes the W&B run first (fldp.stopping); a worker stuck
    # in native code gets SIGKILL after _stop's patience.
    signal.signal(signal.SIGTERM, stopping.on_signal)
    # A terminal's Ctrl-C reaches the whole process group: the launcher alone acts on it and stops
    # the workers, instead of each rank raising KeyboardInterrupt wherever it happens to be.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # A launcher interrupted by an error of its own (a test's time limit) asks the workers where
    # they are: each prints every thread's stack to stderr (_dump_stacks).
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    _die_with_parent(parent)
    try:
        if network is not None:  # before any socket or thread: they would stay in the host's namespace
            network.enter(place + index)
        # Each of the N workers gets its own slice of the cores.
        torch.set_num_threads(threads)
        store = None
        if isinstance(port, RankZeroPort):
            store, port = port.meet(index, addr, timeout_s)
        os.environ.update(  # MASTER_*: torchft's Manager joins the same store
            RANK=str(index), WORLD_SIZE=str(world), LOCAL_RANK=str(index), MASTER_ADDR=addr, MASTER_PORT=str(port)
        )
        device = init_process_group(RankEnv(index, world, index, addr, port), device_type, timeout_s, store)
        fn(*args, device)
    except NoPeerToHealFrom:  # an elastic group back too late: its supervisor's decision, not an error
        stopping.run_hooks(0)
        os._exit(NoPeerToHealFrom.EXIT_CODE)
    except BaseException as e:
        # Report before any teardown: closing this rank's connections makes its peers fail next.
        # A WriteError's message (the path, the reason) is the whole report.
        plain = isinstance(e, WriteError)
        errors.put((time.time(), index, str(e) if plain else traceback.format_exc(), plain))
        stopping.run_hooks(1)  # its W&B run: the exit below skips atexit
        sys.exit(1)
    dist.destroy_process_group()


@contextlib.contextmanager
def _frozen_heap():
    """Forked workers leave the launcher's objects to the garbage collector's permanent generation
    (gc.freeze, as Python's gc docs advise before fork): otherwise each worker's collections scan,
    and so copy page by page, the whole inherited heap, which under a test runner's long-lived
    process is large (a CI run's 8 workers were found all inside the collector, 600 s into a
    two-step job)."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()  # the launcher's own objects are collected as before


def run_local(fn, args: tuple, world: int, device_type: str, cluster_cfg, network=None) -> None:
    """Fork `world` workers running fn(*args, device). Fork, not spawn: the parent has imported
    torch and prepared the data already (fork ~1 s for 8 workers on 2 cores, spawn ~24 s), and
    it has run no torch compute, so no thread pool is forked.

    `network` (fldp.netns.Network): emulated nodes, created here and removed when this returns or
    raises; each worker joins its node's namespace, rank 0's holds the rendezvous.

    SIGINT or SIGTERM to this process stops the workers, then raises Interrupted (see _Interrupts).

    When a worker fails, the others are stopped and the error raised is the FIRST one: once a rank
    dies its peers fail too, with "connection closed by peer", which says nothing of the cause."""
    ctx = mp.get_context("fork")
    addr, port = _rendezvous_of(cluster_cfg, network, ctx, world)
    stop_tqdm_monitors()
    errors = ctx.SimpleQueue()
    rank_args = (world, addr, port, device_type, cluster_cfg.timeout_s, cluster_cfg.threads_per_worker, errors)
    procs = [
        ctx.Process(target=_local_worker, name=f"fldp-rank{i}", args=(i, fn, args, *rank_args, os.getpid(), network))
        for i in range(world)
    ]
    deaths: list[tuple[int, int]] = []  # (rank, exitcode) of the first workers seen to fail
    with _Interrupts(procs) as interrupts:
        try:
            if network is not None:
                network.create()
            with _frozen_heap():
                for p in procs:
                    if interrupts.signum:
                        break
                    p.start()
            try:
                _watch(procs, deaths, interrupts)
            except BaseException:
                _dump_stacks(procs)
                raise
        finally:
            _stop([p for p in procs if p.pid is not None])
            if network is not None:
                network.destroy()
    if interrupts.signum:  # the workers' errors are the stop's, not a cause
        raise Interrupted(interrupts.signum)
    _raise_first_failure(sorted(_drain(errors)), deaths)


def _rendezvous_of(cluster_cfg, network, ctx, world: int) -> tuple[str, int | RankZeroPort]:
    """Where the forked workers meet: rank 0's node on emulated nodes (a namespace of this run's
    own: its port is free), else cluster.master_addr; cluster.master_port, or rank 0's choice."""
    if network is not None:
        return network.master_addr, cluster_cfg.master_port or network.port
    # fldp.validation.check_launch has checked that this machine can listen at cluster.master_addr
    return cluster_cfg.master_addr, cluster_cfg.master_port or RankZeroPort(ctx, world)


def _raise_first_failure(failures: list, deaths: list) -> None:
    """The WorkerError of the earliest failure: `failures` (time, rank, report, plain), earliest
    first, as the workers reported them; `deaths` (rank, exitcode) as the launcher saw them."""
    reported = {rank for _, rank, _, _ in failures}
    after = f"\n({len(failures)} other ranks failed after it)" if failures else ""
    # a rank killed outright (SIGKILL, OOM) leaves no traceback; its peers' errors come after
    for rank, code in deaths:
        if rank not in reported:
            raise WorkerError(f"rank {rank} died ({ended(code)}) without a Python error{after}")
    if failures:
        _, rank, report, plain = failures[0]
        others = f"\n({len(failures) - 1} other ranks failed after it)" if len(failures) > 1 else ""
        raise WorkerError(f"rank {rank}: {report}{others}" if plain else f"rank {rank} failed first:\n{report}{others}")


def stop_tqdm_monitors() -> None:
    """Stop tqdm's monitor threads in this process, and start none again. Every 10 s a monitor
    takes tqdm's lock; a worker forked while it holds it inherits the lock held, by a thread the
    worker does not have, and blocks forever on its first progress bar (rank 0's). This process
    starts one whenever it shows a bar before forking (the datasets library's, tokenising), so
    rarely, and more often on a loaded machine, the run hung: seen as a test stuck 600 s."""
    from tqdm import tqdm
    from tqdm._monitor import TMonitor

    tqdm.monitor_interval = 0  # read by every tqdm subclass (datasets', huggingface_hub's) as it starts one
    for thread in threading.enumerate():
        if isinstance(thread, TMonitor):
            thread.exit()  # wakes it and joins it: it no longer holds the lock


_GRACE_S = 1.0


def _watch(procs, deaths: list, interrupts) -> None:
    """Until every worker has exited, or one failed (appended to `deaths` as (rank, exitcode)), or
    the launcher was told to stop."""
    alive = {p.sentinel: (i, p) for i, p in enumerate(procs) if p.pid is not None}
    while alive and not deaths and not interrupts.signum:
        for sentinel in wait(list(alive)):
            rank, p = alive.pop(sentinel)
            p.join()  # a ready sentinel can precede the reaping that sets exitcode
            if p.exitcode != 0:
                deaths.append((rank, p.exitcode))
    if deaths and not interrupts.signum:
        time.sleep(_GRACE_S)  # let the cascade report, so the first error is known


class _Interrupts:
    """SIGINT (Ctrl-C) and SIGTERM (SLURM, `kill`) to the launcher: the first stops the workers
    (SIGTERM) and is remembered, so run_local returns through its cleanup (the emulated network
    removed) and raises Interrupted; a later one, say a second Ctrl-C while they stop, SIGKILLs them.
    The handler never raises: an exception raised inside the cleanup would cut it short. (Workers
    die with their launcher anyway, even a SIGKILLed one: PR_SET_PDEATHSIG.)"""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, procs):
        self.procs, self.signum, self.previous = procs, None, {}
        self.owner = os.getpid()

    def __enter__(self):
        try:
            self.previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        except ValueError:  # not the main thread: signals cannot be handled here
            self.previous = {}
        return self

    def __exit__(self, *exc):
        for s, handler in self.previous.items():
            if self.signum is not None:  # the workers are gone; another Ctrl-C would only cut the report short
                signal.signal(s, signal.SIG_IGN)
            elif handler is not None:  # None: a handler set outside Python, which cannot be put back
                signal.signal(s, handler)

    def _handle(self, signum, frame):
        if os.getpid() != self.owner:  # a worker just forked, before it set its own handlers
            os._exit(128 + signum)
        first = self.signum is None
        self.signum = self.signum or signum
        for p in self.procs:
            if p.pid is not None and p.exitcode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGTERM if first else signal.SIGKILL)


def _drain(queue):
    while not queue.empty():
        yield queue.get()


def _dump_stacks(procs, wait_s: float = 0.25) -> None:
    """Each worker still running prints every thread's stack to stderr (SIGUSR1, faulthandler):
    where they were stuck when the launcher itself failed, say at a test's time limit. One at a
    time, so their reports do not interleave on the shared stderr."""
    for p in procs:
        if p.pid is not None and p.is_alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGUSR1)
            time.sleep(wait_s)


def _stop(procs, patience_s: float = 10.0) -> None:
    """SIGTERM the workers still running, SIGKILL those that ignore it; reap all. The patience
    covers rank 0 closing its W&B run (fldp.stopping: ~2 s here) on a loaded machine."""
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + patience_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()
