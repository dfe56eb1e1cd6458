"""Which sequences compute which tokens at each step: admission by free blocks, chunked prefill under a
token budget, preemption by recompute (vLLM v1's scheduler, on this engine's terms).

One `schedule()`:
1. running sequences first, in admission order: a decoding one computes its one new token, one whose
   prompt is still being prefilled its next chunk, as much as the step's token budget leaves (so a
   long prompt is taken in chunks and the decoding streams beside it keep their pace). A sequence
   whose next tokens need a block when none is free preempts the most recently admitted one (vLLM's
   recompute: its blocks are given back and it returns to the front of the queue with its tokens so
   far, recomputed when readmitted; with the prefix cache most of them are found again);
2. then, if nobody was preempted, waiting sequences, first come first served, while the budget, the
   free blocks and --max-batch allow: each takes the cached blocks of its longest known prefix and
   blocks for the chunk it computes now. Nobody overtakes the head of the queue.

Every decoding sequence computes its token even past the budget (a decode is never starved); the
budget bounds what prefills add to a step.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from qkvlab.serve.kv_cache_manager import KVCacheManager, blocks_for
from qkvlab.serve.request import Sequence


@dataclass
class Work:
    """One sequence's share of a step: its tokens [start, start + count) computed at those positions."""

    seq: Sequence
    start: int
    count: int

    @property
    def samples(self) -> bool:
        """The chunk reaches its last token: the step's logits give its next one."""
        return self.start + self.count == len(self.seq.tokens)


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_seqs: int, token_budget: int):
        self.kv, self.max_seqs, self.token_budget = kv, max_seqs, token_budget
        self.running: list[Sequence] = []  # in admission order: the last is preempted first
        self.waiting: deque[Sequence] = deque()
        self.preemptions = 0
        self.on_preempt = None  # called with each preempted sequence (metrics)

    def schedule(self) -> list[Work]:
        work: list[Work] = []
        budget = self.token_budget
        preempted = False
        i = 0
        while i < len(self.running):
            seq = self.running[i]
            left = len(seq.tokens) - seq.computed
            count = 1 if left == 1 else min(left, budget)
            if count <= 0:
                i += 1
                continue
            fits, preempted_now = self._grow(seq, seq.computed + count)
            preempted |= preempted_now
            if not fits:  # seq itself was preempted: it was the last one
                break
            work.append(self._register(Work(seq, seq.computed, count)))
            budget -= count
            i += 1
        if not preempted:
            work += self._admit(max(budget, 0))
        return work

    def _grow(self, seq: Sequence, tokens: int) -> tuple[bool, bool]:
        """Blocks for `tokens` of seq, preempting from the tail while none are free -> (seq holds
        them, anyone was preempted)."""
        need = blocks_for(tokens, self.kv.block_size) - len(seq.table)
        preempted = False
        while need > 0 and not self.kv.can_take(need):
            victim = self.running.pop()
            self.preempt(victim)
            preempted = True
            if victim is seq:
                return False, True
        if need > 0:
            seq.table += self.kv.take(need)
        return True, preempted

    def preempt(self, seq: Sequence) -> None:
        self.kv.release(seq.table)
        seq.computed = 0
        if seq.produced == 0:
            seq.prompt_lp = []
        self.waiting.appendleft(seq)
        self.preemptions += 1
        if self.on_preempt is not None:
            self.on_preempt(seq)

    def _admit(self, budget: int) -> list[Work]:
        out = []
        while self.waiting and budget > 0 and len(self.running) < self.max_seqs:
            seq = self.waiting[0]
            hits = []
            if seq.uses_prefix_cache:
                hits = self.kv.lookup(seq.block_keys(self.kv.block_size), len(seq.tokens))
            start = len(hits) * self.kv.block_size
            count = min(len(seq.tokens) - start, budget)
            need = blocks_for(start + count, self.kv.block_size) - len(hits)
            if not self.kv.can_take(need + sum(self.kv.refs[b] == 0 for b in hits)):
                break  # first come first served
            if seq.uses_prefix_cache:
                self.kv.count_query(len(seq.tokens), start)
            self.kv.share(hits)
            seq.table = [*hits, *self.kv.take(need)]
            seq.computed = start
            self.waiting.popleft()
            self.running.append(seq)
            out.append(self._register(Work(seq, start, count)))  # the next admission may find its blocks
            budget -= count
        return out

    def _register(self, w: Work) -> Work:
        """Make the blocks this step fills findable (vLLM registers them when scheduled: a sequence
        admitted later in the same step reads them, written earlier in the same forward) -> w."""
        if w.seq.uses_prefix_cache:
            full = (w.start + w.count) // self.kv.block_size
            keys = w.seq.block_keys(self.kv.block_size)[:full]
            self.kv.register(w.seq.table, keys, w.start // self.kv.block_size)
        return w

    def retire(self, seq: Sequence) -> None:
        """A finished or cancelled running sequence leaves; its blocks go back."""
        self.running.remove(seq)
        self.kv.release(seq.table)
