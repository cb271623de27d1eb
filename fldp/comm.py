"""What really crosses each mesh dimension: every collective this rank issues (FSDP2's all-gathers,
reduce-scatters and all-reduces, FedAvg's all-reduces and broadcasts), counted per dimension of
the mesh, with the bytes a bandwidth-optimal (ring / pipelined) algorithm sends per rank.

Optionally each collective is also made to last at least bytes / bandwidth of the tier its
group crosses (`comm.emulate`), so one machine shows the multi-tier effect of a cluster.

The meter counts at the level of `torch.distributed`'s collective functions, which FSDP2 and FedAvg
look up by name at call time: while it is active those names point to thin recorders around the
originals, restored when it exits. A few microseconds per collective, where a dispatch mode would
run Python for every op of the step (it made the tiny CPU runs' steps ~1.2x slower).

`all_ranks` gathers every rank's few statistics (a step's loss and times, an evaluation's sums).
"""

from __future__ import annotations

import inspect
import threading
import time

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

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
    All-to-all: the input, less the part a rank keeps. Broadcast: a pipelined chain in which every
    rank but the last forwards the message once
    (the mean over ranks)."""
    factor = {
        "all_gather": (n - 1) / n,
        "reduce_scatter": (n - 1) / n,
        "all_to_all": (n - 1) / n,
        "all_reduce": 2 * (n - 1) / n,
        "broadcast": (n - 1) / n,
    }[kind]
    return payload * factor


# The collective functions counted: kind, and the argument holding the payload as ring_bytes wants
# it (for all-gather the output, for reduce-scatter the input).
COLLECTIVES = {
    "all_gather": ("all_gather", "tensor_list"),
    "all_gather_single": ("all_gather", "output_tensor"),
    "all_gather_into_tensor": ("all_gather", "output_tensor"),
    "all_gather_coalesced": ("all_gather", "output_tensor_lists"),
    "reduce_scatter": ("reduce_scatter", "input_list"),
    "reduce_scatter_single": ("reduce_scatter", "input"),
    "reduce_scatter_tensor": ("reduce_scatter", "input"),
    "all_reduce": ("all_reduce", "tensor"),
    "all_reduce_coalesced": ("all_reduce", "tensors"),
    "broadcast": ("broadcast", "tensor"),
    # the quantised aggregation's first stage (fldp/quantize.py): each rank keeps 1/n of its input
    "all_to_all_single": ("all_to_all", "input"),
    "all_to_all": ("all_to_all", "input_tensor_list"),
}


def _signatures() -> dict[str, tuple[str, str, int, int]]:
    """name -> (kind, payload name, payload position, group position), for the functions this
    torch has; positions read once from the signatures so a call costs no argument binding."""
    found = {}
    for name, (kind, payload) in COLLECTIVES.items():
        fn = getattr(c10d, name, None)
        if fn is None:
            continue
        params = list(inspect.signature(fn).parameters)
        found[name] = (kind, payload, params.index(payload), params.index("group"))
    return found


_SIGNATURES = _signatures()
# Both names: callers use torch.distributed.X, and distributed_c10d's own helpers (all_gather_object
# -> all_gather) call X through their module; these count as the collectives they issue.
_TARGETS = [(module, name) for module in (dist, c10d) for name in _SIGNATURES if hasattr(module, name)]


def _arg(args, kwargs, name: str, position: int):
    return args[position] if len(args) > position else kwargs.get(name)


class CommMeter:
    """Active (a context manager) around the timed phases of a step. `bandwidth` (bytes/s per
    dimension) turns on the emulation. Collectives on groups that are not a mesh dimension count
    as 'other'; collectives outside the `with` are not counted."""

    def __init__(self, mesh, bandwidth: dict[str, float] | None = None):
        self.dims = {mesh[d].get_group(): d for d in DIMS}
        self.bandwidth = bandwidth
        self._saved: list | None = None
        self._recorders: dict = {}  # (name, original) -> its recorder, built once, not every step
        # a collective implemented by another (all_gather_into_tensor -> all_gather_single, which
        # distributed_c10d calls by its module name) counts once, as the outer call
        self._inside = threading.local()
        self.reset()

    def reset(self) -> None:
        self.bytes = dict.fromkeys((*DIMS, "other"), 0.0)
        self.count = dict.fromkeys((*DIMS, "other"), 0)

    def __enter__(self):
        if self._saved is not None:
            raise RuntimeError("CommMeter is already active")
        self._saved = [(module, name, getattr(module, name)) for module, name in _TARGETS]
        for module, name, original in self._saved:
            key = (name, original)
            if key not in self._recorders:
                self._recorders[key] = self._recorder(name, original)
            setattr(module, name, self._recorders[key])
        return self

    def __exit__(self, *exc) -> None:
        for module, name, original in self._saved or []:
            setattr(module, name, original)
        self._saved = None

    def _recorder(self, name: str, original):
        kind, payload_name, payload_at, group_at = _SIGNATURES[name]

        def recorded(*args, **kwargs):
            if getattr(self._inside, "active", False):
                return original(*args, **kwargs)
            self._inside.active = True
            try:
                out = original(*args, **kwargs)
            finally:
                self._inside.active = False
            self._record(
                kind, _nbytes(_arg(args, kwargs, payload_name, payload_at)), _arg(args, kwargs, "group", group_at)
            )
            return out

        return recorded

    def _record(self, kind: str, payload: int, group) -> None:
        group = c10d._get_default_group() if group is None else group
        if c10d._rank_not_in_group(group):
            return  # the call issued nothing
        dim = self.dims.get(group, "other")
        sent = ring_bytes(kind, payload, group.size())
        self.bytes[dim] += sent
        self.count[dim] += 1
        if self.bandwidth and dim in self.bandwidth and sent:
            time.sleep(sent / self.bandwidth[dim])

    def take(self) -> dict:
        """This step's counters as record fields; resets them."""
        row = {**{f"bytes_{d}": self.bytes[d] for d in DIMS}, **{f"collectives_{d}": self.count[d] for d in DIMS}}
        if self.count["other"]:
            row.update(bytes_other=self.bytes["other"], collectives_other=self.count["other"])
        self.reset()
        return row


def all_ranks(values: list[float], device) -> torch.Tensor:
    """Every rank's values, one row per rank (a single small collective)."""
    mine = torch.tensor(values, dtype=torch.float64, device=device)
    out = torch.empty(dist.get_world_size() * len(values), dtype=torch.float64, device=device)
    (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(out, mine)
    return out.view(dist.get_world_size(), len(values))
