"""Small-sample intervals without scipy: Student t quantiles, t-intervals of a mean (of paired
differences), and ordinary least squares with slope and prediction intervals.

The t quantile is exact for integer degrees of freedom: the two-sided mass P(|T| <= t) has a
finite closed form in theta = atan(t / sqrt(df)) (Abramowitz & Stegun 26.7.3-4), inverted by
bisection to double precision.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from statistics import NormalDist

LEVEL = 0.95


def _t_mass(theta: float, df: int) -> float:
    """P(|T| <= sqrt(df) tan(theta)) for Student's t with df degrees of freedom."""
    s, c = math.sin(theta), math.cos(theta)
    if df % 2 == 1:  # theta + sin(theta) (cos + 2/3 cos^3 + 2*4/(3*5) cos^5 + ...), up to cos^(df-2)
        term, total = c, 0.0
        for k in range(1, (df - 1) // 2 + 1):
            total += term
            term *= c * c * (2 * k) / (2 * k + 1)
        return 2.0 / math.pi * (theta + s * total)
    term, total = 1.0, 0.0  # sin(theta) (1 + 1/2 cos^2 + 1*3/(2*4) cos^4 + ...), up to cos^(df-2)
    for k in range(1, df // 2 + 1):
        total += term
        term *= c * c * (2 * k - 1) / (2 * k)
    return s * total


def t_critical(df: int, level: float = LEVEL) -> float:
    """The t such that P(|T| <= t) = level (e.g. 2.776 for df 4 at 95%)."""
    if df < 1 or int(df) != df:
        raise ValueError(f"degrees of freedom must be a positive integer, got {df}")
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must lie in (0, 1), got {level}")
    df = int(df)
    if df > 200:  # the series has df/2 terms; Cornish-Fisher's expansion is exact to ~1e-10 here
        z = NormalDist().inv_cdf(0.5 + level / 2)
        return (
            z
            + (z**3 + z) / (4 * df)
            + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)
            + (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / (384 * df**3)
            + (79 * z**9 + 776 * z**7 + 1482 * z**5 - 1920 * z**3 - 945 * z) / (92160 * df**4)
        )
    lo, hi = 0.0, math.pi / 2
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if mid in (lo, hi):
            break
        if _t_mass(mid, df) < level:
            lo = mid
        else:
            hi = mid
    return math.sqrt(df) * math.tan(0.5 * (lo + hi))


@dataclass(frozen=True)
class Interval:
    """An estimate with a two-sided interval; lo/hi are nan when undefined (fewer than 2 values)."""

    estimate: float
    lo: float = math.nan
    hi: float = math.nan
    n: int = 1

    @property
    def defined(self) -> bool:
        return not (math.isnan(self.lo) or math.isnan(self.hi))

    def contains(self, x: float) -> bool:
        return self.defined and self.lo <= x <= self.hi

    def map(self, f) -> Interval:
        """The interval under a monotone increasing f (exact for intervals of a location)."""
        return Interval(
            f(self.estimate), f(self.lo) if self.defined else math.nan, f(self.hi) if self.defined else math.nan, self.n
        )

    def scale(self, k: float) -> Interval:
        return self.map(lambda x: k * x) if k >= 0 else Interval(k * self.estimate, k * self.hi, k * self.lo, self.n)


def mean_interval(xs: Sequence[float], level: float = LEVEL) -> Interval:
    """Mean with its t-interval (sample std, df n-1); undefined for one value."""
    n = len(xs)
    if n == 0:
        raise ValueError("mean_interval of no values")
    m = sum(xs) / n
    if n == 1:
        return Interval(m, n=1)
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (n - 1))
    half = t_critical(n - 1, level) * sd / math.sqrt(n)
    return Interval(m, m - half, m + half, n)


def paired_differences(a: Mapping[Hashable, float], b: Mapping[Hashable, float]) -> list[float]:
    """a[k] - b[k] for every pairing key (seed, or (grid point, seed)) both have, in key order."""
    keys = sorted((k for k in a if k in b), key=repr)
    return [a[k] - b[k] for k in keys]


@dataclass(frozen=True)
class Fit:
    """y = intercept + slope * x by ordinary least squares, with what intervals need."""

    intercept: float
    slope: float
    n: int
    resid_sd: float  # sqrt(SSE / (n - 2)); nan with 2 points
    x_mean: float
    sxx: float
    level: float = LEVEL

    @property
    def df(self) -> int:
        return self.n - 2

    def slope_interval(self) -> Interval:
        if self.df < 1:
            return Interval(self.slope, n=self.n)
        half = t_critical(self.df, self.level) * self.resid_sd / math.sqrt(self.sxx)
        return Interval(self.slope, self.slope - half, self.slope + half, self.n)

    def predict(self, x: float, *, new_observation: bool = True) -> Interval:
        """The fit at x with a prediction interval for one new observation (or, with
        new_observation=False, a confidence interval for the line)."""
        y = self.intercept + self.slope * x
        if self.df < 1:
            return Interval(y, n=self.n)
        se = self.resid_sd * math.sqrt(
            (1.0 if new_observation else 0.0) + 1.0 / self.n + (x - self.x_mean) ** 2 / self.sxx
        )
        half = t_critical(self.df, self.level) * se
        return Interval(y, y - half, y + half, self.n)


def ols(xs: Sequence[float], ys: Sequence[float], level: float = LEVEL) -> Fit:
    n = len(xs)
    if n != len(ys) or n < 2:
        raise ValueError(f"ols needs at least 2 (x, y) pairs of equal length, got {len(xs)} and {len(ys)}")
    xm, ym = sum(xs) / n, sum(ys) / n
    sxx = sum((x - xm) ** 2 for x in xs)
    if sxx == 0:
        raise ValueError("ols needs at least two distinct x values")
    slope = sum((x - xm) * (y - ym) for x, y in zip(xs, ys)) / sxx
    intercept = ym - slope * xm
    sse = sum((y - intercept - slope * x) ** 2 for x, y in zip(xs, ys))
    resid_sd = math.sqrt(sse / (n - 2)) if n > 2 else math.nan
    return Fit(intercept, slope, n, resid_sd, xm, sxx, level)
