"""Which arm of a study spec (analysis.spec) a run is, and the values a tune phase chooses.

A run's directory name holds its overrides (fldp.sweep.point_dirname); an arm is the set of
overrides it names, numbers compared as numbers (`optimizer.lr=1e-2` is `optimizer.lr=0.01`). A run
is every arm whose overrides it has that no other matching arm's strictly contain (the precision
study's fsdp-fp32r, not fsdp, for a run with fp32 reductions; two arms with the same overrides, as
the paper-shape study's fl_fsdp and fl_fsdp-shared where the chosen lrs agree, both). In the tune
phase the tuned key is not an arm's (its runs sweep it); elsewhere `KEY=@ARM` is ARM's chosen value."""

from __future__ import annotations

import math

import pandas as pd

from .paper import paper_ratio
from .spec import Comparison, Family, Study
from .stats import Claim

METRIC = "eval_perplexity"


def overrides_of(point: str) -> set[str]:
    """The overrides a sweep point's directory name holds (fldp.sweep.point_dirname: sorted, joined
    by commas, `/`, `#` and `%` escaped); commas inside brackets or braces belong to a value."""
    name = point.replace("%2F", "/").replace("%23", "#").replace("%25", "%")
    found, depth, start = set(), 0, 0
    for i, ch in enumerate(name):
        if ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
        if ch == "," and depth == 0:
            found.add(name[start:i])
            start = i + 1
    return found | {name[start:]}


def canonical(override: str) -> str:
    """KEY=VALUE with a number's value as Python writes that float (1e-2 and 0.01 alike)."""
    key, _, value = override.partition("=")
    try:
        return f"{key}={float(value)!r}"
    except ValueError:
        return override


def shown(value: float) -> str:
    """A chosen value as an override writes it."""
    return f"{value:g}"


def resolved(study: Study, phase: str, chosen: dict[str, float]) -> dict[str, list[str]]:
    """Each of the phase's arms' overrides: in the tune phase without the tuned key (its runs sweep
    it); elsewhere `KEY=@ARM` as ARM's chosen value (an arm whose value is not chosen yet is left out)."""
    tune, out = study.tune, {}
    listed = next((p.arms for p in study.phases if p.name == phase), ())
    for arm, own in study.arms.items():
        if arm not in listed:
            continue
        overrides = []
        for o in own:
            key, _, of = o.partition("=@")
            if of and tune is not None and phase in tune.phases:
                continue
            if of and of not in chosen:
                break
            overrides.append(f"{key}={shown(chosen[of])}" if of else o)
        else:
            out[arm] = overrides
    return out


def arms_of(overrides: set[str], study: Study, phase: str, chosen: dict[str, float]) -> list[str]:
    """The arms a run with these overrides is (module docstring; ["?"]: none). A key the run has
    from the reduced pipeline's overrides (Hydra keeps a key's last value) does not count."""
    have = {canonical(o) for o in overrides}
    replaced = {o.split("=", 1)[0] for o in study.reduced.overrides if canonical(o) in have}
    own = {
        a: {canonical(o) for o in arm if o.split("=", 1)[0] not in replaced}
        for a, arm in resolved(study, phase, chosen).items()
    }
    matching = {a: o for a, o in own.items() if o <= have}
    found = [a for a, o in matching.items() if not any(o < other for other in matching.values())]
    return found or ["?"]


def geometric_mean(values: pd.Series) -> float:
    return math.exp(values.map(math.log).mean())


def tuning(df: pd.DataFrame, study: Study) -> pd.DataFrame:
    """Geometric-mean metric over the tune phase's seeds, per tuned arm (rows) and value (columns)."""
    tune = study.tune
    if tune is None or tune.key not in df.columns:
        return pd.DataFrame()
    runs = df[df["phase"].isin(tune.phases)]
    return runs.groupby(["arm", tune.key])[METRIC].apply(geometric_mean).unstack(tune.key)


def choices(table: pd.DataFrame, study: Study) -> tuple[dict[str, float], dict[str, float]]:
    """Each tuned arm's value with the lowest geometric-mean metric, and the one-value extension
    past a grid's edge where the best is there (once: never past an extended grid)."""
    chosen: dict[str, float] = {}
    extend: dict[str, float] = {}
    tune = study.tune
    if tune is None:
        return chosen, extend
    for arm in table.index:
        row = table.loc[arm].dropna()
        if row.empty:
            continue
        best = float(row.idxmin())
        chosen[arm] = best
        grid = sorted(row.index)
        if len(grid) > 1 and tune.step and set(grid) <= {*tune.grid, *study.reduced.grid}:  # not yet extended
            if best == grid[0]:
                extend[arm] = float(f"{best / tune.step:.3g}")
            elif best == grid[-1]:
                extend[arm] = float(f"{best * tune.step:.3g}")
    return chosen, extend


def arm(df: pd.DataFrame, name: str, phases: str | tuple[str, ...], metric: str = METRIC) -> pd.Series:
    """An arm's metric by seed in a phase (or in any of several)."""
    sel = df[df["phase"].isin([phases] if isinstance(phases, str) else phases) & (df["arm"] == name)]
    return sel.drop_duplicates("seed").set_index("seed")[metric]


def algorithm_of(study: Study, name: str) -> str:
    """The algorithm an arm runs: its `algorithm=` override (the paper's values are per algorithm)."""
    return next((o.split("=", 1)[1] for o in study.arms[name] if o.startswith("algorithm=")), name)


def paper_value(study: Study, c: Comparison, paper: dict, metric: str = METRIC) -> float:
    if c.paper == "above":
        return math.inf
    if c.paper == "below":
        return 0.0
    return paper_ratio(paper, algorithm_of(study, c.num), algorithm_of(study, c.den), metric)


def claims(df: pd.DataFrame, study: Study, family: Family, paper: dict, phase: str | None = None) -> list[Claim]:
    """A family's comparisons as claims on its metric, seed by seed (in `phase`, else its own)."""
    return [
        Claim(
            c.claim,
            arm(df, c.num, phase or family.phases, family.metric),
            arm(df, c.den, phase or family.phases, family.metric),
            paper_value(study, c, paper, family.metric),
        )
        for c in family.comparisons
    ]
