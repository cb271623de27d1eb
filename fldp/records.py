"""Run records: `metrics.jsonl` and `summary.json` in the run directory (what `analysis/` reads),
the same rows to W&B, and a progress bar. Only rank 0 makes a Recorder.

A record that cannot be written (disk full, read-only, no permission) ends the run with a
WriteError naming the file, and leaves no half row: `metrics.jsonl` holds whole lines only."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import secrets
import string
import warnings
from pathlib import Path
from typing import cast

from omegaconf import OmegaConf

from . import stopping
from .errors import WriteError
from .provenance import run_fields

# The metric field names, defined once: the trainer writes them, analysis/ reads them.
PHASES = ("forward", "backward", "optimizer", "aggregation")
SHORT = {"forward": "fwd", "backward": "bwd", "optimizer": "opt", "aggregation": "agg"}  # the progress bar's
TIME_FIELDS = tuple(f"time_{p}" for p in PHASES)  # each the slowest rank's in that phase
# the phases of the rank whose whole step was slowest (time_step): they add up to it, which the
# time_ fields, each a maximum of its own, need not
CRITICAL_FIELDS = tuple(f"critical_{p}" for p in PHASES)
STEP_FIELDS = ("step", "loss", "perplexity", "lr", "tokens", *TIME_FIELDS, "time_step", *CRITICAL_FIELDS, "aggregated")
ANALYSED_FIELDS = ("step", "perplexity", *TIME_FIELDS, "time_step", "aggregated")  # what analysis/ needs
WANDB_MODES = ("offline", "online", "disabled")


class Recorder:
    def __init__(self, run_dir: str | Path, cfg, total_steps: int, progress: bool = True, resume_from: int = 0):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / "metrics.jsonl"
        with _writing(self.path):
            self.run_dir.mkdir(parents=True, exist_ok=True)
            # summary.json says the run finished: a run that continues in this directory (resume=auto)
            # has not, until it writes its own, and a sweep re-run would skip it if it died before that
            (self.run_dir / "summary.json").unlink(missing_ok=True)
            kept = self._truncate(resume_from, total_steps)
            # a raw descriptor, not a buffered file: each row is one write that is undone if it fails
            self.metrics = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        train = [r for r in kept if r.get("split") != "eval"]
        self.train_time = sum(r["time_step"] for r in train)
        self.last_row = train[-1] if train else {}
        # rows are a deterministic sequence (resume is exact): W&B gets each position once, the rows
        # this segment logs again after its checkpoint only where an earlier segment's W&B run lacks them
        self.position, self.delivered = len(kept), delivered_rows(self.run_dir)
        self.wandb = _start_wandb(cfg, self.run_dir)
        self._unregister = stopping.at_stop(self._close_wandb) if self.wandb is not None else (lambda: None)
        self.bar = None
        if progress:
            from tqdm import tqdm

            self.bar = tqdm(
                total=total_steps,
                initial=resume_from,
                desc=f"{cfg.algorithm.name} {cfg.mesh.federation}x{cfg.mesh.replicate}x{cfg.mesh.shard}",
                unit="step",
                dynamic_ncols=True,
            )

    def _truncate(self, step: int, total_steps: int) -> list[dict]:
        """Keep the rows up to `step`: a resumed run redoes the steps after its checkpoint (and the
        final evaluation, when it resumes from the last step)."""
        path = self.path
        if not path.exists():
            return []
        # a last line without its newline is a row cut short by a kill (SIGKILL can stop a write
        # midway): a step after the checkpoint, redone anyway
        lines = path.read_text().split("\n")[:-1]
        kept = [json.loads(line) for line in lines if line.strip()]
        kept = [
            r
            for r in kept
            if r["step"] < step or (r["step"] == step and not (r.get("split") == "eval" and step == total_steps))
        ]
        tmp = path.with_suffix(".tmp")
        try:
            tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)  # left only when the write failed: the original stays whole
        return kept

    def log(self, row: dict) -> None:
        self._append((json.dumps(row) + "\n").encode())
        # a stop closes the run after this row, not inside W&B's call, and counts the row W&B took
        # (counted after the block, a stop at its end left the row out: the resumed run sent it again)
        with stopping.uninterrupted():
            if self.wandb is not None and self.position >= self.delivered:
                prefix = "eval" if row.get("split") == "eval" else "train"
                fields = {f"{prefix}/{k}": v for k, v in row.items() if k not in ("step", "split")}
                self.wandb.log({"step": row["step"], **fields}, step=row["step"])
            self.position += 1
        if self.bar is not None and "split" not in row:  # a step's row (not an evaluation or a heal)
            self.bar.update(1)
            self.bar.set_postfix_str(
                f"ppl {row['perplexity']:.1f} | " + " ".join(f"{SHORT[p]} {row['time_' + p]:.3f}s" for p in PHASES)
            )

    def _append(self, line: bytes) -> None:
        """One whole line at the end of metrics.jsonl, or none: a write the disk cuts short (a full
        disk takes the part that fits, then fails) is truncated away before the error is raised."""
        with _writing(self.path):
            end = os.fstat(self.metrics).st_size  # only this process appends
            try:
                done = 0
                while done < len(line):  # a short write is retried; the retry raises the reason
                    n = os.write(self.metrics, line[done:])
                    if n == 0:
                        raise OSError(errno.EIO, "the file system accepted no bytes")
                    done += n
            except OSError:
                with contextlib.suppress(OSError):
                    os.ftruncate(self.metrics, end)
                raise

    def finish(self, summary: dict) -> None:
        if self.bar is not None:
            self.bar.close()
        # summary.json also names the W&B run, which W&B's own summary does not need
        record = summary if self.wandb is None else {**summary, "wandb": wandb_identity(self.wandb, self.run_dir)}
        path = self.run_dir / "summary.json"
        tmp = self.run_dir / "summary.json.tmp"
        with _writing(path):
            try:
                tmp.write_text(json.dumps(record, indent=2) + "\n")
                os.replace(tmp, path)  # present only once the run is complete
            finally:
                tmp.unlink(missing_ok=True)
        os.close(self.metrics)
        if self.wandb is not None:
            with stopping.uninterrupted():
                self.wandb.summary.update(summary)
                self._close_wandb(0)

    def _close_wandb(self, exit_code: int) -> None:
        """Finish the W&B run (its rows flushed to the offline log or sent), then note how many rows it
        holds; a run stopped or failed ends with the worker's exit code, resumable."""
        self._unregister()
        self.wandb.finish(exit_code=exit_code)
        _write_atomically(self.run_dir / DELIVERED_FILE, f"{max(self.position, self.delivered)}\n")


