"""Model directories (``model.safetensors`` + ``config.json``), metrics rows and tied weights.

Nothing a user may receive is a pickle: weights are safetensors, metadata JSON. The file writers
live in the torch-free `qkvlab.base.files`; import them from there.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from qkvlab import __version__
from qkvlab.base.errors import UserError
from qkvlab.base.files import atomic_dir, atomic_path, atomic_write, json_text, read_json
from qkvlab.base.folders import check_model_target
from qkvlab.model.config import ModelConfig
from qkvlab.model.limits import check_model
from qkvlab.model.positions import is_legacy_key
from qkvlab.model.transformer import GPT

WEIGHTS, CONFIG = "model.safetensors", "config.json"


# ---- metrics.jsonl ------------------------------------------------------------------------------
METRICS = "metrics.jsonl"


def read_metrics(folder: str | Path, *, required: bool = False) -> list[dict[str, Any]]:
    """The rows of FOLDER/metrics.jsonl (one JSON object per line). A missing file is no rows,
    unless `required`; a line that is not JSON, or no rows when `required`, is a one-line UserError."""
    path = Path(folder) / METRICS
    if not path.is_file():
        if required:
            raise UserError(f"{path}: no such file (not a training run folder?)")
        return []
    rows = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                raise UserError(f"{path}:{n}: not a JSON line") from None
    if required and not rows:
        raise UserError(f"{path}: no metrics rows")
    return rows


# ---- tied weights -------------------------------------------------------------------------------
def tied_aliases(model: torch.nn.Module) -> dict[str, str]:
    """Each further name of a shared parameter -> its first name, e.g. {'lm_head.weight':
    'tok_emb.weight'} for tied embeddings. The one way qkvlab handles tied weights: files hold each
    shared tensor once, under its first name (`drop_aliases`); loading fills or re-ties the rest."""
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            aliases[name] = first[id(p)]
        else:
            first[id(p)] = name
    return aliases


def drop_aliases(state: dict[str, torch.Tensor], aliases: dict[str, str]) -> dict[str, torch.Tensor]:
    """A state dict as a file holds it: no aliases (safetensors refuses shared storage), every
    tensor contiguous on the CPU."""
    return {k: v.detach().contiguous().cpu() for k, v in state.items() if k not in aliases}


def with_aliases(state: dict[str, torch.Tensor], aliases: dict[str, str]) -> dict[str, torch.Tensor]:
    """A state dict as `load_state_dict` wants it: every alias present (the same tensor)."""
    return {**state, **{alias: state[first] for alias, first in aliases.items() if first in state}}


def _retie(model: torch.nn.Module, aliases: dict[str, str]) -> None:
    """After `load_state_dict(assign=True)`, point every alias at its first name's parameter."""
    for alias, first in aliases.items():
        owner, _, attr = alias.rpartition(".")
        setattr(model.get_submodule(owner), attr, model.get_parameter(first))


