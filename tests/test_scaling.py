"""Scaling analysis (analysis/scaling.py, scaling_report.py): paired gaps per size, the log-linear
fit with its slope interval and word, no prediction beyond 10x the largest size, the test split
when every run has one, and the files it writes from run folders (or from its own results.csv)."""

import csv
import json
import math
import random
import re
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from qkvlab.analysis.intervals import lack_of_fit, t_critical
from qkvlab.analysis.rules import VERSIONS
from qkvlab.analysis.scaling import (
    MAX_EXTRAPOLATION,
    NO_LINE,
    ScalingRun,
    analyse,
    predict_gap,
    read_runs,
    read_runs_csv,
)
from qkvlab.analysis.scaling_report import write_scaling_results
from qkvlab.analysis.trends import FLAT, GROWING, SHRINKING
from qkvlab.model.accounting import analytic_params
from qkvlab.model.config import ModelConfig
from qkvlab.model.variants import parse_variant

ROOT = Path(__file__).resolve().parents[1]
SIZES = {"s1": 10_000, "s2": 40_000, "s3": 160_000, "s4": 640_000}


def synthetic_runs(loss_diff, seeds=2, noise=0.0, rng_seed=0, se=0.0):
    """Q-K-V and Q-K=V at 4 sizes; Q-K=V's loss is Q-K-V's + loss_diff(N) (+ noise)."""
    rng = random.Random(rng_seed)
    runs = []
    for size, n in SIZES.items():
        for s in range(seeds):
            base = 5.0 - 0.3 * math.log10(n) + rng.gauss(0, 0.1)
            d = loss_diff(n) + rng.gauss(0, noise)
            for v, loss in (("Q-K-V", base), ("Q-K=V", base + d)):
                runs.append(ScalingRun(size, v, s, n, 2 * n, n, 5 * n, loss, 100, se=se))
    return runs


def pct(d):
    return 100 * math.expm1(d)


def test_exact_log_linear_gap_is_recovered():
    sc = analyse(synthetic_runs(lambda n: 0.1 - 0.02 * math.log10(n)))
    assert sc.sizes == list(SIZES) and sc.largest == 640_000
    (v,) = sc.variants
    for size, n in SIZES.items():
        assert v.gaps[size].estimate == pytest.approx(pct(0.1 - 0.02 * math.log10(n)), abs=1e-9)
    assert v.fit_params.slope == pytest.approx(-0.02, abs=1e-12)
    # compute C = 6 N (5 N): log10 C = log10(30) + 2 log10 N -> slope per decade of compute is half
    assert v.fit_compute.slope == pytest.approx(-0.01, abs=1e-12)


def test_no_prediction_beyond_ten_times_the_largest_size():
    runs = synthetic_runs(lambda n: 0.08 - 0.015 * math.log10(n), seeds=3, noise=0.01, rng_seed=4)
    sc = analyse(runs)
    (v,) = sc.variants
    at = MAX_EXTRAPOLATION * sc.largest
    assert predict_gap(v.fit_params, at, sc.largest).defined
    with pytest.raises(ValueError, match="10x"):
        predict_gap(v.fit_params, at * 1.01, sc.largest)
    with pytest.raises(ValueError):
        predict_gap(v.fit_params, 85e6, sc.largest)  # Paper A's 124M: 2 decades beyond


def test_prediction_interval_matches_matrix_formula_within_range():
    """Under versions <= 3 the line runs through every per-seed point."""
    runs = synthetic_runs(lambda n: 0.08 - 0.015 * math.log10(n), seeds=3, noise=0.01, rng_seed=4)
    sc = analyse(runs, rules=VERSIONS[3])
    (v,) = sc.variants
    xs = np.array([math.log10(SIZES[s]) for s, _ in v.points])
    ys = np.array([d for _, d in v.points])
    X = np.column_stack([np.ones_like(xs), xs])
    beta, *_ = np.linalg.lstsq(X, ys, rcond=None)
    resid = ys - X @ beta
    s2 = float(resid @ resid) / (len(ys) - 2)
    x0 = np.array([1.0, math.log10(2e6)])
    half = t_critical(len(ys) - 2) * math.sqrt(s2 * (1 + float(x0 @ np.linalg.inv(X.T @ X) @ x0)))
    pi = predict_gap(v.fit_params, 2e6, sc.largest)
    y0 = float(x0 @ beta)
    assert (pi.lo, pi.estimate, pi.hi) == pytest.approx((pct(y0 - half), pct(y0), pct(y0 + half)), abs=1e-9)
    # slope interval: t(df) * s / sqrt(Sxx)
    si = v.fit_params.slope_interval()
    assert si.hi - si.estimate == pytest.approx(
        t_critical(len(ys) - 2) * math.sqrt(s2 / float(((xs - xs.mean()) ** 2).sum()))
    )
    assert all(iv.n == 3 and iv.defined for iv in v.gaps.values())  # per-size paired intervals


