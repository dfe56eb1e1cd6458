"""The KV cache as a pool of rows, one per running sequence, each filled to its own length.

`KVCache` (cache.py) fills every row of a batch to the same slot: right for one batch decoded
together, wrong for continuous batching, where sequences join and leave at every step. The pool
keeps a KVCache only as storage (so it is sized from the projection spec and stores only the
distinct tensors: K=V one per layer, MQA one head) and writes each row at its own column:

- a sequence's token at position p sits in column p of its row (rows hold no padding);
- running sequences occupy rows [0, n): when one leaves, the last row moves into its place, so a
  decode step reads the views [:n] and never the free rows;
- a decode step is a duck-typed cache (`RowStep`) that the model reads as it reads a KVCache:
  `begin`, `key_positions`, `layer(i).update`. Each row writes its new token's tensors at its own
  column and attends to its valid columns [0, S) with S the longest row, so one step serves
  sequences of any mix of lengths.
"""

from __future__ import annotations

import torch

from qkvlab.cache import KVCache


class SlotPool:
    def __init__(self, model, rows: int, context: int | None = None):
        """rows of `context` columns each (default: the model's; --max-model-len makes them shorter)."""
        p = next(model.parameters())
        self.context = model.cfg.context if context is None else context
        self.storage = KVCache(model.cfg, rows, self.context, device=p.device, dtype=p.dtype)
        self.stores = [layer.store for layer in self.storage.layers]  # per layer: source -> (R, kvh, L, hd)
        self.positions, self.valid = self.storage.positions, self.storage.valid  # (R, L)

    @property
    def rows(self) -> int:
        return self.storage.batch_size

    def bytes_allocated(self) -> int:
        return self.storage.bytes_allocated()

    def load(self, row: int, prefilled: KVCache, src: int, start: int, length: int) -> None:
        """Copy row `src` of a prefilled cache, columns [start, start + length) (its real tokens,
        after any left padding), into `row`'s columns [0, length)."""
        for mine, theirs in zip(self.stores, prefilled.layers):
            for s, buf in mine.items():
                buf[row, :, :length] = theirs.store[s][src, :, start : start + length]
        self.positions[row, :length] = prefilled.positions[src, start : start + length]
        self.valid[row] = False  # stale columns of the row's last occupant must stay hidden
        self.valid[row, :length] = True

    def move(self, src: int, dst: int, length: int) -> None:
        """Row `src` (filled to `length` columns) into row `dst`."""
        for mine in self.stores:
            for buf in mine.values():
                buf[dst, :, :length] = buf[src, :, :length]
        self.positions[dst, :length] = self.positions[src, :length]
        self.valid[dst] = self.valid[src]

    def step(self, positions: torch.Tensor, width: int) -> RowStep:
        """The cache for one decode step of rows [0, n): positions (n,) of the tokens fed, which are
        also the columns they are written to; width = max(positions) + 1 (known on the host)."""
        return RowStep(self, positions, width)


class RowStep:
    """One decode step over rows [0, n), read by the model as it reads a KVCache."""

    def __init__(self, pool: SlotPool, positions: torch.Tensor, width: int):
        self.pool, self.cols, self.width = pool, positions, width  # cols (n,); width S: columns any row reads
        self.rows = torch.arange(len(positions), device=positions.device)

    def begin(self, positions: torch.Tensor, token_mask: torch.Tensor | None) -> torch.Tensor:
        """positions (n, 1) -> the bool attention mask (n, 1, 1, S)."""
        assert positions.shape[1] == 1 and token_mask is None, "a row step feeds one real token per row"
        n, S = len(self.rows), self.width
        self.pool.positions[self.rows, self.cols] = positions[:, 0]
        self.pool.valid[self.rows, self.cols] = True
        return self.pool.valid[:n, None, None, :S]

    def key_positions(self) -> torch.Tensor:
        return self.pool.positions[: len(self.rows), : self.width]  # (n, S)

    def layer(self, index: int) -> RowStep.Layer:
        return RowStep.Layer(self, self.pool.stores[index])

    class Layer:
        def __init__(self, step: RowStep, store: dict[int, torch.Tensor]):
            self.step, self.store = step, store

        def update(self, source: int, new: torch.Tensor) -> torch.Tensor:
            """new (n, kvh, 1, hd) -> what attention reads: (n, kvh, S, hd)."""
            st, buf = self.step, self.store[source]
            buf[st.rows, :, st.cols] = new[:, :, 0]  # each row at its own column: (n, kvh, hd)
            return buf[: len(st.rows), :, : st.width]

        def key_positions(self) -> torch.Tensor:
            return self.step.key_positions()
