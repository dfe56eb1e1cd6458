"""t quantiles, t-intervals and least squares (analysis/intervals.py) against textbook values and
an independent matrix computation."""

import math
import random

import numpy as np
import pytest

from qkvlab.analysis.intervals import Interval, mean_interval, ols, paired_differences, t_critical

# Two-sided 95% critical values of Student's t (printed tables, 4 decimals).
TABLE_95 = {1: 12.7062, 2: 4.3027, 3: 3.1824, 4: 2.7764, 5: 2.5706, 10: 2.2281, 30: 2.0423, 100: 1.9840, 1000: 1.9623}


@pytest.mark.parametrize("df,value", sorted(TABLE_95.items()))
def test_t_critical_matches_printed_table(df, value):
    assert t_critical(df) == pytest.approx(value, abs=6e-5)


def test_t_critical_matches_scipy_to_1e9():
    stats = pytest.importorskip("scipy.stats")
    for df in list(range(1, 260)) + [500, 5000, 10**6]:
        for level in (0.8, 0.95, 0.99):
            assert t_critical(df, level) == pytest.approx(stats.t.ppf(0.5 + level / 2, df), rel=1e-9)


def test_t_critical_rejects_bad_input():
    for df in (0, -1, 2.5):
        with pytest.raises(ValueError):
            t_critical(df)
    with pytest.raises(ValueError):
        t_critical(3, 1.0)


def test_mean_interval_by_hand():
    iv = mean_interval([1.0, 2.0, 3.0, 4.0])
    sd = math.sqrt(((1.5**2) * 2 + (0.5**2) * 2) / 3)
    half = TABLE_95[3] * sd / 2
    assert iv.estimate == 2.5 and iv.n == 4
    assert iv.lo == pytest.approx(2.5 - half, abs=1e-4) and iv.hi == pytest.approx(2.5 + half, abs=1e-4)
    one = mean_interval([7.0])
    assert one.estimate == 7.0 and not one.defined and not one.contains(7.0)


def test_interval_map_and_scale():
    iv = Interval(1.0, 0.5, 2.0, 3)
    m = iv.map(math.exp)
    assert (m.lo, m.estimate, m.hi) == (math.exp(0.5), math.e, math.exp(2.0))
    s = iv.scale(-2.0)
    assert (s.lo, s.estimate, s.hi) == (-4.0, -2.0, -1.0)


def test_paired_differences_pairs_by_key():
    assert paired_differences({0: 5.0, 1: 7.0, 2: 1.0}, {1: 4.0, 0: 1.0, 3: 9.0}) == [4.0, 3.0]
    assert paired_differences({("p", 1): 2.0}, {("p", 1): 0.5}) == [1.5]


@pytest.mark.parametrize("n", [3, 5, 12])
def test_ols_matches_matrix_formulas(n):
    rng = random.Random(n)
    xs = [rng.uniform(-2, 3) for _ in range(n)]
    ys = [0.7 - 1.3 * x + rng.gauss(0, 0.4) for x in xs]
    fit = ols(xs, ys)
    X = np.column_stack([np.ones(n), np.array(xs)])
    y = np.array(ys)
    beta, *_ = np.linalg.lstsq(X, y, rcond=None)
    resid = y - X @ beta
    s2 = float(resid @ resid) / (n - 2)
    cov = s2 * np.linalg.inv(X.T @ X)
    t = t_critical(n - 2)
    assert fit.intercept == pytest.approx(beta[0], abs=1e-12) and fit.slope == pytest.approx(beta[1], abs=1e-12)
    si = fit.slope_interval()
    assert si.hi - si.estimate == pytest.approx(t * math.sqrt(cov[1, 1]), rel=1e-10)
    x0 = np.array([1.0, 4.5])
    pi = fit.predict(4.5)
    assert pi.estimate == pytest.approx(float(x0 @ beta), abs=1e-12)
    assert pi.hi - pi.estimate == pytest.approx(t * math.sqrt(s2 + float(x0 @ cov @ x0)), rel=1e-10)
    ci = fit.predict(4.5, new_observation=False)
    assert ci.hi - ci.estimate == pytest.approx(t * math.sqrt(float(x0 @ cov @ x0)), rel=1e-10)


def test_ols_two_points_has_no_interval_and_needs_distinct_x():
    fit = ols([0.0, 1.0], [1.0, 3.0])
    assert fit.slope == 2.0 and not fit.slope_interval().defined and not fit.predict(2.0).defined
    with pytest.raises(ValueError):
        ols([1.0, 1.0, 1.0], [0.0, 1.0, 2.0])
