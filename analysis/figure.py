"""The Figure-2-like plot: training perplexity (log scale) against wall-clock minutes, one line per
configuration. Wall-clock is the cumulative sum of the recorded step times (the slowest rank's),
so it leaves out start-up and evaluation, as the training time of Table 3 does. Seeds are averaged
step by step (their clocks differ), with a band of ± one standard deviation of the perplexity."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; no display on CI or a cluster node

import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
import seaborn as sns  # noqa: E402

from .records import Run  # noqa: E402
from .tables import _order, labels  # noqa: E402


def curves(runs: list[Run]) -> pd.DataFrame:
    """label, step, minutes and perplexity (means over seeds), perplexity_std, seeds."""
    frames = []
    for run, label in zip(runs, labels(runs)):
        s = run.steps
        frames.append(pd.DataFrame({"label": label, "seed": run.seed, "step": s["step"],
                                    "minutes": s["time_step"].cumsum() / 60, "perplexity": s["perplexity"]}))
    df = pd.concat(frames, ignore_index=True)
    g = df.groupby(["label", "step"], sort=False)
    out = g.agg(minutes=("minutes", "mean"), perplexity=("perplexity", "mean"),
                perplexity_std=("perplexity", "std"), seeds=("seed", "nunique")).reset_index()
    return out.sort_values(["label", "step"], key=lambda c: c.map(_order) if c.name == "label" else c,
                           ignore_index=True)


def perplexity_figure(runs: list[Run], title: str | None = None):
    data = curves(runs)
    order = sorted(data["label"].unique(), key=_order)
    sns.set_theme(style="whitegrid", context="paper")
    fig, ax = plt.subplots(figsize=(6.4, 4.0), layout="constrained")
    palette = dict(zip(order, sns.color_palette(n_colors=len(order))))
    for label in order:
        c = data[data["label"] == label]
        # one call per line (no hue): the axes then hold exactly one labelled line per configuration;
        # estimator=None: the seed averaging is done above, seaborn only draws
        sns.lineplot(data=c, x="minutes", y="perplexity", estimator=None, label=label, color=palette[label],
                     marker="o", markersize=3, ax=ax)
        if c["seeds"].max() > 1:
            ax.fill_between(c["minutes"], (c["perplexity"] - c["perplexity_std"]).clip(lower=1),
                            c["perplexity"] + c["perplexity_std"], color=palette[label], alpha=0.2, lw=0)
    ax.set_yscale("log")
    ax.set_xlabel("wall-clock time [min] (sum of training step times)")
    ax.set_ylabel("training perplexity")
    seeds = int(data["seeds"].max())
    ax.set_title(title or (f"Training perplexity, mean of {seeds} seeds (band: ± 1 std)" if seeds > 1
                           else "Training perplexity"))
    ax.legend(title=None)
    return fig


def save(fig, out: Path, stem: str = "figure2") -> list[Path]:
    paths = [Path(out) / f"{stem}.{ext}" for ext in ("png", "pdf")]
    for p in paths:
        fig.savefig(p, dpi=150)
    return paths
