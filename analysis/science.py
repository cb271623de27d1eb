"""The study's report: which of the paper's claims survive controls.

    python -m analysis.science RUNS... --out DIR [--elapsed SECONDS]

Reads any runs (experiments/science.sh makes them) and sorts each by what it is, from its own
records: precision, learning rate, A, mesh, per-update batch, steps, network. The paper-shaped runs
(the largest world, the topology's layout for the algorithm) at the most common learning rate and
step count are the main comparison; smaller FSDP/HSDP meshes are the batch controls; runs on an
emulated network give the times. Comparisons pair runs by seed, and every verdict comes from
analysis/stats.py: the paper's five perplexity claims at the shared learning rate in fp32 are the
primary family (simultaneous 95% intervals, Bonferroni, for the size; Holm's step-down for the
direction); everything else is exploratory (a plain 95% interval and its direction, not a finding)."""

from __future__ import annotations

import json
import math
import shlex
import sys
from datetime import date
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only

import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
import seaborn as sns  # noqa: E402

from . import paper as paper_values  # noqa: E402
from .claims import PPL_FINDINGS  # noqa: E402  (the primary family)
from .discover import collect_for, reports_parser  # noqa: E402
from .paper import paper_ratio  # noqa: E402
from .records import Run  # noqa: E402
from .render import markdown  # noqa: E402
from .stats import LEVEL, MIN_SEEDS, TIE_HIGH, TIE_LOW, Claim, Ratio, explore, judge, mean_interval, paired_ratio  # noqa: E402
from .tables import NAMES, ORDER  # noqa: E402

TIME_FINDINGS = [("fsdp", "fl_fsdp"), ("hsdp", "fl_fsdp"), ("fl_hsdp", "fl_fsdp")]


def describe(run: Run) -> dict:
    s = run.summary
    group = s["replicate"] * s["shard"]
    return {
        "run": run.name,
        "algorithm": run.algorithm,
        "seed": run.seed,
        "precision": s["precision"],
        "reduce_dtype": (s.get("outer") or {}).get("reduce_dtype") or "-",
        # A; a schedule as its JSON text (hashable, never equal to an A): the study's A is an integer
        "lr": run.config.get("optimizer.lr", math.nan),
        "every": _every(s.get("every")),
        "F": s["federation"],
        "R": s["replicate"],
        "S": s["shard"],
        "world": s["world_size"],
        "update_batch": group * s["batch_size"],  # sequences behind one optimiser step of one group
        "steps": s["steps"],
        "network": s.get("network", "loopback"),
        "eval_loss": s.get("eval_loss", math.log(s["eval_perplexity"])),
        "eval_perplexity": s["eval_perplexity"],
        "train_time_s": s["train_time_s"],
        "commit": s.get("commit") or "",
        "loss": list(run.steps["loss"]),
    }


def _every(every) -> int | str:
    return json.dumps(every) if isinstance(every, (list, tuple)) else int(every or 0)


def _mode(col: pd.Series):
    return col.mode().iloc[0]


