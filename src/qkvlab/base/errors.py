"""User-facing errors: one line, no traceback, exit status 2 from the CLI.

`as_user_error` is the one place where a fault of the machine rather than of qkvlab (a full disk, a
read-only or forbidden folder) becomes such a line: the CLI, `train` and the atomic writers call it.
A full disk is a `NoRoom`: the path that filled, the free space of that path's own filesystem, what
was kept, and the command that continues (`train` words it: `--resume` when a checkpoint exists).
"""

from __future__ import annotations

import errno
import os
import re
import shutil
from pathlib import Path


class UserError(ValueError):
    """Bad input from a user (config value, file, flag). The message is one line that names
    the bad value and what is allowed."""


NO_ROOM = (errno.ENOSPC, errno.EDQUOT)
NOT_WRITABLE = (errno.EROFS, errno.EACCES, errno.EPERM)
# safetensors (Rust) reports an OS error only as text: "I/O error: No space left on device (os error 28)"
# (older versions: "IoError(Os { code: 28, kind: StorageFull, ... })")
_RUST_OS_ERROR = re.compile(r"(?:os error |Os \{ code: )(\d+)")


def _errno(e: BaseException) -> int | None:
    if isinstance(e, OSError):
        return e.errno
    m = _RUST_OS_ERROR.search(str(e)) if type(e).__name__ == "SafetensorError" else None
    return int(m.group(1)) if m else None


def _mb(n: float) -> str:
    return f"{n / 1e6:,.1f} MB"  # decimal, as qkvlab.base.units prints bytes (units sits above this floor)


def free_bytes(path: str | Path) -> int | None:
    """Free bytes on the filesystem that holds `path` (its nearest existing ancestor)."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return shutil.disk_usage(p).free
    except OSError:
        return None


def mount_point(path: str | Path) -> Path:
    """The mount point of the filesystem that holds `path` (its nearest existing ancestor)."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    while not os.path.ismount(p) and p != p.parent:
        p = p.parent
    return p


RUN_AGAIN = "run the same command again"
KEPT = "nothing there was replaced, so the last complete version stays"  # what the atomic writers leave


class NoRoom(UserError):
    """A full disk met while writing `path`: the line names the path, what the write needed, the
    free space on THAT path's filesystem, what was kept, and what to run once there is room."""

    def __init__(self, path: str | Path | None, room: str, then: str = RUN_AGAIN, kept: str = KEPT):
        self.path, self.room, self.advice, self.kept = path, room, then, kept
        where = f"{path}: " if path else ""
        super().__init__(
            f"{where}no space left on the device{f' ({room})' if room else ''}; {kept}: free some room, then {then}"
        )

    def then(self, advice: str) -> NoRoom:
        """The same fault with another way to continue (e.g. the command with --resume)."""
        return NoRoom(self.path, self.room, advice, self.kept)


def no_room(
    path: str | Path | None, *, needed: int | None = None, written: int | None = None, kept: str = KEPT
) -> NoRoom:
    """The one-line full-disk error for a write to `path`; the free space is that of `path`'s own
    filesystem (none is given when the path is unknown, rather than another filesystem's)."""
    need = f"needs about {_mb(needed)}" if needed else f"needs more than {_mb(written)}" if written else ""
    free = free_bytes(path) if path else None
    room = ", ".join(x for x in (need, f"{_mb(free)} free on {mount_point(path)}" if free is not None else "") if x)
    return NoRoom(path, room, kept=kept)


def as_user_error(
    e: BaseException, path: str | Path | None = None, *, needed: int | None = None, written: int | None = None
) -> UserError | None:
    """`e` as one line when it is a full disk or a folder that cannot be written, else None (a bug:
    its traceback is wanted). `path`: what was being written (default: the error's file name);
    `needed`: the bytes the write needs, `written`: the bytes it got to before the disk filled."""
    if isinstance(e, UserError):
        return e
    code = _errno(e)
    where = path if path is not None else getattr(e, "filename", None)
    if code in NO_ROOM:
        return no_room(where, needed=needed, written=written)
    if code in NOT_WRITABLE:
        return UserError(f"{f'{where}: ' if where else ''}cannot write there ({os.strerror(code)})")
    return None
