"""Training: config + presets, the loop (single process, DDP, FSDP2), checkpoints."""

from qkvlab.train.config import TrainConfig, load_train_config, train_preset
from qkvlab.train.loop import TrainingDiverged, TrainResult, read_metrics, train

__all__ = [
    "TrainConfig",
    "TrainResult",
    "TrainingDiverged",
    "load_train_config",
    "read_metrics",
    "train",
    "train_preset",
]
