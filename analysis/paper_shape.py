"""The paper-shape study (experiments/paper_shape/PLAN.md): the plan's decisions and its report.

    python -m analysis.paper_shape RUNS --decide [--seeds N]        # for experiments/paper_shape.sh
    python -m analysis.paper_shape RUNS --out DIR [--elapsed S] [--strict]
    python -m analysis.paper_shape --rejudge RESULTS                  # verdicts again, from RESULTS/runs.csv

Every run says which phase made it by its directory (RUNS/tune/..., hsdp, pilot, judge). --decide
applies the plan's rules to the runs so far and prints them as shell assignments: each arm's chosen
lr (`lr_ARM`), a grid extension where the best lr sits at an edge (`extend_ARM`), and, once the
pilot has run, the judging seeds (`seeds`). The report: runs.csv (every run), losses.csv.gz (every
run's training loss at every step), tuning.csv, pilot.csv, findings.csv (the primary family at the
chosen lrs, the secondary at the shared lr, judged by analysis.stats.judge), figure.png and
report.md, which quotes the plan."""

from __future__ import annotations

import math
import os
import shlex
import sys
from datetime import date
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only

import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

from . import paper as paper_values  # noqa: E402
from .discover import collect_for, study_parser  # noqa: E402
from .render import markdown  # noqa: E402
from .science import paper_ratio  # noqa: E402
from .stats import Claim, Ratio, judge, paired_ratio, seeds_for, size  # noqa: E402
from .tables import NAMES  # noqa: E402

PLAN = Path(__file__).resolve().parents[1] / "experiments" / "paper_shape" / "PLAN.md"
RESULTS = PLAN.parent / "results"  # the committed report, which the later studies set themselves beside
ARMS = ("fsdp", "fl_fsdp", "fl_hsdp")
BASE_GRID = (1e-3, 3e-3, 1e-2, 3e-2, 1e-1)
# the primary family: (claim, numerator, denominator, the other arm the numerator's runs stand for)
# of an eval-perplexity ratio the paper finds above 1. The paper's claims against HSDP and against
# FSDP are one test: in the simulator HSDP is FSDP's computation (identical records), so a second
# ratio would count the same data twice in Holm's family (issue 33; the plan's amendment 3). HSDP's
# own paper value is read against the same interval (size only).
CLAIMS = (
    ("FL+HSDP reaches a lower perplexity than FSDP (= HSDP)", "fsdp", "fl_hsdp", "hsdp"),
    ("FL+FSDP reaches a lower perplexity than FSDP", "fsdp", "fl_fsdp", None),
    ("FL+HSDP reaches a lower perplexity than FL+FSDP", "fl_fsdp", "fl_hsdp", None),
)
HALF_WIDTH, TARGET, MIN_SEEDS = 0.018, 0.02, 10  # the plan: N for +-1.8%, the target +-2%, N >= 10
MAX_SEEDS = 20  # the plan's amendment 1: at the pilot's SDs the rule asked for 77-668 seeds (results/pilot.csv)
# the phases of every pre-registered study's runner
PHASES = ("tune", "hsdp", "pilot", "judge", "noise16", "onepass", "base", "paper_lr", "clip")


def phase_of(name: str) -> str:
    parts = Path(name).parts
    found = [p for p in parts if p in PHASES]
    return found[-1] if found else "?"


def run_id(name: str) -> str:
    """The run's directory from its phase on (PHASE/<the swept values>): unique in a study, and no
    machine's path in a committed file."""
    parts = Path(name).parts
    at = max((i for i, p in enumerate(parts) if p in PHASES), default=len(parts) - 1)
    return "/".join(parts[at:])