class Study:
    """The runs as a frame, and the base setting the controls vary: the most common learning rate,
    step count and A among the paper-shaped runs."""

    def __init__(self, runs: list[Run]):
        df = pd.DataFrame([describe(r) for r in runs])
        self.world = int(df["world"].max())
        df["paper_mesh"] = df["world"] == self.world
        main = df[df["paper_mesh"]]
        self.lr = float(_mode(main["lr"]))
        self.steps = int(_mode(main["steps"]))
        fl = main[main["F"] > 1]
        periods = fl["every"][fl["every"].map(lambda e: isinstance(e, int))]
        self.every = int(_mode(periods)) if len(periods) else 0
        # the network that gives the times: the emulated one most runs used (loopback when none)
        timed = df[df["network"] != "loopback"]
        self.timed_network = _mode(timed["network"]) if len(timed) else "loopback"
        self.df = df
        self.notes: list[str] = []

    def select(
        self,
        algorithm: str,
        *,
        precision="fp32",
        lr=None,
        every=None,
        steps=None,
        reduce_dtype="-",
        network=None,
        paper_mesh=True,
        update_batch=None,
    ) -> pd.DataFrame:
        """One configuration's runs, one per seed (the first when a seed was run twice)."""
        d = self.df
        keep = (d["algorithm"] == algorithm) & (d["precision"] == precision) & (d["paper_mesh"] == paper_mesh)
        keep &= d["lr"] == (self.lr if lr is None else lr)
        keep &= d["steps"] == (self.steps if steps is None else steps)
        if every is not None or (d.loc[d["algorithm"] == algorithm, "F"] > 1).any():  # FSDP/HSDP have no A
            keep &= d["every"] == (self.every if every is None else every)
        if reduce_dtype is not None:
            keep &= d["reduce_dtype"] == reduce_dtype
        if network is not None:
            keep &= d["network"] == network
        if update_batch is not None:
            keep &= d["update_batch"] == update_batch
        sel = d[keep]
        if sel["seed"].duplicated().any():
            self.notes.append(
                f"{NAMES[algorithm]} ({precision}, lr {lr or self.lr}): a seed ran twice "
                f"(e.g. on two networks); the first run of each seed is used"
            )
        return sel.drop_duplicates("seed").set_index("seed")

    def ratio(self, a: pd.DataFrame, b: pd.DataFrame, metric: str = "eval_perplexity") -> Ratio:
        return paired_ratio(a[metric], b[metric])


def _label(r: Ratio, below: str, above: str) -> str:
    """An exploratory ratio's direction in words, `below` / `above` naming what an ordering means."""
    return {
        "n/a": f"n/a (fewer than {MIN_SEEDS} seeds)",
        "<": below,
        ">": above,
        "tie": f"tie (interval within {TIE_LOW:.3f}-{TIE_HIGH:.3f})",
        "inconclusive": "inconclusive (interval spans the tie band)",
    }[r.verdict]


def _name(a: str) -> str:
    return NAMES.get(a, a)


def best_lrs(st: Study) -> dict[str, float]:
    """Each algorithm's learning rate with the lowest mean log eval perplexity (fp32, paper mesh)."""
    best = {}
    for algo in ORDER:
        d = st.df[
            (st.df["algorithm"] == algo)
            & st.df["paper_mesh"]
            & (st.df["precision"] == "fp32")
            & (st.df["steps"] == st.steps)
            & (st.df["reduce_dtype"] == "-")
        ]
        d = d[(d["F"] == 1) | (d["every"] == st.every)]
        if len(d):
            logs = d.groupby("lr")["eval_perplexity"].apply(lambda v: v.map(math.log).mean())
            best[algo] = float(logs.idxmin())
    return best


def _claim_name(num: str, den: str) -> str:
    if (num, den) == ("hsdp", "fsdp"):
        return "HSDP ends with a higher eval perplexity than FSDP"
    return f"{_name(den)} reaches a lower eval perplexity than {_name(num)}"


def ppl_claims(st: Study, paper: dict, precision: str = "fp32", lrs: dict | None = None) -> list[Claim]:
    """The paper's five perplexity claims as paired ratios, at the shared lr or at `lrs[algorithm]`."""
    lrs = lrs or {}
    return [
        Claim(
            _claim_name(num, den),
            st.select(num, precision=precision, lr=lrs.get(num))["eval_perplexity"],
            st.select(den, precision=precision, lr=lrs.get(den))["eval_perplexity"],
            paper_ratio(paper, num, den),
        )
        for num, den in PPL_FINDINGS
    ]


def grid_lrs(st: Study) -> list[float]:
    """The learning rates the fp32 paper-shaped runs used."""
    d = st.df
    return sorted(d.loc[d["paper_mesh"] & (d["precision"] == "fp32") & (d["steps"] == st.steps), "lr"].unique())


