"""The orderings the papers claim, as checkable predicates over the figures of
:mod:`qkvlab.analysis.paper_figures` (each claim's text quotes the figures it rests on).

A claim is data here, with its margin (the smallest effect of interest, from the papers' own
figures by one rule per kind; versioned in :mod:`qkvlab.analysis.rules`, docs/analysis.md tells when
each rule was written relative to the runs); :mod:`qkvlab.analysis.verdicts` checks it with
one-sided tests at 5% over seeds and answers ``reproduced``, ``contradicted`` or ``inconclusive``
(or "not tested" when a variant or task it needs was not run).
"""

from __future__ import annotations

from dataclasses import dataclass

from qkvlab.analysis.paper_figures import (
    PAPER_A_NON_EMBEDDING_M,
    PAPER_B_LM_PPL_CHANGE,
    PAPER_B_SCHEMES,
    SYNTHETIC_TASKS,
    task_metric,
)

# ---- how a run is read ---------------------------------------------------------------------------
# Solve-or-fail tasks: a run either learns the rule (token accuracy near 1) or stalls far below, so
# their single-task claims compare solve rates over runs, not mean accuracies (docs/analysis.md).
SOLVE_OR_FAIL_TASKS = ("reverse", "swap")
SOLVED_ACCURACY = 0.95  # a run "solves" when at most 1 token in 20 is wrong

# Margins are fixed from the papers alone (neither paper reports a run-to-run spread):
SESOI_FRACTION = 0.5  # ordering claims: half the paper's own gap (the smallest of the claim's)
BOUND_FACTOR = 1.5  # "costs at most" / "all within": the paper's own figure plus half of it


@dataclass(frozen=True)
class Claim:
    """A statement of a paper about how variants rank (checked by :mod:`qkvlab.analysis.verdicts`).

    kind: "better" (variants[0] beats variants[1]), "worst" / "best" (variants[0] is worst /
    best of every variant the run has), "close" (variants[0] within ± margin of variants[1]),
    "at_most" (variants[0] worse than variants[1] by less than margin), "spread" (every pair of
    variants run within ± margin), "order" (variants listed best to worst), "at_least" (every
    variant run above the threshold). With several tasks, a variant's score is its mean over them.

    margin: in the gap's unit (percent of perplexity for language modelling, points = hundredths
    of the metric for tasks): for better / worst / best / order the smallest effect of interest
    (the claim is contradicted when the data exclude an effect that large), for close / spread the
    equivalence margin, for at_most the non-inferiority margin. threshold: of "at_least", in the
    metric's own unit. why: the margin's reason, from the papers only (docs/analysis.md's table).
    """

    id: str
    paper: str
    text: str
    kind: str
    tasks: tuple[str, ...]
    variants: tuple[str, ...] = ()
    margin: float = 0.0
    threshold: float = 0.0
    why: str = ""
    since: int = 1  # the analysis version that introduced the claim (qkvlab.analysis.rules)
    solve: bool = False  # solve-or-fail reading: paired solve outcomes over seeds, McNemar's exact test


# Quality per cache byte from scratch (compare/recipes.py CACHE_ROUTES), registered before its runs (version 6):
# DeepSeek-V2's orderings (arXiv 2405.04434, Tables 8, 9: benchmark accuracy only) and what it and Paper B imply
# together about routes neither ran beside the other. An accuracy gap has no perplexity equivalent, so every
# margin comes from Paper B's perplexities by the rules above.
_MLA50, _MLA25 = "Q-K-V/latent=56/rope=8", "Q-K-V/latent=24/rope=8"
_DSV2_WHY = (
    "DeepSeek-V2 reports accuracy only: half the smallest perplexity gap between attention variants the papers "
    "read as an effect (Paper B's GQA-4, +0.7%: MHA above GQA, the ordering of DeepSeek-V2's Table 8)"
)
_KV_WHY = (
    "half the gap the papers imply: MLA at or above MHA (DeepSeek-V2), K=V at MHA +3.1% (Paper B; +3.9% with GQA-4)"
)
_T9 = "Table 9: above MHA in 7 of 8 benchmark cells with 14% and 4% of its cache"


def _cache_claim(name: str, paper: str, text: str, kind: str, variants: tuple[str, ...], margin: float, why: str):
    """A language-modelling claim of analysis version 6 (the cache comparison's)."""
    return Claim(name, paper, text, kind, ("lm",), variants, margin=margin, why=why, since=6)


