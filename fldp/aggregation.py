"""Decentralised aggregation across federation groups, shard by shard: FedAvg and outer optimisers.

Every A steps (a fixed period or a schedule, and always at the last step) each rank averages its
local parameter shards with the ranks holding the same shards in the other F-1 groups: an
all-reduce over the mesh's federation dimension. Equal weights; the inner optimiser's state stays
local. With an outer optimiser (DiLoCo's Nesterov SGD, FedAdam), the average is not taken as the new
model: the pseudo-gradient (the anchor, i.e. the weights of the last aggregation, minus the average)
is handed to torch's SGD or Adam over the anchor, and every group continues from the new anchor.
FedAvg is outer SGD with lr 1 and no momentum; it takes the average as it is (bit for bit, no anchor
kept). Anchor and outer state are flat fp32 tensors per bucket, on this rank only (its own shards).

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

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from .mesh import ConfigError, MeshShape
from .quantize import Quantizer, all_reduce_mean, residual_for
from .schedule import aggregation_steps, schedule_of
from .schema import check_values
from .streaming import Exchange, StreamingConfig

# What algorithm.outer's null lr / eps mean, per optimiser. sgd: lr 1 (with momentum 0: FedAvg).
# adam: FedAdam's server lr and tau (= eps) of Reddi et al. 2021, 1e-3 each, with torch's bias
# correction (their Algorithm 2 has none): the first step is about lr * sign(delta), so the shared
# lr 1 would move every weight by ~1 (init std 0.02). sgd's eps is unused.
OUTER_DEFAULTS = {"sgd": {"lr": 1.0, "eps": 1e-8}, "adam": {"lr": 1e-3, "eps": 1e-3}}
REDUCE_DTYPES = {None: None, "bf16": torch.bfloat16, "fp32": torch.float32}


class ShardMismatchError(RuntimeError):
    """Federation groups do not hold the same shards: averaging them would corrupt the model."""


@dataclass(frozen=True)
class OuterConfig:
    """The outer optimiser on the pseudo-gradient (algorithm.outer)."""

    name: str = "sgd"
    lr: float | None = None  # None: OUTER_DEFAULTS[name]
    momentum: float = 0.0
    nesterov: bool = False
    betas: tuple = (0.9, 0.99)
    eps: float | None = None  # None: OUTER_DEFAULTS[name]
    reduce_dtype: str | None = None  # None: the parameters' dtype (the authors' bf16 all-reduce)
    quantize: str | None = None  # fldp/quantize.py: int8, fp8, int4; None: not quantised
    quantize_block: int = 256
    error_feedback: bool = False

    def __post_init__(self):
        check_values({f"algorithm.outer.{k}": getattr(self, k) for k in self.__dataclass_fields__})
        Quantizer.of(self)  # its own checks
        if self.quantize and self.reduce_dtype is not None:
            raise ConfigError(
                f"algorithm.outer.reduce_dtype={self.reduce_dtype} with algorithm.outer.quantize="
                f"{self.quantize}: the quantised exchange sums in fp32; set reduce_dtype to null"
            )
        if self.error_feedback and not self.quantize:
            raise ConfigError(
                "algorithm.outer.error_feedback=true: needs algorithm.outer.quantize (int8, fp8 "
                "or int4); without it nothing is lost to feed back"
            )
        for key, value in OUTER_DEFAULTS[self.name].items():
            if getattr(self, key) is None:
                object.__setattr__(self, key, value)
        if self.nesterov and not self.momentum:
            raise ConfigError(
                f"algorithm.outer.nesterov=True: needs algorithm.outer.momentum > 0, not {self.momentum!r}"
            )

    @property
    def averages(self) -> bool:
        """Plain FedAvg: the new model is the groups' average itself."""
        return self.name == "sgd" and self.lr == 1 and self.momentum == 0


def federated_mask(patterns, names: list[str]) -> list[bool]:
    """Which parameters are averaged (any full match); a pattern that matches no name is a config error."""
    for pattern in patterns:
        if not any(re.fullmatch(pattern, n) for n in names):
            raise ConfigError(
                f"algorithm.federate: {pattern!r} matches no parameter name "
                f"(names look like {names[0]!r}, {names[-1]!r})"
            )
    return [any(re.fullmatch(p, n) for p in patterns) for n in names]


