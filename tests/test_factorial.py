"""The factorial reading of a grid of sweep cells at one N: effects as contrasts of cell means with a
pooled within-cell t interval, checked against a known case and against least squares on coded factors."""

from __future__ import annotations

import itertools
import random
from dataclasses import replace

import numpy as np
import pytest
from scipy import stats

from qkvlab.analysis.factorial import analyse_factorial, grid_factors
from qkvlab.analysis.scaling import ScalingRun, analyse
from qkvlab.analysis.scaling_report import to_markdown

N = 393856


def _runs(gaps: dict[str, list[float]], base: float = 3.3) -> list[ScalingRun]:
    """Q-K-V at `base` + a per-seed offset, Q-K=V d nats above it, per cell label."""
    out = []
    for size, ds in gaps.items():
        for seed, d in enumerate(ds):
            qkv = base + 0.01 * seed
            for variant, loss in (("Q-K-V", qkv), ("Q-K=V", qkv + d)):
                out.append(ScalingRun(size, variant, seed, N, 2 * N, N, 20 * N, loss, 1000))
    return out


KNOWN = {
    "d128-L2-b16-lr0.001": [0.05, 0.07],
    "d128-L2-b16-lr0.002": [0.06, 0.04],
    "d128-L2-b32-lr0.001": [0.15, 0.17],
    "d128-L2-b32-lr0.002": [0.16, 0.14],
}


def test_grid_factors_reads_the_settings_that_differ():
    assert grid_factors(list(KNOWN)) == {"b": ("16", "32"), "lr": ("0.001", "0.002")}
    assert grid_factors(["d48-L2", "d80-L2", "d128-L2", "d208-L2"]) is None  # one factor, 4 levels: a sweep
    assert grid_factors(list(KNOWN)[:3]) is None  # a missing cell
    assert grid_factors(["d128-L2-b16-lr0.001", "d128-L2-b32-lr0.002", "d128-L4-b16-lr0.002", "d128-L4-b32"]) is None


def test_known_2x2_effects_and_intervals():
    f = analyse_factorial(_runs(KNOWN), "Q-K=V")
    assert f.df == 4
    effects = {e.name: e for e in f.effects}
    # cell means 0.06, 0.05, 0.16, 0.15; pooled s^2 = 4 * 2 * 0.01^2 / 4 = 2e-4
    t = stats.t.ppf(0.975, 4)
    batch, lr, inter = effects["b: 16 -> 32"], effects["lr: 0.001 -> 0.002"], effects["b x lr"]
    assert batch.interval.estimate == pytest.approx(0.10)
    assert batch.interval.hi - batch.interval.estimate == pytest.approx(t * 0.01)  # se^2 = 2e-4 * 4 * 0.25 / 2
    assert lr.interval.estimate == pytest.approx(-0.01)
    assert inter.interval.estimate == pytest.approx(0.0, abs=1e-12)
    assert inter.interval.hi - inter.interval.estimate == pytest.approx(t * 0.02)  # se^2 = 2e-4 * 4 * 1 / 2
    assert (batch.word, lr.word, inter.word) == ("raises the gap", "no effect detected", "no effect detected")


@pytest.mark.parametrize("k,seeds", [(2, 2), (2, 3), (3, 2)])
def test_effects_equal_least_squares_on_coded_factors(k, seeds):
    """A saturated model on +-1 codes: each main-effect coefficient is half the effect, each two-factor
    coefficient a quarter of the interaction as defined here (k = 2), with the same residual variance."""
    rng = random.Random(k * 10 + seeds)
    names = ["b", "lr", "w"][:k]
    levels = {"b": ("16", "32"), "lr": ("0.001", "0.002"), "w": ("0.0", "0.1")}
    gaps = {}
    for cell in itertools.product(*(levels[n] for n in names)):
        label = "d128-L2-" + "-".join(f"{n}{v}" for n, v in zip(names, cell))
        gaps[label] = [rng.gauss(0.1, 0.03) for _ in range(seeds)]
    f = analyse_factorial(_runs(gaps), "Q-K=V")
    rows, ys = [], []
    for label, ds in gaps.items():
        codes = [1.0 if label.split("-")[2 + i][len(n) :] == levels[n][1] else -1.0 for i, n in enumerate(names)]
        for d in ds:
            pairs = [codes[i] * codes[j] for i, j in itertools.combinations(range(k), 2)]
            triples = [np.prod(codes)] if k == 3 else []
            rows.append([1.0, *codes, *pairs, *triples])
            ys.append(d)
    x, y = np.array(rows), np.array(ys)
    beta, *_ = np.linalg.lstsq(x, y, rcond=None)
    resid = y - x @ beta
    dof = len(y) - x.shape[1]
    cov = resid @ resid / dof * np.linalg.inv(x.T @ x)
    t = stats.t.ppf(0.975, dof)
    assert f.df == dof
    coef_scale = [2.0] * k + [4.0] * (k * (k - 1) // 2)
    for e, j, c in zip(f.effects, range(1, len(f.effects) + 1), coef_scale):
        assert e.interval.estimate == pytest.approx(c * beta[j], abs=1e-12)
        assert e.interval.hi - e.interval.estimate == pytest.approx(t * c * np.sqrt(cov[j, j]), rel=1e-9)


def test_results_md_has_the_grid_section_only_for_a_grid():
    md = to_markdown(analyse(_runs(KNOWN)))
    assert "## The grid's contrasts" in md and "| b: 16 -> 32 | +0.1000 [" in md
    widths = (48, 80, 128, 208)
    sweep = {f"d{w}-L2": [0.05, 0.06] for w in widths}
    runs = [replace(r, size_params=N * w, params=N * w) for r in _runs(sweep) for w in widths if r.size == f"d{w}-L2"]
    assert "grid's contrasts" not in to_markdown(analyse(runs))


def test_grid_plot_draws_every_cell(tmp_path):
    from qkvlab.analysis.scaling_plots import plot_grid

    path = plot_grid(analyse(_runs(KNOWN)), tmp_path / "grid_gaps.png")
    assert path.stat().st_size > 10_000
