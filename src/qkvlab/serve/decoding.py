"""The decoding choices a runner is built with, as one value: the dtype and weight layout
(qkvlab.decode.choices.DecodeChoices, with the measurements behind them), the model tree each step
calls, the compiled decode step, and how a decode step reads the paged cache.

- The layout: `DecodeChoices.decode_model` builds the decode-time tree once (on the CPU in fp32 the
  Linear products in blocks, sharing every parameter; the model itself is never changed). Decode steps
  of at most LAYOUT_MAX_BATCH rows call the tree, larger steps and prefills the model; a compiled step
  always calls the tree (one set of modules in its graph), whose products above LAYOUT_MAX_BATCH rows
  are the Linears' own.
- The paged read: "in place" (paged_attention.py, compiled once per layout; the runner falls back to
  "gather" where the compiler fails or a layer's layout is not read in place) or "gather".
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch.nn as nn

from qkvlab.decode.choices import DecodeChoices, model_choices
from qkvlab.decode.compiled import compiled_paged_step
from qkvlab.decode.layout import LAYOUT_MAX_BATCH
from qkvlab.decode.steps import decode_step
from qkvlab.model.attention import Attention

PAGED_READS = ("in place", "gather")


@dataclass
class RunnerDecoding:
    choices: DecodeChoices
    tree: nn.Module  # choices.decode_model(model): what decode steps of at most LAYOUT_MAX_BATCH rows call
    step: Callable = decode_step  # the one-token step: decode_step or its compiled form
    paged_read: str = "in place"  # or "gather" (PAGED_READS)

    @property
    def compiled(self) -> bool:
        return self.step is not decode_step

    def decoder(self, model: nn.Module, rows: int) -> nn.Module:
        """The modules a step of `rows` tokens calls (a decode step's rows, or a packed step's tokens)."""
        return self.tree if self.compiled or rows <= LAYOUT_MAX_BATCH else model

    def report(self) -> dict:
        """What /health says of them."""
        c = self.choices
        return {
            "dtype": c.dtype,
            "dtype_probe": None if c.dtype_decision is None else c.dtype_decision.record(),
            "decode_layout": f"{c.layout} x {c.parts} up to {LAYOUT_MAX_BATCH} rows ({c.layout_source})",
            "decode_layouts": c.record()["layout_decision"],  # the timing behind it, when timed
            "compiled": self.compiled,
            "paged_read": self.paged_read,
        }


def reads_in_place(model: nn.Module) -> bool:
    """Every attention layer of `model` attends in place on a paged decode step (model/attention.py)."""
    return all(m.attends_in_place for m in model.modules() if isinstance(m, Attention))


def runner_decoding(
    model: nn.Module,
    choices: DecodeChoices | None = None,
    compile: str | None = None,
    rows: int = LAYOUT_MAX_BATCH,
    paged_read: str = "in place",
) -> RunnerDecoding:
    """The choices for `model` (default: its own dtype, the layout chosen for `rows` rows), the decode
    step compiled with `compile` (a torch.compile mode, symbolic shapes) or eager, and the paged read
    (PAGED_READS; "in place" only where every layer reads in place)."""
    if paged_read not in PAGED_READS:
        raise ValueError(f"paged_read={paged_read!r}: use one of {PAGED_READS}")
    choices = choices if choices is not None else model_choices(model, min(rows, LAYOUT_MAX_BATCH))
    device = next(model.parameters()).device
    step = compiled_paged_step(device, compile) if compile else decode_step
    read = paged_read if reads_in_place(model) else "gather"
    return RunnerDecoding(choices, choices.decode_model(model), step, read)
