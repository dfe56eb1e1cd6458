"""Paper B's synthetic list tasks (reverse, sort, sub, swap, copy) as encoder tasks.

A bidirectional encoder reads L digits (learned positions) and predicts L digits, one 10-way
cross-entropy per position; the metric is token accuracy (also reported: whole-sequence
accuracy). Data: `qkvlab.data.synthetic`, 50k/1k/10k rows from `data_seed` by default (the
paper's sizes; generating them takes milliseconds, only the number of steps costs time).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from qkvlab.base.errors import UserError
from qkvlab.base.settings import seed_setting, setting
from qkvlab.data.synthetic import TASKS, VOCAB_SIZE, synthetic_splits
from qkvlab.model.config import ModelConfig
from qkvlab.model.transformer import Encoder, TokenInput
from qkvlab.tasks.arrays import ArrayTask, check_plus_channels

# Paper B's grid for these tasks (papers.md): 3 seeds of each point, batch 128.
PAPER_GRID = dict(
    d_model=(32, 64, 256),
    n_layer=(2, 4),
    n_head=(2, 4),
    length=(16, 64, 128),
    seeds=3,
    batch_size=128,
    plus_channels=10,
)
# Paper B's recipe for these tasks: Borji's encoder (kv-transformer, Reverse_sort_pos.py). One-hot
# digits through a Linear (an embedding), fixed sinusoidal positions, post-norm blocks with a ReLU MLP
# of width 2d, dropout 0.1, an MLP head (Linear, LayerNorm, ReLU, Dropout, Linear); Adam (no decay)
# lr 1e-3, 5 warmup steps then cosine to 0, gradient clip 5, 2 epochs of 50k lists at batch 128
# (drop_last: 390 steps an epoch).
PAPER_RECIPE = dict(
    model=dict(
        norm_position="post", pos="sinusoidal", mlp="relu", mlp_width=2, dropout=0.1, head="norm_mlp", bias=True
    ),
    train=dict(lr=1e-3, min_lr=0.0, warmup_steps=5, weight_decay=0.0, betas=(0.9, 0.999), grad_clip=5.0),
    batch_size=128,
    epochs=2,
)


def paper_recipe(task: str, point: dict[str, Any]) -> dict[str, Any]:
    """PAPER_RECIPE as TrainConfig overrides (`model` a mapping of model keys) for a grid point:
    its d_model (the MLP is 2 d_model wide) and n_train (default 50k: 2 epochs = 780 steps).
    The same for every synthetic task (one signature with the other task families')."""
    r = PAPER_RECIPE
    d_model, n_train = point["d_model"], point.get("n_train", 50_000)
    model = {k: v for k, v in r["model"].items() if k != "mlp_width"}
    model.update(d_model=d_model, mlp_hidden=r["model"]["mlp_width"] * d_model)
    steps = r["epochs"] * (n_train // r["batch_size"])
    return {"model": model, **r["train"], "batch_size": r["batch_size"], "max_steps": steps}


@dataclass
class SyntheticOptions:
    length: int = setting(16, help="digits per list (paper: 16, 64, 128)", minimum=1)
    n_train: int = setting(50_000, help="training lists", minimum=1)
    n_val: int = setting(1_000, help="validation lists", minimum=1)
    n_test: int = setting(10_000, help="test lists", minimum=1)
    data_seed: int = seed_setting(0, help="which lists; the training seed only orders them")
    plus_channels: int | None = setting(10, help="the '+' term's m (the paper's); None leaves the model config's")


OPTIONS_CLASS = SyntheticOptions  # the class `qkvlab.tasks.resolve_task_options` builds


class SyntheticTask(ArrayTask):
    family = "synthetic"
    unit = "list"

    def __init__(self, name: str, options: SyntheticOptions):
        o = options
        check_plus_channels(name, o)
        self.name, self.options = name, o
        s = synthetic_splits(name, o.length, o.data_seed, o.n_train, o.n_val, o.n_test)
        self.data = {"train": s.train, "val": s.val, "test": s.test}
        self.sizes = {k: int(v[0].shape[0]) for k, v in self.data.items()}
        self.tokens_per_example = o.length

    def adapt_config(self, cfg: ModelConfig) -> ModelConfig:
        extra = {} if self.options.plus_channels is None else {"plus_channels": self.options.plus_channels}
        return cfg.replace(vocab_size=VOCAB_SIZE, context=self.options.length, causal=False, **extra)

    def build_model(self, cfg: ModelConfig) -> nn.Module:
        return Encoder(cfg, TokenInput(cfg), head="token", n_out=VOCAB_SIZE)

    def rows(self, split: str, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.data[split]
        return x[index], y[index]  # (B, L) digits, (B, L) target digits

    def scores(self, split, pred, target, index):
        return {
            "accuracy": float((pred == target).double().mean()),
            "sequence_accuracy": float((pred == target).all(-1).double().mean()),
        }


def make_task(name: str, options: SyntheticOptions | None = None) -> SyntheticTask:
    if name not in TASKS:
        raise UserError(f"unknown synthetic task {name!r}; allowed: {', '.join(TASKS)}")
    return SyntheticTask(name, options or SyntheticOptions())
