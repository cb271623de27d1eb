"""The Figure-2-like plot: training perplexity (log scale) against wall-clock minutes, one line per
configuration. Wall-clock is the cumulative sum of the recorded step times (the slowest rank's),
so it leaves out start-up and evaluation, as the training time of Table 3 does. Seeds are averaged
step by step (their clocks differ), with a band of ± one standard deviation of the perplexity."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pandas as pd
import seaborn as sns
from matplotlib.ticker import FuncFormatter, LogFormatter

from .plotting import plt
from .records import Run
from .tables import _order, af_grid, labels


def curves(runs: list[Run]) -> pd.DataFrame:
    """label, step, minutes and perplexity (means over seeds), perplexity_std, seeds."""
    frames = []
    for run, label in zip(runs, labels(runs)):
        s = run.steps
        frames.append(
            pd.DataFrame(
                {
                    "label": label,
                    "seed": run.seed,
                    "step": s["step"],
                    "minutes": s["time_step"].cumsum() / 60,
                    "perplexity": s["perplexity"],
                }
            )
        )
    df = pd.concat(frames, ignore_index=True)
    g = df.groupby(["label", "step"], sort=False)
    out = g.agg(
        minutes=("minutes", "mean"),
        perplexity=("perplexity", "mean"),
        perplexity_std=("perplexity", "std"),
        seeds=("seed", "nunique"),
    ).reset_index()
    return out.sort_values(
        ["label", "step"], key=lambda c: c.map(_order) if c.name == "label" else c, ignore_index=True
    )


LINESTYLES = ("-", "--", ":", "-.")
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
LABEL_WIDTH = 70  # characters per legend line: longer labels wrap, so the legend fits the figure's width


def styles(n: int) -> list[dict]:
    """n line styles, all different: seaborn's palette up to 10 colours (it repeats after that),
    evenly spaced hues beyond, and line style and marker cycling so greys and neighbours stay apart."""
    colours = sns.color_palette(n_colors=n) if n <= 10 else sns.color_palette("husl", n)
    return [
        {"color": colours[i], "linestyle": LINESTYLES[i % len(LINESTYLES)], "marker": MARKERS[i % len(MARKERS)]}
        for i in range(n)
    ]


def plain_number(value: float) -> str:
    """A tick label a reader takes in at once: 4100, 35, 0.5, 12.3k, 1.5M (no 4.1x10^3)."""
    if abs(value) >= 1e6:
        return f"{value / 1e6:.3g}M"
    if abs(value) >= 1e4:
        return f"{value / 1e3:.3g}k"
    return f"{value:.4g}"


class PlainLogFormatter(LogFormatter):
    """matplotlib's log-axis labelling (which ticks get a label), each label a plain number."""

    def _num_to_string(self, x, vmin, vmax):
        return plain_number(x)


def _wrap(label: str) -> str:
    return "\n".join(textwrap.wrap(label, LABEL_WIDTH, subsequent_indent="  ")) or label


def perplexity_figure(runs: list[Run], title: str | None = None):
    data = curves(runs)
    order = sorted(data["label"].unique(), key=_order)
    sns.set_theme(style="whitegrid", context="paper")
    legend_lines = sum(len(_wrap(label).splitlines()) for label in order)
    # the legend goes below the axes, outside them: the figure grows with it, the axes keep their height
    fig, ax = plt.subplots(figsize=(6.4, 4.0 + 0.16 * legend_lines), layout="constrained")
    style = dict(zip(order, styles(len(order))))
    for label in order:
        c = data[data["label"] == label]
        # one line per configuration, the seed averaging done above: matplotlib only draws
        ax.plot(c["minutes"], c["perplexity"], label=_wrap(label), markersize=3, **style[label])
        if c["seeds"].max() > 1:
            ax.fill_between(
                c["minutes"],
                (c["perplexity"] - c["perplexity_std"]).clip(lower=1),
                c["perplexity"] + c["perplexity_std"],
                color=style[label]["color"],
                alpha=0.2,
                lw=0,
            )
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(PlainLogFormatter())
    ax.yaxis.set_minor_formatter(PlainLogFormatter(labelOnlyBase=False, minor_thresholds=(2, 0.5)))
    ax.set_xlabel("wall-clock time [min] (sum of training step times)")
    ax.set_ylabel("training perplexity")
    seeds = int(data["seeds"].max())
    ax.set_title(
        title or (f"Training perplexity, mean of {seeds} seeds (band: ± 1 std)" if seeds > 1 else "Training perplexity")
    )
    fig.legend(
        loc="outside lower center", ncols=2 if max(map(len, order)) <= LABEL_WIDTH // 2 - 5 else 1, frameon=False
    )
    return fig


def af_heatmap(cells: pd.DataFrame, configuration: str):
    """A sweep over A and F: mean step time and eval perplexity of each (A, F), side by side."""
    sns.set_theme(style="white", context="paper")
    fig, axes = plt.subplots(1, 2, figsize=(9.0, 3.6), layout="constrained")
    for ax, (value, title, fmt) in zip(
        axes, (("step_time_s", "mean step time [s]", ".3g"), ("eval_perplexity", "eval perplexity", ".4g"))
    ):
        grid = af_grid(cells, configuration, value)
        sns.heatmap(
            grid,
            annot=True,
            fmt=fmt,
            cmap="viridis",
            ax=ax,
            cbar_kws={"format": FuncFormatter(lambda v, _: plain_number(v))},
        )
        ax.set_xlabel("F (federated groups)")
        ax.set_ylabel("A (steps between aggregations)")
        ax.set_title(title)
    fig.suptitle(_wrap(f"{configuration}: mean of the seeds per (A, F)"))
    return fig


def save(fig, out: Path, stem: str = "figure2") -> list[Path]:
    paths = [Path(out) / f"{stem}.{ext}" for ext in ("png", "pdf")]
    for p in paths:
        fig.savefig(p, dpi=150)
    return paths
