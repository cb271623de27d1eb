"""The precision study's rules (experiments/precision/PLAN.md and its amendment 1), as
analysis.precision applies them; its pipeline end to end is CI's reduced run
(experiments/precision.sh --reduced)."""

import pandas as pd

from analysis.paper_shape import changed
from analysis.precision import BUDGET_S, judging_seeds


def times(bf16_s: float, fp32r_s: float) -> pd.Series:
    """Each of the 8 arms' training time per run."""
    index = pd.MultiIndex.from_product([["fsdp", "hsdp", "fl_fsdp", "fl_hsdp"], ["bf16", "fp32r"]])
    return pd.Series(
        [bf16_s if r == "bf16" else fp32r_s for _, r in index], index=index.set_names(["algorithm", "reductions"])
    )


def test_the_seeds_are_the_rules_at_least_5_and_within_the_budget():
    needed = pd.Series([4, 9, 7, 2])  # the primary ratios' needs
    assert judging_seeds(needed, times(60, 60)) == (9, 9)  # 8 arms x 60 s: 15 seeds fit in 120 min
    assert judging_seeds(pd.Series([2, 3]), times(60, 60)) == (5, 5)  # at least 5
    assert judging_seeds(pd.Series([40]), times(60, 60)) == (15, 15)  # the cap binds


def test_a_cap_under_5_gives_the_fp32r_arms_3_seeds_and_the_bf16_arms_the_rest():
    # one seed of the 8 arms: 4 x 300 + 4 x 200 s = 2000 s, so 3 fit; fp32r's 3 seeds take 2400 s,
    # and the 4800 s left give the bf16 arms (1200 s a seed) 4
    assert BUDGET_S == 7200
    assert judging_seeds(pd.Series([30]), times(300, 200)) == (4, 3)
    assert judging_seeds(pd.Series([30]), times(900, 900)) == (3, 3)  # never under 3


def test_a_verdict_changes_only_where_bf16_decides():
    assert changed("reproduced", "opposite") == "yes"
    assert changed("opposite", "opposite") == "no"
    assert changed("inconclusive", "opposite").startswith("undecided")
