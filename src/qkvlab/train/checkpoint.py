"""Checkpoints: a folder of safetensors + JSON, published atomically, never a pickle.

  OUT/checkpoint/model.safetensors      full (gathered) weights: the folder is a model folder too
  OUT/checkpoint/config.json            as written by qkvlab.model.folder (loadable by load_model)
  OUT/checkpoint/optimizer.safetensors  optimizer state flattened to "<param name>/<key>" tensors
  OUT/checkpoint/state.json             step, metrics so far, RNG states, param groups, train config

The folder is built beside OUT/checkpoint and renamed over it (`qkvlab.model.folder.atomic_dir`), state.json
last, so a kill at any moment leaves the previous complete checkpoint; `find_checkpoint` also
recovers it from the moment between the two renames, when it is parked as `.checkpoint.old-*`.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from qkvlab.base.errors import UserError
from qkvlab.base.files import atomic_dir, atomic_file, atomic_write, file_sha256, json_text
from qkvlab.base.model_files import json_key, typed
from qkvlab.model.config import ModelConfig
from qkvlab.model.folder import CONFIG, WEIGHTS, check_state, config_body, load_weights, read_config, safetensors_keys
from qkvlab.model.positions import is_legacy_key

CHECKPOINT = "checkpoint"
OPTIMIZER = "optimizer.safetensors"
STATE = "state.json"
SLOW_HOOK = "QKVLAB_TEST_SLOW_CHECKPOINT"  # tests: seconds to sleep mid-write, widening the kill window


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
    """Write OUT/checkpoint atomically (call on one rank, with gathered full state dicts). The new
    folder is verified (headers readable, checksums recorded in state.json) before it replaces the
    previous checkpoint, which stays until then."""
    path = Path(out_dir) / CHECKPOINT
    tensors, groups = flatten_optimizer(optimizer)
    needed = sum(t.numel() * t.element_size() for t in [*weights.values(), *tensors.values()])  # + a few kB of JSON
    with atomic_dir(path, needed=needed) as tmp:
        save_file(weights, str(tmp / WEIGHTS), metadata={"format": "pt"})
        (tmp / CONFIG).write_text(json_text(config_body(model_cfg, kind, {"step": state["step"]}), indent=2))
        save_file(tensors, str(tmp / OPTIMIZER))
        if os.environ.get(SLOW_HOOK):
            time.sleep(float(os.environ[SLOW_HOOK]))
        files = {name: _file_record(tmp / name) for name in (WEIGHTS, OPTIMIZER)}
        (tmp / STATE).write_text(json_text({**state, "optimizer_param_groups": groups, "files": files}))
    return path


def _file_record(file: Path) -> dict[str, Any]:
    safetensors_keys(file)
    return {"bytes": file.stat().st_size, "sha256": file_sha256(file)}


def _read_state(folder: Path) -> dict[str, Any] | None:
    try:
        state = json.loads((folder / STATE).read_text())
    except (OSError, ValueError):
        return None
    return state if isinstance(state, dict) and isinstance(state.get("step"), int) else None


def checkpoint_step(out_dir: Path) -> int | None:
    """The step of OUT's checkpoint; None when it has none (or none that can be read)."""
    state = _read_state(Path(out_dir) / CHECKPOINT)
    return None if state is None else state["step"]


def verify_checkpoint(folder: Path, *, hashes: bool = True, resuming: bool = False) -> dict[str, Any]:
    """state.json of a checkpoint whose files are all there and intact (sizes and sha256 as
    recorded, readable safetensors headers), its state.json and config.json typed key by key (with
    `resuming`, every key resuming reads present); else a one-line UserError naming the bad file.
    hashes=False: sizes and headers only (a rank whose reader already checked the sha256s: hashing
    reads every byte, 14 GB per rank at 1.2B parameters)."""
    folder = Path(folder)
    how = f"the checkpoint cannot be resumed; restore it or train into another --out (nothing was changed in {folder.parent})"
    state = _read_state(folder)
    if state is None:
        raise UserError(f"{folder / STATE}: missing, truncated or not a checkpoint state; {how}")
    for name in (WEIGHTS, OPTIMIZER, CONFIG):
        if not (folder / name).is_file():
            raise UserError(f"{folder / name}: missing; {how}")
    try:
        check_state_json(
            state, folder / STATE, required=tuple(STATE_TYPES) if resuming else ("step", "optimizer_param_groups")
        )
        read_config(folder)  # what `generate OUT` reads: its keys typed
    except UserError as e:
        raise UserError(f"{e}; {how}") from None
    for name, want in state.get("files", {}).items():
        file = folder / name
        if file.stat().st_size != want["bytes"] or (hashes and file_sha256(file) != want["sha256"]):
            raise UserError(f"{file}: size or sha256 differs from what was written (damaged); {how}")
    for name in (WEIGHTS, OPTIMIZER):
        try:
            safetensors_keys(folder / name)
        except UserError as e:
            raise UserError(f"{e}; {how}") from None
    return state


STATE_TYPES = {  # what resuming reads from state.json (written by train.loop's save_checkpoint)
    "step": int,
    "tokens": int,
    "metrics": list,
    "loss_sum": float,
    "loss_n": int,
    "elapsed_s": float,
    "rng": list,
    "train_config": dict,
    "optimizer_param_groups": list,
}


