"""Reading and writing files, torch-free: the one atomic writer, strict JSON, user text files.

The bottom floor of qkvlab (docs/architecture.md): it imports nothing of qkvlab but `errors`, so a
tokenizer, a data preparer or a report writer can write atomically without importing torch.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from qkvlab.base.errors import NoRoom, UserError, as_user_error


def cache_dir() -> Path:
    """Where qkvlab caches derived files (`$QKVLAB_CACHE` or `~/.cache/qkvlab`); created lazily
    by writers, not here, so importing has no side effects."""
    env = os.environ.get("QKVLAB_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "qkvlab"


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


def _fsync_dir(folder: Path) -> None:
    """Make a rename in `folder` durable (a no-op where directories cannot be opened)."""
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _mkstemp_beside(path: Path, suffix: str = ".tmp") -> tuple[int, str]:
    try:
        return tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=suffix)
    except OSError as e:
        raise as_user_error(e, path) or UserError(f"{path}: cannot write there ({e.strerror})") from None


def _bytes_in(path: str | Path) -> int:
    """Bytes of a file, or of every file under a folder (0 if it is gone)."""
    p = Path(path)
    try:
        return p.stat().st_size if p.is_file() else sum(f.stat().st_size for f in p.rglob("*") if f.is_file())
    except OSError:
        return 0


def _cleaned_up(e: BaseException, path: Path, tmp: str | Path, needed: int | None) -> None:
    """Remove the temp file or folder `tmp`; then raise a full disk or an unwritable folder met while
    writing `path` as one line (how much room the write needs, or how far it got, and what is free
    once the temp is gone); anything else is left to the caller to re-raise."""
    written = _bytes_in(tmp)
    if Path(tmp).is_dir():
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    if isinstance(e, NoRoom) and str(tmp) in str(e.path):  # a writer inside a temp folder: name the user's path
        raise NoRoom(str(e.path).replace(str(tmp), str(path)), e.room, e.advice, e.kept) from None
    if isinstance(e, UserError) and str(tmp) in str(e):
        raise UserError(str(e).replace(str(tmp), str(path))) from None
    err = as_user_error(e, path, needed=needed, written=written)
    if err is not None and err is not e:
        raise err from None


def _publish(tmp: str, path: Path) -> None:
    """Give `tmp` the ordinary permissions (0666 minus the umask; mkstemp makes 0600), rename it
    over `path` and fsync the folder so the rename is durable."""
    os.chmod(tmp, 0o666 & ~_umask())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


@contextlib.contextmanager
def atomic_file(path: str | Path, mode: str = "w") -> Iterator[IO]:
    """The one way qkvlab writes a file: yield a temp file beside `path`; on success it is flushed,
    fsynced, given the ordinary permissions (0666 minus the umask) and renamed over `path`, and the
    folder is fsynced. Readers see the old file or the new one, never a part; on an error the temp
    file is removed and `path` is untouched."""
    path = Path(path)
    fd, tmp = _mkstemp_beside(path)
    try:
        with os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        _publish(tmp, path)
    except BaseException as e:
        _cleaned_up(e, path, tmp, None)
        raise


@contextlib.contextmanager
def atomic_path(path: str | Path, *, needed: int | None = None) -> Iterator[Path]:
    """`atomic_file` for libraries that write to a file name (safetensors' save_file, matplotlib's
    savefig): yield a temp path beside `path` with the same suffix (so a format is still inferred
    from it); on success it is fsynced and renamed over `path`. `needed`: the bytes it will take,
    for the message when the disk is full."""
    path = Path(path)
    fd, tmp = _mkstemp_beside(path, suffix=f".tmp{path.suffix}")
    os.close(fd)
    try:
        yield Path(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        _publish(tmp, path)
    except BaseException as e:
        _cleaned_up(e, path, tmp, needed)
        raise


def save_figure(fig: Any, path: str | Path, **options: Any) -> None:
    """A matplotlib figure written through `atomic_path` (`options` go to fig.savefig; the format
    follows the path's suffix)."""
    with atomic_path(path) as tmp:
        fig.savefig(tmp, **options)


def atomic_write(path: str | Path, data: str | bytes) -> None:
    """Write text (UTF-8) or bytes to `path` through `atomic_file`."""
    with atomic_file(path, "wb" if isinstance(data, bytes) else "w") as f:
        f.write(data)


@contextlib.contextmanager
def atomic_dir(path: str | Path, *, replace: bool = True, needed: int | None = None) -> Iterator[Path]:
    """Yield a fresh temp folder beside `path`; on success it replaces `path` whole. With
    replace=False it is only renamed into a missing or empty `path`: a folder that appeared
    meanwhile (another process) is never replaced, the write is refused instead.

    Every file in it is fsynced before the rename, and the parent folder after it. If the process
    dies, `path` is either the old complete folder or the new one (at worst the old one survives
    as `.NAME.old-*`, which `load_model` never reads). `needed`: the bytes it will take, for the
    message when the disk is full (the old folder stays then)."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.tmp-"))
    except OSError as e:
        raise as_user_error(e, path) or UserError(f"{path}: cannot write there ({e.strerror})") from None
    try:
        yield tmp
        mask = _umask()
        for f in tmp.rglob("*"):  # durable before the rename publishes them; ordinary modes
            if f.is_file():  # (mkdtemp makes 0700, safetensors writes 0600)
                with open(f, "rb") as fh:
                    os.fsync(fh.fileno())
                os.chmod(f, 0o666 & ~mask)
            elif f.is_dir():
                os.chmod(f, 0o777 & ~mask)
        _fsync_dir(tmp)
        os.chmod(tmp, 0o777 & ~mask)
        if not replace:
            try:
                os.rename(tmp, path)  # replaces an empty folder, never a non-empty one or a file
            except OSError:
                raise UserError(f"{path} appeared while it was being written; nothing was replaced") from None
            _fsync_dir(path.parent)
        elif path.exists():
            old = path.with_name(f".{path.name}.old-{os.getpid()}")
            os.replace(path, old)
            os.replace(tmp, path)
            _fsync_dir(path.parent)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
            _fsync_dir(path.parent)
    except BaseException as e:
        _cleaned_up(e, path, tmp, needed)
        raise


def labelled_path(text: str) -> tuple[str, str]:
    """'LABEL=PATH' -> (LABEL, PATH), as scripts take runs and models to name in a table. Either side
    may hold '=' (a label 'K=V', a folder 'lm/Q-K=V/seed0'): the split is at the first '=' after which
    an existing file or folder follows, else at the last '=' (labels hold one more often than paths);
    a text that is itself an existing path, or has no '=', -> ('', text)."""
    cuts = [i for i, c in enumerate(text) if c == "="]
    if not cuts or Path(text).exists():
        return "", text
    for i in cuts:
        if Path(text[i + 1 :]).exists():
            return text[:i], text[i + 1 :]
    return text[: cuts[-1]], text[cuts[-1] + 1 :]


# ---- strict JSON ----------------------------------------------------------------------------------
def read_user_text(path: str | Path, label: str | None = None) -> str:
    """A text file the user named, as str; a missing, unreadable or non-UTF-8 file is one line
    starting with `label` (default: the path)."""
    path = Path(path)
    label = label or str(path)
    if path.is_dir():
        raise UserError(f"{label}: is a folder; give a file")
    if not path.is_file():
        raise UserError(f"{label}: no such file")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise UserError(f"{label}: not UTF-8 text") from None
    except OSError as e:
        raise UserError(f"{label}: cannot read it ({e.strerror})") from None


def read_json(path: str | Path, label: str | None = None) -> Any:
    """A JSON file, parsed; missing, unreadable, non-UTF-8 or invalid JSON is one line starting
    with `label` (default: the path)."""
    label = label or str(path)
    return parse_json(read_user_text(path, label), label)


def _not_json(token: str) -> None:
    raise ValueError(f"{token} is not a JSON number")


def parse_json(text: str, where: str | Path) -> Any:
    """JSON text parsed strictly, or one line naming `where` and what is wrong (also what json.loads
    lets through or raises besides JSONDecodeError: NaN and Infinity, which JSON has not; nesting
    deeper than the recursion limit; integers of over 4,300 digits)."""
    try:
        return json.loads(text, parse_constant=_not_json)
    except json.JSONDecodeError as e:
        raise UserError(f"{where}: not valid JSON ({e})") from None
    except RecursionError:
        raise UserError(f"{where}: not valid JSON (nested too deeply)") from None
    except ValueError as e:  # NaN, or "Exceeds the limit (4300 digits) for integer string conversion ..."
        raise UserError(f"{where}: not valid JSON ({str(e).split(';')[0]})") from None


def json_text(obj: Any, *, indent: int | None = None) -> str:
    """The one way qkvlab serialises JSON: strict (no NaN/Infinity tokens, which JSON readers
    reject), non-finite floats written as null, newline-terminated. Metrics rows also say which
    values were not finite (`finite_row`)."""
    return json.dumps(_finite(obj), indent=indent, allow_nan=False) + "\n"


def _finite(obj: Any) -> Any:
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def finite_row(row: dict[str, Any]) -> dict[str, Any]:
    """A metrics row with each non-finite number as null and its key listed under "nonfinite"."""
    bad = [k for k, v in row.items() if isinstance(v, float) and not math.isfinite(v)]
    return {**_finite(row), "nonfinite": bad} if bad else row
