"""What `qkvlab info` reports on (`InfoConfig`): a model and the figures asked for (accounting.report,
accounting.memory_estimate), or the timed decisions cached on this machine (qkvlab.base.measured).
Beside the config floor, since it names ModelConfig and the presets."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from qkvlab.base.devices import SHARDINGS, dtype_choices
from qkvlab.base.settings import setting
from qkvlab.model.config import DEFAULT_PRESET, PRESETS, ModelConfig


@dataclass
class InfoConfig:
    """What `qkvlab info` reports on: a model (a folder's, a `--config` file's or a preset, with the
    model options over it) and the figures asked for (`report`, `memory_estimate`)."""

    folder: str | None = setting(
        None,
        help="a model folder or a training run folder (its config; options below override it)",
        positional=True,
        metavar="RUN_OR_MODEL_DIR",
    )
    variant: str | None = setting(
        None, help="apply a compare variant, e.g. Q-K=V/MQA, Id-K-V/mlp, Q-K-V/width=Id-K-V", metavar="VARIANT"
    )
    dtype: str = setting("bf16", help="cache dtype", choices=dtype_choices(auto=False))
    cache_tokens: int | None = setting(
        None, help="tokens held in the KV cache figure (default: the model's --context)", metavar="T", minimum=1
    )
    memory: bool = setting(False, help="estimate a training step's memory per GPU")
    batch: int = setting(8, help="micro-batch per GPU (--memory)", metavar="B", minimum=1)
    world: int = setting(1, help="GPUs (ranks) in all (--memory)", metavar="W", minimum=1)
    sharding: str = setting("ddp", help="ddp (replicated) or fsdp (--memory)", choices=SHARDINGS)
    json: bool = setting(False, help="print one JSON object")
    decisions: bool = setting(
        False, help="list the timed decisions cached on this machine (dtype auto, decode layouts), one line each"
    )
    forget: bool = setting(False, help="remove the cached timed decisions (they are measured again when next needed)")
    preset: str | None = setting(None, help=f"start from a model preset (default {DEFAULT_PRESET})", choices=PRESETS)
    model: dict[str, Any] = setting(help="model options", default_factory=dict, group=ModelConfig)
