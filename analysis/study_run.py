"""Running a study spec: each phase Hydra multiruns of its arms into OUT/runs/PHASE/, in the spec's
order, the judging seeds decided from the runs before them. Run again with the same OUT and finished
points are skipped (trainer.skip_finished), and so are the points a committed report holds (BANKED:
its per-run numbers, from a session whose OUT did not survive to this machine); OUT/study.json holds
the spec's hash, and a spec changed since is refused unless asked for (the report then says so)."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from collections.abc import Set as AbstractSet
from datetime import datetime
from pathlib import Path

from .arms import arms_of, overrides_of, resolved, shown
from .spec import Phase, Study

STAMP = "study.json"
RUN_STAMP = "spec.json"  # beside a run's records: the hash of the spec it was made under

Point = tuple[str, str, int, str]  # (phase, arm, seed, the tuned value as an override writes it; "" outside tuning)


def banked_points(rows, study: Study) -> set[Point]:
    """The points of a committed report's runs (`rows`: its runs.csv, each row's arm placed)."""
    tune = study.tune.phases if study.tune else ()
    values = rows[study.tune.key] if study.tune else [None] * len(rows)  # read only in a tune phase
    return {
        (phase, arm, int(seed), shown(float(value)) if phase in tune else "")
        for phase, arm, seed, value in zip(rows["phase"], rows["arm"], rows["seed"], values)
    }


def unbanked(study: Study, phase: str, arms: dict, seeds: dict, banked: AbstractSet[Point]) -> tuple[dict, dict]:
    """The phase's arms (each one's overrides) and seeds less the points `banked` holds: a point is
    made once, whichever session made it. A tuned arm keeps the values of its sweep with a seed not
    banked; an arm left with no run is dropped."""
    key = study.tune.key if study.tune and phase in study.tune.phases else None
    left_arms, left_seeds = {}, {}
    for arm, overrides in arms.items():
        todo = [s for s in seeds[arm] if key or (phase, arm, s, "") not in banked]
        kept = []
        for o in overrides:
            name, _, values = o.partition("=")
            if name == key:  # the sweep: the values some seed of which is not banked
                wanted = [
                    v for v in values.split(",") if any((phase, arm, s, shown(float(v))) not in banked for s in todo)
                ]
                o = f"{key}={','.join(wanted)}" if wanted else ""
            kept.append(o)
        if todo and all(kept):
            left_arms[arm], left_seeds[arm] = kept, todo
    return left_arms, left_seeds


def phase_seeds(
    study: Study, phase: Phase, reduced: bool, decided: dict[str, int] | None
) -> dict[str, list[int]] | None:
    """Each arm's seeds in a phase: the spec's, or 0..N-1 with N the seed rule's; None while the
    rule cannot decide yet. Reduced: the reduced pipeline's where it names the phase, else 0..N-1
    with N its judging_seeds."""
    if reduced:
        fixed = study.reduced.seeds.get(phase.name) or range(study.reduced.judging_seeds)
        return dict.fromkeys(phase.arms, list(fixed))
    if phase.seeds is not None:
        return dict.fromkeys(phase.arms, list(phase.seeds))
    if decided is None:
        return None
    # an arm the rule's phase did not run (the paper-shape study's shared-lr arms): the most any arm has
    return {a: list(range(decided.get(a, max(decided.values())))) for a in phase.arms}


def batches(arms: dict[str, list[str]], phase: Phase, seeds: dict[str, list[int]]) -> list[tuple[list[str], list[int]]]:
    """The phase's arms (`arms`: each one's overrides) as few multiruns as Hydra's sweep syntax
    allows: arms with the same seeds and the same overrides but `algorithm=` in one,
    `algorithm=a,b,...` (a Python start each costs seconds). Each (overrides, seeds), in the spec's
    order."""
    grouped: dict[tuple, list[str]] = {}
    for arm in phase.arms:
        rest = tuple(o for o in arms[arm] if not o.startswith("algorithm="))
        algorithms = grouped.setdefault((rest, tuple(seeds[arm])), [])
        for o in arms[arm]:  # two arms with the same overrides (agreeing tuned values) run once
            if o.startswith("algorithm=") and o.split("=", 1)[1] not in algorithms:
                algorithms.append(o.split("=", 1)[1])
    return [
        ([*([f"algorithm={','.join(algorithms)}"] if algorithms else []), *rest], list(arm_seeds))
        for (rest, arm_seeds), algorithms in grouped.items()
    ]


def command(study: Study, out: Path, phase: str, overrides: list[str], seeds: list[int], extra: list[str]) -> list[str]:
    return [
        sys.executable,
        "-m",
        "fldp.train",
        "-m",
        *study.train,
        f"hydra.sweep.dir={out / 'runs' / phase}",
        # seed before the arms: Hydra varies the last override fastest, so a phase cut short has whole seeds
        f"seed={','.join(map(str, seeds))}",
        *overrides,
        *extra,
    ]


def stamp(study: Study, out: Path, allow_changed: bool) -> str | None:
    """Records the spec's hash in OUT (first run), or the refusal when OUT was run under another."""
    path = out / STAMP
    if path.exists():
        then = json.loads(path.read_text())["sha256"]
        if then != study.sha256 and not allow_changed:
            return (
                f"{out} was run under another version of the spec (sha256 {then[:12]}, now {study.sha256[:12]}): "
                "a pre-registration changed after its runs. Nothing run: pass --allow-changed-spec to go on "
                "(the report will say so), or use a new OUT"
            )
        return None
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"study": study.name, "sha256": study.sha256}) + "\n")
    return None


