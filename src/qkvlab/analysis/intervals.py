"""Small-sample intervals and one-sided tests: means with a standard error and Welch-Satterthwaite
degrees of freedom, exact binomial (Clopper-Pearson) intervals, Newcombe's square-and-add interval
for a difference of two rates, Holm's step-down rule, and least squares with slope and prediction
intervals. Quantiles come from scipy.stats.

Every estimate answers the same three questions the verdicts ask: its two-sided interval at a
level, and the p-values of the one-sided tests "the true value is above x" / "below x".
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

from scipy import stats

LEVEL = 0.95  # descriptive two-sided intervals (tables, trends, scaling)
ALPHA = 0.05  # every one-sided test of a verdict; its two-sided interval is the 1 - 2 ALPHA = 90% one


def t_critical(df: float, level: float = LEVEL) -> float:
    """The t with P(|T| <= t) = level for Student's t with df degrees of freedom (df may be
    fractional, as Welch-Satterthwaite's is; math.inf gives the normal quantile)."""
    if isinstance(df, bool) or not isinstance(df, (int, float)) or not df > 0:
        raise ValueError(f"degrees of freedom must be positive, got {df}")
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must lie in (0, 1), got {level}")
    q = 0.5 + level / 2
    return float(stats.norm.ppf(q) if df == math.inf else stats.t.ppf(q, df))


@dataclass(frozen=True)
class Interval:
    """An estimate with a two-sided interval; lo/hi are nan when undefined."""

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


# ---- means -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MeanEstimate:
    """A mean with its standard error and degrees of freedom (math.inf: the variance is known).
    se == 0 or nan: no interval and no test (a zero-width interval would claim certainty)."""

    estimate: float
    se: float
    df: float
    n: int
    seed_var: float = math.nan  # sample variance over values (nan with one value): what with_n keeps
    eval_var: float = 0.0  # the evaluation's known variance of the mean

    @property
    def usable(self) -> bool:
        return self.se > 0 and math.isfinite(self.se) and self.df > 0

    def interval(self, level: float = LEVEL) -> Interval:
        if not self.usable:
            return Interval(self.estimate, n=self.n)
        half = t_critical(self.df, level) * self.se
        return Interval(self.estimate, self.estimate - half, self.estimate + half, self.n)

    def _dist(self):
        return stats.norm if self.df == math.inf else stats.t(self.df)

    def p_above(self, x: float) -> float:
        """p-value of H0 "true <= x" against "true > x" (1.0 without a usable se)."""
        return float(self._dist().sf((self.estimate - x) / self.se)) if self.usable else 1.0

    def p_below(self, x: float) -> float:
        """p-value of H0 "true >= x" against "true < x"."""
        return float(self._dist().cdf((self.estimate - x) / self.se)) if self.usable else 1.0

    def with_n(self, n: int) -> MeanEstimate:
        """The same spread with n values instead of self.n (what n seeds would give)."""
        return mean_estimate_from(self.estimate, self.seed_var, self.eval_var, n)


def mean_estimate_from(mean: float, seed_var: float, eval_var: float, n: int) -> MeanEstimate:
    """Var(mean) = seed_var / n + eval_var, df by Welch-Satterthwaite (eval_var is known: infinite
    df). n == 1 or seed_var nan: the evaluation's variance alone, df infinite."""
    if n < 2 or math.isnan(seed_var):
        se = math.sqrt(eval_var)
        return MeanEstimate(mean, se, math.inf, n, seed_var, eval_var)
    a = seed_var / n
    var = a + eval_var
    df = (var * var) / (a * a / (n - 1)) if a > 0 else math.inf
    return MeanEstimate(mean, math.sqrt(var), df, n, seed_var, eval_var)


def mean_estimate(xs: Sequence[float], eval_var: float = 0.0) -> MeanEstimate:
    """Mean of xs, its sample variance over values, plus a known evaluation variance of the mean."""
    n = len(xs)
    if n == 0:
        raise ValueError("mean_estimate of no values")
    m = sum(xs) / n
    s2 = sum((x - m) ** 2 for x in xs) / (n - 1) if n > 1 else math.nan
    return mean_estimate_from(m, s2, eval_var, n)


