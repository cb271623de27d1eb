"""Turn the RUNS arguments of `analysis.report` into runs: a run directory, any directory holding
run directories (a Hydra multirun, `outputs/`), an offline W&B run folder, or `wandb:ENTITY/PROJECT`.

A run directory's JSONL records are the source of truth: its `wandb/` folder is never read. An
offline W&B folder stands for the run directory it sits in (RUN_DIR/wandb/offline-run-*); one
outside a run directory is refused, naming `wandb sync` and `wandb:ENTITY/PROJECT`."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from .records import RecordError, Run, load_run_dir
from .wandb_records import filters, is_offline_folder, read_project

WANDB_PREFIX = "wandb:"
_SKIP = {"wandb", ".hydra", "__pycache__", ".git", ".venv"}


def _is_run_dir(path: Path) -> bool:
    """Anything a training run leaves behind, even one that crashed before its first step."""
    return any((path / f).exists() for f in ("metrics.jsonl", "summary.json", ".hydra/config.yaml"))


def _walk(root: Path, keep) -> list[Path]:
    """Directories under root (root included) for which keep() holds, not descending into them."""
    if keep(root):
        return [root]
    found = []
    for child in sorted(p for p in root.iterdir() if p.is_dir() and p.name not in _SKIP):
        found += _walk(child, keep)
    return found


def _offline_folders(root: Path) -> list[Path]:
    if is_offline_folder(root):
        return [root]
    return sorted(p for p in root.rglob("*-run-*") if is_offline_folder(p))


def _offline_run(folder: Path) -> Run:
    """An offline W&B folder: the records of the run directory it belongs to (the same rows)."""
    run_dir = folder.parent.parent
    if folder.parent.name == "wandb" and _is_run_dir(run_dir):
        return load_run_dir(run_dir)
    raise RecordError(
        str(folder),
        "a W&B run folder outside an fldp run directory: reports read a run's "
        "metrics.jsonl and summary.json, not W&B's log; upload it (`wandb sync "
        "FOLDER`) and report `wandb:ENTITY/PROJECT`, or name its run directory",
    )


def collect(args: list[str], query: dict | None = None) -> tuple[list[Run], list[str]]:
    """Healthy runs, and one message per argument or run that could not be used; `query` selects
    the runs of `wandb:` projects (wandb_records.filters)."""
    runs, problems = [], []

    def load(fn, path):
        try:
            runs.append(fn(path))
        except RecordError as e:
            problems.append(str(e))

    for arg in args:
        if arg.startswith(WANDB_PREFIX):
            try:
                found, bad = read_project(arg[len(WANDB_PREFIX) :], query)
            except Exception as e:  # no network, no login, no such project
                problems.append(f"{arg}: W&B public API failed: {e}")
                continue
            runs += found
            problems += bad
            continue
        root = Path(arg)
        if not root.is_dir():
            problems.append(f"{arg}: no such directory")
            continue
        if is_offline_folder(root):
            load(_offline_run, root)
            continue
        dirs = _walk(root, _is_run_dir)
        if dirs:
            for d in dirs:
                load(load_run_dir, d)
            continue
        folders = _offline_folders(root)
        if not folders:
            problems.append(
                f"{arg}: no run records (metrics.jsonl, summary.json, .hydra/ or a W&B offline run) in this directory"
            )
        for folder in folders:
            load(_offline_run, folder)
    return runs, problems


def invoked_as(module: str, script: str) -> str:
    """How the user called a report, for its usage line: the console script or `python -m`."""
    return script if Path(sys.argv[0]).name == script else f"python -m {module}"


def reports_parser(prog: str, doc: str):
    """The command line every report shares: RUNS..., --out, --paper, --strict."""
    parser = argparse.ArgumentParser(prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", metavar="RUNS")
    parser.add_argument("--out", required=True, type=Path, help="directory for the tables, figures and report")
    parser.add_argument("--paper", default=None, help="paper values (default: analysis/paper_values.json)")
    parser.add_argument("--strict", action="store_true", help="exit 1 if any run had to be skipped")
    add_allow_mixed(parser)
    return parser


def add_allow_mixed(parser) -> None:
    parser.add_argument(
        "--allow-mixed",
        action="store_true",
        help="pool runs of different fldp commits (summary.json's commit); refused otherwise",
    )


def add_wandb_filters(parser) -> None:
    """--group, --tag, --job-type, --commit: which runs of a `wandb:ENTITY/PROJECT` to read."""
    group = parser.add_argument_group("runs read from W&B (wandb:ENTITY/PROJECT)")
    group.add_argument("--group", help="only the runs of this W&B group (wandb.group; a sweep's name)")
    group.add_argument(
        "--tag",
        action="append",
        default=[],
        metavar="TAG",
        help="only runs with this tag, e.g. topology=local_4, A=8, F=2; repeat: runs with all",
    )
    group.add_argument("--job-type", help="only runs of this job type (the algorithm: fsdp, fl_fsdp, ...)")
    group.add_argument(
        "--commit", help="only runs of this fldp commit (the hash as runs record it, or its first 7+ characters)"
    )


def wandb_query(parser, args) -> dict:
    """The W&B API query the filter options make; exit 2 (parser.error) for filters with no W&B project
    to apply them to, or a commit that is not a hash."""
    query = filters(args.group, args.tag, args.job_type, args.commit)
    if query and not any(r.startswith(WANDB_PREFIX) for r in args.runs):
        parser.error(
            "--group, --tag, --job-type and --commit select runs of a W&B project: name one as wandb:ENTITY/PROJECT"
        )
    if args.commit and not re.fullmatch(r"[0-9a-f]{7,40}|[0-9a-f]{40}-dirty", args.commit):
        parser.error(
            f"--commit {args.commit}: not a commit hash (7 to 40 of 0-9a-f, or all 40 and "
            f"'-dirty' for runs of changed files)"
        )
    return query


def collect_for(
    prog: str, args: list[str], allow_mixed: bool = False, query: dict | None = None
) -> tuple[list[Run], list[str]]:
    """collect(), each unusable run named on stderr under the report's name. Runs of more than one
    commit (a dirty tree counts as its own) are refused, exit 2, unless allow_mixed: a comparison
    across code versions must be asked for."""
    runs, problems = collect(args, query)
    for p in problems:
        print(f"{prog}: skipped {p}", file=sys.stderr)
    if not runs:
        print(f"{prog}: no usable runs, nothing written", file=sys.stderr)
    commits = commits_of(runs)
    if len(commits) > 1 and not allow_mixed:
        listed = "; ".join(f"{c} ({len(names)} runs, e.g. {names[0]})" for c, names in commits.items())
        print(
            f"{prog}: the runs come from {len(commits)} commits: {listed}. Nothing written: pass "
            f"--allow-mixed to report them together",
            file=sys.stderr,
        )
        raise SystemExit(2)
    return runs, problems


def commits_of(runs: list[Run]) -> dict[str, list[str]]:
    """The runs' names by the commit that made them ('unknown': records without one)."""
    found: dict[str, list[str]] = {}
    for run in runs:
        found.setdefault(run.summary.get("commit") or "unknown", []).append(run.name)
    return found
