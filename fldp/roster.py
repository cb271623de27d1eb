"""The roll call of an elastic run's federation groups, and when each aggregation's first group came.

torchft's lighthouse waits at a quorum only for the groups it has heard from: a group whose
Manager does not exist yet (its ranks still starting, on a loaded machine) is not waited for, and
the first aggregation would run without it (issue 47). So before its first aggregation every group
of a run's first start answers a roll call: it says it is here once the lighthouse has its
heartbeat, or the supervisor says it failed; every rank waits until each group has done one or the
other, at most `cluster.join_timeout_s`. A restarted group does not take part: it heals in an
aggregation, behind the others.

At each aggregation the first group to ask for the quorum notes the time, so that every group's
records can say why a group was left out of it: it `failed` (the lighthouse stopped hearing from
it: its process or its link is gone) or `timed out` (alive, but later than cluster.join_timeout_s
after the first group asked: the lighthouse's own wait).

The store is a TCPStore in the lighthouse's process, on its host: reachable wherever the lighthouse
is (emulated nodes, a SLURM allocation's first node).
"""

from __future__ import annotations

import time
from datetime import timedelta

from torch.distributed import DistStoreError, TCPStore

READY, FAILED = "ready", "failed"
TIMED_OUT = "timed out"


def serve() -> TCPStore:
    """The roll call's store, in the lighthouse's process: on every interface, at a free port."""
    return TCPStore("localhost", 0, is_master=True, wait_for_workers=False)


def answer(store: TCPStore, group: int, mark: str, groups: int) -> None:
    """Group `group` is here (READY) or failed (FAILED): only its first answer counts."""
    if store.compare_set(f"start/{group}", "", mark) == mark.encode() and store.add("answered", 1) == groups:
        store.set("complete", "1")


class Roster:
    """A rank's side of the roll call and of each aggregation's first arrival."""

    def __init__(self, address: str, groups: int, wait_s: float):
        hostname, port = address.rsplit(":", 1)
        self.groups, self.wait_s = groups, wait_s
        self.store = TCPStore(
            hostname, int(port), is_master=False, wait_for_workers=False, timeout=timedelta(seconds=60)
        )

    def here(self, group: int) -> None:
        answer(self.store, group, READY, self.groups)

    def wait(self) -> list[int]:
        """Until every group has answered, at most wait_s; the groups that have not (empty: all have)."""
        try:
            self.store.wait(["complete"], timedelta(seconds=self.wait_s))
            return []
        except DistStoreError:  # the wait ran out
            return [g for g in range(self.groups) if not self.store.check([f"start/{g}"])]

    def arrive(self, step: int) -> float:
        """This group asks for step `step`'s quorum: the unix time the first group asked."""
        now = repr(time.time())
        return float(self.store.compare_set(f"join/{step}", "", now).decode())

    def why_left_out(self, first_asked: float) -> str:
        """Why the lighthouse formed a quorum without a group: its own wait had run out, or it no
        longer heard from the group."""
        return TIMED_OUT if time.time() - first_asked >= self.wait_s else FAILED
