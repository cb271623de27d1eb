"""The tiny study's pieces (experiments/science/study.yaml; analysis.pieces names them): the controls
the paper lacks, beside its five perplexity claims.

- best_lr: the claims of a family with each algorithm at its best lr over some phases (lowest mean
  log metric, picked on the same seeds: exploratory), rows of findings.csv; lr.csv: each algorithm's
  geometric-mean metric [95% interval] per lr and its best lr.
- by_lr: families of the same claims at different lrs side by side, a column per lr (findings_by_lr.csv).
- drift: [NUM, DEN(, LABEL)] arm pairs that compute the same mathematics (HSDP and FSDP; FedAvg summed
  in bf16 and in fp32): their training losses step by step and their eval perplexity ratio (drift.csv,
  drift.png).
- batch_control: an FL arm against FSDP/HSDP on its full batch and on one group's per-update batch,
  for as many steps and for F times as many (batch_control.csv).
- frontier: the eval perplexity against the training time at every A, relative to FSDP's of the same
  seed, on the seeds every point ran (frontier.csv, frontier.png).
- tables34: Tables 3-4 of a phase's runs (analysis.report), from its run directories."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd
import seaborn as sns

from . import paper as paper_values
from .arms import METRIC, algorithm_of, claims
from .paper import paper_ratio
from .plotting import plt, save
from .render import markdown
from .spec import Study
from .stats import MIN_SEEDS, TIE_HIGH, TIE_LOW, Claim, Ratio, explore, interval_text, mean_interval, paired_ratio, size
from .tables import NAMES, ORDER

BEST_LR = "fp32, each one's best lr (picked on these seeds)"


def runs_of(df: pd.DataFrame, name: str) -> pd.DataFrame:
    """An arm's runs by seed, in whichever phase (the tiny study's arm names are its phases')."""
    return df[df["arm"] == name].drop_duplicates("seed").set_index("seed")


def label(r: Ratio, below: str, above: str) -> str:
    """An exploratory ratio's direction in words, `below` / `above` naming what an ordering means."""
    return {
        "n/a": f"n/a (fewer than {MIN_SEEDS} seeds)",
        "<": below,
        ">": above,
        "tie": f"tie (interval within {TIE_LOW:.3f}-{TIE_HIGH:.3f})",
        "inconclusive": "inconclusive (interval spans the tie band)",
    }[r.verdict]


def named_family(study: Study, name: str):
    return next(f for f in study.families if f.name == name)


# --- best_lr ----------------------------------------------------------------------------------------


def phase_runs(df: pd.DataFrame, phases) -> pd.DataFrame:
    """The phases' runs, one row each."""
    return df[df["phase"].isin(phases)].drop_duplicates("run")


def best_lrs(runs: pd.DataFrame) -> dict[str, float]:
    """Each algorithm's lr with the lowest mean log metric."""
    logs = runs.groupby(["algorithm", "lr"])[METRIC].apply(lambda v: v.map(math.log).mean())
    return {a: float(logs[a].idxmin()) for a in logs.index.get_level_values(0).unique()}


def at_lr(runs: pd.DataFrame, algorithm: str, lr: float) -> pd.Series:
    sel = runs[(runs["algorithm"] == algorithm) & (runs["lr"] == lr)]
    return sel.drop_duplicates("seed").set_index("seed")[METRIC]


def best_lr_findings(df: pd.DataFrame, study: Study, phases, family: str) -> pd.DataFrame:
    """The family's claims with each algorithm at its best lr over the phases: explored."""
    runs, paper = phase_runs(df, phases), paper_values.load()
    best = best_lrs(runs)
    found = []
    for c in named_family(study, family).comparisons:
        num, den = algorithm_of(study, c.num), algorithm_of(study, c.den)
        if num in best and den in best:
            a, b = at_lr(runs, num, best[num]), at_lr(runs, den, best[den])
            found.append(Claim(c.claim, a, b, paper_ratio(paper, num, den)))
    return explore(found).assign(family=BEST_LR) if found else pd.DataFrame()


