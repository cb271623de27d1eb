"""The model-size ladder's primary analysis (analysis/slope.py) against references written from the
definitions with other tools: scipy's linregress for the slope, numpy's polyfit covariance for the
line's band, a grid search for where the band holds 0, a least-squares fit with one mean per size
for the lack-of-fit test; and the ladder spec's slope piece, checked on load."""

import math
from pathlib import Path

import numpy as np
import pytest
import yaml
from omegaconf import OmegaConf
from scipy import stats

from analysis.slope import NOT_WITHIN, UNDETERMINED, WITHIN, crossing, fit, lack_of_fit
from analysis.spec import SpecError, load
from fldp.model import build_model, llama_config, parameter_counts

ROOT = Path(__file__).resolve().parents[1]
LADDER = ROOT / "experiments" / "ladder" / "study.yaml"
SIZES = np.log([92_480, 738_432, 2_417_088, 5_902_592])  # the ladder's N


def points(slope: float, at_zero: float, sd: float, seeds: int = 5, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = np.repeat(SIZES, seeds)
    return x, at_zero + slope * (x - SIZES.mean()) + rng.normal(0, sd, len(x))


@pytest.mark.parametrize("seed", range(3))
def test_slope_and_band_equal_scipy_and_numpy(seed):
    x, y = points(0.1, -0.3, 0.2, seed=seed)
    line = fit(x, y, 0.975)
    ref = stats.linregress(x, y)
    t = stats.t.ppf(1 - 0.025 / 2, len(x) - 2)
    assert line.slope == pytest.approx(ref.slope, rel=1e-12)
    assert line.slope_interval() == pytest.approx((ref.slope - t * ref.stderr, ref.slope + t * ref.stderr), rel=1e-10)
    coef, cov = np.polyfit(x, y, 1, cov=True)
    for at in (SIZES[0], SIZES[-1], math.log(6.98e9)):
        v = np.array([at, 1.0])
        y0, lo, hi = line.at(at)
        assert y0 == pytest.approx(coef @ v, rel=1e-10)
        assert hi - y0 == pytest.approx(t * math.sqrt(v @ cov @ v), rel=1e-8)


@pytest.mark.parametrize(
    "slope, at_zero, sd, verdict",
    [
        (0.3, 0.0, 0.1, WITHIN),  # crosses in the middle of the ladder, a clear trend
        (0.3, -2.0, 0.1, NOT_WITHIN),  # below 1 over the ladder, crossing far past it
        (0.0, -1.0, 0.05, NOT_WITHIN),  # below 1 everywhere, no trend: no crossing estimate
        (0.0, 0.0, 0.3, UNDETERMINED),  # about 1, no trend
    ],
)
def test_the_crossing_is_where_the_band_holds_zero(slope, at_zero, sd, verdict):
    x, y = points(slope, at_zero, sd)
    line = fit(x, y, 0.975)
    found, n_star, lo, hi = crossing(line, SIZES[0], SIZES[-1])
    assert found == verdict
    if math.isnan(n_star):
        return
    assert line.at(math.log(n_star))[0] == pytest.approx(0, abs=1e-9)
    grid = np.linspace(SIZES.mean() - 40, SIZES.mean() + 40, 400_001)
    inside = grid[band_holds_zero_vec(line, grid)]
    assert (math.log(lo), math.log(hi)) == pytest.approx((inside.min(), inside.max()), abs=1e-3)


def band_holds_zero_vec(line, xs):
    y = line.mean + line.slope * (xs - line.x_mean)
    half = line.t * line.s * np.sqrt(1 / line.n + (xs - line.x_mean) ** 2 / line.sxx)
    return (y - half <= 0) & (0 <= y + half)


def test_lack_of_fit_equals_the_nested_least_squares_f_test():
    x, y = points(0.1, 0.0, 0.1)
    y = y + 0.3 * (x - SIZES.mean()) ** 2  # curved
    line = fit(x, y, 0.95)
    design = np.column_stack([np.ones_like(x), x])
    dummies = (x[:, None] == SIZES[None, :]).astype(float)
    rss_line = np.linalg.lstsq(design, y, rcond=None)[1][0]
    rss_means = np.linalg.lstsq(dummies, y, rcond=None)[1][0]
    f = ((rss_line - rss_means) / 2) / (rss_means / (len(x) - 4))
    assert lack_of_fit(x, y, line) == pytest.approx(stats.f.sf(f, 2, len(x) - 4), rel=1e-8)
    assert lack_of_fit(x, y, line) < 0.01
    straight = points(0.1, 0.0, 0.1, seed=1)
    assert lack_of_fit(*straight, fit(*straight, 0.95)) > 0.05


def test_the_ladder_carries_its_lines_to_the_paper_models_n():
    spec = yaml.safe_load(LADDER.read_text())
    at = next(p["slope"]["at"] for p in spec["pieces"] if "slope" in p)
    cfg = OmegaConf.load(ROOT / "conf" / "model" / "llama3_1_8b.yaml")
    assert parameter_counts(build_model(llama_config(cfg, 128_256), "meta"))["params_non_embedding"] == at


def test_a_slope_naming_a_rung_without_its_arms_is_refused(tmp_path):
    spec = yaml.safe_load(LADDER.read_text())
    next(p["slope"] for p in spec["pieces"] if "slope" in p)["rungs"].append("l4")
    path = tmp_path / "ladder" / "study.yaml"
    path.parent.mkdir()
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    with pytest.raises(SpecError) as e:
        load(path)
    assert "pieces.slope (ARM-RUNG): no arm 'fsdp-l4'" in str(e.value)
