"""A two-level factorial at one model size: cells whose size labels differ in a few settings (the
sweep's d128 grid, `d128-L2-b16-lr0.001` ... `d128-L2-b32-lr0.002`), read through contrasts.

With 2 seeds a cell, each cell's own gap has a t interval on 1 df, too wide to say anything; the
contrasts pool the seeds of every cell. Per seed and cell, d = loss(variant) - loss(Q-K-V) (nats).
A factor's main effect is the mean d of the cells at its second level minus that at its first
(levels in the order the labels sort numerically); the interaction of two factors is the first's
effect at the second's second level minus the first's effect at its first level. Each is a contrast
sum_c w_c mean_c with a t interval from the pooled within-cell variance of d (df = sum of n_c - 1):
se^2 = s^2 sum_c w_c^2 / n_c. Seed spread only: every cell is scored on the same test windows, so
their sampling error is shared by the cells rather than a source of the contrasts' noise.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

from qkvlab.analysis.intervals import LEVEL, Interval, t_critical
from qkvlab.model.variants import BASELINE

_SETTING = re.compile(r"([A-Za-z]+)(.*)")


@dataclass(frozen=True)
class Effect:
    name: str  # "b: 16 -> 32", "b x lr"
    interval: Interval  # nats, two-sided at the level asked

    @property
    def word(self) -> str:
        if not self.interval.defined:
            return "no interval"
        if self.interval.hi < 0:
            return "lowers the gap"
        if self.interval.lo > 0:
            return "raises the gap"
        return "no effect detected"


@dataclass(frozen=True)
class Factorial:
    variant: str
    factors: dict[str, tuple[str, str]]  # name -> (first level, second level)
    cells: dict[tuple[str, ...], list[float]]  # levels in factor order -> per-seed d (nats)
    effects: list[Effect]
    df: int


def settings(label: str) -> list[tuple[str, str]]:
    """'d128-L2-b16-lr0.001' -> [('d', '128'), ('L', '2'), ('b', '16'), ('lr', '0.001')]."""
    return [(m.group(1), m.group(2)) for m in map(_SETTING.fullmatch, label.split("-")) if m]


def _level_key(level: str) -> tuple[int, float | str]:
    try:
        return (0, float(level))
    except ValueError:
        return (1, level)


def grid_factors(sizes: Sequence[str]) -> dict[str, tuple[str, str]] | None:
    """The factors of a complete two-level grid over the size labels (each setting that differs between
    labels, with its two levels), or None when the labels are not one: fewer than 4, settings that do not
    line up, a factor with other than 2 levels, or a missing cell."""
    parsed = [settings(s) for s in sizes]
    if len(sizes) < 4 or any(len(p) != len(parsed[0]) or len(p) != len(s.split("-")) for p, s in zip(parsed, sizes)):
        return None
    if any([k for k, _ in p] != [k for k, _ in parsed[0]] for p in parsed):
        return None
    factors = {}
    for i, (name, _) in enumerate(parsed[0]):
        levels = sorted({p[i][1] for p in parsed}, key=_level_key)
        if len(levels) == 2:
            factors[name] = (levels[0], levels[1])
        elif len(levels) > 2:
            return None
    cells = {tuple(v for k, v in p if k in factors) for p in parsed}
    if not factors or len(cells) != len(sizes) or len(cells) != 2 ** len(factors):
        return None
    return factors


def _contrast(cells, weights, s2: float, df: int, level: float) -> Interval:
    est = sum(weights[c] * sum(d) / len(d) for c, d in cells.items())
    n = sum(len(d) for d in cells.values())
    se = math.sqrt(s2 * sum(weights[c] ** 2 / len(d) for c, d in cells.items())) if df > 0 else math.nan
    if not se > 0:
        return Interval(est, n=n)
    half = t_critical(df, level) * se
    return Interval(est, est - half, est + half, n)


def analyse_factorial(runs, variant: str, level: float = LEVEL) -> Factorial | None:
    """Main effects and two-factor interactions of `variant`'s gap to Q-K-V over a grid of sizes at one
    N (runs: ScalingRun-like, with size, variant, seed, val_loss); None when the sizes are not a complete
    two-level grid or a cell has no paired seed."""
    sizes = sorted({r.size for r in runs})
    factors = grid_factors(sizes)
    if factors is None or len({r.size_params for r in runs}) != 1:
        return None
    names = list(factors)
    loss = {(r.size, r.variant, r.seed): r.val_loss for r in runs}
    cells: dict[tuple[str, ...], list[float]] = {}
    for size in sizes:
        key = tuple(v for k, v in settings(size) if k in factors)
        cells[key] = [
            loss[(size, variant, seed)] - loss[(size, BASELINE, seed)]
            for seed in sorted({r.seed for r in runs if r.size == size})
            if (size, variant, seed) in loss and (size, BASELINE, seed) in loss
        ]
    if any(not d for d in cells.values()):
        return None
    df = sum(len(d) - 1 for d in cells.values())
    s2 = sum(sum((x - sum(d) / len(d)) ** 2 for x in d) for d in cells.values()) / df if df > 0 else math.nan
    half = 2 ** (len(names) - 1)

    def sign(cell, i):
        return 1.0 if cell[i] == factors[names[i]][1] else -1.0

    effects = [
        Effect(
            f"{n}: {factors[n][0]} -> {factors[n][1]}",
            _contrast(cells, {c: sign(c, i) / half for c in cells}, s2, df, level),
        )
        for i, n in enumerate(names)
    ]
    for i, j in itertools.combinations(range(len(names)), 2):
        w = {c: sign(c, i) * sign(c, j) * 2 / half for c in cells}
        effects.append(Effect(f"{names[i]} x {names[j]}", _contrast(cells, w, s2, df, level)))
    return Factorial(variant, factors, cells, effects, df)
