"""The paper's headline ratios and findings, computed from the runs beside the paper's values.

Every finding is a ratio a / b the paper finds above 1, paired by seed (runs with the same seed
share the initial weights and data order) and judged by analysis/stats.py: the paper's five
perplexity claims are the primary family (simultaneous 95% intervals for the size, Holm's step-down
for the direction); the time claims are exploratory (a plain 95% interval, not a finding). Each finding is also checked on the paper's own tables, so its definition
is known to match the paper."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pandas as pd

from fldp.schedule import aggregation_steps, schedule_of

from .records import Run
from .render import HEADERS3
from .stats import Claim, explore, judge, paired_ratio
from .tables import NAMES, per_run

METRIC_NAMES = {**HEADERS3, "step_time_s": "step time [s]"}
# The paper's perplexity claims, (a, b) of an eval-perplexity ratio a / b it finds above 1 (Table 3):
# b reaches the lower perplexity. The primary family of every study of the tiny reproduction.
PPL_FINDINGS = [("hsdp", "fl_hsdp"), ("fsdp", "fl_hsdp"), ("fsdp", "fl_fsdp"), ("fl_fsdp", "fl_hsdp"), ("hsdp", "fsdp")]


def run_values(runs: list[Run]) -> tuple[pd.DataFrame, list[str]]:
    """Long frame (algorithm, seed, metric columns) for the algorithms run in exactly one
    configuration; notes for those left out (a claim about "FSDP" needs one FSDP)."""
    df = per_run(runs)
    df["step_time_s"] = [r.steps["time_step"].mean() for r in runs]
    notes, keep = [], []
    for algo, g in df.groupby("algorithm"):
        if g["label"].nunique() > 1:
            notes.append(
                f"{NAMES.get(algo, algo)} was run in {g['label'].nunique()} configurations "
                f"({'; '.join(sorted(g['label'].unique()))}): left out of the ratios and findings"
            )
        else:
            keep.append(algo)
    return df[df["algorithm"].isin(keep)].reset_index(drop=True), notes


def paper_values(paper: dict) -> pd.DataFrame:
    t3, t4 = paper["table3"], paper["table4"]
    overall = t4["columns"].index("overall")
    return pd.DataFrame(
        [
            {"algorithm": a, "seed": 0, **dict(zip(t3["columns"], vals)), "step_time_s": t4["mean"][a][overall]}
            for a, vals in t3["rows"].items()
        ]
    )


def _wide(values: pd.DataFrame, metric: str) -> pd.DataFrame:
    """seed x algorithm."""
    return values.pivot_table(index="seed", columns="algorithm", values=metric, aggfunc="first")


def _mean_std(values: pd.DataFrame, metric: str, algo: str, decimals: int = 2) -> str:
    v = values.loc[values["algorithm"] == algo, metric]
    text = f"{v.mean():.{decimals}f}"
    return text + (f" ± {v.std():.{decimals}f}" if len(v) > 1 else "")


def _paired(values: pd.DataFrame, metric: str, num: str, den: str) -> tuple[pd.Series, pd.Series]:
    """num / den over the seeds both ran (an empty pair when either is missing)."""
    w = _wide(values, metric) if len(values) else pd.DataFrame()
    if not {num, den} <= set(w.columns):
        return pd.Series(dtype=float), pd.Series(dtype=float)
    return w[num], w[den]


def ratios(paper: dict, values: pd.DataFrame) -> pd.DataFrame:
    """Each quoted ratio, described (its verdict is the findings'): the geometric mean of the
    per-seed ratios and its 95% interval, the paper's quoted value and the value its Table 3 gives
    (they can differ: the text rounds or quotes another column)."""
    p = paper_values(paper).set_index("algorithm")
    rows = []
    for r in paper["ratios"]:
        num, den, metric = r["numerator"], r["denominator"], r["metric"]
        runs = paired_ratio(*_paired(values, metric, num, den))
        rows.append(
            {
                "ratio": r["name"],
                "runs_ratio": runs.ratio,
                "runs_low": runs.low,
                "runs_high": runs.high,
                "seeds": runs.seeds,
                "paper_quoted": r["quoted"],
                "paper_table3": p.loc[num, metric] / p.loc[den, metric],
            }
        )
    return pd.DataFrame(rows)


@dataclass(frozen=True)
class Finding:
    """The paper finds metric(a) / metric(b) above 1."""

    claim: str
    metric: str
    a: str
    b: str


FINDINGS = tuple(
    Finding(
        "HSDP ends with a higher eval perplexity than FSDP (paper: 2.35x, though the two are mathematically equivalent)"
        if (a, b) == ("hsdp", "fsdp")
        else f"{NAMES[b]} reaches a lower eval perplexity than {NAMES[a]}",
        "eval_perplexity",
        a,
        b,
    )
    for a, b in PPL_FINDINGS
)
EXPLORATORY = (
    *(
        Finding(f"FL+FSDP trains faster than {NAMES[a]}", "train_time_s", a, "fl_fsdp")
        for a in ("fsdp", "hsdp", "fl_hsdp")
    ),
    *(
        Finding(f"FSDP's training step is slower than {NAMES[b]}'s (Table 4, overall)", "step_time_s", "fsdp", b)
        for b in ("hsdp", "fl_fsdp", "fl_hsdp")
    ),
    *(
        Finding(f"FSDP's evaluation is slower than {NAMES[b]}'s", "eval_time_s", "fsdp", b)
        for b in ("hsdp", "fl_fsdp", "fl_hsdp")
    ),
)


def findings(paper: dict, values: pd.DataFrame, runs: list[Run]) -> pd.DataFrame:
    """One row per finding: the paper's ratio, the runs' paired ratio and interval, direction and
    size (stats.judge for the primary family, stats.explore for the rest), then the records check
    of periodic aggregation."""
    p = paper_values(paper).set_index("algorithm")

    def claims(found):
        return [
            Claim(f.claim, *_paired(values, f.metric, f.a, f.b), p.loc[f.a, f.metric] / p.loc[f.b, f.metric])
            for f in found
        ]

    frames = []
    for family, found, verdicts in (("primary", FINDINGS, judge), ("exploratory", EXPLORATORY, explore)):
        frame = verdicts(claims(found)).rename(columns={"claim": "finding"})
        frames.append(
            frame.assign(
                family=family,
                metric=[METRIC_NAMES[f.metric] for f in found],
                comparison=[f"{NAMES[f.a]} / {NAMES[f.b]}" for f in found],
                runs=[
                    f"{NAMES[f.a]} {_mean_std(values, f.metric, f.a)}; {NAMES[f.b]} {_mean_std(values, f.metric, f.b)}"
                    if len(values) and {f.a, f.b} <= set(values["algorithm"])
                    else ""
                    for f in found
                ],
            )
        )
    out = pd.concat(frames, ignore_index=True)
    text, detail = periodic_aggregation(runs)
    check = {
        "family": "records check",
        "finding": "FL aggregates (and spends time on it) only every A steps and at the last step; FSDP and HSDP never",
        "metric": "aggregation time",
        "comparison": "",
        "runs": detail,
        "direction": text,
        "size": "",
        "paper": math.nan,
    }
    out = pd.concat([out, pd.DataFrame([check])], ignore_index=True)
    return out.astype({"seeds": "Int64"})  # the records check has none


def quote_notes(ratios: pd.DataFrame) -> list[str]:
    """Where the paper's text quotes a ratio its own Table 3 does not give (beyond rounding)."""
    off = ratios[(ratios["paper_quoted"] - ratios["paper_table3"]).abs() > 0.006]
    return [
        f"the paper quotes {r.ratio} as {r.paper_quoted:.2f}, its own Table 3 gives {r.paper_table3:.2f}"
        for r in off.itertuples()
    ]


def periodic_aggregation(runs: list[Run]) -> tuple[str, str]:
    """FL's aggregation runs (and costs time) only every A steps and at the last step; the other
    algorithms never aggregate. The paper's evidence is Table 4's aggregation column (0 for FSDP
    and HSDP, std > mean for FL: rare spikes); here every step's record is checked, against the
    steps the run's A or schedule names (fldp.schedule.aggregation_steps, the trainer's rule)."""
    bad, fl = [], 0
    for run in runs:
        s, every = run.steps, run.summary.get("every")
        last = int(s["step"].iloc[-1])
        expected = set(aggregation_steps(schedule_of(every), last)) if every else set()
        fl += bool(every)
        done = set(s.loc[s["aggregated"].astype(bool), "step"])
        t = s["time_aggregation"]
        idle = t[~s["step"].isin(done)].max() if len(done) < len(s) else 0.0
        # every aggregating step costs more than any other step's (empty) aggregation phase
        if done != expected or (done and t[s["step"].isin(done)].min() <= idle):
            bad.append(
                f"{run.name}: aggregated at steps {sorted(done)} (expected {sorted(expected)}); "
                f"largest aggregation time on another step {idle:.2g} s"
            )
    if not fl:
        return "not tested: no FL runs", ""
    if bad:
        return "fails", "; ".join(bad)
    return "holds in every run", (
        f"in all {len(runs)} runs ({fl} with FL): aggregation on steps A, 2A, ... and "
        f"the last only, each costing more than any other step's aggregation phase"
    )
