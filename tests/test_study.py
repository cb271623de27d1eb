"""Study specs (analysis.spec) and what fldp-study decides and finds from them: the committed
precision and tokens studies' verdicts, pilot and noise scale again from their per-run numbers, the
seed rule and its budget, a report made again from an earlier one's numbers, and bad specs refused
before anything runs. A spec's pipeline end to end is CI's reduced run (`fldp-study run SPEC
--reduced`, .ci/run)."""

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

from analysis import paper
from analysis.arms import arms_of, overrides_of
from analysis.runs_frame import banked, changed, losses
from analysis.spec import SeedRule, SpecError, load
from analysis.study import findings, judging_seeds, pilot, placed_arms

ROOT = Path(__file__).resolve().parents[1]
PRECISION = ROOT / "experiments" / "precision"
TOKENS = ROOT / "experiments" / "tokens"
FLDP_STUDY = str(Path(sys.executable).parent / "fldp-study")  # the installed command (README's setup)


def committed_precision_runs(study) -> pd.DataFrame:
    """results/runs.csv of the precision study, each run's arm from its run id's overrides."""
    return placed_arms(pd.read_csv(PRECISION / "results" / "runs.csv"), study)


def assert_same_table(new: pd.DataFrame, old: pd.DataFrame, but: tuple[str, ...] = ()) -> None:
    """Every column of `old` but those named: numbers to 1e-9, the rest as text."""
    new, old = new.reset_index(drop=True), old.reset_index(drop=True)
    assert {c for c in new.columns if c in old.columns and c not in but} == {c for c in old.columns if c not in but}
    for column in (c for c in old.columns if c not in but):
        if old[column].dtype.kind == "f":
            np.testing.assert_allclose(new[column].to_numpy(float), old[column].to_numpy(float), rtol=0, atol=1e-9)
        else:
            assert new[column].astype(str).tolist() == old[column].astype(str).tolist(), column


def test_the_precision_spec_finds_the_committed_verdicts_and_pilot_from_the_committed_runs():
    study, values = load(PRECISION), paper.load()
    df = committed_precision_runs(study)
    # the arms the spec names are the columns the study's own module read (algorithm, reductions)
    assert (df["arm"] == df["algorithm"] + np.where(df["reductions"] == "fp32r", "-fp32r", "")).all()
    assert_same_table(findings(df, study, values), pd.read_csv(PRECISION / "results" / "findings.csv"))
    assert_same_table(pilot(df, study, values), pd.read_csv(PRECISION / "results" / "pilot.csv"))


def test_the_tokens_report_made_again_from_its_committed_runs_has_the_committed_numbers(tmp_path):
    """fldp-study report from no run directory but the committed report's per-run numbers
    (--banked): the verdicts, the one-pass exploration and the noise scale the study's own module
    (analysis.tokens, before the port) committed. Its findings.csv has a family column, no block."""
    out = tmp_path / "tokens"
    report_again(TOKENS, out, TOKENS / "results")
    new, results = pd.read_csv(out / "report" / "findings.csv"), TOKENS / "results"
    assert_same_table(new[new["family"] == "primary"], pd.read_csv(results / "findings.csv"), but=("block",))
    assert_same_table(new[new["family"] != "primary"], pd.read_csv(results / "onepass.csv"), but=("block",))
    assert_same_table(pd.read_csv(out / "report" / "noise.csv"), pd.read_csv(results / "noise.csv"))
    report = (out / "report" / "report.md").read_text()
    assert "The noise16 runs that repeat one: 9 runs, 0 identical; the largest relative difference" in report
    rerun = pd.read_csv(out / "report" / "rerun.csv")
    assert len(rerun) == 9 and f"{rerun['relative_difference'].abs().max():.1e}" == "2.0e-04"  # as committed


SENSITIVITY = ROOT / "experiments" / "sensitivity"


