"""Which cache blocks each sequence holds: the block pool, block tables and automatic prefix caching.

Blocks only, no tensors (the runner owns the storage): a sequence's block table lists its blocks in
order, its token at position p sits in slot table[p // block_size] * block_size + p % block_size.

Prefix caching (vLLM's automatic prefix caching): a full block is keyed by the hash of its tokens
and of the block before it (so a key names the whole prefix up to the block's end), registered once
its tokens are scheduled, and shared by reference count: a new sequence whose first full blocks'
keys are known takes those blocks and computes only what follows. A block whose count falls to 0
goes to the free queue with its key kept; the free queue hands out its least recently freed block
first, dropping that block's key then (LRU eviction). A sequence's last blocks are freed first, as
vLLM does, so a prefix outlives its tails. At least one token is always computed (the logits of the
last prompt token are needed): hits stop one token short of the prompt's end.

Counters as vLLM's `vllm:prefix_cache_queries` and `vllm:prefix_cache_hits`: prompt tokens looked up
and tokens found, at each admission of a sequence that may use the cache.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

BLOCK_SIZE = 16  # tokens per block: vLLM's default, its GPU kernels'
CPU_BLOCK_SIZE = 64  # on the CPU the compiled in-place read pays per block (docs/serve.md, "Block size")


def default_block_size(device_type: str) -> int:
    """Tokens per block where none is asked for: 64 on the CPU (as vLLM's CPU backend takes 128 with its
    own kernels), vLLM's 16 elsewhere."""
    return CPU_BLOCK_SIZE if device_type == "cpu" else BLOCK_SIZE


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def block_key(parent: bytes | None, tokens: Sequence[int]) -> bytes:
    """The key of a full block: sha256 over its parent's key and its tokens (vLLM's default hash)."""
    h = hashlib.sha256(parent or b"")
    h.update(b"".join(int(t).to_bytes(8, "little", signed=True) for t in tokens))
    return h.digest()


class KVCacheManager:
    def __init__(self, blocks: int, block_size: int, caching: bool = True):
        self.blocks, self.block_size, self.caching = blocks, block_size, caching
        self.refs = [0] * blocks
        self.keys: list[bytes | None] = [None] * blocks
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(blocks))  # eviction order
        self.cached: dict[bytes, int] = {}  # key -> the block holding it
        self.queries = self.hits = 0  # tokens looked up / found in the cache

    @property
    def tokens(self) -> int:
        return self.blocks * self.block_size

    @property
    def used(self) -> int:
        return self.blocks - len(self.free)

    @property
    def usage(self) -> float:
        return self.used / self.blocks

    def can_take(self, n: int) -> bool:
        return n <= len(self.free)

    def take(self, n: int) -> list[int] | None:
        """n free blocks (their cached keys evicted), or None and nothing taken when fewer are free."""
        if n > len(self.free):
            return None
        out = []
        for _ in range(n):
            block, _ = self.free.popitem(last=False)
            self._evict(block)
            self.refs[block] = 1
            out.append(block)
        return out

    def _evict(self, block: int) -> None:
        key = self.keys[block]
        if key is not None:
            self.keys[block] = None
            if self.cached.get(key) == block:
                del self.cached[key]

    def release(self, table: list[int]) -> None:
        """A sequence's blocks given back, its last block first (evicted first); the table is emptied."""
        for block in reversed(table):
            self.refs[block] -= 1
            if self.refs[block] == 0:
                self.free[block] = None
        table.clear()

    def lookup(self, keys: Sequence[bytes], prompt_tokens: int) -> list[int]:
        """The cached blocks of the longest known prefix among `keys` (a prompt's full blocks, in
        order), at most the blocks before the prompt's last token."""
        if not self.caching:
            return []
        found = []
        for key in keys[: (prompt_tokens - 1) // self.block_size]:
            block = self.cached.get(key)
            if block is None:
                break
            found.append(block)
        return found

    def count_query(self, prompt_tokens: int, hit_tokens: int) -> None:
        """One admission's lookup, as vLLM counts it: tokens asked for, tokens found."""
        self.queries += prompt_tokens
        self.hits += hit_tokens

    def share(self, blocks: list[int]) -> None:
        """Take a reference to cached blocks (out of the free queue if nobody held them)."""
        for block in blocks:
            if self.refs[block] == 0:
                del self.free[block]
            self.refs[block] += 1

    def register(self, table: list[int], keys: Sequence[bytes], start: int) -> None:
        """Make the table's full blocks [start, len(keys)) findable by their keys (a key already held
        by another block stays with that one: this block is then a private copy)."""
        if not self.caching:
            return
        for i in range(start, len(keys)):
            block, key = table[i], keys[i]
            if self.keys[block] is None and key not in self.cached:
                self.keys[block] = key
                self.cached[key] = block

    def reset_prefix_cache(self) -> None:
        """Forget every key (after a failed step, whose blocks may not hold what their keys say)."""
        self.cached.clear()
        self.keys = [None] * self.blocks
