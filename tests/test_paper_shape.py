"""The verdict rules every study shares (analysis.stats: Holm, direction, size, seeds) against hand
computations, and the paper-shape study's decisions (analysis.paper_shape) on made-up runs."""

import math

import pandas as pd
import pytest

from analysis import paper as paper_values
from analysis.paper_shape import chosen_lrs, decide, findings, tuning
from analysis.stats import Claim, direction, holm_levels, judge, paired_ratio, seeds_for, size


def test_holm_levels_step_down_then_bonferroni():
    # ranked: 0.005 (< 0.05/4 rejected), 0.01 (< 0.05/3 rejected), 0.03 (not < 0.05/2: stops), 0.04
    levels = holm_levels([0.01, 0.04, 0.03, 0.005])
    assert levels == pytest.approx([1 - 0.05 / 3, 1 - 0.05 / 4, 1 - 0.05 / 2, 1 - 0.05 / 4])
    assert holm_levels([0.001, 0.002]) == pytest.approx([1 - 0.025, 1 - 0.05])  # all rejected: the last at 5%


def test_seeds_for_a_half_width_matches_the_t_table():
    # t(0.975, 31) = 2.0395: 2.0395 * 0.05 / sqrt(32) = 0.01803 > log(1.018) = 0.01784; t(0.975, 32) =
    # 2.0369: 2.0369 * 0.05 / sqrt(33) = 0.01773 <= 0.01784
    assert seeds_for(0.05, 0.018) == 33
    assert seeds_for(0.001, 0.02) == 2


def test_direction_and_size_read_the_interval_not_the_mean():
    seeds = range(6)
    b = pd.Series([100.0] * 6, index=seeds)
    up = paired_ratio(b * pd.Series([1.10, 1.12, 1.09, 1.11, 1.10, 1.12], index=seeds), b)
    assert direction(up, 1.9) == "reproduced" and direction(up, 0.5) == "opposite"
    assert size(up, 1.9) == "effect size refuted at this scale" and size(up, 1.105) == "paper's value inside"
    noisy = paired_ratio(b * pd.Series([1.3, 0.8, 1.25, 0.85, 1.2, 0.9], index=seeds), b)
    assert noisy.ratio > 1 and direction(noisy, 1.9) == "inconclusive"  # a mean above 1 is no verdict
    two = paired_ratio(b.iloc[:2] * 1.5, b.iloc[:2])
    assert direction(two, 1.5) == "n/a (too few seeds)" and size(two, 1.5) == "n/a"  # every seed agrees: no verdict


def test_judge_widens_intervals_for_the_family():
    seeds = range(8)
    b = pd.Series([100.0] * 8, index=seeds)
    noise = pd.Series([1.0, 1.02, 0.99, 1.01, 0.98, 1.03, 1.0, 0.97], index=seeds)
    claims = [Claim("strong", b * 1.5 * noise, b, 1.5), Claim("weak", b * 1.015 * noise, b, 1.5)]
    t = judge(claims).set_index("claim")
    alone = paired_ratio(b * 1.015 * noise, b)
    assert t.loc["strong", "level"] == pytest.approx(1 - 0.05 / 2) == t.loc["weak", "level"]  # Bonferroni
    assert t.loc["strong", "direction_level"] == pytest.approx(1 - 0.05 / 2)  # Holm: ranked first of 2
    assert t.loc["weak", "hi"] - t.loc["weak", "lo"] >= alone.high - alone.low  # never narrower than 95%
    assert t.loc["strong", "direction"] == "reproduced" and t.loc["strong", "size"] == "paper's value inside"


def runs(rows):
    return pd.DataFrame(
        [
            {
                "loss": [1.0],
                "eval_loss": math.log(r[4]),
                **dict(zip(("phase", "algorithm", "seed", "lr", "eval_perplexity"), r)),
            }
            for r in rows
        ]
    )


def test_the_plans_lr_rule_extends_a_grid_edge_once():
    rows = [
        ("tune", a, s, lr, 100 * (1 + abs(math.log10(lr) + (1 if a == "fsdp" else 2))) + s)
        for a in ("fsdp", "fl_fsdp", "fl_hsdp")
        for s in (100, 101)
        for lr in (1e-3, 3e-3, 1e-2, 3e-2, 1e-1)
    ]
    chosen, extend = chosen_lrs(tuning(runs(rows)))
    assert chosen == {"fsdp": 0.1, "fl_fsdp": 1e-2, "fl_hsdp": 1e-2}
    assert extend == {"fsdp": pytest.approx(0.1 * math.sqrt(10))}  # FSDP's best is the grid's top
    rows += [("tune", "fsdp", s, 0.316, 90.0) for s in (100, 101)]
    chosen, extend = chosen_lrs(tuning(runs(rows)))
    assert chosen["fsdp"] == 0.316 and extend == {}  # extended once, never again