@dataclass(frozen=True)
class FedAvgConfig:
    every: object  # an integer A, or a schedule (see schedule_of)
    mode: str = "leader_broadcast"
    bucket_mb: float = 25.0
    outer: OuterConfig = field(default_factory=OuterConfig)
    federate: tuple = (".*",)  # regular expressions over parameter names; the rest stays local
    streaming: StreamingConfig = field(default_factory=StreamingConfig)  # fragments aggregated apart

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
    def from_algorithm(cls, algorithm_cfg) -> FedAvgConfig | None:
        """None for the algorithms that aggregate nothing (`aggregation: null`: fsdp, hsdp)."""
        kind = algorithm_cfg.get("aggregation")
        if kind is None:
            return None
        if kind != "fedavg" or "federation" not in (algorithm_cfg.get("dims") or []):
            raise ConfigError(
                f"algorithm.aggregation={kind!r}: must be null, or fedavg for an algorithm with a "
                f"federation dimension (algorithm.dims={list(algorithm_cfg.get('dims') or [])})"
            )
        from omegaconf import OmegaConf

        fedavg = algorithm_cfg.get("fedavg") or {}
        outer = OmegaConf.to_container(algorithm_cfg.outer, resolve=True) if algorithm_cfg.get("outer") else {}
        if "betas" in outer:
            outer["betas"] = tuple(outer["betas"]) if isinstance(outer["betas"], (list, tuple)) else outer["betas"]
        every = algorithm_cfg.every
        every = OmegaConf.to_container(every) if OmegaConf.is_config(every) else every
        if every is None:
            raise ConfigError(
                "algorithm.aggregation=fedavg needs algorithm.every (an integer A >= 1, or a schedule "
                "[[0, A0], [step1, A1], ...]); it is null"
            )
        federate = algorithm_cfg.get("federate") or [".*"]
        federate = tuple(OmegaConf.to_container(federate) if OmegaConf.is_config(federate) else federate)
        return cls(
            every=every,
            mode=fedavg.get("mode", "leader_broadcast"),
            bucket_mb=fedavg.get("bucket_mb", 25.0),
            outer=OuterConfig(**outer),
            federate=federate,
            streaming=StreamingConfig.from_algorithm(algorithm_cfg),
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
    """Averages local parameter shards across the federation dimension of `mesh`, then (with an
    outer optimiser) steps the anchor with the pseudo-gradient."""

    def __init__(
        self, model, mesh, shape: MeshShape, config: FedAvgConfig, last_step: int, resident: bool = True, elastic=None
    ):
        """elastic: a fldp.elastic.Federation, when the groups are torchft replica groups (each its
        own world, `mesh` its own); the aggregation then runs over the groups alive."""
        self.config, self.shape, self.last_step, self.model = config, shape, last_step, model
        self.elastic = elastic
        self.participants = shape.federation  # the groups in the last aggregation
        named = list(model.named_parameters())
        self.named = [(n, p) for (n, p), keep in zip(named, config.federated([n for n, _ in named])) if keep]
        self.params = [p for _, p in self.named]
        self.federation = mesh["federation"].get_group() if elastic is None else None
        self.replicate = mesh["replicate"].get_group()
        self.replica_index = mesh["replicate"].get_local_rank()
        # leader_broadcast: only replica 0 of each group joins the cross-group average (and the
        # outer step), then hands the result to its replicas.
        self.broadcast = config.mode == "leader_broadcast" and shape.replicate > 1
        self.leads = not self.broadcast or self.replica_index == 0
        # quantised: each group's change is taken in fp32 and crosses in 8 or 4 bits (fldp/quantize.py)
        self.quantizer = Quantizer.of(config.outer)
        self.reduce_dtype = torch.float32 if self.quantizer else REDUCE_DTYPES[config.outer.reduce_dtype]
        self.buckets, self.bucket_fragment = self._buckets(int(config.bucket_mb * 2**20))
        self._buffers: dict = {}
        self._flying: dict[int, tuple] = {}  # bucket -> (its shards, the copy being reduced, the work)
        if elastic is None:  # elastic: a healing group's copy_ of its peer's shards checks their shapes
            check_aligned(model, self.federation)
        # per bucket: its persistent flat tensor (None: packed into a reusable buffer each time),
        # the indices of its shards that are copied into it and back, and what the guard checks
        self.resident: list[torch.Tensor | None] = []
        self._copied: list[list[int]] = []
        self._hosted: list[tuple] = []
        # resident=False: copy as before. DCP's async_save stager fails on the parameters once they
        # are views of a bucket ("copy_() on an invalid python storage", torch 2.13, measured)
        # elastic: never resident, since a healing group loads its peer's weights into the parameters
        # after the all-reduce and before the average is applied
        owners = _fsdp_params(model) if resident and elastic is None else {}
        for bucket in self.buckets:
            self.resident.append(self._adopt(bucket, owners))
        # (name, parameter, its local tensor) as built: the guard's view of every shard averaged
        self._sources = [(n, p, _local(p)) for n, p in self.named if _local(p).numel()]
        # per casting bucket: the weights at the last aggregation, in the parameters' dtype; the same
        # in every group, so the groups' mean change lands them all on the groups' average
        self.reference = [self._reference(b) if self._sends_change(b) else None for b in self.buckets]
        # error feedback: per bucket, what this rank's last quantisation lost (fp32, padded)
        self.residuals = (
            [
                residual_for(sum(t.numel() for t in b), shape.federation, self.quantizer, b[0].device)
                for b in self.buckets
            ]
            if config.outer.error_feedback
            else None
        )
        self.outer = (
            Outer(
                config.outer,
                [
                    ref if ref is not None else torch.cat([t.reshape(-1) for t in b])
                    for ref, b in zip(self.reference, self.buckets)
                ],
            )
            if self.leads and not config.outer.averages
            else None
        )

    def due(self, step: int) -> Exchange:
        """What aggregates after `step` (falsy: nothing; without streaming, fragment 0, the whole
        model): on the schedule's steps, and every fragment at the last step, so all groups end identical."""
        return self.config.exchange(step, self.last_step)

    @property
    def in_flight(self) -> bool:
        """Whether an all-reduce started by exchange() awaits its merge (a checkpoint now would lose it)."""
        return bool(self._flying)

    def exchange(self, due: Exchange) -> bool:
        """Run what `due` says; returns whether it was applied (see __call__)."""
        if due.in_place:
            return self(fragments=due.merges)
        self._send(due.sends)
        self._merge(due.merges, due.alpha)
        return True

    def _chosen(self, fragments) -> list[int]:
        """The buckets of these fragments (None: every bucket)."""
        return [i for i, f in enumerate(self.bucket_fragment) if fragments is None or f in fragments]

    @torch.no_grad()
    def _send(self, fragments: tuple[int, ...]) -> None:
        """Start the all-reduce of each of these fragments' buckets on a copy (the groups train on
        while it is in flight), of the weights or, casting, of their change."""
        self._check_live()
        for i in self._chosen(fragments):
            flat = self._copy_out(i)
            self._flying[i] = (self.buckets[i], flat, self._start_mean(i, flat) if self.leads else None)

    def _copy_out(self, index: int) -> torch.Tensor:
        """A new flat tensor of bucket `index`, in the reduce dtype: every shard's weights, or,
        casting, their change since the base (what the all-reduce averages)."""
        bucket = self.buckets[index]
        flat = torch.empty(
            sum(t.numel() for t in bucket), dtype=self.reduce_dtype or bucket[0].dtype, device=bucket[0].device
        )
        if self.reference[index] is None:
            _pack(bucket, flat, range(len(bucket)))
        else:
            _pack_change(bucket, self._base(index), flat)
        return flat

    @torch.no_grad()
    def _merge(self, fragments: tuple[int, ...], alpha: float) -> None:
        """Finish these fragments' all-reduces: the outer step, the new global weights into every
        shard, then lerp(global, local, alpha) with the weights the group holds now."""
        for i in self._chosen(fragments):
            bucket, flat, work = self._flying.pop(i)
            local = torch.cat([t.reshape(-1) for t in bucket]) if alpha else None
            self._finish(i, bucket, flat, work, True, every_shard=True)
            if alpha:
                for t, mine in _slots(bucket, local, range(len(bucket))):
                    t.lerp_(mine.view_as(t), alpha)

    @property
    def fragments(self) -> int:
        return self.config.streaming.fragments

    def _buckets(self, bucket_bytes: int) -> tuple[list[list[torch.Tensor]], list[int]]:
        """Buckets of one fragment each (fragment 0's first), in parameter order within it, and
        each bucket's fragment."""
        fragment = self.config.streaming.fragment_of([n for n, _ in self.named])
        buckets, fragment_of_bucket = [], []
        for f in range(self.fragments):
            # FSDP2 can leave a rank an empty shard of a small parameter: nothing to send
            locals_ = [_local(p) for p, g in zip(self.params, fragment) if g == f and _local(p).numel()]
            groups = bucket_indices([(t.numel() * t.element_size(), t.dtype) for t in locals_], bucket_bytes)
            buckets += [[locals_[i] for i in group] for group in groups]
            fragment_of_bucket += [f] * len(groups)
        return buckets, fragment_of_bucket

    @torch.no_grad()
    def _adopt(self, bucket: list[torch.Tensor], owners: dict) -> torch.Tensor | None:
        """Make the bucket one flat tensor that FSDP2's shards are views of (their values copied in
        once); None if none can be (a cast to reduce_dtype, no FSDP2 shard, resident=False), and the bucket is
        then packed per aggregation as before. The bucket's layout is the packed one, so the
        all-reduce sums the same bytes in the same order: the same bits."""
        if self._sends_change(bucket) or not owners:  # no FSDP2 shard to host (resident=False)
            self._copied.append(list(range(len(bucket))))
            self._hosted.append(())
            return None
        flat = torch.empty(sum(t.numel() for t in bucket), dtype=bucket[0].dtype, device=bucket[0].device)
        copied, hosted, offset = [], [], 0
        for j, t in enumerate(bucket):
            slot = flat[offset : offset + t.numel()]
            offset += t.numel()
            slot.copy_(t.reshape(-1))
            owner = owners.get(id(t))
            if owner is None:
                copied.append(j)
                continue
            # FSDP2 all-gathers from _sharded_param_data and the optimiser steps the DTensor's local
            # tensor: both become views of the slot (FSDP2's own reset_sharded_param swaps them
            # alike), and the old storage is freed. Tensor.set_ would keep it alive through _base.
            local = slot.view(t.shape)
            owner.sharded_param._local_tensor = local
            owner._sharded_param_data = slot
            bucket[j] = local
            hosted.append((owner, local, slot.data_ptr()))
        if not hosted:  # nothing resident: a persistent copy of the bucket would only cost memory
            self._copied.append(copied)
            self._hosted.append(())
            return None
        self._copied.append(copied)
        self._hosted.append(tuple(hosted))
        return flat

    @torch.no_grad()
    def _reference(self, bucket: list[torch.Tensor]) -> torch.Tensor:
        """The bucket's weights, group 0's in every group (they start alike; where not, the first
        aggregation still gives the groups' average). Elastic: this group's own (alike: fldp.init)."""
        ref = torch.cat([t.reshape(-1) for t in bucket])
        if self.elastic is None:
            dist.broadcast(ref, group=self.federation, group_src=0)
        return ref

    def _check_live(self) -> None:
        """Whatever replaces a parameter or its local shard after FedAvg was built (nn.Module._apply,
        load_state_dict(assign=True), FSDP2 re-padding it) leaves the buckets, resident or copied,
        reading and writing tensors the model no longer uses: fail loudly rather than silently stop
        federating."""
        live = dict(self.model.named_parameters())
        stale = any(live.get(name) is not p or _local(p) is not local for name, p, local in self._sources)
        for hosted in self._hosted:
            for owner, local, ptr in hosted:
                stale |= not (
                    owner.sharded_param._local_tensor is local
                    and local.data_ptr() == ptr
                    and owner._sharded_param_data.data_ptr() == ptr
                )
        if stale:
            raise RuntimeError(
                "FedAvg: a parameter's local shard was replaced after FedAvg was built "
                "(model.to(), load_state_dict(assign=True), ...); build FedAvg after it"
            )

    @torch.no_grad()
    def __call__(self, outer_step: bool = True, fragments: tuple[int, ...] | None = None) -> None:
        """Reduce each bucket's flat tensor in place, every bucket's all-reduce in flight at once,
        then finish them in order (10 buckets on the 2-core CPU: median 1.16x one flat all-reduce
        of the same bytes, 1.22x with two in flight). A bucket packed into a reusable buffer (a
        cast to reduce_dtype) first waits for the bucket that last used that buffer, so its packing
        overlaps the reduction of the one before, and nothing is allocated per aggregation.
        outer_step=False: the plain average, whatever the outer optimiser (an evaluation of it).
        fragments: only these fragments' buckets (algorithm.streaming); None: every bucket.
        Returns whether the aggregation was applied (always, unless elastic and a group failed in it)."""
        self._check_live()
        chosen = self._chosen(fragments)
        if self.elastic is not None:
            return self._elastic(outer_step, chosen)
        pending: collections.deque = collections.deque()
        for i in chosen:
            bucket = self.buckets[i]
            flat = self.resident[i]
            if flat is None:
                while pending and pending[0][0] <= i - 2:  # bucket i - 2 packed into this buffer
                    self._finish(*pending.popleft(), outer_step)
                flat = self._buffer(bucket, i % 2)
            if self.reference[i] is None:
                _pack(bucket, flat, self._copied[i])
            else:
                _pack_change(bucket, self._base(i), flat)
            pending.append((i, bucket, flat, self._start_mean(i, flat, feedback=outer_step) if self.leads else None))
        while pending:
            self._finish(*pending.popleft(), outer_step)
        return True

    def _elastic(self, outer_step: bool, chosen: list[int]) -> bool:
        """The aggregation over the groups alive: the quorum (a restarted group heals in it), every
        bucket's mean over the participants, then, only if every group commits, the same outer step
        and unpacking as a static federation's. A group that failed during it leaves every other
        group with its own weights until the next aggregation."""
        self.participants = self.elastic.quorum()
        pending = []
        for i in chosen:  # never resident (see __init__): every shard is copied out
            flat = self._copy_out(i)
            pending.append((i, self.buckets[i], flat, self.elastic.all_reduce_mean(flat) if self.leads else None))
        for *_, work in pending:
            if work is not None:
                work.wait()
        if not self.elastic.commit():  # after the heal's load: the anchor and reference are the peer's
            return False
        for i, bucket, flat, _ in pending:
            self._apply(i, bucket, flat, self.leads, outer_step)
        return True

    def _buffer(self, bucket, parity: int) -> torch.Tensor:
        numel = sum(t.numel() for t in bucket)
        dtype = self.reduce_dtype or bucket[0].dtype
        key = (dtype, parity)
        if key not in self._buffers or self._buffers[key].numel() < numel:
            self._buffers[key] = torch.empty(numel, dtype=dtype, device=bucket[0].device)
        return self._buffers[key][:numel]

    def _sends_change(self, bucket: list[torch.Tensor]) -> bool:
        """Whether the bucket's change since the last aggregation is reduced, not its weights: a cast
        to reduce_dtype, or a quantised exchange."""
        return self.quantizer is not None or self.reduce_dtype not in (None, bucket[0].dtype)

    def _start_mean(self, index: int, flat: torch.Tensor, feedback: bool = True):
        """Start the groups' mean of `flat`, in place: its handle's wait() leaves the mean there.
        Quantised, it is done at once (two dependent collectives), and only a training aggregation
        (`feedback`) moves the error-feedback residual."""
        if self.quantizer is None:
            return _Divided(dist.all_reduce(flat, group=self.federation, async_op=True), flat, self.shape.federation)
        residual = self.residuals[index] if self.residuals is not None and feedback else None
        all_reduce_mean(flat, self.quantizer, self.federation, residual)
        return _Divided(None, flat, 1)

    def _base(self, index: int) -> torch.Tensor:
        """What a casting bucket's change is taken from: the anchor, or the reference."""
        return self.outer.anchors[index] if self.outer is not None else self.reference[index]

    def _finish(self, index, bucket, flat, work, outer_step: bool, every_shard: bool = False) -> None:
        if work is not None:
            work.wait()
        self._apply(index, bucket, flat, work is not None, outer_step, every_shard)

    def _apply(self, index, bucket, flat, reduced: bool, outer_step: bool, every_shard: bool = False) -> None:
        """`flat` holds the groups' mean (`reduced`), or nothing yet (a replica the leader hands the
        new weights to): the outer step, the broadcast to the replicas, the unpacking (into every
        shard if `flat` is a copy, else into those not resident in it)."""
        ref = self.reference[index]
        if reduced:
            if ref is not None:  # flat: the groups' mean change; the new weights into ref
                if not outer_step:
                    flat = (self._base(index) + flat).to(ref.dtype)  # the average; ref kept
                elif self.outer is not None:
                    flat = ref.copy_(self.outer.step(index, -flat.float()))  # anchor - average
                else:
                    flat = ref.add_(flat)
            elif self.outer is not None and outer_step:
                flat.copy_(self.outer.step(index, self.outer.anchors[index] - flat.float()))
        elif ref is not None:  # a replica the leader hands the new weights to
            flat = ref if outer_step else torch.empty_like(ref)
        if self.broadcast:
            dist.broadcast(flat, group=self.replicate, group_src=0)
        _unpack(bucket, flat, range(len(bucket)) if every_shard else self._copied[index])

    @contextlib.contextmanager
    @torch.no_grad()
    def averaged(self):
        """Within the block, this rank holds the groups' plain average (for an evaluation); after it,
        its own shards again, bit for bit: the training state (outer state too) does not change."""
        shards = [t for bucket in self.buckets for t in bucket]
        saved = [t.clone() for t in shards]
        self(outer_step=False)
        try:
            yield
        finally:
            for t, value in zip(shards, saved):
                t.copy_(value)

    # the outer state, for checkpoints (fldp.checkpoint saves registered stateful components)
    def state_dict(self) -> dict:
        refs = {f"reference_{i}": ref for i, ref in enumerate(self.reference) if ref is not None}
        residuals = {f"residual_{i}": r for i, r in enumerate(self.residuals or ())}
        return {**(self.outer.state_dict() if self.outer is not None else {}), **refs, **residuals}

    def load_state_dict(self, state: dict) -> None:
        if self.outer is not None:
            self.outer.load_state_dict(state)
        for i, ref in enumerate(self.reference):
            if ref is not None:
                ref.copy_(state[f"reference_{i}"])
        for i, residual in enumerate(self.residuals or ()):
            residual.copy_(state[f"residual_{i}"])


def saved_with(fedavg: FedAvg) -> dict:
    """What a checkpoint of FedAvg's state records of the config (meta.json): algorithm.federate,
    which parameters were averaged; with fragments, their layout; and algorithm.fedavg.bucket_mb
    where state is kept per bucket (anchor, outer state, reference, residual: another size regroups it)."""
    keys = fedavg.config.bucket_keys()
    if fedavg.fragments == 1:
        del keys["algorithm.streaming.layout"]
    if not fedavg.state_dict():
        del keys["algorithm.fedavg.bucket_mb"]
    return keys


class _Divided:
    """An all-reduce's handle whose wait() leaves the mean: gloo has no AVG, so sum, then divide
    (identical bits on every rank of the group)."""

    def __init__(self, work, flat: torch.Tensor, groups: int):
        self.work, self.flat, self.groups = work, flat, groups

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()
        if self.groups != 1:
            self.flat.div_(self.groups)


class Outer:
    """torch's SGD or Adam over the anchor: one flat fp32 tensor per FedAvg bucket, holding this
    rank's shards of the weights at the last aggregation. The pseudo-gradient is anchor - average;
    after the step the anchor is the new model for every group."""

    def __init__(self, config: OuterConfig, starts: list[torch.Tensor]):
        """starts: each bucket's weights, flat."""
        self.anchors = [start.detach().to(torch.float32, copy=True) for start in starts]
        if config.name == "sgd":
            make = lambda a: torch.optim.SGD(
                [a],
                lr=config.lr,
                momentum=config.momentum,  # noqa: E731
                nesterov=config.nesterov,
            )
        else:
            make = lambda a: torch.optim.Adam([a], lr=config.lr, betas=tuple(map(float, config.betas)), eps=config.eps)  # noqa: E731
        self.optimizers = [make(a) for a in self.anchors]
        for anchor, optimizer in zip(self.anchors, self.optimizers):
            # the state torch would create at the first step, made now so a checkpoint can load into
            # it (same values: a zero momentum buffer times momentum plus the gradient is the gradient)
            if config.name == "sgd" and config.momentum:
                optimizer.state[anchor]["momentum_buffer"] = torch.zeros_like(anchor)
            elif config.name == "adam":
                optimizer.state[anchor].update(
                    step=torch.tensor(0.0), exp_avg=torch.zeros_like(anchor), exp_avg_sq=torch.zeros_like(anchor)
                )

    def step(self, index: int, pseudo_gradient: torch.Tensor) -> torch.Tensor:
        """Step anchor `index` with the pseudo-gradient (anchor - average, fp32); returns it."""
        anchor = self.anchors[index]
        anchor.grad = pseudo_gradient
        self.optimizers[index].step()
        anchor.grad = None
        return anchor

    def state_dict(self) -> dict:
        out = {}
        for i, (anchor, optimizer) in enumerate(zip(self.anchors, self.optimizers)):
            out[f"anchor_{i}"] = anchor
            out.update({f"{key}_{i}": value for key, value in optimizer.state[anchor].items()})
        return out

    def load_state_dict(self, state: dict) -> None:
        for i, (anchor, optimizer) in enumerate(zip(self.anchors, self.optimizers)):
            anchor.copy_(state[f"anchor_{i}"])
            for key, value in optimizer.state[anchor].items():
                value.copy_(state[f"{key}_{i}"])


def _slots(bucket: list[torch.Tensor], flat: torch.Tensor, which: list[int]):
    """(shard, its slice of the flat tensor) for the shards `which` of a bucket."""
    offsets = [0]
    for t in bucket:
        offsets.append(offsets[-1] + t.numel())
    return [(bucket[j], flat[offsets[j] : offsets[j + 1]]) for j in which]


def _pack(bucket: list[torch.Tensor], flat: torch.Tensor, which: list[int]) -> None:
    """Copy the bucket's shards `which` (all, or those not resident) into their slots of its flat
    tensor, cast to the reduce dtype if it differs."""
    if not which:
        return
    if len(which) == len(bucket) and flat.dtype == bucket[0].dtype:
        torch.cat([t.reshape(-1) for t in bucket], out=flat)  # one kernel
        return
    for t, slot in _slots(bucket, flat, which):
        slot.copy_(t.reshape(-1))


def _pack_change(bucket: list[torch.Tensor], base: torch.Tensor, flat: torch.Tensor) -> None:
    """flat = the bucket's shards - base, computed in the wider dtype, rounded once to flat's."""
    every = range(len(bucket))
    for (t, slot), (_, b) in zip(_slots(bucket, flat, every), _slots(bucket, base, every)):
        if torch.promote_types(slot.dtype, t.dtype) == slot.dtype:  # widen first: bf16 - bf16 rounds to bf16
            slot.copy_(t.reshape(-1)).sub_(b)
        else:
            torch.sub(t.reshape(-1), b, out=slot)


def _local(p) -> torch.Tensor:
    """The DTensor's own local tensor: to_local() of a Parameter returns a fresh view of it."""
    return p._local_tensor if isinstance(p, DTensor) else p


def _unpack(bucket: list[torch.Tensor], flat: torch.Tensor, which: list[int]) -> None:
    """Copy the bucket's flat tensor back into its shards `which`."""
    if not which:
        return
    for t, slot in _slots(bucket, flat, which):
        t.copy_(slot.view_as(t))


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


def bucket_indices(tensors: list[tuple[int, torch.dtype]], bucket_bytes: int) -> list[list[int]]:
    """Greedy, order-preserving grouping of (nbytes, dtype) into buckets of one dtype and at most
    `bucket_bytes` each, so FedAvg issues a few large collectives instead of one per parameter.
    Every index lands in exactly one bucket; one larger than the limit gets a bucket of its own."""
    buckets, size = [], 0
    for i, (nbytes, dtype) in enumerate(tensors):
        if not buckets or size + nbytes > bucket_bytes or tensors[buckets[-1][0]][1] != dtype:
            buckets.append([])
            size = 0
        buckets[-1].append(i)
        size += nbytes
    return buckets


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