def report_again(spec: Path, out: Path, results: Path) -> Path:
    """fldp-study report from no run directory but `results`' per-run numbers (--banked)."""
    proc = subprocess.run(
        [FLDP_STUDY, "report", str(spec), str(out), "--banked", str(results), "--allow-mixed"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    return out / "report"


def test_the_sensitivity_report_made_again_from_its_committed_runs_has_the_committed_numbers(tmp_path):
    """Each setting's family judged alone, FSDP / FL+HSDP also against HSDP's paper value (its
    module's paper_hsdp, size_hsdp), each arm under each setting against its base runs (effects.csv),
    the base runs beside the committed judging runs (rerun.csv): as analysis.sensitivity committed
    them. The committed direction beside each claim is now a table of the report, not a column."""
    results = SENSITIVITY / "results"
    report = report_again(SENSITIVITY, tmp_path / "sensitivity", results)
    new = pd.read_csv(report / "findings.csv").rename(
        columns={"family": "setting", "paper_also": "paper_hsdp", "size_also": "size_hsdp"}
    )
    judged = new[new["setting"].isin(["the paper's lr 3e-4", "clip 1.0 at lr 1e-2"])]
    assert_same_table(
        judged.fillna({"size_hsdp": ""}),
        pd.read_csv(results / "findings.csv").fillna({"size_hsdp": ""}),
        but=("paper_shape_direction", "changed"),
    )
    effects = new[new["setting"] == "what each setting does to each arm"]
    assert_same_table(
        effects[["ratio", "lo", "hi", "seeds"]], pd.read_csv(results / "effects.csv")[["ratio", "lo", "hi", "seeds"]]
    )
    assert_same_table(pd.read_csv(report / "rerun.csv"), pd.read_csv(results / "rerun.csv"))
    assert (report / "report.md").read_text().count("| no |") == 9  # every claim's direction as committed


def test_a_family_waits_for_every_phase_it_reads(tmp_path):
    """The settings are judged before the base phase has run (the plan's amendment 1); the families
    that read base wait for it, and the report says so."""
    results = tmp_path / "results"
    results.mkdir()
    df = pd.read_csv(SENSITIVITY / "results" / "runs.csv")
    df[df["phase"] != "base"].to_csv(results / "runs.csv", index=False)
    (results / "losses.csv.gz").write_bytes((SENSITIVITY / "results" / "losses.csv.gz").read_bytes())
    report = report_again(SENSITIVITY, tmp_path / "sensitivity", results)
    assert set(pd.read_csv(report / "findings.csv")["family"]) == {"the paper's lr 3e-4", "clip 1.0 at lr 1e-2"}
    assert "Not yet: base (phases base); what each setting does to each arm" in (report / "report.md").read_text()


def made_up_runs(phase: str, steps: int, commit: str) -> pd.DataFrame:
    """Three arms on seeds 0-4, each with a run id and a two-step loss curve."""
    rows = [
        {"run": f"{phase}/algorithm={a},seed={s}", "phase": phase, "algorithm": a, "seed": s, "steps": steps}
        for a in ("fsdp", "fl_fsdp", "fl_hsdp")
        for s in range(5)
    ]
    df = pd.DataFrame(rows).assign(commit=commit)
    return df.assign(step=[[1, 2]] * len(df), loss=[[7.0 + s, 6.0 + s] for s in df["seed"]])


def test_a_report_made_again_takes_the_phases_its_runs_lack_from_the_earlier_one(tmp_path):
    earlier = pd.concat([made_up_runs("noise16", 64, "old"), made_up_runs("judge", 32, "old")])
    earlier.drop(columns=["step", "loss"]).to_csv(tmp_path / "runs.csv", index=False)
    losses(earlier, tmp_path)
    now = made_up_runs("judge", 64, "new")
    with pytest.raises(SystemExit) as refused:  # other commits' rows, not asked for
        banked(now, tmp_path, allow_mixed=False)
    assert refused.value.code == 2
    both = banked(now, tmp_path, allow_mixed=True)
    assert len(both) == 30 and set(both[both["commit"] == "old"]["phase"]) == {"noise16"}  # no old judge row
    assert (both[both["phase"] == "judge"]["steps"] == 64).all()
    row = both[(both["phase"] == "noise16") & (both["seed"] == 3)].iloc[0]
    assert row["step"] == [1, 2] and row["loss"] == [10.0, 9.0]  # its curve, read back from losses.csv.gz
    alone = banked(now.iloc[:0], tmp_path, allow_mixed=False)  # no runs: all of the earlier, one commit
    assert len(alone) == 30 and alone.iloc[0]["step"] == [1, 2]


RULE = SeedRule("pilot", "primary", 0.018, 5, budget_s=7200, fallback_seeds=3, fallback_arms=("a-fp32r", "b-fp32r"))


def times(bf16_s: float, fp32r_s: float) -> pd.Series:
    """Each arm's training time per run: two bf16 arms and two fp32r arms, each counted twice (the
    precision study's 8 arms at two times)."""
    return pd.Series({"a": 2 * bf16_s, "b": 2 * bf16_s, "a-fp32r": 2 * fp32r_s, "b-fp32r": 2 * fp32r_s})


def test_the_seeds_are_the_rules_at_least_the_minimum_and_within_the_budget():
    assert set(judging_seeds(RULE, pd.Series([4, 9, 7, 2]), times(60, 60)).values()) == {9}  # 480 s a seed: 15 fit
    assert set(judging_seeds(RULE, pd.Series([2, 3]), times(60, 60)).values()) == {5}  # at least 5
    assert set(judging_seeds(RULE, pd.Series([40]), times(60, 60)).values()) == {15}  # the cap binds
    assert set(
        judging_seeds(SeedRule("pilot", "primary", 0.018, 5, max=7), pd.Series([40]), times(60, 60)).values()
    ) == {7}


def test_a_cap_under_the_minimum_gives_the_fallback_arms_their_seeds_and_the_others_the_rest():
    # one seed of all arms: 4 x 300 + 4 x 200 s = 2000 s, so 3 fit; the fallback arms' 3 seeds take
    # 2400 s, and the 4800 s left give the others (1200 s a seed) 4
    assert judging_seeds(RULE, pd.Series([30]), times(300, 200)) == {"a": 4, "b": 4, "a-fp32r": 3, "b-fp32r": 3}
    assert set(judging_seeds(RULE, pd.Series([30]), times(900, 900)).values()) == {3}  # never under 3


def test_a_verdict_changes_only_where_the_new_study_decides():
    assert changed("reproduced", "opposite") == "yes"
    assert changed("opposite", "opposite") == "no"
    assert changed("inconclusive", "opposite").startswith("undecided")


def spec_with(tmp_path: Path, change) -> Path:
    """The precision spec, changed by `change(dict)`, in a directory of its own."""
    data = yaml.safe_load((PRECISION / "study.yaml").read_text())
    change(data)
    path = tmp_path / "study" / "study.yaml"
    path.parent.mkdir()
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def comparisons_of(data: dict, i: int) -> list:
    return data["families"][i]["comparisons"]


@pytest.mark.parametrize(
    "change, words",
    [
        (lambda d: d.update(arm={}), "unknown key 'arm'"),
        (lambda d: comparisons_of(d, 0)[0].update(den="fl_hsdp-fp16"), "no arm 'fl_hsdp-fp16'"),
        (lambda d: d["families"][1].update(comparisons=[]), "a family of zero"),
        (lambda d: d["families"][0].update(phase="judging"), "'judging' is not a phase"),
        (lambda d: d["arms"].update(fsdp=["algorithm"]), "not a Hydra override KEY=VALUE"),
        (lambda d: d["phases"][0].update(seeds=[200, "b"]), "phases.pilot.seeds: [200, 'b']; a list of integer seeds"),
        (lambda d: d.pop("seed_rule"), "a phase without seeds needs seed_rule"),
        (lambda d: d["phases"][0].update(overides=["x=1"]), "phases.pilot: unknown key 'overides'"),
        (lambda d: d.update(pieces=["noise"]), "pieces: 'noise'; one of noise_scale, reruns"),
        (
            lambda d: d.update(pieces=[{"reruns": {"phase": "judge"}}]),
            "pieces.reruns: arguments phase; it takes phase, of, metric",
        ),
        (lambda d: d["beside"][0].update(rows=[0, 1]), "beside.rows: 2 rows for family primary's 4 comparisons"),
        (
            lambda d: d.update(pieces=[{"drift": {"pairs": [["fsdp", "fsdp-bf16"]]}}]),
            "pieces.drift: no arm 'fsdp-bf16'",
        ),
        (lambda d: d.update(pieces=[{"by_lr": {"families": ["primry"]}}]), "pieces.by_lr: 'primry' is not a family"),
        (lambda d: d["families"][0].update(metric="loss"), "families.primary.metric: 'loss'; one of eval_perplexity"),
    ],
)
def test_a_bad_spec_is_refused_naming_the_key_and_the_fix(tmp_path, change, words):
    with pytest.raises(SpecError) as e:
        load(spec_with(tmp_path, change))
    assert words in str(e.value)


def test_fldp_study_exits_2_on_a_bad_spec_before_anything_runs(tmp_path):
    spec = spec_with(tmp_path, lambda d: comparisons_of(d, 0)[0].update(den="fl_hsdp-fp16"))
    out = tmp_path / "out"
    proc = subprocess.run([FLDP_STUDY, "run", str(spec), str(out), "--reduced"], capture_output=True, text=True)
    assert proc.returncode == 2 and "no arm 'fl_hsdp-fp16' (the arms: " in proc.stderr, proc.stderr
    assert "add it under arms or fix the name" in proc.stderr and not out.exists()


def test_every_problem_of_a_spec_is_named_at_once(tmp_path):
    def two(d):
        d.pop("target")
        comparisons_of(d, 2)[1].update(num="nope")

    with pytest.raises(SpecError) as e:
        load(spec_with(tmp_path, two))
    assert "target" in str(e.value) and "no arm 'nope'" in str(e.value)


def test_a_study_run_under_another_spec_is_refused_unless_asked(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "study.json").write_text('{"study": "precision", "sha256": "0123456789ab"}\n')
    proc = subprocess.run([FLDP_STUDY, "run", str(PRECISION), str(out), "--reduced"], capture_output=True, text=True)
    assert proc.returncode == 2 and "--allow-changed-spec" in proc.stderr, proc.stderr
    assert sorted(p.name for p in out.iterdir()) == ["study.json"]


def test_every_run_records_its_specs_hash_and_a_report_refuses_other_hashes_unless_asked(tmp_path):
    from analysis.study_run import RUN_STAMP, changed_runs, stamp_runs

    study, out = load(PRECISION), tmp_path / "out"
    for name, sha in (("old", "0123456789ab"), ("new", None), ("running", None)):
        run = out / "runs" / "judge" / name
        run.mkdir(parents=True)
        if name != "running":  # a run still going has no summary.json, and no stamp yet
            (run / "summary.json").write_text("{}")
        if sha:
            (run / RUN_STAMP).write_text(json.dumps({"study": "precision", "sha256": sha}))
    stamp_runs(study, out / "runs" / "judge")
    stamped = {p.parent.name: json.loads(p.read_text())["sha256"] for p in out.glob(f"runs/judge/*/{RUN_STAMP}")}
    assert stamped == {"old": "0123456789ab", "new": study.sha256}
    assert changed_runs(study, out) == {"0123456789ab": 1}
    proc = subprocess.run([FLDP_STUDY, "report", str(PRECISION), str(out)], capture_output=True, text=True)
    assert proc.returncode == 2 and "1 under sha256 0123456789ab" in proc.stderr, proc.stderr
    assert "--allow-changed-spec" in proc.stderr and not (out / "report").exists()


def test_until_names_a_phase_of_the_spec(tmp_path):
    proc = subprocess.run(
        [FLDP_STUDY, "run", str(PRECISION), str(tmp_path / "out"), "--until", "tune"], capture_output=True, text=True
    )
    assert proc.returncode == 2 and "--until tune: not a phase of precision (pilot, judge)" in proc.stderr


def test_the_example_spec_in_the_docs_is_a_valid_spec(tmp_path):
    text = (ROOT / "docs" / "studies.md").read_text()
    section = text[text.index("## Writing a study") :]
    example = section[section.index("```yaml\n") + 8 : section.index("```", section.index("```yaml\n") + 8)]
    (tmp_path / "study.yaml").write_text(example)
    study = load(tmp_path)
    assert [p.name for p in study.phases] == ["pilot", "judge"] and len(study.families[0].comparisons) == 1


def test_a_run_directorys_overrides_name_its_arm_the_most_specific_one():
    study = load(PRECISION)
    point = "+experiment=precision,algorithm.outer.reduce_dtype=fp32,algorithm=fl_hsdp,fsdp.reduce_dtype=fp32,seed=3"
    assert arms_of(overrides_of(point), study, "judge", {}) == ["fl_hsdp-fp32r"]
    assert arms_of(overrides_of("+experiment=precision,algorithm=fl_hsdp,seed=3"), study, "judge", {}) == ["fl_hsdp"]
    listed = "algorithm=hsdp,seed=0,topology.network=[{tier:node,ranks:4},{tier:x,ranks:8}]"
    assert overrides_of(listed) == {
        "algorithm=hsdp",
        "seed=0",
        "topology.network=[{tier:node,ranks:4},{tier:x,ranks:8}]",
    }
    assert arms_of(overrides_of("algorithm=diloco,seed=0"), study, "judge", {}) == ["?"]


def test_every_piece_a_spec_may_name_is_a_section_taking_the_arguments_the_spec_checks():
    import inspect

    from analysis.pieces import SECTIONS
    from analysis.spec import PIECES

    assert set(PIECES) == set(SECTIONS)
    for name, args in PIECES.items():
        assert tuple(inspect.signature(SECTIONS[name]).parameters)[3:] == args, name


PAPER_SHAPE = ROOT / "experiments" / "paper_shape"


def paper_shape_runs() -> pd.DataFrame:
    """results/runs.csv of the paper-shape study (its module's: no run ids), each run's id as its
    runner named its directory, from its phase, algorithm, lr and seed."""
    df = pd.read_csv(PAPER_SHAPE / "results" / "runs.csv")
    df["run"] = [
        f"{p}/algorithm={a},optimizer.lr={lr:g},seed={s}"
        for p, a, lr, s in df[["phase", "algorithm", "lr", "seed"]].itertuples(index=False)
    ]
    return df.assign(**{"optimizer.lr": df["lr"]})


def test_the_paper_shape_spec_finds_the_committed_lrs_pilot_and_verdicts_from_the_committed_runs():
    """The tune phase's table and choices, the pilot's SDs and the two families (each arm's chosen lr;
    FSDP's for all), as analysis/paper_shape.py committed them (its pilot had HSDP's row apart, before
    the plan's amendment 3; the spec's pilot is the family's three)."""
    from analysis.arms import choices, tuning
    from analysis.study import decide, placed_arms

    study, values = load(PAPER_SHAPE), paper.load()
    df = placed_arms(paper_shape_runs(), study)
    table = tuning(df, study)
    committed = pd.read_csv(PAPER_SHAPE / "results" / "tuning.csv", index_col=0)
    np.testing.assert_allclose(table.to_numpy(), committed.to_numpy(), rtol=0, atol=1e-9)
    assert choices(table, study) == ({"fl_fsdp": 0.01, "fl_hsdp": 0.01, "fsdp": 0.01}, {})
    assert decide(df, study, values).seeds == {"fl_fsdp": 20, "fl_hsdp": 20, "fsdp": 20}  # amendment 1: at most 20
    # where the chosen lrs agree, the shared-lr arms are the chosen arms' runs
    assert set(df[df["run"] == "judge/algorithm=fl_fsdp,optimizer.lr=0.01,seed=3"]["arm"]) == {
        "fl_fsdp",
        "fl_fsdp-shared",
    }
    old_pilot = pd.read_csv(PAPER_SHAPE / "results" / "pilot.csv").iloc[1:]  # FSDP's, FL+FSDP's, FL+FSDP / FL+HSDP
    assert_same_table(pilot(df, study, values), old_pilot, but=("claim",))
    new = findings(df, study, values).rename(
        columns={"family": "setting", "paper_also": "paper_hsdp", "size_also": "size_hsdp"}
    )
    old = pd.read_csv(PAPER_SHAPE / "results" / "findings.csv")
    assert_same_table(new.fillna({"size_hsdp": ""}), old.fillna({"size_hsdp": ""}), but=("setting",))


def test_the_tune_rule_extends_a_grid_edge_once_and_arms_take_the_chosen_values():
    from analysis.arms import arms_of, choices, resolved, tuning

    study = load(PAPER_SHAPE)
    rows = [
        {
            "phase": "tune",
            "arm": a,
            "seed": s,
            "optimizer.lr": lr,
            "eval_perplexity": 100 * (1 + abs(math.log10(lr) + (1 if a == "fsdp" else 2))) + s,
        }
        for a in ("fsdp", "fl_fsdp", "fl_hsdp")
        for s in (100, 101)
        for lr in (1e-3, 3e-3, 1e-2, 3e-2, 1e-1)
    ]
    chosen, extend = choices(tuning(pd.DataFrame(rows), study), study)
    assert chosen == {"fl_fsdp": 1e-2, "fl_hsdp": 1e-2, "fsdp": 0.1} and extend == {"fsdp": 0.316}  # past the top
    rows += [{**rows[0], "optimizer.lr": 0.316, "eval_perplexity": 90.0, "seed": s} for s in (100, 101)]
    chosen, extend = choices(tuning(pd.DataFrame(rows), study), study)
    assert chosen["fsdp"] == 0.316 and extend == {}  # extended once, never again
    arms = resolved(study, "judge", chosen)
    assert arms["fl_hsdp-shared"] == ["algorithm=fl_hsdp", "optimizer.lr=0.316"]  # FSDP's lr
    assert arms_of({"algorithm=fl_hsdp", "optimizer.lr=1e-2", "seed=0"}, study, "judge", chosen) == ["fl_hsdp"]
    assert arms_of({"algorithm=fl_hsdp", "optimizer.lr=0.316", "seed=0"}, study, "judge", chosen) == ["fl_hsdp-shared"]
    assert arms_of({"algorithm=fsdp", "optimizer.lr=0.003", "seed=100"}, study, "tune", {}) == ["fsdp"]


def test_a_run_that_is_two_arms_is_one_row_of_runs_csv_and_its_losses_once(tmp_path):
    """The report's runs.csv and losses.csv.gz: one row per run (two arms joined by "+": the
    paper-shape study's fl_fsdp and fl_fsdp-shared where the lrs agree), every step of every run
    once, keyed by the run's directory from its phase on (no machine path)."""
    from analysis.records import Run
    from analysis.study import frame
    from analysis.study_report import report

    study, steps, made = load(PAPER_SHAPE), 4, []
    points = [("tune", a, 100, lr) for a in ("fsdp", "fl_fsdp", "fl_hsdp") for lr in (1e-2, 3e-2)]
    points += [("judge", a, s, 1e-2) for a in ("fsdp", "fl_fsdp", "fl_hsdp") for s in (0, 1)]
    for phase, a, seed, lr in points:
        summary = {
            "algorithm": a, "seed": seed, "precision": "fp32", "federation": 1, "replicate": 1, "shard": 4,
            "batch_size": 2, "steps": steps, "eval_loss": 6.0 + seed / 1000 + (lr == 3e-2) + len(a) / 100,
            "eval_perplexity": math.exp(6.0 + seed / 1000 + (lr == 3e-2) + len(a) / 100), "train_time_s": 1.0,
        }  # fmt: skip
        losses_ = pd.DataFrame({"step": range(1, steps + 1), "loss": [8.0 - i / 7 - seed / 1000 for i in range(steps)]})
        made.append(
            Run(
                f"/machine/out/runs/{phase}/algorithm={a},optimizer.lr={lr:g},seed={seed}",
                summary,
                losses_,
                {"optimizer.lr": lr},
            )
        )
    df = frame(made, study)
    assert len(df) == len(made) + 4  # judge: fl_fsdp and fl_hsdp are their shared-lr arms too, at FSDP's 1e-2
    report(df, study, paper.load(), tmp_path, "test", None, tmp_path / "runs")
    got = pd.read_csv(tmp_path / "losses.csv.gz")
    assert len(got) == steps * len(made) and got["run"].nunique() == len(made)
    assert not got["run"].str.startswith("/").any()
    runs_csv = pd.read_csv(tmp_path / "runs.csv")
    assert len(runs_csv) == len(made) and "fl_fsdp+fl_fsdp-shared" in set(runs_csv["arm"])


SCIENCE = ROOT / "experiments" / "science"


def science_runs(study) -> pd.DataFrame:
    """experiments/science/runs.csv (its module's: every run's path as the old runner named it, no
    phase; `every` and `update_batch` for the frame's A and sequences_per_group), each run's phase and
    id from its path (OUT/runs/PART/<the point's overrides>), and no training losses (none committed)."""
    df = pd.read_csv(SCIENCE / "runs.csv").rename(columns={"every": "A", "update_batch": "sequences_per_group"})
    df["phase"] = [Path(r).parts[-2] for r in df["run"]]
    df["run"] = ["/".join(Path(r).parts[-2:]) for r in df["run"]]
    return placed_arms(df.assign(step=[[]] * len(df), loss=[[]] * len(df)), study)


PRIMARY = "primary: fp32, shared lr 0.01"  # the old findings.csv: setting "fp32, shared lr 0.01"


def test_the_science_report_made_again_from_its_committed_runs_has_the_committed_numbers(tmp_path):
    """The tiny study's spec (experiments/science/study.yaml) on its committed per-run numbers: every
    finding (the judged primary family, the explored lrs, bf16, best lrs and time claims), the claims
    by lr, the lr table, the frontier and the batch controls as analysis/science.py committed them;
    drift.csv's ratios (its training-loss columns need the per-step losses, which were not committed)."""
    from analysis.study_report import report

    study = load(SCIENCE)
    df = science_runs(study)
    assert df["run"].nunique() == 126 and (df["arm"] != "?").all() and not df["run"].duplicated().any()
    out = tmp_path / "report"
    report(df, study, paper.load(), out, "test", None, tmp_path / "runs")
    new = pd.read_csv(out / "findings.csv")
    old = pd.read_csv(SCIENCE / "findings.csv")
    new["setting"] = new["family"].replace({PRIMARY: "fp32, shared lr 0.01"})
    assert len(new) == len(old) == 28 and set(new["setting"]) == set(old["setting"])  # best lr now after the times
    new, old = new.set_index(["setting", "claim"]), old.set_index(["setting", "claim"])
    old = old.loc[new.index]
    wording = ("family", "comparison", "runs [CI]")  # the old family (primary/exploratory) is the level's
    assert_same_table(new.reset_index(), old.reset_index(), but=wording)
    for name in ("findings_by_lr", "lr", "frontier", "batch_control"):
        assert_same_table(pd.read_csv(out / f"{name}.csv"), pd.read_csv(SCIENCE / f"{name}.csv"))
    losses_ = [c for c in pd.read_csv(SCIENCE / "drift.csv").columns if "train-loss" in c or "last step" in c]
    assert_same_table(pd.read_csv(out / "drift.csv"), pd.read_csv(SCIENCE / "drift.csv"), but=tuple(losses_))


def test_an_interrupted_run_is_set_aside_to_be_made_again_and_a_finished_or_resumable_one_is_left(tmp_path):
    """A run cut off part-way (the session or the machine ended: records, no summary.json, no
    checkpoint) would be refused by fldp.train as another run's directory, and the study would
    decide from a grid with a hole (the ladder's tuning, 2026-12-07): it is moved aside instead."""
    from analysis.study_run import set_aside_unfinished

    phase = tmp_path / "runs" / "tune"
    for name, files in {
        "cut": ["metrics.jsonl"],
        "done": ["metrics.jsonl", "summary.json"],
        "resumable": ["metrics.jsonl", "checkpoints/step_4/x"],
        "never_stepped": [".hydra/config.yaml"],
    }.items():
        for f in files:
            (phase / name / f).parent.mkdir(parents=True, exist_ok=True)
            (phase / name / f).write_text("{}")
    assert set_aside_unfinished(tmp_path, "tune") == [tmp_path / "interrupted" / "tune" / "cut"]
    assert sorted(p.name for p in phase.iterdir()) == ["done", "never_stepped", "resumable"]
    (phase / "cut").mkdir()
    (phase / "cut" / "metrics.jsonl").write_text("{}")  # cut off again: kept beside the first
    (again,) = set_aside_unfinished(tmp_path, "tune")
    assert again.name.startswith("cut@") and (tmp_path / "interrupted" / "tune" / "cut").is_dir()


def test_a_phase_whose_run_failed_stops_the_study_before_the_phases_decided_from_it(tmp_path, monkeypatch, capsys):
    from types import SimpleNamespace

    from analysis import study_run

    issued: list[list[str]] = []

    def failing(cmd, **kw):
        issued.append(cmd)
        return subprocess.CompletedProcess(cmd, 1)

    monkeypatch.setattr(study_run.subprocess, "run", failing)
    decided = SimpleNamespace(seeds={"a": 2}, chosen={}, extend={})
    study = load(PRECISION)  # pilot, then judge on the seeds the pilot decides
    status = study_run.run(study, tmp_path, True, None, [], lambda out: decided)
    assert status == 1 and issued, issued
    assert all("hydra.sweep.dir=" + str(tmp_path / "runs" / "pilot") in cmd for cmd in issued), issued
    assert "the phases after it are not run" in capsys.readouterr().err


def test_status_times_what_is_left_from_the_arms_runs_in_any_phase_and_counts_the_rest_apart(tmp_path):
    """The ladder's status said "left: ~9 min" with 48 runs of rungs not begun: an arm with no
    finished run in a phase was estimated at zero. Its tuning runs time its judging ones, and runs
    of an arm with none finished anywhere are counted, not estimated."""
    from types import SimpleNamespace

    from analysis.study_run import status_lines

    study = load(ROOT / "experiments" / "ladder")
    point = "+experiment=paper_shape,algorithm=fsdp,dataset=english_pd,model=tiny_llama,optimizer.lr=0.003"
    run = tmp_path / "runs" / "tune-small" / f"{point},seed=100,trainer.precision=fp32,trainer.steps=64"
    run.mkdir(parents=True)
    (run / "summary.json").write_text(json.dumps({"seed": 100, "train_time_s": 600.0}))
    decided = SimpleNamespace(seeds={}, chosen={"fsdp-l0": 0.003})
    lines = status_lines(study, tmp_path, False, decided)
    assert any(line.split()[:2] == ["judge-small", "fsdp-l0"] and "~50 min left" in line for line in lines), lines
    unbegun = 7 * 1 + 7 * 5 + 2 * (4 * 1 + 4 * 5)  # the small rungs' other arms, then l2 and l3
    assert lines[-1].startswith("left: ~50 min") and f"; {unbegun} runs of arms with no finished" in lines[-1]


LADDER = ROOT / "experiments" / "ladder"


def test_a_study_run_with_banked_runs_makes_only_the_points_the_committed_report_lacks(tmp_path, monkeypatch):
    """The ladder's OUT did not survive to a new machine: run with --banked RESULTS makes none of
    the committed runs again (the tuning ones included), and the judging arms take the lr the
    committed tuning runs chose. RESULTS: the committed report less three judging runs (so the test
    does not depend on how far the study has got); expected points read from runs.csv's columns."""
    from analysis import study_run
    from analysis.study_cli import banked_runs, decider

    study = load(LADDER)
    results = tmp_path / "results"
    results.mkdir()
    committed = pd.read_csv(LADDER / "results" / "runs.csv")
    judged = committed[committed["phase"] == "judge-small"]
    dropped = judged[(judged["model"] == "ladder_1") & judged["seed"].isin([3, 4])].head(3)
    assert len(dropped) == 3
    committed.drop(index=dropped.index).to_csv(results / "runs.csv", index=False)
    (results / "losses.csv.gz").write_bytes((LADDER / "results" / "losses.csv.gz").read_bytes())
    issued: list[list[str]] = []

    def recorded(cmd, **kw):
        issued.append(cmd)
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(study_run.subprocess, "run", recorded)
    points = study_run.banked_points(banked_runs(study, results), study)
    assert len(points) == len(committed) - 3
    (tmp_path / "out").mkdir()  # fldp-study's stamp makes it first
    status = study_run.run(study, tmp_path / "out", False, "judge-small", [], decider(study, results), points)
    assert status == 0
    made = set()
    lrs = {"fsdp": "0.003", "diloco_hsdp": "0.003", "fl_fsdp": "0.01", "fl_hsdp": "0.03"}  # the report's choice
    for cmd in issued:
        assert "hydra.sweep.dir=" + str(tmp_path / "out" / "runs" / "judge-small") in cmd, cmd  # tune-small: banked
        values = dict(o.split("=", 1) for o in cmd if "=" in o and not o.startswith("hydra."))
        made |= {
            (values["model"], a, int(s)) for a in values["algorithm"].split(",") for s in values["seed"].split(",")
        }
        assert {lrs[a] for a in values["algorithm"].split(",")} == {values["optimizer.lr"]}, cmd
    assert made == set(zip(dropped["model"], dropped["algorithm"], dropped["seed"]))


def test_banked_runs_made_under_another_spec_are_refused_before_anything_runs(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    for name in ("runs.csv", "losses.csv.gz"):
        (results / name).write_bytes((LADDER / "results" / name).read_bytes())
    report = (LADDER / "results" / "report.md").read_text()
    (results / "report.md").write_text(report.replace(load(LADDER).sha256[:12], "0123456789ab"))
    refused = subprocess.run(
        [FLDP_STUDY, "run", str(LADDER), str(tmp_path / "out"), "--banked", str(results)],
        capture_output=True,
        text=True,
    )
    assert refused.returncode == 2 and "sha256 0123456789ab" in refused.stderr, refused.stderr
    assert not (tmp_path / "out").exists()
    shown = subprocess.run(
        [FLDP_STUDY, "status", str(LADDER), str(tmp_path / "out"), "--banked", str(LADDER / "results")],
        capture_output=True,
        text=True,
    )
    assert shown.returncode == 0, shown.stderr
    line = next(x for x in shown.stdout.splitlines() if x.split()[:2] == ["judge-small", "fsdp-l0"])
    assert "5/5 finished" in line, shown.stdout


def test_status_times_what_is_left_from_the_median_run_so_a_run_paused_part_way_does_not_swell_it(tmp_path):
    """The ladder's committed runs hold one judging run of 8,198 s (the study paused while CI ran)
    among runs of 60-250 s: a mean made the estimate of what is left hours too long."""
    from types import SimpleNamespace

    from analysis.study_run import status_lines

    study = load(LADDER)
    point = "+experiment=paper_shape,algorithm=fsdp,dataset=english_pd,model=tiny_llama,optimizer.lr=0.003"
    for seed, seconds in ((0, 600.0), (1, 600.0), (2, 60000.0)):
        run = tmp_path / "runs" / "judge-small" / f"{point},seed={seed},trainer.precision=fp32"
        run.mkdir(parents=True)
        (run / "summary.json").write_text(json.dumps({"seed": seed, "train_time_s": seconds}))
    lines = status_lines(study, tmp_path, False, SimpleNamespace(seeds={}, chosen={"fsdp-l0": 0.003}))
    assert any(
        line.split()[:2] == ["judge-small", "fsdp-l0"] and "3/5 finished, ~20 min left" in line for line in lines
    ), lines
