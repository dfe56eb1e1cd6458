"""Prefill, then token-by-token decoding with the KV cache; sampling.

Prompts of different lengths are decoded together by left padding: each row's real tokens sit at
the right, every row carries its own positions (0 for its first real token), and ``token_mask``
marks pads so no real query ever attends to them. Row i then computes exactly what it would alone.

Sampling: temperature (0 = greedy argmax), then top-k, then top-p (nucleus), drawn with a seeded
``torch.Generator`` so a seed fixes the output. Sampling runs on the model's device.

The decode loop never waits for the device: tokens are yielded as device tensors, positions advance
in place, and the end-of-text test (a host sync) runs once every STOP_CHECK_EVERY steps. With a
static cache (cache.py) every step has the same shapes, so torch.compile compiles it once per
(batch size, cache length); `compile=` does that, ahead of the prompt, and reports the seconds; if
compiling fails, decoding goes on eager after one line on stderr.

The eager default on the CPU is the dynamic step (attention reads the filled slots only, as
transformers does) with the Linear products in blocks one per thread while decoding (`decode_layout`); on
CUDA it is the static step (the one CUDA graphs replay).
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn

from qkvlab.base.devices import COMPILE_MODES, PAGED_COMPILE_MODES
from qkvlab.base.errors import UserError
from qkvlab.base.measured import alternate, cached_or_measured, timed
from qkvlab.model.cache import KVCache

FINISHED = -1  # what `stream` yields for a row that already produced its end-of-text token
STOP_CHECK_EVERY = 8  # steps between end-of-text checks (each check waits for the device)
# decode_layout's rows: SmolLM2's products on 2 threads as blocks vs as stored 2.14x at 1 row, 2.06x at 4, 1.35-1.44x
# at 16 (benchmarks/linear_layouts.py); 1.27x / 1.18x at 32 / 64 rows, but whole steps there are not measured
LAYOUT_MAX_BATCH = 16
LAYOUT_ROWS_MAX_BATCH = 4  # PackedProduct's block order: "rows" up to this many rows, "columns" above
# A model whose Linear weights reach LAYOUT_PROBE_MIN_BYTES (a real model, streamed from memory each step)
# gets its layout by timing on this machine instead (layout_by_timing): row blocks, chosen on an
# avx512_bf16 EPYC where they ran 2.33x the weights as stored at one row, ran 0.39x on a Xeon with AMX
# (docs/results/speed, 2026-12-05). Below it the weights sit in cache and the constants above decide.
LAYOUT_PROBE_MIN_BYTES = 64 << 20
LAYOUT_PROBE_BYTES = 128 << 20  # the weights timed: past the last-level cache, as in a real step
LAYOUT_PROBE_ROUNDS = 3
LAYOUTS = ("stored", "rows", "columns", "kmajor")  # the ways layout_by_timing times (packed_product)


@dataclass(frozen=True)
class Sampling:
    temperature: float = 1.0  # 0: greedy (top_k / top_p then play no part)
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off

    def validate(self) -> Sampling:
        if not (
            isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature) and self.temperature >= 0
        ):
            raise UserError(f"temperature={self.temperature} must be a finite number >= 0 (0 = greedy)")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise UserError(f"top_k={self.top_k} must be an integer >= 0 (0 = off)")
        if not (isinstance(self.top_p, (int, float)) and 0.0 < self.top_p <= 1.0):
            raise UserError(f"top_p={self.top_p} must be in (0, 1] (1 = off)")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """logits (B, V) -> a copy with every token outside the top-k and outside the nucleus at -inf.

    The nucleus is the smallest set of most probable tokens whose probability reaches top_p
    (the most probable token is always kept)."""
    logits = logits.clone()
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]  # (B, 1)
        logits.masked_fill_(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        before = probs.cumsum(-1) - probs  # mass of the strictly more probable tokens
        drop = before >= top_p
        drop[..., 0] = False
        logits.scatter_(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    return logits


def next_token(
    logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None = None, vocab_limit: int | None = None
) -> torch.Tensor:
    """logits (B, V) -> token ids (B,). vocab_limit: ids >= it are never drawn (a model vocabulary
    padded beyond its tokenizer's, e.g. GPT-2's 50257 ids in a 50304-row embedding)."""
    if vocab_limit is not None and vocab_limit < logits.shape[-1]:
        logits = logits[..., :vocab_limit]
    if sampling.greedy:
        return logits.argmax(-1)
    logits = filter_logits(logits.float() / sampling.temperature, sampling.top_k, sampling.top_p)
    return torch.multinomial(logits.softmax(-1), 1, generator=generator).squeeze(-1)


@dataclass
class Padded:
    """A batch of prompts, left padded: idx, positions, token_mask (B, T); lengths (B,)."""

    idx: torch.Tensor
    positions: torch.Tensor
    token_mask: torch.Tensor | None  # None when every prompt has the same length
    lengths: torch.Tensor


def left_pad(prompts: Sequence[Sequence[int]], *, pad_id: int = 0, device=None) -> Padded:
    if not prompts or any(len(p) == 0 for p in prompts):
        raise UserError("empty prompt: give at least one token to start from")
    lengths = torch.tensor([len(p) for p in prompts], device=device)
    B, T = len(prompts), int(lengths.max())
    idx = torch.full((B, T), pad_id, dtype=torch.long, device=device)
    for i, p in enumerate(prompts):
        idx[i, T - len(p) :] = torch.as_tensor(list(p), dtype=torch.long)
    shift = (T - lengths)[:, None]  # (B, 1) pads in front of each row
    slots = torch.arange(T, device=device)[None]  # (1, T)
    token_mask = slots >= shift
    positions = (slots - shift).clamp(min=0)  # pads sit at position 0; they are never attended to
    uniform = bool((lengths == T).all())
    return Padded(idx, positions, None if uniform else token_mask, lengths)


def check_prompts(model, prompts: Sequence[Sequence[int]]) -> None:
    cfg = model.cfg
    if not prompts or any(len(p) == 0 for p in prompts):
        raise UserError("empty prompt: give at least one token to start from")
    longest = max(len(p) for p in prompts)
    if longest > cfg.context:
        raise UserError(f"prompt of {longest} tokens is longer than the model's context of {cfg.context}")
    bad = [t for p in prompts for t in p if not 0 <= int(t) < cfg.vocab_size]
    if bad:
        raise UserError(f"token id {bad[0]} is outside the vocabulary [0, {cfg.vocab_size})")


def new_cache(model, batch_size: int, max_len: int, *, static: bool = False) -> KVCache:
    p = next(model.parameters())
    return KVCache(model.cfg, batch_size, max_len, device=p.device, dtype=p.dtype, static=static)


def prefill(model, cache: KVCache, batch: Padded) -> torch.Tensor:
    """Run the padded prompts through the model into an empty cache -> logits (B, V) after each
    prompt's last token (the right edge, thanks to left padding)."""
    logits, _ = model(batch.idx, cache=cache, positions=batch.positions, token_mask=batch.token_mask)
    return logits[:, -1]