@pytest.mark.parametrize(
    "diff,word",
    [
        (lambda n: 0.12 - 0.02 * math.log10(n), SHRINKING),  # positive gap falling toward 0
        (lambda n: 0.02 * math.log10(n) - 0.05, GROWING),  # positive gap rising
        (lambda n: -0.12 + 0.02 * math.log10(n), SHRINKING),  # negative gap rising toward 0
        (lambda n: 0.03, FLAT),
    ],
)
def test_slope_words(diff, word):
    (v,) = analyse(synthetic_runs(diff, seeds=3, noise=0.002, rng_seed=1)).variants
    assert v.slope_word == word


def test_per_size_gaps_carry_evaluation_noise():
    one = analyse(synthetic_runs(lambda n: 0.05, seeds=1, noise=0.001)).variants[0]
    assert not any(iv.defined for iv in one.gaps.values())  # one seed, no se: no interval
    assert one.fit_params is not None and one.fit_params.slope_interval().defined  # 4 points, df 2
    with_se = analyse(synthetic_runs(lambda n: 0.05, seeds=1, noise=0.001, se=0.003)).variants[0]
    iv = with_se.gaps["s1"]
    half = 1.959963984540054 * math.sqrt(2 * 0.003**2)
    assert iv.hi == pytest.approx(pct(math.log1p(iv.estimate / 100) + half), abs=1e-9)


def _write_run(root, size, name, model: ModelConfig, seed, loss, tokens, finished=True, test=None):
    d = root / size / parse_variant(name).slug / f"seed{seed}"
    d.mkdir(parents=True)
    rows = [
        {"step": 0, "tokens": 0, "val_loss": loss + 2},
        {"step": 10, "tokens": tokens, "val_loss": loss, "val_ppl": math.exp(loss)},
    ]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if finished:
        train = {"finished": True, "step": 10, "tokens": tokens, "config": {"seed": seed}}
        (d / "config.json").write_text(json.dumps({"model": model.to_dict(), "train": train}))
        (d / "model.safetensors").write_bytes(b"")
    if test is not None:
        (d / "test.json").write_text(json.dumps(test))
    return d


SHAPES = {"d16-L1": (16, 1, 2), "d32-L2": (32, 2, 2), "d64-L2": (64, 2, 4), "d96-L3": (96, 3, 6)}
VARIANTS = ["Q-K-V", "Id-K-V", "Q-K=V/MQA", "Id-K-V/mlp"]


def _sweep(runs_dir, test_se=None):
    """2 seeds x 4 variants x 4 sizes of run folders; with test_se, each with a test.json whose loss
    is the validation loss + 0.01."""
    rng = random.Random(0)
    expected_params = {}
    for size, (d, L, h) in SHAPES.items():
        base = ModelConfig(d_model=d, n_layer=L, n_head=h, vocab_size=64, context=16)
        n = analytic_params(base).non_embedding
        for seed in range(2):
            level = 3.0 - 0.2 * math.log10(n) + rng.gauss(0, 0.05)
            for i, name in enumerate(VARIANTS):
                model = parse_variant(name).apply(base)
                expected_params[(size, parse_variant(name).name, seed)] = analytic_params(model).non_embedding
                loss = level + 0.02 * i + rng.gauss(0, 0.003)
                test = (
                    None
                    if test_se is None
                    else {
                        "split": "test",
                        "metric": "loss",
                        "loss": loss + 0.01,
                        "se": test_se,
                        "n": 100,
                        "units": "windows",
                    }
                )
                _write_run(runs_dir, size, name, model, seed, loss, 5 * n, test=test)
    _write_run(runs_dir, "d96-L3", "Q=K=V", parse_variant("Q=K=V").apply(base), 0, 3.0, 10, finished=False)
    return expected_params


