"""Gap trajectories and their last-half trend (analysis/trends.py) on synthetic histories."""

import math
import random

import pytest

from qkvlab.analysis.intervals import ols
from qkvlab.analysis.trends import (
    FLAT,
    GROWING,
    SHRINKING,
    format_trend,
    gap_trajectory,
    plot_gap_trajectories,
    trend,
    trends_markdown,
)

TOKENS = [i * 1_000_000 for i in range(11)]  # 0 .. 10M tokens, 11 evaluations


def histories(gap_nats, seeds=3, noise=0.0, rng_seed=0):
    """Baseline and variant val-loss histories per seed: a falling shared curve plus a per-seed
    level; the variant adds gap_nats(t) (+ noise)."""
    rng = random.Random(rng_seed)
    base, var = {}, {}
    for s in range(seeds):
        level = rng.gauss(0, 0.2)
        curve = [(t, 4.0 * math.exp(-t / 3e6) + 2.0 + level) for t in TOKENS]
        base[s] = curve
        var[s] = [(t, y + gap_nats(t) + rng.gauss(0, noise)) for t, y in curve]
    return var, base


def test_trajectory_is_paired_perplexity_change():
    var, base = histories(lambda t: 0.05)
    traj = gap_trajectory("Q-K=V", var, base, perplexity=True)
    assert traj.tokens == TOKENS and traj.n == 3 and traj.unit == "%"
    assert all(g == pytest.approx(100 * math.expm1(0.05), abs=1e-9) for g in traj.mean)
    # seeds differ: the seed mean is taken over loss differences, then shown as a perplexity change
    uneven = gap_trajectory("X", {0: [(5, 2.3)], 1: [(5, 1.9)]}, {0: [(5, 2.0)], 1: [(5, 2.0)]}, perplexity=True)
    assert uneven.mean == pytest.approx([100 * math.expm1(0.1)], abs=1e-12)
    assert uneven.per_key[0] == [(5, pytest.approx(100 * math.expm1(0.3), abs=1e-12))]
    # tasks: metric points
    acc = gap_trajectory("Q=K-V", {0: [(0, 0.5), (10, 0.8)]}, {0: [(0, 0.4), (10, 0.9)]}, perplexity=False)
    assert acc.mean == pytest.approx([10.0, -10.0]) and acc.unit == "pts"


def test_trajectory_uses_common_evaluations_and_needs_a_baseline():
    var = {0: [(0, 1.0), (5, 1.0), (10, 1.0)], 1: [(0, 1.0), (10, 1.0)]}
    base = {0: [(0, 1.0), (5, 1.0), (10, 1.0)], 1: [(0, 1.0), (5, 1.0), (10, 1.0)]}
    assert gap_trajectory("X", var, base, perplexity=True).tokens == [0, 10]
    assert gap_trajectory("X", {7: [(0, 1.0)]}, base, perplexity=True) is None


@pytest.mark.parametrize(
    "gap,word",
    [
        (lambda t: 0.10 - 0.008 * t / 1e6, SHRINKING),  # positive gap closing
        (lambda t: 0.02 + 0.004 * t / 1e6, GROWING),  # positive gap widening
        (lambda t: -0.02 - 0.004 * t / 1e6, GROWING),  # negative gap widening
        (lambda t: -0.10 + 0.008 * t / 1e6, SHRINKING),  # negative gap closing
    ],
)
def test_trend_words(gap, word):
    var, base = histories(gap, noise=0.0005)
    tr = trend(gap_trajectory("V", var, base, perplexity=True))
    assert tr.word == word and tr.points == 6


def test_flat_when_the_slope_interval_contains_zero():
    var, base = histories(lambda t: 0.05, noise=0.01, rng_seed=3)
    tr = trend(gap_trajectory("V", var, base, perplexity=True))
    assert tr.per_10pct.lo < 0 < tr.per_10pct.hi and tr.word == FLAT


def test_slope_is_ols_over_last_half_of_seed_mean():
    var, base = histories(lambda t: 0.01 * (t / 1e6) ** 1.5, noise=0.003, rng_seed=5)
    traj = gap_trajectory("V", var, base, perplexity=True)
    tr = trend(traj)
    pts = [(t / 1e6, y) for t, y in zip(traj.tokens, traj.mean) if t >= 5e6]
    fit = ols([x for x, _ in pts], [y for _, y in pts])
    assert tr.per_m_tokens.estimate == pytest.approx(fit.slope, rel=1e-12)
    assert tr.per_10pct.estimate == pytest.approx(fit.slope * 1.0, rel=1e-12)  # 10% of 10M = 1M tokens
    assert tr.per_10pct.hi - tr.per_10pct.lo == pytest.approx(2 * (fit.slope_interval().hi - fit.slope), rel=1e-9)


def test_too_few_points_give_no_word():
    tr = trend(gap_trajectory("V", {0: [(0, 2.0), (10, 2.1)]}, {0: [(0, 2.0), (10, 2.0)]}, perplexity=True))
    assert tr.word is None and "needs 3" in format_trend(tr)


def test_markdown_and_plot(tmp_path):
    var, base = histories(lambda t: 0.10 - 0.008 * t / 1e6, noise=0.0005)
    traj = gap_trajectory("Q-K=V", var, base, perplexity=True)
    tr = trend(traj)
    md = trends_markdown([("lm", traj, tr)])
    assert "shrinking" in md and "per 10% of training" in md
    path = plot_gap_trajectories({"lm": [(traj, tr)]}, tmp_path / "gap_trend.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_trajectories_from_runs():
    from types import SimpleNamespace as NS

    from qkvlab.analysis.trends import trajectories_from_runs

    def run(variant, seed, offset):
        rows = [{"step": i, "tokens": 100 * i, "val_loss": 3.0 - 0.1 * i + offset} for i in range(8)]
        return NS(task="lm", variant=variant, seed=seed, history=rows)

    runs = [run("Q-K-V", 0, 0.0), run("Q-K-V", 1, 0.2), run("Q-K=V", 0, 0.05), run("Q-K=V", 1, 0.25)]
    runs.append(run("Q=K=V", 5, 0.0))  # no baseline with seed 5: no trajectory
    (row,) = trajectories_from_runs(runs, {"lm": "val_loss"})
    task, traj, tr = row
    assert (task, traj.variant, traj.n) == ("lm", "Q-K=V", 2)
    assert traj.mean == pytest.approx([100 * math.expm1(0.05)] * 8, abs=1e-9)
    assert tr.word == FLAT
