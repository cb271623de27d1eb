"""Paired comparisons across seeds with a 95% confidence interval, and the verdict they allow.

Runs with the same seed share their initial weights (fldp.init) and data order, so two
configurations are compared seed by seed: d_i = log(a_i) - log(b_i). The interval is Student's t on
the mean of the d_i (n - 1 degrees of freedom), mapped back to a ratio a / b = exp(mean d). A ratio
whose interval lies inside the tie band (within TIE of 1) is a tie: the two are equal to within TIE
(a 1e-6 difference of float summation order, however consistent across seeds, is not a finding). An
interval that reaches the band but also leaves it is inconclusive: it shows neither an ordering nor
an equality. One seed gives no interval, and fewer than MIN_SEEDS give no verdict.

Claims are judged by `judge` (one definition for every study): the primary claims of a study form
one family. Each gets a direction (reproduced, opposite, tie, inconclusive, or TOO_FEW seeds), read
from its interval at the level Holm's step-down assigns it, and a size (whether the paper's own value
lies inside the interval), read from simultaneous intervals: Bonferroni, each of the m at 1 - alpha / m,
so that all m cover their true ratios together at least 1 - alpha of the time (95% family-wise). Holm's
levels guarantee the rejections, not the intervals' joint coverage (issue 30: 91% in a simulation of
4 large effects), so they judge only the direction. `explore` gives the same columns at the plain
level, for comparisons that are not findings."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd
from scipy.stats import t as student_t

LEVEL = 0.95
TIE = 0.01  # values within 1% of the larger are a tie (analysis/claims.py uses this margin)
TIE_LOW, TIE_HIGH = 1 - TIE, 1 / (1 - TIE)  # the tie band of a ratio a / b
# Fewest seeds for any verdict: with 2, t(1) = 12.7 makes the interval nearly useless, and "every
# seed agrees" happens 1 time in 4 with no effect at all.
MIN_SEEDS = 3
TOO_FEW = "n/a (too few seeds)"


def t_quantile(p: float, df: int) -> float:
    """x with P(T <= x) = p for Student's t with df degrees of freedom."""
    return float(student_t.ppf(p, df))


@dataclass(frozen=True)
class Ratio:
    """a / b over paired seeds: the geometric mean of the per-seed ratios and its interval (at
    `level`); `p`: the paired t-test's two-sided p-value for a / b = 1; `sd`: of the log ratios."""

    ratio: float
    low: float
    high: float
    seeds: int
    p: float = math.nan
    sd: float = math.nan
    level: float = LEVEL

    @property
    def verdict(self) -> str:
        """'>' (a above b: the whole interval above the tie band), '<' (below it), 'tie' (the whole
        interval inside it), 'inconclusive' (reaching into the band and out of it) or 'n/a' (fewer
        than MIN_SEEDS seeds)."""
        if self.seeds < MIN_SEEDS:
            return "n/a"
        if self.high < TIE_LOW:
            return "<"
        if self.low > TIE_HIGH:
            return ">"
        return "tie" if TIE_LOW <= self.low and self.high <= TIE_HIGH else "inconclusive"

    def text(self, decimals: int = 3) -> str:
        return interval_text(self.ratio, self.low, self.high, self.seeds, decimals)


def interval_text(ratio: float, low: float, high: float, seeds: int, decimals: int = 3) -> str:
    """A ratio and its interval as every report writes them."""
    if seeds < 2:
        return f"{ratio:.{decimals}f} (1 seed, no interval)" if seeds else "no runs"
    return f"{ratio:.{decimals}f} [{low:.{decimals}f}, {high:.{decimals}f}]"


def paired_ratio(a: pd.Series, b: pd.Series, level: float = LEVEL) -> Ratio:
    """a / b, paired by index (the seed); seeds present in only one side are left out."""
    both = pd.concat({"a": a, "b": b}, axis=1).dropna()
    d = both["a"].map(math.log) - both["b"].map(math.log)
    mean, low, high = mean_interval(d, level)
    n = len(d)
    sd = float(d.std(ddof=1)) if n > 1 else math.nan
    if n < 2:
        p = math.nan
    elif sd == 0:
        p = 1.0 if mean == 0 else 0.0
    else:
        p = float(2 * student_t.sf(abs(mean) / (sd / math.sqrt(n)), n - 1))
    return Ratio(math.exp(mean), math.exp(low), math.exp(high), n, p, sd, level)


def mean_interval(values: pd.Series, level: float = LEVEL) -> tuple[float, float, float]:
    """Mean and its t-interval at `level` (NaN bounds for fewer than two values)."""
    v = values.dropna().to_list()
    n = len(v)
    if n == 0:
        return math.nan, math.nan, math.nan
    mean = sum(v) / n
    if n == 1:
        return mean, math.nan, math.nan
    sd = math.sqrt(sum((x - mean) ** 2 for x in v) / (n - 1))
    half = float(t_half_width(sd, n, level))
    return mean, mean - half, mean + half


def t_half_width(sd, n: int, level):
    """Half-width of the Student-t interval at `level` on the mean of n values of standard deviation
    sd (numpy arrays welcome for sd and level: a simulation computes many at once)."""
    return student_t.ppf(0.5 + np.asarray(level) / 2, n - 1) * np.asarray(sd) / math.sqrt(n)