def interval_text(row) -> str:
    if row["seeds"] < 2:
        return f"{row['ratio']:.3f} (1 seed, no interval)" if row["seeds"] else "no runs"
    return f"{row['ratio']:.3f} [{row['lo']:.3f}, {row['hi']:.3f}]"


def _family(
    frame: pd.DataFrame, family: str, setting: str, pairs: list[tuple[str, str]], what: str = ""
) -> pd.DataFrame:
    return frame.assign(family=family, setting=setting, comparison=[f"{_name(a)} / {_name(b)}{what}" for a, b in pairs])


def findings(st: Study, paper: dict) -> pd.DataFrame:
    """The primary family (the five perplexity claims, fp32, shared lr: stats.judge), then the exploratory
    comparisons (plain 95% intervals): the five at every other lr of the grid, in bf16, at each
    one's best lr, and the time claims on the timed network."""
    frames = [_family(judge(ppl_claims(st, paper)), "primary", f"fp32, shared lr {st.lr:g}", PPL_FINDINGS)]
    for lr in grid_lrs(st):
        if lr != st.lr:
            frames.append(
                _family(
                    explore(ppl_claims(st, paper, lrs=dict.fromkeys(ORDER, lr))),
                    "exploratory",
                    f"fp32, lr {lr:g} (all)",
                    PPL_FINDINGS,
                )
            )
    frames.append(
        _family(explore(ppl_claims(st, paper, "bf16")), "exploratory", f"bf16, shared lr {st.lr:g}", PPL_FINDINGS)
    )
    frames.append(
        _family(
            explore(ppl_claims(st, paper, lrs=best_lrs(st))),
            "exploratory",
            "fp32, each one's best lr (picked on these seeds)",
            PPL_FINDINGS,
        )
    )
    frames.append(_time_family(st, paper))
    out = pd.concat(frames, ignore_index=True)
    out["runs [CI]"] = out.apply(interval_text, axis=1)
    return out[FINDING_COLUMNS]


FINDING_COLUMNS = [
    *("family", "claim", "setting", "comparison", "paper", "runs [CI]", "level", "direction", "size", "seeds"),
    *("ratio", "lo", "hi", "p", "sd_log", "direction_level"),
]


def _time_family(st: Study, paper: dict) -> pd.DataFrame:
    """The time claims on the timed network, exploratory."""
    network = st.timed_network
    time_claims = [
        Claim(
            f"{_name(den)} trains faster than {_name(num)}",
            st.select(num, network=network)["train_time_s"],
            st.select(den, network=network)["train_time_s"],
            paper_ratio(paper, num, den, "train_time_s"),
        )
        for num, den in TIME_FINDINGS
    ]
    return _family(
        explore(time_claims), "exploratory", f"fp32, shared lr, {network} network", TIME_FINDINGS, " train time"
    )


def by_lr(st: Study, paper: dict) -> pd.DataFrame:
    """What holds at which learning rate: the five perplexity claims at every lr of the grid (every
    algorithm at that lr), each cell the ratio, its plain 95% interval and its direction."""
    table = pd.DataFrame(
        {
            "claim": [_claim_name(a, b) for a, b in PPL_FINDINGS],
            "paper": [paper_ratio(paper, a, b) for a, b in PPL_FINDINGS],
        }
    )
    for lr in grid_lrs(st):
        rows = explore(ppl_claims(st, paper, lrs=dict.fromkeys(ORDER, lr)))
        table[f"lr {lr:g}" + (" (shared)" if lr == st.lr else "")] = [
            f"{interval_text(r)} {r['direction']}" for _, r in rows.iterrows()
        ]
    table["paper"] = table["paper"].map("{:.2f}".format)
    return table


RUN_COLUMNS = [
    "algorithm",
    "seed",
    "lr",
    "precision",
    "F",
    "R",
    "S",
    "every",
    "steps",
    "eval_loss",
    "eval_perplexity",
    "train_time_s",
    "commit",
]


