"""The sensitivity study's comparisons (experiments/sensitivity/PLAN.md), as analysis.sensitivity
makes them, on made-up runs; its pipeline end to end is CI's reduced run
(experiments/sensitivity.sh --reduced)."""

import math

import pandas as pd

from analysis import paper as paper_values
from analysis.paper_shape import committed
from analysis.sensitivity import NOT_YET, effects, findings, report, rerun, rerun_summary

ARMS = ("fsdp", "fl_fsdp", "fl_hsdp")


def made_up(phase: str, seeds: int, scale: dict) -> pd.DataFrame:
    """Runs of one phase: arm a, seed s ends at 100 * scale[a] * (1 + 0.01 * s) (the seed's spread
    shared by every arm, so the paired ratios are exact)."""
    rows = [
        {"phase": phase, "algorithm": a, "seed": s, "eval_perplexity": 100 * scale[a] * (1 + 0.01 * s)}
        for a in ARMS
        for s in range(seeds)
    ]
    return pd.DataFrame(rows)


def test_each_setting_is_its_own_family_beside_the_committed_direction():
    df = pd.concat(
        [
            made_up("base", 12, {"fsdp": 1.0, "fl_fsdp": 2.0, "fl_hsdp": 1.5}),
            made_up("paper_lr", 10, {"fsdp": 3.0, "fl_fsdp": 2.0, "fl_hsdp": 1.0}),  # the paper's order
            made_up("clip", 10, {"fsdp": 1.0, "fl_fsdp": 2.0, "fl_hsdp": 1.5}),  # the base's order
        ]
    )
    table = findings(df, paper_values.load(None))
    assert list(table["setting"]) == ["the paper's lr 3e-4"] * 3 + ["clip 1.0 at lr 1e-2"] * 3
    assert list(table["direction"]) == ["reproduced"] * 3 + ["opposite", "opposite", "reproduced"]
    assert list(table["seeds"]) == [10] * 6
    then = committed("findings.csv")["direction"].tolist()  # the paper-shape study's: opposite, opposite, reproduced
    assert list(table["paper_shape_direction"]) == then * 2
    assert list(table["changed"]) == ["yes" if d != t else "no" for d, t in zip(table["direction"], then * 2)]
    effect = effects(df)  # X-setting / X-base on the seeds both have
    fsdp_lr = effect[(effect["arm"] == "FSDP") & (effect["setting"] == "the paper's lr 3e-4")].iloc[0]
    assert math.isclose(fsdp_lr["ratio"], 3.0) and fsdp_lr["seeds"] == 10


def test_a_rerun_is_matched_to_the_committed_run_of_its_arm_and_seed():
    then = committed("runs.csv", "judge")
    base = then[then["seed"] < 3].copy()
    base["phase"] = "base"
    base.loc[(base["algorithm"] == "fl_fsdp") & (base["seed"] == 1), "eval_perplexity"] *= 1.001
    other = base.iloc[:1].assign(steps=32)  # another length: not the committed run
    table = rerun(pd.concat([base, other]))
    assert len(table) == 9
    assert math.isclose(table["relative_difference"].abs().max(), 1e-3, rel_tol=1e-6)
    text = rerun_summary(table)
    assert "8 identical" in text and "FL+FSDP 1.0e-03" in text and "FSDP 0.0e+00" in text


def test_the_settings_are_judged_before_the_base_phase_has_run(tmp_path):
    """The phases may run in separate sessions: a report of the two judged settings alone has their
    verdicts, and says what waits for the base phase instead of failing on it."""
    df = pd.concat(
        [
            made_up("paper_lr", 10, {"fsdp": 3.0, "fl_fsdp": 2.0, "fl_hsdp": 1.0}),
            made_up("clip", 10, {"fsdp": 1.0, "fl_fsdp": 2.0, "fl_hsdp": 1.5}),
        ],
        ignore_index=True,
    )
    df["run"] = [f"r{i}" for i in range(len(df))]
    df["step"] = [[1, 2]] * len(df)
    df["loss"] = [[7.0, 6.5]] * len(df)
    text = report(df, paper_values.load(None), tmp_path, "made up", None).read_text()
    assert NOT_YET in text and "| the paper's lr 3e-4 |" in text.replace("  ", " ")
    assert (tmp_path / "findings.csv").exists() and not (tmp_path / "effects.csv").exists()
    assert len(pd.read_csv(tmp_path / "findings.csv")) == 6 and not (tmp_path / "rerun.csv").exists()
