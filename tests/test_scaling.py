"""Scaling analysis (analysis/scaling.py): paired gaps per size, the log-linear fit and its
prediction interval at the papers' sizes, the verdict words, and the files it writes from run
folders."""

import csv
import json
import math
import random

import numpy as np
import pytest

from qkvlab.accounting import analytic_params
from qkvlab.analysis import paper_figures as pf
from qkvlab.analysis.intervals import t_critical
from qkvlab.analysis.scaling import (
    EXTRAPOLATION_MARGIN_PCT,
    ScalingRun,
    analyse,
    read_runs,
    write_scaling_results,
)
from qkvlab.analysis.verdicts import CONTRADICTED, INCONCLUSIVE, REPRODUCED
from qkvlab.config import ModelConfig
from qkvlab.variants import parse_variant

SIZES = {"s1": 10_000, "s2": 40_000, "s3": 160_000, "s4": 640_000}
PAPER_N = {"A": 85_000_000, "B": 250_000_000}


def synthetic_runs(loss_diff, seeds=2, noise=0.0, rng_seed=0):
    """Q-K-V and Q-K=V at 4 sizes; Q-K=V's loss is Q-K-V's + loss_diff(N) (+ noise)."""
    rng = random.Random(rng_seed)
    runs = []
    for size, n in SIZES.items():
        for s in range(seeds):
            base = 5.0 - 0.3 * math.log10(n) + rng.gauss(0, 0.1)
            d = loss_diff(n) + rng.gauss(0, noise)
            for v, loss in (("Q-K-V", base), ("Q-K=V", base + d)):
                runs.append(ScalingRun(size, v, s, n, 2 * n, n, 5 * n, loss, 100))
    return runs


def pct(d):
    return 100 * math.expm1(d)


def test_exact_log_linear_gap_is_recovered():
    sc = analyse(synthetic_runs(lambda n: 0.1 - 0.02 * math.log10(n)), PAPER_N)
    assert sc.sizes == list(SIZES)
    (v,) = sc.variants
    for size, n in SIZES.items():
        assert v.gaps[size].estimate == pytest.approx(pct(0.1 - 0.02 * math.log10(n)), abs=1e-9)
    assert v.fit_params.slope == pytest.approx(-0.02, abs=1e-12)
    # compute C = 6 N (5 N): log10 C = log10(30) + 2 log10 N -> slope per decade of compute is half
    assert v.fit_compute.slope == pytest.approx(-0.01, abs=1e-12)
    assert v.extrapolated["B"].estimate == pytest.approx(pct(0.1 - 0.02 * math.log10(250e6)), abs=1e-9)


def test_prediction_interval_matches_matrix_formula():
    runs = synthetic_runs(lambda n: 0.08 - 0.015 * math.log10(n), seeds=3, noise=0.01, rng_seed=4)
    sc = analyse(runs, PAPER_N)
    (v,) = sc.variants
    xs = np.array([math.log10(SIZES[s]) for s, _ in v.points])
    ys = np.array([d for _, d in v.points])
    X = np.column_stack([np.ones_like(xs), xs])
    beta, *_ = np.linalg.lstsq(X, ys, rcond=None)
    resid = ys - X @ beta
    s2 = float(resid @ resid) / (len(ys) - 2)
    x0 = np.array([1.0, math.log10(PAPER_N["A"])])
    half = t_critical(len(ys) - 2) * math.sqrt(s2 * (1 + float(x0 @ np.linalg.inv(X.T @ X) @ x0)))
    pi = v.extrapolated["A"]
    y0 = float(x0 @ beta)
    assert pi.estimate == pytest.approx(pct(y0), abs=1e-9)
    assert (pi.lo, pi.hi) == pytest.approx((pct(y0 - half), pct(y0 + half)), abs=1e-9)
    # per-size gap: paired t-interval over the 3 seeds
    assert all(iv.n == 3 and iv.defined for iv in v.gaps.values())


def _runs_hitting(target_pct, noise):
    """Q-K=V's gap is flat at target_pct (paper: +3.1% at 300M)."""
    return synthetic_runs(lambda n: math.log1p(target_pct / 100), seeds=3, noise=noise, rng_seed=2)


@pytest.mark.parametrize(
    "target,noise,word",
    [
        (pf.PAPER_B_LM_PPL_CHANGE["Q-K=V"], 0.001, REPRODUCED),  # tight PI around the paper's figure
        (pf.PAPER_B_LM_PPL_CHANGE["Q-K=V"] + 10 * EXTRAPOLATION_MARGIN_PCT, 0.001, CONTRADICTED),
        (pf.PAPER_B_LM_PPL_CHANGE["Q-K=V"], 0.02, INCONCLUSIVE),  # PI far wider than the margin
    ],
)
def test_extrapolation_verdict_words(target, noise, word):
    (v,) = analyse(_runs_hitting(target, noise), PAPER_N).variants
    assert v.paper_key == "B"
    assert v.word == word


def test_one_seed_per_size_still_fits_but_sizes_have_no_interval():
    (v,) = analyse(synthetic_runs(lambda n: 0.05 + 0.001 * math.log10(n), seeds=1, noise=0.001), PAPER_N).variants
    assert not any(iv.defined for iv in v.gaps.values())
    assert v.fit_params is not None and v.extrapolated["A"].defined  # 4 points, df 2


def _write_run(root, size, name, model: ModelConfig, seed, loss, tokens, finished=True):
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
    return d


def test_write_scaling_results_from_run_folders(tmp_path):
    runs_dir, out = tmp_path / "runs", tmp_path / "out"
    shapes = {"d16-L1": (16, 1, 2), "d32-L2": (32, 2, 2), "d64-L2": (64, 2, 4), "d96-L3": (96, 3, 6)}
    variants = ["Q-K-V", "Id-K-V", "Q-K=V/MQA", "Id-K-V/mlp"]
    rng = random.Random(0)
    expected_params = {}
    for size, (d, L, h) in shapes.items():
        base = ModelConfig(d_model=d, n_layer=L, n_head=h, vocab_size=64, context=16)
        n = analytic_params(base).non_embedding
        for seed in range(2):
            level = 3.0 - 0.2 * math.log10(n) + rng.gauss(0, 0.05)
            for i, name in enumerate(variants):
                model = parse_variant(name).apply(base)
                expected_params[(size, parse_variant(name).name, seed)] = analytic_params(model).non_embedding
                _write_run(runs_dir, size, name, model, seed, level + 0.02 * i + rng.gauss(0, 0.003), 5 * n)
    _write_run(runs_dir, "d96-L3", "Q=K=V", parse_variant("Q=K=V").apply(base), 0, 3.0, 10, finished=False)

    runs, unfinished = read_runs(runs_dir)
    assert len(runs) == 32 and unfinished == ["d96-L3/Q=K=V/seed0"]
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
    assert {r["variant"] for r in rows} == {"Q-K-V", "Id-K-V", "Q-K=V/MQA", "Id-K-V/mlp"}
    assert [v.variant for v in sc.variants] == ["Id-K-V", "Id-K-V/mlp", "Q-K=V/MQA"]
    assert sc.sizes == list(shapes)  # ascending N
    md = (out / "results.md").read_text()
    assert "4 sizes spanning" in md and "at 124M" in md and "at 300M" in md and "Not finished (1)" in md
    assert "qkvlab compare --sweep" in md and "![gap_vs_params](gap_vs_params.png)" in md
    assert "training time summed over 32 finished runs: 0.0 min" in md
    for v in sc.variants:
        assert v.word in (REPRODUCED, CONTRADICTED, INCONCLUSIVE)
        assert f"**{v.word}**" in md
