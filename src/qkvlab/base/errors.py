"""User-facing errors: one line, no traceback, exit status 2 from the CLI.

`as_user_error` is the one place where a fault of the machine rather than of qkvlab (a full disk, a
read-only or forbidden folder) becomes such a line: the CLI, `train` and the atomic writers call it.
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
    where = f"{where}: " if where else ""
    if code in NO_ROOM:
        free = free_bytes(path or getattr(e, "filename", None) or ".")
        need = f"needs about {_mb(needed)}" if needed else f"needs more than {_mb(written)}" if written else ""
        room = ", ".join(x for x in (need, f"{_mb(free)} free" if free is not None else "") if x)
        return UserError(
            f"{where}no space left on the device{f' ({room})' if room else ''}; nothing there was replaced, "
            "so the last complete version stays: free some room and run the command again"
        )
    if code in NOT_WRITABLE:
        return UserError(f"{where}cannot write there ({os.strerror(code)})")
    return None
