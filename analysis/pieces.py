"""Named pieces of a study's report, asked for by name in its spec (analysis.spec.PIECES): each
may add columns to the one row per run (COLUMNS) and adds a section to report.md (SECTIONS).

- noise_scale: each run's mean gradient-noise terms (fldp.noise_scale) and, per phase, algorithm and
  block length, B_simple against the tokens a group steps on (noise.csv).
- reruns: a phase's runs beside the runs of another study's committed judging phase they repeat
  (the same algorithm, seed, steps and mesh), on a metric (rerun.csv): does the code still compute
  what it computed then.
- identical: a phase's runs beside another arm's runs of their seed: the same records? (HSDP is
  FSDP's computation in the simulator.)
- slope: the model-size ladder's lines (analysis.slope): each [NUM, DEN] pair's log ratio against
  log N over the rungs (arms NUM-RUNG, DEN-RUNG), its slope, crossing and value at `at` parameters;
  rows of findings.csv (FINDINGS) and a figure of the ratios against N (ladder.png).
- best_lr, by_lr, drift, batch_control, frontier, tables34: the tiny study's controls
  (analysis.science_pieces)."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pandas as pd

from . import paper as paper_values
from .arms import METRIC, algorithm_of, arm, geometric_mean
from .paper import paper_ratio
from .plotting import plt, save
from .render import markdown
from .runs_frame import beside_committed
from .science_pieces import (
    batch_control_section,
    best_lr_findings,
    best_lr_section,
    by_lr_section,
    drift_section,
    frontier_section,
    tables34_section,
)
from .slope import crossing, fit, lack_of_fit
from .spec import Study
from .stats import LEVEL
from .tables import NAMES


def block_and_noise(run) -> dict:
    """A run's block length, tokens per group step and mean noise terms over its measured steps."""
    s, block = run.summary, int(run.config.get("dataset.block_size", 0))
    means = {t: run.steps[t].mean() if t in run.steps else math.nan for t in ("noise_trace", "noise_signal")}
    return {"block": block, "tokens_per_group_step": s["replicate"] * s["shard"] * s["batch_size"] * block, **means}


def noise_table(df: pd.DataFrame) -> pd.DataFrame:
    """Per phase, algorithm and block: B_simple = mean trace / mean signal per run, geometric mean
    over seeds, in sequences and tokens, beside the tokens each group steps on."""
    measured = df[df["noise_signal"].notna() & (df["noise_signal"] > 0)].copy()
    measured["b_simple"] = measured["noise_trace"] / measured["noise_signal"]
    table = (
        measured.groupby(["phase", "algorithm", "block"])
        .agg(
            steps=("steps", "first"),
            runs=("b_simple", "size"),
            b_simple_sequences=("b_simple", geometric_mean),
            tokens_per_group_step=("tokens_per_group_step", "first"),
        )
        .reset_index()
    )
    table["b_simple_tokens"] = table["b_simple_sequences"] * table["block"]
    table["group_step_over_b_simple"] = table["tokens_per_group_step"] / table["b_simple_tokens"]
    return table


