"""`python -m analysis.report RUNS... --out DIR`: Tables 3 and 4 (Markdown, LaTeX, CSV), the
perplexity figure (PNG, PDF), the headline ratios and the paper's findings, reproduced or not,
from run records, beside the paper's published values; `report.md` gathers them.

RUNS: run directories, directories holding them (a Hydra multirun), offline W&B run folders (read
as their run directory), or `wandb:ENTITY/PROJECT` (online, public API; --group, --tag, --job-type
and --commit select its runs). Unusable runs are named and skipped. A sweep over A and F also gets
its A x F grids of step time and perplexity, and their heatmap."""

from __future__ import annotations

import datetime
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from . import claims, render, tables
from . import paper as paper_values
from .discover import add_wandb_filters, collect_for, invoked_as, reports_parser, wandb_query
from .figure import af_heatmap, perplexity_figure, plt, save
from .records import Run
from .stats import MIN_SEEDS, TIE_HIGH, TIE_LOW, interval_text

# Summary/config keys that differ between algorithms by design (they ARE the algorithm).
_ALGORITHM_KEYS = (
    "algorithm",
    "federation",
    "replicate",
    "shard",
    "every",
    "schedule",
    "aggregation_steps",
    "fedavg_mode",
    "outer",
    "federate",
    "fragments",
    "config.algorithm.",
)


@dataclass
class Report:
    out: Path
    runs: list[Run]
    problems: list[str]
    files: list[Path] = field(default_factory=list)
    figure: object = None


def _write(report: Report, name: str, text: str) -> None:
    path = report.out / name
    path.write_text(text)
    report.files.append(path)


def shared_setup(runs: list[Run]) -> dict[str, list]:
    """Setup keys whose value is not the same in every run (the algorithm's own keys aside)."""
    setups = [tables.setup(r) for r in runs]
    keys = sorted(set().union(*setups))
    differ = {}
    for k in keys:
        if k.startswith(_ALGORITHM_KEYS):
            continue
        values = {repr(s[k]) for s in setups if k in s}  # absent = unknown (older records)
        if len(values) > 1:
            differ[k] = sorted(values)
    return differ


def _table_files(report: Report, stem: str, numeric: pd.DataFrame, headers: dict, decimals: int, caption: str) -> str:
    md = render.markdown(render.cells(numeric, headers, decimals))
    _write(report, f"{stem}.md", md)
    _write(
        report, f"{stem}.tex", render.latex(render.cells(numeric, headers, decimals, tex=True), caption, f"tab:{stem}")
    )
    _write(report, f"{stem}.csv", numeric.to_csv(index=False))
    return md


def _ratio_md(df: pd.DataFrame) -> str:
    show = pd.DataFrame(
        {
            "ratio": df["ratio"],
            "runs (paired by seed) [95% CI]": [
                interval_text(*v, decimals=2)
                for v in zip(df["runs_ratio"], df["runs_low"], df["runs_high"], df["seeds"])
            ],
            "seeds": df["seeds"],
            "paper (quoted)": df["paper_quoted"].map("{:.2f}".format),
            "paper (from Table 3)": df["paper_table3"].map("{:.2f}".format),
        }
    )
    return render.markdown(show)


def _findings_md(found: pd.DataFrame) -> str:
    show = found.assign(
        paper=[f"{v:.2f}" if v == v else "" for v in found["paper"]],
        level=[f"{v:.2%}" if v == v else "" for v in found["level"]],
        seeds=found["seeds"].astype("string").fillna(""),
        **{
            "runs [CI]": [
                interval_text(r.ratio, r.lo, r.hi, r.seeds) if r.comparison else r.runs for r in found.itertuples()
            ]
        },
    )
    return render.markdown(
        show[["family", "finding", "comparison", "paper", "runs [CI]", "level", "direction", "size", "seeds"]]
    )