CACHE_CLAIMS = (
    _cache_claim(
        "cache-mla-beats-mha-50",
        "DeepSeek-V2",
        f"MLA at 50% of the cache beats MHA ({_T9})",
        "better",
        (_MLA50, "Q-K-V"),
        0.35,
        _DSV2_WHY,
    ),
    _cache_claim(
        "cache-mla-beats-mha-25",
        "DeepSeek-V2",
        f"MLA at 25% of the cache beats MHA ({_T9})",
        "better",
        (_MLA25, "Q-K-V"),
        0.35,
        _DSV2_WHY,
    ),
    _cache_claim(
        "cache-mha-gqa-mqa-order",
        "DeepSeek-V2",
        "perplexity: Q-K-V < Q-K-V/GQA-2 < Q-K-V/MQA (Table 8, 7B dense: MMLU 45.2, 41.2, 37.9)",
        "order",
        ("Q-K-V", "Q-K-V/GQA-2", "Q-K-V/MQA"),
        0.35,
        _DSV2_WHY,
    ),
    _cache_claim(
        "cache-mla-beats-kv-50",
        "DeepSeek-V2 + B (implied)",
        "at equal cache (50%) MLA beats K=V",
        "better",
        (_MLA50, "Q-K=V"),
        1.55,
        _KV_WHY,
    ),
    _cache_claim(
        "cache-mla-beats-kv-25",
        "DeepSeek-V2 + B (implied)",
        "at equal cache (25%) MLA beats K=V with GQA-2",
        "better",
        (_MLA25, "Q-K=V/GQA-2"),
        1.55,
        _KV_WHY,
    ),
    _cache_claim(
        "cache-gqa-beats-kv-50",
        "B (implied)",
        "at equal cache (50%) GQA beats K=V (300M: GQA-4 +0.7% at a quarter of the cache, K=V +3.1% at half)",
        "better",
        ("Q-K-V/GQA-2", "Q-K=V"),
        1.19,
        "half the gap Paper B's figures imply, 1.031/1.007 − 1 = +2.38% (GQA at half the cache, with twice "
        "the heads of its GQA-4, taken to cost no more)",
    ),
    _cache_claim(
        "cache-mla-cost-50",
        "B (its bar)",
        "MLA at 50% of the cache costs at most what Paper B allows its half-cache route (K=V, +3.1%)",
        "at_most",
        (_MLA50, "Q-K-V"),
        4.65,
        "1.5 × Paper B's cost of K=V, as lm-kv-close",
    ),
    _cache_claim(
        "cache-mla-cost-25",
        "B (its bar)",
        "MLA at 25% of the cache costs at most what Paper B allows its quarter-cache route (GQA-4, +0.7%)",
        "at_most",
        (_MLA25, "Q-K-V"),
        1.05,
        "1.5 × Paper B's cost of GQA-4 of 16 heads",
    ),
)

