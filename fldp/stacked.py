"""FedAvg over F federation groups stacked in one process (cluster=simulate): the trainer's buckets,
cut as each rank of a group holds them, and their arithmetic (fldp.buckets.Bucket), without the
collectives.

Parameter `name` of group g is `stacked[name][g]`. Shard s of S is the rows FSDP2 gives shard rank
s (dim 0 cut in chunks of ceil(rows / S), the last ones short or empty), and the shards of each
shard index are bucketed as that rank's are (fldp.aggregation.make_buckets: per fragment, in
parameter order, algorithm.fedavg.bucket_mb): so a quantised exchange quantises the same blocks. A
bucket's reference, anchor and outer state are group 0's (every group holds the same ones); each
group has its own error-feedback residual. The mean is the groups' sum over the stacked dimension,
divided (the collective sums in another order), or the codec's mean of the changes (fldp/quantize.py), the
arithmetic the trainer's two-stage exchange runs.
"""

from __future__ import annotations

import math
from typing import cast

import torch

from .aggregation import REDUCE_DTYPES, FedAvgConfig, bucket_indices
from .buckets import Bucket
from .mesh import shard_piece
from .outer import OuterState
from .quantize import Quantizer, codec_of
from .ring import ring_mean
from .streaming import Exchange


def shard_rows(rows: int, shards: int, index: int) -> tuple[int, int]:
    """The rows [lo, hi) of dim 0 that FSDP2's Shard(0) gives shard `index` of `shards`."""
    chunk = shard_piece(rows, shards)
    lo = min(rows, index * chunk)
    return lo, min(rows, lo + chunk)


class StackedBucket(Bucket):
    """A bucket of every group at once: its shards are group 0's, `rows` each shard's (name, lo, hi)."""

    def __init__(
        self, stacked: dict[str, torch.Tensor], rows: list[tuple[str, int, int]], fragment: int, dtype, ring=False
    ):
        self.stacked, self.rows, self.ring = stacked, rows, ring  # ring: summed as fldp.ring.ring_mean
        super().__init__([n for n, _, _ in rows], self.of_group(0), fragment, dtype)
        self.residuals: list[torch.Tensor] | None = None  # per group

    def of_group(self, g: int) -> list[torch.Tensor]:
        return [self.stacked[n][g, lo:hi] for n, lo, hi in self.rows]

    def every_group(self) -> list[torch.Tensor]:
        """Each shard's rows in every group: [F, rows, ...]."""
        return [self.stacked[n][:, lo:hi] for n, lo, hi in self.rows]

    def mean(self, quantizer: Quantizer | None, feedback: bool) -> torch.Tensor:
        """What the groups' exchange leaves every group: the mean of the weights, or (quantised, or
        cast to reduce_dtype) of the changes since the base; only a training aggregation (`feedback`)
        moves the residuals. With `ring`, summed in the federation all-reduce's order (fldp.ring)."""
        groups = self.stacked[self.names[0]].shape[0]
        if quantizer is not None:
            changes = [self.copy_out(self.of_group(g)) for g in range(groups)]
            return quantizer.mean(changes, self.residuals if feedback else None)
        if self.reference is not None:  # a cast to reduce_dtype: each group's change, as pack() takes it
            flats = torch.stack([self.copy_out(self.of_group(g)) for g in range(groups)])
        elif self.ring:
            flats = torch.cat([t.reshape(groups, -1) for t in self.every_group()], dim=1)
        else:  # the weights summed shard by shard, no [F, numel] copy
            return torch.cat([t.sum(dim=0).reshape(-1) for t in self.every_group()]).div_(groups)
        return ring_mean(flats) if self.ring else flats.sum(dim=0).div_(groups)  # ring: the all-reduce's order

    def merge(self, mean: torch.Tensor, alpha: float) -> None:
        """The outer step on the mean, and its new weights into every group, lerp'd with each group's
        own by `alpha` (Bucket.lerp's arithmetic)."""
        new = self.result(mean, reduced=True, outer_step=True)
        for t, slot in self.slots(new, shards=self.every_group()):
            value = slot.view(t.shape[1:]).expand_as(t)
            t.copy_(torch.lerp(value, t, alpha) if alpha else value)


