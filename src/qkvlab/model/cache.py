"""A preallocated KV cache that stores only the distinct tensors a scheme reads.

Sized from the projection spec, not from n_head: K=V schemes hold one tensor per layer, GQA/MQA
hold kv_heads heads. Each layer has its own LayerCache built from that layer's config, so layers
may differ in scheme and heads. Sequences in a batch may have different lengths (left padding):
each slot records its token's position and whether it is real, and the attention mask follows.

Two ways to run a one-token decode step:
- dynamic (default): attention reads the filled slots ``[:length]``, a view that grows every token;
  the bookkeeping is Python ints.
- static (``static=True``): the step keeps every shape fixed, as gpt-fast does: the slot being
  written is a device tensor advanced in place, attention reads all ``max_len`` slots with the
  ``valid`` mask hiding the unfilled ones, and nothing in the step reads a host value. torch.compile
  then compiles the step once per (batch size, cache length), and CUDA graphs can replay it.
Prefill (several tokens, or padding) uses the dynamic bookkeeping in both.

A layer cache offers attention one of two reads: `update` (store the new tensors, return what to
attend over), which every layer cache here offers, or, where `reads_in_place` is true (serve's paged
decode step, serve/paged.py), `attend(q, new, k_source, v_source, scale, rope_k, v_width)`: it stores
the new tensors and attends over its storage where it lies (attention.py says which layouts call it).
"""

from __future__ import annotations

import torch

from qkvlab.base.errors import UserError
from qkvlab.model.config import ModelConfig


class KVCache:
    def __init__(
        self,
        cfg: ModelConfig,
        batch_size: int,
        max_len: int,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
        static: bool = False,
    ):
        self.max_len, self.static = max_len, static
        layer_cfgs = cfg.layer_configs()  # each layer's own scheme and kv heads
        self.layers = [LayerCache(self, c, batch_size, max_len, device, dtype) for c in layer_cfgs]
        self.positions = torch.zeros(batch_size, max_len, dtype=torch.long, device=device)
        self.valid = torch.zeros(batch_size, max_len, dtype=torch.bool, device=device)  # filled and real
        self.next_pos = torch.zeros(batch_size, dtype=torch.long, device=device)  # per row
        self.slot = torch.full((1,), -1, dtype=torch.long, device=device)  # static: last slot written
        self.all_valid = True  # no padding so far: dynamic decode steps need no mask (and no host sync)
        self.stepping = False  # the current forward is a static decode step
        self.start = 0  # first slot written by the current (dynamic) forward
        self.length = 0  # slots filled (in a static cache: as of the last dynamic forward)

    @property
    def batch_size(self) -> int:
        return self.positions.shape[0]

    def bytes_allocated(self) -> int:
        """Bytes held by key/value storage (position bookkeeping excluded)."""
        return sum(t.numel() * t.element_size() for layer in self.layers for t in layer.store.values())

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor a decode step reads or writes in place (for torch._dynamo.mark_static_address)."""
        stores = [t for layer in self.layers for t in layer.store.values()]
        return [*stores, self.positions, self.valid, self.next_pos, self.slot]

    def begin(self, positions: torch.Tensor, token_mask: torch.Tensor | None) -> torch.Tensor | None:
        """Reserve slots for T new tokens. positions, token_mask: (B, T). Returns the bool attention
        mask (B, 1, T, S) for this step, or None when every key is visible (dynamic, one real token)."""
        T = positions.shape[1]
        self.stepping = self.static and T == 1 and token_mask is None
        if self.stepping:
            return self._begin_step(positions)
        if self.static:
            self.length = int(self.slot) + 1  # host sync: only outside decode steps
        if self.length + T > self.max_len:
            raise UserError(f"KV cache full: {self.length} + {T} tokens exceed its {self.max_len} slots")
        self.start, self.length = self.length, self.length + T
        self.positions[:, self.start : self.length] = positions
        self.next_pos.copy_(positions[:, -1] + 1)  # in place: CUDA graphs hold its address (generate.warm_up)
        self.valid[:, self.start : self.length] = True if token_mask is None else token_mask
        self.all_valid &= token_mask is None
        if self.static:
            self.slot.fill_(self.length - 1)
        valid = self.valid[:, : self.length]
        if T == 1 and token_mask is None:
            return None if self.all_valid else valid[:, None, None, :]
        slots = torch.arange(self.length, device=positions.device)
        q_slots = slots[self.start :]
        allowed = (slots[None, :] <= q_slots[:, None])[None] & valid[:, None, :]  # (B, T, S)
        allowed |= (slots[None, :] == q_slots[:, None])[None]  # a pad query attends to itself: no NaN
        return allowed[:, None]

    def _begin_step(self, positions: torch.Tensor) -> torch.Tensor:
        """Static decode step: every write is in place at the device-side slot; no host values read.
        Writing past max_len is not checked here (that would sync): the caller sizes the cache."""
        self.slot += 1
        self.positions.index_copy_(1, self.slot, positions)
        self.valid.index_fill_(1, self.slot, True)
        self.next_pos.copy_(positions[:, -1] + 1)
        return self.valid[:, None, None, :]  # (B, 1, 1, S): unfilled slots and pads hidden

    def key_positions(self) -> torch.Tensor:
        """Positions of the keys attention reads: (B, S)."""
        return self.positions if self.stepping else self.positions[:, : self.length]

    def layer(self, index: int) -> LayerCache:
        return self.layers[index]

    def next_positions(self, T: int) -> torch.Tensor:
        """Positions continuing each row (rows of a left-padded batch differ): (B, T)."""
        return self.next_pos[:, None] + torch.arange(T, device=self.next_pos.device)

    def reset(self) -> None:
        self.start = self.length = 0
        self.valid.zero_()
        self.next_pos.zero_()
        self.slot.fill_(-1)
        self.all_valid = True
        self.stepping = False


class LayerCache:
    """One layer's storage: a (B, heads, max_len, width) tensor per tensor its config caches
    (ModelConfig.cached_tensors: kv_heads x head_dim per distinct key/value source, or 1 x kv_latent).
    Writes the new tokens' tensors and returns what attention reads."""

    reads_in_place = False  # attention calls update, then attends over what it returns

    def __init__(self, cache: KVCache, cfg: ModelConfig, batch_size: int, max_len: int, device, dtype):
        self.cache = cache
        self.store = {  # (B, kvh, S, hd) per source, or (B, 1, S, r) for a latent
            s: torch.zeros(batch_size, heads, max_len, width, device=device, dtype=dtype)
            for s, (heads, width) in cfg.cached_tensors().items()
        }

    def update(self, source: int, new: torch.Tensor) -> torch.Tensor:
        """new (B, h, T, w) -> the cached tensor attention reads: (B, h, S, w)."""
        buf, c = self.store[source], self.cache
        if c.stepping:
            return buf.index_copy_(2, c.slot, new)  # all max_len slots; c.valid masks the unfilled
        buf[:, :, c.start : c.length] = new
        return buf[:, :, : c.length]

    def key_positions(self) -> torch.Tensor:
        return self.cache.key_positions()