def check_state_json(state: dict[str, Any], where: Path, required: tuple[str, ...]) -> None:
    """The keys of a checkpoint's state.json, each of its type; the `required` ones present (resuming
    needs them all; `load_checkpoint` alone, the step and the optimizer's groups). A damaged
    state.json is refused naming the key, not read into a crash at the first step."""
    for name, t in STATE_TYPES.items():
        json_key(state, name, t, where, **({} if name in required else {"default": None}))
    for name, want in json_key(state, "files", dict, where, default={}).items():  # older checkpoints have none
        typed(want, dict, f"{where}'s files.{name}")
        json_key(want, "bytes", int, f"{where}'s files.{name}")
        json_key(want, "sha256", str, f"{where}'s files.{name}")
    for i, row in enumerate(state.get("metrics") or []):
        typed(row, dict, f"{where}'s metrics[{i}]")
    for i, rng in enumerate(state.get("rng") or []):
        json_key(typed(rng, dict, f"{where}'s rng[{i}]"), "torch", str, f"{where}'s rng[{i}]")


def find_checkpoint(out_dir: Path, *, repair: bool = True) -> Path | None:
    """OUT's checkpoint folder (or None when there is none). With `repair`, a checkpoint parked
    between atomic_dir's two renames is moved back and half-written temp folders are removed.
    `load_checkpoint` verifies it: one that does not verify is refused, never skipped."""
    out_dir = Path(out_dir)
    path = out_dir / CHECKPOINT
    if repair and not path.exists():
        parked = [(s["step"], p) for p in out_dir.glob(f".{CHECKPOINT}.old-*") if (s := _read_state(p))]
        if parked:
            os.replace(max(parked)[1], path)
    if repair:
        for leftover in (*out_dir.glob(f".{CHECKPOINT}.tmp-*"), *out_dir.glob(f".{CHECKPOINT}.old-*")):
            shutil.rmtree(leftover, ignore_errors=True)
    return path if path.exists() else None


def load_checkpoint(
    path: Path, *, tensors: bool = True, hashes: bool = True
) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, Any]]:
    """-> (model weights, optimizer state dict, state.json), verified (`verify_checkpoint`; hashes:
    sha256 too). tensors=False: empty dicts for the first two (FSDP ranks other than 0, loaded by broadcast)."""
    path = Path(path)
    state = verify_checkpoint(path, hashes=hashes)
    groups = state.pop("optimizer_param_groups")
    state.pop("files", None)
    if not tensors:
        return {}, {}, state
    weights = load_weights(path / WEIGHTS)
    optimizer = unflatten_optimizer(load_weights(path / OPTIMIZER), groups)
    return weights, optimizer, state


def check_against_model(
    weights: dict[str, torch.Tensor],
    optimizer: dict[str, Any],
    model: torch.nn.Module,
    aliases: dict[str, str],
    path: Path,
) -> None:
    """The checkpoint's tensors fit `model`: names, shapes, floating dtypes (one line otherwise)."""
    where = str(Path(path) / WEIGHTS)
    bad = sorted(k for k, t in weights.items() if not t.is_floating_point())
    if bad:
        raise UserError(f"{where}: tensor {bad[0]} has dtype {weights[bad[0]].dtype}; weights must be floating point")
    check_state(model, weights, aliases, where)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    for name, entry in optimizer["state"].items():
        if is_legacy_key(name):  # dropped when loaded (train.distributed)
            continue
        for key, t in entry.items():
            if name not in shapes or (t.dim() > 0 and tuple(t.shape) != shapes[name]):
                got = tuple(t.shape) if name in shapes else "no such parameter"
                raise UserError(
                    f"{Path(path) / OPTIMIZER}: {name}/{key} does not fit the model ({got}); the checkpoint is not this run's"
                )


def write_final_model(out_dir: Path, state: dict[str, Any], train_config: dict[str, Any]) -> None:
    """OUT/model.safetensors + OUT/config.json from OUT's checkpoint (whose state.json is `state`),
    so OUT is a model folder. Weights first, config last (each replaced atomically); config.json's
    `train.finished` marks it."""
    out_dir = Path(out_dir)
    ckpt = out_dir / CHECKPOINT
    with open(ckpt / WEIGHTS, "rb") as src, atomic_file(out_dir / WEIGHTS, "wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 22)
    _, body = read_config(ckpt)
    body.pop("step", None)
    train = {
        "finished": True,
        "step": state["step"],
        "tokens": state["tokens"],
        "metrics": state["metrics"][-1] if state["metrics"] else {},
        "task": state.get("task"),
        "config": train_config,
    }
    atomic_write(out_dir / CONFIG, json_text({**body, "train": train}, indent=2))


# ---- RNG streams (dropout) ----------------------------------------------------------------------
def derived_seed(*parts: int) -> int:
    """A seed from integers (hashed, so streams of different (seed, step, rank) never overlap)."""
    return int.from_bytes(hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=8).digest(), "little") >> 1


def rng_state(device: torch.device) -> dict[str, Any]:
    """This process's RNG states, base64 of the byte tensors (JSON for state.json)."""
    enc = lambda t: base64.b64encode(t.numpy().tobytes()).decode()  # noqa: E731
    state = {"torch": enc(torch.get_rng_state())}
    if device.type == "cuda":
        state["cuda"] = enc(torch.cuda.get_rng_state(device))
    return state


def set_rng_state(device: torch.device, state: dict[str, Any]) -> None:
    dec = lambda s: torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)  # noqa: E731
    torch.set_rng_state(dec(state["torch"]))
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(dec(state["cuda"]), device)
