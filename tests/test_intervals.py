"""t quantiles, t-intervals, exact binomial intervals, Holm and least squares (analysis/intervals.py)
against textbook values and an independent matrix computation."""

import math
import random

import numpy as np
import pytest

from qkvlab.analysis.intervals import (
    Interval,
    Rate,
    RateDifference,
    clopper_pearson,
    mean_estimate,
    mean_interval,
    ols,
    paired_differences,
    t_critical,
)

# Two-sided 95% critical values of Student's t (printed tables, 4 decimals).
TABLE_95 = {1: 12.7062, 2: 4.3027, 3: 3.1824, 4: 2.7764, 5: 2.5706, 10: 2.2281, 30: 2.0423, 100: 1.9840, 1000: 1.9623}


@pytest.mark.parametrize("df,value", sorted(TABLE_95.items()))
def test_t_critical_matches_printed_table(df, value):
    assert t_critical(df) == pytest.approx(value, abs=6e-5)


def test_t_critical_fractional_and_infinite_df():
    # Welch-Satterthwaite gives fractional df; a known variance gives the normal quantile
    assert t_critical(math.inf) == pytest.approx(1.959963984540054, abs=1e-12)
    assert TABLE_95[2] > t_critical(2.5) > TABLE_95[3]


def test_t_critical_rejects_bad_input():
    for df in (0, -1, math.nan, True):
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


# Clopper-Pearson 95% limits (Clopper & Pearson 1934; e.g. Newcombe 1998 Table I, method 5)
CP_95 = {(0, 10): (0.0, 0.3085), (10, 10): (0.6915, 1.0), (5, 10): (0.1871, 0.8129), (1, 29): (0.0009, 0.1776)}


@pytest.mark.parametrize("kn,limits", sorted(CP_95.items()))
def test_clopper_pearson_known_values(kn, limits):
    assert clopper_pearson(*kn) == pytest.approx(limits, abs=5e-5)


def test_clopper_pearson_closed_forms_at_the_edges():
    for n in (1, 3, 17):
        assert clopper_pearson(0, n)[1] == pytest.approx(1 - 0.025 ** (1 / n), rel=1e-12)
        assert clopper_pearson(n, n)[0] == pytest.approx(0.025 ** (1 / n), rel=1e-12)
    with pytest.raises(ValueError):
        clopper_pearson(4, 3)


def test_rate_tests_are_exact_binomial_tails():
    r = Rate(7, 10)
    assert r.p_above(0.4) == pytest.approx(sum(math.comb(10, i) * 0.4**i * 0.6 ** (10 - i) for i in range(7, 11)))
    assert r.p_below(0.9) == pytest.approx(sum(math.comb(10, i) * 0.9**i * 0.1 ** (10 - i) for i in range(0, 8)))


def test_rate_difference_p_value_inverts_its_interval():
    d = RateDifference(Rate(9, 10), Rate(2, 10))
    p = d.p_above(0.1)
    iv = d.interval(1 - 2 * p)  # at the p-value's level the one-sided bound sits on 0.1
    assert iv.lo == pytest.approx(0.1, abs=1e-9)
    assert d.p_below(0.1) == 1.0 and 0 < d.p_above(0.0) < p
    assert d.with_n(20) == RateDifference(Rate(18, 20), Rate(4, 20))


def test_mean_estimate_known_eval_variance_and_projection():
    est = mean_estimate([1.0, 2.0, 4.0], eval_var=0.25)
    s2 = ((1 - 7 / 3) ** 2 + (2 - 7 / 3) ** 2 + (4 - 7 / 3) ** 2) / 2
    assert est.se == pytest.approx(math.sqrt(s2 / 3 + 0.25), rel=1e-12)
    assert est.df == pytest.approx((s2 / 3 + 0.25) ** 2 / ((s2 / 3) ** 2 / 2), rel=1e-12)
    big = est.with_n(300)
    assert big.seed_var == est.seed_var and big.se == pytest.approx(math.sqrt(s2 / 300 + 0.25), rel=1e-12)
    one = mean_estimate([3.0])
    assert not one.usable and not one.interval().defined  # one value, no evaluation error: no interval
    flat = mean_estimate([2.0, 2.0, 2.0])
    assert not flat.interval().defined  # identical values: no zero-width interval
