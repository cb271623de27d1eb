"""Elastic federation's heals (fldp/elastic.py): a group behind the others, restarted after a
failure or cut off from them for a while, takes a live peer's whole state in an aggregation (its
step included) and trains on from there. Each heal is a row of the group's records."""

from __future__ import annotations

import time

import torch.distributed as dist

from .errors import NoPeerToHealFrom


class Healing:
    """This rank's side of its group's heals: what a peer's heal copies from it, or it from a peer
    (the TrainingState, tracked by the Federation), and the records' row of each heal."""

    def __init__(self, state, federation, member):
        self.state, self.federation, self.member = state, federation, member
        federation.track(state.model, state.optimizer, state.scheduler, state.fedavg, state.position)

    def rejoin(self) -> dict:
        """A restarted group's first act: join the survivors' next aggregation, heal from one of
        them in it and leave it holding that aggregation's result, like them. The heal row."""
        began = time.perf_counter()
        committed = self.state.fedavg()
        if not self.federation.healed:
            raise NoPeerToHealFrom(
                f"federation group {self.member.group} restarted, but no live group was left to heal "
                "from: every other group had ended"
            )
        return self.row(committed, time.perf_counter() - began)

    def after(self, outcome) -> dict | None:
        """After a step (fldp.step.StepOutcome): the heal row if its aggregation healed this group."""
        if not (outcome.aggregated and self.federation.healed):
            return None
        return self.row(outcome.committed, outcome.times["aggregation"])

    def row(self, committed: bool, time_heal: float) -> dict:
        """The records' row of a heal (a group collective): the step it healed at, and the group each
        rank copied from (torchft spreads a group's ranks over the live peers)."""
        sources: list = [None] * dist.get_world_size()
        dist.all_gather_object(sources, self.federation.healed_from)
        return {
            "split": "heal",
            "step": self.state.step,
            "group": self.member.group,
            "restart": self.member.restart,
            "healed_from": sources,
            "participants": self.state.fedavg.participants,
            "left_out": self.federation.left_out,
            "committed": committed,
            "time_heal": time_heal,
            "healed_at": time.time(),  # unix time: when it rejoined
        }
