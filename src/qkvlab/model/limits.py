"""Bounds checked before allocation: a model or a training step that cannot fit the machine is
refused with one line, instead of a MemoryError traceback (or the kernel's OOM killer) later.

The estimates are lower bounds on what the tensors need, so a refusal is certain to be right;
what passes may still run out of memory on activations the bound leaves out.
"""

from __future__ import annotations

import os

import torch

from qkvlab.base.errors import UserError
from qkvlab.model.accounting import analytic_params
from qkvlab.model.config import ModelConfig

GB = 1e9


def device_memory(device: str | torch.device = "cpu") -> int | None:
    """Bytes of memory on `device` (CUDA: the GPU's; CPU: physical RAM); None if unknown."""
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_properties(device).total_memory
    if device.type == "cpu":
        try:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            return None
    return None


def table_bytes(cfg: ModelConfig) -> int:
    """The computed tables: rotary cos/sin and the '+' sinusoids (float64)."""
    tables = 0
    if cfg.pos == "rope":
        tables += 2 * cfg.context * cfg.head_dim * 8
    if cfg.spec.plus:
        tables += (1 if cfg.share_layers else cfg.n_layer) * cfg.context * (cfg.plus_channels // 2) * 8
    return tables


def model_bytes(cfg: ModelConfig, bytes_per_param: int = 4) -> int:
    """Parameters plus the computed tables."""
    return analytic_params(cfg).total * bytes_per_param + table_bytes(cfg)


def check_fits(need: int, what: str, how: str, device: str | torch.device = "cpu") -> None:
    have = device_memory(device)
    if have is not None and need > have:
        raise UserError(f"{what} needs at least {need / GB:,.1f} GB but {device} has {have / GB:,.1f} GB; {how}")


def check_model(cfg: ModelConfig, where: str, device: str | torch.device = "cpu", bytes_per_param: int = 4) -> None:
    """Before building `cfg`: its weights and tables fit in memory."""
    how = "lower the model size or --context"
    check_fits(model_bytes(cfg, bytes_per_param), f"{where} ({cfg.spec.name}, context {cfg.context:,})", how, device)


def check_training(
    cfg: ModelConfig, *, micro_batch: int, seq_len: int, shards: int = 1, device: str | torch.device = "cpu"
) -> None:
    """Before building a model to train: weights, gradients and AdamW's two moments (16 bytes per
    parameter, divided over FSDP shards) plus one micro-batch's logits (float32) fit in memory."""
    need = 16 * analytic_params(cfg).total // shards + table_bytes(cfg) + micro_batch * seq_len * cfg.vocab_size * 4
    what = f"training ({cfg.spec.name}, micro-batch {micro_batch:,} x {seq_len:,} tokens)"
    check_fits(need, what, "lower --batch-size (or raise --grad-accum), --context or the model size", device)
