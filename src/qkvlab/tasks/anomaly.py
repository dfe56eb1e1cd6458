"""Set anomaly detection (Paper B): a set of `set_size` images, all of one class but one; the
model gives one logit per element and the loss is cross-entropy of the softmax over the set
against the odd element's slot. Metric: accuracy of picking it.

Elements are flattened, standardised pixels fed through `SetInput` (one Linear to d_model);
the encoder has no positional encoding (pos='none'). The odd slot is uniform per set
(`qkvlab.data.sets`), so nothing about slot order carries the answer.

The "+" schemes are allowed. Their score term is positional: S' = S*sum(w) + a(i) + c(j) + b.
Under the softmax over keys a(i) and b cancel, so "+" adds a score temperature sum(w) and a
learned bias c(j) per key slot; the encoder is then not exactly permutation-equivariant, but
because the odd slot is uniform and independent of the images, slot biases carry no
information about the answer: "+" can help only through the temperature, or hurt by noise.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn

from qkvlab.config import ModelConfig
from qkvlab.data.images import DATASETS, ImageDataset
from qkvlab.data.sets import anomaly_set_indices
from qkvlab.errors import UserError
from qkvlab.model import Encoder, SetInput
from qkvlab.tasks.arrays import ArrayTask, check, check_common, parse_options
from qkvlab.tasks.vision import load_splits, standardizer

# Paper B's reference setup (papers.md): CIFAR-100 images, d 256, 4 heads, 4 layers.
PAPER_SETUP = dict(dataset="cifar100", d_model=256, n_head=4, n_layer=4, set_size=10, plus_channels=50)


@dataclass
class AnomalyOptions:
    dataset: str = "digits"  # any image dataset of qkvlab.data.images
    root: str | None = None
    set_size: int = 10
    n_train: int = 20_000  # sets (drawn once from data_seed; images are shared between sets)
    n_val: int = 1_000
    n_test: int = 2_000
    data_seed: int = 0
    val_fraction: float = 0.2  # images held out of train for the validation sets
    label: str | None = None  # cifar100: "fine" (default) or "coarse"
    plus_channels: int | None = 50  # the paper's vision m; None leaves the model config's


class AnomalyTask(ArrayTask):
    family = "anomaly"

    def __init__(self, name: str, options: AnomalyOptions):
        o = options
        check(o.dataset in DATASETS, name, f"unknown image dataset {o.dataset!r}; allowed: {', '.join(DATASETS)}")
        check(o.set_size >= 3, name, f"set_size={o.set_size} must be >= 3")
        check_common(name, o)
        self.name, self.options = name, o
        self.images: dict[str, ImageDataset] = load_splits(name, o.dataset, o.root, o.val_fraction, None, o.label)
        self.mean, self.std = standardizer(self.images["train"].x)
        n = {"train": o.n_train, "val": o.n_val, "test": o.n_test}
        # Each split's sets come from its own images and its own seed (3*seed + k never collides).
        self.sets = {
            s: anomaly_set_indices(self.images[s].y, n[s], 3 * o.data_seed + k, o.set_size)
            for k, s in enumerate(("train", "val", "test"))
        }  # (index (N, S), odd slot (N,))
        self.sizes = {s: int(v[1].shape[0]) for s, v in self.sets.items()}
        self.features = int(np.prod(self.images["train"].x.shape[1:]))
        self.tokens_per_example = o.set_size

    def adapt_config(self, cfg: ModelConfig) -> ModelConfig:
        if cfg.pos == "rope":
            raise UserError("task 'anomaly': sets have no order, so pos=rope is not allowed; use pos none")
        extra = {} if self.options.plus_channels is None else {"plus_channels": self.options.plus_channels}
        return cfg.replace(pos="none", context=self.options.set_size, causal=False, **extra)

    def build_model(self, cfg: ModelConfig) -> nn.Module:
        return Encoder(cfg, SetInput(cfg, self.features), head="element")

    def rows(self, split: str, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        items, slot = self.sets[split]
        x = (self.images[split].x[items[index]].float() - self.mean) / self.std  # (B, S, C, H, W)
        return x, slot[index]

    def describe(self):
        return {**super().describe(), "features": self.features}


def make_task(name: str, **options) -> AnomalyTask:
    if name != "anomaly":
        raise UserError(f"unknown anomaly task {name!r}; allowed: anomaly")
    return AnomalyTask(name, parse_options(AnomalyOptions, name, options))