_HALF = "half the paper's smallest gap of the claim"
# Language modelling claims read the "lm" task's loss (lower is better); gaps and margins are
# perplexity changes in percent.
LM_CLAIMS = (
    Claim(
        "lm-qkv-order",
        "B",
        "perplexity: Q-K-V < Q-K=V < Q=K-V < Q=K=V (300M: 0, +3.1, +4.9, +25.4%)",
        "order",
        ("lm",),
        ("Q-K-V", "Q-K=V", "Q=K-V", "Q=K=V"),
        margin=0.87,
        why=f"{_HALF}: Q=K-V vs Q-K=V, 1.049/1.031 − 1 = +1.75%",
    ),
    Claim(
        "lm-qkeqv-worst",
        "B",
        "Q=K=V is the worst variant (+25.4%)",
        "worst",
        ("lm",),
        ("Q=K=V",),
        margin=9.77,
        why=f"{_HALF}: Q=K=V vs Q=K-V, 1.254/1.049 − 1 = +19.5%",
    ),
    Claim(
        "lm-kv-before-qk",
        "B",
        "sharing K=V costs less than sharing Q=K (+3.1% vs +4.9%)",
        "better",
        ("lm",),
        ("Q-K=V", "Q=K-V"),
        margin=0.86,
        why="half the paper's gap: 1.031/1.049 − 1 = −1.72%",
    ),
    Claim(
        "lm-kv-close",
        "B",
        "Q-K=V stays close to Q-K-V (+3.1%)",
        "at_most",
        ("lm",),
        ("Q-K=V", "Q-K-V"),
        margin=4.65,
        why="1.5 × the paper's own cost, +3.1%",
    ),
    Claim(
        "lm-mqa-cheap",
        "B",
        "adding MQA to Q-K=V costs little more (+4.8% vs +3.1%)",
        "at_most",
        ("lm",),
        ("Q-K=V/MQA", "Q-K=V"),
        margin=2.47,
        why="1.5 × the paper's own cost, 1.048/1.031 − 1 = +1.65%",
    ),
    Claim(
        "lm-identity-close",
        "A",
        "Id-K-V matches Q-K-V (+1.2% in the authors' older run)",
        "close",
        ("lm",),
        ("Id-K-V", "Q-K-V"),
        margin=1.19,
        why="the only gap Paper A reads as an effect (Id-K-V/mlp beats Q-K-V: exp(3.004 − 3.016) − 1 = −1.19%); "
        "a match must be closer than a win",
    ),
    Claim(
        "lm-identity-close-size-matched",
        "A",
        "Id-K-V matches Q-K-V at equal parameters (the size-matched baseline Q-K-V/mlp=Id-K-V; no loss reported)",
        "close",
        ("lm",),
        ("Id-K-V", "Q-K-V/mlp=Id-K-V"),
        margin=1.19,
        why="as Id-K-V vs Q-K-V: removing W_Q and having 8% fewer parameters told apart (Paper A's "
        "original_smaller_mlp, 77.88M non-embedding, like Id-K-V)",
        since=5,
    ),
    Claim(
        "lm-identity-mlp-better",
        "A",
        "Id-K-V with the saved parameters in the MLP beats Q-K-V (3.004 vs 3.016)",
        "better",
        ("lm",),
        ("Id-K-V/mlp", "Q-K-V"),
        margin=0.60,
        why="half the paper's gap, exp(3.004 − 3.016) − 1 = −1.19%",
    ),
    *CACHE_CLAIMS,
)

_SYN_ALL = SYNTHETIC_TASKS
_SOLVE = (
    "in solve-rate points (a gap of g accuracy points between solve-or-fail variants is at least g solve-rate points)"
)
SYNTHETIC_CLAIMS = (
    Claim(
        "syn-qkeqv-worst-reverse",
        "B",
        "Q=K=V is the worst scheme on Reverse (.514)",
        "worst",
        ("reverse",),
        ("Q=K=V",),
        margin=3.35,
        why=f"{_HALF} (.514 vs .581), {_SOLVE}",
    ),
    Claim(
        "syn-qkeqv-worst-swap",
        "B",
        "Q=K=V is the worst scheme on Swap (.446)",
        "worst",
        ("swap",),
        ("Q=K=V",),
        margin=6.5,
        why=f"{_HALF} (.446 vs .576), {_SOLVE}",
    ),
    Claim(
        "syn-qkeqv-solves-least-reverse",
        "B",
        "Q=K=V solves Reverse in fewer seeds than each other scheme (solve-or-fail reading of .514)",
        "worst",
        ("reverse",),
        ("Q=K=V",),
        why="no margin: McNemar's exact test over seeds (the paper reports accuracy, not solve rates)",
        since=4,
        solve=True,
    ),
    Claim(
        "syn-qkeqv-solves-least-swap",
        "B",
        "Q=K=V solves Swap in fewer seeds than each other scheme (solve-or-fail reading of .446)",
        "worst",
        ("swap",),
        ("Q=K=V",),
        why="no margin: McNemar's exact test over seeds (the paper reports accuracy, not solve rates)",
        since=4,
        solve=True,
    ),
    Claim(
        "syn-plus-helps-qkeqv",
        "B",
        "the '+' term helps Q=K=V (mean .823 vs .780)",
        "better",
        _SYN_ALL,
        ("(Q=K=V)+", "Q=K=V"),
        margin=2.15,
        why="half the paper's gap of the five-task means, 4.3 points",
    ),
    Claim(
        "syn-plus-helps-qeqk",
        "B",
        "the '+' term helps Q=K-V (mean .870 vs .854)",
        "better",
        _SYN_ALL,
        ("(Q=K-V)+", "Q=K-V"),
        margin=0.83,
        why="half the paper's gap of the five-task means, 1.66 points",
    ),
    Claim(
        "syn-plus-best",
        "B",
        "(Q=K-V)+ has the best mean accuracy (.870)",
        "best",
        _SYN_ALL,
        ("(Q=K-V)+",),
        margin=0.83,
        why=f"{_HALF}: vs Q=K-V, 1.66 points",
    ),
    Claim(
        "syn-kv-close",
        "B",
        "Q-K=V is close to Q-K-V in mean accuracy (.850 vs .851)",
        "close",
        _SYN_ALL,
        ("Q-K=V", "Q-K-V"),
        margin=1.66,
        why="the smallest gap Paper B reads as an effect on this table ('+' helps Q=K-V: 1.66 points)",
    ),
    Claim(
        "syn-easy-solved",
        "B",
        "every scheme solves Sub and Copy (1.0)",
        "at_least",
        ("sub", "copy"),
        threshold=0.99,
        why="the paper's 1.0 less one point",
    ),
)