def test_write_scaling_results_from_run_folders(tmp_path):
    runs_dir, out = tmp_path / "runs", tmp_path / "out"
    expected_params = _sweep(runs_dir)
    runs, unfinished, source = read_runs(runs_dir)
    assert len(runs) == 32 and unfinished == ["d96-L3/Q=K=V/seed0"] and source == "validation"
    sc = write_scaling_results(runs_dir, out, command="qkvlab compare --sweep")
    assert sorted(p.name for p in out.iterdir()) == [
        "gap_vs_compute.png",
        "gap_vs_params.png",
        "results.csv",
        "results.md",
    ]
    rows = list(csv.DictReader((out / "results.csv").open()))
    assert len(rows) == 32
    for r in rows:
        assert int(r["params"]) == expected_params[(r["size"], r["variant"], int(r["seed"]))]
    assert [v.variant for v in sc.variants] == ["Id-K-V", "Id-K-V/mlp", "Q-K=V/MQA"]
    assert sc.sizes == list(SHAPES)  # ascending N
    md = (out / "results.md").read_text()
    assert "4 sizes spanning" in md and "Not finished (1)" in md and "no prediction beyond 10x" in md
    assert "at 124M" not in md and "verdict" not in md  # no extrapolation, no verdict at the papers' sizes
    assert "qkvlab compare --sweep" in md and "![gap_vs_params](gap_vs_params.png)" in md
    assert "training time summed over 32 finished runs: 0.0 min" in md
    for v in sc.variants:
        assert f"| {v.slope_word} |" in md


def test_test_split_when_every_run_has_it(tmp_path):
    _sweep(tmp_path / "runs", test_se=0.002)
    runs, _, source = read_runs(tmp_path / "runs")
    assert source == "test split" and all(r.se == 0.002 for r in runs)
    for r in runs:  # the LM task's test.json calls the loss "loss": it stands for val_loss
        metrics = [json.loads(x) for x in (tmp_path / "runs" / r.dir / "metrics.jsonl").read_text().splitlines()]
        assert r.val_loss == pytest.approx(metrics[-1]["val_loss"] + 0.01, abs=5e-7)  # to results.csv's 6 digits
    sc = write_scaling_results(tmp_path / "runs", tmp_path / "out", plots=False)
    assert sc.source == "test split" and "test split" in (tmp_path / "out" / "results.md").read_text()


def test_rerender_from_results_csv_alone(tmp_path):
    _sweep(tmp_path / "runs")
    first = write_scaling_results(tmp_path / "runs", tmp_path / "out", command="qkvlab compare --sweep", plots=False)
    only_csv = tmp_path / "docs"
    only_csv.mkdir()
    (only_csv / "results.csv").write_bytes((tmp_path / "out" / "results.csv").read_bytes())
    again = write_scaling_results(only_csv, only_csv, command="qkvlab compare --sweep", plots=False)
    rendered = (only_csv / "results.csv").read_text()
    write_scaling_results(only_csv, only_csv, plots=False)
    assert (only_csv / "results.csv").read_text() == rendered  # re-rendering its own output changes nothing
    for v, w in zip(again.variants, first.variants):  # losses were rounded to 1e-6 in the csv
        for s in v.gaps:
            assert (v.gaps[s].lo, v.gaps[s].hi) == pytest.approx((w.gaps[s].lo, w.gaps[s].hi), abs=1e-3)
    md = (only_csv / "results.md").read_text()
    assert "rendered from results.csv: the run folders are not on disk" in md


def test_lack_of_fit_by_hand():
    """Three x with two replicates each: SS pure error and SS lack of fit computed by hand."""
    xs, ys = [0, 0, 1, 1, 2, 2], [0.0, 0.2, 1.0, 1.2, 0.0, 0.2]
    # means 0.1, 1.1, 0.1; the line through all points: slope 0, intercept 0.433..; SSE = 1.4133..
    sse = sum((y - sum(ys) / 6) ** 2 for y in ys)
    pure = 3 * 2 * 0.1**2
    f = (sse - pure) / 1 / (pure / 3)
    lof = lack_of_fit(xs, ys)
    assert (lof.df_lack, lof.df_pure) == (1, 3)
    assert lof.f == pytest.approx(f, rel=1e-12) and lof.f == pytest.approx(66.666666, rel=1e-6)
    assert lof.p == pytest.approx(stats.f.sf(f, 1, 3), rel=1e-12) and lof.rejects
    assert lack_of_fit([0, 1, 2], [0.0, 1.0, 2.0]) is None  # no replicate: no pure error