def runs_table(st: Study) -> pd.DataFrame:
    """One row per run, the numbers every verdict is computed from (commit: the summary's, if any)."""
    return st.df[RUN_COLUMNS + ["reduce_dtype", "network", "update_batch", "run"]].sort_values(
        ["precision", "lr", "steps", "algorithm", "F", "every", "seed", "run"], ignore_index=True
    )


def drift(st: Study) -> pd.DataFrame:
    """How far HSDP is from FSDP (the same mathematics) in each precision, and what FedAvg's
    accumulation dtype changes in bf16."""
    rows = []
    for precision in ("fp32", "bf16"):
        f, h = st.select("fsdp", precision=precision), st.select("hsdp", precision=precision)
        seeds = sorted(set(f.index) & set(h.index))
        diffs = [abs(x - y) for s in seeds for x, y in zip(f.loc[s, "loss"], h.loc[s, "loss"])]
        last = [abs(f.loc[s, "loss"][-1] - h.loc[s, "loss"][-1]) for s in seeds]
        r = st.ratio(h, f)
        rows.append(
            {
                "comparison": f"HSDP vs FSDP, {precision}",
                "seeds": len(seeds),
                "max abs train-loss difference (any step)": f"{max(diffs):.2e}" if diffs else "-",
                "mean abs train-loss difference": f"{sum(diffs) / len(diffs):.2e}" if diffs else "-",
                "at the last step (mean)": f"{sum(last) / len(last):.2e}" if last else "-",
                "eval perplexity ratio [95% CI]": r.text(4),
                "direction (exploratory)": _label(r, "first lower", "first higher"),
            }
        )
    for algo in ("fl_fsdp", "fl_hsdp"):
        b, f32 = st.select(algo, precision="bf16"), st.select(algo, precision="bf16", reduce_dtype="fp32")
        seeds = sorted(set(b.index) & set(f32.index))
        diffs = [abs(x - y) for s in seeds for x, y in zip(b.loc[s, "loss"], f32.loc[s, "loss"])]
        r = st.ratio(b, f32)
        rows.append(
            {
                "comparison": f"{_name(algo)} bf16: FedAvg summed in bf16 vs in fp32 (reduce_dtype)",
                "seeds": len(seeds),
                "max abs train-loss difference (any step)": f"{max(diffs):.2e}" if diffs else "-",
                "mean abs train-loss difference": f"{sum(diffs) / len(diffs):.2e}" if diffs else "-",
                "at the last step (mean)": "-",
                "eval perplexity ratio [95% CI]": r.text(4),
                "direction (exploratory)": _label(r, "first lower", "first higher"),
            }
        )
    return pd.DataFrame(rows)


def batch_control(st: Study) -> pd.DataFrame:
    """Each FL algorithm against FSDP/HSDP trained on one group's per-update batch: for as many
    steps (batch-matched), and for F times as many (token-matched: the federation's tokens)."""
    rows = []
    for fl, control_algo in (("fl_fsdp", "fsdp"), ("fl_hsdp", "hsdp")):
        mine = st.select(fl)
        if not len(mine):
            continue
        F, batch = int(mine["F"].iloc[0]), int(mine["update_batch"].iloc[0])
        full = st.select(control_algo)
        variants = [
            (
                f"{_name(control_algo)}, full batch ({int(full['update_batch'].iloc[0]) if len(full) else '?'} "
                f"sequences), {st.steps} steps (the paper's comparison)",
                full,
            )
        ]
        for steps, what in ((st.steps, "batch-matched"), (st.steps * F, "token-matched")):
            # any FSDP/HSDP on a smaller mesh with one group's batch: the same mathematics either way
            c = pd.concat([st.select(a, paper_mesh=False, steps=steps, update_batch=batch) for a in ("fsdp", "hsdp")])
            c = c[~c.index.duplicated()]
            variants.append((f"{what}: one group's batch ({batch} sequences), {steps} steps", c))
        for label, c in variants:
            r = st.ratio(c, mine)
            rows.append(
                {
                    "FL run": f"{_name(fl)} (F = {F}, {batch} sequences per group update)",
                    "control": label,
                    "control / FL eval perplexity [95% CI]": r.text(),
                    "seeds": r.seeds,
                    "direction (exploratory)": _label(r, "control lower", "FL lower"),
                }
            )
    return pd.DataFrame(rows)


