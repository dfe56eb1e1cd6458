"""The model runner: one batched forward per step over the scheduler's work, reading the paged cache.

A step of decodes alone (one token per sequence) is one row per sequence, what `decode_step` (or its
compiled form) runs on a `PagedStep`: attention reads each row's blocks in place (paged.py,
paged_attention.py), through the decode-time tree of the layout up to LAYOUT_MAX_BATCH rows
(decoding.py). A step with prefill chunks, where decodes read in place, is one row of all its tokens
(`PackedStep`: no padding, the head applied to each chunk's last token alone), through the same
tree while its tokens are at most LAYOUT_MAX_BATCH. Otherwise (the "+"
term, a latent whose keys rotate on read, a read that did not compile) its work is laid out in rows of `width`
tokens, width the longest chunk: each chunk longer than half a row has a row of its own, shorter ones
(decodes) share rows, first fit, while a row's tokens fit its width and its segments' contexts fit the
step's longest context (so sharing never widens what attention reads); its keys and values are
gathered (`PagedBatch`). Padding writes to the null block and is masked out.

The in-place read is compiled on first use (or by `warm_up`), on the null block; where the compiler
fails the runner says so in one line and gathers from then on.

Each sequence computes exactly what `qkvlab.decode.generate` computes for it alone: the same keys
and values, each query attending to its own sequence's keys at its own positions; so greedy tokens
match.
"""

from __future__ import annotations

import sys
import time

import torch

from qkvlab.base.errors import UserError
from qkvlab.decode.steps import decode_step
from qkvlab.serve.decoding import RunnerDecoding
from qkvlab.serve.kv_cache_manager import blocks_for
from qkvlab.serve.paged import PackedStep, PagedBatch, PagedStep, PagedStore, Segment
from qkvlab.serve.scheduler import Work

WARM_UP_SHAPES = ((1, [4]), (2, [2, 3]))  # (sequences, positions) compiled at start: see ModelRunner.warm_up