def test_decide_and_findings_on_made_up_runs():
    paper = paper_values.load(None)
    lrs = {"fsdp": 1e-2, "fl_fsdp": 3e-3, "fl_hsdp": 1e-2}
    ppl = {"fsdp": 500.0, "fl_fsdp": 520.0, "fl_hsdp": 480.0}
    rows = [
        ("tune", a, s, lr, ppl[a] * (1 if lr == lrs[a] else 1.2))
        for a in lrs
        for s in (100, 101)
        for lr in (1e-3, 3e-3, 1e-2, 3e-2)
    ]
    jitter = [1.0, 1.01, 0.99, 1.02, 0.98]
    rows += [
        ("pilot", a, 200 + i, lrs[a], ppl[a] * j * (1.01 if a == "fl_hsdp" else 1))
        for a in lrs
        for i, j in enumerate(jitter)
    ]
    df = runs(rows)
    lines = decide(df, None, paper)
    assert "lr_fsdp=0.01" in lines and "lr_fl_fsdp=0.003" in lines
    seeds = int([x for x in lines if x.startswith("seeds=")][0].split("=")[1])
    assert seeds >= 10
    df = pd.concat(
        [
            df,
            runs(
                [
                    ("judge", a, s, lr, ppl[a] * jitter[s % 5] * (1 + 0.002 * (s % 3)))
                    for a in lrs
                    for s in range(12)
                    for lr in {lrs[a], lrs["fsdp"]}
                ]
            ),
        ]
    )
    f = findings(df, lrs, paper)
    assert list(f.columns[:9]) == ["claim", "setting", "ratio", "lo", "hi", "level", "paper", "direction", "size"]
    primary = f[f["setting"].str.contains("primary")].set_index("claim")
    assert primary.loc["FL+FSDP reaches a lower perplexity than FSDP", "direction"] == "opposite"  # 500 / 520
    assert (
        primary.loc["FL+HSDP reaches a lower perplexity than FSDP (= HSDP)", "size"]
        == "effect size refuted at this scale"
    )


def test_the_judging_seeds_are_capped_as_the_amendment_says():
    """Amendment 1 of the plan: N is the largest need, at least 10, at most 20 (the pilot asked for
    109-1,272 seeds)."""
    from analysis.paper_shape import judging_seeds

    assert judging_seeds(pd.Series([3, 7])) == 10
    assert judging_seeds(pd.Series([12, 15])) == 15
    assert judging_seeds(pd.Series([528, 1272, 109])) == 20


def test_rejudge_rederives_the_verdicts_from_runs_csv_at_the_simultaneous_level(tmp_path):
    """--rejudge (issue 30): findings.csv and report.md's verdicts again from a report's runs.csv,
    the shown intervals at the Bonferroni 1 - 0.05 / 3 (a family of 3: amendment 3), the rest of
    report.md kept."""
    from analysis.paper_shape import main

    ppl = {"fsdp": 500.0, "fl_fsdp": 560.0, "fl_hsdp": 480.0}
    jitter = [1.0, 1.03, 0.97, 1.02, 0.98]
    rows = [
        ("tune", a, s, lr, ppl[a] * (1 if lr == 1e-2 else 1.3))
        for a in ppl
        for s in (100, 101)
        for lr in (3e-3, 1e-2, 3e-2)
    ]
    rows += [("judge", a, s, 1e-2, ppl[a] * jitter[(s + len(a)) % 5]) for a in ppl for s in range(10)]
    runs(rows).drop(columns=["loss"]).to_csv(tmp_path / "runs.csv", index=False)
    (tmp_path / "report.md").write_text("# kept\n\n## Verdicts\n\nold table\n\n## The plan\n\n> old\n")
    assert main(["--rejudge", str(tmp_path)]) == 0
    f = pd.read_csv(tmp_path / "findings.csv")
    assert len(f) == 6 and list(f["level"]) == pytest.approx([1 - 0.05 / 3] * 6)
    assert sorted(f["direction_level"].head(3)) != [1 - 0.05 / 3] * 3  # Holm's step-down for the direction
    text = (tmp_path / "report.md").read_text()
    assert text.startswith("# kept\n") and "old table" not in text and "> old" not in text
    assert "at 0.9833" in text and "The plan's amendment 2" in text and "amendment 3" in text
    with pytest.raises(SystemExit) as exit_:
        main(["--rejudge", str(tmp_path / "nothing")])
    assert exit_.value.code == 2