def lr_table(st: Study) -> pd.DataFrame:
    """Geometric mean eval perplexity per lr (the mean of the logs best_lrs picks by) and its interval."""
    best = best_lrs(st)
    lrs = sorted(st.df.loc[st.df["paper_mesh"] & (st.df["precision"] == "fp32"), "lr"].unique())
    rows = []
    for algo in ORDER:
        row = {"algorithm": _name(algo)}
        for lr in lrs:
            v = st.select(algo, lr=lr)["eval_perplexity"]
            m, lo, hi = (math.exp(x) for x in mean_interval(v.map(math.log)))
            row[f"lr {lr:g}"] = (
                "-" if not len(v) else f"{m:.1f}" if len(v) < 2 else f"{m:.1f} [{lo:.1f}, {hi:.1f}] (n={len(v)})"
            )
        row["best lr"] = f"{best[algo]:g}" if algo in best else "-"
        rows.append(row)
    return pd.DataFrame(rows)


def frontier(st: Study) -> tuple[pd.DataFrame, str]:
    """Eval perplexity against training time for every A, each FL algorithm at its own F (F only
    changes with the algorithm), on the timed network (loopback
    when no run used another). Seeds differ far more than the points do (different data order and
    initial weights), so each point's perplexity is also given relative to FSDP's in the same seed
    (paired), which is what the figure shows."""
    network = st.timed_network
    d = st.df[
        (st.df["network"] == network)
        & st.df["paper_mesh"]
        & (st.df["precision"] == "fp32")
        & (st.df["lr"] == st.lr)
        & (st.df["steps"] == st.steps)
    ]
    # every point on the same seeds (the ones all of them ran), so the points differ only in the algorithm and A
    common = set.intersection(*(set(g["seed"]) for _, g in d.groupby(["algorithm", "F", "every"]))) if len(d) else set()
    d = d[d["seed"].isin(common)]
    fsdp = d[d["algorithm"] == "fsdp"].drop_duplicates("seed").set_index("seed")
    rows = []
    for (algo, F, every), g in d.groupby(["algorithm", "F", "every"]):
        g = g.drop_duplicates("seed").set_index("seed")
        r = st.ratio(g, fsdp) if len(fsdp) else Ratio(math.nan, math.nan, math.nan, 0)
        rows.append(
            {
                "algorithm": _name(algo),
                "F": F,
                "A": every or "-",
                "seeds": len(g),
                "train time [s]": g["train_time_s"].mean(),
                "eval perplexity": g["eval_perplexity"].mean(),
                "/ FSDP": r.ratio,
                "low": r.low,
                "high": r.high,
                "/ FSDP [95% CI]": r.text(),
            }
        )
    out = pd.DataFrame(rows)
    if len(out):
        out = out.sort_values(
            ["algorithm", "A"],
            key=lambda c: c.map(str) if c.name == "algorithm" else c.map(lambda v: -1 if v == "-" else v),
            ignore_index=True,
        )
    return out, network


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


def drift_figure(st: Study):
    sns.set_theme(style="whitegrid", context="paper")
    fig, ax = plt.subplots(figsize=(6.4, 3.6), layout="constrained")
    for precision, color in (("fp32", "C0"), ("bf16", "C3")):
        f, h = st.select("fsdp", precision=precision), st.select("hsdp", precision=precision)
        for i, s in enumerate(sorted(set(f.index) & set(h.index))):
            d = [max(abs(x - y), 1e-9) for x, y in zip(f.loc[s, "loss"], h.loc[s, "loss"])]
            ax.plot(range(1, len(d) + 1), d, color=color, alpha=0.6, label=precision if i == 0 else None)
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("|train loss HSDP - FSDP| (floor 1e-9)")
    ax.set_title("HSDP against FSDP, step by step, one line per seed")
    ax.legend()
    return fig


