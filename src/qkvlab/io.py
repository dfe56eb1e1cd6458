"""Model directories (``model.safetensors`` + ``config.json``) and atomic file writes.

Nothing a user may receive is a pickle: weights are safetensors, metadata JSON.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from qkvlab import __version__
from qkvlab.config import ModelConfig
from qkvlab.errors import UserError

WEIGHTS, CONFIG = "model.safetensors", "config.json"


def file_sha256(path: str | Path) -> str:
    """Hex sha256 of a file, read in blocks (weights and corpora can be large)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write via a temp file in the same folder, fsync, then rename: readers see old or new."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; publish like an ordinary file
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def atomic_dir(path: str | Path) -> Iterator[Path]:
    """Yield a fresh temp folder beside `path`; on success it replaces `path` whole.

    If the process dies, `path` is either the old complete folder or the new one (at worst the
    old one survives as `path.old-*`, which `load_model` never reads)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.tmp-"))
    try:
        yield tmp
        for f in tmp.rglob("*"):  # make the contents durable before the rename publishes them
            if f.is_file():
                with open(f, "rb") as fh:
                    os.fsync(fh.fileno())
        os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes 0700
        if path.exists():
            old = path.with_name(f".{path.name}.old-{os.getpid()}")
            os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def state_dict_for_save(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Contiguous tensors, one name per shared storage (tied embeddings are saved once)."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, t in model.state_dict(keep_vars=False).items():
        key = t.untyped_storage().data_ptr() if t.numel() else id(t)
        if key in seen and t.numel():
            continue
        seen.add(key)
        out[name] = t.detach().contiguous().cpu()
    return out


def config_body(cfg: ModelConfig, kind: str = "gpt", meta: dict[str, Any] | None = None) -> dict[str, Any]:
    """What config.json holds: the model config, its kind, the writer's version, extra metadata."""
    return {"qkvlab_version": __version__, "kind": kind, "model": cfg.to_dict(), **(meta or {})}


def write_model_files(
    folder: Path, model: torch.nn.Module, cfg: ModelConfig, meta: dict[str, Any] | None = None
) -> None:
    save_file(state_dict_for_save(model), str(folder / WEIGHTS), metadata={"format": "pt"})
    (folder / CONFIG).write_text(json.dumps(config_body(cfg, "gpt", meta), indent=2) + "\n")


def save_model(path: str | Path, model: torch.nn.Module, cfg: ModelConfig, meta: dict[str, Any] | None = None) -> Path:
    with atomic_dir(path) as tmp:
        write_model_files(tmp, model, cfg, meta)
    return Path(path)


def read_config(path: str | Path) -> tuple[ModelConfig, dict[str, Any]]:
    path = Path(path)
    cfg_file = path / CONFIG if path.is_dir() else path
    if not cfg_file.exists():
        raise UserError(f"{path}: no {CONFIG} found (expected a model folder written by qkvlab init/train/convert)")
    try:
        body = json.loads(cfg_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{cfg_file}: not a JSON config ({e})") from None
    if not isinstance(body, dict) or "model" not in body:
        raise UserError(f"{cfg_file}: not a qkvlab config (no 'model' key); import other formats with qkvlab convert")
    return ModelConfig.from_dict(body["model"]), body


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
    """Read a model folder -> (GPT, ModelConfig, config body). Shapes must match exactly."""
    from qkvlab.model import GPT

    cfg, body = read_config(path)
    if body.get("kind", "gpt") != "gpt":
        raise UserError(f"{path}: a {body.get('kind')!r} model; this command needs a decoder ('gpt')")
    state = load_weights(Path(path) / WEIGHTS)
    stored = {t.dtype for t in state.values() if t.is_floating_point()}
    model = GPT(cfg)
    if len(stored) == 1:
        model.to(stored.pop())  # keep float64 weights float64 (exact conversions are checked in it)
    load_state(model, state, str(path))
    model.to(device=device, dtype=dtype) if dtype is not None else model.to(device)
    return model.eval(), cfg, body


def load_state(model: torch.nn.Module, state: dict[str, torch.Tensor], where: str) -> None:
    expected = model.state_dict()
    tied = {
        n
        for n in expected
        if n not in state and n == "lm_head.weight" and getattr(model, "cfg", None) and model.cfg.tie_embeddings
    }
    missing = sorted(set(expected) - set(state) - tied)
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        what = f"missing {missing[0]}" if missing else f"unexpected {unexpected[0]}"
        raise UserError(
            f"{where}: weights do not fit this architecture ({what}, {len(missing)} missing, {len(unexpected)} unexpected)"
        )
    for name, t in state.items():
        if tuple(t.shape) != tuple(expected[name].shape):
            raise UserError(f"{where}: {name} has shape {tuple(t.shape)}, config expects {tuple(expected[name].shape)}")
    model.load_state_dict(state, strict=False)
