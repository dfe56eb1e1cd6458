"""What a task is: how a step's batch is made, how a batch becomes a loss, how a model is scored.

The train loop knows only this interface; it never knows which projection scheme a model uses.
Batches are a pure function of (seed, step): resuming and data parallelism need no data-loader
state (rank r of W takes rows [r*B/W, (r+1)*B/W) of the global batch).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from qkvlab.model.config import ModelConfig


class Task(ABC):
    name: str = ""
    metric: str = "val_loss"  # the headline key of evaluate()'s dict
    higher_is_better: bool = False
    model_kind: str = "encoder"  # what build_model returns: "gpt" (a decoder: generate, convert) or "encoder"

    def adapt_config(self, cfg: ModelConfig) -> ModelConfig:
        """Fit a model config to the data (vocabulary size, context, causal or not)."""
        return cfg

    @abstractmethod
    def build_model(self, cfg: ModelConfig) -> nn.Module:
        """A fresh model for (adapted) cfg."""

    @abstractmethod
    def batch(self, step: int, batch_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The global training batch of `step` (inputs, targets): deterministic in (seed, step)."""

    @abstractmethod
    def loss(self, model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean loss over the batch (a scalar tensor)."""

    @abstractmethod
    def evaluate(self, model: nn.Module, *, batch_size: int, max_batches: int | None = None) -> dict[str, float]:
        """Scores on fixed validation data; must include `val_loss` and `self.metric`."""

    @property
    def has_test_split(self) -> bool:
        """Whether the task scores a test split: its own `test`, not this base's (which has none)."""
        return type(self).test is not Task.test

    def test(self, model: nn.Module, *, batch_size: int) -> dict[str, Any] | None:
        """Scores on the whole held-out test split, for verdicts: `{"split": "test", "metric": NAME,
        NAME: value, "n": units scored, "units": what a unit is, "se": the evaluation's own standard
        error of NAME (SD over units / sqrt(n), None where NAME does not decompose), ...}`. None when
        the task has no test split."""
        return None

    def lr_scale(self, name: str) -> float:
        """The fraction of the scheduled learning rate parameter `name` trains at."""
        return 1.0

    def save_artifacts(self, folder: Path) -> None:
        """Write what a model folder needs beside its weights to be used (e.g. the tokenizer)."""

    def describe(self) -> dict[str, Any]:
        """JSON-able description written beside checkpoints and results."""
        return {"task": self.name}