def _findings_md(found: pd.DataFrame, family: str) -> str:
    f = found[found["family"] == family].copy()
    f["paper"] = f["paper"].map("{:.2f}".format)
    f["level"] = f["level"].map(lambda v: f"{v:.2%}")
    f["direction at"] = f["direction_level"].map(lambda v: f"{v:.2%}")
    return markdown(
        f[
            [
                "claim",
                "setting",
                "comparison",
                "paper",
                "runs [CI]",
                "level",
                "direction",
                "direction at",
                "size",
                "seeds",
            ]
        ]
    )


def report(st: Study, paper: dict, out: Path, command: str, elapsed: float | None) -> Path:
    """The tiny study's report: its tables as CSV, its figures, and report.md."""
    out.mkdir(parents=True, exist_ok=True)
    tables = {
        "findings": findings(st, paper),
        "findings_by_lr": by_lr(st, paper),
        "drift": drift(st),
        "batch_control": batch_control(st),
        "lr": lr_table(st),
    }
    fr, network = frontier(st)
    for name, df in {**tables, "frontier": fr, "runs": runs_table(st)}.items():
        df.to_csv(out / f"{name}.csv", index=False)
    if len(fr):
        frontier_figure(fr, network).savefig(out / "frontier.png", dpi=150)
    drift_figure(st).savefig(out / "drift.png", dpi=150)
    plt.close("all")
    lines = [
        *_intro_md(st, tables["findings"], command, elapsed),
        *_by_lr_and_precision_md(st, paper, tables),
        *_controls_and_frontier_md(st, tables, fr, network),
        *_limitations_md(st),
    ]
    if st.notes:
        lines += ["Notes:", ""] + [f"- {n}" for n in dict.fromkeys(st.notes)] + [""]
    path = out / "report.md"
    path.write_text("\n".join(lines))
    return path


def _bf16_gap(st: Study, paper: dict) -> str:
    """Whether bf16 reduction order could make HSDP / FSDP as large as the paper's."""
    paper_gap = paper_ratio(paper, "hsdp", "fsdp")
    bf16_r = st.ratio(st.select("hsdp", precision="bf16"), st.select("fsdp", precision="bf16"))
    if bf16_r.seeds < MIN_SEEDS:
        return f"untested (fewer than {MIN_SEEDS} seeds)"
    if bf16_r.high < paper_gap:
        return f"no: HSDP / FSDP in bf16 is {bf16_r.text(4)}, below the paper's {paper_gap:.2f}"
    if bf16_r.low > paper_gap:
        return f"yes, at least: HSDP / FSDP in bf16 is {bf16_r.text(4)}, above the paper's {paper_gap:.2f}"
    return f"cannot be excluded: {bf16_r.text(4)} holds the paper's {paper_gap:.2f}"