def frame(runs) -> pd.DataFrame:
    """One row per run: what the plan and runs.csv need."""
    rows = []
    for run in runs:
        s = run.summary
        rows.append(
            {
                "run": run_id(run.name),
                "phase": phase_of(run.name),
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
    """df with the rows of RESULTS/runs.csv whose phase df lacks, each with its training losses from
    RESULTS/losses.csv.gz: a report made again after new phases ran, from the per-run numbers an
    earlier report committed. Rows of other commits than df's are refused (exit 2) unless allow_mixed."""
    earlier = pd.read_csv(results / "runs.csv")
    if df.empty:  # every row from the earlier report (a report made again from its numbers)
        df = pd.DataFrame(columns=[*earlier.columns, "step", "loss"])
    earlier = earlier[~earlier["phase"].isin(set(df["phase"]))]
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


def committed(name: str, phase: str | None = None, results: Path = RESULTS) -> pd.DataFrame:
    """The committed report's RESULTS/NAME (runs.csv: only `phase`'s rows; findings.csv: only the
    primary family, in CLAIMS' order), empty where this checkout has none (an installed analysis)."""
    path = results / name
    if not path.exists():
        return pd.DataFrame()
    table = pd.read_csv(path)
    if phase is not None:
        table = table[table["phase"] == phase]
    if "setting" in table.columns:
        table = table[table["setting"].str.endswith("(primary)")]
    return table.reset_index(drop=True)


SAME_RUN = ["algorithm", "seed", "steps", "F", "R", "S"]  # a rerun of a run: the same arm, seed, length and mesh


def beside_committed(runs: pd.DataFrame, column: str, results: Path = RESULTS) -> pd.DataFrame:
    """Each of `runs` beside the committed judging run it reruns (SAME_RUN; in RESULTS/runs.csv):
    its `column`, the committed one (`column`_committed), both commits and the relative
    difference; empty where none is committed."""
    then = committed("runs.csv", "judge", results)
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


def geometric_mean(values: pd.Series) -> float:
    return math.exp(values.map(math.log).mean())


def tuning(df: pd.DataFrame) -> pd.DataFrame:
    """Geometric-mean eval perplexity over the tuning seeds, per arm (rows) and lr (columns)."""
    tune = df[df["phase"] == "tune"]
    return tune.groupby(["algorithm", "lr"])["eval_perplexity"].apply(geometric_mean).unstack("lr")


def chosen_lrs(table: pd.DataFrame) -> tuple[dict, dict]:
    """Each arm's lr with the lowest geometric-mean perplexity, and the one-value extension the
    plan asks for where that is at the edge of the arm's grid (once: not past an extended grid)."""
    chosen, extend = {}, {}
    for arm in ARMS:
        if arm not in table.index:
            continue
        row = table.loc[arm].dropna()
        best = float(row.idxmin())
        chosen[arm] = best
        grid = sorted(row.index)
        if len(grid) > 1 and set(grid) <= set(BASE_GRID):  # not yet extended
            if best == grid[0]:
                extend[arm] = best / math.sqrt(10)
            elif best == grid[-1]:
                extend[arm] = best * math.sqrt(10)
    return chosen, extend


def arm(df: pd.DataFrame, algorithm: str, lr: float, phase: str) -> pd.Series:
    """Eval perplexity by seed."""
    sel = df[(df["phase"] == phase) & (df["algorithm"] == algorithm) & (df["lr"] == lr)]
    return sel.drop_duplicates("seed").set_index("seed")["eval_perplexity"]


def claims(df: pd.DataFrame, lrs: dict, phase: str, paper: dict) -> list[Claim]:
    return [
        Claim(name, arm(df, num, lrs[num], phase), arm(df, den, lrs[den], phase), paper_ratio(paper, num, den))
        for name, num, den, _ in CLAIMS
    ]


def stood_for(table: pd.DataFrame, paper: dict) -> pd.DataFrame:
    """judge's table with `paper_hsdp` and `size_hsdp`: on the claim whose numerator stands for HSDP
    too (CLAIMS), the paper's HSDP ratio and the size verdict of the same interval against it."""
    values, sizes = [], []
    for (_, _, den, also), row in zip(CLAIMS, table.itertuples()):
        if also is None:
            values.append(math.nan)
            sizes.append("")
            continue
        value = paper_ratio(paper, also, den)
        values.append(value)
        sizes.append(size(Ratio(row.ratio, row.lo, row.hi, int(row.seeds)), value))
    return table.assign(paper_hsdp=values, size_hsdp=sizes)


def pilot(df: pd.DataFrame, lrs: dict, paper: dict) -> pd.DataFrame:
    """Each primary ratio's paired SD of log ratios on the pilot seeds, and the seeds it needs."""
    rows = []
    for c in claims(df, lrs, "pilot", paper):
        r = paired_ratio(c.a, c.b)
        need = seeds_for(r.sd, HALF_WIDTH) if r.seeds >= 2 and r.sd > 0 else (MIN_SEEDS if r.seeds >= 2 else None)
        rows.append({"claim": c.name, "pilot_seeds": r.seeds, "sd_log": r.sd, "seeds_needed": need})
    return pd.DataFrame(rows)


def judging_seeds(needed: pd.Series) -> int:
    """N: the most seeds any primary ratio needs, at least MIN_SEEDS, at most MAX_SEEDS."""
    return min(MAX_SEEDS, max(MIN_SEEDS, int(needed.max())))


def decide(df: pd.DataFrame, fixed_seeds: int | None, paper: dict) -> list[str]:
    chosen, extend = chosen_lrs(tuning(df))
    lines = [f"lr_{a}={lr:g}" for a, lr in chosen.items()] + [f"extend_{a}={lr:.3g}" for a, lr in extend.items()]
    if fixed_seeds:
        lines.append(f"seeds={fixed_seeds}")
    elif len(chosen) == len(ARMS) and (df["phase"] == "pilot").any():
        need = pilot(df, chosen, paper)["seeds_needed"]
        if need.notna().all():
            lines.append(f"seeds={judging_seeds(need)}")
    return lines


def findings(df: pd.DataFrame, chosen: dict, paper: dict) -> pd.DataFrame:
    """The primary family (each arm at its chosen lr) and the secondary one (all at FSDP's lr)."""
    tables = []
    for setting, lrs in (
        ("each arm's chosen lr (primary)", chosen),
        (f"shared lr {chosen['fsdp']:g} (secondary)", {a: chosen["fsdp"] for a in ARMS}),
    ):
        t = stood_for(judge(claims(df, lrs, "judge", paper)), paper)
        t.insert(1, "setting", setting)
        t["half_width"] = (t["hi"] / t["ratio"]).map(lambda x: x - 1)
        tables.append(t)
    return pd.concat(tables, ignore_index=True)


def hsdp_check(df: pd.DataFrame) -> str:
    """Whether HSDP's run equals FSDP's (same seed and lr) record for record."""
    h = df[df["phase"] == "hsdp"]
    if h.empty:
        return "not run"
    row = h.iloc[0]
    f = df[(df["algorithm"] == "fsdp") & (df["seed"] == row["seed"]) & (df["lr"] == row["lr"])]
    if f.empty:
        return f"HSDP ran (seed {row['seed']}, lr {row['lr']:g}) but no FSDP run shares its seed and lr"
    same = f.iloc[0]["loss"] == row["loss"] and f.iloc[0]["eval_loss"] == row["eval_loss"]
    return (
        f"HSDP seed {row['seed']}, lr {row['lr']:g}: every training loss and the eval loss "
        f"{'identical to' if same else 'DIFFER from'} FSDP's"
    )


def figure(df: pd.DataFrame, chosen: dict, out: Path) -> None:
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    table = tuning(df)
    for i, a in enumerate(ARMS):  # one colour per arm in both panels
        if a in table.index:
            row = table.loc[a].dropna()
            left.plot(row.index, row.values, marker="o", color=f"C{i}", label=NAMES.get(a, a))
    left.set(
        xscale="log",
        yscale="log",
        xlabel="learning rate",
        ylabel="eval perplexity (geometric mean, tuning seeds)",
        title="lr grid",
    )
    left.legend()
    judged = df[df["phase"] == "judge"]
    for i, a in enumerate(ARMS):
        v = judged[(judged["algorithm"] == a) & (judged["lr"] == chosen.get(a))]["eval_perplexity"]
        right.scatter([i] * len(v), v, alpha=0.6, color=f"C{i}")
    right.set_xticks(range(len(ARMS)), [f"{NAMES.get(a, a)}\nlr {chosen.get(a, math.nan):g}" for a in ARMS])
    right.set(ylabel="eval perplexity (each judging seed)", title="chosen lr")
    fig.tight_layout()
    fig.savefig(out / "figure.png", dpi=120)
    plt.close(fig)


VERDICTS_NOTE = (
    f"Intervals: simultaneous, each of a family's {len(CLAIMS)} at 1 - 0.05 / {len(CLAIMS)} = "
    f"{1 - 0.05 / len(CLAIMS):.2%} (Bonferroni), so that all {len(CLAIMS)} cover their true ratios together "
    "at least 95% of the time; the size verdict reads them. The direction "
    "reads the interval at the level Holm's step-down assigns the claim (`direction at`; never wider). "
    "The plan's amendment 2. HSDP is identical to FSDP in exact arithmetic (one computation in this "
    "simulator: the HSDP section above), so the paper's claims that FL+HSDP beats HSDP and that it beats "
    "FSDP are one test here, its interval read against both paper values (HSDP's in brackets; the plan's "
    "amendment 3)."
)


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


def verdicts(df: pd.DataFrame, chosen: dict, paper: dict, out: Path) -> list[str]:
    """The verdicts section of report.md; writes findings.csv."""
    f = findings(df, chosen, paper)
    f.to_csv(out / "findings.csv", index=False)
    shown = displayed(f, TARGET).assign(
        **{"direction at": f["direction_level"].map("{:.4f}".format)},
        paper=[f"{v:.2f}" + ("" if math.isnan(h) else f" (HSDP {h:.2f})") for v, h in zip(f["paper"], f["paper_hsdp"])],
        size=[
            s + (f" (HSDP's value: {'the same' if sh == s else sh})" if sh else "")
            for s, sh in zip(f["size"], f["size_hsdp"])
        ],
    )
    table = shown[["claim", "setting", "interval", "paper", "direction", "direction at", "size", "seeds", "target"]]
    return [
        "## Verdicts\n",
        VERDICTS_NOTE + "\n",
        markdown(table),
        "\nHSDP ends with a higher perplexity than FSDP (paper 2.35): a tie by construction (one computation).\n",
    ]


def plan_quote(plan_path: Path = PLAN) -> str:
    plan = (
        plan_path.read_text().splitlines()
        if plan_path.exists()
        else ["(not found: an installed analysis has no experiments/)"]
    )
    shown = "/".join(plan_path.parts[-3:])
    return f"## The plan\n\n(quoted from {shown})\n\n" + "\n".join("> " + line for line in plan)


def rejudge(results: Path, paper: dict, command: str) -> Path:
    """Re-derives findings.csv and report.md's verdicts and plan quotation from a report's runs.csv
    (the per-run numbers; the rest of report.md, which needs the runs' records, is kept)."""
    df = pd.read_csv(results / "runs.csv")
    chosen, _ = chosen_lrs(tuning(df))
    path = results / "report.md"
    text = path.read_text()
    if "## Verdicts\n" not in text or len(chosen) < len(ARMS):
        raise SystemExit(f"analysis.paper_shape: {results} has no judged study to re-derive")
    head = text[: text.index("## Verdicts\n")]
    figure_line = [line for line in text.splitlines() if line.startswith("![")]
    parts = [
        head.rstrip("\n") + "\n",
        *verdicts(df, chosen, paper, results),
        f"Verdicts re-derived {date.today().isoformat()} from runs.csv by `{command}`.\n",
        *[line + "\n" for line in figure_line],
        plan_quote(),
    ]
    path.write_text("\n".join(parts) + "\n")
    return path


def report(df: pd.DataFrame, paper: dict, out: Path, command: str, elapsed: float | None) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    df.drop(columns=["step", "loss"]).sort_values(["phase", "algorithm", "lr", "seed"]).to_csv(
        out / "runs.csv", index=False
    )
    losses(df, out)
    table = tuning(df)
    table.to_csv(out / "tuning.csv")
    chosen, extend = chosen_lrs(table)
    parts = [
        f"# The paper-shape study\n\n`{command}`"
        + (f"; runs took {elapsed / 60:.1f} min" if elapsed else "")
        + f". {len(df)} runs: one row each in runs.csv, every step's training loss in {LOSSES}.\n",
        "## Learning rate (tuning seeds)\n",
        markdown(table.round(1).reset_index()),
        "\nChosen: "
        + ", ".join(f"{NAMES.get(a, a)} {lr:g}" for a, lr in chosen.items())
        + (f"; still at a grid edge: {', '.join(extend)}" if extend else "")
        + "\n",
        f"## HSDP\n\n{hsdp_check(df)}.\n",
    ]
    if len(chosen) == len(ARMS) and (df["phase"] == "pilot").any():
        p = pilot(df, chosen, paper)
        p.to_csv(out / "pilot.csv", index=False)
        n = judging_seeds(p["seeds_needed"]) if p["seeds_needed"].notna().all() else None
        parts += [
            "## Pilot: the seeds the plan asks for\n",
            markdown(p.round({"sd_log": 4})),
            "",
            f"Judging seeds N = {n} (the largest need, at least {MIN_SEEDS}, at most {MAX_SEEDS}: the "
            f"plan's amendment 1)."
            if n is not None
            else "Judging seeds: not yet known (pilot incomplete).",
            "",
        ]
    if len(chosen) == len(ARMS) and (df["phase"] == "judge").any():
        parts += verdicts(df, chosen, paper, out)
        figure(df, chosen, out)
        parts.append("![lr grid and judging seeds](figure.png)\n")
    parts.append(plan_quote())
    path = out / "report.md"
    path.write_text("\n".join(parts) + "\n")
    return path


def report_command(argv: list[str] | None, module: str = "analysis.paper_shape") -> str:
    # paths under the working directory shown relative to it: no machine's absolute path in a report
    shown = [
        os.path.relpath(a) if os.path.isabs(a) and a.startswith(os.getcwd() + os.sep) else a
        for a in (argv if argv is not None else sys.argv[1:])
    ]
    return f"python -m {module} " + shlex.join(shown)


def main(argv: list[str] | None = None) -> int:
    parser = study_parser("analysis.paper_shape", __doc__)
    parser.add_argument(
        "--rejudge",
        type=Path,
        metavar="RESULTS",
        help="re-derive RESULTS/findings.csv and report.md's verdicts from RESULTS/runs.csv",
    )
    args = parser.parse_args(argv)
    if args.rejudge is not None:
        if args.runs or args.decide or args.out:
            parser.error("--rejudge RESULTS takes no RUNS, --decide or --out")
        if not (args.rejudge / "runs.csv").is_file():
            parser.error(f"--rejudge: no runs.csv in {args.rejudge}")
        path = rejudge(args.rejudge, paper_values.load(args.paper), report_command(argv))
        print(f"analysis.paper_shape: wrote {path} and {args.rejudge / 'findings.csv'}")
        return 0
    return study_main("analysis.paper_shape", parser, args, argv, frame, decide, report)


def no_decisions(df: pd.DataFrame, fixed_seeds: int | None, paper: dict) -> list[str]:
    """--decide of a study whose seeds its plan fixes: its runner has nothing to ask the runs."""
    return []


def run_study(module: str, doc: str | None, frame, decide, report, argv: list[str] | None = None) -> int:
    """The command line of a pre-registered study's analysis that has no options of its own."""
    parser = study_parser(module, doc)
    return study_main(module, parser, parser.parse_args(argv), argv, frame, decide, report)


def study_main(module: str, parser, args, argv: list[str] | None, frame, decide, report) -> int:
    """What a pre-registered study's analysis does with study_parser's arguments: the plan's
    decisions (--decide) or the report (--out), from the study's frame of its runs."""
    if not args.runs:
        parser.error("RUNS: at least one run directory")
    if not args.decide and args.out is None:
        parser.error("--out DIR, or --decide")
    runs, problems = collect_for(module, args.runs, args.allow_mixed)
    if not runs:
        return 1
    df, paper = frame(runs), paper_values.load(args.paper)
    if args.banked is not None:
        df = banked(df, args.banked, args.allow_mixed)
    if args.decide:
        print("\n".join(decide(df, args.seeds, paper)))
        return 0
    path = report(df, paper, args.out, report_command(argv, module), args.elapsed)
    print(f"{module}: {len(runs)} runs, {len(problems)} skipped; wrote {path}")
    return 1 if args.strict and problems else 0


if __name__ == "__main__":
    sys.exit(main())
