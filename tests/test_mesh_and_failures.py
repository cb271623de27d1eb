"""Mesh validation, the shard-alignment check and failing workers, on real processes over gloo."""

import contextlib
import os
import time

import pytest
import torch
import torch.distributed as dist
from conftest import compose_cfg, run_world
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard

from fldp.aggregation import FedAvg, FedAvgConfig
from fldp.launch import WorkerError
from fldp.mesh import ConfigError, MeshShape, build_mesh, group_mesh, mesh_shape
from fldp.model import build_model, llama_config, parallelize
from fldp.validation import validate


def test_rank_coordinates_are_federation_major():
    shape = MeshShape(2, 2, 2)
    assert [shape.coords(r) for r in range(8)] == [
        (0, 0, 0),
        (0, 0, 1),
        (0, 1, 0),
        (0, 1, 1),
        (1, 0, 0),
        (1, 0, 1),
        (1, 1, 0),
        (1, 1, 1),
    ]


@pytest.mark.parametrize(
    "algorithm,shape", [("fsdp", (1, 1, 512)), ("hsdp", (1, 128, 4)), ("fl_fsdp", (128, 1, 4)), ("fl_hsdp", (16, 8, 4))]
)
def test_leonardo_layouts_are_the_authors(algorithm, shape):
    cfg = compose_cfg(f"algorithm={algorithm}", "topology=leonardo_512")
    assert mesh_shape(cfg) == MeshShape(*shape)


def test_mesh_override_and_validation_messages():
    assert mesh_shape(compose_cfg("algorithm=fl_fsdp", "mesh.federation=8", "mesh.shard=1")) == MeshShape(8, 1, 1)
    with pytest.raises(ConfigError, match=r"mesh.federation=2: algorithm=hsdp needs mesh.federation=1"):
        mesh_shape(compose_cfg("algorithm=hsdp", "mesh.federation=2", "mesh.replicate=1"))
    # FedAvg's config refuses it on construction (ValueError); the validation, as the config error it is
    with pytest.raises(ValueError, match=r"algorithm.every=-1"):
        FedAvgConfig.from_algorithm(compose_cfg("algorithm.every=-1").algorithm)
    with pytest.raises(ConfigError, match=r"algorithm.every=-1"):
        validate(compose_cfg("algorithm.every=-1"))


def _build(cfg, shape, device, misalign=None):
    mesh = build_mesh(shape, "cpu")
    torch.manual_seed(0)
    f = shape.coords(dist.get_rank())[0]
    model_cfg = cfg.model.copy()
    if misalign == "shape" and f == 1:
        model_cfg.intermediate_size = 128  # group 1 trains a different model
    model = build_model(llama_config(model_cfg, 4096))
    if misalign == "policy" and f == 1:
        # group 1 shards along dim 1: same tensors, different slices on each rank
        for layer in model.model.layers:
            fully_shard(layer, mesh=group_mesh(mesh, shape), shard_placement_fn=lambda p: Shard(p.ndim - 1))
        fully_shard(model, mesh=group_mesh(mesh, shape), shard_placement_fn=lambda p: Shard(p.ndim - 1))
    else:
        parallelize(model, group_mesh(mesh, shape), torch.float32)
    return model, mesh


def _construct_fedavg(cfg, misalign, out, device):
    shape = MeshShape(2, 1, 2)
    model, mesh = _build(cfg, shape, device, misalign)
    try:
        FedAvg(model, mesh, shape, FedAvgConfig(every=2), last_step=4)
        result = "ok"
    except Exception as e:
        result = f"{type(e).__name__}: {e}"
    with open(os.path.join(out, f"rank{dist.get_rank()}"), "w") as f:
        f.write(result)


@pytest.mark.parametrize("misalign", [None, "shape", "policy"])
def test_misaligned_federation_group_trips_the_shard_check(tmp_path, misalign):
    run_world(_construct_fedavg, 4, compose_cfg(), misalign, str(tmp_path))
    results = [(tmp_path / f"rank{r}").read_text() for r in range(4)]
    if misalign is None:
        assert results == ["ok"] * 4
    else:
        for text in results:
            assert text.startswith("ShardMismatchError: federation group"), text
            assert "first difference" in text


def test_bucketed_fedavg_reduces_every_tensor_once(tmp_path):
    run_world(_bucket_worker, 4, compose_cfg(), str(tmp_path))
    assert (tmp_path / "ok").exists()


def _bucket_worker(cfg, out, device):
    """Buckets far smaller than the model (many buckets) give bitwise the per-tensor average."""
    shape = MeshShape(2, 1, 2)
    model, mesh = _build(cfg, shape, device)
    f = shape.coords(dist.get_rank())[0]
    with torch.no_grad():
        for p in model.parameters():  # make the groups differ
            p.to_local().mul_(1.0 + f).add_(0.25 * f)
    expected = []
    fed = mesh["federation"].get_group()
    for p in model.parameters():
        t = p.to_local().clone()
        dist.all_reduce(t, group=fed)
        expected.append(t / 2)
    fedavg = FedAvg(model, mesh, shape, FedAvgConfig(every=1, bucket_mb=0.01), last_step=1)
    assert len(fedavg.buckets) > 5
    assert sum(len(b.shards) for b in fedavg.buckets) == sum(1 for p in model.parameters() if p.to_local().numel())
    fedavg()
    for p, e in zip(model.parameters(), expected):
        assert torch.equal(p.to_local(), e)
    if dist.get_rank() == 0:
        open(os.path.join(out, "ok"), "w").close()


