"""Tasks over in-memory tensors: what the encoder task families (synthetic, vision, anomaly,
segmentation) share.

Every split is a fixed set of rows; `rows(split, index)` turns row numbers into (inputs,
targets). Training batches walk epoch permutations drawn from (seed, epoch), so `batch(step)`
is a pure function of (seed, step) that still sees every training row once per epoch.
Every model these tasks build returns logits whose last dim is the class axis and whose other
dims match the targets, so loss (cross-entropy) and accuracy (argmax) are the same code for
per-token, per-image, per-element and per-patch outputs.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from qkvlab.base.errors import UserError
from qkvlab.tasks.base import Task


def check(ok: bool, task: str, message: str) -> None:
    if not ok:
        raise UserError(f"task {task!r}: {message}")


def check_plus_channels(task: str, o: Any) -> None:
    """The '+' term's channels an array task's options set: an even number >= 2 (or None)."""
    check(
        o.plus_channels is None or (o.plus_channels >= 2 and o.plus_channels % 2 == 0),
        task,
        f"plus_channels={o.plus_channels} must be an even number >= 2",
    )


def check_seed(seed: int) -> int:
    if int(seed) < 0:
        raise UserError(f"seed must be >= 0, got {seed}")
    return int(seed)


def holdout_split(n: int, fraction: float, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(train rows, held-out rows) of a fixed permutation: the validation carve of datasets
    that ship only train/test. It does not depend on the training seed, so every run of a
    grid scores on the same rows."""
    perm = np.random.default_rng([seed, n]).permutation(n)
    n_out = int(round(n * fraction))
    return np.sort(perm[n_out:]), np.sort(perm[:n_out])


class EpochSampler:
    """Row numbers of a training batch: row p of step s is element (s*B + p) mod n of the
    permutation of epoch (s*B + p) // n, drawn from (seed, epoch). Caches the last two
    permutations (a batch spans at most two epochs when B <= n)."""

    def __init__(self, n: int):
        self.n = int(n)
        self._perms: dict[tuple[int, int], torch.Tensor] = {}

    def perm(self, seed: int, epoch: int) -> torch.Tensor:
        key = (seed, epoch)
        if key not in self._perms:
            if len(self._perms) >= 2:
                self._perms.pop(next(iter(self._perms)))
            self._perms[key] = torch.from_numpy(np.random.default_rng([seed, epoch]).permutation(self.n))
        return self._perms[key]

    def __call__(self, step: int, batch_size: int, seed: int) -> torch.Tensor:
        if int(step) < 0 or int(batch_size) < 1:
            raise UserError(f"batch needs step >= 0 and batch_size >= 1, got step={step}, batch_size={batch_size}")
        seed = check_seed(seed)
        pos = int(step) * int(batch_size) + torch.arange(int(batch_size))
        epoch, within = pos // self.n, pos % self.n
        out = torch.empty(int(batch_size), dtype=torch.long)
        for e in epoch.unique().tolist():
            sel = epoch == e
            out[sel] = self.perm(seed, e)[within[sel]]
        return out


