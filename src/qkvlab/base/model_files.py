"""The files a model folder names, read as data: a folder from someone else can make qkvlab read no
file outside itself, no file larger than its kind allows, and no JSON it holds is used before it is
parsed and its keys typed (docs/safety.md).

`member` is the one way a loader finds a file a model folder names (qkvlab model, run and tokenizer
folders, Hugging Face folders, GGUF files): the name is a relative path without `..`, it resolves
(symlinks followed) inside the folder, it is a regular file of at most its kind's size. `read_json`
parses such a file, naming the file and what is wrong; `json_key` reads one typed key of it. Folders that
transformers reads itself are checked whole first (`check_folder`): every entry resolves inside.

A Hugging Face hub cache snapshot (`models--ORG--NAME/snapshots/REV/`) links each file to the
repository's `blobs/`: there the repository folder is the bound (`containment_root`).
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterable
from pathlib import Path, PurePath
from typing import Any

from qkvlab.base.errors import UserError
from qkvlab.base.files import parse_json
from qkvlab.base.folders import RUN_FILES

MIB = 1 << 20
# The most bytes a file of each kind may hold; a larger one is refused before it is read.
LIMITS = {
    "settings": 16 * MIB,  # config.json, generation_config.json, state.json: a few kB in practice
    "tokenizer settings": 64 * MIB,  # qkvlab_tokenizer.json, tokenizer_config.json (chat templates, added tokens)
    "vocabulary": 512 * MIB,  # tokenizer.json, bpe.json, vocab.json, merges.txt (the largest known: ~35 MB)
    "weights index": 64 * MIB,  # model.safetensors.index.json
    "weights": 1 << 41,  # one safetensors or GGUF file (2 TiB); its header is checked against the config too
}
# what transformers reads from a model or tokenizer folder, by kind
HF_FILES = {
    "config.json": "settings",
    "generation_config.json": "settings",
    "model.safetensors.index.json": "weights index",
    "tokenizer_config.json": "tokenizer settings",
    "special_tokens_map.json": "tokenizer settings",
    "added_tokens.json": "tokenizer settings",
    "chat_template.json": "tokenizer settings",
    "chat_template.jinja": "tokenizer settings",
    "tokenizer.json": "vocabulary",
    "vocab.json": "vocabulary",
    "vocab.txt": "vocabulary",
    "merges.txt": "vocabulary",
    "tokenizer.model": "vocabulary",
}
MAX_ENTRIES = 10_000  # a folder listing larger than this is not a model folder


def _size_text(n: int) -> str:
    return f"{n / MIB:,.0f} MiB" if n < 1 << 40 else f"{n / (1 << 40):,.0f} TiB"


def containment_root(folder: str | Path) -> Path:
    """The real path files named by `folder` must resolve inside: the folder itself, or for a hub
    cache snapshot (`.../models--X/snapshots/REV`) the repository folder holding its blobs."""
    real = Path(os.path.realpath(folder))
    repo = real.parent.parent
    if real.parent.name == "snapshots" and repo.name.startswith("models--") and (repo / "blobs").is_dir():
        return repo
    return real


def model_root(model_dir: str | Path) -> Path:
    """The folder whose files a model folder may name: its training run when it is a run's
    `checkpoint/` (the run's tokenizer/ sits beside it), else the folder itself."""
    p = Path(model_dir)
    if p.name == "checkpoint" and any((p.parent / name).is_file() for name in RUN_FILES):
        return p.parent
    return p


def _inside(real: str, root: Path) -> bool:
    return real == str(root) or real.startswith(str(root).rstrip(os.sep) + os.sep)


def _leads_outside(path: str | Path, real: str, root: Path) -> UserError:
    return UserError(f"{path}: a link to {real}, outside {root}; qkvlab reads only files inside a model folder")


def _checked_name(name: Any, where: str) -> PurePath:
    """A name a folder may use for one of its files: a non-empty relative path without `..`."""
    if not isinstance(name, str) or not name or "\x00" in name:
        raise UserError(f"{where} must be the name of a file inside the folder, got {json.dumps(name)[:80]}")
    pure = PurePath(name)
    if pure.is_absolute() or ".." in pure.parts:
        raise UserError(f"{where} names {name!r}, outside the folder; a model folder may name only files inside itself")
    return pure


def member(
    folder: str | Path,
    name: Any,
    kind: str,
    *,
    within: str | Path | None = None,
    named_by: str | None = None,
    missing_ok: bool = False,
    limit: int | None = None,
) -> Path | None:
    """`folder/name` once it is safe to read: `name` is relative without `..`, the path resolves
    (symlinks followed) inside `within` (default `folder`; see `containment_root`), and it is a
    regular file of at most LIMITS[kind] bytes (or `limit`), or with kind "folder" a folder. One
    line otherwise, naming the file. `named_by`: the file and key that gave `name` ("x.json's
    'file'"), for the message; `missing_ok`: None for a missing file instead of a refusal."""
    folder = Path(folder)
    pure = _checked_name(name, f"{named_by or folder}" + ("" if named_by else f": file {name!r}"))
    path = folder / pure
    root = containment_root(within if within is not None else folder)
    real = os.path.realpath(path)
    if not _inside(real, root):
        raise _leads_outside(path, real, root)
    try:
        st = os.stat(real)
    except FileNotFoundError:
        if missing_ok:
            return None
        raise UserError(f"{path}: no such {'folder' if kind == 'folder' else 'file'}") from None
    except OSError as e:
        raise UserError(f"{path}: cannot read it ({e.strerror})") from None
    if kind == "folder":
        if not stat.S_ISDIR(st.st_mode):
            raise UserError(f"{path}: not a folder")
        return path
    if not stat.S_ISREG(st.st_mode):
        raise UserError(f"{path}: not a regular file (a folder, a pipe or a device); a model file must be one")
    bound = LIMITS[kind] if limit is None else limit
    if st.st_size > bound:
        raise UserError(
            f"{path}: {st.st_size:,} bytes, more than a {kind} file may hold ({_size_text(bound)}); refused unread"
        )
    return path


def read_bytes(path: Path) -> bytes:
    """The bytes of a file `member` returned, as one line on an OS error."""
    try:
        return path.read_bytes()
    except OSError as e:
        raise UserError(f"{path}: cannot read it ({e.strerror})") from None


def read_text(path: Path) -> str:
    """The UTF-8 text of a file `member` returned."""
    data = read_bytes(path)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{path}: not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start})") from None


