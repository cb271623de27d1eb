"""The family-wise coverage of the intervals analysis.stats.judge shows (issue 30, item 9), by
simulation with the truth known: 4 large true effects (every claim rejected, so Holm's step-down
assigns its four different levels), 20 paired seeds, 20,000 families."""

import math

import numpy as np
import pandas as pd
import pytest
from scipy.stats import t as student_t

from analysis.stats import Claim, family_levels, holm_levels, judge, t_half_width

REPS, SEEDS = 20_000, 20
TRUE_LOG_RATIOS = np.array([0.4, 0.5, 0.6, 0.7])  # each many standard errors from 0: all rejected
SD_LOG = 0.2
# 3 standard errors (each sqrt(0.95 * 0.05 / REPS) = 0.0015) of a coverage of 0.95 estimated from REPS families
SLACK = 3 * math.sqrt(0.95 * 0.05 / REPS)


def _simulated_families():
    """Per family and claim: the mean and SD of the seeds' log ratios, and the paired t-test's p."""
    rng = np.random.default_rng(30)
    d = TRUE_LOG_RATIOS[None, :, None] + SD_LOG * rng.standard_normal((REPS, len(TRUE_LOG_RATIOS), SEEDS))
    mean, sd = d.mean(axis=2), d.std(axis=2, ddof=1)
    p = 2 * student_t.sf(np.abs(mean) / (sd / math.sqrt(SEEDS)), SEEDS - 1)  # from the definition
    return mean, sd, p


def _joint_coverage(mean, sd, levels) -> float:
    """How often all of a family's intervals hold their true log ratio."""
    half = t_half_width(sd, SEEDS, levels)
    return float((np.abs(mean - TRUE_LOG_RATIOS) <= half).all(axis=1).mean())


def test_the_half_width_is_students_t():
    # the t table: t(0.975, 19) = 2.0930 (a 95% interval), t(0.995, 19) = 2.8609 (99%)
    assert float(t_half_width(1.0, 20, 0.95)) == pytest.approx(2.0930 / math.sqrt(20), rel=1e-4)
    assert float(t_half_width(0.5, 20, 0.99)) == pytest.approx(0.5 * 2.8609 / math.sqrt(20), rel=1e-4)


def test_the_shown_intervals_cover_together_95_percent_and_holms_do_not():
    mean, sd, p = _simulated_families()
    assert (p < 0.05 / len(TRUE_LOG_RATIOS)).all()  # every claim rejected: Holm's levels all differ
    levels = [family_levels(list(row)) for row in p]
    shown = np.array([s for s, _ in levels])
    holm = np.array([h for _, h in levels])
    covered = _joint_coverage(mean, sd, shown)
    assert covered >= 0.95 - SLACK, f"the shown intervals cover jointly {covered:.2%}, not 95%"
    # the old way, intervals at Holm's levels (0.95 to 0.9875), falls short (91% here: 15 standard errors below)
    holm_covered = _joint_coverage(mean, sd, holm)
    assert holm_covered < 0.95 - 5 * SLACK, f"Holm-level intervals cover jointly {holm_covered:.2%}"


def test_judge_shows_the_simultaneous_intervals_and_reads_direction_at_holms_levels():
    rng = np.random.default_rng(1)
    seeds = range(SEEDS)
    b = pd.Series(100.0, index=seeds)
    claims = [
        Claim(f"claim {i}", b * np.exp(mu + SD_LOG * rng.standard_normal(SEEDS)), b, 1.5)
        for i, mu in enumerate(TRUE_LOG_RATIOS)
    ]
    t = judge(claims)
    assert list(t["level"]) == pytest.approx([1 - 0.05 / 4] * 4)  # Bonferroni, whatever the p-values
    assert list(t["direction_level"]) == pytest.approx(holm_levels(list(t["p"])))
    for c, row in zip(claims, t.itertuples()):
        d = np.log(c.a / c.b)  # the interval from its definition
        half = student_t.ppf(0.5 + row.level / 2, SEEDS - 1) * d.std(ddof=1) / math.sqrt(SEEDS)
        assert (row.lo, row.hi) == pytest.approx((math.exp(d.mean() - half), math.exp(d.mean() + half)))
        assert row.direction_lo >= row.lo and row.direction_hi <= row.hi  # Holm's is never wider
        inside = row.lo <= 1.5 <= row.hi
        assert row.size == ("paper's value inside" if inside else "effect size refuted at this scale")
