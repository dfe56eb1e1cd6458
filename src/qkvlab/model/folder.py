"""Model directories (``model.safetensors`` + ``config.json``), metrics rows and tied weights.

Nothing a user may receive is a pickle: weights are safetensors, metadata JSON. The file writers
live in the torch-free `qkvlab.base.files`; import them from there.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from qkvlab import __version__
from qkvlab.base.errors import UserError
from qkvlab.base.files import atomic_dir, atomic_path, atomic_write, json_text
from qkvlab.base.folders import check_model_target
from qkvlab.base.model_files import json_key, member, model_root, read_json
from qkvlab.model.accounting import analytic_params
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
            except (ValueError, RecursionError):  # JSONDecodeError, an integer of 4,300+ digits, deep nesting
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


def run_checkpoint(path: str | Path) -> Path | None:
    """`path/checkpoint` when `path` is a training run folder that has not written its final model
    yet (no config.json of its own), checked to lie inside it; else None."""
    p = Path(path)
    if not p.is_dir() or (p / CONFIG).exists():
        return None
    ckpt = member(p, "checkpoint", "folder", missing_ok=True)
    return ckpt if ckpt is not None and member(ckpt, CONFIG, "settings", within=p, missing_ok=True) else None


def find_model_dir(path: str | Path) -> Path:
    """The model folder a user named: the folder itself, or its `checkpoint/` while a training run has
    not written its final model (generate, info, convert). When it holds weights, its config must fit
    in them (`check_weights_size`), before anything (a decode probe, a tokenizer) is built from it."""
    p = Path(path)
    if not p.exists():
        raise UserError(f"{path}: no such model folder")
    p = run_checkpoint(p) or p
    if not p.is_dir():
        raise UserError(
            f"{path}: a file, not a model folder (expected a folder with config.json and "
            "model.safetensors, written by qkvlab init/train/convert)"
        )
    if os.path.lexists(p / CONFIG) and os.path.lexists(p / WEIGHTS):  # what commands then build from it
        check_weights_size(read_config(p)[0], p)
    return p


def read_config(path: str | Path) -> tuple[ModelConfig, dict[str, Any]]:
    """The model config of a model folder (or of its config.json) and the file's whole body: the one
    reader of qkvlab's config.json (through qkvlab.base.model_files: inside the folder, bounded, typed)."""
    path = Path(path)
    named = Path(os.path.realpath(path))  # a config.json the user named: where it really is
    folder, name = (path, CONFIG) if path.is_dir() else (named.parent, named.name)
    within = model_root(folder)
    if not os.path.lexists(folder / name):
        raise UserError(f"{path}: no {CONFIG} found (expected a model folder written by qkvlab init/train/convert)")
    body = read_json(folder, name, within=within)
    cfg_file = folder / name
    if "model" not in body:
        raise UserError(f"{cfg_file}: not a qkvlab config (no 'model' key); import other formats with qkvlab convert")
    json_key(body, "model", dict, cfg_file)
    json_key(body, "kind", str, cfg_file, default="gpt")
    try:
        cfg = ModelConfig.from_dict(body["model"])
    except UserError as e:
        raise UserError(f"{cfg_file}: model: {e}") from None
    return cfg, body


def check_weights_size(cfg: ModelConfig, folder: str | Path) -> Path:
    """The folder's weights file (inside it), holding at least one byte per parameter of its config
    (float8; float32 holds 4). -> the file."""
    weights = member(folder, WEIGHTS, "weights", within=model_root(folder))
    check_declared_size(cfg, weights.stat().st_size, Path(folder) / CONFIG, weights.name)
    return weights


def check_declared_size(cfg: ModelConfig, stored: int, config_file: str | Path, weights: str) -> None:
    """One line when the model `config_file` declares has more parameters than `stored` bytes of
    weights can hold at one byte each: the config and the weights do not belong together (and nothing
    is built from such a config). Layers and embeddings are bounded first, so a declared depth of
    10^18 is refused without counting it."""
    blocks = 1 if cfg.share_layers else cfg.n_layer
    rough = max(blocks, cfg.vocab_size) * cfg.d_model  # each block holds at least d_model parameters
    params = rough if rough > stored else analytic_params(cfg).total
    if params > stored:
        raise UserError(
            f"{config_file} declares a model of {'more than ' if rough > stored else ''}{params:,} parameters, "
            f"more than the {stored:,} bytes of {weights} can hold; config and weights do not belong together"
        )


def is_model_folder(path: str | Path) -> bool:
    """True when `path` is a folder whose config.json is qkvlab's (a JSON object with a "model"
    key), not a Hugging Face folder or a GGUF file; never raises (reading it is `read_config`)."""
    try:
        body = read_json(path, CONFIG, missing_ok=True) if Path(path).is_dir() else None
    except UserError:
        return False
    return isinstance(body, dict) and "model" in body


def safetensors_keys(file: str | Path) -> list[str]:
    """The tensor names in a safetensors file's header (nothing else is read), or one line naming the
    file and what is wrong."""
    try:
        with safe_open(str(file), framework="pt") as f:
            return list(f.keys())
    except (SafetensorError, OSError, ValueError) as e:
        raise UserError(f"{file}: not a readable safetensors file ({str(e).splitlines()[0][:160]})") from None


def load_weights(file: str | Path) -> dict[str, torch.Tensor]:
    file = Path(file)
    if not file.exists():
        raise UserError(f"{file}: no such weights file (expected {WEIGHTS})")
    try:
        return load_file(str(file))
    except (SafetensorError, OSError, ValueError) as e:
        with open(file, "rb") as f:
            head = f.read(2)
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
    if member(path, WEIGHTS, "weights", within=model_root(path), missing_ok=True) is None:
        raise UserError(f"{Path(path) / WEIGHTS}: no such weights file (expected {WEIGHTS})")
    weights = check_weights_size(cfg, path)  # a hostile config.json cannot make us allocate terabytes:
    check_model(cfg, f"the model in {path}")  # neither more than its weights hold, nor than the machine has
    model = build_model_from_state(GPT, cfg, load_weights(weights), str(path))
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
