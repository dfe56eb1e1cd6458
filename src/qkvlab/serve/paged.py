"""The paged KV storage and one step's view of it, read by the model as it reads a KVCache.

Storage (`PagedStore`): per layer, one tensor per distinct tensor the scheme caches
(`ModelConfig.cached_tensors()`: K and V, or one for K=V, kv_heads heads, or the 1 x (r + p) latent
row), of `blocks x block_size` token slots and one block more, the null block, where padding writes
(never handed out, never read unmasked). A K=V model's storage holds one tensor where Q-K-V holds
two, so at one --cache-memory it holds twice the tokens.

A decode step (`PagedStep`: every row one sequence's one new token) reads its blocks where they lie:
each layer writes the new token's tensors into their slots, then attends through the block tables
(paged_attention.py, compiled), for every layout attention.py attends in place (all but the "+" term
and a latent whose keys rotate on read; the runner gathers for those models).

Any other step, where every layer attends in place (`PackedStep`): the step's tokens in one row, each
segment's back to back, no padding (so the projections and the MLP compute the step's tokens and no
more); each layer writes every new token into its slot, the decodes among them read their blocks in
place as a decode step's rows do, and each prefill chunk gathers its own context (its slots, in
position order) and attends to it causally from its start.

Any other step of the other layouts (`PagedBatch`): rows of `width` query tokens, each row one or more segments, a segment
one sequence's tokens [start, start + count) at those positions. Each layer writes every new token's
tensors into its slot first, then gathers, per row, the slots of its segments' whole contexts into
(rows, heads, S, width) (an index_select of rows computed once per step, one per layer and tensor),
so a segment admitted in this step reads the prefix-cached blocks another segment wrote in this same
forward. The mask lets a query see its own segment's keys at positions up to its own; a padding query
sees column 0 only (finite, and its output is dropped). Column c of a row holds its key's position,
so rotary keys read back (K=V's rotate-on-read) at their own positions and the "+" term finds them,
and each sequence computes what it would alone.

Storage starts zeroed and holds only what the model wrote, so a masked column is always finite
(a masked NaN would still poison the weighted sum).
"""

from __future__ import annotations

import torch

from qkvlab.model.attention import sdpa
from qkvlab.model.positions import apply_rotary
from qkvlab.serve.paged_attention import read


class PagedStore:
    def __init__(self, layer_configs, blocks: int, block_size: int, device, dtype):
        self.blocks, self.block_size, self.device = blocks, block_size, device
        slots = (blocks + 1) * block_size  # the last block: the null block
        self.null_slot = blocks * block_size
        self.layers = [  # per layer: source -> (slots, heads, width)
            {s: torch.zeros(slots, h, w, device=device, dtype=dtype) for s, (h, w) in c.cached_tensors().items()}
            for c in layer_configs
        ]

    def bytes_allocated(self) -> int:
        """Bytes of the blocks sequences use (the null block left out)."""
        per_slot = sum(t[0].numel() * t.element_size() for layer in self.layers for t in layer.values())
        return self.blocks * self.block_size * per_slot