def read_json(
    folder: str | Path, name: Any, kind: str = "settings", *, missing_ok: bool = False, **where: Any
) -> dict[str, Any] | None:
    """The JSON object in `folder/name` (through `member`); None when missing and `missing_ok`."""
    path = member(folder, name, kind, missing_ok=missing_ok, **where)
    if path is None:
        return None
    body = parse_json(read_text(path), path)
    if not isinstance(body, dict):
        raise UserError(f"{path}: must hold a JSON object, not {_json_kind(body)}")
    return body


_KINDS = {str: "a string", int: "a whole number", float: "a number", bool: "true or false", list: "a list",
          dict: "an object", type(None): "null"}  # fmt: skip
REQUIRED = object()


def _json_kind(value: Any) -> str:
    return _KINDS.get(type(value), type(value).__name__)


def _is(value: Any, t: type) -> bool:
    if t is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if t is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, t)


def json_key(
    body: dict[str, Any], name: str, types: type | tuple[type, ...], where: str | Path, default: Any = REQUIRED
):
    """body[name], checked to be of one of `types` (int excludes bool; float takes int); a missing
    key is `default`, or a refusal when there is none. `where`: the file, for the message."""
    if name not in body:
        if default is REQUIRED:
            raise UserError(f"{where}: missing key {name!r}")
        return default
    return typed(body[name], types, f"{where}: key {name!r}")


def typed(value: Any, types: type | tuple[type, ...], where: str | Path) -> Any:
    """`value` when it is of one of `types` (as `json_key` checks them), else one line: `where` must be ..."""
    types = types if isinstance(types, tuple) else (types,)
    if not any(_is(value, t) for t in types):
        want = " or ".join(_KINDS.get(t, t.__name__) for t in types)
        raise UserError(f"{where} must be {want}, not {_json_kind(value)} ({json.dumps(value)[:60]})")
    return value


def check_folder(
    folder: str | Path,
    kinds: dict[str, str] | None = None,
    *,
    names: Iterable[str] = (),
    within: str | Path | None = None,
) -> Path:
    """A folder another library reads by itself (transformers): every entry resolves inside it (or
    inside `within`, the model folder holding it; see `containment_root`), no entry is a pipe or a
    device, and each file of `kinds` (name -> kind; default HF_FILES) or of `names` (kind "weights")
    passes `member`. Returns the folder."""
    folder = Path(folder)
    kinds = {**(HF_FILES if kinds is None else kinds), **{n: "weights" for n in names}}
    root = containment_root(folder if within is None else within)
    if not _inside(os.path.realpath(folder), root):
        raise _leads_outside(folder, os.path.realpath(folder), root)
    try:
        entries = sorted(os.scandir(folder), key=lambda e: e.name)
    except OSError as e:
        raise UserError(f"{folder}: cannot list it ({e.strerror})") from None
    if len(entries) > MAX_ENTRIES:
        raise UserError(f"{folder}: {len(entries):,} entries, more than a model folder holds ({MAX_ENTRIES:,})")
    for entry in entries:
        if entry.name in kinds:
            member(folder, entry.name, kinds[entry.name], within=root)
            continue
        real = os.path.realpath(entry.path)
        if not _inside(real, root):
            raise _leads_outside(entry.path, real, root)
        try:
            mode = os.stat(real).st_mode
        except OSError:
            continue  # a dangling link inside the folder: nothing to read there
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
            raise UserError(f"{entry.path}: not a regular file (a pipe or a device); a model folder holds files")
    return folder