def model_forward(model: nn.Module, inputs: torch.Tensor) -> torch.Tensor:
    """Run `model` on inputs moved to its device (float inputs also to its dtype)."""
    p = next(model.parameters())
    inputs = inputs.to(p.device, p.dtype) if inputs.is_floating_point() else inputs.to(p.device)
    return model(inputs)


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Logits (..., K) against integer targets (...)."""
    return F.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), targets.to(logits.device).reshape(-1), reduction=reduction
    )


class ArrayTask(Task):
    """A task whose splits are rows in memory. Subclasses set `self.sizes` (rows per split),
    `self.options` (a dataclass) and implement `rows`, `build_model`; they may extend `scores`."""

    metric = "accuracy"
    higher_is_better = True
    family = ""

    sizes: dict[str, int]
    options: Any
    tokens_per_example: int  # encoder positions per example (for a loop's tokens/s)

    def rows(self, split: str, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def scores(self, split: str, pred: torch.Tensor, target: torch.Tensor, index: torch.Tensor) -> dict[str, float]:
        """Metrics from the argmax predictions of rows `index` of `split`."""
        return {"accuracy": float((pred == target).double().mean())}

    # ---- Task interface ---------------------------------------------------------------------
    def batch(self, step: int, batch_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not hasattr(self, "_sampler"):
            self._sampler = EpochSampler(self.sizes["train"])
        return self.rows("train", self._sampler(step, batch_size, seed))

    def loss(self, model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return cross_entropy(model_forward(model, inputs), targets)

    @torch.no_grad()
    def evaluate(
        self, model: nn.Module, *, batch_size: int, max_batches: int | None = None, split: str = "val"
    ) -> dict[str, float]:
        """Loss and metrics on the first rows of a fixed split (`val` by default; `test` is what
        `test()` reports). Keys: `val_loss` (or `test_loss` for split='test') and the metrics."""
        if split not in self.sizes:
            raise UserError(f"task {self.name!r} has no split {split!r}; allowed: {', '.join(self.sizes)}")
        if int(batch_size) < 1:
            raise UserError(f"batch_size must be >= 1, got {batch_size}")
        n = self.sizes[split]
        if max_batches is not None:
            n = min(n, int(max_batches) * int(batch_size))
        was_training = model.training
        model.eval()
        total, count, preds, targets = 0.0, 0, [], []
        try:
            for start in range(0, n, int(batch_size)):
                index = torch.arange(start, min(n, start + int(batch_size)))
                x, y = self.rows(split, index)
                logits = model_forward(model, x)
                total += float(cross_entropy(logits, y, reduction="sum"))
                count += y.numel()
                preds.append(logits.argmax(-1).cpu())
                targets.append(y)
        finally:
            model.train(was_training)
        pred, target = torch.cat(preds), torch.cat(targets)
        return {
            f"{'test' if split == 'test' else 'val'}_loss": total / count,
            **self.scores(split, pred, target, torch.arange(n)),
        }

    unit = "example"  # what one test row is (a list, an image, a set): the unit of the evaluation's SE

    def unit_scores(self, pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor | None:
        """The headline metric per test row (n,), whose mean is the metric; None if it does not
        decompose (mIoU). Accuracy: the row's fraction of correct predictions (0/1 for one label)."""
        if self.metric != "accuracy":
            return None
        return (pred == target).double().reshape(pred.shape[0], -1).mean(-1)

    @torch.no_grad()
    def test(self, model: nn.Module, *, batch_size: int) -> dict[str, Any]:
        """Every row of the test split (keys: see Task.test; the other metrics keep their names)."""
        preds, targets, out = [], [], {}
        n = self.sizes["test"]
        was_training = model.training
        model.eval()
        try:
            for start in range(0, n, int(batch_size)):
                x, y = self.rows("test", torch.arange(start, min(n, start + int(batch_size))))
                preds.append(model_forward(model, x).argmax(-1).cpu())
                targets.append(y.cpu())
        finally:
            model.train(was_training)
        pred, target = torch.cat(preds), torch.cat(targets)
        out.update(self.scores("test", pred, target, torch.arange(n)))
        units = self.unit_scores(pred, target)
        se = None if units is None or n < 2 else float(units.std() / n**0.5)
        per_unit = None if units is None else [round(float(x), 6) for x in units]  # pairs runs unit by unit
        return {
            "split": "test",
            "metric": self.metric,
            **out,
            "n": n,
            "units": self.unit,
            "se": se,
            "per_unit": per_unit,
        }

    def describe(self) -> dict[str, Any]:
        return {
            "task": self.name,
            "family": self.family,
            "metric": self.metric,
            "sizes": dict(self.sizes),
            "tokens_per_example": self.tokens_per_example,
            "options": dataclasses.asdict(self.options),
        }