@contextlib.contextmanager
def _writing(path: Path):
    """An OSError writing a record becomes a WriteError naming the file (one line for the user)."""
    try:
        yield
    except OSError as e:
        raise WriteError(f"cannot write {path}: {e.strerror or e}") from e


def wandb_id(run_dir: Path) -> str:
    """The W&B run id of this run directory, kept in RUN_DIR/wandb_id: a resumed run
    (trainer.resume=auto) continues the W&B run it started instead of starting another."""
    path = run_dir / "wandb_id"
    if path.is_file() and path.read_text().strip():
        return path.read_text().strip()
    # W&B's own format (8 of [a-z0-9]); made here, as wandb's helper for it is not public API
    run_id = "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))
    _write_atomically(path, run_id + "\n")
    return run_id


DELIVERED_FILE = "wandb_rows"  # how many of the run's rows its W&B run holds, as of its last finish


def delivered_rows(run_dir: Path) -> int:
    """The rows an earlier segment of this run directory delivered to W&B (0: none, or a segment
    killed outright, whose W&B run never finished: its rows are sent again)."""
    path = run_dir / DELIVERED_FILE
    return int(path.read_text()) if path.is_file() and path.read_text().strip() else 0


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def wandb_labels(cfg) -> dict:
    """group (wandb.group; train.py sets it to the sweep for a multirun point), job_type (the
    algorithm) and tags (topology, and for FL: A and F), to filter and group runs by in W&B."""
    tags = [f"topology={cfg.topology.name}"]
    if cfg.algorithm.get("every") is not None:
        every = cast(dict, OmegaConf.to_container(cfg.algorithm, resolve=True))["every"]
        tags += [f"A={every}".replace(" ", ""), f"F={cfg.mesh.federation}"]
    return {"group": cfg.wandb.group, "job_type": cfg.algorithm.name, "tags": tags}