def mean_interval(xs: Sequence[float], level: float = LEVEL, eval_var: float = 0.0) -> Interval:
    """Mean with its t-interval (sample variance over values, plus eval_var); one value: the
    interval of eval_var alone (none without it)."""
    return mean_estimate(xs, eval_var).interval(level)


def paired_differences(a: Mapping[Hashable, float], b: Mapping[Hashable, float]) -> list[float]:
    """a[k] - b[k] for every pairing key (seed, or (grid point, seed)) both have, in key order."""
    keys = sorted((k for k in a if k in b), key=repr)
    return [a[k] - b[k] for k in keys]


# ---- rates -------------------------------------------------------------------------------------
def clopper_pearson(k: int, n: int, level: float = LEVEL) -> tuple[float, float]:
    """Exact two-sided interval of a binomial rate k/n (each side holds (1 - level) / 2)."""
    if n < 1 or not 0 <= k <= n:
        raise ValueError(f"need 0 <= k <= n and n >= 1, got k={k}, n={n}")
    a = (1 - level) / 2
    lo = 0.0 if k == 0 else float(stats.beta.ppf(a, k, n - k + 1))
    hi = 1.0 if k == n else float(stats.beta.ppf(1 - a, k + 1, n - k))
    return lo, hi


@dataclass(frozen=True)
class Rate:
    """k successes in n trials: exact one-sided binomial tests, Clopper-Pearson interval."""

    k: int
    n: int

    @property
    def estimate(self) -> float:
        return self.k / self.n

    def interval(self, level: float = LEVEL) -> Interval:
        lo, hi = clopper_pearson(self.k, self.n, level)
        return Interval(self.estimate, lo, hi, self.n)

    def p_above(self, x: float) -> float:
        """P(K >= k | rate x): H0 "rate <= x"."""
        return 1.0 if x >= 1 else float(stats.binom.sf(self.k - 1, self.n, x))

    def p_below(self, x: float) -> float:
        """P(K <= k | rate x): H0 "rate >= x"."""
        return 1.0 if x <= 0 else float(stats.binom.cdf(self.k, self.n, x))


def rate_difference(a: Rate, b: Rate, level: float = LEVEL) -> Interval:
    """Newcombe's square-and-add (MOVER) interval of a.rate - b.rate for independent samples, with
    Clopper-Pearson limits for each rate (Newcombe 1998, method 10, exact limits in place of Wilson)."""
    pa, pb = a.estimate, b.estimate
    la, ua = clopper_pearson(a.k, a.n, level)
    lb, ub = clopper_pearson(b.k, b.n, level)
    d = pa - pb
    lo = d - math.sqrt((pa - la) ** 2 + (ub - pb) ** 2)
    hi = d + math.sqrt((ua - pa) ** 2 + (pb - lb) ** 2)
    return Interval(d, lo, hi, min(a.n, b.n))


@dataclass(frozen=True)
class RateDifference:
    """a - b of two solve rates; tests by inverting the Newcombe interval (the p-value is the
    one-sided level at which the interval's bound reaches x)."""

    a: Rate
    b: Rate

    @property
    def estimate(self) -> float:
        return self.a.estimate - self.b.estimate

    @property
    def n(self) -> int:
        return min(self.a.n, self.b.n)

    def interval(self, level: float = LEVEL) -> Interval:
        return rate_difference(self.a, self.b, level)

    def _p(self, x: float, lower: bool) -> float:
        def excludes(p: float) -> bool:  # the one-sided (1 - p) bound lies beyond x
            iv = rate_difference(self.a, self.b, 1 - 2 * p)
            return iv.lo > x if lower else iv.hi < x

        if not excludes(0.5 - 1e-12):
            return 1.0
        lo, hi = 1e-15, 0.5 - 1e-12
        if excludes(lo):
            return lo
        for _ in range(60):  # bisection in log p: the bound moves monotonically with p
            mid = math.sqrt(lo * hi)
            lo, hi = (lo, mid) if excludes(mid) else (mid, hi)
        return hi

    def p_above(self, x: float) -> float:
        return self._p(x, lower=True)

    def p_below(self, x: float) -> float:
        return self._p(x, lower=False)

    def with_n(self, n: int) -> RateDifference:
        """The same observed rates with n runs per variant (k rounded)."""
        return RateDifference(Rate(round(self.a.estimate * n), n), Rate(round(self.b.estimate * n), n))


