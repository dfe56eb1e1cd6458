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


class SinusoidalPositions(nn.Module):
    """Fixed input positions (Vaswani et al.; Borji's encoder): sinusoid(p, d_model) added to the
    input at position p. The table for [0, max_positions) is computed, not stored (build_tables)."""

    def __init__(self, max_positions: int, d_model: int):
        super().__init__()
        self.max_positions, self.d_model = max_positions, d_model
        self.register_buffer("table", None, persistent=False)
        self.build_tables()

    def build_tables(self) -> None:
        self.table = sinusoid(torch.arange(self.max_positions), self.d_model).float()  # (P, d)

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        """positions (...,) -> (..., d_model)."""
        return self.table[positions]


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
        """positions (B, T) -> cos, sin of shape (B, 1, T, head_dim), broadcast over heads. Under
        autocast in its dtype (q and k leave the projections in it and reach attention in it)."""
        if torch.is_autocast_enabled(self.cos.device.type):
            dtype = torch.get_autocast_dtype(self.cos.device.type)
        return self.cos[positions][:, None].to(dtype), self.sin[positions][:, None].to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, h, T, hd) rotated by position; returns a new tensor (x itself is untouched)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


PLUS_ENCODINGS = ("original", "halves")


def axis_encodings(
    positions: torch.Tensor, channels: int, encoding: str = "original"
) -> tuple[torch.Tensor, torch.Tensor]:
    """The 2D encoding's two parts at integer positions: (row part (P, r), column part (P, m - r)).

    original: `positional_encodings.PositionalEncoding2D(m)`, which Borji's code calls: c = 2*ceil(m/4)
    channels of each axis with frequencies 10000^(-2k/c), rows first, cut to m (m = 10: 6 row + 4
    column channels). halves: m/2 + m/2 with frequencies over m/2 (the Brainchip reconstruction).
    """
    if encoding == "halves":
        return sinusoid(positions, channels // 2), sinusoid(positions, channels - channels // 2)
    if encoding != "original":
        raise ValueError(f"unknown 2D encoding {encoding!r}; allowed: {', '.join(PLUS_ENCODINGS)}")
    c = 2 * math.ceil(channels / 4)
    axis = sinusoid(positions, c)  # (P, c): the same table for rows and columns
    return axis[:, : min(c, channels)], axis[:, : max(0, channels - c)]


def encoding_2d(rows: int, cols: int, channels: int, encoding: str = "original") -> torch.Tensor:
    """P[i, j] of the "+" term: (rows, cols, channels) float64; channel k depends on i alone (the
    row part) or j alone (the column part)."""
    row, _ = axis_encodings(torch.arange(rows), channels, encoding)
    _, col = axis_encodings(torch.arange(cols), channels, encoding)
    return torch.cat((row[:, None].expand(rows, cols, -1), col[None].expand(rows, cols, -1)), dim=-1)


def plus_channels_pad(head_dim: int) -> int:
    """Extra channels for the "+" key term: at least one, up to a multiple of 8 (flash kernels' head dims)."""
    return -(head_dim + 1) % 8 + 1


LEGACY_KEYS = ("score_term.bias",)  # parameters older checkpoints hold that never acted: loaded and dropped


def is_legacy_key(name: str) -> bool:
    return name.endswith(LEGACY_KEYS)


class ScoreTerm2D(nn.Module):
    """The "+" variants' learned term: S' = Linear(m->1)(S[..., None] + P[i, j]), shared by heads.

    P = encoding_2d(T, T, m): a 2D sinusoidal encoding of (query row i, key column j) whose channels
    each depend on i alone or j alone. Expanded, S' = S * sum(w) + a(i) + c(j) + b with
    P . w = a(i) + c(j). Under the softmax over keys a(i) and b are constant along each row and cancel
    exactly (their gradients are zero), so only the temperature sum(w) and the key term c(j) act: the
    bias is not a parameter (checkpoints that hold one load, the value is dropped) and a(i) is never
    computed when attending. c(j) rides inside the attention dot product (attention.ride_key_term),
    which keeps causal flash attention and the cache exact. The per-axis sinusoids of positions
    [0, max_positions) are tables built once, like the rotary tables.
    """

    def __init__(self, channels: int, max_positions: int, encoding: str = "original"):
        super().__init__()
        self.channels, self.encoding, self.max_positions = channels, encoding, max_positions
        self.weight = nn.Parameter(torch.empty(channels))
        self.register_buffer("pe_row", None, persistent=False)  # (P, n_row)
        self.register_buffer("pe_col", None, persistent=False)  # (P, m - n_row)
        self.build_tables()
        self.n_row = self.pe_row.shape[1]  # weight[:n_row] reads the row channels, the rest the column ones
        self.reset_parameters()

    def build_tables(self) -> None:
        """Compute the row and column tables (also after loading weights into a model built on meta)."""
        self.pe_row, self.pe_col = axis_encodings(torch.arange(self.max_positions), self.channels, self.encoding)

    def reset_parameters(self) -> None:
        bound = math.sqrt(6.0 / (self.channels + 1))  # Xavier-uniform of a Linear(m, 1)
        nn.init.uniform_(self.weight, -bound, bound)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        state_dict.pop(prefix + "bias", None)  # the Linear's bias of older checkpoints: no effect (see above)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def score_scale(self) -> torch.Tensor:
        return self.weight.sum()

    def row_col_terms(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q_pos (B, T), k_pos (B, S) -> (a (B, T), c (B, S)) with P[i, j] . w = a(i) + c(j), in the
        weight's dtype. Only c(j) survives the softmax over keys (`key_term`); a(i) cancels."""
        return self.pe_row.to(self.weight.dtype)[q_pos] @ self.weight[: self.n_row], self.key_term(k_pos)

    def key_term(self, k_pos: torch.Tensor) -> torch.Tensor:
        """k_pos (B, S) -> c(j), shape (B, S), in the weight's dtype."""
        return self.pe_col.to(self.weight.dtype)[k_pos] @ self.weight[self.n_row :]