def judged_runs(ppl: dict, seeds: int = 12) -> pd.DataFrame:
    """Made-up tuning and judging runs, every arm best at lr 1e-2, FSDP noisier than the FL arms."""
    rows = [
        ("tune", a, s, lr, ppl[a] * (1 if lr == 1e-2 else 1.3))
        for a in ppl
        for s in (100, 101)
        for lr in (3e-3, 1e-2, 3e-2)
    ]
    noise = [1.0, 1.05, 0.95, 1.03, 0.97, 1.02]
    rows += [
        ("judge", a, s, 1e-2, ppl[a] * (noise[s % 6] if a == "fsdp" else 1 + 0.002 * (s % 3)))
        for a in ppl
        for s in range(seeds)
    ]
    return runs(rows)


def test_hsdp_and_fsdp_are_one_test_in_a_family_of_three():
    """Issue 33 (the plan's amendment 3): in the simulator HSDP's runs are FSDP's, so the paper's
    claims against HSDP and against FSDP are one test; the family has 3, Holm steps over 3, and the
    one interval is read against both of the paper's values (FSDP's 1.90, HSDP's 4.48)."""
    paper = paper_values.load(None)
    df = judged_runs({"fsdp": 500.0, "fl_fsdp": 560.0, "fl_hsdp": 480.0})
    primary = findings(df, {"fsdp": 1e-2, "fl_fsdp": 1e-2, "fl_hsdp": 1e-2}, paper)
    primary = primary[primary["setting"].str.contains("primary")]
    assert len(primary) == 3 and list(primary["level"]) == pytest.approx([1 - 0.05 / 3] * 3)
    assert sorted(primary["direction_level"]) == pytest.approx([0.95, 1 - 0.05 / 2, 1 - 0.05 / 3])  # all rejected
    merged = primary[primary["claim"].str.contains("HSDP\\)", regex=True)]
    assert len(merged) == 1 and merged["claim"].iloc[0].startswith("FL+HSDP reaches a lower perplexity than FSDP")
    row = merged.iloc[0]
    assert row["paper"] == pytest.approx(1.90, abs=0.01) and row["paper_hsdp"] == pytest.approx(4.48, abs=0.01)
    assert row["size_hsdp"] == "effect size refuted at this scale"  # 500 / 480 is far from 4.48
    assert primary["paper_hsdp"].isna().sum() == 2  # no other claim stands for HSDP


def test_the_report_writes_every_runs_loss_at_every_step(tmp_path):
    """losses.csv.gz (issue 33): the study's report holds each run's training loss at each step,
    one row per step per run, keyed by the run's directory from its phase on (no machine path);
    the reduced study's shape: 4 steps, runs in every phase."""
    from analysis.paper_shape import LOSSES, frame, report
    from analysis.records import Run

    steps, made = 4, []
    for phase, a, seed, lr in [
        *[("tune", a, 100, lr) for a in ("fsdp", "fl_fsdp", "fl_hsdp") for lr in (1e-2, 3e-2)],
        ("hsdp", "hsdp", 0, 1e-2),
        *[
            (ph, a, s, 1e-2)
            for ph, ss in (("pilot", (200, 201)), ("judge", (0, 1)))
            for a in ("fsdp", "fl_fsdp", "fl_hsdp")
            for s in ss
        ],
    ]:
        summary = {
            "algorithm": a, "seed": seed, "precision": "fp32", "federation": 1, "replicate": 1, "shard": 4,
            "batch_size": 2, "steps": steps, "eval_loss": 6.0 + seed / 1000, "eval_perplexity": math.exp(6.0 + seed / 1000),
            "train_time_s": 1.0,
        }  # fmt: skip
        losses = pd.DataFrame(
            {"step": range(1, steps + 1), "loss": [8.0 - i / 7 - seed / 1000 - lr for i in range(steps)]}
        )
        name = f"/machine/out/runs/{phase}/algorithm={a},optimizer.lr={lr:g},seed={seed}"
        made.append(Run(name, summary, losses, {"optimizer.lr": lr}))
    report(frame(made), paper_values.load(None), tmp_path, "test", None)
    got = pd.read_csv(tmp_path / LOSSES)
    assert list(got.columns) == ["run", "phase", "algorithm", "lr", "seed", "step", "loss"]
    assert len(got) == steps * len(made)
    assert all(s == [1, 2, 3, 4] for s in got.groupby("run")["step"].apply(list))  # in step order
    assert got["run"].nunique() == len(made) and not got["run"].str.startswith("/").any()
    one = got[got["run"] == "judge/algorithm=fl_hsdp,optimizer.lr=0.01,seed=1"]
    assert list(one["loss"]) == pytest.approx([8.0 - i / 7 - 0.001 - 0.01 for i in range(steps)], abs=0)
    runs_csv = pd.read_csv(tmp_path / "runs.csv")
    assert len(runs_csv) == len(made) and "loss" not in runs_csv and set(runs_csv["run"]) == set(got["run"])
