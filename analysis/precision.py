"""The precision study (experiments/precision/PLAN.md): the plan's decisions and its report.

    python -m analysis.precision RUNS --decide [--seeds N]      # for experiments/precision.sh
    python -m analysis.precision RUNS --out DIR [--elapsed S] [--strict]

Every run says which phase made it by its directory (RUNS/pilot/..., RUNS/judge/...) and which arm
by its configuration: the algorithm, and its reductions (`fsdp.reduce_dtype=fp32`: the fp32r arm;
else every reduction in bf16). --decide applies the plan's seed rule to the pilot and prints it as
shell assignments (`seeds`: the bf16 arms' judging seeds, `seeds_fp32r`: the fp32r arms'). The
report: runs.csv, losses.csv.gz, pilot.csv, findings.csv (the primary family on the bf16 arms, the
secondary bf16 / fp32r per algorithm, and the fp32r arms' P1-P3 reported beside), figure.png and
report.md, which quotes the plan."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only

import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

from .paper_shape import changed, committed, displayed, losses, plan_quote, run_study  # noqa: E402
from .paper_shape import frame as shape_frame  # noqa: E402
from .render import markdown  # noqa: E402
from .science import paper_ratio  # noqa: E402
from .stats import Claim, explore, judge, paired_ratio, seeds_for  # noqa: E402
from .tables import NAMES  # noqa: E402

PLAN = Path(__file__).resolve().parents[1] / "experiments" / "precision" / "PLAN.md"
ALGORITHMS = ("fsdp", "hsdp", "fl_fsdp", "fl_hsdp")
REDUCTIONS = ("bf16", "fp32r")
# the primary family on the bf16 arms: (claim, numerator, denominator), worse-in-the-paper on top
PRIMARY = (
    ("P1 FL+HSDP reaches a lower perplexity than FSDP", "fsdp", "fl_hsdp"),
    ("P2 FL+FSDP reaches a lower perplexity than FSDP", "fsdp", "fl_fsdp"),
    ("P3 FL+HSDP reaches a lower perplexity than FL+FSDP", "fl_fsdp", "fl_hsdp"),
    ("P4 HSDP ends with a higher perplexity than FSDP", "hsdp", "fsdp"),
)
HALF_WIDTH, TARGET, MIN_SEEDS = 0.018, 0.02, 5  # the plan: N for +-1.8%, the target +-2%, N >= 5
BUDGET_S = 120 * 60  # the judging runs' cap: 120 minutes of this machine at the pilot's times
FALLBACK_SEEDS = 3  # the plan (and its amendment 1): the fp32r arms' seeds when the cap is under 5


def frame(runs) -> pd.DataFrame:
    """paper_shape's one row per run, with the arm's reductions."""
    df = shape_frame(runs)
    df.insert(3, "reductions", [_reductions(run.config) for run in runs])
    return df


def _reductions(config: dict) -> str:
    return "fp32r" if config.get("fsdp.reduce_dtype") == "fp32" else "bf16"


def arm(df: pd.DataFrame, algorithm: str, reductions: str, phase: str) -> pd.Series:
    """Eval perplexity by seed."""
    sel = df[(df["phase"] == phase) & (df["algorithm"] == algorithm) & (df["reductions"] == reductions)]
    return sel.drop_duplicates("seed").set_index("seed")["eval_perplexity"]


def primary(df: pd.DataFrame, phase: str, paper: dict, reductions: str = "bf16") -> list[Claim]:
    return [
        Claim(name, arm(df, num, reductions, phase), arm(df, den, reductions, phase), paper_ratio(paper, num, den))
        for name, num, den in PRIMARY
    ]


def secondary(df: pd.DataFrame, phase: str) -> list[Claim]:
    """bf16 reductions make X worse: X-bf16 / X-fp32r. The paper gives no value; the claim's side is
    above 1 (inf: the side for `direction`; `findings` blanks the size it would read)."""
    return [
        Claim(
            f"bf16 reductions make {NAMES.get(a, a)} worse",
            arm(df, a, "bf16", phase),
            arm(df, a, "fp32r", phase),
            math.inf,
        )
        for a in ALGORITHMS
    ]


def seconds_per_run(df: pd.DataFrame, phase: str = "pilot") -> pd.Series:
    """Each arm's mean training time per run [s], indexed by (algorithm, reductions)."""
    return df[df["phase"] == phase].groupby(["algorithm", "reductions"])["train_time_s"].mean()


