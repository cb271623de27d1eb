"""Runs from an online W&B project, through W&B's public API (needs network and a login): the rows
the trainer logged (as `train/<field>` and `eval/<field>`) and the summary it wrote at the end;
`records.make_run` checks them like the JSONL records. Offline W&B folders are not read: they sit
in run directories whose JSONL records hold the same rows (analysis.discover maps one to its run
directory), and W&B's log format is not a public interface."""
from __future__ import annotations

from pathlib import Path

from .records import RecordError, Run, make_run


def _split_row(flat: dict) -> list[dict]:
    """One W&B history row may hold a training step and the eval at that step: split them back."""
    step = flat.get("_step")
    rows = []
    for split in ("train", "eval"):
        fields = {k[len(split) + 1:]: v for k, v in flat.items() if k.startswith(split + "/")}
        if fields:
            rows.append({"step": step, **fields, **({"split": "eval"} if split == "eval" else {})})
    return rows


def is_offline_folder(path: Path) -> bool:
    """A W&B run folder (`wandb/offline-run-*`, or `run-*` once synced)."""
    return path.is_dir() and any(path.glob("run-*.wandb"))


def read_project(project: str) -> tuple[list[Run], list[str]]:
    """Every run of an online project ("entity/project"), through the public API (needs network
    and a W&B login). Returns the healthy runs and one message per unusable run."""
    import wandb

    runs, problems = [], []
    for remote in wandb.Api().runs(project):
        name = f"wandb:{project}/{remote.id} ({remote.name})"
        try:
            rows = [r for flat in remote.scan_history() for r in _split_row(flat)]
            summary = dict(remote.summary) if remote.state == "finished" else None
            if summary is not None and "train_time_s" not in summary:
                summary = None
            runs.append(make_run(name, summary, rows, dict(remote.config), source="wandb-online",
                                 summary_name="final W&B summary"))
        except RecordError as e:
            problems.append(str(e))
    return runs, problems