@dataclass(frozen=True)
class PairedSolves:
    """Solve-or-fail outcomes of two variants paired by seed: McNemar's exact test, i.e. a binomial
    test at 1/2 on the discordant seeds (A solves and B fails: a_only; the reverse: b_only); the
    concordant seeds say nothing about which variant solves more often."""

    a_only: int
    b_only: int
    n: int  # paired seeds
    a_solved: int = 0
    b_solved: int = 0

    @property
    def estimate(self) -> float:
        """Solve rate of A minus solve rate of B."""
        return (self.a_only - self.b_only) / self.n

    def p_more(self) -> float:
        """Exact one-sided p of "A solves no more often than B" (H1: A solves more often)."""
        m = self.a_only + self.b_only
        return float(stats.binomtest(self.a_only, m, 0.5, alternative="greater").pvalue) if m else 1.0

    def p_less(self) -> float:
        m = self.a_only + self.b_only
        return float(stats.binomtest(self.b_only, m, 0.5, alternative="greater").pvalue) if m else 1.0

    def interval(self, level: float = LEVEL) -> Interval:
        return Interval(self.estimate, n=self.n)  # the test is exact; no interval is claimed for it

    def with_n(self, n: int) -> PairedSolves:
        """The same discordance rates at n seeds (counts rounded)."""
        k = lambda x: round(x * n / self.n)
        return PairedSolves(k(self.a_only), k(self.b_only), n, k(self.a_solved), k(self.b_solved))


def holm(pvalues: Sequence[float], alpha: float = ALPHA) -> list[bool]:
    """Holm's step-down rule: which hypotheses to reject with familywise error <= alpha."""
    order = sorted(range(len(pvalues)), key=lambda i: pvalues[i])
    reject = [False] * len(pvalues)
    for rank, i in enumerate(order):
        if pvalues[i] > alpha / (len(pvalues) - rank):
            break
        reject[i] = True
    return reject


# ---- least squares -----------------------------------------------------------------------------
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


@dataclass(frozen=True)
class LackOfFit:
    """The F test of a straight line against one mean per x (pure error from the replicates at each x):
    F = (SS lack of fit / (k - 2)) / (SS pure error / (n - k)), k distinct x, n points."""

    f: float
    df_lack: int
    df_pure: int
    p: float

    @property
    def rejects(self) -> bool:
        return self.p < ALPHA


def lack_of_fit(xs: Sequence[float], ys: Sequence[float]) -> LackOfFit | None:
    """The line fitted through every (x, y) tested against the group means; None without at least
    three distinct x and a replicate (no degrees of freedom for one of the two terms)."""
    groups: dict[float, list[float]] = {}
    for x, y in zip(xs, ys):
        groups.setdefault(x, []).append(y)
    k, n = len(groups), len(xs)
    if k < 3 or n - k < 1:
        return None
    fit = ols(xs, ys)
    sse = sum((y - fit.intercept - fit.slope * x) ** 2 for x, y in zip(xs, ys))
    pure = sum(sum((y - sum(g) / len(g)) ** 2 for y in g) for g in groups.values())
    if pure <= 0:
        return None
    f = ((sse - pure) / (k - 2)) / (pure / (n - k))
    return LackOfFit(f, k - 2, n - k, float(stats.f.sf(f, k - 2, n - k)))
