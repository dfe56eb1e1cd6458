"""What is at an output path, and whether a command may write there (docs/safety.md).

A path a command writes to is the user's: qkvlab writes into a missing path, an empty folder, or a
folder of the same kind it is asked to continue (a training run with --resume, a compare folder);
it replaces a model folder only with --overwrite; anything else (a file, a model where a run is
asked for, a run of another kind, a folder of other files) is refused with one line saying what is
there and how to proceed. A run folder is locked while a process writes it (an OS file lock,
released on exit and after a crash), so a second process is refused instead of interleaving.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from qkvlab.base.errors import UserError

try:
    import fcntl
except ImportError:  # Windows: no flock; folders are not locked there
    fcntl = None

LOCK = ".qkvlab.lock"
RUN_FILES = ("train_config.json", "checkpoint", "metrics.jsonl")  # any of them: a training run
COMPARE_FILE = "compare.json"


@dataclass(frozen=True)
class Found:
    kind: str  # missing | empty | file | model | run | compare | other | unusable
    what: str  # for messages: "a file", "a training run (checkpoint at step 40)", ...


def inspect(path: str | Path) -> Found:
    """Classify what is at `path` without changing anything."""
    path = Path(path)
    try:
        if not path.exists():
            parent = _existing_parent(path)
            if parent is not None and not parent.is_dir():
                return Found("unusable", f"under {parent}, which is a file")
            return Found("missing", "nothing")
        if not path.is_dir():
            return Found("file", "a file")
        names = sorted(n for n in os.listdir(path) if n != LOCK)
    except OSError as e:
        return Found("unusable", f"not readable ({e.strerror})")
    if not names:
        return Found("empty", "an empty folder")
    if COMPARE_FILE in names:
        return Found("compare", "a compare folder")
    if any(n in names for n in RUN_FILES):
        return Found("run", f"a training run ({_run_progress(path)})")
    if "config.json" in names and "model.safetensors" in names:
        return Found("model", "a model (config.json + model.safetensors)")
    shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
    return Found("other", f"a folder of other files ({shown})")


def _existing_parent(path: Path) -> Path | None:
    for parent in path.absolute().parents:
        if parent.exists():
            return parent
    return None


def _run_progress(path: Path) -> str:
    try:
        return f"checkpoint at step {json.loads((path / 'checkpoint' / 'state.json').read_text())['step']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "no complete checkpoint"


def check_model_target(path: str | Path, *, overwrite: bool, flag: str = "--out") -> None:
    """Before writing a model folder at `path` (init, convert): refuse anything but a missing path,
    an empty folder, or (with --overwrite) a model folder. Writing is then `io.atomic_dir`."""
    if str(path) == "" or Path(path).name in ("", ".", ".."):
        raise UserError(f"{flag} {str(path)!r} names no new folder; give a folder name such as runs/model")
    path = Path(path)
    found = inspect(path)
    if found.kind in ("missing", "empty"):
        _check_creatable(path, flag)
        return
    if found.kind == "model":
        if overwrite:
            return
        raise UserError(
            f"{flag} {path} already holds {found.what}; pass --overwrite to replace it or choose another {flag}"
        )
    raise UserError(f"{flag} {path} holds {found.what}; choose another {flag} (nothing was written)")


def check_file_target(path: str | Path, flag: str, *, same_kind: Callable[[Path], bool] | None = None) -> None:
    """Before a long job that ends by writing the file `path` (e.g. bench --json): the folder
    exists and is writable, and `path` is missing or (per `same_kind`) an earlier output."""
    if str(path) == "":
        raise UserError(f"{flag} '' names no file")
    path = Path(path)
    if path.is_dir():
        raise UserError(f"{flag} {path} is a folder; give a file path")
    parent = path.parent
    if not parent.is_dir():
        raise UserError(f"{flag} {path}: {parent} is not an existing folder")
    try:  # a real file, not os.access: root passes access checks on read-only mounts and /proc
        fd, probe = tempfile.mkstemp(dir=parent, prefix=f".{path.name}.probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise UserError(f"{flag} {path}: cannot write in {parent} ({e.strerror})") from None
    if path.exists() and not (same_kind and same_kind(path)):
        raise UserError(
            f"{flag} {path} already exists and is not an earlier output of this command; choose another path"
        )


def _check_creatable(path: Path, flag: str) -> None:
    parent = _existing_parent(path) if not path.exists() else path
    if parent is None or not os.access(parent, os.W_OK | os.X_OK):
        raise UserError(f"{flag} {path}: {parent or path} is not writable")


class FolderInUse(UserError):
    """Another process holds the folder's lock."""