def _fail_on_rank_2(device):
    if dist.get_rank() == 2:
        raise ValueError("injected failure")
    dist.barrier()  # the others wait in a collective that will never complete


@pytest.mark.timeout(120)  # the others, waiting in a barrier, would wait past it if they were not stopped
def test_a_failing_worker_ends_the_whole_run(tmp_path):
    with pytest.raises(WorkerError, match=r"rank 2 failed first:(.|\n)*ValueError: injected failure"):
        run_world(_fail_on_rank_2, 4, timeout_s=600)
    children = [p for p in os.listdir("/proc") if p.isdigit() and _parent(p) == os.getpid()]
    assert not children, f"worker processes left behind: {children}"


def _all_reduce_one(device):
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == dist.get_world_size()


@pytest.mark.timeout(120)
def test_a_port_taken_after_the_launcher_looked_does_not_fail_the_rendezvous(monkeypatch):
    """Another process binds, as the first worker starts, any port the launcher has already chosen
    for the rendezvous (a port found free, then handed to rank 0): seen in a fresh-clone CI run as
    EADDRINUSE beside another test's workers. Rank 0 must hold its port from the moment it is chosen."""
    import socket
    from multiprocessing.context import ForkProcess

    stolen: list[socket.socket] = []
    start = ForkProcess.start

    def steal_then_start(self):
        if not stolen:
            addr = next(a for a in self._args if a == "127.0.0.1")
            for port in [a for a in self._args if type(a) is int and 1024 < a < 65536]:
                s = socket.socket()
                with contextlib.suppress(OSError):  # not a port at all
                    s.bind((addr, port))
                    s.listen()
                stolen.append(s)
        start(self)

    monkeypatch.setattr(ForkProcess, "start", steal_then_start)
    try:
        run_world(_all_reduce_one, 3)
    finally:
        for s in stolen:
            s.close()


def _progress_bar(device):
    from tqdm import tqdm

    tqdm(total=1, disable=True).close()  # takes tqdm's lock, as rank 0's progress bar does


@pytest.mark.timeout(90)
def test_a_worker_forked_while_tqdms_monitor_holds_its_lock_still_starts(monkeypatch):
    """tqdm's monitor thread takes tqdm's lock every 10 s. Here one holds it for 3 s just as the
    launcher forks: a worker that inherits the lock held (by a thread it does not have) would block
    on its first progress bar until the test's limit; the launcher stops the monitor first."""
    import threading

    from tqdm import tqdm
    from tqdm._monitor import TMonitor

    holding = threading.Event()

    def run(self):  # a monitor caught inside its periodic check
        with self.tqdm_cls.get_lock():
            holding.set()
            self.was_killed.wait(3)

    monkeypatch.setattr(TMonitor, "run", run)
    monkeypatch.setattr(tqdm, "monitor_interval", 10)
    monitor = TMonitor(tqdm, 10)
    try:
        assert holding.wait(10)
        run_world(_progress_bar, 2, timeout_s=60)  # with the lock inherited held: stuck until the test's limit
        assert not monitor.is_alive()
    finally:
        monitor.exit()


def _parent(pid: str) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _stuck_forever(device):
    time.sleep(3600)


class _LauncherTimedOut(Exception):
    pass


@pytest.mark.timeout(90)
def test_a_launcher_failing_on_its_own_prints_where_each_worker_is_stuck(capfd):
    """A hang the suite cannot explain from the launcher's side (a test's time limit): before the
    workers are stopped, each prints every thread's stack, so the report shows where they were."""
    import signal

    def time_limit(signum, frame):
        raise _LauncherTimedOut()

    previous = signal.signal(signal.SIGALRM, time_limit)
    signal.alarm(8)
    try:
        with pytest.raises(_LauncherTimedOut):
            run_world(_stuck_forever, 2, timeout_s=60)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    err = capfd.readouterr().err
    assert "in _stuck_forever" in err and "thread 0x" in err, err[-3000:]


def _report_frozen(out, device):
    import gc

    out[dist.get_rank()] = gc.get_freeze_count()


def test_forked_workers_leave_the_launchers_heap_to_the_permanent_generation():
    """A worker's garbage collector does not scan (and so copy) the objects it inherited: they are
    frozen (gc.freeze) when it forks, and the launcher's own are collected again afterwards. Without
    it, a CI run's 8 memory-tracked workers were all found inside the collector after 600 s."""
    import gc

    out = torch.multiprocessing.Manager().dict()
    run_world(_report_frozen, 2, out)
    assert len(out) == 2 and min(out.values()) > 1000, dict(out)  # the launcher's modules at least
    assert gc.get_freeze_count() == 0
