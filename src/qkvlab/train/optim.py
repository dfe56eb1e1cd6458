"""AdamW with nanoGPT's weight-decay groups, and linear warmup + cosine decay."""

from __future__ import annotations

import math

import torch
import torch.nn as nn


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Matrices and embeddings (dim >= 2) are decayed; biases, norm gains and other vectors are not
    (nanoGPT, hence Paper A's code). Shared parameters (tied embeddings) appear once."""
    decay, no_decay = [], []
    for p in model.parameters():  # parameters() already de-duplicates shared tensors
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def make_optimizer(
    model: nn.Module, lr: float, weight_decay: float, betas: tuple[float, float], device: torch.device
) -> torch.optim.AdamW:
    # fused kernels on CUDA (one launch for all parameters) and on the CPU (one pass over each tensor
    # instead of one per elementwise op: 12 vs 52 ms per step at the 12M-parameter anchor, one thread,
    # issue 18); the default foreach path elsewhere (MPS)
    fused = device.type in ("cuda", "cpu")
    return torch.optim.AdamW(param_groups(model, weight_decay), lr=lr, betas=betas, fused=fused or None)


def lr_at(step: int, *, lr: float, min_lr: float, warmup: int, total: int) -> float:
    """Learning rate for the 0-based optimizer step `step` (nanoGPT's get_lr, decay to `total`)."""
    if step < warmup:
        return lr * (step + 1) / (warmup + 1)
    if step >= total:
        return min_lr
    ratio = (step - warmup) / max(1, total - warmup)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (lr - min_lr)
