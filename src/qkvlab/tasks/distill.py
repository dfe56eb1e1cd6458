"""Distillation: a student (a model folder, e.g. a retrofitted one) learns from a frozen teacher.

loss = lm_weight * LM cross-entropy + kl_weight * KL(teacher || student), per token, temperature 1.
The student starts from its folder's weights (not a fresh init); the teacher is a qkvlab model
folder or a Hugging Face GPT-2/Llama folder or .gguf (imported through convert/hf.py). Batches are
random windows of a token file (safetensors with int64 tensors "train" and "val", as written by
`qkvlab.retrofit.workflow.write_tokens`) drawn from (seed, step) like the LM task, so the training
loop resumes it exactly. Options: teacher, student, tokens, kl_weight (1.0), lm_weight (1.0; 0:
pure distillation, which cannot adapt the student to the corpus beyond the teacher), block_size
(the student's context, at most 256), train_layers (None: every weight trains; a list of layer
indices: only those layers' attention weights do, e.g. a retrofit's converted layers, so the
backward pass skips the embedding's and the MLPs' weight gradients), rest_lr_scale (0; with
train_layers, > 0 trains every other weight too, at that fraction of the learning rate).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file

from qkvlab.base.errors import UserError
from qkvlab.base.settings import setting
from qkvlab.convert.hf import from_hf, load_hf, quiet
from qkvlab.data.prepare import fixed_val_batches, get_batch
from qkvlab.model.config import ModelConfig
from qkvlab.model.folder import is_model_folder, load_model, read_config
from qkvlab.tasks.base import Task
from qkvlab.tasks.lm import VAL_SEED, step_generator

DEFAULT_BLOCK = 256


@dataclass
class DistillOptions:
    teacher: str | None = setting(None, help="the teacher: a qkvlab model folder, a Hugging Face folder or a .gguf")
    student: str | None = setting(None, help="the student's model folder (its weights are the start)")
    tokens: str | None = setting(None, help="token file (safetensors, int64 tensors train and val)")
    kl_weight: float = setting(1.0, help="weight of KL(teacher || student)", minimum=0)
    lm_weight: float = setting(1.0, help="weight of the LM cross-entropy (0: pure distillation)", minimum=0)
    block_size: int | None = setting(
        None, help=f"training window (default: the student's context, at most {DEFAULT_BLOCK})", minimum=1
    )
    train_layers: tuple[int, ...] | None = setting(
        None, help="layers whose attention weights train (default: every weight)", minimum=0
    )
    rest_lr_scale: float = setting(
        0.0, help="with train_layers: the other weights train too, at this fraction of the lr (0: frozen)", minimum=0
    )


OPTIONS_CLASS = DistillOptions  # the class `qkvlab.tasks.resolve_task_options` builds


def kl_teacher_student(teacher_logits: torch.Tensor, student_logits: torch.Tensor) -> torch.Tensor:
    """Mean over tokens of KL(p_teacher || p_student), (B, T, V) logits, computed in float32."""
    t = F.log_softmax(teacher_logits.float(), -1)
    s = F.log_softmax(student_logits.float(), -1)
    return (t.exp() * (t - s)).sum(-1).mean()


def check_loss_weights(kl_weight, lm_weight, nothing: str = "nothing to train on") -> None:
    """The distillation loss's two weights: numbers >= 0, not both 0 (retrofit checks them before its fit)."""
    for key, value in (("kl_weight", kl_weight), ("lm_weight", lm_weight)):
        if not (isinstance(value, (int, float)) and value >= 0):
            raise UserError(f"{key}={value!r} must be a number >= 0")
    if kl_weight == 0 and lm_weight == 0:
        raise UserError(f"kl_weight and lm_weight are both 0: {nothing}")


