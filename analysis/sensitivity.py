"""The sensitivity study (experiments/sensitivity/PLAN.md): its report.

    python -m analysis.sensitivity RUNS --out DIR [--elapsed S] [--strict]

Every run says which phase made it by its directory (RUNS/base/..., RUNS/paper_lr/...,
RUNS/clip/...). The report: runs.csv, losses.csv.gz, findings.csv (the paper-shape study's three
claims on the paper_lr runs and on the clip runs: two families, each beside the committed
direction), effects.csv (each arm under each setting against its base run of the same seed),
rerun.csv (each base run against the paper-shape study's committed run of its arm and seed),
figure.png and report.md, which quotes the plan."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only

import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

from .paper_shape import (
    CLAIMS,
    beside_committed,
    changed,
    committed,
    displayed,
    losses,
    no_decisions,
    plan_quote,
    run_study,
    stood_for,
)  # noqa: E402
from .paper_shape import frame as shape_frame  # noqa: E402
from .render import markdown  # noqa: E402
from .science import paper_ratio  # noqa: E402
from .stats import Claim, explore, judge, paired_ratio  # noqa: E402
from .tables import NAMES  # noqa: E402

PLAN = Path(__file__).resolve().parents[1] / "experiments" / "sensitivity" / "PLAN.md"
ARMS = ("fsdp", "fl_fsdp", "fl_hsdp")
SETTINGS = {"paper_lr": "the paper's lr 3e-4", "clip": "clip 1.0 at lr 1e-2"}  # judged phases: their family
TARGET = 0.02
NOT_YET = "The base phase has not run yet (experiments/sensitivity.sh runs it; --banked takes it from a later report)"
SHOWN = [
    "claim",
    "setting",
    "interval",
    "paper",
    "direction",
    "size",
    "seeds",
    "target",
    "paper-shape direction",
    "changed",
]


def frame(runs) -> pd.DataFrame:
    """paper_shape's one row per run, with its clipping norm (NaN: none)."""
    df = shape_frame(runs)
    clip = [run.config.get("optimizer.clip_norm") for run in runs]
    df.insert(5, "clip_norm", [math.nan if c is None else float(c) for c in clip])
    return df


def arm(df: pd.DataFrame, algorithm: str, phase: str) -> pd.Series:
    """Eval perplexity by seed."""
    sel = df[(df["phase"] == phase) & (df["algorithm"] == algorithm)]
    return sel.drop_duplicates("seed").set_index("seed")["eval_perplexity"]


def claims(df: pd.DataFrame, phase: str, paper: dict) -> list[Claim]:
    """The paper-shape study's three claims on one phase's runs."""
    return [
        Claim(name, arm(df, num, phase), arm(df, den, phase), paper_ratio(paper, num, den))
        for name, num, den, _ in CLAIMS
    ]


def findings(df: pd.DataFrame, paper: dict) -> pd.DataFrame:
    """Each setting's family judged alone, beside the paper-shape study's committed direction."""
    then = committed("findings.csv")
    tables = []
    for phase, setting in SETTINGS.items():
        if not (df["phase"] == phase).any():
            continue
        t = stood_for(judge(claims(df, phase, paper)), paper)
        t.insert(1, "setting", setting)
        t["half_width"] = t["hi"] / t["ratio"] - 1
        t["paper_shape_direction"] = list(then["direction"]) if not then.empty else ""
        t["changed"] = [changed(now, was) for now, was in zip(t["direction"], t["paper_shape_direction"])]
        tables.append(t)
    return pd.concat(tables, ignore_index=True) if tables else pd.DataFrame()


def base_beside(df: pd.DataFrame, paper: dict) -> pd.DataFrame:
    """The three claims on the base runs (plain 95%, reported) beside the committed intervals."""
    now, then = explore(claims(df, "base", paper)), committed("findings.csv")
    rows = []
    for i, r in now.iterrows():
        row = {"claim": r["claim"], "rerun": f"{r['ratio']:.3f} [{r['lo']:.3f}, {r['hi']:.3f}] {r['direction']}"}
        if not then.empty:
            c = then.iloc[i]
            row["committed (paper-shape study)"] = f"{c['ratio']:.3f} [{c['lo']:.3f}, {c['hi']:.3f}] {c['direction']}"
        rows.append(row)
    return pd.DataFrame(rows)


