"""The steps of decoding with the KV cache: left-padded prompts, prefill, one decode step.

Prompts of different lengths are decoded together by left padding: each row's real tokens sit at
the right, every row carries its own positions (0 for its first real token), and ``token_mask``
marks pads so no real query ever attends to them. Row i then computes exactly what it would alone.

A step takes the model it calls as an argument: the model itself, or the decode-time tree of its
layout (`qkvlab.decode.layout.packed_model`). The eager step on the CPU is the dynamic one
(attention reads the filled slots only, as transformers does); on CUDA the static one (fixed
shapes, what CUDA graphs replay; qkvlab.model.cache).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from qkvlab.base.errors import UserError
from qkvlab.model.cache import KVCache


@dataclass
class Padded:
    """A batch of prompts, left padded: idx, positions, token_mask (B, T); lengths (B,)."""

    idx: torch.Tensor
    positions: torch.Tensor
    token_mask: torch.Tensor | None  # None when every prompt has the same length
    lengths: torch.Tensor


def left_pad(prompts: Sequence[Sequence[int]], *, pad_id: int = 0, device=None) -> Padded:
    if not prompts or any(len(p) == 0 for p in prompts):
        raise UserError("empty prompt: give at least one token to start from")
    lengths = torch.tensor([len(p) for p in prompts], device=device)
    B, T = len(prompts), int(lengths.max())
    idx = torch.full((B, T), pad_id, dtype=torch.long, device=device)
    for i, p in enumerate(prompts):
        idx[i, T - len(p) :] = torch.as_tensor(list(p), dtype=torch.long)
    shift = (T - lengths)[:, None]  # (B, 1) pads in front of each row
    slots = torch.arange(T, device=device)[None]  # (1, T)
    token_mask = slots >= shift
    positions = (slots - shift).clamp(min=0)  # pads sit at position 0; they are never attended to
    uniform = bool((lengths == T).all())
    return Padded(idx, positions, None if uniform else token_mask, lengths)


def check_prompts(model, prompts: Sequence[Sequence[int]]) -> None:
    cfg = model.cfg
    if not prompts or any(len(p) == 0 for p in prompts):
        raise UserError("empty prompt: give at least one token to start from")
    longest = max(len(p) for p in prompts)
    if longest > cfg.context:
        raise UserError(f"prompt of {longest} tokens is longer than the model's context of {cfg.context}")
    bad = [t for p in prompts for t in p if not 0 <= int(t) < cfg.vocab_size]
    if bad:
        raise UserError(f"token id {bad[0]} is outside the vocabulary [0, {cfg.vocab_size})")


def max_steps(model, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> int:
    """New tokens that fit: every token fed to the model has a position inside its context (the
    last sampled token is never fed, so a prompt of exactly `context` tokens still gets one)."""
    return max(0, min(max_new_tokens, model.cfg.context + 1 - max(len(p) for p in prompts)))


def new_cache(model, batch_size: int, max_len: int, *, static: bool = False) -> KVCache:
    p = next(model.parameters())
    return KVCache(model.cfg, batch_size, max_len, device=p.device, dtype=p.dtype, static=static)


def prefill(model, cache: KVCache, batch: Padded) -> torch.Tensor:
    """Run the padded prompts through the model into an empty cache -> logits (B, V) after each
    prompt's last token (the right edge, thanks to left padding)."""
    logits, _ = model(batch.idx, cache=cache, positions=batch.positions, token_mask=batch.token_mask)
    return logits[:, -1]


def decode_step(model, cache: KVCache, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """tokens, positions (B,) -> logits (B, V) for the token after them."""
    logits, _ = model(tokens[:, None], cache=cache, positions=positions[:, None])
    return logits[:, -1]


def eager_static(device: torch.device) -> bool:
    """The eager decode step's kind: static (fixed shapes, what CUDA graphs replay) on CUDA, dynamic
    (reads only the filled cache slots) elsewhere."""
    return device.type == "cuda"
