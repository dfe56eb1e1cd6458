"""Interval verdicts (analysis/verdicts.py): each of the three words must come out of synthetic
results built for it, and nothing else."""

import math
import random

import pytest

from qkvlab.analysis import paper_figures as pf
from qkvlab.analysis.intervals import Interval, t_critical
from qkvlab.analysis.verdicts import (
    CONTRADICTED,
    INCONCLUSIVE,
    REPRODUCED,
    check,
    check_claims,
    combine,
    verdicts_markdown,
    word_for,
)

CLAIM = {c.id: c for c in pf.ALL_CLAIMS}
LM = ({"lm": False}, {"lm": "val_loss"})


def lm_values(offsets: dict[str, float], seeds=4, noise=0.0, seed_spread=0.3, rng_seed=0):
    """Val losses per variant per seed: a shared per-seed level (large: the seed's data order and
    init) plus the variant's offset plus independent noise."""
    rng = random.Random(rng_seed)
    level = {s: 2.0 + rng.gauss(0, seed_spread) for s in range(seeds)}
    return {"lm": {v: {s: level[s] + off + rng.gauss(0, noise) for s in range(seeds)} for v, off in offsets.items()}}


def test_word_for_regions():
    assert word_for(Interval(1.0, 0.5, 1.5, 3), 0.0, math.inf) == REPRODUCED
    assert word_for(Interval(-1.0, -1.5, -0.5, 3), 0.0, math.inf) == CONTRADICTED
    assert word_for(Interval(0.2, -0.5, 0.9, 3), 0.0, math.inf) == INCONCLUSIVE
    assert word_for(Interval(5.0, n=1), 0.0, math.inf) == INCONCLUSIVE  # one seed: never a verdict
    assert word_for(Interval(0.1, -0.5, 0.9, 3), -1.0, 1.0) == REPRODUCED
    assert word_for(Interval(3.0, 2.0, 4.0, 3), -1.0, 1.0) == CONTRADICTED
    assert word_for(Interval(1.0, 0.5, 1.5, 3), -1.0, 1.0) == INCONCLUSIVE
    assert combine([REPRODUCED, REPRODUCED]) == REPRODUCED
    assert combine([REPRODUCED, INCONCLUSIVE]) == INCONCLUSIVE
    assert combine([INCONCLUSIVE, CONTRADICTED, REPRODUCED]) == CONTRADICTED


@pytest.mark.parametrize(
    "offset,noise,seeds,word",
    [
        (-0.03, 0.002, 4, REPRODUCED),  # Id-K-V/mlp clearly better
        (+0.03, 0.002, 4, CONTRADICTED),  # clearly worse
        (-0.003, 0.02, 4, INCONCLUSIVE),  # the interval straddles 0
        (-0.30, 0.0, 1, INCONCLUSIVE),  # a huge gap, one seed: no interval
    ],
)
def test_better_claim_words(offset, noise, seeds, word):
    vals = lm_values({"Q-K-V": 0.0, "Id-K-V/mlp": offset}, seeds=seeds, noise=noise)
    v = check(CLAIM["lm-identity-mlp-better"], vals, *LM)
    assert v.word == word


def test_pairing_by_seed_removes_shared_seed_noise():
    # seeds differ by ~0.3 nats, the variant is always 0.02 better: paired -> reproduced
    vals = lm_values({"Q-K-V": 0.0, "Id-K-V/mlp": -0.02}, seeds=3, noise=0.001, seed_spread=0.3)
    assert check(CLAIM["lm-identity-mlp-better"], vals, *LM).word == REPRODUCED
    # the same values with the seeds of one variant shuffled are no longer paired: inconclusive
    mlp = vals["lm"]["Id-K-V/mlp"]
    vals["lm"]["Id-K-V/mlp"] = {0: mlp[1], 1: mlp[2], 2: mlp[0]}
    assert check(CLAIM["lm-identity-mlp-better"], vals, *LM).word == INCONCLUSIVE


def test_gap_is_perplexity_change_with_exact_paired_interval():
    vals = {"lm": {"Q-K-V": {0: 2.0, 1: 2.1, 2: 1.9}, "Id-K-V": {0: 2.01, 1: 2.13, 2: 1.905}}}
    v = check(CLAIM["lm-identity-close"], vals, *LM)
    d = [0.01, 0.03, 0.005]
    m = sum(d) / 3
    half = t_critical(2) * math.sqrt(sum((x - m) ** 2 for x in d) / 2) / math.sqrt(3)
    g = v.gaps[0]
    assert g.unit == "%" and g.interval.n == 3
    assert g.interval.estimate == pytest.approx(100 * math.expm1(m), abs=1e-12)
    assert g.interval.lo == pytest.approx(100 * math.expm1(m - half), abs=1e-12)
    assert g.interval.hi == pytest.approx(100 * math.expm1(m + half), abs=1e-12)
    assert g.paper == pytest.approx(100 * math.expm1(2.9274 - 2.9159), abs=1e-9)


