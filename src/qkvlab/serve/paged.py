"""The KV cache as a pool of fixed-size blocks, vLLM's paging, sized from the projection spec.

The pool is one set of tensors per layer, each holding `blocks x block_size` token slots of the
distinct tensors the scheme caches (cache.py's rule: K and V as two, K=V as one, kv_heads heads),
so at one --cache-memory a K=V model's pool holds twice the tokens of Q-K-V, and MQA n_head times.

- a sequence's block table lists its blocks in order: its token at position p sits in slot
  table[p // block_size] * block_size + p % block_size (blocks need not be contiguous);
- blocks are taken when a sequence is admitted (its prompt's) and one at a time as it grows, and
  all given back when it ends, so a 200-token request holds 13 blocks of 16, not a whole context;
- a decode step is a duck-typed cache (`PagedStep`) read by the model as it reads a KVCache
  (`begin`, `key_positions`, `layer(i).update`): each sequence writes its new token into its own
  slot and attention reads its slots gathered into (n, kvh, S, hd), S the longest sequence's length,
  columns past a sequence's own length masked. Column c is position c, so rotary keys read back
  (K=V's rotate-on-read) at their own positions, and each sequence computes what it would alone.

Storage starts zeroed and holds only what the model wrote, so a masked column is always finite
(a masked NaN would still poison the weighted sum).
"""

from __future__ import annotations

import torch

from qkvlab.model.cache import KVCache

BLOCK_SIZE = 16  # tokens per block: vLLM's default


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


class BlockPool:
    def __init__(self, model, blocks: int, block_size: int = BLOCK_SIZE):
        p = next(model.parameters())
        self.blocks, self.block_size, self.device = blocks, block_size, p.device
        slots = blocks * block_size
        self.stores = [  # per layer: source -> (slots, kvh, hd), or (slots, 1, r) for a latent
            {
                s: torch.zeros(slots, heads, width, device=p.device, dtype=p.dtype)
                for s, (heads, width) in c.cached_tensors().items()
            }
            for c in model.cfg.layer_configs()
        ]
        self.free = list(range(blocks - 1, -1, -1))  # a stack: the lowest ids are taken first

    @property
    def tokens(self) -> int:
        return self.blocks * self.block_size

    @property
    def used(self) -> int:
        return self.blocks - len(self.free)

    def bytes_allocated(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.stores for t in layer.values())

    def take(self, n: int) -> list[int] | None:
        """n free blocks, or None (and nothing taken) when fewer are free."""
        if n > len(self.free):
            return None
        return [self.free.pop() for _ in range(n)]

    def give_back(self, table: list[int]) -> None:
        self.free.extend(reversed(table))
        table.clear()

    def slots(self, table: list[int], length: int) -> torch.Tensor:
        """The slots of positions [0, length) of the sequence with this block table: (length,)."""
        B = self.block_size
        cols = torch.arange(length, device=self.device)
        return torch.tensor(table, device=self.device)[cols // B] * B + cols % B

    def load(self, table: list[int], prefilled: KVCache, src: int, start: int, length: int) -> None:
        """Copy row `src` of a prefilled cache, columns [start, start + length) (its real tokens,
        after any left padding), into positions [0, length) of the table's blocks."""
        slots = self.slots(table, length)
        for mine, theirs in zip(self.stores, prefilled.layers):
            for s, buf in mine.items():
                buf[slots] = theirs.store[s][src, :, start : start + length].transpose(0, 1)  # (length, kvh, hd)

    def step(self, tables: list[list[int]], positions: list[int]) -> PagedStep:
        """The cache for one decode step of these sequences: each feeds one token at its position
        (also its length so far); every table already has the block that position falls in."""
        return PagedStep(self, tables, positions)


class PagedStep:
    """One decode step over n sequences' blocks, read by the model as it reads a KVCache."""

    def __init__(self, pool: BlockPool, tables: list[list[int]], positions: list[int]):
        B, dev = pool.block_size, pool.device
        n, S = len(tables), max(positions) + 1
        width = blocks_for(S, B)
        padded = [t[:width] + [0] * (width - len(t[:width])) for t in tables]  # block 0 past the end: masked
        table = torch.tensor(padded, dtype=torch.long, device=dev)  # (n, width)
        cols = torch.arange(S, device=dev)
        pos = torch.tensor(positions, dtype=torch.long, device=dev)  # (n,)
        self.pool, self.shape = pool, (n, S)
        self.read = table[:, cols // B] * B + cols % B  # (n, S): the slot of each column
        self.write = self.read[torch.arange(n, device=dev), pos]  # (n,): the new token's slot
        self.flat = self.read.flatten()  # index_select's index: ~14x faster than buf[read] (n 16, CPU)
        self.mask = (cols[None, :] <= pos[:, None])[:, None, None, :]  # (n, 1, 1, S)
        self.kpos = cols.expand(n, S)  # column c holds position c

    def begin(self, positions: torch.Tensor, token_mask: torch.Tensor | None) -> torch.Tensor:
        """positions (n, 1) -> the bool attention mask (n, 1, 1, S)."""
        assert positions.shape[1] == 1 and token_mask is None, "a decode step feeds one real token per sequence"
        return self.mask

    def key_positions(self) -> torch.Tensor:
        return self.kpos  # (n, S)

    def layer(self, index: int) -> PagedStep.Layer:
        return PagedStep.Layer(self, self.pool.stores[index])

    class Layer:
        def __init__(self, step: PagedStep, store: dict[int, torch.Tensor]):
            self.step, self.store = step, store

        def update(self, source: int, new: torch.Tensor) -> torch.Tensor:
            """new (n, kvh, 1, hd) -> what attention reads: (n, kvh, S, hd)."""
            buf, step = self.store[source], self.step
            buf.index_copy_(0, step.write, new[:, :, 0])  # each sequence into its own slot: (n, kvh, hd)
            # one row gather (index_select, not buf[read]: advanced indexing's generic kernel took
            # 16% of a 16-row SmolLM2 step, benchmarks/decode_smollm2.py)
            rows = buf.index_select(0, step.flat).view(*step.shape, *buf.shape[1:])  # (n, S, kvh, hd)
            return rows.transpose(1, 2)  # (n, kvh, S, hd)

        def key_positions(self) -> torch.Tensor:
            return self.step.key_positions()
