"""AdamW with nanoGPT's weight-decay groups, and linear warmup + cosine decay."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn as nn


def param_groups(model: nn.Module, weight_decay: float, lr_scale: Callable[[str], float] | None = None) -> list[dict]:
    """Matrices and embeddings (dim >= 2) are decayed; biases, norm gains and other vectors are not
    (nanoGPT, hence Paper A's code). Shared parameters (tied embeddings) appear once. `lr_scale(name)`
    (default 1) puts each parameter in a group whose "lr_scale" the loop multiplies the scheduled lr by
    (a retrofit trains its converted layers at the full rate and the rest of the model at a fraction)."""
    groups: dict[tuple[bool, float], list] = {}
    for name, p in model.named_parameters():  # named_parameters() already de-duplicates shared tensors
        if p.requires_grad:
            groups.setdefault((p.dim() >= 2, lr_scale(name) if lr_scale else 1.0), []).append(p)
    for decay in (True, False):  # the two weight-decay groups always exist, as before scales did
        if not any(d == decay for d, _ in groups):
            groups[(decay, 1.0)] = []
    return [
        {"params": ps, "weight_decay": weight_decay if decay else 0.0, "lr_scale": scale}
        for (decay, scale), ps in sorted(groups.items(), key=lambda kv: (not kv[0][0], -kv[0][1]))
    ]


def make_optimizer(
    model: nn.Module,
    lr: float,
    weight_decay: float,
    betas: tuple[float, float],
    device: torch.device,
    lr_scale: Callable[[str], float] | None = None,
) -> torch.optim.AdamW:
    # fused kernels on CUDA (one launch for all parameters) and on the CPU (one pass over each tensor
    # instead of one per elementwise op; docs/results/speed); the default foreach path elsewhere (MPS)
    fused = device.type in ("cuda", "cpu")
    groups = param_groups(model, weight_decay, lr_scale)
    return torch.optim.AdamW(groups, lr=lr, betas=betas, fused=fused or None)


def lr_at(step: int, *, lr: float, min_lr: float, warmup: int, total: int) -> float:
    """Learning rate for the 0-based optimizer step `step` (nanoGPT's get_lr, decay to `total`)."""
    if step < warmup:
        return lr * (step + 1) / (warmup + 1)
    if step >= total:
        return min_lr
    ratio = (step - warmup) / max(1, total - warmup)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (lr - min_lr)
