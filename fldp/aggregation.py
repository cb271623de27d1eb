"""Decentralised FedAvg across federation groups, shard by shard.

Every `every` steps (and at the last step) each rank averages its local parameter shards with the
ranks holding the same shards in the other F-1 groups: an all-reduce over the mesh's federation
dimension. Equal weights; optimiser state stays local. This is only correct if shard k of
parameter p is the same slice of the same tensor in every group, so that is checked on
construction, before anything is averaged (a silent average of unrelated values would corrupt
the model without an error).
"""
from __future__ import annotations

import contextlib
import hashlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .mesh import ConfigError, MeshShape

MODES = ("leader_broadcast", "all_replicas")


class ShardMismatchError(RuntimeError):
    """Federation groups do not hold the same shards: averaging them would corrupt the model."""


@dataclass(frozen=True)
class FedAvgConfig:
    every: int
    mode: str = "leader_broadcast"
    bucket_mb: float = 25.0

    def __post_init__(self):
        if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1:
            raise ConfigError(f"algorithm.every={self.every!r}: aggregation period must be an integer >= 1")
        if self.mode not in MODES:
            raise ConfigError(f"algorithm.fedavg.mode={self.mode!r}: must be one of {list(MODES)}")
        if not self.bucket_mb > 0:
            raise ConfigError(f"algorithm.fedavg.bucket_mb={self.bucket_mb!r}: must be > 0")

    @classmethod
    def from_algorithm(cls, algorithm_cfg) -> FedAvgConfig | None:
        """None for the algorithms without a federation (fsdp, hsdp)."""
        if not algorithm_cfg.name.startswith("fl_"):
            return None
        fedavg = algorithm_cfg.get("fedavg") or {}
        return cls(every=algorithm_cfg.every, mode=fedavg.get("mode", "leader_broadcast"),
                   bucket_mb=fedavg.get("bucket_mb", 25.0))


def shard_signature(model) -> list[tuple]:
    """What must agree across groups for a shard-wise average to mean anything."""
    rows = []
    for name, p in model.named_parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        placements = tuple(str(x) for x in getattr(p, "placements", ()))
        rows.append((name, tuple(p.shape), str(p.dtype), tuple(local.shape), placements))
    return rows


class FedAvg:
    """Averages local parameter shards across the federation dimension of `mesh`."""

    def __init__(self, model, mesh, shape: MeshShape, config: FedAvgConfig, last_step: int):
        self.config, self.shape, self.last_step = config, shape, last_step
        self.params = [p for _, p in model.named_parameters()]
        self.federation = mesh["federation"].get_group()
        self.replicate = mesh["replicate"].get_group()
        self.replica_index = mesh["replicate"].get_local_rank()
        # leader_broadcast: only replica 0 of each group joins the cross-group average.
        self.broadcast = config.mode == "leader_broadcast" and shape.replicate > 1
        self.buckets = self._buckets(int(config.bucket_mb * 2**20))
        self._buffers: dict = {}
        check_aligned(model, self.federation)

    def due(self, step: int) -> bool:
        """Aggregate every `every` steps and at the last step, so all groups end identical."""
        return step % self.config.every == 0 or step == self.last_step

    def _buckets(self, bucket_bytes: int) -> list[list[torch.Tensor]]:
        locals_ = [p.to_local() if hasattr(p, "to_local") else p for p in self.params]
        # FSDP2 can leave a rank an empty shard of a small parameter: nothing to send
        locals_ = [t for t in locals_ if t.numel()]
        groups = bucket_indices([(t.numel() * t.element_size(), t.dtype) for t in locals_], bucket_bytes)
        return [[locals_[i] for i in group] for group in groups]

    @torch.no_grad()
    def __call__(self) -> None:
        """Pack bucket k+1 while bucket k is being reduced (two reusable buffers per dtype): the
        copies overlap the collective, and nothing is allocated per aggregation."""
        pending = None
        for i, bucket in enumerate(self.buckets):
            flat = self._buffer(bucket, i % 2)
            torch.cat([t.reshape(-1) for t in bucket], out=flat)
            reduce = not self.broadcast or self.replica_index == 0
            work = dist.all_reduce(flat, group=self.federation, async_op=True) if reduce else None
            if pending:
                self._finish(*pending)
            pending = (bucket, flat, work)
        if pending:
            self._finish(*pending)

    def _buffer(self, bucket, parity: int) -> torch.Tensor:
        numel = sum(t.numel() for t in bucket)
        key = (bucket[0].dtype, parity)
        if key not in self._buffers or self._buffers[key].numel() < numel:
            self._buffers[key] = torch.empty(numel, dtype=bucket[0].dtype, device=bucket[0].device)
        return self._buffers[key][:numel]

    def _finish(self, bucket, flat, work) -> None:
        if work is not None:
            work.wait()
            # gloo has no AVG: sum, then divide (identical bits on every rank of the group)
            flat.div_(self.shape.federation)
        if self.broadcast:
            dist.broadcast(flat, group=self.replicate, group_src=0)
        _unpack(bucket, flat)

    @contextlib.contextmanager
    @torch.no_grad()
    def averaged(self):
        """Within the block, this rank holds the groups' average (for an evaluation); after it, its
        own shards again, bit for bit: the training state does not change."""
        shards = [t for bucket in self.buckets for t in bucket]
        saved = [t.clone() for t in shards]
        self()
        try:
            yield
        finally:
            for t, value in zip(shards, saved):
                t.copy_(value)


def _unpack(bucket: list[torch.Tensor], flat: torch.Tensor) -> None:
    """Copy a bucket's flat buffer back into its local shards."""
    for t, value in zip(bucket, torch.split(flat, [t.numel() for t in bucket])):
        t.copy_(value.view_as(t))


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
