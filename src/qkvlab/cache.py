"""A preallocated KV cache that stores only the distinct tensors a scheme reads.

Sized from the projection spec, not from n_head: K=V schemes hold one tensor per layer, GQA/MQA
hold kv_heads heads. Sequences in a batch may have different lengths (left padding): each slot
records its token's position and whether it is real, and the attention mask follows from that.
"""

from __future__ import annotations

import torch

from qkvlab.config import ModelConfig


class KVCache:
    def __init__(
        self,
        cfg: ModelConfig,
        batch_size: int,
        max_len: int,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ):
        self.sources = cfg.spec.cached_sources()
        self.max_len = max_len
        shape = (batch_size, cfg.n_kv_heads, max_len, cfg.head_dim)  # (B, kvh, S, hd)
        self.layers = [
            {s: torch.zeros(shape, device=device, dtype=dtype) for s in self.sources} for _ in range(cfg.n_layer)
        ]
        self.positions = torch.zeros(batch_size, max_len, dtype=torch.long, device=device)
        self.valid = torch.zeros(batch_size, max_len, dtype=torch.bool, device=device)
        self.next_pos = torch.zeros(batch_size, dtype=torch.long, device=device)  # per row
        self.all_valid = True  # no padding so far: decode steps need no mask (and no host sync)
        self.start = 0  # first slot written by the current forward
        self.length = 0  # slots filled

    @property
    def batch_size(self) -> int:
        return self.positions.shape[0]

    def bytes_allocated(self) -> int:
        """Bytes held by key/value storage (position bookkeeping excluded)."""
        return sum(t.numel() * t.element_size() for layer in self.layers for t in layer.values())

    def begin(self, positions: torch.Tensor, token_mask: torch.Tensor | None) -> torch.Tensor | None:
        """Reserve slots for T new tokens. positions, token_mask: (B, T). Returns the bool attention
        mask (B, 1, T, S) for this step, or None when every key is visible (one real token)."""
        T = positions.shape[1]
        if self.length + T > self.max_len:
            from qkvlab.errors import UserError

            raise UserError(f"KV cache full: {self.length} + {T} tokens exceed its {self.max_len} slots")
        self.start, self.length = self.length, self.length + T
        self.positions[:, self.start : self.length] = positions
        self.next_pos = positions[:, -1] + 1
        self.valid[:, self.start : self.length] = True if token_mask is None else token_mask
        self.all_valid &= token_mask is None
        valid = self.valid[:, : self.length]
        if T == 1 and token_mask is None:
            return None if self.all_valid else valid[:, None, None, :]
        slots = torch.arange(self.length, device=positions.device)
        q_slots = slots[self.start :]
        allowed = (slots[None, :] <= q_slots[:, None])[None] & valid[:, None, :]  # (B, T, S)
        allowed |= (slots[None, :] == q_slots[:, None])[None]  # a pad query attends to itself: no NaN
        return allowed[:, None]

    def key_positions(self) -> torch.Tensor:
        return self.positions[:, : self.length]

    def layer(self, index: int) -> LayerCache:
        return LayerCache(self, index)

    def next_positions(self, T: int) -> torch.Tensor:
        """Positions continuing each row (rows of a left-padded batch differ): (B, T)."""
        return self.next_pos[:, None] + torch.arange(T, device=self.next_pos.device)

    def reset(self) -> None:
        self.start = self.length = 0
        self.valid.zero_()
        self.next_pos.zero_()
        self.all_valid = True


class LayerCache:
    """One layer's view: write the new tokens' tensors, read everything cached so far."""

    def __init__(self, cache: KVCache, index: int):
        self.cache, self.store = cache, cache.layers[index]

    def update(self, source: int, new: torch.Tensor) -> torch.Tensor:
        buf = self.store[source]
        buf[:, :, self.cache.start : self.cache.length] = new
        return buf[:, :, : self.cache.length]

    def key_positions(self) -> torch.Tensor:
        return self.cache.key_positions()
