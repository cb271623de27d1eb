"""Tables 3 and 4 as pandas frames, from checked runs (or from the paper's published values).

A row is one configuration: runs that differ only in their seed. Table 3 cells are the mean and
standard deviation across seeds of each run's value. Table 4 cells are the paper's statistic, mean
and standard deviation over training steps, with the steps of all seeds pooled; `*_seed_std` is the
spread of the per-seed means. Standard deviations are sample ones (ddof=1): NaN for a single value.
"""
from __future__ import annotations

import pandas as pd

from fldp.setting import flatten

from .records import PHASES, Run

NAMES = {"fsdp": "FSDP", "hsdp": "HSDP", "fl_fsdp": "FL+FSDP", "fl_hsdp": "FL+HSDP"}
ORDER = list(NAMES)
TABLE3 = ("train_perplexity", "train_time_s", "eval_perplexity", "eval_time_s")
TABLE4 = (*PHASES, "overall")
# Summary fields that are results, not setup (train_*, eval_*, times *_s; and the seed): they never
# split configurations, including ones a later trainer adds under the same naming.
def _is_result(key: str) -> bool:
    return key == "seed" or key.startswith(("train_", "eval_")) or key.endswith("_s")

# follow from other settings (schedule, aggregation_steps: from every and steps), or say where a run
# came from, not what it computed (commit); never worth a label
DERIVED = {"tokens", "world_size", "schedule", "aggregation_steps", "commit"}


def setup(run: Run) -> dict:
    """Everything that defines the experiment except the seed."""
    # outer -> outer.lr, ...; provenance (command, host, versions) is where it ran, not what
    fixed = {k: v for k, v in flatten(run.summary).items() if not _is_result(k) and not k.startswith("provenance.")}
    return {**{f"config.{k}": v for k, v in run.config.items()}, **fixed}


def labels(runs: list[Run]) -> list[str]:
    """The algorithm's name, plus the settings that tell its configurations apart when one
    algorithm was run in more than one configuration."""
    setups = [setup(r) for r in runs]
    out = []
    for run, mine in zip(runs, setups):
        others = [s for r, s in zip(runs, setups) if r.algorithm == run.algorithm]
        # a key only some runs have (records of an older version) is unknown, not a difference
        differ = sorted(k for k in mine if k not in DERIVED and any(k in s and s[k] != mine[k] for s in others))
        # a config key repeating a summary key (trainer.steps = steps, algorithm.outer.lr = outer.lr)
        # is said once, by the summary
        short = {k for k in differ if not k.startswith("config.")}
        differ = [k for k in differ if not (k.startswith("config.") and any(
            k == f"config.{x}" or k.endswith(f".{x}") for x in short))]
        name = NAMES.get(run.algorithm, run.algorithm)
        detail = ", ".join(f"{k.removeprefix('config.')}={mine[k]}" for k in differ)
        out.append(f"{name} ({detail})" if differ else name)
    return out


def _order(label: str) -> tuple:
    algo = next((k for k, v in NAMES.items() if label.split(" (")[0] == v), label)
    return (ORDER.index(algo) if algo in ORDER else len(ORDER), label)


def per_run(runs: list[Run]) -> pd.DataFrame:
    """One row per run: its Table 3 values (from its records) and identity."""
    rows = []
    for run, label in zip(runs, labels(runs)):
        s = run.steps
        rows.append({"label": label, "algorithm": run.algorithm, "seed": run.seed, "run": run.name,
                     "steps": len(s), "train_perplexity": float(s["perplexity"].iloc[-1]),
                     "train_time_s": float(s["time_step"].sum()),
                     "eval_perplexity": float(run.summary["eval_perplexity"]),
                     "eval_time_s": float(run.summary["eval_time_s"]),
                     "commit": run.summary.get("commit") or ""})
    return pd.DataFrame(rows)


def step_times(runs: list[Run]) -> pd.DataFrame:
    """Every training step of every run: label, seed, step, the four phases and the overall time."""
    frames = []
    for run, label in zip(runs, labels(runs)):
        s = run.steps
        frames.append(pd.DataFrame({"label": label, "seed": run.seed, "run": run.name, "step": s["step"],
                                    **{p: s[f"time_{p}"] for p in PHASES}, "overall": s["time_step"]}))
    return pd.concat(frames, ignore_index=True)


def _sorted(df: pd.DataFrame) -> pd.DataFrame:
    return df.sort_values("label", key=lambda c: c.map(_order)).reset_index(drop=True)


def table3(runs: list[Run]) -> pd.DataFrame:
    """label, seeds (runs aggregated), and <metric>_mean / <metric>_std across them."""
    df = per_run(runs)
    g = df.groupby("label", sort=False)
    out = pd.DataFrame({"label": list(g.groups), "seeds": g.size().values})
    for m in TABLE3:
        out[f"{m}_mean"] = g[m].mean().values
        out[f"{m}_std"] = g[m].std().values
    return _sorted(out)


def table4(runs: list[Run]) -> pd.DataFrame:
    """label, seeds, and per phase: mean and std over all steps of all seeds, and the std across
    seeds of the per-seed means."""
    df = step_times(runs)
    g = df.groupby("label", sort=False)
    per_seed = df.groupby(["label", "run"], sort=False)[list(TABLE4)].mean().groupby("label")
    out = pd.DataFrame({"label": list(g.groups), "seeds": g["run"].nunique().values})
    for p in TABLE4:
        out[f"{p}_mean"] = g[p].mean().values
        out[f"{p}_std"] = g[p].std().values
        out[f"{p}_seed_std"] = per_seed[p].std().reindex(out["label"]).values
    return _sorted(out)


def paper_table3(paper: dict) -> pd.DataFrame:
    t = paper["table3"]
    rows = [{"label": NAMES[a], "seeds": 1, **{f"{c}_mean": v for c, v in zip(t["columns"], vals)}}
            for a, vals in t["rows"].items()]
    return pd.DataFrame(rows)


def paper_table4(paper: dict) -> pd.DataFrame:
    t = paper["table4"]
    rows = []
    for a in t["mean"]:
        row = {"label": NAMES[a], "seeds": 1}
        for c, m, s in zip(t["columns"], t["mean"][a], t["std"][a]):
            row.update({f"{c}_mean": m, f"{c}_std": s})
        rows.append(row)
    return pd.DataFrame(rows)
