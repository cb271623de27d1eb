"""Runs from an online W&B project, through W&B's public API (needs network and a login): the rows
the trainer logged (as `train/<field>` and `eval/<field>`) and the summary it wrote at the end;
`records.make_run` checks them like the JSONL records. Offline W&B folders are not read: they sit
in run directories whose JSONL records hold the same rows (analysis.discover maps one to its run
directory), and W&B's log format is not a public interface."""

from __future__ import annotations

import re
from pathlib import Path

from .records import RecordError, Run, make_run


def _split_row(flat: dict) -> list[dict]:
    """One W&B history row may hold a training step and the eval at that step: split them back.
    W&B's own keys (`_step`, `_runtime`, `_timestamp`) are not the trainer's; the step is (`step`,
    where the trainer logs it, otherwise W&B's `_step`, which the trainer sets to it)."""
    step = flat.get("step", flat.get("_step"))
    rows = []
    for split in ("train", "eval"):
        fields = {k[len(split) + 1 :]: v for k, v in flat.items() if k.startswith(split + "/")}
        if fields:
            rows.append({"step": step, **fields, **({"split": "eval"} if split == "eval" else {})})
    return rows


def is_offline_folder(path: Path) -> bool:
    """A W&B run folder (`wandb/offline-run-*`, or `run-*` once synced)."""
    return path.is_dir() and any(path.glob("run-*.wandb"))


def plain(value):
    """W&B's summary (and its nested parts) as plain dicts: the API hands out dict-like objects that
    are not dicts and hide `_wandb`."""
    if hasattr(value, "keys") and not isinstance(value, (str, bytes)):
        return {k: plain(value[k]) for k in value.keys()}
    return value


def filters(
    group: str | None = None, tags: list[str] | None = None, job_type: str | None = None, commit: str | None = None
) -> dict:
    """A W&B API query (MongoDB syntax) for the runs of one sweep, algorithm or code version: the
    trainer's group (wandb.group), every one of the tags (topology=..., A=..., F=...), its job type
    (the algorithm) and the fldp commit it recorded in the run's config (a prefix of 7+ characters
    will do)."""
    clauses: list[dict] = [{"group": group}] if group else []
    clauses += [{"tags": {"$in": [tag]}} for tag in tags or []]
    clauses += [{"jobType": job_type}] if job_type else []
    if commit:
        clauses.append({"config.commit": commit if len(commit) >= 40 else {"$regex": f"^{re.escape(commit)}"}})
    return {"$and": clauses} if len(clauses) > 1 else (clauses[0] if clauses else {})


def read_project(project: str, query: dict | None = None) -> tuple[list[Run], list[str]]:
    """Every run of an online project ("entity/project") that the query selects, through the public
    API (needs network and a W&B login). Returns the healthy runs and one message per unusable run."""
    import wandb

    runs, problems = [], []
    for remote in wandb.Api().runs(project, filters=query or {}):
        name = f"wandb:{project}/{remote.id} ({remote.name})"
        try:
            rows = [r for flat in remote.scan_history() for r in _split_row(flat)]
            summary = plain(remote.summary) if remote.state == "finished" else None
            if summary is not None and "train_time_s" not in summary:
                summary = None
            runs.append(
                make_run(
                    name, summary, rows, plain(remote.config), source="wandb-online", summary_name="final W&B summary"
                )
            )
        except RecordError as e:
            problems.append(str(e))
    return runs, problems
