"""The decode step under torch.compile: compiled once per (mode, shapes, device type), warmed up
ahead of the prompt, eager after one line on stderr when the compiler fails, and its guards skipped
after the first call of a decode.

With a static cache (qkvlab.model.cache) every step has the same shapes, so torch.compile compiles
it once per (batch size, cache length); serve's paged cache changes shape every step, so its step is
compiled with symbolic shapes (`compiled_paged_step`).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

import torch

from qkvlab.base.devices import COMPILE_MODES, PAGED_COMPILE_MODES
from qkvlab.base.errors import UserError
from qkvlab.decode.steps import decode_step
from qkvlab.model.cache import KVCache

# The torch.compile wrappers of decode_step, one per (mode, dynamic, device type): dynamo keeps its
# compiled graphs on the wrapper, so a second decode of one shape reuses them.
_COMPILED: dict[tuple[str, bool, str], Callable] = {}


def compiled_step(mode: str = "default", device: torch.device | str = "cpu") -> Callable:
    """decode_step under torch.compile (one wrapper per mode and device type). Use it with a static
    cache: its shapes never change, so torch compiles it once per (batch size, cache length) and never
    mid-decode. On the CPU inductor's C++ wrapper calls the step's kernels without Python between
    them, which is what a one-stream step is short enough to feel (docs/results/speed)."""
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
        # each (scheme, batch, cache length) is one compile of this one function, and each decode's
        # layout tree is new objects in the graph: past dynamo's default of 8 it would silently fall
        # back to eager (e.g. bench: 6 variants x 2 batches)
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        if key[2] == "cpu" and mode != "reduce-overhead":  # options replace a mode (torch.compile takes one)
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
    is returned as it is (what skipping the guards gains: benchmarks/decode_guards.py)."""
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
