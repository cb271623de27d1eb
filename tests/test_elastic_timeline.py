"""The failure-time chart's series (analysis/elastic_timeline.py) from rows written by hand, as the
trainer and experiments/bench_elastic.py define them: no processes. Every step takes 0.5 s but the
first (2 s); FedAvg every 4 steps; unix times start at T."""

from __future__ import annotations

import pytest

from analysis.elastic_timeline import elastic_series, static_series

T = 1000.0


def train_rows(first: int, last: int, step_s: float = 0.5, **aggregation) -> list[dict]:
    return [
        {
            "step": s,
            "time_step": 2.0 if s == 1 else step_s,
            "aggregated": s % 4 == 0,
            **(aggregation if s % 4 == 0 else {}),
        }
        for s in range(first, last + 1)
    ]


def elastic_groups() -> dict[int, list[dict]]:
    """Group 1 killed after step 6, restarted, healed at step 8's aggregation (at T + 10) from
    groups 0 and 2, and trains on to 12; the others aggregate at 8 without it."""
    full = {"participants": 3, "committed": True}

    def survivor():
        return [*train_rows(1, 7, **full), *train_rows(8, 8, **{**full, "participants": 2}), *train_rows(9, 12, **full)]

    heal = {
        "split": "heal",
        "step": 8,
        "group": 1,
        "restart": 1,
        "healed_from": [0, 2, 0],
        "participants": 2,
        "committed": True,
        "time_heal": 0.7,
        "healed_at": T + 10.0,
    }
    return {0: survivor(), 1: [*train_rows(1, 6, **full), heal, *train_rows(9, 12, **full)], 2: survivor()}


def line(points, name: str, part: int) -> list[tuple[int, float]]:
    p = points[(points["line"] == name) & (points["part"] == part)]
    return list(zip(p["step"], p["seconds"]))


def test_the_killed_group_stops_at_the_kill_and_trains_again_from_the_heal_step():
    points, events = elastic_series(elastic_groups(), started=T, killed=T + 9.0)
    # the survivors leave step 8's aggregation with the healed group, at T + 10; the others step back by 0.5 s
    assert line(points, "group 0", 0)[:3] == [(0, 4.5), (1, 6.5), (2, 7.0)]
    assert (8, 10.0) in line(points, "group 0", 0) and line(points, "group 0", 0)[-1] == (12, 12.0)
    # group 1: steps 0..6 end at the kill (T + 9), nothing between, then 8 at the heal and on from there
    assert line(points, "group 1", 0) == [(0, 4.5), (1, 6.5), (2, 7.0), (3, 7.5), (4, 8.0), (5, 8.5), (6, 9.0)]
    assert line(points, "group 1", 1) == [(8, 10.0), (9, 10.5), (10, 11.0), (11, 11.5), (12, 12.0)]
    assert set(points["part"][points["line"] != "group 1"]) == {0}
    kill, heal = events
    assert (kill["event"], kill["line"], kill["step"], kill["seconds"]) == ("kill", "group 1", 6, 9.0)
    assert kill["falls_to"] == 4  # its last committed aggregation
    assert (heal["event"], heal["step"], heal["seconds"], heal["healed_from"]) == ("heal", 8, 10.0, [0, 2])
    # the aggregation without group 1 is the only one with fewer participants than the most seen
    fewer = points[points["aggregated"] & (points["participants"] < points["participants"].max())]
    assert sorted(zip(fewer["line"], fewer["step"])) == [("group 0", 8), ("group 2", 8)]


def test_elastic_series_needs_one_healed_failure():
    groups = elastic_groups()
    groups[1] = train_rows(1, 12)
    with pytest.raises(ValueError, match="one group healed once"):
        elastic_series(groups, started=T, killed=T + 9.0)


def test_the_static_run_redoes_the_steps_after_its_checkpoint():
    """Killed after step 6 at T + 5, launched again at T + 7, resumed from the step-4 checkpoint;
    its step 5 (0.25 s a step now) ends at T + 12."""
    killed = train_rows(1, 6)
    final = [*killed[:4], *train_rows(5, 8, step_s=0.25), {"split": "eval", "step": 8}]
    moments = {"started": T, "killed": T + 5.0, "relaunched": T + 7.0, "resumed_from": 4, "first_step_seen": T + 12.0}
    points, events = static_series(killed, final, moments)
    assert line(points, "static", 0) == [(0, 0.5), (1, 2.5), (2, 3.0), (3, 3.5), (4, 4.0), (5, 4.5), (6, 5.0)]
    assert line(points, "static", 1) == [(4, 11.75), (5, 12.0), (6, 12.25), (7, 12.5), (8, 12.75)]
    twice = points[points["step"].isin([5, 6])]
    assert sorted(twice["part"]) == [0, 0, 1, 1]
    assert sorted(points.loc[points["redone"], "step"]) == [5, 6]
    assert [(e["event"], e["step"], e["seconds"]) for e in events] == [("kill", 6, 5.0), ("relaunch", 4, 7.0)]
    assert events[0]["falls_to"] == 4
