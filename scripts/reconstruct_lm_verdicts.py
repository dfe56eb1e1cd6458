"""The 16-seed LM verdicts (docs/results/lm) under analysis versions 2, 3 and 4, reconstructed from
the intervals results.md published under version 3: the per-seed scores of that run were not
committed, so this is what can be checked without them (docs/analysis.md, "Versions of the rules").

    python scripts/reconstruct_lm_verdicts.py

Each comparison's seed variance comes from its published interval (df 15: the per-unit evaluation
variance of version 3 is 0.04-0.07% perplexity, negligible beside it); version 2 adds the published
evaluation variance sqrt(se_A^2 + se_B^2) = 1.35% whole. Version 4's "worst" needs Q=K=V against
Q-K=V and Q-K=V/MQA, which were not published: their standard error is bounded by the sum of the two
published ones (any correlation), the conservative end. The version 3 words must come out as
published (4 / 2 / 1): a check that the reconstruction is faithful.
"""

from __future__ import annotations

import math
from dataclasses import replace

from scipy import stats

from qkvlab.analysis import paper_claims as pc
from qkvlab.analysis.intervals import Interval, MeanEstimate, mean_estimate_from
from qkvlab.analysis.rules import VERSIONS
from qkvlab.analysis.verdicts import (
    INCONCLUSIVE,
    Gap,
    _pairs,
    _Setup,
    _words,
    decide,
    to_raw,
)

SEEDS = 16
EVAL_V2 = math.log1p(0.0135) ** 2  # docs/analysis.md: sqrt(se_A^2 + se_B^2) was 1.35% perplexity
# (A, B): (gap %, lo, hi, level) as docs/results/lm/results.md (8178b3c) shows them
PUBLISHED = {
    ("Q=K=V", "Q=K-V"): (1.84, 0.60, 3.09, 0.90),
    ("Q-K=V", "Q-K-V"): (2.14, 1.18, 3.11, 0.90),
    ("Q-K=V", "Q=K-V"): (-2.15, -3.48, -0.80, 0.90),
    ("Q=K=V", "Id-K=V"): (1.64, 0.64, 2.65, 0.90),
    ("Q=K=V", "Q-K-V"): (6.30, 4.70, 7.94, 0.95),
    ("Q-K=V/MQA", "Q-K-V"): (3.18, 1.93, 4.45, 0.95),
    ("Q-K=V/MQA", "Q-K=V"): (1.02, -0.27, 2.33, 0.90),
    ("Id-K-V", "Q-K-V"): (1.43, 0.56, 2.32, 0.90),
    ("Id-K-V/mlp", "Q-K-V"): (0.64, -0.21, 1.50, 0.90),
}


def _published(a: str, b: str) -> MeanEstimate | None:
    """The comparison's estimate in nats, its seed variance from the published interval."""
    if (b, a) in PUBLISHED:
        e = _published(b, a)
        return replace(e, estimate=-e.estimate)
    if (a, b) not in PUBLISHED:
        return None
    gap, lo, hi, level = PUBLISHED[a, b]
    half = (math.log1p(hi / 100) - math.log1p(lo / 100)) / 2
    se = half / stats.t.ppf(0.5 + level / 2, SEEDS - 1)
    return mean_estimate_from(math.log1p(gap / 100), se * se * SEEDS, 0.0, SEEDS)


def estimate(a: str, b: str) -> MeanEstimate:
    """A - B: published, else through Q-K-V with the standard errors added (the bound)."""
    e = _published(a, b)
    if e is not None:
        return e
    ea, eb = _published(a, "Q-K-V"), _published(b, "Q-K-V")
    se = ea.se + eb.se
    return mean_estimate_from(ea.estimate - eb.estimate, se * se * SEEDS, 0.0, SEEDS)


def verdicts(version: int) -> dict[str, str]:
    rules = VERSIONS[version]
    run = ("Q-K-V", "Id-K-V", "Id-K-V/mlp", "Q-K=V", "Q=K-V", "Q=V-K", "Q=K=V", "Id-K=V", "Q-K=V/MQA")
    out = {}
    for claim in pc.LM_CLAIMS:
        if claim.since > version:  # a claim added later (the run had none of its variants)
            continue
        s = _Setup(("lm",), False, True, False, rules)
        pairs = _pairs(claim, s, dict.fromkeys(run, {}))
        if version < 4 and claim.kind == "worst":  # every variant run: only the published ones can be shown
            pairs = [p for p in pairs if (p[0], p[1]) in PUBLISHED]
        gaps = []
        for a, b, region in pairs:
            est = estimate(a, b)
            if rules.eval_variance == "independent":
                est = mean_estimate_from(est.estimate, est.seed_var, EVAL_V2, SEEDS)
            raw = region.raw(to_raw("%", True))
            ph, pfail = decide(est, raw, SEEDS)
            gaps.append(Gap(a, b, Interval(est.estimate), "%", region, INCONCLUSIVE, None, est, raw, ph, pfail))
        out[claim.id] = _words(gaps, rules)[0]
    return out


def main() -> None:
    for version in (2, 3, 4):
        words = verdicts(version)
        counts = [sum(w == x for w in words.values()) for x in ("reproduced", "contradicted", "inconclusive")]
        print(f"version {version}: {' / '.join(map(str, counts))}")
        for claim, word in words.items():
            print(f"  {claim}: {word}")


if __name__ == "__main__":
    main()
