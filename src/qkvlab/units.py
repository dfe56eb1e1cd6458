"""How qkvlab prints numbers: one SI formatter, one byte unit, one empty cell.

Bytes are decimal SI everywhere (1 kB = 10^3 B, 1 MB = 10^6 B, 1 GB = 10^9 B): `qkvlab info`,
`bench`, the memory checks and the results tables. Paper B's "5.9 GB" KV cache (1.2B model,
32,768 tokens, bf16) is 5.906e9 B, so it compares as printed; its "88 MB" for Q-K=V + MQA is
88 MiB = 92.3 MB, and where qkvlab quotes it the label says so (README, docs/schemes.md).
"""

from __future__ import annotations

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
