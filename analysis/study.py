"""What a study spec (analysis.spec) decides and finds from its runs: one row per run, the judging
seeds its rule asks for, and its families' verdicts (analysis.stats.judge or explore).

A study's runs live in OUT/runs/PHASE/<the point's overrides>/ (analysis.study_run makes them): the
directory says which phase made a run, and its overrides which arm (the arm's own, most specific). Every ratio pairs the two
arms' runs seed by seed on the final eval perplexity, worse-in-the-paper on top."""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd

from .paper_shape import frame as shape_frame
from .pieces import COLUMNS
from .science import paper_ratio
from .spec import Comparison, Family, SeedRule, Study
from .stats import Claim, Ratio, explore, judge, paired_ratio, seeds_for, size

METRIC = "eval_perplexity"
NO_PAPER = "n/a (no paper value)"


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


def arm_of(overrides: set[str], study: Study) -> str:
    """The arm whose overrides the run has, the most specific where several match ("?": none). A
    key the run has from the reduced pipeline's overrides (a reduced run: Hydra keeps the last value
    of a key) does not count."""
    replaced = {o.split("=", 1)[0] for o in study.reduced.overrides if o in overrides}
    own = {a: {o for o in arm if o.split("=", 1)[0] not in replaced} for a, arm in study.arms.items()}
    matching = [a for a in own if own[a] <= overrides]
    return max(matching, key=lambda a: len(own[a]), default="?")


def place(name: str, study: Study) -> tuple[str, str, str]:
    """(phase, arm, run id) of a run directory OUT/runs/PHASE/<the point's overrides>: the last
    phase in its path, the arm its overrides name, and the path from the phase on (unique in a
    study, no machine's path in a committed file)."""
    parts = Path(name).parts
    phases = {p.name for p in study.phases}
    at = max((i for i in range(len(parts) - 1) if parts[i] in phases), default=None)
    if at is None:
        return "?", "?", parts[-1]
    return parts[at], arm_of(overrides_of(parts[-1]), study), "/".join(parts[at:])


def frame(runs, study: Study) -> pd.DataFrame:
    """The paper-shape study's one row per run (analysis.paper_shape.frame), with the phase, the
    arm and the run id its directory gives, and the columns the spec's pieces read."""
    df = shape_frame(runs)
    placed = [place(run.name, study) for run in runs]
    df["phase"] = [p for p, _, _ in placed]
    df["run"] = [r for _, _, r in placed]
    df.insert(2, "arm", [a for _, a, _ in placed])
    for piece in study.pieces:  # the columns a named piece reads (analysis.pieces)
        if piece.name in COLUMNS and runs:
            df = df.join(pd.DataFrame([COLUMNS[piece.name](run) for run in runs], index=df.index))
    return df


def placed_arms(df: pd.DataFrame, study: Study) -> pd.DataFrame:
    """df (e.g. read back from a report's runs.csv) with every row's arm from its run id."""
    return df.assign(arm=[arm_of(overrides_of(Path(r).name), study) for r in df["run"]])


def arm(df: pd.DataFrame, name: str, phases: str | tuple[str, ...]) -> pd.Series:
    """An arm's metric by seed in a phase (or in any of several)."""
    sel = df[df["phase"].isin([phases] if isinstance(phases, str) else phases) & (df["arm"] == name)]
    return sel.drop_duplicates("seed").set_index("seed")[METRIC]


def algorithm_of(study: Study, name: str) -> str:
    """The algorithm an arm runs: its `algorithm=` override (the paper's values are per algorithm)."""
    return next((o.split("=", 1)[1] for o in study.arms[name] if o.startswith("algorithm=")), name)


def paper_value(study: Study, c: Comparison, paper: dict) -> float:
    if c.paper == "above":
        return math.inf
    if c.paper == "below":
        return 0.0
    return paper_ratio(paper, algorithm_of(study, c.num), algorithm_of(study, c.den))


def claims(df: pd.DataFrame, study: Study, family: Family, paper: dict, phase: str | None = None) -> list[Claim]:
    return [
        Claim(
            c.claim,
            arm(df, c.num, phase or family.phases),
            arm(df, c.den, phase or family.phases),
            paper_value(study, c, paper),
        )
        for c in family.comparisons
    ]


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