def stamp_runs(study: Study, phase_dir: Path) -> None:
    """Each finished run of the phase without a stamp gets this spec's hash (a run skipped as
    finished keeps the hash it was made under)."""
    for summary in phase_dir.glob("*/summary.json"):
        path = summary.parent / RUN_STAMP
        if not path.exists():
            path.write_text(json.dumps({"study": study.name, "sha256": study.sha256}) + "\n")


def changed_runs(study: Study, out: Path) -> dict[str, int]:
    """Runs of OUT made under another version of the spec: {its sha256: how many}. A run without a
    stamp (made before runs had one) counts as made under OUT's study.json."""
    whole = json.loads((out / STAMP).read_text())["sha256"] if (out / STAMP).exists() else study.sha256
    found: dict[str, int] = {}
    for summary in (out / "runs").glob("*/*/summary.json"):
        path = summary.parent / RUN_STAMP
        sha = json.loads(path.read_text())["sha256"] if path.exists() else whole
        if sha != study.sha256:
            found[sha] = found.get(sha, 0) + 1
    return found


def elapsed(out: Path, seconds: float) -> float:
    """The study's wall time so far, this part's added (a study run in parts: their sum)."""
    path = out / "elapsed_s"
    total = (float(path.read_text()) if path.exists() else 0.0) + seconds
    path.write_text(f"{total:.0f}\n")
    return total


def tune_arms(study: Study, phase: Phase, reduced: bool, extend: dict[str, float] | None) -> dict[str, list[str]]:
    """The tune phase's arms swept over the grid (the reduced one where given), or over `extend`:
    each arm's one value past its grid's edge (arms without one are left out)."""
    tune = study.tune
    assert tune is not None
    grid = study.reduced.grid if reduced and study.reduced.grid else tune.grid
    own = resolved(study, phase.name, {})
    if extend is None:
        return {a: [*own[a], f"{tune.key}={','.join(map(shown, grid))}"] for a in phase.arms}
    return {a: [*own[a], f"{tune.key}={shown(v)}"] for a, v in extend.items()}


def set_aside_unfinished(out: Path, phase: str) -> list[Path]:
    """A run of the phase that stopped part-way (its records, no summary.json: the machine or the
    session ended) and keeps no checkpoint to resume from is moved to OUT/interrupted/PHASE/, so
    that the multirun makes it again from its start: fldp.train refuses a directory holding another
    run's records, and a decision must not be read off a grid with a hole. Where it went, each."""
    moved = []
    for metrics in sorted((out / "runs" / phase).glob("*/metrics.jsonl")):
        run = metrics.parent
        if (run / "summary.json").exists() or any((run / "checkpoints").glob("step_*")):
            continue
        to = out / "interrupted" / phase / run.name
        if to.exists():
            to = to.with_name(f"{run.name}@{datetime.now():%Y%m%d-%H%M%S}")
        to.parent.mkdir(parents=True, exist_ok=True)
        run.rename(to)
        moved.append(to)
    return moved


def run_phase(
    study: Study,
    out: Path,
    phase: Phase,
    arms: dict,
    seeds: dict,
    extra: list[str],
    start: float,
    banked: AbstractSet[Point],
) -> int:
    """The phase's multiruns of `arms` (each arm's overrides) but the points `banked` holds, its
    interrupted runs set aside first; 0 when every one succeeded."""
    status = 0
    arms, seeds = unbanked(study, phase.name, arms, seeds, banked)
    if not arms:
        print(f"{study.name}: {phase.name}: every run is banked (--banked), none made again", flush=True)
        return 0
    for moved in set_aside_unfinished(out, phase.name):
        print(f"{study.name}: {phase.name}: an interrupted run, set aside to be made again: {moved}", flush=True)
    for overrides, batch_seeds in batches(arms, Phase(phase.name, tuple(arms), None), seeds):
        print(
            f"{study.name}: {phase.name} {' '.join(overrides)} seed={','.join(map(str, batch_seeds))} "
            f"({time.monotonic() - start:.0f} s so far)",
            flush=True,
        )
        every = [*phase.overrides, *extra]
        status |= subprocess.run(command(study, out, phase.name, overrides, batch_seeds, every)).returncode != 0
        stamp_runs(study, out / "runs" / phase.name)
    return status


