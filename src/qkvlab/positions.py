"""Positional machinery: rotary embeddings (Llama's convention) and Paper B's 2D score term."""

from __future__ import annotations

import math

import torch
import torch.nn as nn


def sinusoid(positions: torch.Tensor, channels: int) -> torch.Tensor:
    """Interleaved sin/cos encoding of integer positions: (...,) -> (..., channels)."""
    div = torch.exp(torch.arange(0, channels, 2, dtype=torch.float64) * (-math.log(10000.0) / channels))
    angles = positions.to(torch.float64)[..., None] * div  # (..., ceil(channels/2))
    out = torch.zeros(*positions.shape, channels, dtype=torch.float64, device=positions.device)
    out[..., 0::2] = torch.sin(angles)
    out[..., 1::2] = torch.cos(angles[..., : channels // 2])
    return out


class Rotary(nn.Module):
    """Rotary position embedding in the HF/Llama layout (rotate_half over two contiguous halves).

    cos/sin tables for positions [0, max_positions) are built once in float64 and indexed per step.
    """

    def __init__(self, head_dim: int, max_positions: int, theta: float = 10000.0):
        super().__init__()
        self.head_dim, self.max_positions, self.theta = head_dim, max_positions, theta
        self.register_buffer("cos", None, persistent=False)
        self.register_buffer("sin", None, persistent=False)
        self.build_tables()

    def build_tables(self) -> None:
        """Compute the tables (also after loading weights into a model built on the meta device)."""
        hd = self.head_dim
        inv_freq = 1.0 / (self.theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
        freqs = torch.arange(self.max_positions, dtype=torch.float64)[:, None] * inv_freq  # (P, hd/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (P, hd)
        self.cos, self.sin = emb.cos(), emb.sin()

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions (B, T) -> cos, sin of shape (B, 1, T, head_dim), broadcast over heads."""
        return self.cos[positions][:, None].to(dtype), self.sin[positions][:, None].to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, h, T, hd) rotated by position; returns a new tensor (x itself is untouched)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class ScoreTerm2D(nn.Module):
    """The "+" variants' learned term: S' = Linear(m->1)(S[..., None] + P[i, j]), shared by heads.

    P is a 2D sinusoidal encoding of (query row i, key column j): the first m/2 channels encode i,
    the last m/2 encode j. Expanded, S' = S * sum(w) + P . w + b. Because P's channels each depend
    on i alone or j alone, P . w = a(i) + c(j): we compute those two vectors instead of the (T, T, m)
    tensor, which keeps the term exact and cheap when decoding with a cache. The sinusoids of
    positions [0, max_positions) are a table built once, like the rotary tables.
    """

    def __init__(self, channels: int, max_positions: int):
        super().__init__()
        self.channels = channels
        self.weight = nn.Parameter(torch.empty(channels))
        self.bias = nn.Parameter(torch.zeros(()))
        self.max_positions = max_positions
        self.register_buffer("pe", None, persistent=False)
        self.build_tables()
        self.reset_parameters()

    def build_tables(self) -> None:
        """Compute the sinusoid table (also after loading weights into a model built on meta)."""
        self.pe = sinusoid(torch.arange(self.max_positions), self.channels // 2)

    def reset_parameters(self) -> None:
        bound = math.sqrt(6.0 / (self.channels + 1))  # Xavier-uniform of a Linear(m, 1)
        nn.init.uniform_(self.weight, -bound, bound)
        nn.init.zeros_(self.bias)

    def score_scale(self) -> torch.Tensor:
        return self.weight.sum()

    def additive(self, q_pos: torch.Tensor, k_pos: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """q_pos (B, T), k_pos (B, S) -> the additive term P . w + b, shape (B, 1, T, S)."""
        half = self.channels // 2
        w_row, w_col = self.weight[:half], self.weight[half:]
        pe = self.pe.to(self.weight.dtype)
        a = pe[q_pos] @ w_row  # (B, T)
        c = pe[k_pos] @ w_col  # (B, S)
        return (a[:, :, None] + c[:, None, :] + self.bias)[:, None].to(dtype)