def pilot(df: pd.DataFrame, paper: dict) -> pd.DataFrame:
    """Each ratio of both families on the pilot seeds: its paired SD of log ratios and the seeds it
    needs for +-1.8% (the primary family's set N)."""
    rows = []
    for family, claims in (("primary", primary(df, "pilot", paper)), ("secondary", secondary(df, "pilot"))):
        for c in claims:
            r = paired_ratio(c.a, c.b)
            need = seeds_for(r.sd, HALF_WIDTH) if r.seeds >= 2 and r.sd > 0 else (MIN_SEEDS if r.seeds >= 2 else None)
            rows.append(
                {"family": family, "claim": c.name, "pilot_seeds": r.seeds, "sd_log": r.sd, "seeds_needed": need}
            )
    return pd.DataFrame(rows)


def judging_seeds(needed: pd.Series, seconds: pd.Series) -> tuple[int, int]:
    """(N for the bf16 arms, N for the fp32r arms), by the plan's rule and its amendment 1: the
    least n giving every primary ratio +-1.8%, at least MIN_SEEDS, capped so that one seed of all
    eight arms times N fits BUDGET_S. A cap under MIN_SEEDS: the fp32r arms get FALLBACK_SEEDS and
    the bf16 arms what is left of the budget, at least FALLBACK_SEEDS."""
    want = max(MIN_SEEDS, int(needed.max()))
    per_reduction = seconds.groupby(level="reductions").sum()
    cap = int(BUDGET_S // per_reduction.sum())
    if cap >= MIN_SEEDS:
        return min(want, cap), min(want, cap)
    left = BUDGET_S - FALLBACK_SEEDS * per_reduction.get("fp32r", 0.0)
    return max(FALLBACK_SEEDS, min(want, int(left // per_reduction["bf16"]))), FALLBACK_SEEDS


def decide(df: pd.DataFrame, fixed_seeds: int | None, paper: dict) -> list[str]:
    if fixed_seeds:
        return [f"seeds={fixed_seeds}", f"seeds_fp32r={fixed_seeds}"]
    done = df[df["phase"] == "pilot"].groupby(["algorithm", "reductions"]).size()
    if len(done) < len(ALGORITHMS) * len(REDUCTIONS):
        return []
    need = pilot(df, paper)
    n, n_fp32r = judging_seeds(need[need["family"] == "primary"]["seeds_needed"], seconds_per_run(df))
    return [f"seeds={n}", f"seeds_fp32r={n_fp32r}"]


def findings(df: pd.DataFrame, paper: dict) -> pd.DataFrame:
    """The primary family (bf16 arms), the secondary (bf16 / fp32r per algorithm) and, reported
    beside and not judged, P1-P4 among the fp32r arms."""
    primary_t = judge(primary(df, "judge", paper)).assign(family="primary")
    secondary_t = judge(secondary(df, "judge")).assign(family="secondary", paper=math.nan, size="n/a (no paper value)")
    beside = explore(primary(df, "judge", paper, "fp32r")).assign(family="fp32r arms (reported, not judged)")
    table = pd.concat([primary_t, secondary_t, beside], ignore_index=True)
    table["half_width"] = table["hi"] / table["ratio"] - 1
    return table[["family", *[c for c in table.columns if c != "family"]]]


def fp32_beside(table: pd.DataFrame) -> pd.DataFrame:
    """P1-P3 in bf16 beside the paper-shape study's fp32 intervals (its primary family, committed),
    and whether the direction changed (named, not tested)."""
    fp32 = committed("findings.csv")
    if fp32.empty:
        return pd.DataFrame()
    rows = []
    for (name, _, _), (_, bf16), (_, then) in zip(
        PRIMARY, table[table["family"] == "primary"].iterrows(), fp32.iterrows()
    ):
        rows.append(
            {
                "claim": name,
                "bf16": f"{bf16['ratio']:.3f} [{bf16['lo']:.3f}, {bf16['hi']:.3f}] {bf16['direction']}",
                "fp32 (paper-shape study)": f"{then['ratio']:.3f} [{then['lo']:.3f}, {then['hi']:.3f}] {then['direction']}",
                "changed": changed(bf16["direction"], then["direction"]),
            }
        )
    return pd.DataFrame(rows)


def figure(df: pd.DataFrame, table: pd.DataFrame, out: Path) -> None:
    """Left: each arm's final perplexity per judging seed; right: the ratios with their intervals."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    judged = df[df["phase"] == "judge"]
    for j, reductions in enumerate(REDUCTIONS):
        for i, a in enumerate(ALGORITHMS):
            v = arm(judged, a, reductions, "judge")
            left.scatter(
                [i + 0.15 * (2 * j - 1)] * len(v), v, alpha=0.6, color=f"C{j}", label=reductions if i == 0 else None
            )
    left.set_xticks(range(len(ALGORITHMS)), [NAMES.get(a, a) for a in ALGORITHMS])
    left.set(yscale="log", ylabel="eval perplexity (each judging seed)", title="arms")
    left.legend(title="reductions")
    shown = table[table["family"] != "fp32r arms (reported, not judged)"].reset_index(drop=True)
    y = range(len(shown))
    right.errorbar(shown["ratio"], y, xerr=[shown["ratio"] - shown["lo"], shown["hi"] - shown["ratio"]], fmt="o")
    right.scatter(shown["paper"], y, marker="x", color="C3", label="paper")
    right.axvline(1.0, color="grey", lw=0.8)
    right.set_yticks(list(y), [c.split(" reaches")[0].split(" ends")[0] for c in shown["claim"]])
    right.set(xscale="log", xlabel="ratio (simultaneous interval)", title="P1-P4 (bf16) and bf16 / fp32r")
    right.invert_yaxis()
    right.legend()
    fig.tight_layout()
    fig.savefig(out / "figure.png", dpi=120)
    plt.close(fig)


def verdicts(df: pd.DataFrame, paper: dict, out: Path) -> list[str]:
    """The verdicts section of report.md; writes findings.csv and figure.png."""
    table = findings(df, paper)
    table.to_csv(out / "findings.csv", index=False)
    shown = displayed(table, TARGET)
    figure(df, table, out)
    beside = fp32_beside(table)
    return [
        "## Verdicts\n",
        "Each family's intervals are simultaneous (Bonferroni, 1 - 0.05 / 4); the direction reads the "
        "interval at Holm's level (analysis.stats.judge). The fp32r arms' rows are shown at 95%, not judged.\n",
        markdown(shown[["family", "claim", "interval", "paper", "direction", "size", "seeds", "target"]]),
        *(["\n### bf16 beside fp32 (named, not tested)\n", markdown(beside)] if not beside.empty else []),
        "\n![arms and ratios](figure.png)\n",
    ]


def report(df: pd.DataFrame, paper: dict, out: Path, command: str, elapsed: float | None) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    df.drop(columns=["step", "loss"]).sort_values(["phase", "algorithm", "reductions", "seed"]).to_csv(
        out / "runs.csv", index=False
    )
    losses(df, out)
    parts = [
        f"# The precision study\n\n`{command}`"
        + (f"; runs took {elapsed / 60:.1f} min" if elapsed else "")
        + f". {len(df)} runs: one row each in runs.csv, every step's training loss in losses.csv.gz.\n"
    ]
    if decide(df, None, paper):
        p = pilot(df, paper)
        p.to_csv(out / "pilot.csv", index=False)
        times = seconds_per_run(df).rename("train_time_s").reset_index()
        parts += ["## Pilot\n", markdown(p.round({"sd_log": 4})), "", markdown(times.round(1)), ""]
        parts.append("Judging seeds: " + ", ".join(decide(df, None, paper)) + " (the plan's rule and amendment 1).\n")
    if (df["phase"] == "judge").any():
        parts += verdicts(df, paper, out)
    parts.append(plan_quote(PLAN))
    path = out / "report.md"
    path.write_text("\n".join(parts) + "\n")
    return path


def main(argv: list[str] | None = None) -> int:
    return run_study("analysis.precision", __doc__, frame, decide, report, argv)


if __name__ == "__main__":
    sys.exit(main())
