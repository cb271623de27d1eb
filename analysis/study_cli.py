"""fldp-study: a pre-registered study, from its spec (experiments/<study>/study.yaml, analysis.spec).

    fldp-study run SPEC [OUT] [--reduced] [--until PHASE] [--allow-mixed] [--allow-changed-spec] [--banked RESULTS] [KEY=VALUE...]
    fldp-study status SPEC OUT [--reduced] [--banked RESULTS]
    fldp-study report SPEC OUT [--allow-mixed] [--banked RESULTS]

run: every phase (Hydra multiruns of its arms into OUT/runs/PHASE/), then the report in OUT/report/;
again with the same OUT, finished runs are skipped. --until PHASE stops after it. --reduced: CI's
pipeline check (the spec's `reduced`), whose numbers judge nothing. KEY=VALUE: overrides for every
run (cluster=slurm submits them). status: what is finished and what is left, with a time estimate.
report: the report of OUT's runs. --banked RESULTS: the runs OUT lacks, from an earlier report's
per-run numbers (runs.csv, losses.csv.gz; e.g. the committed one, where the session that made them
left no OUT on this machine): run makes none of them again, status counts them, the decisions and
the report take them in (OUT's own run of a point comes first). A bad spec or argument exits 2
before anything runs."""

from __future__ import annotations

import argparse
import os
import re
import shlex
import sys
from datetime import datetime
from pathlib import Path

from .spec import SpecError, Study, load
from .study_run import banked_points, changed_runs, run, stamp, status_lines

# the analysis's imports (pandas, scipy, matplotlib, fldp's records) wait until the spec and the
# arguments are checked: a refusal comes in a fraction of a second

PROG = "fldp-study"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command", choices=("run", "status", "report"))
    p.add_argument("spec", metavar="SPEC", help="a study.yaml, or the directory holding one")
    p.add_argument("rest", nargs="*", metavar="OUT|KEY=VALUE", help="the study's directory; overrides (run)")
    p.add_argument("--reduced", action="store_true", help="the spec's reduced pipeline (CI)")
    p.add_argument("--until", metavar="PHASE", help="run: stop after this phase")
    p.add_argument(
        "--allow-changed-spec",
        action="store_true",
        help="run: go on in an OUT run under another spec; report: judge runs made under another (said so)",
    )
    p.add_argument("--allow-mixed", action="store_true", help="pool runs of different fldp commits")
    p.add_argument(
        "--banked",
        type=Path,
        metavar="RESULTS",
        help="the runs OUT lacks, from an earlier report's runs.csv and losses.csv.gz (run makes none again)",
    )
    return p


def shown(argv: list[str]) -> str:
    """The command as typed, paths under the working directory relative to it (no machine's path)."""
    cwd = os.getcwd() + os.sep
    return f"{PROG} " + shlex.join(os.path.relpath(a) if a.startswith(cwd) else a for a in argv)


def runs_of(study: Study, out: Path, banked: Path | None, allow_mixed: bool):
    """One row per run (analysis.study.frame) of OUT's runs, and of `banked`'s that OUT lacks (each
    arm placed again); the runs that could not be read, one message each."""
    import pandas as pd

    from .discover import collect_for
    from .runs_frame import banked as with_banked
    from .study import frame, placed_arms

    runs, problems = collect_for(PROG, [str(out / "runs")], allow_mixed) if (out / "runs").is_dir() else ([], [])
    df = frame(runs, study) if runs else pd.DataFrame()
    if banked is not None:
        df = placed_arms(with_banked(df, banked, allow_mixed), study)
    return df, problems


def banked_runs(study: Study, results: Path):
    """A committed report's runs (its runs.csv), each arm placed."""
    import pandas as pd

    from .runs_frame import banked
    from .study import placed_arms

    return placed_arms(banked(pd.DataFrame(), results, allow_mixed=True), study)