@dataclass
class Claim:
    """A folder this process writes, locked until `release`; `undo` removes what it created."""

    path: Path
    created: bool  # the folder did not exist before
    was_empty: bool  # it existed but was empty (so everything in it now is ours)
    fd: int | None = None
    keep: bool = False  # set once something worth keeping is written: undo does nothing then

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing drops the flock
            self.fd = None

    def undo(self) -> None:
        """After a refusal: leave the path as it was (only when everything in it is ours)."""
        self.release()
        if self.keep:
            return
        if self.created:
            shutil.rmtree(self.path, ignore_errors=True)
        elif self.was_empty:
            for entry in self.path.iterdir():
                shutil.rmtree(entry, ignore_errors=True) if entry.is_dir() else entry.unlink(missing_ok=True)


def claim_folder(path: str | Path, *, accept: tuple[str, ...], advice: dict[str, str], flag: str = "--out") -> Claim:
    """Create (if missing) and lock `path` for this process, refusing unless what is there is one
    of `accept` (kinds of `inspect`; missing/empty are always accepted). `advice[kind]` says how to
    proceed in the refusal. The check runs again under the lock, so two processes cannot both pass."""
    if str(path) == "":
        raise UserError(f"{flag} '' names no folder")
    path = Path(path)
    found = inspect(path)
    _refuse_unless(path, found, accept, advice, flag)
    try:  # created: by this mkdir, not merely missing a moment ago (a racing process may create it too)
        path.mkdir(parents=True)
        created = True
    except FileExistsError:
        created = False
    except OSError as e:
        raise UserError(f"{flag} {path}: cannot create it ({e.strerror})") from None
    claim = Claim(path, created, found.kind == "empty")
    try:
        claim.fd = _lock(path, flag)
        found = inspect(path)  # again, under the lock: another process may have written meanwhile
        _refuse_unless(path, found, accept, advice, flag)
        claim.was_empty = claim.was_empty and found.kind == "empty"
    except FolderInUse:
        raise  # its lock holder works in it now, even if this process created it a moment ago: leave it
    except BaseException:
        claim.undo() if created else claim.release()
        raise
    return claim


def check_folder(path: str | Path, *, accept: tuple[str, ...], advice: dict[str, str], flag: str = "--out") -> None:
    """claim_folder's refusal without creating or locking anything (a dry run's check)."""
    _refuse_unless(Path(path), inspect(path), accept, advice, flag)


def _refuse_unless(path: Path, found: Found, accept: tuple[str, ...], advice: dict[str, str], flag: str) -> None:
    if found.kind in ("missing", "empty", *accept):
        return
    how = advice.get(found.kind, f"choose another {flag}")
    raise UserError(f"{flag} {path} holds {found.what}; {how}")


def _lock(path: Path, flag: str) -> int | None:
    if fcntl is None:
        return None
    try:
        fd = os.open(path / LOCK, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError as e:
        raise UserError(f"{flag} {path}: cannot write there ({e.strerror})") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        if e.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
            raise FolderInUse(
                f"{flag} {path} is in use by another qkvlab process (it holds {LOCK}); wait for it or choose another {flag}"
            ) from None
        raise UserError(no_lock_message(flag, path, e)) from None
    return fd


def no_lock_message(flag: str, path: Path, e: OSError) -> str:
    """flock failed for another reason than a holder: the filesystem has no locks (NFS without lockd, some Lustre mounts)."""
    return (
        f"{flag} {path}: cannot lock {LOCK} there ({e.strerror or e}); the filesystem does not support "
        "file locks (NFS, Lustre?): choose a folder on a filesystem that does (e.g. local disk)"
    )


@contextlib.contextmanager
def claimed(path: str | Path, **kwargs) -> Iterator[Claim]:
    """`claim_folder` for the body; a UserError inside undoes what was created, the lock is
    released on any exit."""
    claim = claim_folder(path, **kwargs)
    try:
        yield claim
    except UserError:
        claim.undo()
        raise
    finally:
        claim.release()