@pytest.mark.parametrize(
    "offset,noise,word",
    [(0.005, 0.002, REPRODUCED), (0.08, 0.002, CONTRADICTED), (0.018, 0.01, INCONCLUSIVE)],
)
def test_close_claim_uses_its_margin(offset, noise, word):
    # lm-identity-close: |ppl change| < 2%; 0.005 nats = 0.5%, 0.08 = 8.3%, 0.018 = 1.8% with noise
    vals = lm_values({"Q-K-V": 0.0, "Id-K-V": offset}, seeds=5, noise=noise)
    v = check(CLAIM["lm-identity-close"], vals, *LM)
    assert v.gaps[0].region == (-2.0, 2.0)
    assert v.word == word


@pytest.mark.parametrize("offset,word", [(0.02, REPRODUCED), (0.10, CONTRADICTED), (-0.2, REPRODUCED)])
def test_at_most_claim_is_one_sided(offset, word):
    # lm-kv-close: Q-K=V costs at most 5%; being much better is no contradiction
    vals = lm_values({"Q-K-V": 0.0, "Q-K=V": offset}, seeds=4, noise=0.002)
    assert check(CLAIM["lm-kv-close"], vals, *LM).word == word


def test_worst_claim_needs_every_comparison():
    offsets = {"Q-K-V": 0.0, "Q-K=V": 0.05, "Q=K-V": 0.08, "Q=K=V": 0.25}
    assert check(CLAIM["lm-qkeqv-worst"], lm_values(offsets, noise=0.003), *LM).word == REPRODUCED
    v = check(CLAIM["lm-qkeqv-worst"], lm_values({**offsets, "Q=K-V": 0.40}, noise=0.003), *LM)
    assert v.word == CONTRADICTED and v.decisive.b == "Q=K-V"
    v = check(CLAIM["lm-qkeqv-worst"], lm_values({**offsets, "Q=K-V": 0.25}, noise=0.003), *LM)
    assert v.word == INCONCLUSIVE and v.decisive.b == "Q=K-V"


def test_order_claim():
    good = {"Q-K-V": 0.0, "Q-K=V": 0.03, "Q=K-V": 0.06, "Q=K=V": 0.2}
    assert check(CLAIM["lm-qkv-order"], lm_values(good, noise=0.002), *LM).word == REPRODUCED
    swapped = {**good, "Q-K=V": 0.09}
    v = check(CLAIM["lm-qkv-order"], lm_values(swapped, noise=0.002), *LM)
    assert v.word == CONTRADICTED and (v.decisive.a, v.decisive.b) == ("Q=K-V", "Q-K=V")


def task_values(task, means: dict[str, float], seeds=3, noise=0.0, rng_seed=1):
    rng = random.Random(rng_seed)
    return {task: {v: {s: min(1.0, m + rng.gauss(0, noise)) for s in range(seeds)} for v, m in means.items()}}


HIB = {t: True for t in ("mnist5k", "sub", "copy", "anomaly")}
ACC = {t: "accuracy" for t in HIB}


@pytest.mark.parametrize(
    "spread,noise,word", [(0.004, 0.001, REPRODUCED), (0.05, 0.001, CONTRADICTED), (0.008, 0.004, INCONCLUSIVE)]
)
def test_spread_claim_in_points(spread, noise, word):
    means = {"Q-K-V": 0.95, "Q=K-V": 0.95 + spread / 2, "Q=K=V": 0.95 + spread}
    v = check(CLAIM["vis-mnist-flat"], task_values("mnist5k", means, seeds=4, noise=noise), HIB, ACC)
    assert v.gaps[0].unit == "pts" and v.gaps[0].region == (-1.0, 1.0)
    assert v.word == word


def test_at_least_claim():
    vals = {t: {v: {0: 1.0, 1: 1.0, 2: 1.0} for v in ("Q-K-V", "Q=K=V")} for t in ("sub", "copy")}
    assert check(CLAIM["syn-easy-solved"], vals, HIB, ACC).word == REPRODUCED
    vals["copy"]["Q=K=V"] = {0: 0.5, 1: 0.52, 2: 0.49}
    assert check(CLAIM["syn-easy-solved"], vals, HIB, ACC).word == CONTRADICTED
    vals["copy"]["Q=K=V"] = {0: 1.0}
    vals["sub"]["Q=K=V"] = {0: 1.0}
    assert check(CLAIM["syn-easy-solved"], vals, HIB, ACC).word == INCONCLUSIVE


