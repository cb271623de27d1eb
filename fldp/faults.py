"""Real failures and delays on purpose, for tests, drills and the elastic benchmark (FLDP_FAULT).

FLDP_FAULT="group=G,step=N[,at=step|aggregation|allreduce|start][,repeat=true][,sleep=S]" makes every
rank of federation group G SIGKILL itself: after step N is recorded (`step`, the default, in any
run), or, in an elastic run (fldp/elastic.py), as step N's aggregation begins (`aggregation`: before
its quorum), inside it (`allreduce`: in the quorum, before the all-reduce) or as the group starts
(`start`, no step: before its torchft Manager exists). With sleep=S the ranks sleep S seconds there
instead: a group that is late, not failed. A restarted group's ranks strike again only with
repeat=true. Each rank prints the moment (unix time) on stderr first: the benchmark's start of a
failure. The trainer reaches these points through Drills; fldp.elastic strikes at `allreduce` itself.
"""

from __future__ import annotations

import os
import signal
import sys
import time

VARIABLE = "FLDP_FAULT"


def strike(group: int, incarnation: int, step: int | None, at: str) -> None:
    """SIGKILL this rank (or sleep, with sleep=S) if FLDP_FAULT names its group, this point and this step."""
    spec = os.environ.get(VARIABLE)
    if not spec:
        return
    fields = dict(part.split("=", 1) for part in spec.split(","))
    if incarnation and fields.get("repeat") != "true":
        return
    if (
        int(fields["group"]) == group
        and fields.get("at", "step") == at
        and (at == "start" or int(fields["step"]) == step)
    ):
        delay = fields.get("sleep")
        what = f"delays group {group} by {delay} s" if delay else f"kills group {group}"
        print(f"fldp: {VARIABLE} {what} at {at} {step} (unix time {time.time():.3f})", file=sys.stderr, flush=True)
        if delay:
            time.sleep(float(delay))
        else:
            os.kill(os.getpid(), signal.SIGKILL)


class Drills:
    """The points of a training run where FLDP_FAULT may kill this rank, of federation group
    `group` in its `incarnation`-th start (0: the first). Only an elastic run has the points
    `start` and `aggregation`: its supervisor restarts a group."""

    def __init__(self, group: int, incarnation: int = 0, elastic: bool = False):
        self.group, self.incarnation, self.elastic = group, incarnation, elastic

    def start(self) -> None:
        if self.elastic:
            strike(self.group, self.incarnation, None, "start")

    def aggregation(self, step: int) -> None:
        if self.elastic:
            strike(self.group, self.incarnation, step, "aggregation")

    def step(self, step: int) -> None:
        """After step `step` is recorded."""
        strike(self.group, self.incarnation, step, "step")
