"""One run's records, checked, as pandas frames: `metrics.jsonl` + `summary.json` (+ the Hydra
config, for the hyper-parameters). W&B sources build the same `Run` through `make_run`."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import pandas as pd

from fldp.records import ANALYSED_FIELDS, PHASES  # noqa: F401  (PHASES: for analysis.tables)
from fldp.setting import defining

SUMMARY_FIELDS = ("algorithm", "seed", "steps", "eval_perplexity", "eval_time_s")


class RecordError(Exception):
    """A run whose records cannot be used; the message starts with the run's name."""

    def __init__(self, run: str, problem: str):
        super().__init__(f"{run}: {problem}")
        self.run, self.problem = run, problem


@dataclass
class Run:
    name: str  # how messages and tables name it (its directory, or W&B path)
    summary: dict
    steps: pd.DataFrame  # one training row per step, in step order
    config: dict = field(default_factory=dict)  # flattened setup (hyper-parameters), may be empty
    source: str = "jsonl"

    @property
    def algorithm(self) -> str:
        return self.summary["algorithm"]

    @property
    def seed(self):
        return self.summary["seed"]


def setup_of(config: dict) -> dict:
    """The keys that define the experiment (fldp.setting: not resume, checkpointing, progress, W&B,
    cluster, paths or the byte meter), from a (possibly unresolved) config."""
    # an unresolved interpolation ("${topology.precision}") says nothing about the value: the
    # summary holds the resolved ones that matter
    return {
        k: (json.dumps(v) if isinstance(v, list) else v)
        for k, v in defining(config).items()
        if not (isinstance(v, str) and "${" in v)
    }


def make_run(
    name: str,
    summary: dict | None,
    rows: list[dict],
    config: dict | None = None,
    source: str = "jsonl",
    summary_name: str = "summary.json",
) -> Run:
    """Check one run's records and build a Run; RecordError names the run and what is wrong."""
    train = [r for r in rows if r.get("split", "train") == "train"]
    if not train:
        raise RecordError(name, "no training steps recorded (empty metrics)")
    for i, r in enumerate(train):
        missing = [f for f in ANALYSED_FIELDS if f not in r]
        if missing:
            raise RecordError(name, f"training row {i + 1} (step {r.get('step')}) lacks {', '.join(missing)}")
    steps = pd.DataFrame(train)
    if steps["step"].duplicated().any():
        dup = int(steps.loc[steps["step"].duplicated(), "step"].iloc[0])
        raise RecordError(name, f"step {dup} is recorded twice: two runs appended into one directory?")
    steps = steps.sort_values("step", ignore_index=True)
    last = int(steps["step"].iloc[-1])
    if summary is None:
        raise RecordError(
            name, f"no {summary_name}: the run did not finish (crashed or still running) after step {last}"
        )
    missing = [f for f in SUMMARY_FIELDS if f not in summary]
    if missing:
        raise RecordError(name, f"summary lacks {', '.join(missing)}")
    if list(steps["step"]) != list(range(1, summary["steps"] + 1)):
        raise RecordError(
            name, f"summary says {summary['steps']} steps but the metrics hold steps {_span(steps['step'])}"
        )
    return Run(name, summary, steps, setup_of(config or {}), source)


def _span(s: pd.Series) -> str:
    return f"{s.min()}..{s.max()} ({len(s)} rows)"


def _read_json_lines(name: str, path: Path) -> list[dict]:
    if not path.exists():
        raise RecordError(name, "no metrics.jsonl: the run never recorded a step")
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            raise RecordError(name, f"metrics.jsonl line {n} is not valid JSON (a run killed mid-write?)") from None
    if not rows:
        raise RecordError(name, "metrics.jsonl is empty")
    return rows


def _read_config(run_dir: Path) -> dict:
    """Hydra's saved config, unresolved (interpolations compare as text; nothing to import)."""
    path = run_dir / ".hydra" / "config.yaml"
    if not path.exists():
        return {}
    from omegaconf import OmegaConf

    return cast(dict, OmegaConf.to_container(OmegaConf.load(path), resolve=False))


def load_run_dir(run_dir: Path, name: str | None = None) -> Run:
    run_dir = Path(run_dir)
    name = name or str(run_dir)
    rows = _read_json_lines(name, run_dir / "metrics.jsonl")
    summary = None
    if (run_dir / "summary.json").exists():
        try:
            summary = json.loads((run_dir / "summary.json").read_text())
        except json.JSONDecodeError:
            raise RecordError(name, "summary.json is not valid JSON") from None
    return make_run(name, summary, rows, _read_config(run_dir))
