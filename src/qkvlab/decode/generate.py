"""Prefill, then token-by-token decoding with the KV cache: `stream` and `generate`.

A decode runs as its `DecodeChoices` say (qkvlab.decode.choices: the dtype the model was loaded in,
and the layout of its Linear weights): the caller builds them once (`decode_choices`) and passes
them, or they are chosen for the model at hand (`model_choices`). The model itself is never
changed: a layout that packs its weights decodes through a new tree that shares everything else
(qkvlab.decode.layout.packed_model).

The decode loop never waits for the device: tokens are yielded as device tensors, positions advance
in place, and the end-of-text test (a host sync) runs once every STOP_CHECK_EVERY steps. With a
static cache every step has the same shapes, so torch.compile compiles it once per (batch size,
cache length); `compile=` does that ahead of the prompt (qkvlab.decode.compiled) and reports the
seconds; if compiling fails, decoding goes on eager after one line on stderr. The eager default on
the CPU is the dynamic step (qkvlab.decode.steps); on CUDA the static one (what CUDA graphs replay).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import torch

from qkvlab.base.errors import UserError
from qkvlab.decode.choices import DecodeChoices, model_choices
from qkvlab.decode.compiled import compile_or_fall_back, compiled_step, steady
from qkvlab.decode.sampling import Sampling, next_token
from qkvlab.decode.steps import check_prompts, decode_step, eager_static, left_pad, max_steps, new_cache, prefill

FINISHED = -1  # what `stream` yields for a row that already produced its end-of-text token
STOP_CHECK_EVERY = 8  # steps between end-of-text checks (each check waits for the device)


def stream(
    model,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    sampling: Sampling = Sampling(),
    *,
    choices: DecodeChoices | None = None,
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

    choices: how to decode (qkvlab.decode.choices.DecodeChoices, made for this model's dtype); None:
    `model_choices(model, len(prompts))`, chosen now. compile: False, True (= "default") or a
    torch.compile mode ("reduce-overhead": CUDA graphs); the step is compiled before the prompt is
    read and `on_compiled(seconds)` is told how long that took; if compiling fails, decoding goes on
    eager (one line on stderr). static: the static-shape decode step, or False for the dynamic one
    (not compilable); None: static when compiling or on CUDA, dynamic on the CPU (`eager_static`)."""
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
    choices = choices if choices is not None else model_choices(model, len(prompts))
    decoding = choices.decode_model(model, len(prompts))  # checks the dtype now; its blocks live while decoding
    steps = max_steps(model, prompts, max_new_tokens)
    return _decode(decoding, prompts, steps, sampling, eot_id, generator, step, vocab_limit, static, on_compiled)


@torch.inference_mode()
def _decode(
    model, prompts, steps, sampling, eot_id, generator, step, vocab_limit, static, on_compiled
) -> Iterator[torch.Tensor]:
    device = next(model.parameters()).device
    batch = left_pad(prompts, device=device)
    cache = new_cache(model, len(prompts), batch.idx.shape[1] + steps - 1, static=static)
    if step is not decode_step and steps > 1:  # compiled for the tree it will call
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
    """The new tokens of every row (end-of-text excluded). kwargs: as for `stream` (`choices` among them)."""
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