def decode_step(model, cache: KVCache, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """tokens, positions (B,) -> logits (B, V) for the token after them."""
    logits, _ = model(tokens[:, None], cache=cache, positions=positions[:, None])
    return logits[:, -1]


_COMPILED: dict[tuple[str, bool, str], Callable] = {}


def compiled_step(mode: str = "default", device: torch.device | str = "cpu") -> Callable:
    """decode_step under torch.compile (one wrapper per mode and device type). Use it with a static
    cache: its shapes never change, so torch compiles it once per (batch size, cache length) and never
    mid-decode. On the CPU inductor's C++ wrapper calls the step's kernels without Python between
    them: SmolLM2-135M fp32, one stream, 14.9 ms a step against 17.5 with the Python wrapper and 19.1
    eager (docs/results/speed)."""
    if mode not in COMPILE_MODES:
        raise UserError(f"compile mode {mode!r} is not allowed; use one of {', '.join(COMPILE_MODES)}")
    return _compiled(mode, device, dynamic=False)


def compiled_paged_step(device: torch.device | str = "cpu", mode: str = "default") -> Callable:
    """decode_step compiled for the serve engine's paged cache (serve/paged.py), where every step has
    its own number of sequences and length: shapes are symbolic (dynamic=True), so it compiles once for
    two or more sequences and once for one (torch specializes a size of 1), not once a step. On the CPU
    with inductor's C++ wrapper, as `compiled_step`. CUDA graphs (reduce-overhead) need fixed shapes."""
    if mode not in PAGED_COMPILE_MODES:
        raise UserError(
            f"compile mode {mode!r} is not allowed for changing shapes; use {' or '.join(PAGED_COMPILE_MODES)}"
        )
    return _compiled(mode, device, dynamic=True)


def _compiled(mode: str, device: torch.device | str, *, dynamic: bool) -> Callable:
    """The one torch.compile wrapper of decode_step per (mode, shapes, device type). On the CPU every
    mode but CUDA graphs' compiles with the C++ wrapper."""
    key = (mode, dynamic, torch.device(device).type)
    if key not in _COMPILED:
        # each (scheme, batch, cache length) is one compile of this one function, and each serve engine's
        # decode layout is new objects in the graph: past dynamo's default of 8 it would silently fall
        # back to eager (e.g. bench: 6 variants x 2 batches)
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        if key[1] == "cpu" and mode != "reduce-overhead":  # options replace a mode (torch.compile takes one)
            options = {"cpp_wrapper": True, "max_autotune": mode == "max-autotune"}
            _COMPILED[key] = torch.compile(decode_step, dynamic=dynamic, fullgraph=True, options=options)
        else:
            _COMPILED[key] = torch.compile(
                decode_step, mode=None if mode == "default" else mode, dynamic=dynamic, fullgraph=True
            )
    return _COMPILED[key]


@torch.inference_mode()
def warm_up(step: Callable, model, cache: KVCache, calls: int = 3) -> float:
    """Run `step` on the empty static cache (compiling it for this shape; CUDA graphs record on the
    second or third call), then empty the cache again -> seconds spent."""
    device = cache.positions.device
    if device.type == "cuda":
        # CUDA graphs: in-place writes to these belong to the graph. No identity guard: a new cache of
        # the same shape re-records the graph (cudagraph trees check static inputs' addresses), it
        # does not recompile.
        for t in cache.tensors():
            torch._dynamo.mark_static_address(t, guard=False)
    zeros = torch.zeros(cache.batch_size, dtype=torch.long, device=device)
    t0 = time.perf_counter()
    for _ in range(calls):
        cache.reset()
        step(model, cache, zeros, zeros.clone())
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    cache.reset()
    return time.perf_counter() - t0


LAYOUT_DTYPES = (torch.float32, torch.float64)  # bf16's own matrix-vector product is the faster one as it is


class PackedProduct:
    """A Linear's product for a few rows at a time on the CPU: its weight (N, K) split into `parts`
    blocks of output rows, multiplied by one `bmm` whose batch the CPU threads share. `order` "rows"
    keeps each block as stored, (parts, N/parts, K), and computes W_p x (a dot product per output,
    reading each weight row once); "columns" stores it K-major, (parts, K, N/parts), and computes
    x W_p^T. More rows than `max_rows` go to the Linear's own weight. Installed as the Linear's
    `forward` (its parameters, names and state dict untouched) by `DecodeLayout`.

    Why: a one-token step is a chain of matrix-vector products bound by memory, and MKL runs a
    one-row product on one thread whatever torch.get_num_threads() says: SmolLM2's 151 products
    of a step (538 MB fp32, streamed from memory as in a real step) took 33.9 ms as stored, 17.5 ms
    as column blocks and 14.6 ms as row blocks on 2 threads; at 2-4 rows row blocks are 1.5-1.6x
    column blocks, level at 8, 0.93x at 16 (benchmarks/linear_layouts.py, docs/results/speed). Outputs
    equal F.linear's to rounding (the same dot products; fp64 tests hold them within 1e-12)."""

    def __init__(self, linear: nn.Linear, parts: int, max_rows: int = LAYOUT_MAX_BATCH, order: str = "rows"):
        n, k = linear.weight.shape
        self.linear, self.max_rows, self.order = linear, max_rows, order
        self.parts = parts if parts > 0 and n % parts == 0 else 1
        w = linear.weight.detach().view(self.parts, n // self.parts, k)  # (P, N/P, K)
        if order == "rows":
            self.blocks = w.contiguous()
        elif order == "columns":
            self.blocks = w.transpose(1, 2).contiguous()  # (P, K, N/P)
        else:
            raise ValueError(f"order={order!r}: 'rows' or 'columns'")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        *lead, k = x.shape
        rows = x.reshape(-1, k)  # (R, K)
        if rows.shape[0] > self.max_rows:
            return nn.functional.linear(x, self.linear.weight, self.linear.bias)
        if self.order == "rows":
            y = torch.bmm(self.blocks, rows.t().expand(self.parts, -1, -1))  # (P, N/P, R)
            # (R, N) laid out row by row: a transposed view would carry stride R into q, k and v, and
            # SDPA's CPU flash kernel takes only a last dimension of stride 1 (else its slow math path)
            y = y.reshape(-1, rows.shape[0]).t().contiguous().view(*lead, -1)  # (..., N)
        else:
            y = torch.bmm(rows.expand(self.parts, -1, -1), self.blocks)  # (P, R, N/P)
            y = y.transpose(0, 1).reshape(*lead, -1)  # (..., N): block p's outputs at columns p*N/P onwards
        return y if self.linear.bias is None else y + self.linear.bias


class DecodeLayout:
    """Every Linear of `model` computed by a `PackedProduct` (its weight copied into blocks, one per
    CPU thread, `parts` = torch.get_num_threads() at `hold()` unless given) between `hold()` and
    `release()`, on the CPU in fp32/fp64; the model's parameters are never touched.

    The block order follows the batch given to `hold` (LAYOUT_ROWS_MAX_BATCH; whole SmolLM2 fp32 decode
    steps, 2 threads, benchmarks/block_orders.py: row blocks 1.12-1.29x column blocks at 1 row, 1.4x
    at 2-4, 0.96-1.00x at 8, 0.89-0.92x at 16).
    Costs one copy of every Linear weight while held (SmolLM2-135M fp32: 538 MB). Not for bf16
    weights: their product already uses every thread and is the faster as it is (SmolLM2's 151
    products: 14.7 ms as stored, 20.7 ms as blocks), nor above LAYOUT_MAX_BATCH rows."""

    def __init__(self, model, parts: int | None = None):
        self.model = model
        self.parts = parts
        self.packed: list[nn.Linear] = []  # the Linears whose forward is a PackedProduct
        self.held = False  # hold() called and not released (the timing may have chosen the weights as stored)

    @staticmethod
    def applies(model) -> bool:
        p = next(model.parameters())
        return p.device.type == "cpu" and p.dtype in LAYOUT_DTYPES

    def hold(self, batch: int = 1) -> None:
        """Pack for decoding `batch` rows (the block order suits it; held until release, whatever the
        batch does meanwhile)."""
        if self.held or not self.applies(self.model):
            return
        self.held = True
        parts = self.parts or torch.get_num_threads()
        linears = [m for m in self.model.modules() if isinstance(m, nn.Linear) and "forward" not in vars(m)]
        if sum(m.weight.nbytes for m in linears) >= LAYOUT_PROBE_MIN_BYTES:
            layout = layout_by_timing(linears, batch, parts)
        else:
            layout = default_layout(batch)
        if layout == "stored":
            return
        for m in linears:
            # an instance attribute: nn.Module.__call__ finds it first
            m.forward = packed_product(m, layout, parts)
            self.packed.append(m)

    def release(self) -> None:
        for m in self.packed:
            del m.forward
        self.packed.clear()
        self.held = False


def default_layout(batch: int) -> str:
    """The layout fixed by measurement on one machine (LAYOUT_ROWS_MAX_BATCH): what small models hold,
    and what layout_by_timing keeps unless another way wins by more than the noise."""
    return "rows" if batch <= LAYOUT_ROWS_MAX_BATCH else "columns"


def packed_product(linear: nn.Linear, layout: str, parts: int) -> Callable:
    """The product `layout` names for this Linear: "stored" its own forward, "kmajor" one K-major
    block, "rows"/"columns" one block per part in that order."""
    if layout == "stored":
        return linear.__call__
    return (
        PackedProduct(linear, 1, order="columns") if layout == "kmajor" else PackedProduct(linear, parts, order=layout)
    )


layout_decisions: dict[str, dict] = {}  # this process's timed layouts by key (measured.cached_or_measured's entries)


@torch.inference_mode()
def layout_by_timing(linears: list[nn.Linear], batch: int, parts: int) -> str:
    """How to compute these Linears' products for `batch` rows on this machine: "rows" or "columns"
    (PackedProduct's block orders, one block per thread), "kmajor" (the whole weight K-major, one
    block: 1.14x as stored at one row on a Xeon with AMX, benchmarks/linear_layouts.py) or "stored"
    (the weights as they are). A speed policy decided by
    measurement (qkvlab.base.measured): the products of the first LAYOUT_PROBE_BYTES of weights timed each
    way, alternating, best of LAYOUT_PROBE_ROUNDS; the constants' order (LAYOUT_ROWS_MAX_BATCH) is kept
    unless another way beats it by more than the noise. Cached per machine on disk and per process,
    keyed by rows, parts, dtype and the timed weights' shapes."""
    rows = min(batch, LAYOUT_MAX_BATCH)
    subset, total = [], 0
    for m in linears:
        if total >= LAYOUT_PROBE_BYTES:
            break
        subset.append(m)
        total += m.weight.nbytes
    w = subset[0].weight
    shapes = ",".join(f"{n}x{k}" for n, k in dict.fromkeys(tuple(m.weight.shape) for m in subset))
    key = f"layout-{str(w.dtype).removeprefix('torch.')}-{w.device.type}-r{rows}-p{parts}-{shapes}-n{len(subset)}"

    def measure() -> dict[str, list[float]]:
        inputs = [torch.randn(rows, m.in_features, dtype=w.dtype, device=w.device) for m in subset]
        ways = {layout: [packed_product(m, layout, parts) for m in subset] for layout in LAYOUTS}

        def products(way: list[Callable]) -> None:
            for product, x in zip(way, inputs):
                product(x)

        return alternate(
            {o: lambda way=way: timed(lambda: products(way)) for o, way in ways.items()}, LAYOUT_PROBE_ROUNDS
        )

    if key not in layout_decisions:
        layout_decisions[key] = cached_or_measured(key, default_layout(rows), measure)
    return layout_decisions[key]["choice"]


@contextlib.contextmanager
def decode_layout(model, batch_size: int) -> Iterator[None]:
    """`DecodeLayout` held while eager decoding `batch_size` rows, and put back afterwards; at batches
    above LAYOUT_MAX_BATCH, on CUDA and for bf16 weights it does nothing."""
    layout = DecodeLayout(model)
    if batch_size <= LAYOUT_MAX_BATCH:
        layout.hold(batch_size)
    try:
        yield
    finally:
        layout.release()


def eager_static(device: torch.device) -> bool:
    """The eager decode step's kind: static (fixed shapes, what CUDA graphs replay) on CUDA, dynamic
    (reads only the filled cache slots) elsewhere."""
    return device.type == "cuda"


def compile_or_fall_back(step: Callable, model, cache: KVCache) -> tuple[Callable, float | None]:
    """Compile `step` for this cache's shape (`warm_up`) -> (step, seconds); if the compiler fails
    (no C compiler, an unsupported GPU, a torch bug), one line on stderr and (decode_step, None)."""
    try:
        return step, warm_up(step, model, cache)
    except Exception as e:  # noqa: BLE001 - whatever the compiler raised, eager decoding still works
        first = (str(e).strip().splitlines() or [""])[0][:200]
        print(
            f"qkvlab: compiling the decode step failed ({type(e).__name__}: {first}); decoding eager", file=sys.stderr
        )
        cache.reset()
        return decode_step, None


def steady(step: Callable) -> Callable:
    """`step` for one decode (make one per decode): its first call as it is, every later one (the same
    model, cache and shapes; only the values change) with dynamo's guards skipped, bar those that tell
    its compiled graphs apart (torch.compiler.set_stance's skip_guard_eval_unsafe; safe here because
    every guard passed on the first call and nothing they check changes between steps). The eager step
    is returned as it is. SmolLM2-135M's compiled step, fp32, one stream, 2 threads, avx2 EPYC: 1.05x
    with the guards skipped (median round 1.02x; benchmarks/decode_guards.py), 1.13x in an earlier run
    with a copy of the model each way."""
    if step is decode_step:
        return step
    first = True

    def call(*args):
        nonlocal first
        if first:
            first = False
            return step(*args)
        # a context manager, not set_stance's decorator form: in torch 2.13 that form re-creates the stance
        # per call without skip_guard_eval_unsafe (set_stance.clone), so it would skip nothing
        with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
            return step(*args)

    return call


def max_steps(model, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> int:
    """New tokens that fit: every token fed to the model has a position inside its context (the
    last sampled token is never fed, so a prompt of exactly `context` tokens still gets one)."""
    return max(0, min(max_new_tokens, model.cfg.context + 1 - max(len(p) for p in prompts)))


def stream(
    model,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    sampling: Sampling = Sampling(),
    *,
    eot_id: int | None = None,
    seed: int | None = None,
    generator: torch.Generator | None = None,
    compile: bool | str = False,
    static: bool | None = None,
    vocab_limit: int | None = None,
    on_compiled: Callable[[float], None] | None = None,
) -> Iterator[torch.Tensor]:
    """An iterator over steps: each yields the next token of every row (B,), on the model's device.

    Stops after `max_new_tokens` (fewer if the context ends first) or when every row has produced
    `eot_id`; a row that has finished yields FINISHED (-1) from then on. Only ids below
    `vocab_limit` are produced (default: the whole vocabulary). Bad arguments raise
    UserError here, before anything is decoded.

    compile: False, True (= "default") or a torch.compile mode ("reduce-overhead": CUDA graphs);
    the step is compiled before the prompt is read and `on_compiled(seconds)` is told how long that
    took; if compiling fails, decoding goes on eager (one line on stderr). static: the static-shape
    decode step (cache.py), or False for the dynamic one (not compilable); None: static when compiling
    or on CUDA, dynamic on the CPU (`eager_static`)."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise UserError(f"max_new_tokens={max_new_tokens} must be an integer >= 1")
    sampling.validate()
    check_prompts(model, prompts)
    device = next(model.parameters()).device
    if generator is None and seed is not None:
        generator = torch.Generator(device=device).manual_seed(seed)
    if compile is True:
        compile = "default"
    if compile and static is False:
        raise UserError("compile needs the static decode step (static=True)")
    if static is None:
        static = bool(compile) or eager_static(device)
    step = compiled_step(compile, device) if compile else decode_step
    steps = max_steps(model, prompts, max_new_tokens)
    return _decode(model, prompts, steps, sampling, eot_id, generator, step, vocab_limit, static, on_compiled)


@torch.inference_mode()
def _decode(
    model, prompts, steps, sampling, eot_id, generator, step, vocab_limit, static, on_compiled
) -> Iterator[torch.Tensor]:
    device = next(model.parameters()).device
    batch = left_pad(prompts, device=device)
    cache = new_cache(model, len(prompts), batch.idx.shape[1] + steps - 1, static=static)
    with decode_layout(model, len(prompts)):  # held while compiling too: the compiled step reads the blocks
        if step is not decode_step and steps > 1:
            step, seconds = compile_or_fall_back(step, model, cache)
            if on_compiled is not None and seconds is not None:
                on_compiled(seconds)
        yield from _steps(model, cache, batch, steps, sampling, eot_id, generator, step, vocab_limit)


def _steps(model, cache, batch, steps, sampling, eot_id, generator, step, vocab_limit) -> Iterator[torch.Tensor]:
    device = batch.idx.device
    logits = prefill(model, cache, batch)
    positions = batch.lengths.clone()  # (B,) position of the token about to be fed
    finished = torch.zeros(batch.idx.shape[0], dtype=torch.bool, device=device) if eot_id is not None else None
    step = steady(step)
    for i in range(steps):
        tok = next_token(logits, sampling, generator, vocab_limit)
        if finished is None:
            yield tok
        else:
            yield tok.masked_fill(finished, FINISHED)
            finished |= tok == eot_id
            if (i + 1) % STOP_CHECK_EVERY == 0 and bool(finished.all()):  # the loop's only host sync
                return
        if i + 1 < steps:
            logits = step(model, cache, tok, positions)
            positions += 1


def generate(
    model, prompts: Sequence[Sequence[int]], max_new_tokens: int, sampling: Sampling = Sampling(), **kwargs
) -> list[list[int]]:
    """The new tokens of every row (end-of-text excluded). kwargs: as for `stream`."""
    eot = kwargs.get("eot_id")
    steps = list(stream(model, prompts, max_new_tokens, sampling, **kwargs))  # device tensors: no sync per step
    rows: list[list[int]] = [[] for _ in prompts]
    done = [False] * len(prompts)
    for tok in torch.stack(steps).tolist():
        for r, t in enumerate(tok):
            if done[r] or t == FINISHED:
                continue
            if eot is not None and t == eot:
                done[r] = True
            else:
                rows[r].append(t)
    return rows
