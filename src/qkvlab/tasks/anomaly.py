"""Set anomaly detection (Paper B): a set of `set_size` images, all of one class but one; the
model gives one logit per element and the loss is cross-entropy of the softmax over the set
against the odd element's slot. Metric: accuracy of picking it.

Elements (`features`, see `qkvlab.data.features`) are fed through `SetInput` (one Linear to
d_model): `resnet34`, the paper's 512-d features of a frozen ImageNet-pretrained ResNet34 (needs
torchvision and a local weights file); `encoder` (default, offline), the features of a small CNN
that qkvlab trains on the first half of the dataset's classes and freezes, the sets then being
drawn from the other half; `pixels`, the flattened image. Pixels and encoder features are
standardised with the training split's statistics; ResNet34 features are used raw, as the reference
does. The encoder has no positional encoding (pos='none'). The odd slot is uniform per set
(`qkvlab.data.sets`), so nothing about slot order carries the answer; `odd_slot=last` puts it in
the last slot as the reference code does (docs/results/anomaly: the slot ablation).

The "+" schemes are allowed. Their score term is positional: S' = S*sum(w) + a(i) + c(j) + b.
Under the softmax over keys a(i) and b cancel, so "+" adds a score temperature sum(w) and a
learned bias c(j) per key slot; the encoder is then not exactly permutation-equivariant, but
because the odd slot is uniform and independent of the images, slot biases carry no
information about the answer: "+" can help only through the temperature, or hurt by noise.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn as nn

from qkvlab.base.errors import UserError
from qkvlab.base.files import file_sha256
from qkvlab.base.settings import seed_setting, setting
from qkvlab.data import features as F
from qkvlab.data.images import DATASETS, ImageDataset
from qkvlab.data.sets import ODD_SLOTS, anomaly_set_indices
from qkvlab.model.config import ModelConfig
from qkvlab.model.transformer import Encoder, SetInput
from qkvlab.tasks.arrays import ArrayTask, check, check_plus_channels
from qkvlab.tasks.vision import load_splits, standardizer

# Paper B's reference setup (papers.md): CIFAR-100 ResNet34 features, d 256, 4 heads, 4 layers.
PAPER_SETUP = dict(
    dataset="cifar100", features="resnet34", d_model=256, n_head=4, n_layer=4, set_size=10, plus_channels=50
)
# Its recipe (the UvA tutorial the reference follows): the post-norm encoder of Borji's synthetic tasks
# (ReLU MLP 2d, MLP head Linear-LayerNorm-ReLU-Dropout-Linear), dropout 0.1 (and 0.1 on the input
# features, which qkvlab does not have), no positions; Adam lr 5e-4, 100 warmup steps then cosine to
# 0, clip 2, 100 epochs of 45k sets (one per training image, 10% of each class held out) at batch 64.
PAPER_RECIPE = dict(
    model=dict(
        norm_position="post",
        pos="none",
        mlp="relu",
        mlp_hidden=512,
        dropout=0.1,
        head="norm_mlp",
        bias=True,
        d_model=256,
        n_head=4,
        n_layer=4,
    ),
    train=dict(lr=5e-4, min_lr=0.0, warmup_steps=100, weight_decay=0.0, betas=(0.9, 0.999), grad_clip=2.0),
    task_options=dict(dataset="cifar100", features="resnet34", set_size=10, n_train=45_000, val_fraction=0.1),
    batch_size=64,
    epochs=100,
)


def paper_recipe(task: str = "anomaly", point: dict[str, Any] | None = None) -> dict[str, Any]:
    """PAPER_RECIPE as TrainConfig overrides (`model` and `task_options` mappings; add the user's
    `weights` and `root` task options). One point: the grid has one (d 256, 4 layers, 4 heads)."""
    r = PAPER_RECIPE
    steps = r["epochs"] * (r["task_options"]["n_train"] // r["batch_size"])
    return {
        "model": dict(r["model"]),
        "task_options": dict(r["task_options"]),
        **r["train"],
        "batch_size": r["batch_size"],
        "max_steps": steps,
    }


@dataclass
class AnomalyOptions:
    dataset: str = setting("digits", help="any image dataset of qkvlab.data.images")
    root: str | None = setting(None, help="the dataset's folder")
    set_size: int = setting(10, help="images per set: the odd one and at least two of one class", minimum=3)
    n_train: int = setting(20_000, help="training sets (drawn once from data_seed; images are shared)", minimum=1)
    n_val: int = setting(1_000, help="validation sets", minimum=1)
    n_test: int = setting(2_000, help="test sets", minimum=1)
    data_seed: int = seed_setting(0, help="which sets")
    val_fraction: float = setting(0.2, help="images held out of train for the validation sets")
    label: str | None = setting(None, help='cifar100: "fine" (default) or "coarse"')
    plus_channels: int | None = setting(
        50, help="the '+' term's m (the paper's vision m); None leaves the model config's"
    )
    features: str = setting(
        "encoder", help="encoder (offline default), resnet34 (the paper's), pixels", choices=F.FEATURES
    )
    weights: str | None = setting(None, help="features=resnet34: a local torchvision resnet34 weights file")
    encoder_steps: int = setting(400, help="features=encoder: training steps of the small CNN (batch 128)", minimum=1)
    odd_slot: str = setting(
        "random", help='random (uniform per set) or last (the reference\'s fixed slot: leaks to "+")', choices=ODD_SLOTS
    )


OPTIONS_CLASS = AnomalyOptions  # the class `qkvlab.tasks.resolve_task_options` builds


class AnomalyTask(ArrayTask):
    family = "anomaly"
    unit = "set"

    def __init__(self, name: str, options: AnomalyOptions):
        o = options
        check(o.dataset in DATASETS, name, f"unknown image dataset {o.dataset!r}; allowed: {', '.join(DATASETS)}")
        check((o.weights is not None) == (o.features == "resnet34"), name, "option weights goes with features=resnet34")
        check_plus_channels(name, o)
        if o.weights is not None and not Path(o.weights).is_file():
            raise UserError(
                f"task {name!r}: weights={o.weights}: no such file (a torchvision resnet34 .pth/.safetensors)"
            )
        self.name, self.options = name, o
        self.images: dict[str, ImageDataset] = load_splits(name, o.dataset, o.root, o.val_fraction, None, o.label)
        splits = ("train", "val", "test")
        # The sets' elements: all images, or (features=encoder) those of the classes the encoder never saw.
        first_set_class = self.images["train"].num_classes // 2 if o.features == "encoder" else 0
        check(
            self.images["train"].num_classes - first_set_class >= 2,
            name,
            f"features={o.features} leaves fewer than 2 classes for the sets",
        )
        keep = {s: (self.images[s].y >= first_set_class).nonzero().flatten() for s in splits}
        self.labels = {s: self.images[s].y[keep[s]] for s in splits}
        if o.features == "pixels":
            self.elements = {s: self.images[s].x[keep[s]] for s in splits}  # (N, C, H, W)
            self.mean, self.std = standardizer(self.elements["train"])
        else:
            feats = self._features(first_set_class)
            self.elements = {s: feats[s][keep[s]] for s in splits}  # (N, F)
            if o.features == "resnet34":  # the reference feeds the raw features
                self.mean, self.std = torch.zeros(()), torch.ones(())
            else:
                self.mean = self.elements["train"].mean(0, keepdim=True)
                self.std = self.elements["train"].std(0, keepdim=True).clamp_min(1e-6)
        n = {"train": o.n_train, "val": o.n_val, "test": o.n_test}
        # Each split's sets come from its own images and its own seed (3*seed + k never collides).
        self.sets = {
            s: anomaly_set_indices(self.labels[s], n[s], 3 * o.data_seed + k, o.set_size, o.odd_slot)
            for k, s in enumerate(splits)
        }  # (index (N, S) into elements[s], odd slot (N,))
        self.sizes = {s: int(v[1].shape[0]) for s, v in self.sets.items()}
        self.features = int(np.prod(self.elements["train"].shape[1:]))
        self.tokens_per_example = o.set_size

    def _features(self, first_set_class: int) -> dict[str, torch.Tensor]:
        """Per split, the features of every image (cached; see qkvlab.data.features)."""
        o, splits = self.options, ("train", "val", "test")
        xs = [self.images[s].x for s in splits]
        settings: dict[str, Any] = {"kind": o.features, "images": F.images_digest(*xs, self.images["train"].y)}
        if o.features == "encoder":
            settings.update(version=F.ENCODER_VERSION, steps=o.encoder_steps, classes=first_set_class, seed=0)
        else:
            settings.update(weights_sha256=file_sha256(o.weights), size=224)

        def compute() -> dict[str, torch.Tensor]:
            if o.features == "encoder":
                tr = self.images["train"]
                own = (tr.y < first_set_class).nonzero().flatten()
                net = F.train_encoder(tr.x[own], tr.y[own], o.encoder_steps)
                return {s: F.encoder_features(net, x) for s, x in zip(splits, xs)}
            net = F.resnet34(o.weights)
            if torch.cuda.is_available():
                net = net.cuda()
            return {s: F.resnet_features(net, x) for s, x in zip(splits, xs)}

        return F.cached(settings, compute)

    def adapt_config(self, cfg: ModelConfig) -> ModelConfig:
        if cfg.pos == "rope":
            raise UserError("task 'anomaly': sets have no order, so pos=rope is not allowed; use pos none")
        extra = {} if self.options.plus_channels is None else {"plus_channels": self.options.plus_channels}
        return cfg.replace(pos="none", context=self.options.set_size, causal=False, **extra)

    def build_model(self, cfg: ModelConfig) -> nn.Module:
        return Encoder(cfg, SetInput(cfg, self.features), head="element")

    def rows(self, split: str, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        items, slot = self.sets[split]
        x = (self.elements[split][items[index]].float() - self.mean) / self.std  # (B, S, C, H, W) or (B, S, F)
        return x, slot[index]

    def describe(self):
        return {
            **super().describe(),
            "features": self.features,
            "set_classes": int(self.labels["train"].unique().numel()),
        }


def make_task(name: str, options: AnomalyOptions | None = None) -> AnomalyTask:
    if name != "anomaly":
        raise UserError(f"unknown anomaly task {name!r}; allowed: anomaly")
    return AnomalyTask(name, options or AnomalyOptions())
