"""Decoding speed against the hardware: prefill and decode timed apart, and the bandwidth limit.

A decode step at small batch reads every weight once and the filled part of the KV cache once, and
does little arithmetic on each byte, so its floor is (weight bytes + cache bytes read) / the rate at
which this machine moves memory. That rate is measured at the start, as a large tensor copy (bytes
read + bytes written per second, STREAM's convention), so a report can say which fraction of the
limit decoding reaches. Used by `qkvlab bench` and benchmarks/decode.py.

A timing that came out zero or negative (transformers' step is a difference of two generate calls)
is None, "unmeasured", and so is every rate made from it (qkvlab.base.loadavg.rate): never a number.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn

from qkvlab.base.loadavg import rate
from qkvlab.decode.choices import DecodeChoices, model_choices
from qkvlab.decode.compiled import compiled_step, steady, warm_up
from qkvlab.decode.steps import decode_step, eager_static, left_pad, new_cache, prefill


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_rate(device: torch.device | str = "cpu", nbytes: int = 256 * 2**20, seconds: float = 0.5) -> float:
    """Bytes moved per second (read + write) copying one large tensor into another, best of
    repeated copies; the tensors are far larger than any CPU cache."""
    device = torch.device(device)
    src = torch.ones(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # touch the pages
    best, t_end = float("inf"), time.perf_counter() + seconds
    while time.perf_counter() < t_end:
        _sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.numel() * src.element_size() / best


def weight_bytes_per_step(model: nn.Module) -> int:
    """Parameter bytes a decode step reads: all of them once, except embedding tables, of which it
    reads one row per token (negligible); a table tied to the output head is read whole by the head."""
    head = getattr(getattr(model, "lm_head", None), "weight", None)
    tables = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)} - {id(head)}
    return sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in tables)


def cache_bytes_per_token(model: nn.Module) -> int:
    """KV-cache bytes one token occupies (all layers), from a real one-slot cache."""
    return new_cache(model, 1, 1).bytes_allocated()


@dataclass
class DecodeTiming:
    batch: int
    prompt_len: int
    new_tokens: int
    prefill_s: float  # the prompt into an empty cache, best of rounds
    step_s: float | None  # one decode step (all rows) including greedy sampling, best of rounds; None: unmeasured
    compile_s: float | None = None  # compiling the step for this shape, once

    @property
    def prefill_tokens_per_s(self) -> float | None:
        return rate(self.batch * self.prompt_len, self.prefill_s)

    @property
    def decode_tokens_per_s(self) -> float | None:
        return rate(self.batch, self.step_s)

    @property
    def end_to_end_tokens_per_s(self) -> float | None:
        """New tokens per second, prefill included (what a generate call sees)."""
        if self.step_s is None or not self.step_s > 0:
            return None
        return rate(self.batch * self.new_tokens, self.prefill_s + (self.new_tokens - 1) * self.step_s)


DECODE_MODES = (
    "eager (the default: dynamic on the CPU, static on CUDA), dynamic, static, compiled or a torch.compile mode"
)


def decode_step_fn(mode: str, device: torch.device | str = "cpu") -> tuple[Callable, bool]:
    """'eager' | 'dynamic' | 'static' | 'compiled' | a torch.compile mode -> (step, static cache?)."""
    if mode == "eager":
        return decode_step, eager_static(torch.device(device))
    if mode == "dynamic":
        return decode_step, False
    if mode == "static":
        return decode_step, True
    return compiled_step("default" if mode == "compiled" else mode, device), True


@torch.inference_mode()
def time_decode(
    model, prompt: torch.Tensor, new_tokens: int, mode: str = "eager", choices: DecodeChoices | None = None
) -> DecodeTiming:
    """One round: prefill `prompt` (B, T), then greedy-decode new_tokens - 1 steps, timed apart, on
    generate's path for `mode` and `choices` (default: `model_choices(model, B)`, chosen before the
    clock starts). The decode layout's tree is built inside the prefill's time, as generate builds it
    for each decode; compiled, before the compile, whose time is reported apart."""
    device = prompt.device
    step, static = decode_step_fn(mode, device)
    B, T = prompt.shape
    choices = choices if choices is not None else model_choices(model, B)
    batch = left_pad(prompt.tolist(), device=device)
    cache = new_cache(model, B, T + new_tokens - 1, static=static)
    _sync(device)
    start = time.perf_counter()
    decoding = choices.decode_model(model, B)  # eager and compiled steps alike (compiled: the blocks are in its graph)
    compile_s = warm_up(step, decoding, cache) if step is not decode_step else None
    t0 = start if compile_s is None else time.perf_counter()  # eager: packing counts as prefill
    logits = prefill(decoding, cache, batch)
    tok = logits.argmax(-1)
    _sync(device)
    t1 = time.perf_counter()
    positions = batch.lengths.clone()
    decode = steady(step)
    for _ in range(new_tokens - 1):
        tok = decode(decoding, cache, tok, positions).argmax(-1)
        positions += 1
    _sync(device)
    t2 = time.perf_counter()
    step_s = (t2 - t1) / (new_tokens - 1) if new_tokens > 1 else None  # None: no step to time
    return DecodeTiming(B, T, new_tokens, t1 - t0, step_s, compile_s)


def best_of(timings: list[DecodeTiming]) -> DecodeTiming:
    """Fastest prefill and fastest measured step over rounds (contention only ever slows a round down)."""
    first = timings[0]
    compile_s = next((t.compile_s for t in timings if t.compile_s is not None), None)
    return DecodeTiming(
        first.batch,
        first.prompt_len,
        first.new_tokens,
        min(t.prefill_s for t in timings),
        min((t.step_s for t in timings if t.step_s is not None and t.step_s > 0), default=None),
        compile_s,
    )


def bandwidth_limit_step_s(model, batch: int, fill: float, rate: float) -> float:
    """Seconds a decode step needs at `rate` bytes/s to read the weights once and `fill` cached
    tokens of each of `batch` rows."""
    return (weight_bytes_per_step(model) + batch * fill * cache_bytes_per_token(model)) / rate


@torch.inference_mode()
def time_hf(hf, prompt: torch.Tensor, new_tokens: int) -> DecodeTiming:
    """transformers' generate with its cache: prefill as generate(1) (the prompt's forward and one
    greedy pick), a decode step as (generate(new_tokens) - generate(1)) / (new_tokens - 1)."""
    device = prompt.device
    mask = torch.ones_like(prompt)

    def gen(n: int) -> float:
        _sync(device)
        t0 = time.perf_counter()
        hf.generate(prompt, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False, use_cache=True)
        _sync(device)
        return time.perf_counter() - t0

    one, full = gen(1), gen(new_tokens)
    step_s = (full - one) / (new_tokens - 1) if new_tokens > 1 and full > one else None  # None: unmeasured
    B, T = prompt.shape
    return DecodeTiming(B, T, new_tokens, one, step_s)