def noise_figure(table: pd.DataFrame, path: Path) -> None:
    """Each phase and algorithm's B_simple in tokens against its tokens per group step, by block
    length (the diagonal: a group batch at B_simple)."""
    fig, ax = plt.subplots(figsize=(6, 4.5))
    for (phase, algorithm), rows in table.groupby(["phase", "algorithm"]):
        ax.plot(rows["tokens_per_group_step"], rows["b_simple_tokens"], "o-", label=f"{algorithm} ({phase})")
    values = pd.concat([table["tokens_per_group_step"], table["b_simple_tokens"]])
    lims = [values.min() / 2, values.max() * 2] if len(values) else [1e2, 1e5]
    ax.plot(lims, lims, color="grey", lw=0.8, ls="--")
    ax.set(xscale="log", yscale="log", xlabel="tokens per group step", ylabel="B_simple (tokens)")
    ax.set_title("gradient noise scale (dashed: a group batch at B_simple)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    save(fig, path, 120)


def noise_section(df: pd.DataFrame, study: Study, out: Path) -> list[str]:
    table = noise_table(df)
    table.to_csv(out / "noise.csv", index=False)
    noise_figure(table, out / "noise.png")
    return ["## Gradient noise scale\n", markdown(table.round(3)), "", "![noise scale](noise.png)\n"]


def reruns_section(df: pd.DataFrame, study: Study, out: Path, phase: str, of: str, metric: str) -> list[str]:
    """rerun.csv: each of the phase's runs beside the committed run it repeats, on `metric`."""
    table = beside_committed(df[df["phase"] == phase], metric, study.directory.parent / of / "results")
    table.to_csv(out / "rerun.csv", index=False)
    if table.empty:
        found = f"not checked (no {phase} run repeats a committed {of} judging run)"
    else:
        gap = table["relative_difference"].abs()
        per_algorithm = table.assign(gap=gap).groupby("algorithm")["gap"].max()
        found = (
            f"{len(table)} runs, {int((gap == 0).sum())} identical; the largest relative difference of {metric} "
            + ", ".join(f"{a} {v:.1e}" for a, v in per_algorithm.items())
        )
    return [f"## Reruns of the {of} study's judging runs\n\nThe {phase} runs that repeat one: {found}.\n"]


def identical_section(df: pd.DataFrame, study: Study, out: Path, phase: str, to: str) -> list[str]:
    """Each of the phase's runs beside arm `to`'s run of its seed (and tuned value): are every
    training loss and the eval loss the same (HSDP against FSDP: one computation in the simulator)."""
    lines = []
    key = study.tune.key if study.tune else None
    for _, run in df[df["phase"] == phase].drop_duplicates("run").iterrows():
        same = (df["arm"] == to) & (df["seed"] == run["seed"]) & (df["phase"] != phase)
        if key in df.columns:
            same &= df[key] == run[key]
        if not same.any():
            lines.append(f"{run['arm']} seed {run['seed']}: no {to} run of its seed to set it beside")
            continue
        other = df[same].iloc[0]
        equal = other["loss"] == run["loss"] and other["eval_loss"] == run["eval_loss"]
        what = "identical to" if equal else "DIFFER from"
        lines.append(f"{run['arm']} seed {run['seed']}: every training loss and the eval loss {what} {to}'s")
    return [f"## {phase}: the same records as {to}?\n", *[f"- {line}" for line in lines], ""]


SHOWN = {**NAMES, "diloco_hsdp": "DiLoCo"}


def ladder_points(df: pd.DataFrame, phases: list[str], rungs: list[str], num: str, den: str) -> pd.DataFrame:
    """One row per rung and paired seed: the rung's N (params_non_embedding) and ln(num / den)."""
    rows = []
    for rung in rungs:
        a, b = arm(df, f"{num}-{rung}", tuple(phases)), arm(df, f"{den}-{rung}", tuple(phases))
        sizes = df.loc[df["arm"] == f"{num}-{rung}", "params_non_embedding"].dropna()
        for seed in sorted(set(a.index) & set(b.index)):
            rows.append({"rung": rung, "N": float(sizes.iloc[0]), "seed": seed, "y": math.log(a[seed] / b[seed])})
    return pd.DataFrame(rows, columns=["rung", "N", "seed", "y"])


def pair_name(study: Study, num: str, den: str, rung: str) -> tuple[str, float]:
    """'FSDP / FL+HSDP' and the paper's value of it (nan where the paper has none)."""
    a, b = algorithm_of(study, f"{num}-{rung}"), algorithm_of(study, f"{den}-{rung}")
    try:
        value = paper_ratio(paper_values.load(), a, b)
    except KeyError:
        value = math.nan
    return f"{SHOWN.get(a, a)} / {SHOWN.get(b, b)}", value


def slope_row(points: pd.DataFrame, name: str, paper: float, at: float, level: float) -> dict:
    x, y = np.log(points["N"].to_numpy()), points["y"].to_numpy()
    line = fit(x, y, level)
    lo, hi = line.slope_interval()
    verdict, n_star, n_lo, n_hi = crossing(line, float(x.min()), float(x.max()))
    there = [math.exp(v) for v in line.at(math.log(at))]
    return {
        "claim": f"{name} against N", "rungs": points["rung"].nunique(), "points": len(points), "level": level,
        "slope": line.slope, "slope_lo": lo, "slope_hi": hi, "trend": line.trend(),
        "crossing": verdict, "crossing_N": n_star, "crossing_lo": n_lo, "crossing_hi": n_hi,
        "at_N": at, "at": there[0], "at_lo": there[1], "at_hi": there[2], "paper": paper,
        "paper_inside": there[1] <= paper <= there[2] if paper == paper else None,
        "lack_of_fit_p": lack_of_fit(x, y, line),
    }  # fmt: skip


def slope_findings(df: pd.DataFrame, study: Study, phases, rungs, primary, secondary, at) -> pd.DataFrame:
    """findings.csv's slope rows: the primary pairs' at 1 - 0.05 / m each (Bonferroni: together at
    least 95%), the secondary's at 95% alone; a pair with points at fewer than two rungs is left out."""
    rows = []
    for family, pairs, level in (
        ("slope (primary)", primary, 1 - (1 - LEVEL) / len(primary)),
        ("slope (secondary)", secondary, LEVEL),
    ):
        for num, den in pairs:
            points = ladder_points(df, phases, rungs, num, den)
            if points["rung"].nunique() < 2 or len(points) < 3:
                continue
            name, paper = pair_name(study, num, den, rungs[0])
            rows.append({"family": family, **slope_row(points, name, paper, at, level)})
    return pd.DataFrame(rows)


def slope_figure(df: pd.DataFrame, study: Study, out: Path, args: dict, table: pd.DataFrame) -> None:
    """Each pair's per-seed ratios and rung means against N (log axes), the fitted line and its
    band carried to `at`, and the paper's value there."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, (num, den) in enumerate([*args["primary"], *args["secondary"]]):
        points = ladder_points(df, args["phases"], args["rungs"], num, den)
        name, paper = pair_name(study, num, den, args["rungs"][0])
        ax.scatter(points["N"], np.exp(points["y"]), s=10, alpha=0.4, color=f"C{i}")
        means = points.groupby("N")["y"].mean()
        ax.plot(means.index, np.exp(means), "o", color=f"C{i}", label=name)
        row = table[table["claim"] == f"{name} against N"]
        if not row.empty:
            r = row.iloc[0]
            xs = np.geomspace(points["N"].min(), args["at"], 60)
            y0 = math.log(r["at"]) - r["slope"] * math.log(args["at"])
            ax.plot(xs, np.exp(y0 + r["slope"] * np.log(xs)), "--", color=f"C{i}", lw=1)
            ax.errorbar([args["at"]], [r["at"]], yerr=[[r["at"] - r["at_lo"]], [r["at_hi"] - r["at"]]], color=f"C{i}")
        if paper == paper:
            ax.scatter([args["at"]], [paper], marker="x", s=60, color=f"C{i}")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set(xscale="log", yscale="log", xlabel="N (non-embedding parameters)", ylabel=f"ratio of {METRIC}")
    ax.set_title("ratio against model size; x: the paper at 8B; bar at 8B: extrapolation", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    save(fig, out / "ladder.png", 120)


def slope_section(df: pd.DataFrame, study: Study, out: Path, phases, rungs, primary, secondary, at) -> list[str]:
    args = {"phases": phases, "rungs": rungs, "primary": primary, "secondary": secondary, "at": at}
    table = slope_findings(df, study, **args)
    if table.empty:
        return []
    slope_figure(df, study, out, args, table)
    shown = table.assign(
        slope=[f"{s:+.3f} [{lo:+.3f}, {hi:+.3f}]" for s, lo, hi in zip(table.slope, table.slope_lo, table.slope_hi)],
        crossing=[
            f"{c}: {n / 1e6:.3g} M [{lo / 1e6:.3g}, {hi / 1e6:.3g}]" if n == n else c
            for c, n, lo, hi in zip(table.crossing, table.crossing_N, table.crossing_lo, table.crossing_hi)
        ],
        extrapolated=[f"{a:.2f} [{lo:.2f}, {hi:.2f}]" for a, lo, hi in zip(table["at"], table.at_lo, table.at_hi)],
    )
    columns = ["family", "claim", "rungs", "points", "level", "slope", "trend", "crossing", "extrapolated", "paper"]
    return [
        "## The ratios against model size (piece `slope`)\n",
        f"Per e-fold of N; `extrapolated`: the line at N = {args['at']:.3g}, an extrapolation past the ladder.\n",
        markdown(shown[[*columns, "paper_inside", "lack_of_fit_p"]].round(3)),
        "\n![ratios against N](ladder.png)\n",
    ]


COLUMNS = {"noise_scale": block_and_noise}
# each takes (df, study, out) and its spec arguments
SECTIONS: dict[str, Callable[..., list[str]]] = {
    "noise_scale": noise_section,
    "reruns": reruns_section,
    "identical": identical_section,
    "slope": slope_section,
    "best_lr": best_lr_section,
    "by_lr": by_lr_section,
    "drift": drift_section,
    "batch_control": batch_control_section,
    "frontier": frontier_section,
    "tables34": tables34_section,
}
# rows a piece adds to findings.csv, each taking (df, study) and its spec arguments
FINDINGS: dict[str, Callable[..., pd.DataFrame]] = {"slope": slope_findings, "best_lr": best_lr_findings}


def sections(df: pd.DataFrame, study: Study, out: Path) -> list[str]:
    """Every piece's section, in the spec's order."""
    return [line for piece in study.pieces for line in SECTIONS[piece.name](df, study, out, **piece.args)]


def findings_rows(df: pd.DataFrame, study: Study) -> list[pd.DataFrame]:
    return [FINDINGS[p.name](df, study, **p.args) for p in study.pieces if p.name in FINDINGS]
