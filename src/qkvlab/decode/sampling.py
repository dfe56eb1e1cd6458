"""Sampling the next token from logits: temperature (0 = greedy argmax), then top-k, then top-p
(nucleus), drawn with a seeded ``torch.Generator`` so a seed fixes the output. Sampling runs on the
logits' device."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from qkvlab.base.errors import UserError


@dataclass(frozen=True)
class Sampling:
    temperature: float = 1.0  # 0: greedy (top_k / top_p then play no part)
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off

    def validate(self) -> Sampling:
        if not (
            isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature) and self.temperature >= 0
        ):
            raise UserError(f"temperature={self.temperature} must be a finite number >= 0 (0 = greedy)")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise UserError(f"top_k={self.top_k} must be an integer >= 0 (0 = off)")
        if not (isinstance(self.top_p, (int, float)) and 0.0 < self.top_p <= 1.0):
            raise UserError(f"top_p={self.top_p} must be in (0, 1] (1 = off)")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """logits (B, V) -> a copy with every token outside the top-k and outside the nucleus at -inf.

    The nucleus is the smallest set of most probable tokens whose probability reaches top_p
    (the most probable token is always kept)."""
    logits = logits.clone()
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]  # (B, 1)
        logits.masked_fill_(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        before = probs.cumsum(-1) - probs  # mass of the strictly more probable tokens
        drop = before >= top_p
        drop[..., 0] = False
        logits.scatter_(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    return logits


def next_token(
    logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None = None, vocab_limit: int | None = None
) -> torch.Tensor:
    """logits (B, V) -> token ids (B,). vocab_limit: ids >= it are never drawn (a model vocabulary
    padded beyond its tokenizer's, e.g. GPT-2's 50257 ids in a 50304-row embedding)."""
    if vocab_limit is not None and vocab_limit < logits.shape[-1]:
        logits = logits[..., :vocab_limit]
    if sampling.greedy:
        return logits.argmax(-1)
    logits = filter_logits(logits.float() / sampling.temperature, sampling.top_k, sampling.top_p)
    return torch.multinomial(logits.softmax(-1), 1, generator=generator).squeeze(-1)
