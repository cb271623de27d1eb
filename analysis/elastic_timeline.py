"""The failure-time chart of experiments/bench_elastic.py (issue 20): one seed's training progress
(the last step completed) against seconds since each run was launched. Top: the elastic run, one
line per federation group: the killed group stops, restarts and heals at a later aggregation while
the others train on (an aggregation without every group is marked). Bottom: the static run with a
checkpoint every 8 steps: the same kill ends it, it is launched again and redoes the steps after the
checkpoint.

The rows hold each step's duration (`time_step`) but no clock. The moments that place them are unix
times: the heal row's `healed_at`, and what the benchmark keeps in SEED_DIR/timeline.json (each
launch, each kill as the killed ranks print it, the resumed run's first step as its row appeared),
beside the killed static run's rows (the resume truncates them from metrics.jsonl). Each stretch of
steps is placed by one step whose end is known and its neighbours' step times (checked on one seed:
the four groups' step-8 aggregation, placed by the kill for one and by the heal for the others, ends
within 21 ms). Time outside `time_step` is not drawn: a few ms a step for the row, and a checkpoint's
write (0.3-1.2 s each on a 2-core machine), so the static run's steps before its checkpoint sit that
much late and its resumed run ends about a second early: in its favour.

    python -m analysis.elastic_timeline RUN_ROOT [--seed 0] -o PATH.png

RUN_ROOT is bench_elastic.py's --out (RUN_ROOT/seed_N/{elastic,static}/).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pandas as pd
import seaborn as sns
from matplotlib.lines import Line2D

from .plotting import plt, save
from .records import RecordError, _read_json_lines

MOMENTS = "timeline.json"  # in SEED_DIR, written by experiments/bench_elastic.py
KILLED_ROWS = "killed_run_metrics.jsonl"  # in the static run's directory, copied before its resume


def segment(
    run: str, line: str, part: int, rows: list[dict], known_step: int, known_at: float, origin: float
) -> list[dict]:
    """One uninterrupted stretch of training rows as points (step, seconds since `origin`): the
    stretch's start (its first step - 1) and each step's end. `known_step` (a row's step, or the
    step before the first) ended at unix time `known_at`; every other end is that moment moved by
    the step times in between."""
    train = [r for r in rows if "split" not in r]
    done = {train[0]["step"] - 1: 0.0}
    for r in train:
        done[r["step"]] = done[r["step"] - 1] + r["time_step"]
    shift = known_at - done[known_step] - origin
    points = [
        {
            "run": run,
            "line": line,
            "part": part,
            "step": train[0]["step"] - 1,
            "seconds": shift,
            "aggregated": False,
            "participants": None,
        }
    ]
    points += [
        {
            "run": run,
            "line": line,
            "part": part,
            "step": r["step"],
            "seconds": done[r["step"]] + shift,
            "aggregated": bool(r.get("aggregated")),
            "participants": r.get("participants"),
        }
        for r in train
    ]
    return points


def last_commit(rows: list[dict]) -> int:
    """The last step a group can continue from: its last committed aggregation (0: none)."""
    return max(
        (r["step"] for r in rows if "split" not in r and r.get("aggregated") and r.get("committed", True)), default=0
    )


def elastic_series(groups: dict[int, list[dict]], started: float, killed: float) -> tuple[pd.DataFrame, list[dict]]:
    """Points of each group's line and the kill and heal events, for an elastic run in which one group
    was killed once and healed (rows: each group's metrics.jsonl, in file order; `killed`: the kill's
    unix time). The survivors are placed by the heal: they leave the aggregation it joins, at the
    heal step, as the healed group does (`healed_at`); the killed group before it by the kill."""
    heals = {g: [r for r in rows if r.get("split") == "heal"] for g, rows in groups.items()}
    failed = [g for g, found in heals.items() if found]
    if len(failed) != 1 or len(heals[failed[0]]) != 1:
        raise ValueError(f"expected one group healed once, found heal rows for groups {failed}")
    down = failed[0]
    heal = heals[down][0]
    points, events = [], []
    for g, rows in sorted(groups.items()):
        line = f"group {g}"
        if g != down:
            points += segment("elastic", line, 0, rows, heal["step"], heal["healed_at"], started)
            continue
        cut = rows.index(heal)
        before, after = rows[:cut], rows[cut + 1 :]
        kill_step = [r for r in before if "split" not in r][-1]["step"]
        points += segment("elastic", line, 0, before, kill_step, killed, started)
        points += segment("elastic", line, 1, after, heal["step"], heal["healed_at"], started)
        events += [
            {
                "run": "elastic",
                "event": "kill",
                "line": line,
                "step": kill_step,
                "seconds": killed - started,
                "falls_to": last_commit(before),
            },
            {
                "run": "elastic",
                "event": "heal",
                "line": line,
                "step": heal["step"],
                "seconds": heal["healed_at"] - started,
                "healed_from": sorted(set(heal["healed_from"])),
            },
        ]
    return pd.DataFrame(points), events


def static_series(killed_rows: list[dict], final_rows: list[dict], moments: dict) -> tuple[pd.DataFrame, list[dict]]:
    """Points of the static run's killed launch and its resumed one (`final_rows`: metrics.jsonl after
    the resume: the killed run's rows up to the checkpoint, then the resumed run's), and the kill and
    the relaunch. `moments` (unix times): started, killed, relaunched, first_step_seen (the resumed
    run's first step ended), and resumed_from (the checkpoint's step). Resumed steps the killed launch
    had done too are marked `redone`."""
    started, checkpoint = moments["started"], moments["resumed_from"]
    kill_step = [r for r in killed_rows if "split" not in r][-1]["step"]
    resumed = [r for r in final_rows if "split" not in r and r["step"] > checkpoint]
    points = segment("static", "static", 0, killed_rows, kill_step, moments["killed"], started)
    points += segment("static", "static", 1, resumed, checkpoint + 1, moments["first_step_seen"], started)
    frame = pd.DataFrame(points)
    frame["redone"] = (frame["part"] == 1) & (frame["step"] > checkpoint) & (frame["step"] <= kill_step)
    events = [
        {
            "run": "static",
            "event": "kill",
            "line": "static",
            "step": kill_step,
            "seconds": moments["killed"] - started,
            "falls_to": checkpoint,
        },
        {
            "run": "static",
            "event": "relaunch",
            "line": "static",
            "step": checkpoint,
            "seconds": moments["relaunched"] - started,
        },
    ]
    return frame, events


def read_seed(seed_dir: Path) -> tuple[tuple[pd.DataFrame, list[dict]], tuple[pd.DataFrame, list[dict]]]:
    """Both runs' series from one seed's directories, as bench_elastic.py lays them out."""
    seed_dir = Path(seed_dir)
    if not (seed_dir / MOMENTS).exists():
        raise RecordError(
            str(seed_dir),
            f"no {MOMENTS}: the moments the chart needs are kept by "
            "experiments/bench_elastic.py; run it (again) with --out",
        )
    moments = json.loads((seed_dir / MOMENTS).read_text())
    elastic, static = seed_dir / "elastic", seed_dir / "static"
    group_dirs = {
        0: elastic,
        **{int(d.name.split("_")[1]): d for d in elastic.glob("group_*")},
    }  # as fldp lays them out
    groups = {g: _read_json_lines(str(d), d / "metrics.jsonl") for g, d in group_dirs.items()}
    return (
        elastic_series(groups, moments["elastic"]["started"], moments["elastic"]["killed"]),
        static_series(
            _read_json_lines(str(static), static / KILLED_ROWS),
            _read_json_lines(str(static), static / "metrics.jsonl"),
            moments["static"],
        ),
    )


def _draw_run(ax, points: pd.DataFrame, events: list[dict], colors: dict) -> None:
    """Lines (last completed step, held until the next step ends), aggregations, the kill (a drop to
    the step the run or group can continue from, held until it trains again) and the heal."""
    groups = points["participants"].max() if points["participants"].notna().any() else None
    killed = {e["line"] for e in events if e["event"] == "kill"}
    for (line, part), p in points.groupby(["line", "part"], sort=True):
        ax.plot(
            p["seconds"],
            p["step"],
            drawstyle="steps-post",
            color=colors[line],
            lw=2.2 if line in killed else 1.2,
            label=(line if line != "static" else "all groups") if part == 0 else None,
        )
        agg = p[p["aggregated"]]
        full = agg if groups is None else agg[agg["participants"] >= groups]
        ax.plot(full["seconds"], full["step"], "o", ms=3.5, color=colors[line])
        fewer = agg.drop(full.index)
        ax.plot(fewer["seconds"], fewer["step"], "D", ms=10, mfc="none", mec="black", mew=1.2, zorder=5)
        if "redone" in p:
            redone = p[p["redone"] | p["redone"].shift(-1, fill_value=False)]
            ax.plot(redone["seconds"], redone["step"], drawstyle="steps-post", color="tab:orange", lw=4, alpha=0.6)
    for e in events:
        if e["event"] == "kill":
            again = points[(points["line"] == e["line"]) & (points["part"] == 1)].iloc[0]  # where it trains again
            ax.plot(
                [e["seconds"], e["seconds"], again["seconds"], again["seconds"]],
                [e["step"], e["falls_to"], e["falls_to"], again["step"]],
                ":",
                color="tab:red",
                lw=1.2,
            )
            ax.plot(e["seconds"], e["step"], "X", ms=9, color="tab:red", zorder=6)
        elif e["event"] == "heal":
            ax.plot(e["seconds"], e["step"], "*", ms=11, color="gold", mec="black", mew=0.6, zorder=4)
            src = ", ".join(str(g) for g in e["healed_from"])
            ax.annotate(
                f"healed from group{'s' if len(e['healed_from']) > 1 else ''} {src}",
                (e["seconds"], e["step"]),
                xytext=(8, -12),
                textcoords="offset points",
                fontsize=7,
            )
        elif e["event"] == "relaunch":
            ax.axvline(e["seconds"], color="grey", ls="--", lw=1)
            ax.annotate(
                "launched again", (e["seconds"], e["step"]), xytext=(4, 4), textcoords="offset points", fontsize=7
            )


def timeline_figure(
    elastic: tuple[pd.DataFrame, list[dict]], static: tuple[pd.DataFrame, list[dict]], title: str | None = None
):
    sns.set_theme(style="whitegrid", context="paper")
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7.2, 6.0), sharex=True, layout="constrained")
    lines = sorted(elastic[0]["line"].unique(), key=lambda s: int(s.split()[-1]))
    colors = dict(zip(lines, sns.color_palette("colorblind", n_colors=len(lines))), static="tab:blue")
    _draw_run(top, *elastic, colors)
    _draw_run(bottom, *static, colors)
    kill = next(e for e in elastic[1] if e["event"] == "kill")
    top.set_title(
        f"elastic federation: {kill['line']} killed after step {kill['step']}, restarted, healed "
        "at an aggregation; the others train on",
        fontsize=9,
    )
    skill = next(e for e in static[1] if e["event"] == "kill")
    bottom.set_title(
        f"static federation: killed after step {skill['step']}, launched again, resumed from its "
        f"step-{skill['falls_to']} checkpoint",
        fontsize=9,
    )
    n = int(elastic[0]["participants"].max())
    keys = [
        Line2D([], [], ls="none", marker="o", color="grey", ms=3.5, label="aggregation"),
        Line2D([], [], ls="none", marker="D", mfc="none", mec="black", ms=7, label=f"aggregation of < {n} groups"),
        Line2D([], [], ls="none", marker="X", color="tab:red", ms=9, label="SIGKILL"),
        Line2D([], [], ls=":", color="tab:red", label="the step it can continue from"),
        Line2D([], [], ls="none", marker="*", color="gold", mec="black", ms=11, label="healed from live groups"),
        Line2D([], [], color="tab:orange", lw=4, alpha=0.6, label="steps redone"),
    ]
    top.legend(handles=top.get_legend_handles_labels()[0] + keys[:5], fontsize=7, loc="upper left", ncols=2)
    bottom.legend(
        handles=[*bottom.get_legend_handles_labels()[0], keys[0], *keys[2:4], keys[5]],
        fontsize=7,
        loc="upper left",
        ncols=2,
    )
    steps = int(max(elastic[0]["step"].max(), static[0]["step"].max()))
    for ax in (top, bottom):
        ax.set_ylabel("last step completed")
        ax.set_ylim(0, steps + 2)
        ax.set_yticks(range(0, steps + 1, 8))
    bottom.set_xlabel("seconds since the run was launched (python -m fldp.train)")
    bottom.set_xlim(left=0)
    if title:
        fig.suptitle(title, fontsize=10)
    return fig


def save_chart(run_root: Path, seed: int, out: Path, title: str | None = None) -> Path:
    """The chart of RUN_ROOT/seed_N, as a PNG small enough for the README (dpi 110)."""
    fig = timeline_figure(*read_seed(Path(run_root) / f"seed_{seed}"), title=title)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    save(fig, out, 110)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m analysis.elastic_timeline",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("run_root", type=Path, metavar="RUN_ROOT", help="experiments/bench_elastic.py's --out")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("-o", "--out", type=Path, required=True, help="the PNG to write")
    parser.add_argument("--title", default=None, help="a line above both panels")
    args = parser.parse_args(argv)
    try:
        path = save_chart(args.run_root, args.seed, args.out, args.title)
    except RecordError as e:
        print(f"analysis.elastic_timeline: {e}", file=sys.stderr)
        return 1
    print(f"analysis.elastic_timeline: wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