def _intro_md(st: Study, found: pd.DataFrame, command: str, elapsed: float | None) -> list[str]:
    """The report's head, its statistics and the primary family."""
    seeds = st.df.groupby("algorithm")["seed"].nunique()
    few = found[found["family"] == "primary"]["seeds"].min() < MIN_SEEDS
    return [
        "# Which of the paper's claims survive controls: the tiny study",
        "",
        f"Generated {date.today().isoformat()} by `{command}` from {len(st.df)} runs"
        + (f"; the study took {elapsed / 60:.1f} min" if elapsed else "")
        + ". Per-run numbers: `runs.csv`.",
        f"Base setting: tiny_llama, {st.world} ranks in the paper's mesh relations (local_4x2 / netns_4x2: "
        "FL+FSDP F = 4 > FL+HSDP F = 2 > 1, HSDP R = 4, S = 2 but FSDP), "
        f"{st.steps} steps, lr {st.lr:g} shared by all (AdamW, warm-up + cosine), A = {st.every}. "
        "Seeds per algorithm: " + ", ".join(f"{_name(a)} {seeds.get(a, 0)}" for a in ORDER) + ".",
        "",
        "**Statistics** (analysis/stats.py, one definition for every study). Runs with the same seed share "
        "initial weights (fldp.init) and data order, so configurations are compared seed by seed: the ratio "
        "is the geometric mean of the per-seed ratios, the interval a Student-t interval on the mean log "
        f"ratio. The tie band is {TIE_LOW:.3f}-{TIE_HIGH:.3f} (the two within 1% of the larger). "
        "*Direction*: reproduced when the interval lies beyond the band on the paper's side, opposite when "
        "beyond it on the other side, tie when inside it, inconclusive when it reaches into the band and out. "
        "*Size*: whether the paper's own ratio lies inside the interval (if not: the effect size is refuted "
        f"at this scale). Fewer than {MIN_SEEDS} seeds give no verdict (n/a): with 2 seeds every seed agrees "
        "1 time in 4 with no effect at all.",
        "",
        "**Which comparisons are findings.** The primary family is the paper's five perplexity claims in "
        f"the primary setting (fp32, the shared lr {st.lr:g}), judged as one family: the intervals shown "
        f"are simultaneous (Bonferroni: each of the m at 1 - {1 - LEVEL:.2f} / m, the column `level`, so that "
        f"all m cover their true ratios together at least {LEVEL:.0%} of the time), and the size is read from "
        "them; the direction is read from the interval at the level Holm's step-down assigns each claim "
        "(the column `direction at`: never wider than the one shown, as Holm guarantees the rejections, "
        "not the intervals' joint coverage). "
        "Everything else (the same claims at the other learning rates, in bf16 and at each one's best lr, "
        "the time claims, the batch controls, the precision drift and the A frontier) is **exploratory**: "
        "its plain 95% interval and direction are shown, not corrected for the number of comparisons "
        "(about one in twenty of them excludes 1 by chance), and none of it is a finding.",
        "",
        "## The primary family: the paper's perplexity claims, fp32, shared lr",
        "",
        (
            f"Fewer than {MIN_SEEDS} seeds: no verdicts (a reduced run, not the study)."
            if few
            else "Simultaneous 95% intervals over these five claims; directions by Holm's step-down."
        ),
        "",
        _findings_md(found, "primary"),
        "",
    ]


def _by_lr_and_precision_md(st: Study, paper: dict, tables: dict) -> list[str]:
    """The claims by lr, the exploratory comparisons and the precision drift."""
    lr_claims, found, dr = tables["findings_by_lr"], tables["findings"], tables["drift"]
    paper_gap, gap = paper_ratio(paper, "hsdp", "fsdp"), _bf16_gap(st, paper)
    return [
        "## What holds at which learning rate (exploratory)",
        "",
        "The five claims with every algorithm at the same lr, fp32, each cell the ratio [plain 95% interval] "
        "and its direction (the shared lr's column is the primary runs at the plain 95% level; their "
        "verdicts are the table above).",
        "",
        markdown(lr_claims),
        "",
        "## Exploratory comparisons",
        "",
        _findings_md(found, "exploratory"),
        "",
        "## Precision: HSDP against FSDP (the same mathematics) in fp32 and bf16 (exploratory)",
        "",
        markdown(dr),
        "",
        "FedAvg's accumulation dtype (`algorithm.outer.reduce_dtype`): with F = 2 summing in bf16 and in "
        "fp32 are the same arithmetic (halving is exact in binary floating point, so rounding the sum "
        "or the mean rounds alike); from F = 4 on they can differ.",
        "",
        f"Could bf16 reduction order produce a gap of the paper's size (HSDP / FSDP {paper_gap:.2f}) at this "
        f"scale? {gap}.",
        "",
        "![HSDP - FSDP train loss per step](drift.png)",
        "",
    ]


