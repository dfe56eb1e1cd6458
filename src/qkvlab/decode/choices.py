"""Decoding choices as values: the inference dtype and the weight layout one decode uses, with the
measurements that produced them, built once by `decode_choices` and passed to whatever decodes
(`qkvlab.decode.generate.stream`/`generate`, `qkvlab.decode.speed.time_decode`).

    choices = decode_choices(model_cfg, device="cpu", dtype="auto", batch=len(prompts))  # before loading
    model = load_model(..., dtype=torch_dtype(choices.dtype))
    rows = generate(model, prompts, 50, choices=choices)

`dtype` "auto" on the CPU is timed (qkvlab.decode.dtype_probe.inference_dtype); `layout` "auto" is
qkvlab.decode.layout.choose_layout's (the default for small models, timed for real ones); either may
be given instead. Nothing here changes the model: `DecodeChoices.decode_model` returns the tree a
decode calls (the model itself, or a new tree holding its packed weights). A caller that passes no
choices gets `model_choices(model, rows)`: the model's own dtype and the layout chosen for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from qkvlab.base.devices import DTYPE_ALIASES
from qkvlab.base.errors import UserError
from qkvlab.base.measured import Measured, Timer
from qkvlab.decode.dtype_probe import Decision, inference_dtype
from qkvlab.decode.layout import LAYOUT_MAX_BATCH, choose_layout, linear_shapes, packed_model
from qkvlab.model.transformer import GPT


@dataclass(frozen=True)
class DecodeChoices:
    """How one decode runs: the weights' and cache's dtype, the Linear layout (qkvlab.decode.layout.LAYOUTS)
    in `parts` blocks, the rows it was chosen for, and the measurements behind each (None: set by the
    caller, or nothing to time)."""

    dtype: str
    layout: str
    parts: int
    rows: int
    dtype_decision: Decision | None = None
    layout_decision: Measured | None = None
    layout_source: str = "as set"  # or "timed", or "the default" (no timing: a small model, or no layout applies)

    def decode_model(self, model: nn.Module, rows: int | None = None) -> nn.Module:
        """What a decode of `rows` rows (default: `self.rows`) calls: `model` itself, or the new tree of
        its layout (qkvlab.decode.layout.packed_model) when the layout packs and the rows are at most
        LAYOUT_MAX_BATCH. Refuses a model whose dtype is not the one these choices were made for."""
        have = model_dtype(model)
        if have != self.dtype:
            raise UserError(f"decode choices made for {self.dtype} weights, but the model's are {have}")
        if (self.rows if rows is None else rows) > LAYOUT_MAX_BATCH:
            return model
        return packed_model(model, self.layout, self.parts)

    def describe(self) -> str:
        """One line: the dtype and the layout, and where each came from."""
        dtype = self.dtype_decision.describe() if self.dtype_decision is not None else f"dtype {self.dtype} (as set)"
        how = self.layout_source if self.layout_decision is None else f"timed, {self.layout_decision.source}"
        return f"{dtype}; layout {self.layout} x {self.parts} for {self.rows} rows ({how})"

    def record(self) -> dict[str, Any]:
        """JSON-able: what a run's record keeps."""
        return {
            "dtype": self.dtype,
            "layout": self.layout,
            "parts": self.parts,
            "rows": self.rows,
            "layout_source": self.layout_source,
            "dtype_decision": None if self.dtype_decision is None else self.dtype_decision.record(),
            "layout_decision": None
            if self.layout_decision is None
            else {
                **self.layout_decision.entry(),
                "key": self.layout_decision.key,
                "source": self.layout_decision.source,
            },
        }


def model_dtype(model: nn.Module) -> str:
    """The dtype name (qkvlab.base.devices.DTYPES) of the model's weights."""
    return DTYPE_ALIASES[str(next(model.parameters()).dtype).removeprefix("torch.")]


def config_shapes(model_cfg) -> list[tuple[int, int]]:
    """The Linear weight shapes of a GPT of `model_cfg`, from one built on the meta device (no memory)."""
    with torch.device("meta"):
        return linear_shapes(GPT(model_cfg))


def decode_choices(
    model_cfg,
    *,
    device: torch.device | str = "cpu",
    dtype: str = "auto",
    layout: str = "auto",
    batch: int = 1,
    batches: tuple[int, ...] | None = None,
    parts: int | None = None,
    shapes: list[tuple[int, int]] | None = None,
    timer: Timer = Timer(),
    cache: Path | None = None,
) -> DecodeChoices:
    """The choices for decoding `batch` rows of a model of `model_cfg` on `device`: `dtype` a setting
    ("auto": timed on the CPU at `batches`, default (batch,)), `layout` "auto" or one of LAYOUTS,
    `parts` the blocks per weight (default: torch's threads now), `shapes` the model's Linear weight
    shapes (default: those of a GPT of the config). `timer`, `cache`: qkvlab.base.measured's."""
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise UserError(f"batch={batch} must be an integer >= 1")
    device_type = torch.device(device).type
    dname, dtype_decision = inference_dtype(dtype, device_type, model_cfg, batches or (batch,))
    parts = parts or torch.get_num_threads()
    shapes = shapes if shapes is not None else config_shapes(model_cfg)
    chosen, record = choose_layout(shapes, dname, device_type, batch, parts, layout, timer=timer, cache=cache)
    source = "as set" if layout != "auto" else "timed" if record is not None else "the default"
    return DecodeChoices(dname, chosen, parts, batch, dtype_decision, record, source)


def model_choices(model: nn.Module, batch: int, *, layout: str = "auto", timer: Timer = Timer()) -> DecodeChoices:
    """The choices for decoding `batch` rows with a model in hand: its own dtype and device, the layout
    chosen for its Linears."""
    p = next(model.parameters())
    return decode_choices(
        model.cfg,
        device=p.device,
        dtype=model_dtype(model),
        layout=layout,
        batch=batch,
        shapes=linear_shapes(model),
        timer=timer,
    )
