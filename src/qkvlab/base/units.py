"""How qkvlab prints numbers: one SI formatter, one byte unit, one empty cell.

Bytes are decimal SI everywhere (1 kB = 10^3 B, 1 MB = 10^6 B, 1 GB = 10^9 B): `qkvlab info`,
`bench`, the memory checks and the results tables. Paper B's "5.9 GB" KV cache (1.2B model,
32,768 tokens, bf16) is 5.906e9 B, so it compares as printed; its "88 MB" for Q-K=V + MQA is
88 MiB = 92.3 MB, and where qkvlab quotes it the label says so (README, docs/schemes.md).
"""

from __future__ import annotations

import math

from qkvlab.base.errors import UserError

EMPTY = "–"  # a table cell with no value
_SI = (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3))


def human(n: float, unit: str = "", spec: str = ".2f") -> str:
    """1234567 -> '1.23M' (k, M, G, T: powers of 1000); the one number formatter of tables,
    `qkvlab info` and `bench`."""
    for suffix, scale in _SI:
        if abs(n) >= scale:
            return f"{n / scale:{spec}}{suffix}{unit}"
    return f"{n:g}{unit}"


def nbytes(n: float, spec: str = ".2f") -> str:
    """A byte count in decimal SI units: 5906104320 -> '5.91 GB', 65536 -> '65.54 kB'."""
    for suffix, scale in _SI:
        if abs(n) >= scale:
            return f"{n / scale:{spec}} {suffix}B"
    return f"{n:g} B"


def cell(x: float | None, spec: str = ".1f") -> str:
    """A number for a table cell, or EMPTY for a missing one."""
    return EMPTY if x is None else format(x, spec)


def fmt_duration(s: float) -> str:
    """Seconds as m:ss, or h:mm:ss from an hour on (elapsed and estimated times)."""
    s = int(round(s))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


BYTE_UNITS = {"": 1, "B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def byte_size(text: str, flag: str = "size") -> int:
    """'24GB', '80GiB', '512MB', '1e9' -> bytes; anything else (nan, inf, 0, -1GB) is one line."""
    t = str(text).strip().upper()
    num = t.rstrip("KMGTIB")
    try:
        value = float(num) * BYTE_UNITS[t[len(num) :]]
    except (ValueError, KeyError):
        raise UserError(f"{flag} {text!r}: write a size like 24GB, 80GiB or 512MB") from None
    if not math.isfinite(value):
        raise UserError(f"{flag} {text!r} is not a finite size; write one like 24GB, 80GiB or 512MB")
    if value <= 0:
        raise UserError(f"{flag} {text!r} must be positive")
    return int(value)
