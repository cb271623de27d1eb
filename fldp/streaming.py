"""Streaming aggregation (Douillard et al. 2025, Streaming DiLoCo): the federated parameters are
split into P fragments, and each fragment is aggregated on its own, at staggered steps, so each
aggregation sends 1/P of the model (the peak bytes per step / P) and the same total.

Fragments are groups of FSDP units. The units, in depth order, are the root (embeddings, final norm,
lm_head: the unit around the layers) and then the decoder layers; `strided` puts unit u in
fragment u % P (each fragment spans the depth, the paper's choice), `contiguous` in u * P // units.
With period A (P divides A), fragment p aggregates at the steps t with t = (p + 1) A / P (mod A):
fragment P - 1 on the steps a whole-model aggregation would take, the others A / P, 2 A / P, ...
steps before; the last step aggregates every fragment, so all groups end identical. This is
torchft's DiLoCo schedule (`torchft.local_sgd.DiLoCo`, `fragment_sync_delay=0`): its fragment p
syncs when its manager step is p modulo P, after A / P inner steps each time.

Each fragment has its own anchor and outer-optimiser state (FedAvg keeps them per bucket, and a
bucket holds one fragment's parameters only). `overlap` (tau, the all-reduce in flight during tau
inner steps) and `alpha` (mixing local and global weights) are not built yet: 0 only.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from .errors import ConfigError

LAYOUTS = ("strided", "contiguous")
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")  # a decoder layer's parameters: model.layers.<i>.


@dataclass(frozen=True)
class StreamingConfig:
    """algorithm.streaming: how the federated parameters are split and when each part aggregates."""
    fragments: int = 1
    layout: str = "strided"
    overlap: int = 0
    alpha: float = 0.0

    def __post_init__(self):
        if self.layout not in LAYOUTS:
            raise ConfigError(f"algorithm.streaming.layout={self.layout!r}: must be one of {', '.join(LAYOUTS)}")
        if isinstance(self.fragments, bool) or not isinstance(self.fragments, int) or self.fragments < 1:
            raise ConfigError(f"algorithm.streaming.fragments={self.fragments!r}: must be an integer >= 1")
        if self.overlap != 0 or self.alpha != 0:
            raise ConfigError(f"algorithm.streaming.overlap={self.overlap!r}, alpha={self.alpha!r}: an all-reduce "
                              "in flight during inner steps is not built yet (issue 22); 0 and 0 only")

    @classmethod
    def from_algorithm(cls, algorithm_cfg) -> StreamingConfig:
        streaming = algorithm_cfg.get("streaming") or {}
        return cls(**{k: streaming[k] for k in ("fragments", "layout", "overlap", "alpha") if k in streaming})

    def check_schedule(self, schedule: tuple[tuple[int, int], ...]) -> int:
        """The period A fragments are staggered over; refuses what cannot be staggered."""
        if self.fragments == 1:
            return schedule[0][1]
        if len(schedule) > 1:
            raise ConfigError(f"algorithm.streaming.fragments={self.fragments} with a schedule algorithm.every="
                              f"{[list(p) for p in schedule]}: fragments need one period A (not built yet)")
        every = schedule[0][1]
        if every % self.fragments:
            raise ConfigError(f"algorithm.streaming.fragments={self.fragments} must divide algorithm.every={every}: "
                              "each fragment aggregates every A steps, A / P steps after the one before")
        return every

    def due(self, step: int, every: int, last_step: int) -> tuple[int, ...]:
        """The fragments that aggregate after `step` (P > 1): one on every (A / P)-th step, all at the last."""
        if step == last_step:
            return tuple(range(self.fragments))
        gap = every // self.fragments
        if step % gap:
            return ()
        return ((step // gap - 1) % self.fragments,)

    def fragment_of(self, names: list[str]) -> list[int]:
        """Each parameter's fragment, by its FSDP unit (the root, or decoder layer i: unit i + 1)."""
        units = [int(m.group(1)) + 1 if (m := _LAYER.search(name)) else 0 for name in names]
        count = max(units) + 1
        if self.fragments > count:
            raise ConfigError(f"algorithm.streaming.fragments={self.fragments}: the model has {count} FSDP units "
                              f"(the root and {count - 1} decoder layers) to split; at most {count} fragments")
        if self.layout == "strided":
            return [u % self.fragments for u in units]
        return [u * self.fragments // count for u in units]