def lr_table(df: pd.DataFrame, phases) -> pd.DataFrame:
    """Geometric-mean metric per algorithm and lr [95% t-interval on the mean log], and the best lr."""
    runs = phase_runs(df, phases)
    best, rows = best_lrs(runs), []
    for algorithm in (a for a in ORDER if a in set(runs["algorithm"])):
        row = {"algorithm": NAMES[algorithm]}
        for lr in sorted(runs["lr"].unique()):
            v = at_lr(runs, algorithm, lr)
            m, lo, hi = (math.exp(x) for x in mean_interval(v.map(math.log)))
            row[f"lr {lr:g}"] = (
                "-" if not len(v) else f"{m:.1f}" if len(v) < 2 else f"{m:.1f} [{lo:.1f}, {hi:.1f}] (n={len(v)})"
            )
        row["best lr"] = f"{best[algorithm]:g}"
        rows.append(row)
    return pd.DataFrame(rows)


def best_lr_section(df: pd.DataFrame, study: Study, out: Path, phases, family: str) -> list[str]:
    table = lr_table(df, phases)
    if table.empty:
        return []
    table.to_csv(out / "lr.csv", index=False)
    return [
        f"## Learning rate (phases {', '.join(phases)})\n",
        f"Geometric-mean {METRIC} [95% t-interval on the mean log] over seeds; each algorithm's best lr "
        f"gives the family '{BEST_LR}' of findings.csv (picked on the seeds it is compared on: explored).\n",
        markdown(table),
        "",
    ]


# --- by_lr --------------------------------------------------------------------------------------------


def by_lr(df: pd.DataFrame, study: Study, families) -> pd.DataFrame:
    """The families' claims (the same claims at different lrs) side by side: a column per lr, each cell
    the ratio [plain 95% interval] and its direction; the first family's the judged one (shared)."""
    paper, columns = paper_values.load(), {}
    for i, name in enumerate(families):
        f = named_family(study, name)
        runs = df[df["phase"].isin(f.phases) & df["arm"].isin({a for c in f.comparisons for a in (c.num, c.den)})]
        if runs.empty:  # a family not run (yet)
            continue
        lr = float(runs["lr"].iloc[0])
        rows = explore(claims(df, study, f, paper))
        columns[lr] = (f"lr {lr:g}" + (" (shared)" if i == 0 else ""), rows)
    first = next(iter(columns.values()))[1]
    table = pd.DataFrame({"claim": first["claim"], "paper": first["paper"].map("{:.2f}".format)})
    for lr in sorted(columns):
        name, rows = columns[lr]
        table[name] = [
            f"{interval_text(r['ratio'], r['lo'], r['hi'], r['seeds'])} {r['direction']}" for _, r in rows.iterrows()
        ]
    return table


def by_lr_section(df: pd.DataFrame, study: Study, out: Path, families) -> list[str]:
    if not df["phase"].isin(named_family(study, families[0]).phases).any():
        return []
    table = by_lr(df, study, families)
    table.to_csv(out / "findings_by_lr.csv", index=False)
    return [
        "## What holds at which learning rate (exploratory)\n",
        "Each cell: the ratio [plain 95% interval] and its direction (the shared lr's verdicts are its family's).\n",
        markdown(table),
        "",
    ]


# --- drift --------------------------------------------------------------------------------------------


def loss_gaps(a: pd.DataFrame, b: pd.DataFrame) -> tuple[list[float], list[float]]:
    """|loss a - loss b| at every step of every shared seed, and at each seed's last step."""
    seeds = sorted(set(a.index) & set(b.index))
    every = [abs(x - y) for s in seeds for x, y in zip(a.loc[s, "loss"], b.loc[s, "loss"])]
    last = [abs(a.loc[s, "loss"][-1] - b.loc[s, "loss"][-1]) for s in seeds if len(a.loc[s, "loss"])]
    return every, last


def drift(df: pd.DataFrame, pairs) -> pd.DataFrame:
    rows = []
    for num, den, *named in pairs:
        a, b = runs_of(df, num), runs_of(df, den)
        every, last = loss_gaps(a, b)
        r = paired_ratio(a[METRIC], b[METRIC])
        rows.append(
            {
                "comparison": named[0] if named else f"{num} vs {den}",
                "seeds": r.seeds,
                "max abs train-loss difference (any step)": f"{max(every):.2e}" if every else "-",
                "mean abs train-loss difference": f"{sum(every) / len(every):.2e}" if every else "-",
                "at the last step (mean)": f"{sum(last) / len(last):.2e}" if last else "-",
                "eval perplexity ratio [95% CI]": r.text(4),
                "direction (exploratory)": label(r, "first lower", "first higher"),
            }
        )
    return pd.DataFrame(rows)


