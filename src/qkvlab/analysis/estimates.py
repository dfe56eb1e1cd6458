"""Estimates behind the verdicts: a run's score with its evaluation's error (`Measured`), the paired
mean difference of two variants over seeds (with the fixed test set's variance), solve-rate
differences, and a variant's mean level."""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping, Sequence
from typing import NamedTuple

from qkvlab.analysis import paper_claims as pc
from qkvlab.analysis.intervals import MeanEstimate, PairedSolves, Rate, RateDifference, mean_estimate


class Measured(NamedTuple):
    """A run's score with its evaluation's own standard error (0: unknown) and scored units."""

    value: float
    se: float = 0.0
    units: int = 0
    per_unit: tuple[float, ...] | None = None  # the score of every test unit (the same units for every run)


Score = float | Measured
Values = Mapping[str, Mapping[str, Mapping[Hashable, Score]]]  # task -> variant -> key -> score


def _m(x: Score) -> Measured:
    return x if isinstance(x, Measured) else Measured(float(x))


def _scores(values: Values, tasks: Sequence[str], variant: str) -> dict[Hashable, Measured] | None:
    """Per key, the variant's mean over tasks (keys every task has; eval variances add as for a
    mean of independent test sets); None when a task lacks the variant."""
    per_task = [values.get(t, {}).get(variant) for t in tasks]
    if any(not p for p in per_task):
        return None
    keys = set.intersection(*(set(p) for p in per_task))
    out = {}
    for k in keys:
        ms = [_m(p[k]) for p in per_task]
        t = len(ms)
        if t == 1:  # one task: its units stay paired (per_unit); a mean over tasks keeps only se
            out[k] = ms[0]
            continue
        out[k] = Measured(
            sum(m.value for m in ms) / t, math.sqrt(sum(m.se**2 for m in ms)) / t, sum(m.units for m in ms)
        )
    return out


def paired_estimate(
    a: Mapping[Hashable, Score], b: Mapping[Hashable, Score], eval_variance: str = "paired units"
) -> MeanEstimate | None:
    """Mean of A - B over common keys. Its variance: the spread of the per-key differences over n
    (it holds the seed noise and the part of the evaluation noise that differs between seeds) plus
    the evaluation variance common to every seed, that of a fixed test set. With every run's
    per-unit scores on the same units, that is the spread over units of the seed-averaged
    difference over the number of units (a crossed seed x unit model; the seed-unit interaction is
    counted in both terms: conservative). Without them, se_A^2 + se_B^2 averaged over keys, added
    whole (far more conservative: it ignores that A and B are scored on the same units).
    eval_variance="independent": se_A^2 + se_B^2 even with per-unit scores (analysis versions <= 2)."""
    keys = sorted((k for k in a if k in b), key=repr)
    if not keys:
        return None
    ma, mb = [_m(a[k]) for k in keys], [_m(b[k]) for k in keys]
    diffs = [x.value - y.value for x, y in zip(ma, mb)]
    return mean_estimate(diffs, _unit_paired_var(ma, mb, eval_variance == "independent"))


def _unit_paired_var(ma: Sequence[Measured], mb: Sequence[Measured], independent: bool = False) -> float:
    lengths = {len(m.per_unit) if m.per_unit else 0 for m in (*ma, *mb)}
    if independent or len(lengths) != 1 or 0 in lengths:
        return sum(x.se**2 + y.se**2 for x, y in zip(ma, mb)) / len(ma)
    (units,) = lengths
    if units < 2:
        return 0.0
    per_unit = [sum(x.per_unit[u] - y.per_unit[u] for x, y in zip(ma, mb)) / len(ma) for u in range(units)]
    mean = sum(per_unit) / units
    return sum((d - mean) ** 2 for d in per_unit) / (units - 1) / units


def solve_estimate(a: Mapping[Hashable, Score], b: Mapping[Hashable, Score]) -> RateDifference | None:
    """Solve rate of A minus solve rate of B over common keys (solved: score >= SOLVED_ACCURACY)."""
    keys = [k for k in a if k in b]
    if not keys:
        return None
    solved = lambda s: sum(_m(s[k]).value >= pc.SOLVED_ACCURACY for k in keys)
    return RateDifference(Rate(solved(a), len(keys)), Rate(solved(b), len(keys)))


def paired_solves(a: Mapping[Hashable, Score], b: Mapping[Hashable, Score]) -> PairedSolves | None:
    """Solve-or-fail outcomes paired by key (solved: score >= SOLVED_ACCURACY), for McNemar's test."""
    keys = [k for k in a if k in b]
    if not keys:
        return None
    sa = [_m(a[k]).value >= pc.SOLVED_ACCURACY for k in keys]
    sb = [_m(b[k]).value >= pc.SOLVED_ACCURACY for k in keys]
    a_only = sum(x and not y for x, y in zip(sa, sb))
    b_only = sum(y and not x for x, y in zip(sa, sb))
    return PairedSolves(a_only, b_only, len(keys), sum(sa), sum(sb))


def level_estimate(scores: Mapping[Hashable, Score]) -> MeanEstimate | Rate:
    """A variant's mean score (at_least). When values and evaluation errors leave no spread at all
    (every seed scored alike, no se) and unit counts are known, the exact binomial rate over the
    pooled units instead: no zero-width interval."""
    ms = [_m(x) for x in scores.values()]
    est = mean_estimate([m.value for m in ms], sum(m.se**2 for m in ms) / len(ms))
    units = sum(m.units for m in ms)
    if not est.usable and len(ms) > 1 and all(m.units > 0 and 0 <= m.value <= 1 for m in ms):
        return Rate(round(sum(m.value * m.units for m in ms)), units)
    return est
