"""A study spec's report: runs.csv, losses.csv.gz, pilot.csv (with a seed rule), findings.csv,
figure.png and report.md, which names the spec's hash and quotes the plan."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from .arms import METRIC, arm, choices, tuning
from .pieces import findings_rows, sections
from .plotting import plt, save
from .render import markdown
from .runs_frame import changed, displayed, losses, plan_quote
from .spec import Study
from .study import decided_seeds, findings, pilot, seconds_per_run
from .study_run import STAMP, changed_runs


def committed_primary(directory: Path) -> pd.DataFrame:
    """Another study's committed primary verdicts (its results/findings.csv), empty without one."""
    path = directory / "results" / "findings.csv"
    if not path.exists():
        return pd.DataFrame()
    table = pd.read_csv(path)
    for column in ("family", "setting"):
        if column in table.columns:
            table = table[table[column].astype(str).str.contains("primary")]
    return table.reset_index(drop=True)


def beside(table: pd.DataFrame, study: Study, family: str) -> list[str]:
    """The family's `beside` entries: its rows beside another study's committed primary verdicts
    (in order, or the entry's rows), and whether the direction changed (named, not tested)."""
    parts = []
    for b in (b for b in study.beside if b.family == family):
        then = committed_primary(study.directory.parent / b.study)
        ours = table[table["family"] == b.family].reset_index(drop=True)
        if then.empty:
            continue
        olds = then.iloc[list(b.rows)] if b.rows else then.iloc[: len(ours)]
        rows = [
            {
                "claim": now["claim"],
                b.family: f"{now['ratio']:.3f} [{now['lo']:.3f}, {now['hi']:.3f}] {now['direction']}",
                b.label: f"{old['ratio']:.3f} [{old['lo']:.3f}, {old['hi']:.3f}] {old['direction']}",
                "changed": changed(now["direction"], old["direction"]),
            }
            for (_, now), (_, old) in zip(ours.iterrows(), olds.iterrows())
        ]
        parts += [f"\n{b.family} beside {b.label} (named, not tested):\n", markdown(pd.DataFrame(rows))]
    return parts


