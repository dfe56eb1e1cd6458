"""A training run's folder: claimed and locked for one process, its config written before the
first step, its checkpoint read back verified and checked against the config (docs/safety.md)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from qkvlab.base.errors import UserError
from qkvlab.base.files import atomic_write, json_text
from qkvlab.base.folders import Claim, claim_folder
from qkvlab.train import checkpoint as ck
from qkvlab.train import distributed as D
from qkvlab.train.config import TrainConfig, changed_fields

TRAIN_CONFIG = "train_config.json"


REFUSAL_ADVICE = {
    "run": "pass --resume to continue it, or choose another --out",
    "model": "that is a model folder, not a training run: choose another --out",
    "file": "give --out a folder path",
}


def claim_run_folder(out: Path, env: D.Env, resume: bool) -> Claim | None:
    """Rank 0 creates and locks OUT, refusing what is not a run it may write; every rank learns
    the verdict (so a refusal is one line on every rank, not a hang at the next barrier)."""
    claimed: list[Claim | None] = [None]

    def claim() -> None:
        claimed[0] = claim_folder(out, accept=("run",) if resume else (), advice=REFUSAL_ADVICE)

    verdict_on_rank0(env, claim)
    return claimed[0]


@dataclass
class Saved:
    """A checkpoint as read: full weights, optimizer state dict, state.json."""

    weights: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    state: dict[str, Any]


def read_checkpoint(cfg: TrainConfig, out: Path, env: D.Env, resume: bool) -> Saved | None:
    """OUT's checkpoint, or None to start fresh. Rank 0 first repairs an interrupted checkpoint
    write and verifies it (sha256 of every file; every rank learns the verdict), then every rank
    reads (under FSDP only rank 0 reads the tensors), checking sizes and headers only."""
    if env.main:
        ck.find_checkpoint(out, repair=True)
    D.barrier(env)
    found = ck.find_checkpoint(out, repair=False)
    if found is None:
        return None
    if not resume:
        raise UserError(f"{out} already holds a checkpoint; pass --resume to continue it or choose another --out")
    verdict_on_rank0(env, lambda: ck.verify_checkpoint(found, resuming=True))  # sha256 read once, by rank 0
    fsdp = env.distributed and cfg.sharding == "fsdp"  # rank 0 alone holds the tensors; it broadcasts them
    weights, optim_state, state = ck.load_checkpoint(found, tensors=env.main or not fsdp, hashes=False)
    check_resumable(state["train_config"], cfg, out)
    if state["step"] > cfg.max_steps:
        raise UserError(f"{found} is at step {state['step']}, beyond max_steps={cfg.max_steps}")
    return Saved(weights, optim_state, state)


def verdict_on_rank0(env: D.Env, check) -> None:
    """Run `check` on rank 0; its UserError is raised on every rank (not a hang at the next collective)."""
    error = None
    if env.main:
        try:
            check()
        except UserError as e:
            error = e
    verdict = D.all_gather_object(env, None if error is None else str(error))[0]
    if error is not None:
        raise error
    if verdict is not None:
        raise UserError(verdict)


def first_difference(key: str, old: Any, new: Any) -> tuple[str, Any, Any]:
    """The first differing leaf under `key` (model.d_model, not the whole model): (dotted key, old, new)."""
    if isinstance(old, dict) and isinstance(new, dict):
        for k in sorted(set(old) | set(new), key=str):
            if old.get(k) != new.get(k):
                return first_difference(f"{key}.{k}", old.get(k), new.get(k))
    return key, old, new


def check_resumable(saved: dict[str, Any], cfg: TrainConfig, where: Path) -> None:
    for key, (old, new) in changed_fields(saved, cfg).items():  # RESUMABLE_FIELDS (train/config.py) may change
        name, old, new = first_difference(key, old, new)
        raise UserError(
            f"{where} was trained with {name}={json.dumps(old)}, not {json.dumps(new)}; "
            f"resume with the same {name} or use another --out"
        )


def write_train_config(out: Path, cfg: TrainConfig) -> None:
    """OUT/train_config.json, before any step: what `train --out OUT --resume` alone continues.
    A run's existing config must agree on every key that is not resumable."""
    path = out / TRAIN_CONFIG
    if path.exists():
        try:
            saved = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            raise UserError(f"{path}: unreadable or not JSON; restore it or train into another --out") from None
        check_resumable(saved, cfg, out)
    atomic_write(path, json_text(cfg.to_dict(), indent=2))
