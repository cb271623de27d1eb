"""Checkpoints with torch.distributed.checkpoint (DCP), one per federation group.

Between aggregations the federation groups hold different parameters, and their optimiser states
differ always (they stay local at aggregation), so every group's state is kept: each group saves
its sharded model and optimiser into its own DCP directory, over a process group of its own ranks
(DCP would otherwise take the groups' same-named tensors for replicas of one). Per rank, a small
file holds the scheduler, the RNG state and the step; the data position follows from the step.

    run_dir/checkpoints/step_00000008/{group_0/, group_1/, rank_0.pt, ..., meta.json, COMPLETE}

COMPLETE is written last, after every rank finished and every file and directory of the checkpoint
is fsynced (so a node crash cannot leave COMPLETE beside a truncated file): a checkpoint without it
is never resumed, and the launcher deletes it once its workers have stopped (a save cut short by a
failure, a full disk or a signal). A write that fails (disk full, read-only) ends the run with a WriteError naming
the checkpoint's directory.
With trainer.keep_last=K, the older complete checkpoints beyond the newest K (by completion: never
the one just written, even beside a higher step left by an earlier run) are deleted once a new one
is complete. With trainer.async_save, DCP writes in a background thread while training goes
on; the checkpoint is marked COMPLETE when every rank's write has finished, checked at the next
checkpoint or at the end of the run (a crash before that loses only the one in flight).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import signal
import threading
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from .errors import WriteError
from .mesh import ConfigError, MeshShape

if TYPE_CHECKING:
    from .config import Config

MARKER = "COMPLETE"


def latest(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint of a run directory."""
    done = sorted(p.parent for p in (Path(run_dir) / "checkpoints").glob(f"step_*/{MARKER}"))
    return done[-1] if done else None


class Stopped(Exception):
    """Training stopped on a warning signal (a SLURM time limit or preemption ahead), with a
    complete checkpoint after `step`."""

    def __init__(self, step: int):
        super().__init__(f"stopped on the warning signal after step {step}, checkpoint saved")
        self.step = step


_warned: threading.Event | None = None  # None: no handler installed, nothing checked, nothing spent


def stop_on(signum: int) -> None:
    """From now on `signum` makes training save a checkpoint at the end of its step and raise
    Stopped (fldp.slurm.run_rank installs it for SLURM's warning signal)."""
    global _warned
    _warned = threading.Event()
    signal.signal(signum, lambda *_: _warned.set())  # only a flag: the ranks act together, between steps


def discard_incomplete(run_dir: str | Path) -> list[Path]:
    """Delete the checkpoints without COMPLETE: saves cut short. Only once no process of the run is
    writing any more (the launcher, after its workers stopped): an incomplete checkpoint may be one
    still being written. Best effort: a disk that refuses the deletion keeps them, never resumed."""
    partial = [p for p in (Path(run_dir) / "checkpoints").glob("step_*") if not (p / MARKER).exists()]
    for path in partial:
        shutil.rmtree(path, ignore_errors=True)
    return [p for p in partial if not p.exists()]


@contextlib.contextmanager
def _writing(path: Path):
    """A save that fails for want of a writable disk (ENOSPC, EROFS, EDQUOT, EACCES, EIO), on this
    rank or another of its group, becomes a WriteError naming the checkpoint: the launcher reports
    it as one line instead of a traceback per rank. Any other failure passes through as it is."""
    try:
        yield
    except (Exception, CheckpointException) as e:  # DCP's CheckpointException is a BaseException
        cause = _os_error(e) or _unwritable(path if path.exists() else path.parent)
        if cause is None:
            raise
        raise WriteError(f"cannot write checkpoint {path}: {cause.strerror or cause}") from e


def _os_error(error: BaseException) -> OSError | None:
    """The OSError behind a failed save, where its exceptions still carry one: in the chain of
    causes (torch's zip writer, unable to finish a file the disk cut short, raises a RuntimeError
    of its own on top), or among the ranks' failures DCP gathered (these come without chains)."""
    todo: list[BaseException | None] = [error]
    seen: set[int] = set()
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and not isinstance(e, (ConnectionError, TimeoutError)):  # not a peer's loss
            return e
        todo += [e.__cause__, e.__context__]
        if isinstance(e, CheckpointException):
            todo += [exc for exc, _ in e.failures.values()]
    return None


