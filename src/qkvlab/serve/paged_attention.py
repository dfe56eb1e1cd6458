"""A decode step's attention read from the paged pool where its blocks lie: no gathered copy.

Each row of a decode step is one sequence's one query; its keys and values sit in the blocks its
block table names. `decode_attention` writes the attention out in torch ops over the pool viewed as
blocks, (blocks, block_size, heads, width), indexed through the tables: scores as a multiply-and-sum
over the width, a softmax over every (block, slot) of the row, the values summed per block and then
over the blocks. Under torch.compile, inductor fuses the indexing into its loops, so each block is
read where it lies, once for the scores and once for the values, and nothing the size of the context
is written. The same ops run eager would materialise the indexed blocks and their products: without
a compiler the step gathers (paged.PagedBatch) instead.

One compiled function per layout (`compiled_read`): keys and values two tensors or one (K=V), keys
rotated on read (K=V's RoPE: the rotation fused into the read, at each key's position) or not, and
MLA's rows (one row tensor read as MQA reads one head: keys the whole row, values its first r
numbers). The batch, the blocks per row, the block size and the pool's blocks are unbacked sizes
(marked by `read`), so one graph serves every step of a model, one sequence or many, short or long,
in any pool; the heads and widths are the model's and fixed.

Measured to choose (benchmarks/serve_engine.py --attention, one layer's decode attention at 16 streams
x 2,000 tokens on SmolLM2's shape, fp32): this read and SDPA over one contiguous cache against SDPA
over the gathered rows; docs/serve.md has the figures and the command.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

_COMPILED: dict[tuple[str, bool, bool], Callable] = {}  # (device type, rotates, a value width): one per layout


def decode_attention(
    q: torch.Tensor,
    k_blocks: torch.Tensor,
    v_blocks: torch.Tensor,
    tables: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    cos: torch.Tensor | None = None,
    sin: torch.Tensor | None = None,
    v_width: int | None = None,
) -> torch.Tensor:
    """q (B, hk, g, wk): each row's query, its heads grouped by kv head (as GQA groups them); k_blocks,
    v_blocks (blocks, block_size, hk, w): the pool's storage viewed as blocks (the same tensor for K=V);
    tables (B, n): each row's blocks, padded with any block; lengths (B,): the keys each row reads, its
    positions [0, length); cos, sin (P, wk): rotate each key at its position on read (P > the longest
    length - 1); v_width: the values are the first v_width numbers of v_blocks -> (B, hk, g, wv)."""
    B, hk, g, wk = q.shape
    n, block_size = tables.shape[1], k_blocks.shape[1]
    acc = torch.promote_types(q.dtype, torch.float32)  # bf16 is summed in fp32, fp64 stays fp64
    keys = k_blocks[tables].to(acc)  # (B, n, bs, hk, wk): indexed, not copied when fused
    pos = torch.arange(n, device=q.device)[:, None] * block_size + torch.arange(block_size, device=q.device)  # (n, bs)
    if cos is not None:
        c, s = cos[pos][:, :, None].to(acc), sin[pos][:, :, None].to(acc)  # (n, bs, 1, wk)
        k1, k2 = keys.chunk(2, dim=-1)
        keys = keys * c + torch.cat((-k2, k1), dim=-1) * s  # positions.apply_rotary, at the keys' own positions
    scores = (q.to(acc)[:, None, None] * keys[:, :, :, :, None]).sum(-1) * scale  # (B, n, bs, hk, g)
    scores = scores.masked_fill((pos >= lengths[:, None, None])[..., None, None], float("-inf"))
    weights = (scores - scores.amax(dim=(1, 2), keepdim=True)).exp()  # every row reads at least its own key
    values = v_blocks[tables].to(acc)  # (B, n, bs, hk, wv)
    if v_width is not None:
        values = values[..., :v_width]
    per_block = (weights[..., None] * values[:, :, :, :, None]).sum(2)  # (B, n, hk, g, wv): one block at a time
    return (per_block.sum(1) / weights.sum(dim=(1, 2))[..., None]).to(q.dtype)


def compiled_read(device_type: str, rotates: bool, value_width: bool) -> Callable:
    """`decode_attention` under torch.compile for one layout (fullgraph; on the CPU inductor's C++
    wrapper). The sizes marked by `read` are unbacked: one graph for every batch and context."""
    key = (device_type, rotates, value_width)
    if key not in _COMPILED:
        # dynamo counts the graphs of one function's code, whatever wrapper compiled them: each model's
        # heads, widths and dtype are one more (a process serving one model compiles one; tests, many)
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        options = {"cpp_wrapper": True} if device_type == "cpu" else None
        _COMPILED[key] = torch.compile(decode_attention, fullgraph=True, options=options)
    return _COMPILED[key]


def read(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    tables: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    block_size: int,
    cos: torch.Tensor | None = None,
    sin: torch.Tensor | None = None,
    v_width: int | None = None,
) -> torch.Tensor:
    """`decode_attention` over k_pool, v_pool (slots, hk, w) viewed as blocks of `block_size` slots,
    through its layout's compiled function: the batch, blocks per row, block size, pool size and cos/sin
    positions marked unbacked and the query made contiguous (no size of 1 nor a stride is specialised: no
    recompile when one sequence runs, for a strided query, nor for another block size or pool). Inside a compiled step the call is traced into the step's own graph."""
    k_blocks = k_pool.view(-1, block_size, *k_pool.shape[1:])
    v_blocks = k_blocks if v_pool is k_pool else v_pool.view(-1, block_size, *v_pool.shape[1:])
    if not torch.compiler.is_compiling():
        q = q.contiguous()  # strides are guarded: a caller's strided view would compile again (no copy if contiguous)
        marks = ((q, (0,)), (tables, (0, 1)), (lengths, (0,)), (cos, (0,)), (sin, (0,)), (k_blocks, (0, 1)))
        for t, dims in (*marks, *(((v_blocks, (0, 1)),) if v_blocks is not k_blocks else ())):
            for d in dims if t is not None else ():
                torch._dynamo.decorators.mark_unbacked(t, d)
    fn = compiled_read(q.device.type, cos is not None, v_width is not None)
    return fn(q, k_blocks, v_blocks, tables, lengths, scale, cos, sin, v_width)
