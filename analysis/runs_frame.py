"""A study's runs as a table, and what its report needs beside them: one row per run (`frame`),
every run's loss curve (losses.csv.gz), a report made again from an earlier one's per-run numbers
(`banked`), another study's committed results (`committed`, `beside_committed`), how a verdict is
shown and whether it changed (`displayed`, `changed`), and the plan quoted (`plan_quote`)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pandas as pd


def frame(runs) -> pd.DataFrame:
    """One row per run: what a study's verdicts and runs.csv need (analysis.study adds where it ran:
    its phase, run id and arm)."""
    rows = []
    for run in runs:
        s = run.summary
        rows.append(
            {
                "algorithm": s["algorithm"],
                "seed": s["seed"],
                "lr": float(run.config.get("optimizer.lr", math.nan)),
                "precision": s["precision"],
                "F": s["federation"],
                "R": s["replicate"],
                "S": s["shard"],
                "sequences_per_group": s["replicate"] * s["shard"] * s["batch_size"],
                "steps": s["steps"],
                "A": s.get("every"),
                "eval_loss": s["eval_loss"],
                "eval_perplexity": s["eval_perplexity"],
                "train_time_s": s["train_time_s"],
                "model": s.get("model", ""),
                "params": s.get("params"),  # absent from runs made before the model-size ladder
                "params_non_embedding": s.get("params_non_embedding"),
                "executor": s.get("executor", ""),
                "commit": s.get("commit", ""),
                "step": list(run.steps["step"]),
                "loss": list(run.steps["loss"]),
            }
        )
    return pd.DataFrame(rows)


LOSSES = "losses.csv.gz"


def losses(df: pd.DataFrame, out: Path) -> Path:
    """Every run's training loss at every step, one row each (run, phase, algorithm, lr, seed, step,
    loss): runs.csv keeps one number per run, and the curves cannot be re-derived without rerunning
    the study (issue 33). gzip's mtime fixed at 0: the same runs give the same bytes."""
    keys = [c for c in ("run", "phase", "arm", "algorithm", "reductions", "block", "lr", "seed") if c in df.columns]
    rows = df[[*keys, "step", "loss"]].explode(["step", "loss"])
    path = out / LOSSES
    rows.sort_values(["run", "step"], kind="stable").to_csv(
        path, index=False, compression={"method": "gzip", "mtime": 0}
    )
    return path


def banked(df: pd.DataFrame, results: Path, allow_mixed: bool) -> pd.DataFrame:
    """df with the rows of RESULTS/runs.csv whose run df lacks, each with its training losses from
    RESULTS/losses.csv.gz: a report made again after new runs, from the per-run numbers an earlier
    report committed. Rows of other commits than df's are refused (exit 2) unless allow_mixed."""
    earlier = pd.read_csv(results / "runs.csv")
    if df.empty:  # every row from the earlier report (a report made again from its numbers)
        df = pd.DataFrame(columns=[*earlier.columns, "step", "loss"])
    earlier = earlier[~earlier["run"].isin(set(df["run"]))]
    curves = pd.read_csv(results / LOSSES).groupby("run")
    missing = sorted(set(earlier["run"]) - set(curves.groups))
    if missing:
        raise SystemExit(f"--banked {results}: no training losses for {len(missing)} runs, e.g. {missing[0]}")
    ours = set(df["commit"].astype(str)) or set(earlier["commit"].astype(str)[:1])  # none: the earlier's first
    commits = set(earlier["commit"].astype(str)) - ours
    if commits and not allow_mixed:
        print(
            f"--banked {results}: its runs come from other commits ({', '.join(sorted(commits))}). "
            "Nothing written: pass --allow-mixed to report them together",
            file=sys.stderr,
        )
        raise SystemExit(2)
    earlier = earlier.assign(
        step=[list(curves.get_group(r)["step"]) for r in earlier["run"]],
        loss=[list(curves.get_group(r)["loss"]) for r in earlier["run"]],
    )
    earlier = earlier[[c for c in df.columns if c in earlier.columns]]
    return earlier.reset_index(drop=True) if df.empty else pd.concat([df, earlier], ignore_index=True)


def committed_runs(results: Path, phase: str) -> pd.DataFrame:
    """The committed report's runs of `phase` (RESULTS/runs.csv), empty where this checkout has
    none (an installed analysis)."""
    path = results / "runs.csv"
    if not path.exists():
        return pd.DataFrame()
    table = pd.read_csv(path)
    return table[table["phase"] == phase].reset_index(drop=True)


SAME_RUN = ["algorithm", "seed", "steps", "F", "R", "S"]  # a rerun of a run: the same arm, seed, length and mesh


def beside_committed(runs: pd.DataFrame, column: str, results: Path) -> pd.DataFrame:
    """Each of `runs` beside the committed judging run it reruns (SAME_RUN; in RESULTS/runs.csv):
    its `column`, the committed one (`column`_committed), both commits and the relative
    difference; empty where none is committed."""
    then = committed_runs(results, "judge")
    if then.empty or runs.empty:
        return pd.DataFrame()
    keep = [*SAME_RUN, column, "commit"]
    both = runs[keep].merge(then[keep], on=SAME_RUN, suffixes=("", "_committed"))
    both["relative_difference"] = both[column] / both[f"{column}_committed"] - 1
    return both.sort_values(SAME_RUN).reset_index(drop=True)


def changed(now: str, then: str) -> str:
    """Whether a later study's direction for a claim changes the committed one: only where it is
    decided (reproduced, opposite or tie; not inconclusive, not too few seeds) and differs."""
    if now not in ("reproduced", "opposite", "tie"):
        return f"undecided ({now})"
    return "yes" if now != then else "no"


def displayed(table: pd.DataFrame, target: float) -> pd.DataFrame:
    """judge's table (with `half_width`) as a study's report shows it: each interval with its level,
    whether its half-width meets the plan's target, the paper's value to 2 decimals (blank: none)."""
    return table.assign(
        interval=[
            f"{r:.3f} [{lo:.3f}, {hi:.3f}] at {lv:.4f}"
            for r, lo, hi, lv in zip(table["ratio"], table["lo"], table["hi"], table["level"])
        ],
        target=["met" if w <= target else "MISSED" for w in table["half_width"]],
        paper=table["paper"].map(lambda v: "" if math.isnan(v) else f"{v:.2f}"),
    )


def plan_quote(plan_path: Path) -> str:
    if plan_path.exists():
        plan = plan_path.read_text().splitlines()
    elif (plan_path.parent / "study.yaml").exists():  # the tiny study's: written before the pre-registered ones
        plan = ["(none: the study was not pre-registered; its spec says what it runs and reports)"]
    else:
        plan = ["(not found: an installed analysis has no experiments/)"]
    shown = "/".join(plan_path.parts[-3:])
    return f"## The plan\n\n(quoted from {shown})\n\n" + "\n".join("> " + line for line in plan)