def _controls_and_frontier_md(st: Study, tables: dict, fr: pd.DataFrame, network: str) -> list[str]:
    """The batch-matched control, the lr table and the A frontier."""
    bc, lrt = tables["batch_control"], tables["lr"]
    fr_md = fr.copy()
    if len(fr_md):
        fr_md["train time [s]"] = fr_md["train time [s]"].map(lambda v: f"{v:.1f}")
        fr_md["eval perplexity"] = fr_md["eval perplexity"].map(lambda v: f"{v:.1f}")
        fr_md = fr_md.drop(columns=["/ FSDP", "low", "high"])
    return [
        "## Batch-matched control (exploratory)",
        "",
        "Each FL group steps on 1/F of the pool's batch. The controls train FSDP or HSDP on exactly one "
        "group's per-update batch (a smaller mesh: the same mathematics as one group that never "
        "averages) at the shared learning rate, for the same number of steps and for F times as many "
        "(the federation's tokens). A ratio above 1 means the FL run reached the lower perplexity.",
        "",
        markdown(bc) if len(bc) else "No control runs.",
        "",
        "## Learning rate",
        "",
        f"Eval perplexity, geometric mean [95% t-interval on the mean log] over seeds, fp32, {st.steps} steps.",
        "",
        markdown(lrt),
        "",
        "## Perplexity against time: A at each algorithm's F (exploratory)",
        "",
        f"FL runs at every A, each FL algorithm at its own F (FL+FSDP 4, FL+HSDP 2: F changes only with the "
        f"algorithm, so this varies A, not F), fp32, shared lr, on the `{network}` network, on the seeds "
        f"every point ran ({int(fr['seeds'].min()) if len(fr) else 0} each); mean eval perplexity, and "
        "relative to FSDP's in the same seed (paired: the seeds differ far more than the points)"
        + (
            " (no emulated network was used: times are loopback's, CPU contention and not the paper's link)"
            if network == "loopback"
            else ""
        )
        + "; FSDP and HSDP for reference. With this few seeds the "
        "intervals are wide: the table describes the points and claims no ordering between them.",
        "",
        markdown(fr_md) if len(fr_md) else "No runs.",
        "",
        "![eval perplexity against training time](frontier.png)" if len(fr) else "",
        "",
    ]


def _limitations_md(st: Study) -> list[str]:
    return [
        "## Limitations",
        "",
        "- Each algorithm's best learning rate is picked on the same seeds it is then compared on, which "
        "biases those comparisons toward whichever algorithm's seeds happened to favour one lr; they are "
        "exploratory for this reason too (the paper_shape study tunes on separate seeds).",
        "- The primary verdicts are for the shared lr; the same claims at the grid's other lrs (the table by "
        "lr) are exploratory, and a ratio's side of 1 can change with the lr.",
        f"- tiny_llama, {st.steps} steps, {st.world} ranks: a refuted effect size is refuted at this scale, "
        "not at the paper's.",
        "",
    ]


def main(argv: list[str] | None = None) -> int:
    parser = reports_parser("python -m analysis.science", __doc__)
    parser.add_argument("--elapsed", type=float, default=None, help="the study's wall time [s], for the report")
    args = parser.parse_args(argv)
    runs, problems = collect_for("analysis.science", args.runs, args.allow_mixed)
    if not runs:
        return 1
    command = "python -m analysis.science " + shlex.join(argv if argv is not None else sys.argv[1:])
    path = report(Study(runs), paper_values.load(args.paper), args.out, command, args.elapsed)
    print(f"analysis.science: {len(runs)} runs, {len(problems)} skipped; wrote {path}")
    return 1 if args.strict and problems else 0


if __name__ == "__main__":
    sys.exit(main())
