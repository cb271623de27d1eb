"""Decentralised aggregation across federation groups, shard by shard: FedAvg and outer optimisers.

Every A steps (a fixed period or a schedule, and always at the last step) each rank averages its
local parameter shards with the ranks holding the same shards in the other F-1 groups: an
all-reduce over the mesh's federation dimension. Equal weights; the inner optimiser's state stays
local. With an outer optimiser (DiLoCo's Nesterov SGD, FedAdam), the average is not taken as the new
model: the pseudo-gradient (the anchor, i.e. the weights of the last aggregation, minus the average)
is handed to torch's SGD or Adam over the anchor, and every group continues from the new anchor.
FedAvg is outer SGD with lr 1 and no momentum; it takes the average as it is (bit for bit, no anchor
kept). Anchor and outer state are flat fp32 tensors per bucket, on this rank only (its own shards).

FedAvg coordinates buckets (fldp/buckets.py: each bucket's flat tensor, reference, residual, anchor,
outer state and exchange in flight; saved by parameter name) over a transport (fldp/transport.py:
the group all-reduce, the quantised exchange, or torchft's Manager when elastic).

A `reduce_dtype` other than the parameters' reduces the change since the last aggregation (local
minus anchor, or minus a copy of the weights then: the reference), never the weights: rounding
them, or the anchor, at every aggregation would move a model no group changed.

The average is reduced in place: each bucket is one persistent flat tensor and FSDP2's local shards
are views of it, so an aggregation is one all-reduce per bucket and no copy (copying 9.6 MiB into a
bucket and back cost ~4.8 ms beside a 12.6 ms all-reduce on a 2-core CPU). A shard FSDP2 pads is
still copied into its bucket and back; a bucket whose `reduce_dtype` casts packs the change.

Averaging is only correct if shard k of parameter p is the same slice of the same tensor in every
group, so that is checked on construction, before anything is averaged (a silent average of
unrelated values would corrupt the model without an error).
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import hashlib
import re
from dataclasses import dataclass, field
from typing import cast

import torch
import torch.distributed as dist

from .buckets import Bucket, bucket_indices  # noqa: F401  (fldp.cost uses bucket_indices)
from .config import AlgorithmConfig, FedAvgSection, default_of, section_of
from .mesh import MeshShape
from .outer import OUTER_DEFAULTS, OuterConfig, OuterState  # noqa: F401  (OUTER_DEFAULTS: for its users)
from .quantize import codec_of
from .schedule import aggregation_steps, schedule_of
from .schema import check_values
from .streaming import Exchange, StreamingConfig
from .transport import transport_for

REDUCE_DTYPES = {None: None, "bf16": torch.bfloat16, "fp32": torch.float32}


class ShardMismatchError(RuntimeError):
    """Federation groups do not hold the same shards: averaging them would corrupt the model."""


def federated_mask(patterns, names: list[str]) -> list[bool]:
    """Which parameters are averaged (any full match); a pattern that matches no name is a config error."""
    for pattern in patterns:
        if not any(re.fullmatch(pattern, n) for n in names):
            raise ValueError(
                f"algorithm.federate: {pattern!r} matches no parameter name "
                f"(names look like {names[0]!r}, {names[-1]!r})"
            )
    return [any(re.fullmatch(p, n) for p in patterns) for n in names]


@dataclass(frozen=True)
class FedAvgConfig:
    every: object  # an integer A, or a schedule (see schedule_of)
    mode: str = default_of("algorithm.fedavg.mode")
    bucket_mb: float = default_of("algorithm.fedavg.bucket_mb")
    outer: OuterConfig = field(default_factory=OuterConfig)
    federate: tuple = tuple(
        default_of("algorithm.federate")
    )  # regular expressions over parameter names; the rest stays local
    streaming: StreamingConfig = field(default_factory=StreamingConfig)  # fragments aggregated apart
    # [[start, A], ...] from `every`, set on construction
    schedule: tuple = field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "schedule", schedule_of(self.every))  # an FL algorithm needs one
        check_values(
            {
                "algorithm.fedavg.mode": self.mode,
                "algorithm.fedavg.bucket_mb": self.bucket_mb,
                "algorithm.federate": list(self.federate),
            }
        )
        self.streaming.check_schedule(self.schedule)

    def exchange(self, step: int, last_step: int) -> Exchange:
        """What aggregates after `step`: the fragments whose all-reduce starts and those merged (one
        fragment, 0, is the whole model; without overlap, each is sent and merged at once)."""
        if self.streaming.exchanges:
            return self.streaming.exchange(step, self.schedule[0][1], last_step)
        due: tuple[int, ...]
        if self.streaming.fragments == 1:
            due = (0,) if self.due(step, last_step) else ()
        else:
            due = self.streaming.due(step, self.schedule[0][1], last_step)
        return Exchange(due, due)

    def due(self, step: int, last_step: int) -> bool:
        """Whether `step` aggregates (aggregation_steps; a binary search, as a run may have many)."""
        steps = aggregation_steps(self.schedule, last_step)
        i = bisect.bisect_left(steps, step)
        return i < len(steps) and steps[i] == step

    def federated(self, names: list[str]) -> list[bool]:
        """Which parameters are averaged (federated_mask)."""
        return federated_mask(self.federate, names)

    def bucket_keys(self) -> dict:
        """The keys that decide what each bucket (and fragment) holds, by name: a checkpoint records
        those its saved state depends on, and a resume must keep them (fldp.checkpoint.check_schedule)."""
        return {
            "algorithm.streaming.layout": self.streaming.layout,
            "algorithm.federate": list(self.federate),
            "algorithm.fedavg.bucket_mb": self.bucket_mb,
        }

    @classmethod
    def from_algorithm(cls, algorithm) -> FedAvgConfig | None:
        """None for the algorithms that aggregate nothing (`aggregation: null`: fsdp, hsdp).
        `algorithm`: the typed section (fldp.config.load), or a composed one."""
        alg = section_of(AlgorithmConfig, algorithm)
        if alg.aggregation is None:
            return None
        if alg.aggregation != "fedavg" or "federation" not in (alg.dims or []):
            raise ValueError(
                f"algorithm.aggregation={alg.aggregation!r}: must be null, or fedavg for an algorithm with a "
                f"federation dimension (algorithm.dims={list(alg.dims or [])})"
            )
        if alg.every is None:
            raise ValueError(
                "algorithm.aggregation=fedavg needs algorithm.every (an integer A >= 1, or a schedule "
                "[[0, A0], [step1, A1], ...]); it is null"
            )
        fedavg = alg.fedavg or FedAvgSection()
        return cls(
            every=alg.every,
            mode=fedavg.mode,
            bucket_mb=fedavg.bucket_mb,
            outer=alg.outer,
            federate=tuple(alg.federate or [".*"]),
            streaming=StreamingConfig.from_algorithm(alg),
        )


def fragment_fields(config: FedAvgConfig, due: Exchange) -> dict:
    """What an aggregation row says of the fragments (algorithm.streaming): those merged, and those
    whose all-reduce started (with overlap); nothing without streaming."""
    fields = {"fragments": list(due.merges)} if config.streaming.fragments > 1 or config.streaming.exchanges else {}
    if config.streaming.overlap:
        fields["fragments_sent"] = list(due.sends)
    return fields


def shard_signature(model) -> list[tuple]:
    """What must agree across groups for a shard-wise average to mean anything."""
    rows = []
    for name, p in model.named_parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        placements = tuple(str(x) for x in getattr(p, "placements", ()))
        rows.append((name, tuple(p.shape), str(p.dtype), tuple(local.shape), placements))
    return rows


class FedAvg:
    """Averages local parameter shards across the federation dimension of `mesh`, bucket by bucket,
    then (with an outer optimiser) steps each bucket's anchor with the pseudo-gradient."""

    def __init__(
        self, model, mesh, shape: MeshShape, config: FedAvgConfig, last_step: int, resident: bool = True, elastic=None
    ):
        """elastic: a fldp.elastic.Federation, when the groups are torchft replica groups (each its
        own world, `mesh` its own); the aggregation then runs over the groups alive.
        resident=False: copy, never hold FSDP2's shards: DCP's async_save stager fails on parameters
        that are views of a bucket ("copy_() on an invalid python storage", torch 2.13, measured)."""
        self.config, self.shape, self.last_step, self.model = config, shape, last_step, model
        self.participants = shape.federation  # the groups in the last aggregation
        named = list(model.named_parameters())
        self.named = [(n, p) for (n, p), keep in zip(named, config.federated([n for n, _ in named])) if keep]
        self.replicate = mesh["replicate"].get_group()
        # leader_broadcast: only replica 0 of each group joins the cross-group average (and the
        # outer step), then hands the result to its replicas.
        self.broadcast = config.mode == "leader_broadcast" and shape.replicate > 1
        self.leads = not self.broadcast or mesh["replicate"].get_local_rank() == 0
        # quantised: each group's change is taken in fp32 and crosses in 8 or 4 bits (fldp/quantize.py)
        self.quantizer = codec_of(config.outer)
        self.reduce_dtype = torch.float32 if self.quantizer else REDUCE_DTYPES[config.outer.reduce_dtype]
        self.transport = transport_for(self.quantizer, mesh, shape.federation, elastic)
        if elastic is None:  # elastic: a healing group's copy_ of its peer's shards checks their shapes
            check_aligned(model, mesh["federation"].get_group())
        self.buckets = make_buckets(self.named, config, self.reduce_dtype)
        self._buffers: dict = {}
        # elastic: never resident, since a healing group loads its peer's weights into the parameters
        # after the all-reduce and before the average is applied
        owners = _fsdp_params(model) if resident and elastic is None else {}
        for bucket in self.buckets:
            if not self._sends_change(bucket) and owners:
                bucket.adopt(owners)
        # (name, parameter, its local tensor) as built: the guard's view of every shard averaged
        self._sources = [(n, p, _local(p)) for n, p in self.named if _local(p).numel()]
        for bucket in self.buckets:
            self._keep(bucket)

    @torch.no_grad()
    def _keep(self, bucket: Bucket) -> None:
        """What the bucket keeps between aggregations: a casting or quantised bucket, the weights at
        the last aggregation (the same in every group, so the groups' mean change lands them all on
        the groups' average); with error feedback, what this rank's last quantisation lost; with an
        outer optimiser, on the leaders, the anchor and its state."""
        if self._sends_change(bucket):
            bucket.reference = bucket.weights()
            self.transport.share(bucket.reference)
        if self.config.outer.error_feedback and self.quantizer is not None:  # error feedback needs one
            bucket.residual = self.quantizer.residual(bucket.numel, self.shape.federation, bucket.shards[0].device)
        if self.leads and not self.config.outer.averages:
            start = bucket.reference if bucket.reference is not None else bucket.weights()
            bucket.outer = OuterState(self.config.outer, start)

    def _sends_change(self, bucket: Bucket) -> bool:
        """Whether the bucket's change since the last aggregation crosses, not its weights: a cast
        to reduce_dtype, or a quantised exchange."""
        return self.quantizer is not None or self.reduce_dtype not in (None, bucket.shards[0].dtype)

    @property
    def fragments(self) -> int:
        return self.config.streaming.fragments

    def due(self, step: int) -> Exchange:
        """What aggregates after `step` (falsy: nothing; without streaming, fragment 0, the whole
        model): on the schedule's steps, and every fragment at the last step, so all groups end identical."""
        return self.config.exchange(step, self.last_step)

    @property
    def in_flight(self) -> bool:
        """Whether an all-reduce started by exchange() awaits its merge (a checkpoint now would lose it)."""
        return any(bucket.flying is not None for bucket in self.buckets)

    def exchange(self, due: Exchange) -> bool:
        """Run what `due` says; returns whether it was applied (see __call__)."""
        if due.in_place:
            return self(fragments=due.merges)
        self._send(due.sends)
        self._merge(due.merges, due.alpha)
        return True

    def _chosen(self, fragments) -> list[int]:
        """The indices of these fragments' buckets (None: every bucket)."""
        return [i for i, b in enumerate(self.buckets) if fragments is None or b.fragment in fragments]

    def _start(self, bucket: Bucket, flat: torch.Tensor, feedback: bool):
        """Start the groups' mean of `flat` (None on a replica the leader hands the result to); only
        a training aggregation (`feedback`) moves the error-feedback residual."""
        return self.transport.mean(flat, bucket.residual if feedback else None) if self.leads else None

    @torch.no_grad()
    def __call__(self, outer_step: bool = True, fragments: tuple[int, ...] | None = None) -> bool:
        """Reduce each bucket's flat tensor in place, every bucket's all-reduce in flight at once,
        then finish them in order (10 buckets on the 2-core CPU: median 1.16x one flat all-reduce
        of the same bytes, 1.22x with two in flight). A bucket packed into a reusable buffer first
        waits for the bucket that last used it, so nothing is allocated per aggregation.
        outer_step=False: the plain average, whatever the outer optimiser (an evaluation of it).
        fragments: only these fragments' buckets (algorithm.streaming); None: every bucket.
        Returns whether the aggregation was applied (always, unless elastic and a group failed in it)."""
        check_live(self.model, self._sources, self.buckets)
        chosen = self._chosen(fragments)
        self.participants = self.transport.begin()
        if self.transport.deferred:
            return self._deferred(chosen, outer_step)
        pending: collections.deque[tuple[int, Bucket, torch.Tensor, object]] = collections.deque()
        for i in chosen:
            bucket = self.buckets[i]
            flat = bucket.flat
            if flat is None:
                while pending and pending[0][0] <= i - 2:  # bucket i - 2 packed into this buffer
                    self._finish(*pending.popleft()[1:], outer_step)
                flat = self._buffer(bucket, i % 2)
            bucket.pack(flat)
            pending.append((i, bucket, flat, self._start(bucket, flat, outer_step)))
        while pending:
            self._finish(*pending.popleft()[1:], outer_step)
        return True

    def _deferred(self, chosen: list[int], outer_step: bool) -> bool:
        """Elastic: every bucket's mean over the participants, then, only if every group commits, the
        same outer step and unpacking as a static federation's. A group that failed during it leaves
        every other group with its own weights until the next aggregation."""
        pending = []
        for i in chosen:  # never resident (see __init__): every shard is copied out
            flat = self.buckets[i].copy_out()
            pending.append((self.buckets[i], flat, self._start(self.buckets[i], flat, outer_step)))
        for *_, work in pending:
            if work is not None:
                work.wait()
        if not self.transport.commit():
            return False
        for bucket, flat, work in pending:
            self._apply(bucket, flat, work is not None, outer_step)
        return True

    @torch.no_grad()
    def _send(self, fragments: tuple[int, ...]) -> None:
        """Start the all-reduce of each of these fragments' buckets on a copy (the groups train on
        while it is in flight), of the weights or, casting, of their change."""
        check_live(self.model, self._sources, self.buckets)
        for i in self._chosen(fragments):
            bucket = self.buckets[i]
            flat = bucket.copy_out()
            bucket.flying = (flat, self._start(bucket, flat, True))

    @torch.no_grad()
    def _merge(self, fragments: tuple[int, ...], alpha: float) -> None:
        """Finish these fragments' all-reduces: the outer step, the new global weights into every
        shard, then lerp(global, local, alpha) with the weights the group holds now."""
        for i in self._chosen(fragments):
            bucket = self.buckets[i]
            (flat, work), bucket.flying = cast(tuple, bucket.flying), None  # sent at an earlier step
            local = bucket.weights() if alpha else None
            self._finish(bucket, flat, work, True, every_shard=True)
            if local is not None:
                bucket.lerp(local, alpha)

    def _buffer(self, bucket: Bucket, parity: int) -> torch.Tensor:
        """A reusable flat tensor for a bucket that is not resident (two: packing one overlaps the
        reduction of the other)."""
        key = (bucket.dtype, parity)
        if key not in self._buffers or self._buffers[key].numel() < bucket.numel:
            self._buffers[key] = torch.empty(bucket.numel, dtype=bucket.dtype, device=bucket.shards[0].device)
        return self._buffers[key][: bucket.numel]

    def _finish(self, bucket: Bucket, flat, work, outer_step: bool, every_shard: bool = False) -> None:
        if work is not None:
            work.wait()
        self._apply(bucket, flat, work is not None, outer_step, every_shard)

    def _apply(self, bucket: Bucket, flat, reduced: bool, outer_step: bool, every_shard: bool = False) -> None:
        """The bucket's new weights from the groups' mean (`reduced`; else a replica's tensor), handed
        to the replicas, then unpacked (into every shard if `flat` is a copy, else those not resident)."""
        flat = bucket.result(flat, reduced, outer_step)
        if self.broadcast:
            dist.broadcast(flat, group=self.replicate, group_src=0)
        bucket.unpack(flat, every_shard)

    @contextlib.contextmanager
    @torch.no_grad()
    def averaged(self):
        """Within the block, this rank holds the groups' plain average (for an evaluation); after it,
        its own shards again, bit for bit: the training state (outer state too) does not change."""
        shards = [t for bucket in self.buckets for t in bucket.shards]
        saved = [t.clone() for t in shards]
        self(outer_step=False)
        try:
            yield
        finally:
            for t, value in zip(shards, saved):
                t.copy_(value)

    # the state, for checkpoints (fldp.checkpoint saves registered stateful components)
    def state_dict(self) -> dict:
        """{parameter name: {kind: this rank's shard of it}} (Bucket.state_dict); {} if nothing is kept."""
        return {name: kinds for bucket in self.buckets for name, kinds in bucket.state_dict().items()}

    def load_state_dict(self, state: dict) -> None:
        for bucket in self.buckets:
            bucket.load_state_dict(state)


