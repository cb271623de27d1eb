"""Checkpoints with torch.distributed.checkpoint (DCP), one per federation group.

Between aggregations the federation groups hold different parameters, and their optimiser states
differ always (they stay local at aggregation), so every group's state is kept: each group saves
its sharded model and optimiser into its own DCP directory, over a process group of its own ranks
(DCP would otherwise take the groups' same-named tensors for replicas of one). Per rank, a small
file holds the scheduler, the RNG state and the step; the data position follows from the step.

    run_dir/checkpoints/step_00000008/{group_0/, group_1/, rank_0.pt, ..., meta.json, COMPLETE}

COMPLETE is written last, after every rank finished: a checkpoint without it is never resumed.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from .mesh import ConfigError, MeshShape

MARKER = "COMPLETE"


def latest(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint of a run directory."""
    done = sorted(p.parent for p in (Path(run_dir) / "checkpoints").glob(f"step_*/{MARKER}"))
    return done[-1] if done else None


def check_mesh(path: Path, shape: MeshShape) -> None:
    """A checkpoint resumes only on the mesh it was saved with: FedAvg pairs shard k of group f
    with shard k of the others, so another F, R or S would pair different slices, and another F
    has no state for the new groups."""
    meta = json.loads((path / "meta.json").read_text())
    saved = MeshShape(meta["federation"], meta["replicate"], meta["shard"])
    if saved != shape:
        raise ConfigError(f"trainer.resume=auto: {path} was saved with mesh {saved}, this run has "
                          f"{shape}; resume with the same mesh.* or use a new hydra.run.dir")


class Checkpointer:
    """`stateful`: further components to save beside model and optimiser, by name (anything with
    state_dict / load_state_dict whose tensors are this rank's own, e.g. the outer optimiser's
    anchor and state: saved under the rank's own keys, so DCP keeps every rank's)."""

    def __init__(self, run_dir: str, shape: MeshShape, algorithm: str, every: int, last_step: int,
                 stateful: dict | None = None):
        self.stateful = stateful or {}
        self.root = Path(run_dir) / "checkpoints"
        self.shape, self.algorithm, self.every, self.last_step = shape, algorithm, every, last_step
        self.rank = dist.get_rank()
        self.federation_index = shape.coords(self.rank)[0]
        size = shape.group_size
        self.group, _ = dist.new_subgroups_by_enumeration(
            [list(range(f * size, (f + 1) * size)) for f in range(shape.federation)])

    def due(self, step: int) -> bool:
        return bool(self.every) and (step % self.every == 0 or step == self.last_step)

    def save(self, step: int, model, optimizer, scheduler) -> None:
        path = self.root / f"step_{step:08d}"
        dcp.save(self._state(model, optimizer),
                 checkpoint_id=path / f"group_{self.federation_index}", process_group=self.group)
        torch.save({"step": step, "scheduler": scheduler.state_dict(), "rng": torch.get_rng_state()},
                   path / f"rank_{self.rank}.pt")
        dist.barrier()
        if self.rank == 0:
            meta = {"step": step, "algorithm": self.algorithm, "federation": self.shape.federation,
                    "replicate": self.shape.replicate, "shard": self.shape.shard}
            (path / "meta.json").write_text(json.dumps(meta))
            tmp = path / f".{MARKER}.tmp"
            tmp.write_text(str(step))
            os.replace(tmp, path / MARKER)
        dist.barrier()

    def _state(self, model, optimizer) -> dict:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        return {"model": model_sd, "optim": optim_sd,
                **{name: {f"rank_{self.rank}": c.state_dict()} for name, c in self.stateful.items()}}

    def load(self, path: Path, model, optimizer, scheduler) -> int:
        """Restore this rank from `path`; returns the step it was taken after."""
        check_mesh(path, self.shape)
        state = self._state(model, optimizer)
        dcp.load(state, checkpoint_id=path / f"group_{self.federation_index}", process_group=self.group)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        for name, component in self.stateful.items():
            component.load_state_dict(state[name][f"rank_{self.rank}"])
        extras = torch.load(path / f"rank_{self.rank}.pt", weights_only=False)
        scheduler.load_state_dict(extras["scheduler"])
        torch.set_rng_state(extras["rng"])
        return extras["step"]
