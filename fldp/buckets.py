"""A FedAvg bucket: a run of one fragment's federated local shards of one dtype, exchanged as one
flat tensor, and everything the exchange keeps of them: the reference (the weights at the last
aggregation, when the change is what crosses), the error-feedback residual, the outer optimiser's
anchor and state, and the exchange in flight.

Its state is saved by the names of the parameters whose shards it holds, not by its position, so a
checkpoint re-assembles into other buckets (another algorithm.fedavg.bucket_mb): every piece of it
is elementwise (anchor, momentum, Adam's moments, reference, residual), or, Adam's step count, one
number that every bucket of a fragment shares.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch

from .outer import OuterState


class Bucket:
    """The shards of the parameters `names` (this rank's local tensors), of fragment `fragment`,
    exchanged as one flat tensor of `dtype` (None: the shards' own)."""

    def __init__(self, names: Sequence[str], shards: Sequence[torch.Tensor], fragment: int, dtype: torch.dtype | None):
        self.names, self.shards, self.fragment = list(names), list(shards), fragment
        self.dtype = dtype or shards[0].dtype
        self.offsets = [0]
        for t in shards:
            self.offsets.append(self.offsets[-1] + t.numel())
        self.numel = self.offsets[-1]
        self.flat: torch.Tensor | None = None  # resident: FSDP2's shards are views of it
        self.copied = list(range(len(shards)))  # the shards copied into a flat tensor and back
        self.hosted: tuple = ()  # (FSDP2 owner, local view, data pointer) per resident shard
        self.reference: torch.Tensor | None = None
        self.residual: torch.Tensor | None = None
        self.outer: OuterState | None = None
        self.flying: tuple | None = None  # (the copy being reduced, its work), sent and not merged

    def __len__(self) -> int:
        return len(self.shards)

    def slots(self, flat: torch.Tensor, which=None, shards=None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(shard, its slice of `flat`) for the shards `which` (None: all) of `shards` (None: the
        bucket's; else another group's shards of the same parameters, as the simulator holds them)."""
        which, shards = range(len(self.shards)) if which is None else which, shards or self.shards
        return [(shards[j], flat[self.offsets[j] : self.offsets[j + 1]]) for j in which]

    def weights(self) -> torch.Tensor:
        """The shards' weights, flat (a new tensor)."""
        return torch.cat([t.reshape(-1) for t in self.shards])

    @property
    def base(self) -> torch.Tensor | None:
        """What the change is taken from: the anchor, or the reference."""
        return self.outer.anchor if self.outer is not None else self.reference

    # --- the exchange ----------------------------------------------------------------------------
    def pack(self, flat: torch.Tensor, which=None, shards=None) -> None:
        """flat := what crosses: the weights of the shards `which` (None: those copied), or, with a
        reference, every shard's change since the base, taken in the wider dtype and rounded once.
        shards: another group's (slots)."""
        if self.reference is not None:
            base = cast(torch.Tensor, self.base)  # a reference is kept: there is a base
            for (t, slot), (_, b) in zip(self.slots(flat, None, shards), self.slots(base)):
                if torch.promote_types(slot.dtype, t.dtype) == slot.dtype:  # widen first: bf16 - bf16 rounds
                    slot.copy_(t.reshape(-1)).sub_(b)
                else:
                    torch.sub(t.reshape(-1), b, out=slot)
            return
        which = self.copied if which is None else which
        if len(which) == len(self.shards) and flat.dtype == self.shards[0].dtype:
            torch.cat([t.reshape(-1) for t in shards or self.shards], out=flat)  # one kernel
        else:
            for t, slot in self.slots(flat, which, shards):
                slot.copy_(t.reshape(-1))

    def copy_out(self, shards=None) -> torch.Tensor:
        """A new flat tensor of what crosses, from every shard (of `shards`: another group's)."""
        flat = torch.empty(self.numel, dtype=self.dtype, device=self.shards[0].device)
        self.pack(flat, range(len(self.shards)), shards)
        return flat

    def result(self, flat: torch.Tensor, reduced: bool, outer_step: bool) -> torch.Tensor:
        """The new weights, flat: from the groups' mean in `flat` (`reduced`: of the weights, or with a
        reference of the change), with the outer step (`outer_step`; else the plain average, the
        state untouched); not `reduced`: a replica's tensor the leader's result is broadcast into."""
        ref = self.reference
        if not reduced:
            return flat if ref is None else ref if outer_step else torch.empty_like(ref)
        if ref is not None:
            if not outer_step:
                return (cast(torch.Tensor, self.base) + flat).to(ref.dtype)  # the average; the reference kept
            if self.outer is not None:
                return ref.copy_(self.outer.step(-flat.float()))  # anchor - (anchor + change)
            return ref.add_(flat)
        if self.outer is not None and outer_step:
            flat.copy_(self.outer.step(self.outer.anchor - flat.float()))
        return flat

    def unpack(self, flat: torch.Tensor, every_shard: bool = False) -> None:
        """Copy `flat` back into the shards (every one, or those not resident in it)."""
        for t, slot in self.slots(flat, None if every_shard else self.copied):
            t.copy_(slot.view_as(t))

    def lerp(self, local: torch.Tensor, alpha: float) -> None:
        """shards := lerp(shards, local, alpha): the global weights mixed with the group's own."""
        for t, mine in self.slots(local):
            t.lerp_(mine.view_as(t), alpha)

    # --- FSDP2's shards as views of the bucket ---------------------------------------------------
    @torch.no_grad()
    def adopt(self, owners: dict) -> None:
        """Make the bucket one flat tensor that FSDP2's shards (`owners`: id(local) -> FSDPParam) are
        views of, their values copied in once; left packed per aggregation if none can be. The
        layout is the packed one, so the all-reduce sums the same bytes in the same order."""
        flat = torch.empty(self.numel, dtype=self.shards[0].dtype, device=self.shards[0].device)
        copied, hosted = [], []
        for j, (t, slot) in enumerate(self.slots(flat)):
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
            self.shards[j] = local
            hosted.append((owner, local, slot.data_ptr()))
        if hosted:  # else a persistent copy of the bucket would only cost memory
            self.flat, self.copied, self.hosted = flat, copied, tuple(hosted)

    def stale(self) -> bool:
        """Whether a resident shard's storage was swapped out of the bucket since adopt()."""
        return not all(
            owner.sharded_param._local_tensor is local
            and local.data_ptr() == ptr
            and owner._sharded_param_data.data_ptr() == ptr
            for owner, local, ptr in self.hosted
        )

    # --- state, by parameter ---------------------------------------------------------------------
    def _state(self) -> dict[str, torch.Tensor]:
        state = dict(self.outer.tensors()) if self.outer is not None else {}
        if self.reference is not None:
            state["reference"] = self.reference
        if self.residual is not None:
            state["residual"] = self.residual  # padded to whole blocks: the padding stays zero
        return state

    def state_dict(self) -> dict[str, dict[str, torch.Tensor]]:
        """{parameter name: {kind: this rank's slice of it}}; a number shared by the bucket (Adam's
        step) is given to each parameter, as its own copy."""
        state = self._state()
        if not state:
            return {}
        return {
            name: {k: t[self.offsets[j] : self.offsets[j + 1]] if t.dim() else t.clone() for k, t in state.items()}
            for j, name in enumerate(self.names)
        }

    @torch.no_grad()
    def load_state_dict(self, saved: dict) -> None:
        """From state_dict()'s form, for these parameters; saved with any buckets of the same shards."""
        for kind, t in self._state().items():
            pieces = [saved[name][kind] for name in self.names]
            if t.dim():  # the pieces may be views of t itself (DCP loads into state_dict()'s tensors)
                t[self.numel :].zero_()  # a residual's padding
                for j, piece in enumerate(pieces):
                    t[self.offsets[j] : self.offsets[j + 1]].copy_(piece)
            elif any(not torch.equal(p, pieces[0]) for p in pieces):
                raise ValueError(
                    f"trainer.resume: the saved {kind} of {self.names[0]} and {self.names[-1]} differ, "
                    "and this run keeps them in one bucket (algorithm.fedavg.bucket_mb, algorithm.streaming)"
                )
            else:
                t.copy_(pieces[0])


def bucket_indices(tensors: list[tuple[int, torch.dtype]], bucket_bytes: int) -> list[list[int]]:
    """Greedy, order-preserving grouping of (nbytes, dtype) into buckets of one dtype and at most
    `bucket_bytes` each, so FedAvg issues a few large collectives instead of one per parameter.
    Every index lands in exactly one bucket; one larger than the limit gets a bucket of its own."""
    buckets: list[list[int]] = []
    size = 0
    for i, (nbytes, dtype) in enumerate(tensors):
        if not buckets or size + nbytes > bucket_bytes or tensors[buckets[-1][0]][1] != dtype:
            buckets.append([])
            size = 0
        buckets[-1].append(i)
        size += nbytes
    return buckets