class Segment:
    """One sequence's tokens in a step: row, first column, count, start position, block table."""

    def __init__(self, row: int, col: int, start: int, count: int, table: list[int]):
        self.row, self.col, self.start, self.count, self.table = row, col, start, count, table

    @property
    def context(self) -> int:
        return self.start + self.count

    def slots(self, block_size: int) -> torch.Tensor:
        """The pool slot of each of its context's positions [0, context): (context,)."""
        cols = torch.arange(self.context)
        return torch.tensor(self.table, dtype=torch.long)[cols // block_size] * block_size + cols % block_size


class PagedBatch:
    """One forward over `rows` x `width` tokens whose keys and values live in `store`."""

    def __init__(self, store: PagedStore, segments: list[Segment], rows: int, width: int):
        dev, B = store.device, store.block_size
        self.store = store
        spans = [0] * rows  # key columns each row has used
        offsets = []  # each segment's first key column in its row
        for seg in segments:
            offsets.append(spans[seg.row])
            spans[seg.row] += seg.context
        S = max(spans)
        read = torch.full((rows, S), store.null_slot, dtype=torch.long)
        kpos = torch.zeros(rows, S, dtype=torch.long)
        kseg = torch.full((rows, S), -1, dtype=torch.long)
        qpos = torch.zeros(rows, width, dtype=torch.long)
        qseg = torch.full((rows, width), -2, dtype=torch.long)
        write = torch.full((rows, width), store.null_slot, dtype=torch.long)
        for i, (seg, k0) in enumerate(zip(segments, offsets)):
            cols, slots = torch.arange(seg.context), seg.slots(B)
            read[seg.row, k0 : k0 + seg.context] = slots
            kpos[seg.row, k0 : k0 + seg.context] = cols
            kseg[seg.row, k0 : k0 + seg.context] = i
            q = slice(seg.col, seg.col + seg.count)
            qpos[seg.row, q] = cols[seg.start :]
            qseg[seg.row, q] = i
            write[seg.row, q] = slots[seg.start :]
        allowed = (qseg[:, :, None] == kseg[:, None, :]) & (kpos[:, None, :] <= qpos[:, :, None])  # (rows, W, S)
        allowed[:, :, 0] |= qseg < 0  # a padding query sees column 0: no NaN
        self.shape = (rows, S)
        self.positions = qpos.to(dev)  # (rows, width)
        self.mask = allowed[:, None].to(dev)  # (rows, 1, width, S)
        self.kpos = kpos.to(dev)  # (rows, S)
        self.flat = read.flatten().to(dev)
        self.write = write.flatten().to(dev)

    def begin(self, positions: torch.Tensor, token_mask: torch.Tensor | None) -> torch.Tensor:
        """The bool attention mask (rows, 1, width, S); the positions are this batch's own."""
        assert token_mask is None, "a paged batch places its padding itself"
        return self.mask

    def key_positions(self) -> torch.Tensor:
        return self.kpos  # (rows, S)

    def layer(self, index: int) -> PagedLayer:
        return PagedLayer(self, self.store.layers[index])


class PagedLayer:
    reads_in_place = False  # attention calls update, then attends over what it returns

    def __init__(self, batch: PagedBatch, store: dict[int, torch.Tensor]):
        self.batch, self.store = batch, store

    def update(self, source: int, new: torch.Tensor) -> torch.Tensor:
        """new (rows, h, width, w) -> what attention reads: (rows, h, S, w)."""
        buf, b = self.store[source], self.batch
        write_slots(self.store, b.write, {source: new.transpose(1, 2).reshape(-1, *buf.shape[1:])})
        # one gather of rows: index_select, whose kernel copies whole rows (advanced indexing's
        # generic kernel is the slower, benchmarks/decode_smollm2.py)
        rows = buf.index_select(0, b.flat).view(*b.shape, *buf.shape[1:])  # (rows, S, h, w)
        return rows.transpose(1, 2)

    def key_positions(self) -> torch.Tensor:
        return self.batch.key_positions()


class PagedStep:
    """A decode step over `segments` (one token each, row i the i-th) that reads the pool in place:
    the block tables (rows, n), padded with the null block, and each row's keys [0, start + 1)."""

    def __init__(self, store: PagedStore, segments: list[Segment]):
        dev, B = store.device, store.block_size
        null = store.blocks  # the null block's id
        n = max(2, *(-(-seg.context // B) for seg in segments))  # at least 2: no graph for a size of 1
        self.store = store
        held = [seg.table[: -(-seg.context // B)] for seg in segments]
        self.tables = torch.tensor([t + [null] * (n - len(t)) for t in held], device=dev)  # (rows, n)
        self.lengths = torch.tensor([seg.context for seg in segments], device=dev)  # (rows,)
        self.positions = torch.tensor([[seg.start] for seg in segments], device=dev)  # (rows, 1)
        self.write = torch.tensor([seg.table[seg.start // B] * B + seg.start % B for seg in segments], device=dev)
        # the position of each (block, slot) column, for keys rotated on read; past the longest
        # context (masked) clamped into the rotary table
        longest = max(seg.context for seg in segments)
        self.kpos = torch.arange(n * B, device=dev).clamp(max=longest - 1)[None]  # (1, n * B)

    def begin(self, positions: torch.Tensor, token_mask: torch.Tensor | None) -> None:
        """No mask: each row reads its own blocks up to its length."""
        assert token_mask is None, "a paged step places its rows itself"

    def key_positions(self) -> torch.Tensor:
        return self.kpos

    def layer(self, index: int) -> PagedStepLayer:
        return PagedStepLayer(self, self.store.layers[index])


class PagedStepLayer:
    reads_in_place = True  # attention calls attend (model/attention.py)

    def __init__(self, step: PagedStep, store: dict[int, torch.Tensor]):
        self.step, self.store = step, store

    def attend(self, q, new, k_source: int, v_source: int, scale: float, rope_k=None, v_width=None) -> torch.Tensor:
        """q (rows, hq, 1, wk); new {source: (rows, h, 1, w)}, written into their slots first; rope_k:
        cos, sin (1, 1, n * block_size, wk) at `key_positions`, to rotate keys on read; v_width: the
        values are the first v_width numbers of v_source's -> (rows, hq, 1, wv)."""
        write_slots(self.store, self.step.write, {source: t[:, :, 0] for source, t in new.items()})
        return self.read(q, k_source, v_source, scale, rope_k, v_width)

    def read(self, q, k_source: int, v_source: int, scale: float, rope_k=None, v_width=None) -> torch.Tensor:
        """Attention over what the blocks hold, nothing written: q (rows, hq, 1, wk) -> (rows, hq, 1, wv)."""
        step = self.step
        rows, hq, _, wk = q.shape
        keys = self.store[k_source]
        cos, sin = rotation(rope_k)
        grouped = q.reshape(rows, keys.shape[1], hq // keys.shape[1], wk)  # query heads by kv head
        y = read(grouped, keys, self.store[v_source], step.tables, step.lengths, scale, step.store.block_size, cos, sin, v_width)  # fmt: skip
        return y.reshape(rows, hq, 1, y.shape[-1])

    def key_positions(self) -> torch.Tensor:
        return self.step.key_positions()


class PackedStep:
    """Any step of segments (row 0, back to back from column 0) whose layers all attend in place: one
    row of every segment's tokens; decodes (one token) read their blocks in place, chunks gather."""

    def __init__(self, store: PagedStore, segments: list[Segment]):
        dev, B = store.device, store.block_size
        self.store, self.tokens = store, sum(seg.count for seg in segments)
        decodes = [seg for seg in segments if seg.count == 1]
        self.decodes = PagedStep(store, decodes) if decodes else None
        self.decode_cols = torch.tensor([seg.col for seg in decodes], dtype=torch.long, device=dev)
        self.chunks = []  # (first column, tokens, the context's slots (S,), causal mask (tokens, S))
        positions, write = [], []
        for seg in segments:
            cols, slots = torch.arange(seg.context), seg.slots(B)
            positions.append(cols[seg.start :])
            write.append(slots[seg.start :])
            if seg.count > 1:
                mask = cols[None, :] <= cols[seg.start :, None]  # a query sees its sequence up to itself
                self.chunks.append((seg.col, seg.count, slots.to(dev), mask.to(dev)))
        self.positions = torch.cat(positions)[None].to(dev)  # (1, tokens)
        self.write = torch.cat(write).to(dev)  # (tokens,)
        # keys rotated on read take their rotation from one table over every position read: the
        # decodes' block columns and the chunks' contexts (past the longest context, clamped)
        longest = max(seg.context for seg in segments)
        span = max(longest, self.decodes.kpos.shape[1] if decodes else 0)
        self.kpos = torch.arange(span, device=dev).clamp(max=longest - 1)[None]  # (1, span)

    def begin(self, positions: torch.Tensor, token_mask: torch.Tensor | None) -> None:
        assert token_mask is None, "a packed step places its segments itself"

    def key_positions(self) -> torch.Tensor:
        return self.kpos

    def layer(self, index: int) -> PackedLayer:
        return PackedLayer(self, self.store.layers[index])


class PackedLayer:
    reads_in_place = True  # attention calls attend (model/attention.py)

    def __init__(self, step: PackedStep, store: dict[int, torch.Tensor]):
        self.step, self.store = step, store

    def attend(self, q, new, k_source: int, v_source: int, scale: float, rope_k=None, v_width=None) -> torch.Tensor:
        """As PagedStepLayer.attend, for one row of the step's tokens: q (1, hq, tokens, wk); new
        {source: (1, h, tokens, w)} -> (1, hq, tokens, wv)."""
        step = self.step
        write_slots(self.store, step.write, {source: t[0].transpose(0, 1) for source, t in new.items()})
        keys, values = self.store[k_source], self.store[v_source]
        wv = values.shape[-1] if v_width is None else v_width
        cos, sin = rotation(rope_k)  # (span, wk)
        y = q.new_empty(1, q.shape[1], step.tokens, wv)
        if step.decodes is not None:
            rows = q[0].transpose(0, 1)[step.decode_cols][:, :, None]  # (decodes, hq, 1, wk), gathered contiguous
            out = PagedStepLayer(step.decodes, self.store).read(rows, k_source, v_source, scale, rope_k, v_width)
            y[0].index_copy_(1, step.decode_cols, out[:, :, 0].transpose(0, 1))
        for col, count, slots, mask in step.chunks:
            k = keys.index_select(0, slots).transpose(0, 1)[None]  # (1, hk, S, wk)
            # K=V and MLA read one tensor as both: gathered once, the values a view of it
            v = k if v_source == k_source else values.index_select(0, slots).transpose(0, 1)[None]
            if cos is not None:
                k = apply_rotary(k, cos[: len(slots)], sin[: len(slots)])
            y[:, :, col : col + count] = sdpa(q[:, :, col : col + count], k, v[..., :wv], mask, False, scale, 0.0)
        return y

    def key_positions(self) -> torch.Tensor:
        return self.step.key_positions()


def write_slots(store: dict[int, torch.Tensor], slots: torch.Tensor, new: dict[int, torch.Tensor]) -> None:
    """new {source: (tokens, h, w)}: each token's tensors into its pool slot (slots (tokens,)), in the pool's dtype."""
    for source, t in new.items():
        buf = store[source]
        buf.index_copy_(0, slots, t.to(buf.dtype))


def rotation(rope_k) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """cos, sin (1, 1, span, wk) at a step's key positions -> (span, wk) each, or (None, None) without rotation."""
    return (rope_k[0][0, 0], rope_k[1][0, 0]) if rope_k is not None else (None, None)