VISION_CLAIMS = (
    Claim(
        "vis-mnist-flat",
        "B",
        "on MNIST (5k subset here) all schemes are close (.976-.982)",
        "spread",
        ("mnist5k",),
        margin=0.9,
        why="1.5 × the paper's own spread, 0.6 points",
    ),
    Claim(
        "vis-fmnist-flat",
        "B",
        "on Fashion-MNIST all schemes are close (.875-.887)",
        "spread",
        ("fashion-mnist",),
        margin=1.8,
        why="1.5 × the paper's own spread, 1.2 points",
    ),
    Claim(
        "vis-cifar10-qkeqv",
        "B",
        "Q=K=V is the best scheme on CIFAR-10 (.672)",
        "best",
        ("cifar10",),
        ("Q=K=V",),
        margin=0.15,
        why=f"{_HALF}: vs (Q=K=V)+, 0.3 points",
    ),
    Claim(
        "vis-cifar100-qkeqv",
        "B",
        "Q=K=V is the best scheme on CIFAR-100 (.376)",
        "best",
        ("cifar100",),
        ("Q=K=V",),
        margin=0.35,
        why=f"{_HALF}: vs Q=K-V, 0.7 points",
    ),
)

ANOMALY_CLAIMS = (
    Claim(
        "anom-plus-helps-qkeqv",
        "B",
        "the '+' term helps Q=K=V on anomaly detection (.961 vs .933)",
        "better",
        ("anomaly",),
        ("(Q=K=V)+", "Q=K=V"),
        margin=1.4,
        why="half the paper's gap, 2.8 points",
    ),
    Claim(
        "anom-plus-helps-qeqk",
        "B",
        "the '+' term helps Q=K-V on anomaly detection (.966 vs .954)",
        "better",
        ("anomaly",),
        ("(Q=K-V)+", "Q=K-V"),
        margin=0.6,
        why="half the paper's gap, 1.2 points",
    ),
    Claim(
        "anom-qkeqv-worst",
        "B",
        "Q=K=V is the worst scheme on anomaly detection (.933)",
        "worst",
        ("anomaly",),
        ("Q=K=V",),
        margin=0.45,
        why=f"{_HALF}: vs Q-K-V, 0.9 points",
    ),
    Claim(
        "anom-shared-beats-base",
        "B",
        "Q=K-V beats Q-K-V on anomaly detection (.954 vs .942)",
        "better",
        ("anomaly",),
        ("Q=K-V", "Q-K-V"),
        margin=0.6,
        why="half the paper's gap, 1.2 points",
    ),
)

ALL_CLAIMS = LM_CLAIMS + SYNTHETIC_CLAIMS + VISION_CLAIMS + ANOMALY_CLAIMS


PAPER_A_VARIANTS = ("Q-K-V", *(v for v in PAPER_A_NON_EMBEDDING_M if v != "Q-K-V"))
PAPER_B_LM_VARIANTS = ("Q-K-V", *PAPER_B_LM_PPL_CHANGE)


def paper_variants(claim: Claim) -> tuple[str, ...]:
    """The variants the claim's paper ran on the claim's tasks (what a worst/best claim ranks over
    from analysis version 4): Paper B's LM table, Paper A's five models, or Paper B's schemes with
    a figure on every task of the claim."""
    if claim.tasks == ("lm",):
        return PAPER_A_VARIANTS if claim.paper == "A" else PAPER_B_LM_VARIANTS
    return tuple(v for v in PAPER_B_SCHEMES if all(task_metric(t, v) is not None for t in claim.tasks))