def build(runs: list[Run], problems: list[str], out: Path, paper: dict, command: str) -> Report:
    out.mkdir(parents=True, exist_ok=True)
    report = Report(out, runs, problems)
    t3, t4 = tables.table3(runs), tables.table4(runs)
    md3 = _table_files(
        report,
        "table3",
        t3,
        render.HEADERS3,
        2,
        "Training and evaluation perplexity and time per algorithm (mean and std across seeds)",
    )
    md4 = _table_files(
        report,
        "table4",
        t4,
        render.HEADERS4,
        3,
        "Per-step training time by phase [s], mean and std over steps (seeds pooled); "
        "in brackets: std across seeds of the per-seed mean",
    )
    _write(report, "runs.csv", tables.per_run(runs).to_csv(index=False))  # one row per run

    report.figure = perplexity_figure(runs)
    report.files += save(report.figure, out)

    values, notes = claims.run_values(runs)
    for (label, seed), n in tables.per_run(runs).groupby(["label", "seed"]).size().items():
        if n > 1:  # still averaged, but they are repeats, not independent seeds
            notes.append(f"{label}: {n} runs share seed {seed}")
    ratios = claims.ratios(paper, values)
    notes += claims.quote_notes(ratios)
    _write(report, "ratios.csv", ratios.to_csv(index=False))
    ratio_md = _ratio_md(ratios)
    _write(report, "ratios.md", ratio_md)
    found = claims.findings(paper, values, runs)
    _write(report, "findings.csv", found.to_csv(index=False))
    findings_md = _findings_md(found)
    _write(report, "findings.md", findings_md)

    _write(
        report,
        "report.md",
        _report_md(report, paper, command, t3, md3, md4, ratio_md, findings_md, found, notes) + _af_section(report),
    )
    return report


def _af_section(report: Report) -> str:
    """A sweep over A and F: per configuration, A x F grids of the mean step time and the eval
    perplexity (af.csv, af.md) and their heatmap (af_N.png/pdf); nothing without such a sweep."""
    cells = tables.af_cells(report.runs)
    if cells.empty:
        return ""
    _write(report, "af.csv", cells.to_csv(index=False))
    lines = [
        "",
        "## A x F",
        "",
        "Each cell: the mean across seeds of each run's mean step time [s] (over its training steps), and of "
        "its eval perplexity; A: steps between aggregations, F: federated groups. Seeds per cell in `af.csv`.",
        "",
    ]
    for n, configuration in enumerate(dict.fromkeys(cells["configuration"]), 1):
        lines += [f"### {configuration}", ""]
        for value, title, decimals in (
            ("step_time_s", "mean step time [s]", 4),
            ("eval_perplexity", "eval perplexity", 2),
        ):
            grid = tables.af_grid(cells, configuration, value)
            shown = pd.DataFrame(
                {
                    "A": grid.index,
                    **{f"F={f}": [f"{v:.{decimals}f}" if v == v else "" for v in grid[f]] for f in grid.columns},
                }
            )
            lines += [f"{title}:", "", render.markdown(shown)]
        fig = af_heatmap(cells, configuration)
        report.files += save(fig, report.out, f"af_{n}")
        plt.close(fig)
        lines += [f"![A x F: step time and perplexity](af_{n}.png)", ""]
    _write(report, "af.md", "\n".join(lines[5:]))
    return "\n".join(lines)


def _network(summary: dict) -> str:
    """summary["network"]: netns (emulated nodes and their capped links), loopback, sleep (comm.emulate)."""
    link = summary.get("network_link") or {}
    if summary.get("network") == "netns":
        return (
            f"netns, {link['nodes']} emulated nodes x {link['procs_per_node']} ranks, each node's link "
            f"capped at {link['mbit_s']:g} Mbit/s each way"
            + (f", {link['delay_ms']:g} ms delay" if link["delay_ms"] else "")
        )
    return summary.get("network", "not recorded (older records)")


def _report_md(report, paper, command, t3, md3, md4, ratio_md, findings_md, found, notes) -> str:
    lines = _head_md(report, paper, command, t3, notes)
    lines += _sections_md(paper, md3, md4, ratio_md, findings_md, found)
    return "\n".join(lines)


def _head_md(report, paper, command, t3, notes) -> list[str]:
    """What was read, the setup, the network and FedAvg's mode; skipped runs and notes."""
    runs = report.runs
    seeds = ", ".join(f"{row.label} {row.seeds}" for row in t3.itertuples())
    differ = shared_setup(runs)
    setup_line = (
        "identical in every run, apart from the algorithm and its mesh"
        if not differ
        else "NOT identical: " + "; ".join(f"`{k}` takes {', '.join(v)}" for k, v in differ.items())
    )
    first = runs[0].summary
    lines = [
        "# Tables 3-4 and Figure 2, regenerated",
        "",
        f"Generated {datetime.date.today().isoformat()} by `{command}`.",
        f"{len(runs)} runs read (seeds per configuration: {seeds}); {len(report.problems)} skipped.",
        f"Setup of the first run: {first.get('model')} on {first.get('topology')} "
        f"({first.get('world_size')} ranks), {first.get('dataset')}, {first.get('steps')} steps, "
        f"precision {first.get('precision')}. Hyper-parameters: {setup_line}.",
        "Network between the ranks: " + "; ".join(sorted({_network(r.summary) for r in runs})) + ".",
        f"Paper values from `analysis/paper_values.json`: {paper['source']}",
        "",
    ]
    modes = sorted({f"{r.summary['fedavg_mode']} ({r.algorithm})" for r in runs if r.summary.get("fedavg_mode")})
    if modes:  # FL+HSDP's aggregation traffic depends on it (paper.md: Eq. 5 vs the authors' code)
        lines += [
            f"FedAvg mode of the runs with replicas: {', '.join(modes)}. The paper's Table 4 "
            "FL+HSDP times ran `all_replicas` (the authors' code); Eq. 5 models `leader_broadcast`.",
            "",
        ]
    if report.problems:
        lines += ["Skipped runs:", ""] + [f"- {p}" for p in report.problems] + [""]
    if notes:
        lines += ["Notes:", ""] + [f"- {n}" for n in notes] + [""]
    return lines


