"""Synthetic list tasks of Paper B: integer lists over 0-9, target as long as the input.

Inputs are uniform random digits drawn from a seeded ``torch.Generator``; the same
(n, length, seed) gives the same input for every task, so tasks differ only in the rule.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from qkvlab.base.errors import UserError

VOCAB_SIZE = 10  # tokens 0..9, per-token 10-way classification


def _reverse(x: torch.Tensor) -> torch.Tensor:
    return x.flip(1)


def _sort(x: torch.Tensor) -> torch.Tensor:
    return x.sort(dim=1).values


def _sub(x: torch.Tensor) -> torch.Tensor:
    return (VOCAB_SIZE - 1) - x


def _swap(x: torch.Tensor) -> torch.Tensor:
    """Exchange first and second halves. Odd length: the middle element stays in place,
    i.e. [a b c d e] -> [d e c a b], so swap is its own inverse for every length."""
    h, r = x.shape[1] // 2, x.shape[1] % 2
    return torch.cat([x[:, h + r :], x[:, h : h + r], x[:, :h]], dim=1)


def _copy(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


RULES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "reverse": _reverse,
    "sort": _sort,
    "sub": _sub,
    "swap": _swap,
    "copy": _copy,
}
TASKS = tuple(RULES)


def apply_rule(task: str, x: torch.Tensor) -> torch.Tensor:
    """The target of ``task`` for inputs ``x`` (N, L); exposed so models can be checked."""
    if task not in RULES:
        raise UserError(f"unknown synthetic task {task!r}; allowed: {', '.join(TASKS)}")
    return RULES[task](x)


def make_synthetic(task: str, n: int, length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` lists of ``length`` digits and their targets, both int64 (n, length)."""
    if task not in RULES:
        raise UserError(f"unknown synthetic task {task!r}; allowed: {', '.join(TASKS)}")
    if int(n) < 1 or int(length) < 1:
        raise UserError(f"synthetic task needs n >= 1 and length >= 1, got n={n}, length={length}")
    if int(seed) < 0:
        raise UserError(f"seed must be >= 0, got {seed}")
    g = torch.Generator().manual_seed(int(seed))
    x = torch.randint(0, VOCAB_SIZE, (int(n), int(length)), generator=g, dtype=torch.int64)
    return x, RULES[task](x)


@dataclass
class SyntheticSplits:
    """Train/val/test (x, y) pairs of one task; each split comes from its own seed."""

    task: str
    length: int
    train: tuple[torch.Tensor, torch.Tensor]
    val: tuple[torch.Tensor, torch.Tensor]
    test: tuple[torch.Tensor, torch.Tensor]
    seeds: dict[str, int]


def split_seed(seed: int, split: str) -> int:
    """Seed of one split: 3*seed + {0,1,2} is injective, so no two (seed, split) pairs ever
    share a stream. (Short lists can still repeat by chance: 10**length possible inputs.)"""
    order = ("train", "val", "test")
    if split not in order:
        raise UserError(f"unknown split {split!r}; allowed: {', '.join(order)}")
    return 3 * int(seed) + order.index(split)


def synthetic_splits(
    task: str,
    length: int,
    seed: int,
    n_train: int = 50_000,
    n_val: int = 1_000,
    n_test: int = 10_000,
) -> SyntheticSplits:
    """Paper B sizes by default (50k / 1k / 10k)."""
    sizes = {"train": n_train, "val": n_val, "test": n_test}
    seeds = {s: split_seed(seed, s) for s in sizes}
    parts = {s: make_synthetic(task, sizes[s], length, seeds[s]) for s in sizes}
    return SyntheticSplits(task=task, length=int(length), seeds=seeds, **parts)
