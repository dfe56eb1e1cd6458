"""Seeds to decide: from a pilot's observed spread, how many seeds an undecided claim needs before
its test can decide it at its margin, what that costs here, and the command that runs it.

Per comparison, the pilot's estimate keeps its seed-to-seed variance and its evaluation variance
(:meth:`MeanEstimate.with_n`), or its solve rates (:meth:`RateDifference.with_n`), and n grows until

- ordering claims (better, worst, best, order): the 90% interval is narrower than the margin. Such
  an interval always decides (it either excludes 0 or excludes an effect of the margin's size),
  whatever the estimate: this n decides for sure (Holm aside);
- McNemar's test (solve-or-fail, version 4): the pilot's discordance rates kept, until the exact
  one-sided p of either direction is below 5%;
- every other kind: the estimate, as observed, lies a distance of (t(95%) + t(80%)) standard errors
  inside a region that decides (80% power if the observed gap is the true one).

A claim needs the largest n of its undecided comparisons. The decisive run then uses that fixed n,
chosen before its data: the 5% error of each test stays what it says, because n does not depend on
the outcome of the decisive data (the pilot's seeds may be reused as part of the n; the pilot only
sets n, never stops a run early).
"""

from __future__ import annotations

import math
import re

from scipy import stats

from qkvlab.analysis.intervals import ALPHA, MeanEstimate, PairedSolves, RateDifference, t_critical
from qkvlab.analysis.verdicts import INCONCLUSIVE, TEST_LEVEL, ClaimVerdict, Gap
from qkvlab.base.units import fmt_duration

N_MAX = 1000  # beyond this the answer is "more than N_MAX"
POWER = 0.80


def _power_half(est) -> float:
    """Half-width of the band around the estimate that must lie inside a deciding region."""
    if isinstance(est, MeanEstimate):
        return (t_critical(est.df, 1 - 2 * ALPHA) + t_critical(est.df, 2 * POWER - 1)) * est.se
    z = stats.norm.ppf(1 - ALPHA) + stats.norm.ppf(POWER)  # rates: the Newcombe interval at that z
    iv = est.interval(2 * stats.norm.cdf(z) - 1)
    return max(est.estimate - iv.lo, iv.hi - est.estimate)


def decides(est, g: Gap) -> bool:
    """Would this (projected) estimate decide comparison g by the rule in the module doc?"""
    if isinstance(est, MeanEstimate) and not est.usable:
        return False
    if isinstance(est, PairedSolves):  # McNemar: exact, either direction decides
        return min(est.p_less(), est.p_more()) < ALPHA
    region = g.raw_region
    if region.overlap > 0:
        iv = est.interval(TEST_LEVEL)
        return iv.defined and iv.hi - iv.lo < region.overlap
    half = _power_half(est)
    lo, hi = est.estimate - half, est.estimate + half
    if region.holds[0] < lo and hi < region.holds[1]:
        return True
    return any(hi < x if side == "below" else lo > x for side, x in region.fails)


def seeds_for_gap(g: Gap, n_max: int = N_MAX) -> int | None:
    """The smallest n (> the pilot's) at which g decides; math.inf past n_max; None when the pilot
    cannot say (one seed: no spread; no spread at all; a threshold on pooled units)."""
    est = g.est
    if not isinstance(est, (MeanEstimate, RateDifference, PairedSolves)) or g.raw_region is None:
        return None
    if isinstance(est, PairedSolves) and est.a_only + est.b_only == 0:
        return None  # no discordant seed in the pilot: no rate to project
    if isinstance(est, MeanEstimate) and (math.isnan(est.seed_var) or not est.usable):
        return None
    ok = lambda n: decides(est.with_n(n), g)
    lo = max(est.n, 2)
    if ok(lo):
        return lo
    hi = lo
    while not ok(hi):  # gallop, then bisect: deciding is monotone in n (up to rounding of rates)
        if hi >= n_max:
            return math.inf
        lo, hi = hi, min(2 * hi, n_max)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if ok(mid) else (mid, hi)
    return hi


def seeds_to_decide(v: ClaimVerdict, n_max: int = N_MAX) -> int | None:
    """Seeds per variant an inconclusive claim needs (the most of its undecided comparisons);
    None when decided, untested, or the pilot cannot say."""
    if v.word != INCONCLUSIVE:
        return None
    needs = [seeds_for_gap(g, n_max) for g in v.gaps if g.word == INCONCLUSIVE]
    if not needs or any(n is None for n in needs):
        return None
    return max(needs)


def seeds_for_claims(verdicts) -> dict[str, int | float]:
    """claim id -> seeds per variant it needs (math.inf: more than N_MAX), for every inconclusive
    claim the pilot can project: what a fixed-n decisive run (`--seeds auto`) plans from."""
    return {v.claim.id: n for v in verdicts if (n := seeds_to_decide(v)) is not None}


def decide_command(command: str, n: int) -> str:
    """The folder's own command with --seeds n (finished runs are reused)."""
    command = command or "qkvlab compare"
    if re.search(r"--seeds[ =]\S+", command):
        return re.sub(r"--seeds[ =]\S+", f"--seeds {n}", command)
    return f"{command} --seeds {n}"


def decide_seconds(n: int, n_have: int, runs_per_seed: int, seconds_per_run: float) -> float:
    """Wall time of the missing runs: (n - n_have) seeds x runs per seed x wall seconds per run
    (as measured with this machine's parallel jobs)."""
    return max(0, n - n_have) * runs_per_seed * seconds_per_run


def seeds_cell(v: ClaimVerdict, runs_per_seed: int, seconds_per_run: float | None) -> str:
    """results.md's 'seeds to decide' cell: '24 (≈ 1:52:00 here)', '> 1000', '–' (decided) or
    'needs 2 seeds' (a pilot of one seed has no spread)."""
    if v.word != INCONCLUSIVE:
        return "–"
    n = seeds_to_decide(v)
    if n is None:
        return "needs ≥ 2 seeds" if v.seeds < 2 else "–"
    if n == math.inf:
        return f"> {N_MAX}"
    if not seconds_per_run:
        return str(n)
    return f"{n} (≈ {fmt_duration(decide_seconds(n, v.seeds, runs_per_seed, seconds_per_run))} here)"
