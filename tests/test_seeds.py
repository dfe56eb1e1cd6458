"""Seeds to decide (analysis/seeds.py): the n each undecided claim needs at its margin, checked
against the defining inequality by hand, its cost and the command that runs it."""

import math
import random

import pytest
from scipy import stats

from qkvlab.analysis import paper_claims as pc
from qkvlab.analysis.seeds import N_MAX, decide_command, decide_seconds, seeds_cell, seeds_for_gap, seeds_to_decide
from qkvlab.analysis.verdicts import INCONCLUSIVE, REPRODUCED, check

CLAIM = {c.id: c for c in pc.ALL_CLAIMS}
LM = ({"lm": False}, {"lm": "val_loss"})


def lm(offsets, seeds=3, noise=0.01, rng_seed=0):
    rng = random.Random(rng_seed)
    level = {s: 2.0 + rng.gauss(0, 0.3) for s in range(seeds)}
    return {"lm": {v: {s: level[s] + o + rng.gauss(0, noise) for s in range(seeds)} for v, o in offsets.items()}}


def test_ordering_needs_an_interval_narrower_than_the_margin():
    v = check(CLAIM["lm-identity-mlp-better"], lm({"Q-K-V": 0, "Id-K-V/mlp": -0.004}), *LM)
    assert v.word == INCONCLUSIVE
    g = v.gaps[0]
    n = seeds_to_decide(v)
    s = math.sqrt(g.est.seed_var)
    width = lambda k: 2 * stats.t.ppf(0.95, k - 1) * s / math.sqrt(k)  # 90% interval, in nats
    overlap = -math.log1p(-0.006)  # between 0 and the margin -0.6% perplexity
    assert width(n) < overlap <= width(n - 1)


def test_equivalence_needs_power_at_the_observed_gap():
    v = check(CLAIM["lm-kv-close"], lm({"Q-K-V": 0, "Q-K=V": 0.03}, noise=0.02), *LM)
    assert v.word == INCONCLUSIVE
    est = v.gaps[0].est
    n = seeds_for_gap(v.gaps[0])
    dist = math.log1p(0.0465) - est.estimate  # to the non-inferiority margin +4.65%

    def band(k):
        p = est.with_n(k)
        return (stats.t.ppf(0.95, p.df) + stats.t.ppf(0.80, p.df)) * p.se

    assert band(n) < dist <= band(n - 1)


def test_decided_and_hopeless_claims():
    v = check(CLAIM["lm-identity-mlp-better"], lm({"Q-K-V": 0, "Id-K-V/mlp": -0.05}, noise=0.001), *LM)
    assert v.word == REPRODUCED and seeds_to_decide(v) is None and seeds_cell(v, 8, 10.0) == "–"
    v = check(CLAIM["lm-identity-close"], lm({"Q-K-V": 0, "Id-K-V": math.log1p(0.0119)}, noise=0.02), *LM)
    assert v.word == INCONCLUSIVE
    assert seeds_to_decide(v, n_max=50) == math.inf or seeds_to_decide(v, n_max=50) <= 50
    one = check(CLAIM["lm-identity-mlp-better"], lm({"Q-K-V": 0, "Id-K-V/mlp": -0.004}, seeds=1), *LM)
    assert seeds_to_decide(one) is None and seeds_cell(one, 8, 10.0) == "needs ≥ 2 seeds"
    assert N_MAX >= 1000


def test_cost_and_command():
    assert decide_seconds(24, 3, 8, 30.0) == 21 * 8 * 30.0
    assert decide_seconds(2, 3, 8, 30.0) == 0
    assert decide_command("qkvlab compare --task synthetic --seeds 3 --out x", 24) == (
        "qkvlab compare --task synthetic --seeds 24 --out x"
    )
    assert decide_command("qkvlab compare --seeds=3", 9) == "qkvlab compare --seeds 9"
    assert decide_command("", 5) == "qkvlab compare --seeds 5"
    v = check(CLAIM["lm-identity-mlp-better"], lm({"Q-K-V": 0, "Id-K-V/mlp": -0.004}), *LM)
    n = seeds_to_decide(v)
    assert seeds_cell(v, 8, 30.0).startswith(f"{n} (≈ ") and seeds_cell(v, 8, None) == str(n)


@pytest.mark.parametrize("k", [0, 1, 2])
def test_solve_rate_claims_get_a_seed_count(k):
    """Version 3's unpaired solve rates, and version 4's McNemar test: the discordance seen in the
    pilot, kept at more seeds (none seen: nothing to project)."""
    from qkvlab.analysis.rules import VERSIONS

    acc = lambda solved, s: 1.0 if s < solved else 0.3
    six = ("Q-K-V", "Q=K-V", "(Q=K-V)+", "Q-K=V", "(Q=K=V)+", "Q=K=V")
    vals = {"reverse": {v: {s: acc(k if v == "Q=K=V" else 2, s) for s in range(3)} for v in six}}
    tables = {"reverse": True}, {"reverse": "accuracy"}
    v = check(CLAIM["syn-qkeqv-worst-reverse"], vals, *tables, rules=VERSIONS[3])
    assert v.word == INCONCLUSIVE
    n = seeds_to_decide(v)
    assert n is not None and n > 3
    v = check(CLAIM["syn-qkeqv-solves-least-reverse"], vals, *tables)
    assert v.word == INCONCLUSIVE
    n = seeds_to_decide(v)
    if k == 2:
        assert n is None  # every pair concordant: McNemar has nothing to count
    else:
        assert n is not None and n > 3
        assert all(g.est.with_n(n).p_less() < 0.05 for g in v.gaps)


def test_seeds_for_claims_lists_the_projectable_inconclusive_claims():
    from qkvlab.analysis.seeds import seeds_for_claims
    from qkvlab.analysis.verdicts import check_claims

    vals = lm({"Q-K-V": 0, "Id-K-V/mlp": -0.004, "Id-K-V": 0.0, "Q-K=V": 0.2, "Q=K-V": 0.3, "Q=K=V": 0.6})
    verdicts = check_claims(vals, *LM)
    got = seeds_for_claims(verdicts)
    assert got and all(isinstance(n, int) and n > 3 or n == math.inf for n in got.values())
    assert set(got) == {v.claim.id for v in verdicts if v.word == INCONCLUSIVE}


def test_one_seed_cells_say_the_interval_is_evaluation_only():
    from qkvlab.analysis.intervals import Interval
    from qkvlab.analysis.report import gap_cell

    assert gap_cell(Interval(1.0, 0.9, 1.1, 1), "%") == "+1.00% [+0.90, +1.10] (1 seed: evaluation error only)"
    assert gap_cell(Interval(1.0, 0.9, 1.1, 3), "%") == "+1.00% [+0.90, +1.10]"
    assert gap_cell(Interval(1.0, n=1), "pts") == "+1.0 pts (1 seed)"
