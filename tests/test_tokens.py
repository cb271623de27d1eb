"""The tokens study's comparisons (experiments/tokens/PLAN.md and its amendment 1), as analysis.tokens
makes them, on made-up runs; its pipeline end to end is CI's reduced run
(experiments/tokens.sh --reduced)."""

import pandas as pd
import pytest

from analysis import paper as paper_values
from analysis.paper_shape import banked, losses
from analysis.tokens import findings, noise


def made_up(phase: str, steps: int) -> pd.DataFrame:
    """Three arms at 32 and 48 tokens on seeds 0-4: FSDP ends lowest (the seed's spread shared)."""
    scale = {"fsdp": 1.0, "fl_fsdp": 1.3, "fl_hsdp": 1.1}
    rows = [
        {
            "phase": phase,
            "algorithm": a,
            "block": b,
            "seed": s,
            "steps": steps,
            "eval_perplexity": 500 * scale[a] * (1 + 0.02 * s) * (1 + 0.001 * (s % 2) * (a == "fsdp")),
            "noise_trace": 10.0 * b,
            "noise_signal": 1.0,
            "tokens_per_group_step": 8 * b,
        }
        for a in scale
        for b in (32, 48)
        for s in range(5)
    ]
    return pd.DataFrame(rows)


def test_the_judged_runs_make_one_family_and_the_one_pass_runs_are_only_explored():
    df = pd.concat([made_up("judge", 64), made_up("onepass", 32)])
    paper = paper_values.load(None)
    judged, explored = findings(df, paper), findings(df, paper, "onepass")
    assert len(judged) == len(explored) == 6
    assert (judged["level"] > 0.95).all()  # simultaneous Bonferroni intervals over the family of 6
    assert (explored["level"] == 0.95).all()
    assert list(judged["direction"][:3]) == ["opposite", "opposite", "reproduced"]
    table = noise(df)  # one row per phase, arm and level: the two kinds of runs are never pooled
    assert len(table) == 12 and set(table["phase"]) == {"judge", "onepass"}


def with_curves(df: pd.DataFrame, commit: str) -> pd.DataFrame:
    df = df.assign(
        run=[f"{p}/{a},{b},{s}" for p, a, b, s in zip(df["phase"], df["algorithm"], df["block"], df["seed"])]
    )
    return df.assign(commit=commit, step=[[1, 2]] * len(df), loss=[[7.0 + s, 6.0 + s] for s in df["seed"]])


def test_a_report_made_again_takes_the_phases_its_runs_lack_from_the_committed_one(tmp_path):
    earlier = with_curves(pd.concat([made_up("noise16", 64), made_up("judge", 32)]), "old")
    earlier.drop(columns=["step", "loss"]).to_csv(tmp_path / "runs.csv", index=False)
    losses(earlier, tmp_path)
    now = with_curves(made_up("judge", 64), "new")
    with pytest.raises(SystemExit) as refused:  # other commits' rows, not asked for
        banked(now, tmp_path, allow_mixed=False)
    assert refused.value.code == 2
    both = banked(now, tmp_path, allow_mixed=True)
    assert len(both) == 60 and set(both[both["commit"] == "old"]["phase"]) == {"noise16"}  # no old judge row
    assert (both[both["phase"] == "judge"]["steps"] == 64).all()
    row = both[(both["phase"] == "noise16") & (both["seed"] == 3)].iloc[0]
    assert row["step"] == [1, 2] and row["loss"] == [10.0, 9.0]  # its curve, read back from losses.csv.gz