def _sections_md(paper, md3, md4, ratio_md, findings_md, found) -> list[str]:
    """The findings, the headline ratios, Tables 3-4 and Figure 2, each beside the paper's."""
    primary = found[found["family"] == "primary"]
    tally = primary["direction"].value_counts()
    return [
        "## Findings of the paper: reproduced or not",
        "",
        "Primary family (the paper's five perplexity claims, judged together with Holm's step-down): "
        + ", ".join(f"{n} {d}" for d, n in tally.items())
        + f", of {len(primary)}. Each finding is a ratio "
        "the paper finds above 1, paired by seed (same seed = same initial weights and data order): the "
        "geometric mean of the per-seed ratios and a Student-t interval on the mean log ratio, at the level "
        "in `level` (simultaneous: Bonferroni, 95% family-wise; analysis/stats.py). *Direction*: read from the "
        "interval at Holm's step-down level (`direction_level`, never wider): reproduced when it lies beyond the tie band "
        f"({TIE_LOW:.3f}-{TIE_HIGH:.3f}) on the paper's side, opposite beyond it on the other, tie inside it, "
        "inconclusive reaching into it and out; *size*: whether the paper's own ratio lies inside the "
        f"interval. Fewer than {MIN_SEEDS} seeds give no verdict (n/a). The time findings are exploratory "
        "(a plain 95% interval each, no correction for the number of comparisons): shown, not findings. "
        "The records check reads every run's aggregation steps: a property of the code, not a statistic.",
        "",
        findings_md,
        "",
        "## Headline ratios",
        "",
        ratio_md,
        "Runs: the geometric mean of the per-seed ratios and its 95% interval, described (the verdicts "
        "are the findings above).",
        "",
        "## Table 3",
        "",
        md3,
        "Train perplexity: the last step's; train time: the sum of the step times; eval perplexity and "
        "time: `summary.json`. Cells: mean ± std across seeds (std omitted for one seed).",
        "",
        "Paper (512 GPUs, Llama 3.1 8B):",
        "",
        render.markdown(render.cells(tables.paper_table3(paper), render.HEADERS3, 2)),
        "",
        "## Table 4",
        "",
        md4,
        "Seconds per training step; mean ± std over all steps of all seeds; in brackets the std "
        "across seeds of the per-seed mean.",
        "",
        "Paper:",
        "",
        render.markdown(render.cells(tables.paper_table4(paper), render.HEADERS4, 2)),
        "",
        "## Figure 2",
        "",
        "![training perplexity against wall-clock minutes](figure2.png)",
        "",
        "Paper's Figure 2: " + paper["figure2"],
        "",
    ]


def main(argv: list[str] | None = None) -> int:
    module = __spec__.name if __spec__ else "analysis.report"  # or fldp.analysis.report, installed
    prog = invoked_as(module, "fldp-report")  # as the user typed it: fldp-report or python -m ...
    parser = reports_parser(prog, __doc__)
    add_wandb_filters(parser)
    args = parser.parse_args(argv)
    runs, problems = collect_for(prog, args.runs, args.allow_mixed, wandb_query(parser, args))
    if not runs:
        return 1
    command = f"{prog} " + shlex.join(argv if argv is not None else sys.argv[1:])
    report = build(runs, problems, args.out, paper_values.load(args.paper), command)
    print(
        f"{prog}: {len(runs)} runs, {len(problems)} skipped; wrote "
        + ", ".join(p.name for p in report.files)
        + f" in {args.out}"
    )
    return 1 if args.strict and problems else 0


if __name__ == "__main__":
    sys.exit(main())