def run(
    study: Study,
    out: Path,
    reduced: bool,
    until: str | None,
    overrides: list[str],
    decide,
    banked: AbstractSet[Point] = frozenset(),
) -> int:
    """Every phase up to `until`, but the points `banked` holds; `decide(out)`: what the runs so far
    decide (analysis.study.decide: the seed rule's seeds, the tuned values and the grid's
    extensions), banked ones included. 0 when every multirun succeeded."""
    start, status = time.monotonic(), 0
    extra = [*(study.reduced.overrides if reduced else ()), *overrides]
    until = until or (study.reduced.until if reduced else None)
    tune = study.tune.phases if study.tune else ()
    for phase in study.phases:
        if not phase.run:
            print(f"{study.name}: {phase.name}: kept as it ran, not run again (the spec: run: false)")
            continue
        decided = decide(out)
        seeds = phase_seeds(study, phase, reduced, decided.seeds)
        arms = (
            tune_arms(study, phase, reduced, None)
            if phase.name in tune
            else resolved(study, phase.name, decided.chosen)
        )
        missing = [a for a in phase.arms if a not in arms]
        if seeds is None or missing:
            why = (
                "the seed rule's phase is incomplete"
                if seeds is None
                else f"no tuned value yet for {', '.join(missing)}"
            )
            print(f"{study.name}: {phase.name}: nothing run ({why})", file=sys.stderr)
            return 1
        status |= run_phase(study, out, phase, arms, seeds, extra, start, banked)
        # the grid's runs read once; this phase's arms only
        extend = {a: v for a, v in decide(out).extend.items() if a in phase.arms} if phase.name in tune else {}
        if extend and not status:  # the best at a grid's edge: one value past it, once
            status |= run_phase(
                study, out, phase, tune_arms(study, phase, reduced, extend), seeds, extra, start, banked
            )
        if status:  # what comes next is decided from this phase's runs: none may be missing
            print(
                f"{study.name}: {phase.name}: a run failed (its error above); the phases after it are not run, "
                "since they are decided from its runs. Run the study again to retry it",
                file=sys.stderr,
            )
            break
        if phase.name == until:
            break
    total = elapsed(out, time.monotonic() - start)
    print(f"{study.name}: {total:.0f} s of runs in all")
    return int(status)


def finished_seeds(out: Path, phase: str, study: Study, chosen: dict[str, float]) -> dict[str, dict[int, float]]:
    """Per arm, the seeds of its finished runs in a phase (summary.json: written last), each run's
    training time."""
    found: dict[str, dict[int, float]] = {}
    for summary in sorted((out / "runs" / phase).glob("*/summary.json")):
        s = json.loads(summary.read_text())
        for arm in arms_of(overrides_of(summary.parent.name), study, phase, chosen):
            found.setdefault(arm, {})[int(s["seed"])] = float(s.get("train_time_s", 0.0))
    return found


def status_lines(study: Study, out: Path, reduced: bool, decided, banked=None) -> list[str]:
    """Per phase and arm: the runs finished of those the phase asks for (OUT's, and `banked`'s: a
    committed report's runs.csv, arms placed), and a time estimate for what is left from the arm's
    finished runs in any phase (its tuning runs time its judging ones); the runs of an arm with
    none finished yet are counted apart, never estimated as zero (`decided`: analysis.study.decide
    on them)."""
    finished = {p.name: finished_seeds(out, p.name, study, decided.chosen) for p in study.phases}
    if banked is not None:
        for phase, arm, seed, seconds in zip(banked["phase"], banked["arm"], banked["seed"], banked["train_time_s"]):
            finished.setdefault(phase, {}).setdefault(arm, {}).setdefault(int(seed), float(seconds))
    per_run = {  # the median: a run paused part-way (the machine lent to other work) says nothing of the rest
        arm: statistics.median(times)
        for arm in {a for f in finished.values() for a in f}
        if (times := [t for f in finished.values() for t in f.get(arm, {}).values()])
    }
    lines, left_s, unknown = [], 0.0, 0
    for phase in study.phases:
        seeds = phase_seeds(study, phase, reduced, decided.seeds)
        for arm in phase.arms:
            done = finished[phase.name].get(arm, {})
            if not phase.run or seeds is None:
                why = "not run again (run: false)" if not phase.run else "seeds not decided yet"
                lines.append(f"{phase.name:8} {arm:16} {len(done)} finished; {why}")
                continue
            missing = [s for s in seeds[arm] if s not in done]
            left_s += per_run.get(arm, 0.0) * len(missing)
            unknown += len(missing) if arm not in per_run else 0
            lines.append(
                f"{phase.name:8} {arm:16} {len(seeds[arm]) - len(missing)}/{len(seeds[arm])} finished"
                + (f", ~{per_run[arm] * len(missing) / 60:.0f} min left" if missing and arm in per_run else "")
            )
    lines.append(
        f"left: ~{left_s / 60:.0f} min of training at the arms' finished runs' times (startup not counted)"
        + (f"; {unknown} runs of arms with no finished run yet, not estimated" if unknown else "")
    )
    return lines