def figure(df: pd.DataFrame, table: pd.DataFrame, study: Study, out: Path) -> None:
    """Left: each arm's metric per seed in the judged phase; right: the judged families' ratios
    with their intervals, and the paper's values."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    phase = study.families[0].phase
    names = list(study.arms)
    for i, name in enumerate(names):
        v = arm(df, name, phase)
        left.scatter([i] * len(v), v, alpha=0.6, color=f"C{i % 10}")
    left.set_xticks(range(len(names)), names, rotation=45, ha="right")
    left.set(ylabel=f"{METRIC} (each seed, {phase})", title="arms")
    if (df.loc[df["phase"] == phase, METRIC] > 0).any():
        left.set_yscale("log")
    judged = {f.name for f in study.families if f.test == "judge"}
    shown = table[table["family"].isin(judged)].reset_index(drop=True)
    y = range(len(shown))
    right.errorbar(shown["ratio"], y, xerr=[shown["ratio"] - shown["lo"], shown["hi"] - shown["ratio"]], fmt="o")
    right.scatter(shown["paper"], y, marker="x", color="C3", label="paper")
    right.axvline(1.0, color="grey", lw=0.8)
    right.set_yticks(list(y), [c[:40] for c in shown["claim"]])
    right.set(xlabel="ratio (simultaneous interval)", title="judged families")
    if (shown["ratio"] > 0).any():
        right.set_xscale("log")
    right.invert_yaxis()
    right.legend()
    fig.tight_layout()
    save(fig, out / "figure.png", 120)


def pilot_section(df: pd.DataFrame, study: Study, paper: dict, out: Path) -> list[str]:
    rule = study.seed_rule
    seeds = decided_seeds(df, study, paper)
    if rule is None or seeds is None:
        return []
    p = pilot(df, study, paper)
    p.to_csv(out / "pilot.csv", index=False)
    times = seconds_per_run(df, rule.phase).rename("train_time_s").reset_index()
    shown = ", ".join(f"{a} {n}" for a, n in seeds.items())
    return [
        f"## {rule.phase.capitalize()}\n",
        markdown(p.round({"sd_log": 4})),
        "",
        markdown(times.round(1)),
        "",
        f"Judging seeds per arm (the seed rule): {shown}.\n",
    ]


JUDGED = (
    "judged: each interval simultaneous (Bonferroni, 1 - 0.05 / {m}), the direction read at the level Holm's "
    "step-down gives it (analysis.stats.judge)"
)
EXPLORED = "explored: plain 95% intervals, no verdict read from them"


def with_also(rows: pd.DataFrame) -> pd.DataFrame:
    """The paper and size columns with the second paper value where a comparison has one (`also`)."""
    also = rows["also"].fillna("").astype(str) != ""
    paper = [
        f"{p} ({a.upper()} {v:.2f})" if has else p
        for p, a, v, has in zip(rows["paper"], rows["also"], rows["paper_also"], also)
    ]
    sizes = [
        f"{s} ({a.upper()}'s value: {'the same' if t == s else t})" if has else s
        for s, a, t, has in zip(rows["size"], rows["also"], rows["size_also"], also)
    ]
    return rows.assign(paper=paper, size=sizes)


def family_section(table: pd.DataFrame, study: Study, family) -> list[str]:
    rows = with_also(displayed(table[table["family"] == family.name], study.target))
    judged = family.test == "judge"
    columns = ["claim", "interval", "paper", "direction", *(["size"] if judged else []), "seeds"]
    return [
        f"### {family.name}\n",
        f"{len(family.comparisons)} comparisons, {(JUDGED if judged else EXPLORED).format(m=len(family.comparisons))}.\n",
        *([family.note + "\n"] if family.note else []),
        markdown(rows[[*columns, *(["target"] if judged else [])]]),
        *beside(table, study, family.name),
        "",
    ]


def verdicts(df: pd.DataFrame, study: Study, paper: dict, out: Path) -> list[str]:
    """The verdicts section, a table per family with its phase's runs; writes findings.csv and
    figure.png."""
    shown = [f for f in study.families if has_run(df, f)]
    table = findings(df, study, paper, shown)
    pd.concat([table, *findings_rows(df, study)], ignore_index=True).to_csv(out / "findings.csv", index=False)
    figure(df, table, study, out)
    parts = ["## Verdicts\n"]
    for family in shown:
        parts += family_section(table, study, family)
    waiting = [f"{f.name} (phases {', '.join(f.phases)})" for f in study.families if f not in shown]
    if waiting:
        parts.append(f"Not yet: {'; '.join(waiting)}: a phase of each has no finished run.\n")
    return [*parts, "![arms and ratios](figure.png)\n"]


def has_run(df: pd.DataFrame, family) -> bool:
    """Every phase the family reads has a finished run."""
    return all((df["phase"] == p).any() for p in family.phases)


def tuning_section(df: pd.DataFrame, study: Study, out: Path) -> list[str]:
    """The tune phase's table (tuning.csv), each arm's chosen value and any extension still to run."""
    table = tuning(df, study)
    if table.empty or study.tune is None:
        return []
    table.to_csv(out / "tuning.csv")
    chosen, extend = choices(table, study)
    tune = study.tune
    return [
        f"## {tune.key} ({', '.join(tune.phases)} seeds; geometric-mean {METRIC})\n",
        markdown(table.round(1).reset_index()),
        "\nChosen: "
        + ", ".join(f"{a} {v:g}" for a, v in chosen.items())
        + (f"; still at a grid edge, one value past it to run: {', '.join(extend)}" if extend else "")
        + "\n",
    ]


def spec_line(study: Study, runs_dir: Path) -> str:
    stamp = runs_dir.parent / STAMP
    then = json.loads(stamp.read_text())["sha256"] if stamp.exists() else None
    line = f"The spec: `{study.name}` sha256 {study.sha256[:12]}"
    if then and then != study.sha256:
        line += f"; the runs were made under another version of it (sha256 {then[:12]}): read with that in mind"
    if changed := changed_runs(study, runs_dir.parent):
        made = ", ".join(f"{n} under sha256 {sha[:12]}" for sha, n in changed.items())
        line += f"; runs made under other versions of it, judged as told (--allow-changed-spec): {made}"
    return line + ".\n"


def report(
    df: pd.DataFrame, study: Study, paper: dict, out: Path, command: str, elapsed: float | None, runs_dir: Path
) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    # a run that is several arms (analysis.arms) is one row, its arms joined by "+"
    runs = df.assign(arm=df.groupby("run")["arm"].transform("+".join)).drop_duplicates("run")
    runs.drop(columns=["step", "loss"]).sort_values(["phase", "arm", "seed"]).to_csv(out / "runs.csv", index=False)
    losses(runs, out)
    parts = [
        f"# {study.title}\n\n`{command}`"
        + (f"; runs took {elapsed / 60:.1f} min" if elapsed else "")
        + f". {len(runs)} runs: one row each in runs.csv, every step's training loss in losses.csv.gz.\n",
        spec_line(study, runs_dir),
        *tuning_section(df, study, out),
        *pilot_section(df, study, paper, out),
        *sections(df, study, out),
    ]
    if any(has_run(df, f) for f in study.families):
        parts += verdicts(df, study, paper, out)
    parts.append(plan_quote(study.plan))
    path = out / "report.md"
    path.write_text("\n".join(parts) + "\n")
    return path
