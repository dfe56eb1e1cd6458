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

With inputs="converted" the chosen layers are refined once more, in order, each on the inputs it
gets inside the converted model (the layers before it converted and refined), toward the original
layer's output on the original's inputs: attn_new(x') ≈ attn_old(x). Refined on the original's
inputs alone, every layer is fitted to a stream the converted model never produces, and the
errors of 30 layers add up; this pass lets each layer absorb part of the error upstream of it.
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
    inputs: str = "converted"  # "original": no second pass on the converted model's own inputs (module doc)


REFINE_INPUTS = ("original", "converted")


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


def refine_layer(
    new: nn.Module,
    old: nn.Module,
    xs: torch.Tensor,
    rotary,
    opts: RefineOptions,
    new_xs: torch.Tensor | None = None,
    new_rotary=None,
) -> tuple[float, float]:
    """Fit `new` (in place) to `old`'s outputs on xs (n, T, C), reading new_xs (the same windows as
    the converted model sees them; default xs); returns the relative output error (before, after)
    on the held windows (the last n // 8, at least one, never stepped on). Steps that end worse on
    those windows than the start are undone. new_rotary: the new layer's own (MLA rotates fewer
    dimensions, at another base), default `rotary`."""
    new_xs = xs if new_xs is None else new_xs
    new_rotary = rotary if new_rotary is None else new_rotary
    n_check = max(1, len(xs) // 8) if len(xs) > 1 else 0
    split = lambda t: (t[:-n_check], t[-n_check:]) if n_check else (t, t)  # noqa: E731
    (old_train, old_check), (train, check) = split(xs), split(new_xs)
    y_train, y_check = targets(old, old_train, rotary), targets(old, old_check, rotary)
    before = output_error(new, check, y_check, new_rotary)
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
            loss = ((_run(new, train[idx], new_rotary) - y_train[idx]) ** 2).mean() / scale
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    for p, w in zip(params, was):
        p.requires_grad_(w)
        p.grad = None
    after = output_error(new, check, y_check, new_rotary)
    if after > before:  # a layer the fit already matched: Adam's unit-size steps only moved it away
        with torch.no_grad():
            for p, w in zip(params, start):
                p.copy_(w)
        return before, before
    return before, after


def _capture_attention_input(block: nn.Module, run) -> torch.Tensor:
    """What block.attn reads when run() runs the block: its input after the block's own norm."""
    seen: list[torch.Tensor] = []
    hook = block.attn.register_forward_pre_hook(lambda m, args: seen.append(args[0].detach()))
    try:
        run()
    finally:
        hook.remove()
    return torch.cat(seen)


@torch.no_grad()
def refine_in_sequence(
    new, old, layers: list[int], windows: torch.Tensor, xs: list[torch.Tensor], opts: RefineOptions, chunk: int = 8
) -> dict[int, tuple[float, float]]:
    """The second pass of inputs="converted" (module doc): every layer of `layers`, first to last, refined
    in place in the model `new` on the inputs it reads there, toward `old`'s layer output on xs[i]
    (the original's inputs of the same calibration windows (n, T)). Returns {layer: (before, after)}."""
    p = next(new.parameters())
    rows = windows.to(p.device).split(chunk)
    pos = [torch.arange(r.shape[1], device=p.device)[None].expand(r.shape) for r in rows]
    rotary = new.trunk.rotary
    rope = [None if rotary is None else rotary.cos_sin(q, p.dtype) for q in pos]
    stream = [new.embed(r, q) for r, q in zip(rows, pos)]  # the residual stream, chunk by chunk
    errors = {}
    for i in range(new.cfg.n_layer):
        block = new.trunk.layer(i)
        step = lambda: [block(h, q_pos=q, rope=c) for h, q, c in zip(stream, pos, rope)]  # noqa: E731
        if i in layers:
            seen = _capture_attention_input(block, step)
            old_attn = old.trunk.layer(i).attn
            errors[i] = refine_layer(block.attn, old_attn, xs[i].to(p.device), old.trunk.rotary, opts, seen, rotary)
        stream = step()
    return errors
