"""What a study spec (analysis.spec) decides and finds from its runs: one row per run, the judging
seeds its rule asks for, and its families' verdicts (analysis.stats.judge or explore).

A study's runs live in OUT/runs/PHASE/<the point's overrides>/ (analysis.study_run makes them): the
directory says which phase made a run, and its overrides which arm (analysis.arms). Every ratio
pairs the two arms' runs seed by seed on the final eval perplexity, worse-in-the-paper on top."""

from __future__ import annotations

import math
from pathlib import Path
from typing import NamedTuple

import pandas as pd

from .arms import algorithm_of, arms_of, choices, claims, overrides_of, tuning
from .paper import paper_ratio
from .pieces import COLUMNS
from .runs_frame import frame as shape_frame
from .spec import Family, SeedRule, Study
from .stats import Ratio, explore, judge, paired_ratio, seeds_for, size

NO_PAPER = "n/a (no paper value)"


def place(name: str, study: Study) -> tuple[str, set[str], str]:
    """(phase, overrides, run id) of a run directory OUT/runs/PHASE/<the point's overrides>: the
    last phase in its path, the overrides its name holds, and the path from the phase on (unique in
    a study, no machine's path in a committed file)."""
    parts = Path(name).parts
    phases = {p.name for p in study.phases}
    at = max((i for i in range(len(parts) - 1) if parts[i] in phases), default=None)
    if at is None:
        return "?", set(), parts[-1]
    return parts[at], overrides_of(parts[-1]), "/".join(parts[at:])


def placed(df: pd.DataFrame, study: Study, overrides: list[set[str]]) -> pd.DataFrame:
    """df with each row's arm (a row per arm where a run is several: analysis.arms): the tune
    phase's first, then the others' with the values it chose."""
    tune = study.tune
    first = [arms_of(o, study, p, {})[0] if tune and p in tune.phases else "?" for o, p in zip(overrides, df["phase"])]
    chosen, _ = choices(tuning(df.assign(arm=first), study), study)
    df = df.assign(arm=[arms_of(o, study, p, chosen) for o, p in zip(overrides, df["phase"])])
    df = df.explode("arm", ignore_index=True)
    return df[["run", "phase", "arm", *[c for c in df.columns if c not in ("run", "phase", "arm")]]]


def placed_arms(df: pd.DataFrame, study: Study) -> pd.DataFrame:
    """df (e.g. read back from a report's runs.csv: one row per run) with every row's arm from its
    run id: one row per run and arm (a run placed before, a row per arm, is not doubled)."""
    df = df.drop(columns=["arm"], errors="ignore").drop_duplicates("run", ignore_index=True)
    return placed(df, study, [overrides_of(Path(r).name) for r in df["run"]])


def frame(runs, study: Study) -> pd.DataFrame:
    """One row per run (analysis.runs_frame.frame), with the phase, the
    arm and the run id its directory gives, and the columns the spec's pieces read."""
    df = shape_frame(runs)
    where = [place(run.name, study) for run in runs]
    df["phase"] = [p for p, _, _ in where]
    df["run"] = [r for _, _, r in where]
    if study.tune is not None:  # the tuned key's value, as the run's config holds it
        df[study.tune.key] = [float(run.config.get(study.tune.key, math.nan)) for run in runs]
    for piece in study.pieces:  # the columns a named piece reads (analysis.pieces)
        if piece.name in COLUMNS and runs:
            df = df.join(pd.DataFrame([COLUMNS[piece.name](run) for run in runs], index=df.index))
    return placed(df, study, [o for _, o, _ in where])


def family_table(df: pd.DataFrame, study: Study, family: Family, paper: dict) -> pd.DataFrame:
    """A family's rows: judged (Holm for the direction, Bonferroni intervals) or explored (plain
    95%); a comparison with no paper value shows none and no size verdict."""
    found = claims(df, study, family, paper)
    table = (judge if family.test == "judge" else explore)(found)
    sided = [c.paper != "paper" for c in family.comparisons]
    table.loc[sided, "paper"] = math.nan
    table.loc[sided, "size"] = NO_PAPER
    return stood_for(table, study, family, paper)


