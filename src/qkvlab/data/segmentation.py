"""Semantic segmentation of digits pasted on a blank canvas (Paper B's segmentation task is
not public, so this is qkvlab's stand-in): per-pixel labels 0 = background, 1 + class,
pooled to per-patch labels for a ViT that classifies each patch.

Each digit is cropped to its ink box and placed where its box overlaps no earlier box;
a digit that finds no free place in 50 tries is left out, so labels are never ambiguous.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from qkvlab.base.errors import UserError
from qkvlab.data.images import ImageDataset, load_images


@dataclass
class SegmentationData:
    """``x`` float (N, 1, H, W) in [0, 1]; ``mask`` int64 (N, H, W) with 0 = background and
    1 + digit class; ``num_classes`` counts the background."""

    x: torch.Tensor
    mask: torch.Tensor
    num_classes: int
    digits_per_image: torch.Tensor  # (N,) how many digits were placed


def make_segmentation(
    n: int,
    seed: int,
    source: str | ImageDataset = "digits",
    split: str = "train",
    canvas: int = 32,
    digits: tuple[int, int] = (1, 3),
    threshold: float = 0.3,
) -> SegmentationData:
    """``n`` canvases of ``canvas`` px with ``digits`` = (min, max) digits each. ``source`` is
    a dataset name for ``load_images`` (e.g. 'digits' 8 px, 'mnist5k' 28 px: use canvas=56)
    or a loaded single-channel ``ImageDataset``. Ink above ``threshold`` gets the label."""
    src = load_images(source, split=split) if isinstance(source, str) else source
    if src.x.ndim != 4 or src.x.shape[1] != 1:
        raise UserError(f"segmentation needs single-channel images (N, 1, H, W), got {tuple(src.x.shape)}")
    lo, hi = digits
    if int(n) < 1 or not 1 <= lo <= hi:
        raise UserError(f"segmentation needs n >= 1 and 1 <= min <= max digits, got n={n}, digits={digits}")
    if max(src.x.shape[2:]) > canvas:
        raise UserError(f"canvas {canvas} px is smaller than the {tuple(src.x.shape[2:])} px digits")
    if int(seed) < 0:
        raise UserError(f"seed must be >= 0, got {seed}")
    rng = np.random.default_rng(int(seed))
    glyphs = src.x[:, 0].numpy()
    labels = src.y.numpy()
    x = np.zeros((n, canvas, canvas), np.float32)
    mask = np.zeros((n, canvas, canvas), np.int64)
    placed = np.zeros(n, np.int64)
    for i in range(n):
        boxes: list[tuple[int, int, int, int]] = []
        for j in rng.choice(len(glyphs), size=rng.integers(lo, hi + 1), replace=False):
            g = glyphs[j]
            rows, cols = np.nonzero(g > threshold)
            if len(rows) == 0:
                continue
            g = g[rows.min() : rows.max() + 1, cols.min() : cols.max() + 1]
            h, w = g.shape
            for _ in range(50):
                r, c = int(rng.integers(0, canvas - h + 1)), int(rng.integers(0, canvas - w + 1))
                if all(r >= b[2] or r + h <= b[0] or c >= b[3] or c + w <= b[1] for b in boxes):
                    boxes.append((r, c, r + h, c + w))
                    x[i, r : r + h, c : c + w] = g
                    mask[i, r : r + h, c : c + w][g > threshold] = 1 + int(labels[j])
                    placed[i] += 1
                    break
    return SegmentationData(
        torch.from_numpy(x)[:, None], torch.from_numpy(mask), 1 + src.num_classes, torch.from_numpy(placed)
    )


def patch_labels(mask: torch.Tensor, patch: int, num_classes: int | None = None) -> torch.Tensor:
    """Majority label of each ``patch`` x ``patch`` block: (N, H, W) -> (N, H/patch, W/patch).
    Ties go to the lowest label (background first)."""
    n, hgt, wid = mask.shape
    if patch < 1 or hgt % patch or wid % patch:
        raise UserError(f"patch size {patch} must divide the {hgt}x{wid} mask")
    k = int(num_classes) if num_classes is not None else int(mask.max()) + 1
    blocks = mask.long().reshape(n, hgt // patch, patch, wid // patch, patch).permute(0, 1, 3, 2, 4)
    blocks = blocks.reshape(n, hgt // patch, wid // patch, patch * patch)
    if blocks.numel() and (int(blocks.min()) < 0 or int(blocks.max()) >= k):
        raise UserError(f"mask labels must lie in 0..{k - 1}")
    counts = torch.zeros(*blocks.shape[:3], k, dtype=torch.int32)
    counts.scatter_add_(-1, blocks, torch.ones_like(blocks, dtype=torch.int32))
    return counts.argmax(-1)  # argmax returns the first maximum


def mean_iou(pred: torch.Tensor, target: torch.Tensor, num_classes: int) -> float:
    """Mean over classes of |pred & target| / |pred | target|; classes absent from both are
    skipped (their IoU is undefined), not counted as 0 or 1."""
    pred, target = torch.as_tensor(pred).long().reshape(-1), torch.as_tensor(target).long().reshape(-1)
    if pred.shape != target.shape:
        raise UserError(f"mean_iou: pred has {pred.numel()} labels, target {target.numel()}")
    for name, t in (("pred", pred), ("target", target)):
        if t.numel() and (int(t.min()) < 0 or int(t.max()) >= num_classes):
            raise UserError(f"mean_iou: {name} labels must lie in 0..{num_classes - 1}")
    conf = torch.bincount(target * num_classes + pred, minlength=num_classes**2).reshape(num_classes, num_classes)
    inter = conf.diag().double()
    union = conf.sum(0).double() + conf.sum(1).double() - inter
    present = union > 0
    if not bool(present.any()):
        raise UserError("mean_iou: no labels at all (empty inputs)")
    return float((inter[present] / union[present]).mean())