class StackedFedAvg:
    """The simulator's FedAvg: `stacked` holds every parameter of the F groups, `shards` is S; `ring`:
    the unquantised mean summed along the federation group's ring (fldp.ring), as the all-reduce."""

    @torch.no_grad()
    def __init__(self, config: FedAvgConfig, stacked: dict[str, torch.Tensor], shards: int, ring: bool = False):
        self.config, self.stacked = config, stacked
        names = list(stacked)
        self.federated = [n for n, keep in zip(names, config.federated(names)) if keep]
        self.quantizer = codec_of(config.outer)
        dtype = torch.float32 if self.quantizer else REDUCE_DTYPES[config.outer.reduce_dtype]
        fragment = config.streaming.fragment_of(self.federated)
        self.buckets: list[StackedBucket] = []
        for s in range(shards):
            for f in range(config.streaming.fragments):
                rows = [(n, *shard_rows(stacked[n].shape[1], shards, s)) for n in self.federated]
                rows = [r for r, g in zip(rows, fragment) if g == f and r[2] > r[1]]
                sizes = [(self._numel(r) * stacked[r[0]].element_size(), stacked[r[0]].dtype) for r in rows]
                for group in bucket_indices(sizes, int(config.bucket_mb * 2**20)):
                    self.buckets.append(self._keep(StackedBucket(stacked, [rows[i] for i in group], f, dtype, ring)))

    def _numel(self, row: tuple[str, int, int]) -> int:
        name, lo, hi = row
        return (hi - lo) * math.prod(self.stacked[name].shape[2:])

    def _keep(self, bucket: StackedBucket) -> StackedBucket:
        """As FedAvg._keep, from group 0's weights (every group starts with them)."""
        groups = self.stacked[bucket.names[0]].shape[0]
        if self.quantizer is not None or bucket.dtype != bucket.shards[0].dtype:  # FedAvg._sends_change
            bucket.reference = bucket.weights()
        if self.config.outer.error_feedback and self.quantizer is not None:  # error feedback needs one
            bucket.residuals = [
                self.quantizer.residual(bucket.numel, groups, bucket.shards[0].device) for _ in range(groups)
            ]
        if not self.config.outer.averages:
            start = bucket.reference if bucket.reference is not None else bucket.weights()
            bucket.outer = OuterState(self.config.outer, start)
        return bucket

    @torch.no_grad()
    def exchange(self, due: Exchange) -> None:
        """The means of the fragments sent (their exchange), then, for those merged, FedAvg or the
        outer step on them, mixed with each group's weights by alpha."""
        for bucket in self.buckets:
            if bucket.fragment in due.sends:
                bucket.flying = (bucket.mean(self.quantizer, feedback=True), None)
        for bucket in self.buckets:
            if bucket.fragment in due.merges:
                (mean, _), bucket.flying = cast(tuple, bucket.flying), None  # sent at this or an earlier step
                bucket.merge(mean, due.alpha)

    @torch.no_grad()
    def averaged(self) -> dict[str, torch.Tensor]:
        """The average the trainer's evaluation scores (FedAvg.averaged), by name, [1, ...] each:
        the plain one, or the base plus the quantised mean change (the residuals untouched)."""
        out = {n: torch.empty_like(self.stacked[n][:1]) for n in self.federated}
        for bucket in self.buckets:
            new = bucket.result(bucket.mean(self.quantizer, feedback=False), reduced=True, outer_step=False)
            for (name, lo, hi), (_, slot) in zip(bucket.rows, bucket.slots(new)):
                out[name][0, lo:hi] = slot.view(hi - lo, *out[name].shape[2:])
        return out
