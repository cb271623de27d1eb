"""What really crosses each mesh dimension: every collective this rank issues (FSDP2's all-gathers,
reduce-scatters and all-reduces, FedAvg's all-reduces and broadcasts), counted per dimension of
the mesh, with the bytes a bandwidth-optimal (ring / pipelined) algorithm sends per rank.

Optionally each collective is also made to last at least bytes / bandwidth of the tier its
group crosses (`comm.emulate`), so one machine shows the multi-tier effect of a cluster.
"""
from __future__ import annotations

import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .mesh import DIMS


def _nbytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(y) for y in x)
    return 0


def ring_bytes(kind: str, payload: int, n: int) -> float:
    """Bytes one rank sends in a bandwidth-optimal collective over n ranks. `payload` is the
    full gathered / reduced message (for all-gather the output, for reduce-scatter the input).
    Broadcast: a pipelined chain in which every rank but the last forwards the message once
    (the mean over ranks)."""
    factor = {"all_gather": (n - 1) / n, "reduce_scatter": (n - 1) / n,
              "all_reduce": 2 * (n - 1) / n, "broadcast": (n - 1) / n}[kind]
    return payload * factor


def _classify(opname: str, args) -> tuple[str, int] | None:
    """(kind, payload bytes) of a c10d op, from its arguments as the dispatcher sees them."""
    if "allgather" in opname:
        return "all_gather", _nbytes(args[0])       # outputs
    if "reduce_scatter" in opname:
        return "reduce_scatter", _nbytes(args[1])   # inputs
    if "allreduce" in opname:
        return "all_reduce", _nbytes(args[0])
    if "broadcast" in opname:
        return "broadcast", _nbytes(args[0])
    return None


class CommMeter(TorchDispatchMode):
    """Active around the timed phases of a step. `bandwidth` (bytes/s per dimension) turns on the
    emulation. Collectives on groups that are not a mesh dimension count as 'other'."""

    def __init__(self, mesh, bandwidth: dict[str, float] | None = None):
        super().__init__()
        self.dims = {id(mesh[d].get_group()): d for d in DIMS}
        self.bandwidth = bandwidth
        self.reset()

    def reset(self) -> None:
        self.bytes = dict.fromkeys((*DIMS, "other"), 0.0)
        self.count = dict.fromkeys((*DIMS, "other"), 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.namespace == "c10d":
            self._record(func._opname, args)
        return out

    def _record(self, opname: str, args) -> None:
        op = _classify(opname, args)
        group = next((torch.distributed.ProcessGroup.unbox(a) for a in args
                      if isinstance(a, torch.ScriptObject) and "ProcessGroup" in str(a._type())), None)
        if op is None or group is None:
            return
        dim = self.dims.get(id(group), "other")
        sent = ring_bytes(op[0], op[1], group.size())
        self.bytes[dim] += sent
        self.count[dim] += 1
        if self.bandwidth and dim in self.bandwidth and sent:
            time.sleep(sent / self.bandwidth[dim])

    def take(self) -> dict:
        """This step's counters as record fields; resets them."""
        row = {**{f"bytes_{d}": self.bytes[d] for d in DIMS},
               **{f"collectives_{d}": self.count[d] for d in DIMS}}
        if self.count["other"]:
            row.update(bytes_other=self.bytes["other"], collectives_other=self.count["other"])
        self.reset()
        return row
