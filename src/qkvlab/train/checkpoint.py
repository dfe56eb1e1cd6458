"""Checkpoints: a folder of safetensors + JSON, published atomically, never a pickle.

  OUT/checkpoint/model.safetensors      full (gathered) weights: the folder is a model folder too
  OUT/checkpoint/config.json            as written by qkvlab.io (loadable by load_model)
  OUT/checkpoint/optimizer.safetensors  optimizer state flattened to "<param name>/<key>" tensors
  OUT/checkpoint/state.json             step, metrics so far, RNG states, param groups, train config

The folder is built beside OUT/checkpoint and renamed over it (`qkvlab.io.atomic_dir`), state.json
last, so a kill at any moment leaves the previous complete checkpoint; `find_checkpoint` also
recovers it from the moment between the two renames, when it is parked as `.checkpoint.old-*`.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from qkvlab.config import ModelConfig
from qkvlab.errors import UserError
from qkvlab.io import CONFIG, WEIGHTS, atomic_dir, atomic_write_text, config_body

CHECKPOINT = "checkpoint"
OPTIMIZER = "optimizer.safetensors"
STATE = "state.json"
SLOW_HOOK = "QKVLAB_TEST_SLOW_CHECKPOINT"  # tests: seconds to sleep mid-write, widening the kill window


def untie(state: dict[str, torch.Tensor], tied: dict[str, str]) -> dict[str, torch.Tensor]:
    """Drop the second name of each tied pair (safetensors refuses shared storage) and make every
    tensor contiguous on the CPU."""
    return {k: v.detach().contiguous().cpu() for k, v in state.items() if k not in tied}


def flatten_optimizer(osd: dict[str, Any]) -> tuple[dict[str, torch.Tensor], list[dict[str, Any]]]:
    """{'state': {name: {key: tensor}}, 'param_groups': [...]} -> flat tensors + JSON groups."""
    tensors: dict[str, torch.Tensor] = {}
    for name, entry in osd["state"].items():
        for key, value in entry.items():
            t = value if isinstance(value, torch.Tensor) else torch.tensor(value)
            tensors[f"{name}/{key}"] = t.detach().contiguous().cpu()
    groups = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()} for g in osd["param_groups"]]
    return tensors, groups


def unflatten_optimizer(tensors: dict[str, torch.Tensor], groups: list[dict[str, Any]]) -> dict[str, Any]:
    state: dict[str, dict[str, torch.Tensor]] = {}
    for flat, t in tensors.items():
        name, _, key = flat.rpartition("/")
        state.setdefault(name, {})[key] = t
    groups = [{k: (tuple(v) if k == "betas" else v) for k, v in g.items()} for g in groups]
    return {"state": state, "param_groups": groups}


def save_checkpoint(
    out_dir: Path,
    weights: dict[str, torch.Tensor],
    optimizer: dict[str, Any],
    model_cfg: ModelConfig,
    kind: str,
    state: dict[str, Any],
) -> Path:
    """Write OUT/checkpoint atomically (call on one rank, with gathered full state dicts)."""
    path = Path(out_dir) / CHECKPOINT
    with atomic_dir(path) as tmp:
        save_file(weights, str(tmp / WEIGHTS), metadata={"format": "pt"})
        (tmp / CONFIG).write_text(json.dumps(config_body(model_cfg, kind, {"step": state["step"]}), indent=2) + "\n")
        tensors, groups = flatten_optimizer(optimizer)
        save_file(tensors, str(tmp / OPTIMIZER))
        if os.environ.get(SLOW_HOOK):
            time.sleep(float(os.environ[SLOW_HOOK]))
        (tmp / STATE).write_text(json.dumps({**state, "optimizer_param_groups": groups}) + "\n")
    return path


def _complete(folder: Path) -> dict[str, Any] | None:
    try:
        return json.loads((folder / STATE).read_text())
    except (OSError, ValueError):
        return None


def find_checkpoint(out_dir: Path, *, repair: bool = True) -> Path | None:
    """The last complete checkpoint of OUT (or None). With `repair`, a checkpoint parked between
    atomic_dir's two renames is moved back and half-written temp folders are removed."""
    out_dir = Path(out_dir)
    path = out_dir / CHECKPOINT
    if _complete(path) is None and repair:
        parked = [(s["step"], p) for p in out_dir.glob(f".{CHECKPOINT}.old-*") if (s := _complete(p))]
        if parked:
            shutil.rmtree(path, ignore_errors=True)
            os.replace(max(parked)[1], path)
    if repair:
        for leftover in (*out_dir.glob(f".{CHECKPOINT}.tmp-*"), *out_dir.glob(f".{CHECKPOINT}.old-*")):
            shutil.rmtree(leftover, ignore_errors=True)
    return path if _complete(path) is not None else None


def load_checkpoint(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, Any]]:
    """-> (model weights, optimizer state dict, state.json)."""
    path = Path(path)
    state = _complete(path)
    if state is None:
        raise UserError(f"{path}: not a complete qkvlab checkpoint (no readable {STATE})")
    weights = load_file(str(path / WEIGHTS))
    optimizer = unflatten_optimizer(load_file(str(path / OPTIMIZER)), state.pop("optimizer_param_groups"))
    return weights, optimizer, state


def write_final_model(out_dir: Path, ckpt: Path, body_extra: dict[str, Any]) -> None:
    """OUT/model.safetensors + OUT/config.json from a checkpoint, so OUT is a model folder.
    Weights first, config last (each replaced atomically); config.json's `train.finished` marks it."""
    out_dir = Path(out_dir)
    tmp = out_dir / f".{WEIGHTS}.{os.getpid()}.tmp"
    shutil.copyfile(ckpt / WEIGHTS, tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, out_dir / WEIGHTS)
    body = json.loads((ckpt / CONFIG).read_text())
    body.pop("step", None)
    atomic_write_text(out_dir / CONFIG, json.dumps({**body, **body_extra}, indent=2) + "\n")