# --- verdicts on a family of claims -----------------------------------------------------------------


@dataclass(frozen=True)
class Claim:
    """A claim of the paper as a ratio a / b of a metric over paired seeds (lower perplexity: the
    worse algorithm on top), with the paper's own value of that ratio (> 1: a above b)."""

    name: str
    a: pd.Series
    b: pd.Series
    paper: float


def direction(r: Ratio, paper: float) -> str:
    """reproduced (the interval beyond the tie band on the paper's side), opposite (beyond it on the
    other side), tie (inside it), inconclusive (reaching into it and out), TOO_FEW (fewer than
    MIN_SEEDS seeds)."""
    v = r.verdict
    if v in (">", "<"):
        return "reproduced" if v == (">" if paper > 1 else "<") else "opposite"
    return TOO_FEW if v == "n/a" else v


def size(r: Ratio, paper: float) -> str:
    """Whether the paper's value lies inside the interval (n/a below MIN_SEEDS seeds or without a
    paper value)."""
    if r.seeds < MIN_SEEDS or math.isnan(paper):
        return "n/a"
    return "paper's value inside" if r.low <= paper <= r.high else "effect size refuted at this scale"


def holm_levels(p_values: list[float], alpha: float = 1 - LEVEL) -> list[float]:
    """The interval level Holm's step-down judges each claim at. Ranked by p-value (smallest first),
    the claim of rank k of m is tested at alpha / (m - k + 1) while every claim before it was
    rejected (its p below its threshold); from the first that was not, every later claim gets the
    Bonferroni level alpha / m. Level = 1 - that threshold."""
    m = len(p_values)
    order = sorted(range(m), key=lambda i: (math.isnan(p_values[i]), p_values[i]))
    levels, stepping = [0.0] * m, True
    for k, i in enumerate(order):
        threshold = alpha / (m - k) if stepping else alpha / m
        stepping = stepping and p_values[i] < threshold
        levels[i] = 1 - threshold
    return levels


def simultaneous_levels(m: int, alpha: float = 1 - LEVEL) -> list[float]:
    """Bonferroni: each of m intervals at 1 - alpha / m, so that all m cover together with
    probability at least 1 - alpha, whatever their dependence."""
    return [1 - alpha / m] * m


def family_levels(p_values: list[float], alpha: float = 1 - LEVEL) -> tuple[list[float], list[float]]:
    """The levels judge reads a family at: (the shown intervals' levels, from which size is read:
    simultaneous; the direction's levels: Holm's step-down)."""
    return simultaneous_levels(len(p_values), alpha), holm_levels(p_values, alpha)


COLUMNS = [
    "claim",
    "ratio",
    "lo",
    "hi",
    "level",
    "paper",
    "direction",
    "size",
    "seeds",
    "p",
    "sd_log",
    "direction_level",
    "direction_lo",
    "direction_hi",
]


def _rows(claims: list[Claim], levels: list[float], direction_levels: list[float]) -> pd.DataFrame:
    rows = []
    for c, level, direction_level in zip(claims, levels, direction_levels):
        shown, judged = paired_ratio(c.a, c.b, level), paired_ratio(c.a, c.b, direction_level)
        rows.append(
            {
                "claim": c.name,
                "ratio": shown.ratio,
                "lo": shown.low,
                "hi": shown.high,
                "level": level,
                "paper": c.paper,
                "direction": direction(judged, c.paper),
                "size": size(shown, c.paper),
                "seeds": shown.seeds,
                "p": shown.p,
                "sd_log": shown.sd,
                "direction_level": direction_level,
                "direction_lo": judged.low,
                "direction_hi": judged.high,
            }
        )
    return pd.DataFrame(rows, columns=COLUMNS)


def judge(claims: list[Claim], alpha: float = 1 - LEVEL) -> pd.DataFrame:
    """Each claim's ratio and its simultaneous interval (`lo`, `hi` at `level`: the family's
    intervals cover together at 1 - alpha), the paper's value and the size verdict read from that
    interval; the direction verdict read from the interval at Holm's level (`direction_level`,
    `direction_lo`, `direction_hi`: never wider than the shown one); the seeds. One row per claim, in
    the given order."""
    plain = [paired_ratio(c.a, c.b) for c in claims]
    return _rows(claims, *family_levels([r.p for r in plain], alpha))


def explore(claims: list[Claim]) -> pd.DataFrame:
    """judge's columns at the plain LEVEL, with no correction for the number of comparisons: for
    exploratory comparisons, whose direction is shown but is not a finding."""
    return _rows(claims, [LEVEL] * len(claims), [LEVEL] * len(claims))


def seeds_for(sd_log: float, half_width: float, level: float = LEVEL) -> int:
    """Seeds for an interval of half-width at most `half_width` on the ratio (relative, on the
    log scale: 0.02 is +-2%), given the paired SD of the log ratios (a pilot's): the least n with
    t(n - 1) * sd / sqrt(n) <= log(1 + half_width)."""
    target = math.log1p(half_width)
    n = 2
    while t_quantile(0.5 + level / 2, n - 1) * sd_log / math.sqrt(n) > target:
        n += 1
    return n