def wandb_identity(run, run_dir: Path) -> dict:
    """The W&B run these records went to, as W&B holds it (its public Run attributes): the id, path,
    labels and the folder of an offline run (for `wandb sync`), relative to the run directory."""
    return {
        "id": run.id,
        "path": run.path,
        "name": run.name,
        "group": run.group,
        "job_type": run.job_type,
        "tags": sorted(run.tags),
        "mode": "offline" if run.offline else "online",
        "folder": os.path.relpath(Path(run.dir).parent, run_dir),
    }


def wandb_name(cfg) -> str:
    """A short name to read in W&B's run list: ALGORITHM TOPOLOGY [F=.. A=..] seed=N. The id tells
    runs apart; the sweep point's overrides are in the run's config (`overrides`)."""
    tags = dict(tag.split("=", 1) for tag in wandb_labels(cfg)["tags"])
    fl = [f"{k}={tags[k]}" for k in ("F", "A") if k in tags]
    return " ".join([cfg.algorithm.name, tags["topology"], *fl, f"seed={cfg.seed}"])


def run_overrides(run_dir: Path) -> list[str] | None:
    """The command-line overrides Hydra composed this run from (.hydra/overrides.yaml of its run
    directory; a federation group's records sit one directory down)."""
    for folder in (run_dir, run_dir.parent):
        path = folder / ".hydra" / "overrides.yaml"
        if path.is_file():
            return list(OmegaConf.load(path))
    return None


def public_config(cfg) -> dict:
    """The resolved config, less every value read from the environment (`${oc.env:...}`): an account,
    a key or a path given there is the user's, not the experiment's, and W&B would keep it."""
    resolved = OmegaConf.to_container(cfg, resolve=True)
    raw = OmegaConf.to_container(cfg, resolve=False)

    def strip(r, v):
        if isinstance(r, dict):
            return {k: strip(r[k], v[k]) for k in r}
        return "(from the environment)" if isinstance(r, str) and "oc.env:" in r else v

    return strip(raw, resolved)


def _start_wandb(cfg, run_dir: Path):
    mode = cfg.wandb.mode
    if mode == "disabled":
        return None
    try:
        import wandb

        run = wandb.init(
            project=cfg.wandb.project,
            entity=cfg.wandb.entity,
            mode=mode,
            id=wandb_id(run_dir),
            resume="allow",
            **wandb_labels(cfg),
            name=wandb_name(cfg),
            dir=str(run_dir),
            config={**public_config(cfg), **run_fields(), "overrides": run_overrides(run_dir)},
            # never block a training run on a missing network
            settings=wandb.Settings(init_timeout=60, silent=True, console="off"),
        )
        _define_metrics(run)
        return run
    except Exception as e:
        warnings.warn(f"W&B ({mode}) could not start, records go to {run_dir} only: {e}", stacklevel=2)
        return None


def _define_metrics(run) -> None:
    """Charts against the training step (`step`, the rows' own), and summaries that say something:
    the best and last perplexity, each phase's mean time."""
    run.define_metric("step")
    for split in ("train", "eval"):
        run.define_metric(f"{split}/*", step_metric="step")
        run.define_metric(f"{split}/perplexity", step_metric="step", summary="min,last")
    for field in (*TIME_FIELDS, "time_step"):
        run.define_metric(f"train/{field}", step_metric="step", summary="mean,last")