def stood_for(table: pd.DataFrame, study: Study, family: Family, paper: dict) -> pd.DataFrame:
    """The table with `also` (the algorithm a comparison's numerator stands for too), `paper_also`
    (the paper's ratio of it to the denominator) and `size_also` (the same interval against it)."""
    values, sizes = [], []
    for c, row in zip(family.comparisons, table.itertuples()):
        value = paper_ratio(paper, c.also, algorithm_of(study, c.den)) if c.also else math.nan
        values.append(value)
        sizes.append(size(Ratio(row.ratio, row.lo, row.hi, int(row.seeds)), value) if c.also else "")
    return table.assign(also=[c.also or "" for c in family.comparisons], paper_also=values, size_also=sizes)


def findings(df: pd.DataFrame, study: Study, paper: dict, families: list[Family] | None = None) -> pd.DataFrame:
    """Every family's rows (or `families`'), in the spec's order, with each interval's relative
    half-width."""
    tables = [family_table(df, study, f, paper).assign(family=f.name) for f in families or study.families]
    table = pd.concat(tables, ignore_index=True)
    table["half_width"] = table["hi"] / table["ratio"] - 1
    return table[["family", *[c for c in table.columns if c != "family"]]]


def pilot(df: pd.DataFrame, study: Study, paper: dict) -> pd.DataFrame:
    """Each judged family's ratios on the seed rule's phase: the paired SD of the log ratios and the
    seeds each needs for the rule's half-width (the rule's minimum where the SD is 0)."""
    rule = study.seed_rule
    assert rule is not None
    rows = []
    for family in study.families:
        if family.test != "judge":
            continue
        for c in claims(df, study, family, paper, rule.phase):
            r = paired_ratio(c.a, c.b)
            if r.seeds == 0:  # arms the rule's phase does not run (the paper-shape study's shared lr)
                continue
            enough = r.seeds >= 2
            need = seeds_for(r.sd, rule.half_width) if enough and r.sd > 0 else (rule.min if enough else None)
            rows.append(
                {"family": family.name, "claim": c.name, "pilot_seeds": r.seeds, "sd_log": r.sd, "seeds_needed": need}
            )
    return pd.DataFrame(rows)


def seconds_per_run(df: pd.DataFrame, phase: str) -> pd.Series:
    """Each arm's mean training time per run [s] in a phase."""
    return df[df["phase"] == phase].groupby("arm")["train_time_s"].mean()


def judging_seeds(rule: SeedRule, needed: pd.Series, seconds: pd.Series) -> dict[str, int]:
    """Seeds per arm: the most any ratio of the rule's family needs, within [min, max]; with a
    budget, capped so one seed of every arm (at `seconds` per run) times N fits it; a cap under
    min gives the fallback arms `fallback_seeds` and the others what is left, at least that."""
    want = max(rule.min, int(needed.max()))
    if rule.max is not None:
        want = min(want, rule.max)
    arms = list(seconds.index)
    if rule.budget_s is None:
        return dict.fromkeys(arms, want)
    cap = int(rule.budget_s // seconds.sum())
    if cap >= rule.min or rule.fallback_seeds is None:
        return dict.fromkeys(arms, min(want, cap))
    fallback = [a for a in arms if a in rule.fallback_arms]
    left = rule.budget_s - rule.fallback_seeds * seconds[fallback].sum()
    rest = max(rule.fallback_seeds, min(want, int(left // seconds.drop(fallback).sum())))
    return {a: rule.fallback_seeds if a in fallback else rest for a in arms}


def decided_seeds(df: pd.DataFrame, study: Study, paper: dict) -> dict[str, int] | None:
    """The seed rule applied to its phase's runs: seeds per arm, or None while an arm of the phase
    has fewer than 2 finished seeds there (no SD yet). The runner decides once the phase is done."""
    rule = study.seed_rule
    if rule is None:
        return None
    done = df[df["phase"] == rule.phase].groupby("arm")["seed"].nunique()
    if any(done.get(a, 0) < 2 for a in study.phase(rule.phase).arms):
        return None
    need = pilot(df, study, paper)
    return judging_seeds(rule, need[need["family"] == rule.family]["seeds_needed"], seconds_per_run(df, rule.phase))


class Decisions(NamedTuple):
    """What the runs so far decide: the seed rule's seeds per arm (None: not yet), each tuned arm's
    value, and the tune phase's one-value extensions still to run."""

    seeds: dict[str, int] | None
    chosen: dict[str, float]
    extend: dict[str, float]


NOTHING = Decisions(None, {}, {})


def decide(df: pd.DataFrame, study: Study, paper: dict) -> Decisions:
    chosen, extend = choices(tuning(df, study), study)
    return Decisions(decided_seeds(df, study, paper), chosen, extend)
