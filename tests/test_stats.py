"""The verdict rules every study shares (analysis.stats: Holm, direction, size, seeds) against hand
computations."""

import pandas as pd
import pytest

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
