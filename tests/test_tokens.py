"""The tokens study's comparisons (experiments/tokens/PLAN.md and its amendment 1), as analysis.tokens
makes them, on made-up runs; its pipeline end to end is CI's reduced run
(experiments/tokens.sh --reduced)."""

import pandas as pd

from analysis import paper as paper_values
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