def _unwritable(directory: Path) -> OSError | None:
    """Why `directory` takes no write of 1 MiB now, or None. Asked when a save failed without an
    OSError to say why: a disk that a save filled up has not even that much room left."""
    probe = directory / f".write-probe-{os.getpid()}"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        try:
            data = memoryview(bytes(2**20))
            while data:  # a full disk takes what fits, then fails
                data = data[os.write(fd, data) :]
        finally:
            os.close(fd)
    except OSError as e:
        return e
    finally:
        with contextlib.suppress(OSError):
            probe.unlink()
    return None


def _fsync(path: Path) -> None:
    """Flush a file's data, or a directory's entries, to the disk: a node that crashes after
    COMPLETE is written must not come back with COMPLETE beside a truncated or missing file."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as e:  # some FUSE and network file systems cannot sync a directory: nothing to do
        if not (path.is_dir() and e.errno in (errno.EINVAL, errno.ENOTSUP)):
            raise
    finally:
        os.close(fd)


def prune(run_dir: str | Path, keep: int, newest: Path | None = None) -> list[Path]:
    """Delete the complete checkpoints older than the newest `keep` (>= 1), newest by when they were
    completed, not by step: a checkpoint of a higher step left in the run directory by an earlier
    run is older than the one just written. `newest`, the one just written, is never deleted;
    incomplete ones (being written, or cut short by a crash) are not touched. Returns the deleted."""
    done = [p.parent for p in (Path(run_dir) / "checkpoints").glob(f"step_*/{MARKER}")]
    order = {p: (p == newest, (p / MARKER).stat().st_mtime_ns, p.name) for p in done}
    old = sorted(done, key=lambda p: order[p])[:-keep]
    for path in old:
        (path / MARKER).unlink()  # first, so that a deletion cut short leaves no resumable half
        shutil.rmtree(path)
    return old


def check_mesh(path: Path, shape: MeshShape) -> None:
    """A checkpoint resumes only on the mesh it was saved with: FedAvg pairs shard k of group f
    with shard k of the others, so another F, R or S would pair different slices, and another F
    has no state for the new groups."""
    meta = json.loads((path / "meta.json").read_text())
    saved = MeshShape(meta["federation"], meta["replicate"], meta["shard"])
    if saved != shape:
        raise ConfigError(
            f"trainer.resume=auto: {path} was saved with mesh {saved}, this run has "
            f"{shape}; resume with the same mesh.* or use a new hydra.run.dir"
        )


def _schedule_json(schedule) -> list | None:
    """An aggregation schedule ((start, A), ...) as meta.json holds it; None without aggregation."""
    return [list(p) for p in schedule] if schedule is not None else None


# why a resume must keep each key a checkpoint records of what its buckets and fragments hold
_BUCKET_KEYS = {
    "algorithm.streaming.layout": "the steps before the checkpoint aggregated each layer on the saved "
    "layout's steps, so the run would be neither configuration",
    "algorithm.federate": "the steps before the checkpoint averaged other parameters (one newly federated "
    "has no saved outer state), so the run would be neither configuration",
    "algorithm.fedavg.bucket_mb": "a quantised exchange quantises each bucket, and the steps before the "
    "checkpoint quantised the saved buckets",
}
# how meta.json says FedAvg's state is keyed (fldp.buckets.Bucket.state_dict); absent: by bucket number
STATE_KEYS = "parameter"


def check_state_keys(path: Path, keeps_state: bool) -> None:
    """A checkpoint whose FedAvg state was saved by bucket number (fldp before STATE_KEYS) cannot be
    read by this fldp, which keeps it by parameter name; one without that state (plain FedAvg,
    nothing quantised or cast) has nothing to read and resumes."""
    meta = json.loads((path / "meta.json").read_text())
    if keeps_state and meta.get("fedavg_state") != STATE_KEYS:
        raise ConfigError(
            f"trainer.resume=auto: {path} was saved by an earlier fldp, which kept FedAvg's outer "
            "state (anchor, reference, residual) by bucket number; this one keeps it by parameter "
            "name and cannot read it; finish that run with the fldp that wrote it or use a new hydra.run.dir"
        )


def check_schedule(path: Path, schedule: tuple | None, fragments: int = 1, federation=None) -> None:
    """A checkpoint resumes only with the aggregation schedule (FedAvgConfig.schedule) and streaming
    fragments it was saved with: another would make the run neither the saved configuration nor the
    new one (the steps before the checkpoint aggregated on the old schedule), and other fragments
    have other outer state. Likewise the keys that decide what a bucket holds, as far as the
    checkpoint recorded them (`federation`: this run's FedAvgConfig; FedAvg.saved_with). One from
    before meta.json held them passes, unless its FedAvg state was saved by bucket number."""
    meta = json.loads((path / "meta.json").read_text())
    wanted = _schedule_json(schedule)
    if "schedule" in meta and meta["schedule"] != wanted:
        raise ConfigError(
            f"trainer.resume=auto: {path} was saved with algorithm.every={meta['schedule']}, "
            f"this run has algorithm.every={wanted}; resume with the same algorithm.every "
            f"or use a new hydra.run.dir"
        )
    if meta.get("fragments", 1) != fragments:
        raise ConfigError(
            f"trainer.resume=auto: {path} was saved with algorithm.streaming.fragments="
            f"{meta.get('fragments', 1)}, this run has {fragments}; resume with the same "
            "fragments or use a new hydra.run.dir"
        )
    # before STATE_KEYS, saved_with named bucket_mb exactly where FedAvg kept state (by bucket number)
    check_state_keys(path, "algorithm.fedavg.bucket_mb" in meta.get("saved_with", {}))
    now = federation.bucket_keys() if federation is not None else {}
    for key, saved in meta.get("saved_with", {}).items():
        if now.get(key) != saved:
            raise ConfigError(
                f"trainer.resume=auto: {path} was saved with {key}={saved}, this run has "
                f"{key}={now.get(key)}: {_BUCKET_KEYS[key]}; resume with the same {key} or use a "
                "new hydra.run.dir"
            )


class Checkpointer:
    """`stateful`: further components to save beside model and optimiser, by name (anything with
    state_dict / load_state_dict whose tensors are this rank's own, e.g. the outer optimiser's
    anchor and state: saved under the rank's own keys, so DCP keeps every rank's)."""

    def __init__(
        self,
        run_dir: str,
        shape: MeshShape,
        algorithm: str,
        every: int,
        last_step: int,
        stateful: dict | None = None,
        keep_last: int | None = None,
        async_save: bool = False,
        schedule: tuple | None = None,
        fragments: int = 1,
    ):
        self.stateful = stateful or {}
        self.schedule, self.fragments = schedule, fragments
        self.root = Path(run_dir) / "checkpoints"
        self.shape, self.algorithm, self.every, self.last_step = shape, algorithm, every, last_step
        self.keep_last, self.async_save = keep_last or None, async_save
        self.pending: tuple | None = None  # (step, path, future) of an async save not yet marked COMPLETE
        self.rank = dist.get_rank()
        self.federation_index = shape.coords(self.rank)[0]
        size = shape.group_size
        # DCP's async_save coordinates over a CPU (gloo) group, also when training runs on NCCL
        self.group, _ = dist.new_subgroups_by_enumeration(
            [list(range(f * size, (f + 1) * size)) for f in range(shape.federation)],
            backend="gloo" if async_save else None,
        )

    @property
    def _aggregation(self):
        """The FedAvg among the stateful components (fldp.trainer registers it as "outer"), or None."""
        from .aggregation import FedAvg

        return next((c for c in self.stateful.values() if isinstance(c, FedAvg)), None)

    def due(self, step: int) -> bool:
        return bool(self.every) and (step % self.every == 0 or step == self.last_step)

    def save(self, step: int, model, optimizer, scheduler) -> None:
        self.finish()  # one save in flight at most: the previous one is complete before this starts
        path = self.root / f"step_{step:08d}"
        with _writing(path):
            path.mkdir(parents=True, exist_ok=True)
            torch.save(
                {"step": step, "scheduler": scheduler.state_dict(), "rng": torch.get_rng_state()},
                path / f"rank_{self.rank}.pt",
            )
            _fsync(path / f"rank_{self.rank}.pt")
            target = {"checkpoint_id": path / f"group_{self.federation_index}", "process_group": self.group}
            if self.async_save:  # returns once the state is copied aside; the write goes on in a thread
                self.pending = (step, path, dcp.async_save(self._state(model, optimizer), **target))
            else:
                dcp.save(self._state(model, optimizer), **target)
        if not self.async_save:
            self._complete(step, path)

    def finish(self) -> None:
        """Wait for this rank's async save in flight, then mark it COMPLETE once every rank's is done."""
        if self.pending is None:
            return
        step, path, future = self.pending
        self.pending = None
        with _writing(path):
            getattr(future, "upload_completion", future).result()  # a Future, or an AsyncSaveResponse
        self._complete(step, path)

    def stop_if_warned(self, step: int, model, optimizer, scheduler, device) -> None:
        """After a step, where a warning handler is installed: if any rank caught the signal, every
        rank saves now (unless this step was just saved) and raises Stopped; the last step just ends."""
        if _warned is None:
            return
        flag = torch.tensor([float(_warned.is_set())], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # the signal reaches the ranks at different moments
        if not flag.item() or step == self.last_step:
            return
        if not self.due(step):
            self.save(step, model, optimizer, scheduler)
        self.finish()
        raise Stopped(step)

    def _complete(self, step: int, path: Path) -> None:
        with _writing(path):  # DCP fsyncs its files, not the directory that names them
            _fsync(path / f"group_{self.federation_index}")
        dist.barrier()  # every rank's shards and extras are written, and on the disk
        if self.rank == 0:
            from .aggregation import saved_with

            meta = {
                "step": step,
                "algorithm": self.algorithm,
                "federation": self.shape.federation,
                "replicate": self.shape.replicate,
                "shard": self.shape.shard,
                "schedule": _schedule_json(self.schedule),
                **({"fragments": self.fragments} if self.fragments > 1 else {}),
                **({"saved_with": saved_with(self._aggregation)} if self._aggregation else {}),
                **({"fedavg_state": STATE_KEYS} if self._aggregation else {}),
            }
            with _writing(path):
                (path / "meta.json").write_text(json.dumps(meta))
                _fsync(path / "meta.json")
                _fsync(path)  # the entries of rank_k.pt, group_f/ and meta.json
                tmp = path / f".{MARKER}.tmp"
                tmp.write_text(str(step))
                _fsync(tmp)
                os.replace(tmp, path / MARKER)
                _fsync(path)  # COMPLETE's entry
                _fsync(path.parent)  # the checkpoint's own entry
            if self.keep_last:
                prune(self.root.parent, self.keep_last, newest=path)
        dist.barrier()

    def _state(self, model, optimizer) -> dict:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        return {
            "model": model_sd,
            "optim": optim_sd,
            **{name: {f"rank_{self.rank}": c.state_dict()} for name, c in self.stateful.items()},
        }

    def load(self, path: Path, model, optimizer, scheduler) -> int:
        """Restore this rank from `path`; returns the step it was taken after."""
        check_mesh(path, self.shape)
        check_schedule(path, self.schedule, self.fragments, self._aggregation.config if self._aggregation else None)
        check_state_keys(path, bool(self._aggregation and self._aggregation.state_dict()))
        state = self._state(model, optimizer)
        dcp.load(state, checkpoint_id=path / f"group_{self.federation_index}", process_group=self.group)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        for name, component in self.stateful.items():
            component.load_state_dict(state[name][f"rank_{self.rank}"])
        extras = torch.load(path / f"rank_{self.rank}.pt", weights_only=False)
        scheduler.load_state_dict(extras["scheduler"])
        torch.set_rng_state(extras["rng"])
        return extras["step"]


# --- how big a checkpoint is (the dry run prints it) --------------------------------------------


def group_bytes(conf: Config, shape: MeshShape, names_sizes: list[tuple[str, int]]) -> tuple[int, str]:
    """Bytes of one federation group's checkpoint, from the parameters' names and element counts,
    and what they hold: the parameters and the inner optimiser's state in the parameter dtype
    (AdamW: 2 moments; SGD with momentum: 1; DCP saves the group's replicas once), plus the outer
    optimiser's fp32 anchor and state on the federated parameters unless it is plain FedAvg (see
    fldp.aggregation), kept by every replica in all_replicas mode, by replica 0 in leader_broadcast;
    and where algorithm.outer.reduce_dtype casts or algorithm.outer.quantize quantises, every
    replica's copy of the federated weights at the last aggregation (the change is reduced from it),
    and with error feedback every replica's fp32 residual."""
    from .aggregation import FedAvgConfig
    from .model import DTYPES

    width = DTYPES[conf.trainer.precision].itemsize
    inner = {"adamw": 2, "sgd": 1 if conf.optimizer.momentum else 0}[conf.optimizer.name]
    total = sum(n for _, n in names_sizes) * width * (1 + inner)
    held = f"{conf.trainer.precision} weights" + (f" + {conf.optimizer.name} {inner} moment(s)" if inner else "")
    federation = FedAvgConfig.from_algorithm(conf.algorithm)
    if federation is None:
        return total, held
    names = [name for name, _ in names_sizes]
    federated = sum(n for (_, n), keep in zip(names_sizes, federation.federated(names)) if keep)
    if federation.outer.reduce_dtype not in (None, conf.trainer.precision) or federation.outer.quantize:
        # a casting or quantised reduce: every replica keeps the weights of the last aggregation (the reference)
        total += shape.replicate * federated * width
        held += f" + the last aggregation's weights x {shape.replicate} replicas"
    if federation.outer.error_feedback:  # fp32, each bucket padded to whole blocks (not counted)
        total += shape.replicate * federated * 4
        held += f" + the quantisation's fp32 error feedback x {shape.replicate} replicas"
    if not federation.outer.averages:
        outer = federation.outer
        moments = 2 if outer.name == "adam" else (1 if outer.momentum else 0)
        holders = 1 if federation.mode == "leader_broadcast" else shape.replicate
        total += holders * federated * 4 * (1 + moments)
        held += f" + outer {outer.name}'s fp32 anchor" + (f" and {moments} moment(s)" if moments else "")
        held += f" x {holders} replicas" if holders > 1 else ""
    return total, held


def _amount(n: float, unit: str = "B") -> str:
    """3 significant digits in decimal units: 48.2 GB, 6.17 TB, 8.03 G parameters."""
    scale = next((s for s in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")) if n >= s[0]), (1, ""))
    return f"{n / scale[0]:.3g} {scale[1]}{unit}"


def size_line(conf: Config, shape: MeshShape) -> str:
    """The dry run's checkpoint line: size per federation group and for the job, how many are kept."""
    from .model import build_model, llama_config

    try:
        vocab = conf.model.vocab_size
        if vocab is None:
            from .data import load_tokenizer

            vocab = len(load_tokenizer(conf.dataset.tokenizer))
        model = build_model(llama_config(conf.model, vocab), "meta")
    except Exception as e:  # the pre-flight reports a missing tokenizer; the size just is not known
        return f"checkpoint: size unknown (no vocabulary size: {e})"
    params = [(name, p.numel()) for name, p in model.named_parameters()]
    group, held = group_bytes(conf, shape, params)
    job = group * shape.federation
    t = conf.trainer
    line = (
        f"checkpoint: {_amount(group)} per federation group x {shape.federation} = {_amount(job)} "
        f"({_amount(sum(n for _, n in params), ' parameters')}: {held})"
    )
    if not t.checkpoint_every:
        return line + "; none saved (trainer.checkpoint_every=0)"
    kept = (
        f"the newest {t.keep_last} kept (up to {_amount(job * (t.keep_last + 1))} on disk while the next is written)"
        if t.keep_last
        else "all kept (trainer.keep_last=null)"
    )
    return line + f"; every {t.checkpoint_every} steps, {kept}"