def saved_with(fedavg: FedAvg) -> dict:
    """What a checkpoint of FedAvg's state records of the config (meta.json), the keys a resume must
    keep: algorithm.federate, which parameters were averaged; with fragments, their layout (either
    would make the run neither the saved configuration nor the new one); and, quantised,
    algorithm.fedavg.bucket_mb, whose buckets are what is quantised. The state itself is saved by
    parameter, so another bucket_mb re-assembles it exactly where nothing is quantised."""
    keys = fedavg.config.bucket_keys()
    if fedavg.fragments == 1:
        del keys["algorithm.streaming.layout"]
    if fedavg.quantizer is None:
        del keys["algorithm.fedavg.bucket_mb"]
    return keys


def make_buckets(named: list[tuple[str, object]], config: FedAvgConfig, dtype) -> list[Bucket]:
    """The federated parameters' local shards (`named`) in buckets of one fragment each (fragment 0's
    first), in parameter order within it, of at most algorithm.fedavg.bucket_mb, reduced in `dtype`."""
    fragment = config.streaming.fragment_of([n for n, _ in named])
    buckets = []
    for f in range(config.streaming.fragments):
        # FSDP2 can leave a rank an empty shard of a small parameter: nothing to send
        mine = [(n, _local(p)) for (n, p), g in zip(named, fragment) if g == f and _local(p).numel()]
        sizes = [(t.numel() * t.element_size(), t.dtype) for _, t in mine]
        for group in bucket_indices(sizes, int(config.bucket_mb * 2**20)):
            names, shards = zip(*(mine[i] for i in group))
            buckets.append(Bucket(names, shards, f, dtype))
    return buckets


