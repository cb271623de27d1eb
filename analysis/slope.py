"""A log ratio's straight line in log model size (the model-size ladder, experiments/ladder/PLAN.md):
ordinary least squares of y = ln(num / den), one point per paired seed and rung, on x = ln N; the
slope's Student-t interval; where the line crosses 0 (the ratio 1) with Fieller's interval; the
line carried to another N (an extrapolation) with its confidence band; and the lack-of-fit F test
against the rungs' means."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy import stats

WITHIN, NOT_WITHIN, UNDETERMINED = "within the ladder", "not within the ladder", "undetermined"
GROWS, SHRINKS, FLAT = "grows with size", "shrinks with size", "no trend shown"


@dataclass(frozen=True)
class Line:
    """y = mean + slope (x - x_mean), fitted on n points; `s` the residual SD (n - 2 degrees of
    freedom), `sxx` the sum of squared x deviations; intervals at `level`."""

    n: int
    x_mean: float
    mean: float
    slope: float
    s: float
    sxx: float
    level: float

    @property
    def t(self) -> float:
        return float(stats.t.ppf(1 - (1 - self.level) / 2, self.n - 2))

    def slope_interval(self) -> tuple[float, float]:
        half = self.t * self.s / math.sqrt(self.sxx)
        return self.slope - half, self.slope + half

    def trend(self) -> str:
        lo, hi = self.slope_interval()
        return GROWS if lo > 0 else SHRINKS if hi < 0 else FLAT

    def at(self, x: float) -> tuple[float, float, float]:
        """The line at x, and its confidence band there (of the line, not of a new point)."""
        y = self.mean + self.slope * (x - self.x_mean)
        half = self.t * self.s * math.sqrt(1 / self.n + (x - self.x_mean) ** 2 / self.sxx)
        return y, y - half, y + half

    def zero_set(self) -> tuple[float, float, bool]:
        """Fieller: the x where the band contains 0 solve A d^2 + B d + C <= 0 (d = x - x_mean).
        (lo, hi, bounded): bounded, the interval [lo, hi]; else everything outside (lo, hi), or
        every x where lo and hi are nan."""
        k = (self.t * self.s) ** 2
        a, b, c = self.slope**2 - k / self.sxx, 2 * self.mean * self.slope, self.mean**2 - k / self.n
        disc = b * b - 4 * a * c
        if disc < 0:  # a < 0 here: the band holds 0 everywhere
            return math.nan, math.nan, False
        roots = sorted(((-b - math.sqrt(disc)) / (2 * a), (-b + math.sqrt(disc)) / (2 * a))) if a else [-c / b] * 2
        return roots[0] + self.x_mean, roots[1] + self.x_mean, a > 0


def fit(x: np.ndarray, y: np.ndarray, level: float) -> Line:
    if len(set(x.tolist())) < 2 or len(x) < 3:
        raise ValueError(f"a line needs points at two sizes at least and 3 in all (got {len(x)})")
    x_mean, mean = float(x.mean()), float(y.mean())
    sxx = float(((x - x_mean) ** 2).sum())
    slope = float(((x - x_mean) * (y - mean)).sum() / sxx)
    residual = y - mean - slope * (x - x_mean)
    return Line(len(x), x_mean, mean, slope, math.sqrt(float((residual**2).sum()) / (len(x) - 2)), sxx, level)


def crossing(line: Line, x_min: float, x_max: float) -> tuple[str, float, float, float]:
    """Where the ratio is 1: (verdict, N*, lo, hi) in N. Within the ladder: the band holds 0 at some
    size of the ladder and the slope is shown (a bounded set) with N* inside it; not within the
    ladder: the band excludes 0 over the whole ladder (N* an extrapolation, where the slope is shown);
    else undetermined."""
    lo, hi, bounded = line.zero_set()
    estimate = math.exp(line.x_mean - line.mean / line.slope) if line.slope else math.nan
    holds = [line.at(x)[1] <= 0 <= line.at(x)[2] for x in np.linspace(x_min, x_max, 201)]
    if not any(holds):
        if not bounded:  # the ratio stays on one side over the ladder, and no trend says where it would cross
            return NOT_WITHIN, math.nan, math.nan, math.nan
        return NOT_WITHIN, estimate, math.exp(lo), math.exp(hi)
    if bounded and x_min <= math.log(estimate) <= x_max:
        return WITHIN, estimate, math.exp(lo), math.exp(hi)
    return UNDETERMINED, math.nan, math.nan, math.nan


def lack_of_fit(x: np.ndarray, y: np.ndarray, line: Line) -> float:
    """p of the F test of the line against each size's own mean (nan with fewer than 3 sizes)."""
    sizes = sorted(set(x.tolist()))
    if len(sizes) < 3 or len(x) <= len(sizes):
        return math.nan
    pure = sum(float(((y[x == v] - y[x == v].mean()) ** 2).sum()) for v in sizes)
    residual = line.s**2 * (line.n - 2)
    df_lack, df_pure = len(sizes) - 2, len(x) - len(sizes)
    if pure == 0:
        return 0.0 if residual > pure else 1.0
    return float(stats.f.sf(((residual - pure) / df_lack) / (pure / df_pure), df_lack, df_pure))