class ModelRunner:
    def __init__(self, model, blocks: int, block_size: int, choices: RunnerDecoding):
        p = next(model.parameters())
        self.model, self.device, self.choices = model, p.device, choices
        self.store = PagedStore(model.cfg.layer_configs(), blocks, block_size, p.device, p.dtype)
        self.read_ready = choices.compiled  # a compiled step traces the read into its own graph

    def execute(self, work: list[Work], every: set[int]) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """One forward over `work` -> logits (len(work), V) after each chunk's last token, and for the
        indices in `every` the logits after each of its tokens (count, V)."""
        if max(w.count for w in work) > 1 and self.packs():
            return self.packed(work, every)
        segments, rows, width = layout(work)
        if width == 1:
            tokens = torch.tensor([w.seq.tokens[w.start] for w in work], device=self.device)
            batch = self.decode_batch(segments)
            model = self.choices.decoder(self.model, rows)
            logits = self.choices.step(model, batch, tokens, batch.positions[:, 0])[:, None]  # (rows, 1, V)
        else:
            batch = PagedBatch(self.store, segments, rows, width)
            idx = torch.zeros(rows, width, dtype=torch.long)
            for w, seg in zip(work, segments):
                idx[seg.row, seg.col : seg.col + seg.count] = torch.tensor(w.seq.tokens[w.start : w.start + w.count])
            logits, _ = self.model(idx.to(self.device), cache=batch, positions=batch.positions)  # (rows, width, V)
        last = torch.stack([logits[s.row, s.col + s.count - 1] for s in segments])
        return last, {i: logits[segments[i].row, segments[i].col : segments[i].col + segments[i].count] for i in every}

    def packs(self) -> bool:
        """The cache is read in place (its read compiled first, if not yet): decode steps read their blocks
        where they lie, and steps with prefill chunks run packed (PackedStep)."""
        if self.choices.paged_read == "in place" and not self.read_ready:
            self.warm_up_read()
        return self.choices.paged_read == "in place"

    def packed(self, work: list[Work], every: set[int]) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """`execute` as one row of the step's tokens, the head applied only where logits are asked for."""
        segments, col = [], 0
        for w in work:
            segments.append(Segment(0, col, w.start, w.count, w.seq.table))
            col += w.count
        batch = PackedStep(self.store, segments)
        idx = torch.tensor([t for w in work for t in w.seq.tokens[w.start : w.start + w.count]], device=self.device)
        model = self.choices.decoder(self.model, len(idx))  # a few tokens' products as a decode step's
        x = model.hidden(idx[None], cache=batch, positions=batch.positions)[0]  # (tokens, C)
        ends = [s.col + s.count - 1 for s in segments]
        last = model.lm_head(x[ends])  # (len(work), V)
        return last, {i: model.lm_head(x[segments[i].col : segments[i].col + segments[i].count]) for i in every}

    def decode_batch(self, segments: list[Segment]) -> PagedStep | PagedBatch:
        """A decode step's view of the cache: read in place, once that read is compiled, else gathered."""
        if self.packs():
            return PagedStep(self.store, segments)
        return PagedBatch(self.store, segments, len(segments), 1)

    @torch.inference_mode()
    def warm_up_read(self) -> float:
        """Compile the in-place read: a decode step of two rows on the null block (which only padding
        writes) -> seconds; where compiling fails, one line on stderr and the gather from then on."""
        t0 = time.perf_counter()
        null = [self.store.blocks]
        segments = [Segment(r, 0, 0, 1, null) for r in range(2)]
        try:
            batch = PagedStep(self.store, segments)
            tokens = torch.zeros(2, dtype=torch.long, device=self.device)
            decode_step(self.choices.decoder(self.model, 2), batch, tokens, batch.positions[:, 0])
        except Exception as e:  # noqa: BLE001 - whatever the compiler raised, the gather still works
            first = (str(e).strip().splitlines() or [""])[0][:200]
            print(f"qkvlab serve: compiling the paged read failed ({type(e).__name__}: {first}); gathering instead",
                  file=sys.stderr)  # fmt: skip
            self.choices.paged_read = "gather"
        self.read_ready = True
        return time.perf_counter() - t0

    @torch.inference_mode()
    def warm_up(self) -> float:
        """Compile what the runner compiles before serving -> seconds: the decode step (WARM_UP_SHAPES,
        on block 0, which nobody holds yet) when it is compiled, else the in-place read."""
        if not self.choices.compiled:
            return self.warm_up_read() if self.choices.paged_read == "in place" and not self.read_ready else 0.0
        t0 = time.perf_counter()
        table = [0] * blocks_for(5, self.store.block_size)  # a sequence up to position 4
        if self.store.blocks < len(table):
            raise UserError("the cache pool is too small to compile the decode step on (a sequence of 5 tokens)")
        # one sequence first: its graph keeps the batch of 1 as a constant (torch specializes sizes of 1)
        # and the length symbolic; then two, whose graph is symbolic in both (started the other way
        # round, dynamo kept the first graph's sizes fixed and needed a third)
        for n, positions in WARM_UP_SHAPES:
            segments = [Segment(r, 0, p, 1, table) for r, p in enumerate(positions)]
            batch = self.decode_batch(segments)
            tokens = torch.zeros(n, dtype=torch.long, device=self.device)
            self.choices.step(self.choices.tree, batch, tokens, batch.positions[:, 0])
        return time.perf_counter() - t0


def layout(work: list[Work]) -> tuple[list[Segment], int, int]:
    """Rows for a step's work -> (a segment per work item, in order; rows; width)."""
    width = max(w.count for w in work)
    span = max(w.start + w.count for w in work)  # the longest context: what no shared row exceeds
    fill: list[list[int]] = []  # per row: tokens, key columns used
    segments = []
    for w in work:
        row = None
        if 2 * w.count <= width:
            row = next(
                (r for r, (t, k) in enumerate(fill) if t + w.count <= width and k + w.start + w.count <= span), None
            )
        if row is None:
            row = len(fill)
            fill.append([0, 0])
        segments.append(Segment(row, fill[row][0], w.start, w.count, w.seq.table))
        fill[row][0] += w.count
        fill[row][1] += w.start + w.count
    return segments, len(fill), width