def test_committed_sweep_rescored_on_size_means():
    """The sweep of docs/results/scaling, from its per-seed rows: the line through every seed is
    rejected (F = 25.3 on 2 and 14 df, p = 2.3e-5); on the four size means the slope is
    +0.058 [-0.25, +0.37] nats per 10x N (scipy's linregress), so no trend word is given."""
    runs = read_runs_csv(ROOT / "docs" / "results" / "scaling" / "results.csv")
    (v,) = analyse(runs, source="test split").variants
    lof = v.lack_of_fit
    assert (lof.df_lack, lof.df_pure) == (2, 14)
    assert lof.f == pytest.approx(25.26, abs=0.01) and lof.p == pytest.approx(2.26e-5, rel=0.01)
    sizes = list(dict.fromkeys(s for s, _ in v.points))
    x = [math.log10(runs[[r.size for r in runs].index(s)].size_params) for s in sizes]
    y = [np.mean([d for s2, d in v.points if s2 == s]) for s in sizes]
    ref = stats.linregress(x, y)
    assert v.fit_params.slope == pytest.approx(ref.slope, rel=1e-12)
    iv = v.fit_params.slope_interval()
    assert iv.hi - iv.estimate == pytest.approx(stats.t.ppf(0.975, 2) * ref.stderr, rel=1e-9)
    assert (iv.lo, iv.hi) == pytest.approx((-0.2528, 0.3681), abs=1e-4)
    assert v.slope_word == NO_LINE
    old = analyse(runs, source="test split", rules=VERSIONS[3]).variants[0]
    assert old.slope_word == GROWING and old.fit_params.slope_interval().lo > 0  # what was published


def test_per_window_scores_pair_the_sweep_and_survive_the_csv(tmp_path):
    """With every run's per-window test losses, a size's gap takes the paired per-unit evaluation
    variance (not se_A^2 + se_B^2); scores.json beside results.csv keeps them for a re-render."""
    runs_dir = tmp_path / "runs"
    _sweep(runs_dir, test_se=0.05)
    rng = random.Random(5)
    windows = [rng.gauss(3.0, 1.0) for _ in range(30)]
    for test in runs_dir.glob("*/*/*/test.json"):
        body = json.loads(test.read_text())
        shift = body["loss"] - 3.0
        body["per_unit"] = [w + shift + rng.gauss(0, 0.01) for w in windows]
        test.write_text(json.dumps(body))
    paired = write_scaling_results(runs_dir, tmp_path / "out", plots=False)
    loose = analyse([r.__class__(**{**r.__dict__, "per_unit": None}) for r in paired.runs], source="test split")
    for v, w in zip(paired.variants, loose.variants):
        for s in v.gaps:
            assert v.gaps[s].hi - v.gaps[s].lo < w.gaps[s].hi - w.gaps[s].lo  # se 0.05 added whole is wider
    only_csv = tmp_path / "docs"
    only_csv.mkdir()
    for name in ("results.csv", "scores.json"):
        (only_csv / name).write_bytes((tmp_path / "out" / name).read_bytes())
    again = write_scaling_results(only_csv, only_csv, plots=False)
    for v, w in zip(again.variants, paired.variants):
        for s in v.gaps:
            assert (v.gaps[s].lo, v.gaps[s].hi) == pytest.approx((w.gaps[s].lo, w.gaps[s].hi), abs=1e-3)


# every committed sweep folder (one with a compare.json); previous/ predates compare.json and is kept as published
COMMITTED_SWEEPS = sorted(
    p.parent.relative_to(ROOT / "docs" / "results" / "scaling").as_posix()
    for p in (ROOT / "docs" / "results" / "scaling").glob("**/compare.json")
)


@pytest.mark.parametrize("folder", COMMITTED_SWEEPS)
def test_committed_sweep_rerenders_to_its_committed_results(tmp_path, folder):
    """A committed sweep's results.md is what `compare --render` derives from the folder's own
    per-seed rows (and per-window scores, where committed) and compare.json: re-scoring reproduces
    every stored figure and word."""
    src = ROOT / "docs" / "results" / "scaling" / folder
    for name in ("results.csv", "compare.json", "scores.json", "lr_scan.json"):
        if (src / name).exists():
            (tmp_path / name).write_bytes((src / name).read_bytes())
    write_scaling_results(tmp_path, tmp_path, plots=False)
    plots = re.compile(r"## Plots\n\n(!\[[^\]]*\]\([^)]*\)\n)+\n")
    assert (tmp_path / "results.md").read_text() == plots.sub("", (src / "results.md").read_text())
    assert (tmp_path / "results.csv").read_text() == (src / "results.csv").read_text()