def drift_figure(df: pd.DataFrame, pairs, path: Path) -> None:
    sns.set_theme(style="whitegrid", context="paper")
    fig, ax = plt.subplots(figsize=(6.4, 3.6), layout="constrained")
    for i, (num, den, *_) in enumerate(pairs):
        a, b = runs_of(df, num), runs_of(df, den)
        for j, s in enumerate(sorted(set(a.index) & set(b.index))):
            d = [max(abs(x - y), 1e-9) for x, y in zip(a.loc[s, "loss"], b.loc[s, "loss"])]
            ax.plot(range(1, len(d) + 1), d, color=f"C{i}", alpha=0.6, label=f"{num} - {den}" if j == 0 else None)
    ax.set(yscale="log", xlabel="step", ylabel="|train loss difference| (floor 1e-9)")
    ax.set_title("the same mathematics, step by step, one line per seed")
    ax.legend(fontsize=7)
    save(fig, path, 150)


def paper_gaps(df: pd.DataFrame, study: Study, pairs) -> list[str]:
    """Where a pair's arms run different algorithms (HSDP, FSDP): could the drift between them be as
    large as the paper's ratio of the two (the size verdict of its interval)?"""
    lines, paper = [], paper_values.load()
    for num, den, *named in pairs:
        a, b = algorithm_of(study, num), algorithm_of(study, den)
        if a != b:
            value, r = paper_ratio(paper, a, b), paired_ratio(runs_of(df, num)[METRIC], runs_of(df, den)[METRIC])
            what = named[0] if named else f"{num} vs {den}"
            lines.append(f"- {what}: {r.text(4)} against the paper's {value:.2f}: {size(r, value)}")
    return ["Could the drift be a gap of the paper's size?\n", *lines, ""] if lines else []


def drift_section(df: pd.DataFrame, study: Study, out: Path, pairs) -> list[str]:
    table = drift(df, pairs)
    table.to_csv(out / "drift.csv", index=False)
    drift_figure(df, pairs, out / "drift.png")
    return [
        "## Precision: the same mathematics computed two ways (exploratory)\n",
        markdown(table),
        "",
        *paper_gaps(df, study, pairs),
        "FedAvg's accumulation dtype (`algorithm.outer.reduce_dtype`): with F = 2 summing in bf16 and in "
        "fp32 are the same arithmetic (halving is exact in binary floating point); from F = 4 on they can differ.\n",
        "![train-loss differences per step](drift.png)\n",
    ]


# --- batch_control --------------------------------------------------------------------------------------


def control_label(control: pd.DataFrame, mine: pd.DataFrame, name: str) -> str:
    batch, steps = int(control["sequences_per_group"].iloc[0]), int(control["steps"].iloc[0])
    if batch != int(mine["sequences_per_group"].iloc[0]):
        return f"{name}, full batch ({batch} sequences), {steps} steps (the paper's comparison)"
    what = "batch-matched" if steps == int(mine["steps"].iloc[0]) else "token-matched"
    return f"{what}: one group's batch ({batch} sequences), {steps} steps"


def batch_control(df: pd.DataFrame, controls) -> pd.DataFrame:
    """Each [FL arm, control arms...]: control / FL eval perplexity, paired by seed (above 1: the FL
    run reached the lower perplexity)."""
    rows = []
    for fl, *others in controls:
        mine = runs_of(df, fl)
        if not len(mine):
            continue
        F, batch = int(mine["F"].iloc[0]), int(mine["sequences_per_group"].iloc[0])
        for other in others:
            control = runs_of(df, other)
            if not len(control):
                continue
            r = paired_ratio(control[METRIC], mine[METRIC])
            name = NAMES.get(control["algorithm"].iloc[0], other)
            rows.append(
                {
                    "FL run": f"{NAMES.get(mine['algorithm'].iloc[0], fl)} (F = {F}, {batch} sequences per group update)",
                    "control": control_label(control, mine, name),
                    "control / FL eval perplexity [95% CI]": r.text(),
                    "seeds": r.seeds,
                    "direction (exploratory)": label(r, "control lower", "FL lower"),
                }
            )
    return pd.DataFrame(rows)