def check_live(model, sources: list[tuple], buckets: list[Bucket]) -> None:
    """Whatever replaces a parameter or its local shard after FedAvg was built (nn.Module._apply,
    load_state_dict(assign=True), FSDP2 re-padding it) leaves the buckets, resident or copied,
    reading and writing tensors the model no longer uses: fail loudly rather than silently stop
    federating. sources: (name, parameter, its local tensor) as FedAvg was built."""
    live = dict(model.named_parameters())
    stale = any(live.get(name) is not p or _local(p) is not local for name, p, local in sources)
    if stale or any(bucket.stale() for bucket in buckets):
        raise RuntimeError(
            "FedAvg: a parameter's local shard was replaced after FedAvg was built "
            "(model.to(), load_state_dict(assign=True), ...); build FedAvg after it"
        )


def _local(p) -> torch.Tensor:
    """The DTensor's own local tensor: to_local() of a Parameter returns a fresh view of it."""
    from torch.distributed.tensor import DTensor  # here: its import (~1 s) was most of fldp-plan's start-up

    return p._local_tensor if isinstance(p, DTensor) else p


def _fsdp_params(model) -> dict[int, object]:
    """id(local shard tensor) -> FSDP2's FSDPParam owning it, for the shards FedAvg can hold in its
    buckets: unpadded (the local tensor is all of _sharded_param_data), not offloaded. FSDP2's
    private state: if this torch lacks it, nothing is resident and FedAvg copies, as before."""
    owners = {}
    try:
        for module in model.modules():
            if not hasattr(module, "_get_fsdp_state"):
                continue
            group = module._get_fsdp_state()._fsdp_param_group
            for owner in group.fsdp_params if group is not None else ():
                local, data = owner.sharded_param._local_tensor, owner._sharded_param_data
                if (
                    type(local) is torch.Tensor
                    and type(data) is torch.Tensor
                    and local.is_contiguous()
                    and not owner.offload_to_cpu
                    and local.numel() == data.numel() > 0
                    and local.data_ptr() == data.data_ptr()
                ):
                    owners[id(local)] = owner
    except AttributeError:
        return {}
    return owners


def check_aligned(model, federation_group) -> None:
    """Compare every rank's shard signature with its peers in the other federation groups."""
    mine = shard_signature(model)
    digest = hashlib.sha256(repr(mine).encode()).hexdigest()
    peers: list = [None] * dist.get_world_size(federation_group)
    dist.all_gather_object(peers, (digest, mine), group=federation_group)
    for group_index, (peer_digest, theirs) in enumerate(peers):
        if peer_digest == digest:
            continue
        first = next(
            ((a, b) for a, b in zip(mine, theirs) if a != b),
            (f"{len(mine)} parameters", f"{len(theirs)} parameters"),
        )
        raise ShardMismatchError(
            f"federation group {group_index} does not hold the same parameter shards as this "
            f"rank's group (rank {dist.get_rank()}): first difference: here {first[0]} vs "
            f"there {first[1]} [name, global shape, dtype, local shape, placements]. Every group "
            f"must use the same model and sharding policy, or FedAvg would average unrelated values."
        )
