"""The retrofit's refinement: each converted layer's attention fitted to the original layer's output.

The closed-form fit (retrofit_fit.py) matches value activations, but what the rest of the network
reads is the attention *output* (out_proj's, added to the residual stream), and a value fit that
is good in R² can still move that output by more than its own norm (SmolLM2's layer 23: relative
output error 2.05 after the fit). Refinement takes Adam steps on the converted layer's own weights
(query rows, shared key/value rows, out_proj) to minimise

    ||attn_new(x) - attn_old(x)||² / ||attn_old(x)||²

over windows x of the layer's real inputs (the original model's, after its norm). One layer at a
time, so a step costs one attention layer on a few windows, not the model: it is the cheap local
part before any end-to-end distillation. The error is measured on calibration windows the steps
never saw, and it is what `--cache-budget` ranks layers by (sensitivity by output, not by R²).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn


@dataclass(frozen=True)
class RefineOptions:
    steps: int = 150  # Adam steps per layer (0: the closed-form fit alone)
    lr: float = 1e-3  # peak learning rate, cosine to 0
    batch: int = 4  # windows per step
    seed: int = 0  # batch order


def _run(attn: nn.Module, x: torch.Tensor, rotary) -> torch.Tensor:
    """One attention layer on its own: x (B, T, C) -> (B, T, C), positions 0..T-1, causal."""
    B, T, _ = x.shape
    pos = torch.arange(T, device=x.device)[None].expand(B, T)
    rope = None if rotary is None else rotary.cos_sin(pos, x.dtype)
    return attn(x, q_pos=pos, rope=rope)


@torch.no_grad()
def targets(attn: nn.Module, xs: torch.Tensor, rotary, chunk: int = 8) -> torch.Tensor:
    """The original layer's outputs on windows xs (n, T, C)."""
    return torch.cat([_run(attn, x, rotary) for x in xs.split(chunk)])


@torch.no_grad()
def output_error(attn: nn.Module, xs: torch.Tensor, ys: torch.Tensor, rotary, chunk: int = 8) -> float:
    """||attn(xs) - ys||² / ||ys||² over windows xs (n, T, C) and the original's outputs ys."""
    num = sum(float(((_run(attn, x, rotary) - y) ** 2).sum()) for x, y in zip(xs.split(chunk), ys.split(chunk)))
    den = float((ys**2).sum())
    return num / den if den > 0 else 0.0


def refine_layer(new: nn.Module, old: nn.Module, xs: torch.Tensor, rotary, opts: RefineOptions) -> tuple[float, float]:
    """Fit `new` (in place) to `old`'s outputs on xs (n, T, C); returns the relative output error
    (before, after) on the held windows (the last n // 8, at least one, never stepped on). Steps
    that end worse on those windows than the start are undone."""
    n_check = max(1, len(xs) // 8) if len(xs) > 1 else 0
    train, check = (xs[:-n_check], xs[-n_check:]) if n_check else (xs, xs)
    y_train, y_check = targets(old, train, rotary), targets(old, check, rotary)
    before = output_error(new, check, y_check, rotary)
    if opts.steps == 0:
        return before, before
    params = list(new.parameters())
    was = [p.requires_grad for p in params]
    start = [p.detach().clone() for p in params]
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.Adam(params, lr=opts.lr)
    gen = torch.Generator().manual_seed(opts.seed)
    scale = float((y_train**2).mean()) or 1.0  # the loss in units of the output's energy
    with torch.enable_grad():
        for step in range(opts.steps):
            for group in opt.param_groups:
                group["lr"] = opts.lr * 0.5 * (1 + math.cos(math.pi * step / opts.steps))
            idx = torch.randint(len(train), (min(opts.batch, len(train)),), generator=gen)
            loss = ((_run(new, train[idx], rotary) - y_train[idx]) ** 2).mean() / scale
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    for p, w in zip(params, was):
        p.requires_grad_(w)
        p.grad = None
    after = output_error(new, check, y_check, rotary)
    if after > before:  # a layer the fit already matched: Adam's unit-size steps only moved it away
        with torch.no_grad():
            for p, w in zip(params, start):
                p.copy_(w)
        return before, before
    return before, after