def state_dict_for_save(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's state as a file holds it (see `tied_aliases`)."""
    return drop_aliases(model.state_dict(), tied_aliases(model))


def config_body(cfg: ModelConfig, kind: str = "gpt", meta: dict[str, Any] | None = None) -> dict[str, Any]:
    """What config.json holds: the model config, its kind, the writer's version, extra metadata."""
    return {"qkvlab_version": __version__, "kind": kind, "model": cfg.to_dict(), **(meta or {})}


def write_model_files(
    folder: Path, model: torch.nn.Module, cfg: ModelConfig, meta: dict[str, Any] | None = None
) -> None:
    """The model's two files in `folder`, each written atomically (a reader never sees half of one)."""
    weights = state_dict_for_save(model)
    with atomic_path(folder / WEIGHTS, needed=sum(t.numel() * t.element_size() for t in weights.values())) as tmp:
        save_file(weights, str(tmp), metadata={"format": "pt"})
    atomic_write(folder / CONFIG, json_text(config_body(cfg, "gpt", meta), indent=2))


def save_model(
    path: str | Path,
    model: torch.nn.Module,
    cfg: ModelConfig,
    meta: dict[str, Any] | None = None,
    *,
    overwrite: bool = False,
) -> Path:
    """Write a model folder atomically: into a missing or empty `path`, or over a model folder
    with overwrite=True; anything else is refused before writing (qkvlab.base.folders)."""
    check_model_target(path, overwrite=overwrite, flag="path")
    with atomic_dir(path, replace=overwrite) as tmp:
        write_model_files(tmp, model, cfg, meta)
    return Path(path)


def find_model_dir(path: str | Path) -> Path:
    """The model folder a user named: the folder itself, or its `checkpoint/` while a training run has
    not written its final model (generate, info, similarity, serve)."""
    p = Path(path)
    if not p.exists():
        raise UserError(f"{path}: no such model folder")
    if p.is_dir() and not (p / "config.json").exists() and (p / "checkpoint" / "config.json").exists():
        return p / "checkpoint"
    if not p.is_dir():
        raise UserError(
            f"{path}: a file, not a model folder (expected a folder with config.json and "
            "model.safetensors, written by qkvlab init/train/convert)"
        )
    return p


def read_config(path: str | Path) -> tuple[ModelConfig, dict[str, Any]]:
    """The model config of a model folder (or of its config.json) and the file's whole body: the one
    reader of qkvlab's config.json."""
    path = Path(path)
    cfg_file = path / CONFIG if path.is_dir() else path
    if not cfg_file.exists():
        raise UserError(f"{path}: no {CONFIG} found (expected a model folder written by qkvlab init/train/convert)")
    body = read_json(cfg_file)
    if not isinstance(body, dict) or "model" not in body:
        raise UserError(f"{cfg_file}: not a qkvlab config (no 'model' key); import other formats with qkvlab convert")
    return ModelConfig.from_dict(body["model"]), body


def is_model_folder(path: str | Path) -> bool:
    """True when `path` is a folder whose config.json is qkvlab's (a JSON object with a "model"
    key), not a Hugging Face folder or a GGUF file; never raises (reading it is `read_config`)."""
    cfg_file = Path(path) / CONFIG
    try:
        body = read_json(cfg_file) if cfg_file.is_file() else None
    except UserError:
        return False
    return isinstance(body, dict) and "model" in body


def load_weights(file: str | Path) -> dict[str, torch.Tensor]:
    file = Path(file)
    if not file.exists():
        raise UserError(f"{file}: no such weights file (expected {WEIGHTS})")
    try:
        return load_file(str(file))
    except (SafetensorError, OSError, ValueError) as e:
        head = file.read_bytes()[:2]
        kind = "a pickle" if head[:1] == b"\x80" or head == b"PK" else "not safetensors"
        raise UserError(
            f"{file}: {kind}; qkvlab reads weights only as safetensors ({str(e).splitlines()[0]})"
        ) from None


def load_model(path: str | Path, *, device: str | torch.device = "cpu", dtype: torch.dtype | None = None):
    """Read a model folder -> (GPT, ModelConfig, config body). Shapes must match exactly.

    The model is built on the meta device and the file's tensors become its parameters
    (`load_state_dict(assign=True)`, as gpt-fast does): no random initialisation is computed and
    thrown away. Weights keep their stored dtype (float64 stays float64 for exact conversions)."""
    cfg, body = read_config(path)
    if body.get("kind", "gpt") != "gpt":
        raise UserError(f"{path}: a {body.get('kind')!r} model; this command needs a decoder ('gpt')")
    check_model(cfg, f"the model in {path}")  # a hostile config.json cannot make us allocate terabytes
    model = build_model_from_state(GPT, cfg, load_weights(Path(path) / WEIGHTS), str(path))
    model.to(device=device, dtype=dtype) if dtype is not None else model.to(device)
    return model.eval(), cfg, body


def build_model_from_state(
    cls: Callable[[ModelConfig], torch.nn.Module], cfg: ModelConfig, state: dict[str, torch.Tensor], where: str
) -> torch.nn.Module:
    """`cls(cfg)` holding `state`'s tensors, built on the meta device (see `load_model`): the one
    way qkvlab turns tensors into a model (files, converters, imports). Every key must fit, by name
    and shape; a state from a live model may hold tied aliases (`tied_aliases`) equal to their first name.

    A file of one float dtype gives a model of that dtype (its computed tables too); mixed float
    dtypes are read as float32. Computed tables (non-persistent buffers: rotary, sinusoids) are
    rebuilt by each module's `build_tables`."""
    bad = sorted(k for k, t in state.items() if not t.is_floating_point())
    if bad:
        raise UserError(
            f"{where}: tensor {bad[0]} has dtype {state[bad[0]].dtype}; model weights must be floating point"
        )
    bad = next((k for k in sorted(state) if not torch.isfinite(state[k]).all()), None)
    if bad is not None:
        raise UserError(f"{where}: tensor {bad} holds NaN or infinite values; this model cannot be used")
    stored = {t.dtype for t in state.values()}
    target = stored.pop() if len(stored) == 1 else torch.float32
    with torch.random.fork_rng(devices=[]), torch.device("meta"):  # the caller's RNG stays untouched
        model = cls(cfg)  # (a model draws its init seed from it even on meta: init.py)
    aliases = tied_aliases(model)
    state = _fold_aliases(state, aliases, where)
    check_state(model, state, aliases, where)
    # copies in fresh (64-byte aligned) memory: safetensors' tensors sit at arbitrary offsets of
    # one buffer, and float kernels may sum in another order on unaligned data (not bit-identical)
    owned = {k: t.to(target, copy=True) for k, t in state.items()}
    model.load_state_dict(with_aliases(owned, aliases), assign=True)
    _retie(model, aliases)
    for module in model.modules():
        if hasattr(module, "build_tables"):
            module.build_tables()
    left = [n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]
    if left:  # a module with a computed buffer but no build_tables
        raise RuntimeError(f"{where}: {left[0]} was not loaded or rebuilt")
    if len({t.dtype for t in state.values()}) == 1:
        model.to(target)  # the tables follow the weights' dtype, as after GPT(cfg).to(dtype)
    return model


def _fold_aliases(state: dict[str, torch.Tensor], aliases: dict[str, str], where: str) -> dict[str, torch.Tensor]:
    """A state as `model.state_dict()` gives it (tied aliases present) -> as a file holds it. An alias
    holding another tensor than its first name is refused by name: the config ties them."""
    for alias, first in aliases.items():
        if alias in state and first in state and not torch.equal(state[alias], state[first]):
            raise UserError(f"{where}: {alias} differs from {first}, which this config ties it to")
    return {k: v for k, v in state.items() if k not in aliases}


def check_state(model: torch.nn.Module, state: dict[str, torch.Tensor], aliases: dict[str, str], where: str) -> None:
    """One line naming the first tensor that is missing, unexpected or of the wrong shape (keys older
    versions wrote that never acted, positions.LEGACY_KEYS, are accepted: loading drops them)."""
    expected = {k: v for k, v in model.state_dict().items() if k not in aliases}
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(k for k in set(state) - set(expected) if not is_legacy_key(k))
    if missing or unexpected:
        what = f"missing {missing[0]}" if missing else f"unexpected {unexpected[0]}"
        raise UserError(
            f"{where}: weights do not fit this architecture ({what}, {len(missing)} missing, {len(unexpected)} unexpected)"
        )
    for name, t in state.items():
        if name in expected and tuple(t.shape) != tuple(expected[name].shape):
            raise UserError(f"{where}: {name} has shape {tuple(t.shape)}, config expects {tuple(expected[name].shape)}")