def write_report(study: Study, out: Path, allow_mixed: bool, command: str, banked: Path | None = None) -> int:
    from . import paper as paper_values
    from .study_report import report

    df, problems = runs_of(study, out, banked, allow_mixed)
    if df.empty:
        print(f"{PROG}: no finished run in {out / 'runs'}", file=sys.stderr)
        return 1
    elapsed_path = out / "elapsed_s"
    elapsed = float(elapsed_path.read_text()) if elapsed_path.exists() else None
    path = report(df, study, paper_values.load(), out / "report", command, elapsed, out / "runs")
    print(f"{PROG}: {df['run'].nunique()} runs, {len(problems)} skipped; wrote {path}")
    return 1 if problems else 0


def decider(study: Study, banked: Path | None = None):
    """What OUT's runs so far (and `banked`'s) decide (analysis.study.decide): seeds, tuned values,
    extensions."""

    def decide(out: Path):
        from . import paper as paper_values
        from .study import NOTHING, decide

        df, _ = runs_of(study, out, banked, allow_mixed=True)
        return NOTHING if df.empty else decide(df, study, paper_values.load())

    return decide


def banked_refusal(study: Study, results: Path, allow_changed: bool) -> str | None:
    """Why `results` cannot be banked: no runs.csv or losses.csv.gz, or its report made under
    another version of the spec (its report.md's spec line) and not allowed."""
    missing = [f for f in ("runs.csv", "losses.csv.gz") if not (results / f).is_file()]
    if missing:
        return f"--banked {results}: no {' or '.join(missing)} there (a report's directory holds both)"
    made = re.search(r"^The spec: `[^`]*` sha256 ([0-9a-f]{12})", read_or_empty(results / "report.md"), re.M)
    if made and made[1] != study.sha256[:12] and not allow_changed:
        return (
            f"--banked {results}: its runs were made under another version of the spec (sha256 {made[1]}, "
            f"now {study.sha256[:12]}). Nothing run: pass --allow-changed-spec to take them in (the report will say so)"
        )
    return None


def read_or_empty(path: Path) -> str:
    return path.read_text() if path.is_file() else ""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = parser()
    args = ap.parse_args(argv)
    try:
        study = load(args.spec)
    except SpecError as e:
        print(f"{PROG}: the spec is refused, nothing run:\n{e}", file=sys.stderr)
        return 2
    outs = [a for a in args.rest if "=" not in a]
    overrides = [a for a in args.rest if "=" in a]
    if len(outs) > 1 or (args.command != "run" and (not outs or overrides)):
        ap.error(
            f"{args.command}: {'one OUT and KEY=VALUE overrides' if args.command == 'run' else 'one OUT, no overrides'}"
        )
    if args.until is not None and args.until not in [p.name for p in study.phases]:
        ap.error(f"--until {args.until}: not a phase of {study.name} ({', '.join(p.name for p in study.phases)})")
    out = Path(outs[0]) if outs else Path("outputs") / study.name / datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    if args.banked is not None and (refused := banked_refusal(study, args.banked, args.allow_changed_spec)):
        print(f"{PROG}: {refused}", file=sys.stderr)
        return 2
    if args.command == "status":
        banked = banked_runs(study, args.banked) if args.banked else None
        print("\n".join(status_lines(study, out, args.reduced, decider(study, args.banked)(out), banked)))
        return 0
    if args.command == "report":
        if (changed := changed_runs(study, out)) and not args.allow_changed_spec:
            made = ", ".join(f"{n} under sha256 {sha[:12]}" for sha, n in changed.items())
            print(
                f"{PROG}: {out}: runs made under another version of the spec ({made}; now {study.sha256[:12]}): "
                "nothing judged. Pass --allow-changed-spec to judge them (the report says so)",
                file=sys.stderr,
            )
            return 2
        return write_report(study, out, args.allow_mixed, shown(argv), args.banked)
    refused = stamp(study, out, args.allow_changed_spec)
    if refused:
        print(f"{PROG}: {refused}", file=sys.stderr)
        return 2
    points = banked_points(banked_runs(study, args.banked), study) if args.banked else set()
    status = run(study, out, args.reduced, args.until, overrides, decider(study, args.banked), points)
    reported = write_report(study, out, args.allow_mixed, shown(argv), args.banked)
    print(f"{study.name}: report in {out / 'report' / 'report.md'}")
    return max(status, reported)


if __name__ == "__main__":
    sys.exit(main())