def effects(df: pd.DataFrame) -> pd.DataFrame:
    """X-setting / X-base for each arm and setting, paired by seed, 95% t interval (reported)."""
    rows = []
    for phase, setting in SETTINGS.items():
        for a in ARMS:
            r = paired_ratio(arm(df, a, phase), arm(df, a, "base"))
            rows.append(
                {
                    "setting": setting,
                    "arm": NAMES.get(a, a),
                    "ratio": r.ratio,
                    "lo": r.low,
                    "hi": r.high,
                    "seeds": r.seeds,
                }
            )
    return pd.DataFrame(rows)


def rerun(df: pd.DataFrame) -> pd.DataFrame:
    """Each base run's final eval perplexity against the committed judging run it reruns."""
    return beside_committed(df[df["phase"] == "base"], "eval_perplexity")


def rerun_summary(table: pd.DataFrame) -> str:
    if table.empty:
        return "No base run shares its arm, seed, length and mesh with a committed judging run."
    gap = table["relative_difference"].abs()
    per_arm = table.assign(gap=gap).groupby("algorithm")["gap"].max()
    return (
        f"{len(table)} base runs against the committed judging runs of their arm and seed: "
        f"{int((gap == 0).sum())} identical; the largest relative difference of the final eval perplexity "
        + ", ".join(f"{NAMES.get(a, a)} {v:.1e}" for a, v in per_arm.items())
        + "."
    )


def figure(df: pd.DataFrame, out: Path) -> None:
    """Left: each arm's final perplexity per seed in each phase; right: each arm's mean training loss
    per step in each phase (line style: the phase)."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    phases = ["base", *SETTINGS]
    styles = dict(zip(phases, ("-", "--", ":")))
    for j, phase in enumerate(phases):
        for i, a in enumerate(ARMS):
            v = arm(df, a, phase)
            left.scatter([i + 0.2 * (j - 1)] * len(v), v, alpha=0.6, color=f"C{j}", label=phase if i == 0 else None)
            runs = df[(df["phase"] == phase) & (df["algorithm"] == a)]
            if len(runs):
                curve = pd.DataFrame([dict(zip(s, x)) for s, x in zip(runs["step"], runs["loss"])]).mean()
                right.plot(curve.index, curve.values, styles[phase], color=f"C{i}", label=f"{NAMES.get(a, a)} {phase}")
    left.set_xticks(range(len(ARMS)), [NAMES.get(a, a) for a in ARMS])
    left.set(yscale="log", ylabel="final eval perplexity (each seed)", title="arms by phase")
    left.legend(title="phase")
    right.set(xlabel="step", ylabel="training loss (mean over seeds)", title="loss curves")
    right.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    fig.savefig(out / "figure.png", dpi=120)
    plt.close(fig)


def report(df: pd.DataFrame, paper: dict, out: Path, command: str, elapsed: float | None) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    df.drop(columns=["step", "loss"]).sort_values(["phase", "algorithm", "seed"]).to_csv(out / "runs.csv", index=False)
    losses(df, out)
    has_base = bool((df["phase"] == "base").any())
    parts = [
        f"# The sensitivity study\n\n`{command}`"
        + (f"; runs took {elapsed / 60:.1f} min" if elapsed else "")
        + f". {len(df)} runs: one row each in runs.csv, every step's training loss in losses.csv.gz.\n",
        "## The paper-shape judging runs again (base)\n",
    ]
    if has_base:  # a phase may run in a later session: the settings' families are judged without it
        again = rerun(df)
        again.to_csv(out / "rerun.csv", index=False)
        parts += [f"{rerun_summary(again)}\n", markdown(base_beside(df, paper)), ""]
    else:
        parts.append(f"{NOT_YET}: no rerun.csv, and no effects.csv (each setting against its base runs).\n")
    table = findings(df, paper)
    if not table.empty:
        table.to_csv(out / "findings.csv", index=False)
        shown = displayed(table, TARGET).rename(columns={"paper_shape_direction": "paper-shape direction"})
        parts += [
            "## Verdicts (a family of 3 per setting: Holm for the direction, Bonferroni intervals)\n",
            markdown(shown[SHOWN]),
            "",
        ]
        parts.append("## What each setting does to each arm (X-setting / X-base, 95%, reported)\n")
        if has_base:
            effect = effects(df)
            effect.to_csv(out / "effects.csv", index=False)
            parts += [markdown(effect.round(3)), ""]
        else:
            parts.append(f"{NOT_YET}.\n")
    figure(df, out)
    parts += ["![final perplexities and loss curves](figure.png)\n", plan_quote(PLAN)]
    path = out / "report.md"
    path.write_text("\n".join(parts) + "\n")
    return path


def main(argv: list[str] | None = None) -> int:
    return run_study("analysis.sensitivity", __doc__, frame, no_decisions, report, argv)


if __name__ == "__main__":
    sys.exit(main())
