"""Per-patch semantic segmentation (qkvlab's stand-in for Paper B's unpublished setup): digits
composited on a blank canvas (`qkvlab.data.segmentation`), a ViT encoder without a class token
classifies every patch as background or 1 + digit class; the label of a patch is the majority
of its pixels. Metric: mean IoU over patch labels ("miou"); also patch accuracy and pixel
accuracy (each patch's prediction painted over its pixels, against the pixel mask).

Canvases: train from the training images minus a fixed validation carve, val from the carved
images, test from the official test images, each with its own seed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from qkvlab.base.errors import UserError
from qkvlab.base.settings import seed_setting, setting
from qkvlab.data.images import DATASETS
from qkvlab.data.segmentation import make_segmentation, mean_iou, patch_labels
from qkvlab.model.config import ModelConfig
from qkvlab.model.transformer import Encoder, PatchInput
from qkvlab.tasks.arrays import ArrayTask, check, check_plus_channels
from qkvlab.tasks.vision import load_splits


@dataclass
class SegmentationOptions:
    dataset: str = setting("digits", help="single-channel image dataset the digits come from")
    root: str | None = setting(None, help="the dataset's folder")
    # 16 px of 8 px digits: 18% ink pixels (32 px: 5%); patch 2: 8x8 = 64 patches, 13% of them
    # foreground (patch 4 on 32 px: 3%)
    canvas: int = setting(16, help="canvas side in px (28 px digits: 56)", minimum=1)
    patch: int = setting(2, help="patch side in px; divides the canvas", minimum=1)
    min_digits: int = setting(1, help="fewest digits on a canvas", minimum=1)
    max_digits: int = setting(3, help="most digits on a canvas", minimum=1)
    n_train: int = setting(5_000, help="training canvases", minimum=1)
    n_val: int = setting(500, help="validation canvases", minimum=1)
    n_test: int = setting(1_000, help="test canvases", minimum=1)
    data_seed: int = seed_setting(0, help="which canvases")
    val_fraction: float = setting(0.1, help="training images held out for the validation canvases", positive=True)
    plus_channels: int | None = setting(
        50, help="the '+' term's m (the paper's vision m); None leaves the model config's"
    )


OPTIONS_CLASS = SegmentationOptions  # the class `qkvlab.tasks.resolve_task_options` builds


class SegmentationTask(ArrayTask):
    family = "segmentation"
    unit = "image"
    metric = "miou"

    def __init__(self, name: str, options: SegmentationOptions):
        o = options
        check(o.dataset in DATASETS, name, f"unknown image dataset {o.dataset!r}; allowed: {', '.join(DATASETS)}")
        check(o.canvas % o.patch == 0, name, f"patch={o.patch} must divide canvas={o.canvas}")
        check_plus_channels(name, o)
        self.name, self.options = name, o
        images = load_splits(name, o.dataset, o.root, o.val_fraction, None)
        n = {"train": o.n_train, "val": o.n_val, "test": o.n_test}
        self.data = {
            s: make_segmentation(
                n[s], 3 * o.data_seed + k, images[s], canvas=o.canvas, digits=(o.min_digits, o.max_digits)
            )
            for k, s in enumerate(("train", "val", "test"))
        }
        self.num_classes = self.data["train"].num_classes  # background + digit classes
        self.labels = {s: patch_labels(d.mask, o.patch, self.num_classes).flatten(1) for s, d in self.data.items()}
        self.sizes = {s: int(v.shape[0]) for s, v in self.labels.items()}
        self.n_patches = (o.canvas // o.patch) ** 2
        self.tokens_per_example = self.n_patches

    def adapt_config(self, cfg: ModelConfig) -> ModelConfig:
        extra = {} if self.options.plus_channels is None else {"plus_channels": self.options.plus_channels}
        return cfg.replace(context=self.n_patches, causal=False, **extra)

    def build_model(self, cfg: ModelConfig) -> nn.Module:
        inputs = PatchInput(cfg, 1, self.options.canvas, self.options.patch, cls_token=False)
        return Encoder(cfg, inputs, head="token", n_out=self.num_classes)

    def rows(self, split: str, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data[split].x[index], self.labels[split][index]  # (B, 1, H, W), (B, N patches)

    def scores(self, split, pred, target, index):
        p, side = self.options.patch, self.options.canvas // self.options.patch
        pixels = pred.view(-1, side, 1, side, 1).expand(-1, side, p, side, p).reshape(-1, side * p, side * p)
        return {
            "miou": mean_iou(pred, target, self.num_classes),
            "patch_accuracy": float((pred == target).double().mean()),
            "pixel_accuracy": float((pixels == self.data[split].mask[index]).double().mean()),
        }


def make_task(name: str, options: SegmentationOptions | None = None) -> SegmentationTask:
    if name != "segmentation":
        raise UserError(f"unknown segmentation task {name!r}; allowed: segmentation")
    return SegmentationTask(name, options or SegmentationOptions())
