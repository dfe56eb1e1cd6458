"""Training: config + presets (config.py), the loop (loop.py: single process, DDP, FSDP2),
checkpoints (checkpoint.py), data parallelism (distributed.py).

Importing the package imports nothing: `from qkvlab.train import train` loads the loop on first
use (PEP 562), so `qkvlab.train.checkpoint` or `.distributed` never pull the loop in, and no module
works only because another was imported first.
"""

import importlib
from typing import Any

_EXPORTS = {  # the Python API docs/guide.md shows; every other name from its module
    "TrainConfig": "qkvlab.train.config",
    "train_preset": "qkvlab.train.config",
    "train": "qkvlab.train.loop",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'qkvlab.train' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
