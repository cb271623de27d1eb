"""Paired comparisons across seeds with a 95% confidence interval, and the verdict they allow.

Runs with the same seed share their initial weights (fldp.init) and data order, so two
configurations are compared seed by seed: d_i = log(a_i) - log(b_i). The interval is Student's t on
the mean of the d_i (n - 1 degrees of freedom), mapped back to a ratio a / b = exp(mean d). A ratio
whose interval lies inside the tie band (within TIE of 1) is a tie: the two are equal to within TIE
(a 1e-6 difference of float summation order, however consistent across seeds, is not a finding). An
interval that reaches the band but also leaves it is inconclusive: it shows neither an ordering nor
an equality. One seed gives no interval."""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import pandas as pd

LEVEL = 0.95
TIE = 0.01  # values within 1% of the larger are a tie (analysis/claims.py uses this margin)
TIE_LOW, TIE_HIGH = 1 - TIE, 1 / (1 - TIE)  # the tie band of a ratio a / b


def t_pdf(x: float, df: int) -> float:
    c = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)
    return math.exp(c - (df + 1) / 2 * math.log1p(x * x / df))


def t_cdf(x: float, df: int, intervals: int = 4000) -> float:
    """P(T <= x): 1/2 plus Simpson's rule on the density from 0 to |x| (no SciPy among our deps)."""
    a = abs(x)
    if a == 0:
        return 0.5
    h = a / intervals
    s = t_pdf(0, df) + t_pdf(a, df) + sum((4 if k % 2 else 2) * t_pdf(k * h, df) for k in range(1, intervals))
    half = s * h / 3
    return 0.5 + half if x > 0 else 0.5 - half


@lru_cache(maxsize=None)  # a report asks for the same few (p, df) dozens of times
def t_quantile(p: float, df: int) -> float:
    """x with P(T <= x) = p, for p in (0.5, 1): bisection on t_cdf."""
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:
        lo, hi = hi, hi * 2
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if t_cdf(mid, df) < p else (lo, mid)
    return (lo + hi) / 2


@dataclass(frozen=True)
class Ratio:
    """a / b over paired seeds: the geometric mean of the per-seed ratios and its interval."""
    ratio: float
    low: float
    high: float
    seeds: int

    @property
    def verdict(self) -> str:
        """'>' (a above b: the whole interval above the tie band), '<' (below it), 'tie' (the whole
        interval inside it), 'inconclusive' (reaching into the band and out of it) or 'n/a' (one seed)."""
        if self.seeds < 2:
            return "n/a"
        if self.high < TIE_LOW:
            return "<"
        if self.low > TIE_HIGH:
            return ">"
        return "tie" if TIE_LOW <= self.low and self.high <= TIE_HIGH else "inconclusive"

    def text(self, decimals: int = 3) -> str:
        if self.seeds < 2:
            return f"{self.ratio:.{decimals}f} (1 seed, no interval)" if self.seeds else "no runs"
        return f"{self.ratio:.{decimals}f} [{self.low:.{decimals}f}, {self.high:.{decimals}f}]"


def paired_ratio(a: pd.Series, b: pd.Series) -> Ratio:
    """a / b, paired by index (the seed); seeds present in only one side are left out."""
    both = pd.concat({"a": a, "b": b}, axis=1).dropna()
    d = both["a"].map(math.log) - both["b"].map(math.log)
    mean, low, high = mean_interval(d)
    return Ratio(math.exp(mean), math.exp(low), math.exp(high), len(d))


def mean_interval(values: pd.Series) -> tuple[float, float, float]:
    """Mean and its 95% t-interval (NaN bounds for fewer than two values)."""
    v = values.dropna().to_list()
    n = len(v)
    if n == 0:
        return math.nan, math.nan, math.nan
    mean = sum(v) / n
    if n == 1:
        return mean, math.nan, math.nan
    sd = math.sqrt(sum((x - mean) ** 2 for x in v) / (n - 1))
    half = t_quantile(0.5 + LEVEL / 2, n - 1) * sd / math.sqrt(n)
    return mean, mean - half, mean + half