def batch_control_section(df: pd.DataFrame, study: Study, out: Path, controls) -> list[str]:
    table = batch_control(df, controls)
    table.to_csv(out / "batch_control.csv", index=False)
    return [
        "## Batch-matched control (exploratory)\n",
        "Each FL group steps on 1/F of the pool's batch. The controls train FSDP or HSDP on exactly one "
        "group's per-update batch (a smaller mesh: the same mathematics as one group that never averages) "
        "for the same number of steps and for F times as many (the federation's tokens). A ratio above 1 "
        "means the FL run reached the lower perplexity.\n",
        markdown(table) if len(table) else "No control runs.",
        "",
    ]


# --- frontier -------------------------------------------------------------------------------------------


def period(a) -> int | str:
    """A run's A as the frontier shows it: an integer, a schedule as its JSON text, or "-" (FSDP,
    HSDP: none)."""
    if isinstance(a, (str, list, tuple)):
        return a if isinstance(a, str) else json.dumps(a)
    return int(a) if a is not None and a == a and a else "-"


def frontier(df: pd.DataFrame, phases) -> pd.DataFrame:
    """Mean training time and eval perplexity per algorithm and A over the phases, on the seeds every
    point ran, and each relative to FSDP's of the same seed (paired: seeds differ far more than the
    points)."""
    d = phase_runs(df, phases).assign(A=lambda t: t["A"].map(period))
    points = list(d.groupby(["algorithm", "F", "A"], sort=False))
    common = set.intersection(*(set(g["seed"]) for _, g in points)) if points else set()
    d = d[d["seed"].isin(common)]
    fsdp = d[d["algorithm"] == "fsdp"].drop_duplicates("seed").set_index("seed")
    rows = []
    for (algorithm, F, A), g in d.groupby(["algorithm", "F", "A"], sort=False):
        g = g.drop_duplicates("seed").set_index("seed")
        r = paired_ratio(g[METRIC], fsdp[METRIC]) if len(fsdp) else Ratio(math.nan, math.nan, math.nan, 0)
        rows.append(
            {
                "algorithm": NAMES.get(algorithm, algorithm), "F": F, "A": A, "seeds": len(g),
                "train time [s]": g["train_time_s"].mean(), "eval perplexity": g[METRIC].mean(),
                "/ FSDP": r.ratio, "low": r.low, "high": r.high, "/ FSDP [95% CI]": r.text(),
            }
        )  # fmt: skip
    out = pd.DataFrame(rows)
    if len(out):
        key = {
            "algorithm": lambda c: c.map(str),
            "A": lambda c: c.map(lambda v: -1 if v == "-" else v if isinstance(v, int) else math.inf),
        }
        out = out.sort_values(["algorithm", "A"], key=lambda c: key[str(c.name)](c), ignore_index=True)
    return out


def frontier_figure(table: pd.DataFrame, network: str):
    """One panel per FL algorithm (its A), sharing the y axis; FSDP and HSDP in each as reference
    points, hollow and on top, so a baseline at the same time as an FL point stays visible. The A
    labels of one curve alternate above and below it, in the order of their times."""
    sns.set_theme(style="whitegrid", context="paper")
    palette = dict(zip([NAMES[a] for a in ORDER], sns.color_palette(n_colors=len(ORDER))))
    is_fl = table["A"].map(lambda a: str(a) != "-")
    curves = list(table[is_fl].groupby(["algorithm", "F"], sort=False))
    baselines = table[~is_fl]
    fig, axes = plt.subplots(
        1,
        max(len(curves), 1),
        figsize=(4.2 * max(len(curves), 1), 4.2),
        sharey=True,
        layout="constrained",
        squeeze=False,
    )
    seeds = int(table["seeds"].max()) if len(table) else 0
    for ax, ((algo, F), g) in zip(axes[0], curves):
        _frontier_panel(ax, algo, F, g.sort_values("train time [s]"), baselines, palette)
        ax.set_xlabel(f"training time [s] (sum of step times, {network} network)", fontsize=8)
    axes[0][0].set_ylabel("eval perplexity / FSDP's (same seed)")
    fig.suptitle(
        f"Exploratory: perplexity against time ({seeds} seed{'s' if seeds > 1 else ''} per point"
        + (", bars: paired 95% t-interval)" if seeds > 1 else ")"),
        fontsize=9,
    )
    return fig


