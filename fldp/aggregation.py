"""Decentralised FedAvg across federation groups, shard by shard.

Every `every` steps (and at the last step) each rank averages its local parameter shards with the
ranks holding the same shards in the other F-1 groups: an all-reduce over the mesh's federation
dimension. Equal weights; optimiser state stays local. This is only correct if shard k of
parameter p is the same slice of the same tensor in every group, so that is checked on
construction, before anything is averaged (a silent average of unrelated values would corrupt
the model without an error).
"""
from __future__ import annotations

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
        check_aligned(model, self.federation)

    def due(self, step: int) -> bool:
        """Aggregate every `every` steps and at the last step, so all groups end identical."""
        return step % self.config.every == 0 or step == self.last_step

    def _buckets(self, bucket_bytes: int) -> list[list[torch.Tensor]]:
        """Greedy, order-preserving grouping of local shards (one dtype per bucket), so FedAvg
        issues a few large collectives instead of one per parameter. Each shard is in exactly one
        bucket; one larger than the limit gets a bucket of its own."""
        buckets, current, size = [], [], 0
        for p in self.params:
            local = p.to_local() if hasattr(p, "to_local") else p
            if local.numel() == 0:
                continue  # FSDP2 can leave a rank an empty shard of a small parameter
            nbytes = local.numel() * local.element_size()
            if current and (size + nbytes > bucket_bytes or current[0].dtype != local.dtype):
                buckets.append(current)
                current, size = [], 0
            current.append(local)
            size += nbytes
        if current:
            buckets.append(current)
        return buckets

    @torch.no_grad()
    def __call__(self) -> None:
        for bucket in self.buckets:
            flat = torch.cat([t.reshape(-1) for t in bucket])
            if not self.broadcast or self.replica_index == 0:
                # gloo has no AVG: sum, then divide (identical bits on every rank of the group)
                dist.all_reduce(flat, group=self.federation)
                flat.div_(self.shape.federation)
            if self.broadcast:
                dist.broadcast(flat, group=self.replicate, group_src=0)
            for t, avg in zip(bucket, torch.split(flat, [t.numel() for t in bucket])):
                t.copy_(avg.view_as(t))

    @torch.no_grad()
    def synchronise(self) -> None:
        """Make every group start from group 0's weights (a broadcast over the federation dim)."""
        for bucket in self.buckets:
            flat = torch.cat([t.reshape(-1) for t in bucket])
            dist.broadcast(flat, group=self.federation, group_src=0)
            for t, src in zip(bucket, torch.split(flat, [t.numel() for t in bucket])):
                t.copy_(src.view_as(t))


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
