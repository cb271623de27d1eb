"""How a FedAvg bucket's flat tensor becomes the federation groups' mean: the collective work,
apart from what a bucket does with the mean.

- `GroupMean`: an all-reduce over the mesh's federation group (gloo has no AVG: sum, then divide).
- `QuantizedMean`: fldp/quantize.py's two-stage exchange (all-to-all, then all-gather) of the
  change in 8 or 4 bits, with the bucket's error-feedback residual.
- `ElasticMean`: torchft's Manager (fldp.elastic.Federation) over the groups alive: a quorum before
  the exchange, and a commit after it that decides whether the mean is applied.

A new compression of the outer exchange is a codec in fldp/quantize.py (CODECS: its one-process mean,
which the simulator runs, and the same arithmetic over the group's collectives, which QuantizedMean
runs); the transports, FedAvg, the buckets and the simulator do not change (docs/development.md).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .quantize import Quantizer


class Divided:
    """An all-reduce's handle whose wait() leaves the mean: the sum divided by the groups (identical
    bits on every rank of the group). work None: the sum is already there."""

    def __init__(self, work, flat: torch.Tensor, groups: int):
        self.work, self.flat, self.groups = work, flat, groups

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()
        if self.groups != 1:
            self.flat.div_(self.groups)


class GroupMean:
    """The mean over a static federation group, started asynchronously, in place."""

    deferred = False  # the mean is applied as each bucket's arrives

    def __init__(self, group, groups: int):
        self.group, self.groups = group, groups

    def begin(self) -> int:
        """Start an aggregation; the groups taking part."""
        return self.groups

    def mean(self, flat: torch.Tensor, residual: torch.Tensor | None = None) -> Divided:
        """Start the groups' mean of `flat`, in place: the handle's wait() leaves it there."""
        return Divided(dist.all_reduce(flat, group=self.group, async_op=True), flat, self.groups)

    def commit(self) -> bool:
        """Whether the aggregation is applied (a static federation: always)."""
        return True

    def share(self, flat: torch.Tensor) -> None:
        """Give every group group 0's `flat` (they start alike; where not, the first aggregation
        still gives the groups' average)."""
        dist.broadcast(flat, group=self.group, group_src=0)


class QuantizedMean(GroupMean):
    """The quantised mean of the change (fldp.quantize.all_reduce_mean): two dependent collectives,
    done at once; the residual (error feedback) is moved by training aggregations only."""

    def __init__(self, group, groups: int, quantizer: Quantizer):
        super().__init__(group, groups)
        self.quantizer = quantizer

    def mean(self, flat: torch.Tensor, residual: torch.Tensor | None = None) -> Divided:
        self.quantizer.all_reduce_mean(flat, self.group, residual)
        return Divided(None, flat, 1)


class ElasticMean:
    """The mean over the groups alive, through torchft (fldp.elastic.Federation): every bucket's
    all-reduce waited on, then applied only if every group commits."""

    deferred = True

    def __init__(self, federation):
        self.federation = federation

    def begin(self) -> int:
        return self.federation.quorum()  # a restarted group heals in it

    @property
    def left_out(self) -> dict[str, str]:
        """The groups not in the last quorum: "failed" or "timed out" (fldp.roster)."""
        return self.federation.left_out

    def mean(self, flat: torch.Tensor, residual: torch.Tensor | None = None):
        return self.federation.all_reduce_mean(flat)

    def commit(self) -> bool:
        return self.federation.commit()  # after the heal's load: the anchor and reference are the peer's

    def share(self, flat: torch.Tensor) -> None:
        """Nothing: each group's own weights are alike (fldp.init)."""


def transport_for(quantizer: Quantizer | None, mesh, groups: int, elastic=None):
    """The transport of a federation: elastic (torchft), quantised, or a plain all-reduce."""
    if elastic is not None:
        return ElasticMean(elastic)
    group = mesh["federation"].get_group()
    return QuantizedMean(group, groups, quantizer) if quantizer is not None else GroupMean(group, groups)
