"""Tables 3 and 4 as pandas frames, from checked runs (or from the paper's published values).

A row is one configuration: runs that differ only in their seed. Table 3 cells are the mean and
standard deviation across seeds of each run's value. Table 4 cells are the paper's statistic, mean
and standard deviation over training steps, with the steps of all seeds pooled; `*_seed_std` is the
spread of the per-seed means. Standard deviations are sample ones (ddof=1): NaN for a single value.
"""

from __future__ import annotations

import json

import pandas as pd

from fldp.setting import flatten

from .records import PHASES, Run

NAMES = {"fsdp": "FSDP", "hsdp": "HSDP", "fl_fsdp": "FL+FSDP", "fl_hsdp": "FL+HSDP"}
ORDER = list(NAMES)
TABLE3 = ("train_perplexity", "train_time_s", "eval_perplexity", "eval_time_s")
TABLE4 = (*PHASES, "overall")
# The summary fields that record the setting (fldp.trainer.run_summary): what ran, on which mesh, model,
# data and network, and by which executor. An include list: a summary also names where its records
# went (W&B's run, the commit, the host) and, read from W&B, holds W&B's own keys (`_timestamp`,
# `_runtime`, the last `train/*` values); none of those defines an experiment.
SETTING_FIELDS = (
    "algorithm",
    "federation",
    "replicate",
    "shard",
    "every",
    "outer",
    "federate",
    "fragments",
    "fedavg_mode",
    "steps",
    "topology",
    "model",
    "dataset",
    "precision",
    "batch_size",
    "comm_emulated",
    "comm_scale",
    "executor",
    "network",
    "network_link",
)
# what a sweep over A and F varies: the aggregation period and the mesh (F, and the R x S the
# topology's ranks leave beside it)
AF_KEYS = ("every", "federation", "replicate", "shard", "config.algorithm.every", "config.mesh.")


def setup(run: Run) -> dict:
    """What defines the experiment, less the seed: the config's defining keys (fldp.setting, as
    `config.<key>`) and the summary's setting fields (outer -> outer.lr, ...)."""
    fixed = flatten({k: run.summary[k] for k in SETTING_FIELDS if k in run.summary})
    return {**{f"config.{k}": v for k, v in run.config.items()}, **fixed}


def labels(runs: list[Run], ignore: tuple[str, ...] = ()) -> list[str]:
    """The algorithm's name, plus the settings that tell its configurations apart when one
    algorithm was run in more than one configuration; keys starting with one of `ignore` never do."""
    setups = [setup(r) for r in runs]
    out = []
    for run, mine in zip(runs, setups):
        others = [s for r, s in zip(runs, setups) if r.algorithm == run.algorithm]
        # a key only some runs have (records of an older version) is unknown, not a difference
        differ = sorted(k for k in mine if not k.startswith(ignore) and any(k in s and s[k] != mine[k] for s in others))
        # a config key repeating a summary key (trainer.steps = steps, algorithm.outer.lr = outer.lr,
        # dataset.name = dataset) is said once, by the summary
        short = {k for k in differ if not k.startswith("config.")}
        differ = [
            k
            for k in differ
            if not (
                k.startswith("config.")
                and any(k in (f"config.{x}", f"config.{x}.name") or k.endswith(f".{x}") for x in short)
            )
        ]
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
        rows.append(
            {
                "label": label,
                "algorithm": run.algorithm,
                "seed": run.seed,
                "run": run.name,
                "steps": len(s),
                "train_perplexity": float(s["perplexity"].iloc[-1]),
                "train_time_s": float(s["time_step"].sum()),
                "eval_perplexity": float(run.summary["eval_perplexity"]),
                "eval_time_s": float(run.summary["eval_time_s"]),
                "commit": run.summary.get("commit") or "",
            }
        )
    return pd.DataFrame(rows)


def step_times(runs: list[Run]) -> pd.DataFrame:
    """Every training step of every run: label, seed, step, the four phases and the overall time."""
    frames = []
    for run, label in zip(runs, labels(runs)):
        s = run.steps
        frames.append(
            pd.DataFrame(
                {
                    "label": label,
                    "seed": run.seed,
                    "run": run.name,
                    "step": s["step"],
                    **{p: s[f"time_{p}"] for p in PHASES},
                    "overall": s["time_step"],
                }
            )
        )
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
    rows = [
        {"label": NAMES[a], "seeds": 1, **{f"{c}_mean": v for c, v in zip(t["columns"], vals)}}
        for a, vals in t["rows"].items()
    ]
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


def _period(every) -> str:
    """A as text: the period, or a schedule [[start, A], ...] as written."""
    return str(every) if isinstance(every, int) else json.dumps(every)


def af_cells(runs: list[Run]) -> pd.DataFrame:
    """A sweep over A and F: one row per configuration (its label less A and the mesh), A and F, with
    the seeds (runs) and the mean across them of each run's mean step time [s] and eval perplexity.
    Only FL configurations run at more than one (A, F) are kept; empty when there are none."""
    columns = ["configuration", "A", "F", "seeds", "step_time_s", "eval_perplexity"]
    fl = [r for r in runs if r.summary.get("every") is not None and "federation" in r.summary]
    if not fl:
        return pd.DataFrame(columns=columns)
    df = pd.DataFrame(
        [
            {
                "configuration": family,
                "A": _period(run.summary["every"]),
                "F": int(run.summary["federation"]),
                "step_time_s": float(run.steps["time_step"].mean()),
                "eval_perplexity": float(run.summary["eval_perplexity"]),
            }
            for run, family in zip(fl, labels(fl, ignore=AF_KEYS))
        ]
    )
    g = df.groupby(["configuration", "A", "F"], sort=False)
    out = g.agg(
        seeds=("step_time_s", "size"), step_time_s=("step_time_s", "mean"), eval_perplexity=("eval_perplexity", "mean")
    ).reset_index()
    swept = out.groupby("configuration")["A"].transform("size") > 1
    # numeric periods in numeric order, schedules after them
    order = lambda a: a.map(lambda v: (0, int(v), "") if v.isdigit() else (1, 0, v))
    out = out[swept].sort_values(["configuration", "A", "F"], key=lambda c: order(c) if c.name == "A" else c)
    return out.reset_index(drop=True)[columns]


def af_grid(cells: pd.DataFrame, configuration: str, value: str) -> pd.DataFrame:
    """One configuration's cells as a grid: A down, F across (NaN where a pair was not run)."""
    mine = cells[cells["configuration"] == configuration]
    grid = mine.pivot(index="A", columns="F", values=value)
    return grid.reindex(index=list(dict.fromkeys(mine["A"])), columns=sorted(mine["F"].unique()))
