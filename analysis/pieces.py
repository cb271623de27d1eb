"""Named pieces of a study's report, asked for by name in its spec (analysis.spec.PIECES): each
may add columns to the one row per run (COLUMNS) and adds a section to report.md (SECTIONS).

- noise_scale: each run's mean gradient-noise terms (fldp.noise_scale) and, per phase, algorithm and
  block length, B_simple against the tokens a group steps on (noise.csv).
- reruns: a phase's runs beside the runs of another study's committed judging phase they repeat
  (the same algorithm, seed, steps and mesh), on a metric (rerun.csv): does the code still compute
  what it computed then.
- identical: a phase's runs beside another arm's runs of their seed: the same records? (HSDP is
  FSDP's computation in the simulator.)"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only

import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

from .arms import geometric_mean  # noqa: E402
from .render import markdown  # noqa: E402
from .runs_frame import beside_committed  # noqa: E402
from .spec import Study  # noqa: E402


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
    fig.savefig(path, dpi=120)
    plt.close(fig)


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


COLUMNS = {"noise_scale": block_and_noise}
# each takes (df, study, out) and its spec arguments
SECTIONS: dict[str, Callable[..., list[str]]] = {
    "noise_scale": noise_section,
    "reruns": reruns_section,
    "identical": identical_section,
}


def sections(df: pd.DataFrame, study: Study, out: Path) -> list[str]:
    """Every piece's section, in the spec's order."""
    return [line for piece in study.pieces for line in SECTIONS[piece.name](df, study, out, **piece.args)]