def _frontier_panel(ax, algo, F, g: pd.DataFrame, baselines: pd.DataFrame, palette: dict) -> None:
    """One FL algorithm's A curve (g, in the order of its times), its A labels, and the baselines."""
    err = [g["/ FSDP"] - g["low"], g["high"] - g["/ FSDP"]] if g["seeds"].min() > 1 and g["low"].notna().all() else None
    ax.errorbar(
        g["train time [s]"],
        g["/ FSDP"],
        yerr=err,
        marker="o",
        capsize=3,
        color=palette.get(algo),
        label=f"{algo} (F = {F})",
    )
    for i, (_, r) in enumerate(g.iterrows()):
        ax.annotate(
            f"A={r['A']}",
            (r["train time [s]"], r["/ FSDP"]),
            fontsize=7,
            textcoords="offset points",
            xytext=(4, 5) if i % 2 == 0 else (4, -11),
        )
    for marker, (_, b) in zip(("s", "D", "^"), baselines.iterrows()):
        ax.plot(
            b["train time [s]"],
            b["/ FSDP"],
            marker=marker,
            markersize=9,
            markerfacecolor="none",
            markeredgewidth=1.6,
            linestyle="none",
            color=palette.get(b["algorithm"]),
            zorder=4,
            label=b["algorithm"],
        )
    ax.axhline(1, color="grey", lw=0.8)
    ax.margins(x=0.08)  # room for the labels of the first and last points
    ax.set_title(f"{algo}, F = {F}: A varied", fontsize=9)
    ax.legend(fontsize=7)


def frontier_section(df: pd.DataFrame, study: Study, out: Path, phases) -> list[str]:
    table = frontier(df, phases)
    table.to_csv(out / "frontier.csv", index=False)
    if not len(table):
        return []
    fig = frontier_figure(table, f"phases {', '.join(phases)}")
    save(fig, out / "frontier.png", 150)
    shown = table.drop(columns=["/ FSDP", "low", "high"]).round({"train time [s]": 1, "eval perplexity": 1})
    return [
        "## Perplexity against time: A at each algorithm's F (exploratory)\n",
        f"FL runs at every A, each FL algorithm at its own F (F changes only with the algorithm: this varies A), "
        f"phases {', '.join(phases)}, on the seeds every point ran ({int(table['seeds'].min())} each); mean eval "
        "perplexity, and relative to FSDP's in the same seed; FSDP and HSDP for reference. The table describes "
        "the points and claims no ordering between them.\n",
        markdown(shown),
        "",
        "![eval perplexity against training time](frontier.png)\n",
    ]


# --- tables34 -------------------------------------------------------------------------------------------


def tables34_section(df: pd.DataFrame, study: Study, out: Path, phase: str) -> list[str]:
    """Tables 3-4 and Figure 2 (analysis.report) of the phase's runs in OUT/runs/PHASE, written to
    OUT/report/PHASE/; none from per-run numbers alone (a report made again with --banked)."""
    from .discover import collect
    from .report import build

    runs_dir = out.parent / "runs" / phase
    runs, problems = collect([str(runs_dir)]) if runs_dir.is_dir() else ([], [])
    if not runs:
        return [f"## Tables 3-4 ({phase})\n\nNot made: no run directory of the phase (per-run numbers only).\n"]
    build(runs, problems, out / phase, paper_values.load(), f"{study.name}: Tables 3-4 of {runs_dir.name}")
    return [
        f"## Tables 3-4 ({phase})\n\nThe paper's Tables 3-4 of the {phase} runs: [{phase}/report.md]({phase}/report.md).\n"
    ]
