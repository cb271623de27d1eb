"""Streaming aggregation (Douillard et al. 2025, Streaming DiLoCo): the federated parameters are
split into P fragments, and each fragment is aggregated on its own, at staggered steps, so each
aggregation sends 1/P of the model (the peak bytes per step / P) and the same total.

Fragments are groups of FSDP units. The units, in depth order, are the root (embeddings, final norm,
lm_head: the unit around the layers) and then the decoder layers. Only the units that hold a federated
parameter count (algorithm.federate may leave the root, or layers, local): numbered u = 0, 1, ... in
depth order, `strided` puts unit u in fragment u % P (each fragment spans the depth, the paper's
choice), `contiguous` in u * P // units; so every fragment holds a unit, and P above the number of
federated units is refused.
With period A (P divides A), fragment p aggregates at the steps t with t = (p + 1) A / P (mod A):
fragment P - 1 on the steps a whole-model aggregation would take, the others A / P, 2 A / P, ...
steps before; the last step aggregates every fragment, so all groups end identical. This is
torchft's DiLoCo schedule (`torchft.local_sgd.DiLoCo`, `fragment_sync_delay=0`): its fragment p
syncs when its manager step is p modulo P, after A / P inner steps each time.

Each fragment has its own anchor and outer-optimiser state (FedAvg keeps them per bucket, and a
bucket holds one fragment's parameters only).

`overlap` tau: a fragment's all-reduce starts tau steps before its merge step and is in flight while
the groups train those tau steps (its average is of the weights when it started); at the merge step
the fragment's new global weights are mixed with the group's own: local + (1 - alpha) * (global -
local), i.e. lerp(global, local, alpha), `alpha` 0 taking the global. torchft's `fragment_sync_delay`
and `fragment_update_alpha`, on the same steps. tau < A / P, so one fragment at most is in flight.
The last step ends every fragment global (alpha 0 there): the fragments in flight merge, the others
aggregate at once.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .config import AlgorithmConfig, StreamingSettings, section_of
from .model import fsdp_unit


@dataclass(frozen=True)
class Exchange:
    """What the aggregation does after one step: start the all-reduces of `sends`, then merge
    `merges` (their averages, mixed with the local weights by `alpha`). Without overlap, a fragment
    is sent and merged at once."""

    sends: tuple[int, ...] = ()
    merges: tuple[int, ...] = ()
    alpha: float = 0.0

    def __bool__(self) -> bool:
        return bool(self.sends or self.merges)

    @property
    def in_place(self) -> bool:
        """Each fragment sent is merged at once and taken as it is: the plain aggregation."""
        return self.sends == self.merges and not self.alpha

    def synced(self, fragments: int) -> bool:
        """Whether the groups hold one model after it: every fragment merged, none mixed."""
        return len(self.merges) == fragments and not self.alpha


@dataclass(frozen=True)
class StreamingConfig(StreamingSettings):
    """algorithm.streaming (its keys: fldp/config.py): how the federated parameters are split and
    when each part aggregates."""

    @property
    def exchanges(self) -> bool:
        """Whether an aggregation is more than the in-place average: an all-reduce in flight, or a mix."""
        return bool(self.overlap or self.alpha)

    @classmethod
    def from_algorithm(cls, algorithm) -> StreamingConfig:
        """From the typed algorithm section (fldp.config.load), or a composed one."""
        return cls(**dataclasses.asdict(section_of(AlgorithmConfig, algorithm).streaming))

    def check_schedule(self, schedule: tuple[tuple[int, int], ...]) -> int:
        """The period A fragments are staggered over; refuses what cannot be staggered."""
        if self.fragments == 1 and not self.exchanges:
            return schedule[0][1]
        if len(schedule) > 1:
            what = (
                f"fragments={self.fragments}" if self.fragments > 1 else f"overlap={self.overlap}, alpha={self.alpha}"
            )
            raise ValueError(
                f"algorithm.streaming.{what} with a schedule algorithm.every="
                f"{[list(p) for p in schedule]}: streaming needs one period A (not built yet)"
            )
        every = schedule[0][1]
        if every % self.fragments:
            raise ValueError(
                f"algorithm.streaming.fragments={self.fragments} must divide algorithm.every={every}: "
                "each fragment aggregates every A steps, A / P steps after the one before"
            )
        if self.overlap >= every // self.fragments:
            raise ValueError(
                f"algorithm.streaming.overlap={self.overlap} must be less than algorithm.every / "
                f"fragments = {every // self.fragments}: a fragment's all-reduce must end before the "
                "next fragment's starts"
            )
        return every

    def due(self, step: int, every: int, last_step: int) -> tuple[int, ...]:
        """The fragments that aggregate (merge) after `step`: one on every (A / P)-th step, all at the last."""
        if step == last_step:
            return tuple(range(self.fragments))
        return self._periodic(step, every)

    def _periodic(self, step: int, every: int) -> tuple[int, ...]:
        gap = every // self.fragments
        if step % gap:
            return ()
        return ((step // gap - 1) % self.fragments,)

    def exchange(self, step: int, every: int, last_step: int) -> Exchange:
        """What the aggregation does after `step`: the all-reduces that start (tau steps before their
        fragment's merge; at the last step, every fragment not already in flight) and the merges."""
        merges = self.due(step, every, last_step)
        if step != last_step:
            return Exchange(self._periodic(step + self.overlap, every), merges, self.alpha)
        # in flight at the last step: those sent in the tau steps before it, merging at it or later
        flying = {p for t in range(step, step + self.overlap) for p in self._periodic(t, every)}
        return Exchange(tuple(p for p in merges if p not in flying), merges, 0.0)

    def fragment_of(self, names: list[str]) -> list[int]:
        """Each parameter's fragment, by its FSDP unit (the root, or decoder layer i: unit i + 1).
        `names`: the federated parameters only. The units that hold them are numbered 0, 1, ... in
        depth order and the layout deals those out, so every fragment gets at least one unit (a
        unit left local, e.g. the root under algorithm.federate=[model\\.layers\\..*], is no one's)."""
        units = [fsdp_unit(name) for name in names]
        present = sorted(set(units))
        count = len(present)
        if self.fragments > count:
            raise ValueError(
                f"algorithm.streaming.fragments={self.fragments}: the federated parameters lie in "
                f"{_units_named(present)}; a fragment is a set of these units, so at most {count} "
                f"fragment{'s' * (count != 1)} (fewer fragments, or a wider algorithm.federate)"
            )
        rank = {u: i for i, u in enumerate(present)}
        if self.layout == "strided":
            return [rank[u] % self.fragments for u in units]
        return [rank[u] * self.fragments // count for u in units]


def _units_named(units: list[int]) -> str:
    """FSDP units in words: 'the root and 2 decoder layers' / '1 FSDP unit (decoder layer 3)'."""
    layers = [u - 1 for u in units if u]
    parts = (["the root"] if 0 in units else []) + (
        [f"{len(layers)} decoder layer{'s' * (len(layers) != 1)} ({', '.join(map(str, layers))})"] if layers else []
    )
    return f"{len(units)} FSDP unit{'s' * (len(units) != 1)}: " + " and ".join(parts)