class DistillTask(Task):
    name = "distill"
    model_kind = "gpt"
    metric = "val_loss"
    higher_is_better = False

    def __init__(
        self,
        teacher: str | None = None,
        student: str | None = None,
        tokens: str | None = None,
        kl_weight: float = 1.0,
        lm_weight: float = 1.0,
        block_size: int | None = None,
        train_layers: list[int] | None = None,
        rest_lr_scale: float = 0.0,
    ):
        for key, value in (("teacher", teacher), ("student", student), ("tokens", tokens)):
            if not value:
                raise UserError(f"the distill task needs the option {key} (a path)")
        check_loss_weights(kl_weight, lm_weight)
        if block_size is not None and (not isinstance(block_size, int) or block_size <= 0):
            raise UserError(f"block_size={block_size!r} must be a positive integer")
        self.teacher_path, self.student_path, self.tokens_path = str(teacher), str(student), str(tokens)
        self.kl_weight, self.lm_weight, self._block_size = float(kl_weight), float(lm_weight), block_size
        if not Path(self.tokens_path).is_file():
            raise UserError(f"{self.tokens_path}: no such token file")
        data = load_file(self.tokens_path)
        self.train_ids, self.val_ids = data["train"].numpy(), data["val"].numpy()
        self.student_cfg, _ = read_config(self.student_path)
        if train_layers is not None:
            n = self.student_cfg.n_layer
            if not isinstance(train_layers, (list, tuple)) or not all(
                isinstance(i, int) and not isinstance(i, bool) and 0 <= i < n for i in train_layers
            ):
                raise UserError(f"train_layers={train_layers!r} must be a list of layer indices in [0, {n})")
        self.train_layers = None if train_layers is None else sorted(set(train_layers))
        if not (isinstance(rest_lr_scale, (int, float)) and rest_lr_scale >= 0):
            raise UserError(f"rest_lr_scale={rest_lr_scale!r} must be a number >= 0")
        if rest_lr_scale and train_layers is None:
            raise UserError(
                f"rest_lr_scale={rest_lr_scale} needs train_layers (without them every weight trains at the lr)"
            )
        self.rest_lr_scale = float(rest_lr_scale)
        self._full_lr: set[str] = set()  # names of the train_layers' attention weights (build_model)
        self._teacher: nn.Module | None = None
        self._val: dict[tuple[int, int, int], list] = {}

    @property
    def block(self) -> int:
        return self._block_size or min(self.student_cfg.context, DEFAULT_BLOCK)

    def adapt_config(self, cfg: ModelConfig) -> ModelConfig:
        """The student's own config: its weights are the starting point."""
        return self.student_cfg

    def build_model(self, cfg: ModelConfig) -> nn.Module:
        model, _, _ = load_model(self.student_path, dtype=torch.float32)
        if self.train_layers is not None:  # the optimizer takes only what requires grad (train/optim.py)
            model.requires_grad_(self.rest_lr_scale > 0)
            attn = {id(p) for i in self.train_layers for p in model.trunk.layer(i).attn.parameters()}
            self._full_lr = {n for n, p in model.named_parameters() if id(p) in attn}
            for i in self.train_layers:
                model.trunk.layer(i).attn.requires_grad_(True)
        return model

    def lr_scale(self, name: str) -> float:
        return 1.0 if self.train_layers is None or name in self._full_lr else self.rest_lr_scale

    def teacher(self, device: torch.device) -> nn.Module:
        if self._teacher is None:
            if is_model_folder(self.teacher_path):
                model, _, _ = load_model(self.teacher_path)
            else:  # a Hugging Face folder or .gguf, imported as retrofit imports its source
                quiet()
                model, _ = from_hf(load_hf(Path(self.teacher_path)))
            self._teacher = model.float().eval().requires_grad_(False)
        return self._teacher.to(device)

    def batch(self, step: int, batch_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        return get_batch(self.train_ids, batch_size, self.block, step_generator(seed, step))

    def loss(self, model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits, lm = model(inputs, targets if self.lm_weight else None)  # no LM loss to compute at weight 0
        if self.kl_weight == 0:
            return self.lm_weight * lm
        with torch.no_grad():
            teacher_logits, _ = self.teacher(inputs.device)(inputs)
        kl = self.kl_weight * kl_teacher_student(teacher_logits, logits)
        return kl if lm is None else self.lm_weight * lm + kl

    @torch.no_grad()
    def evaluate(self, model: nn.Module, *, batch_size: int, max_batches: int | None = None) -> dict[str, float]:
        n = max_batches or 10
        key = (n, batch_size, self.block)
        if key not in self._val:
            self._val[key] = fixed_val_batches(self.val_ids, n, batch_size, self.block, seed=VAL_SEED)
        device = next(model.parameters()).device
        total = kl = 0.0
        for x, y in self._val[key]:
            x, y = x.to(device), y.to(device)
            logits, loss = model(x, y)
            total += float(loss)
            kl += float(kl_teacher_student(self.teacher(device)(x)[0], logits))
        val_loss = total / n
        return {"val_loss": val_loss, "val_ppl": math.exp(min(val_loss, 700.0)), "val_kl": kl / n}

    def describe(self) -> dict[str, Any]:
        return {
            "task": self.name,
            "teacher": self.teacher_path,
            "student": self.student_path,
            "tokens": self.tokens_path,
            "kl_weight": self.kl_weight,
            "lm_weight": self.lm_weight,
            "block_size": self.block,
            "train_layers": self.train_layers,
            "rest_lr_scale": self.rest_lr_scale,
        }


def make_task(name: str = "distill", options: DistillOptions | None = None) -> DistillTask:
    return DistillTask(**asdict(options or DistillOptions()))