def test_task_gap_direction_and_paper_figure():
    vals = task_values("anomaly", {"Q-K-V": 0.90, "Q=K-V": 0.95}, seeds=3, noise=0.002)
    v = check(CLAIM["anom-shared-beats-base"], vals, HIB, ACC)
    assert v.word == REPRODUCED
    assert v.gaps[0].interval.estimate == pytest.approx(5.0, abs=0.5)
    assert v.gaps[0].paper == pytest.approx(100 * (0.954 - 0.942))
    flipped = task_values("anomaly", {"Q-K-V": 0.95, "Q=K-V": 0.90}, seeds=3, noise=0.002)
    assert check(CLAIM["anom-shared-beats-base"], flipped, HIB, ACC).word == CONTRADICTED


def test_untested_claims_and_markdown_words():
    vals = lm_values({"Q-K-V": 0.0, "Id-K-V": 0.005, "Q-K=V": 0.2}, noise=0.002)
    verdicts = check_claims(vals, *LM)
    assert {v.claim.id for v in verdicts} == {c.id for c in pf.LM_CLAIMS}  # only lm claims
    untested = [v for v in verdicts if v.word is None]
    assert any("Id-K-V/mlp" in v.note for v in untested)
    md = verdicts_markdown(verdicts)
    assert "not reproduced" not in md
    assert "**reproduced**" in md and "**contradicted**" in md
    assert "Not tested" in md and "[" in md  # intervals shown


def test_values_from_runs_pairs_by_grid_point_and_seed():
    from types import SimpleNamespace as NS

    from qkvlab.analysis.verdicts import values_from_runs

    hist = lambda acc: [{"step": 0, "tokens": 0, "accuracy": 0.1}, {"step": 9, "tokens": 90, "accuracy": acc}]
    runs = [
        NS(task="reverse", variant="Q-K-V", seed=0, point="d32", history=hist(0.5)),
        NS(task="reverse", variant="Q-K-V", seed=0, point="d64", history=hist(0.7)),
        NS(task="reverse", variant="Q=K=V", seed=0, point="d32", history=hist(0.4)),
        NS(task="lm", variant="Q-K-V", seed=1, history=[{"tokens": 5, "val_loss": 2.0}, {"tokens": 9, "lr": 0.1}]),
    ]
    vals = values_from_runs(runs, {"reverse": "accuracy", "lm": "val_loss"})
    assert vals["reverse"]["Q-K-V"] == {("d32", 0): 0.5, ("d64", 0): 0.7}
    assert vals["reverse"]["Q=K=V"] == {("d32", 0): 0.4}
    assert vals["lm"]["Q-K-V"] == {("", 1): 2.0}  # the last row that has the metric


def test_every_claim_holds_on_the_papers_own_figures():
    """Every claim must be reproduced by the numbers it was read from (else it misquotes the paper
    or its margin excludes the paper itself): three identical seeds, zero-width intervals."""
    cells = {t: dict(v) for t, v in pf.PAPER_B_TASK_METRIC.items()}
    cells["mnist5k"] = cells.pop("mnist")
    ppl = {"Q-K-V": 0.0, **pf.PAPER_B_LM_PPL_CHANGE}
    ppl.update({v: pf.lm_ppl_change(v).value for v in ("Id-K-V", "Id-K-V/mlp")})
    cells["lm"] = {v: math.log(pf.PAPER_B_LM_BASE_PPL * (1 + p / 100)) for v, p in ppl.items()}
    values = {t: {v: {s: x for s in range(3)} for v, x in row.items()} for t, row in cells.items()}
    hib = {t: t != "lm" for t in values}
    metric = {t: "val_loss" if t == "lm" else "accuracy" for t in values}
    verdicts = check_claims(values, hib, metric)
    assert len(verdicts) == len(pf.ALL_CLAIMS)
    assert {v.claim.id: v.word for v in verdicts if v.word != REPRODUCED} == {}
    # the paper's figure beside each comparison is the gap measured here
    for v in verdicts:
        for g in v.gaps:
            if g.paper is not None and g.b:
                assert g.paper == pytest.approx(g.interval.estimate, abs=1e-9)
    # the paper's mean column is the mean of its task columns
    for scheme, mean in pf.PAPER_B_SYNTHETIC_MEAN.items():
        assert abs(sum(pf.task_metric(t, scheme) for t in pf.SYNTHETIC_TASKS) / 5 - mean) < 1e-3
