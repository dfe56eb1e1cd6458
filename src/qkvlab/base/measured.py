"""Speed policies decided by measurement: the one mechanism behind them.

Which of two dtypes trains faster (decode/dtype_probe.py) and in which order a decode step reads its
weights (generate.layout_by_timing) depend on the chip, not on its flags. Each such policy names its
options and a default, times the options in alternating rounds (a drift in the machine's speed hits
all of them), and `choose` keeps the default unless another option's best round beats the default's
best by more than the rounds' own spread. `cached_or_measured` stores each decision and its figures
per machine (CPU, torch, threads) under the policy's key in `cache_dir()/PROBE_FILE`, so a machine
measures a shape once and a record can say what its choice was decided from.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from qkvlab.base.devices import cpu_name
from qkvlab.base.errors import UserError
from qkvlab.base.files import atomic_write, cache_dir, json_text

PROBE_FILE = "dtype_probe.json"  # its name from when the dtype was the only policy timed
MIN_NOISE = 0.03  # the least margin an option must win by: below it two timings of one option differ as much


def probe_path() -> Path:
    """The cache of measured decisions."""
    return cache_dir() / PROBE_FILE


def machine_key() -> str:
    """What the figures depend on besides the shapes: the CPU, torch and its thread count."""
    return f"{cpu_name()} | torch {torch.__version__} | {torch.get_num_threads()} threads"


def choose(times: dict[str, list[float]], default: str, min_noise: float = MIN_NOISE) -> tuple[str, float]:
    """(option, noise) from each option's round times: the fastest other option if its best round beats
    the default's best by more than the noise (the larger of min_noise and each option's spread,
    median over best minus 1), else the default (also when any option has nothing to go by)."""
    if any(not t or min(t) <= 0 for t in times.values()):
        return default, min_noise
    noise = max(min_noise, *(statistics.median(t) / min(t) - 1 for t in times.values()))
    best = min((o for o in times if o != default), key=lambda o: min(times[o]), default=default)
    if best != default and min(times[default]) > min(times[best]) * (1 + noise):
        return best, noise
    return default, noise


def alternate(ways: dict[str, Callable[[], float]], rounds: int) -> dict[str, list[float]]:
    """Each way's result (seconds) for `rounds` rounds, the order of the ways reversed every other
    round, after an untimed warm-up round (first-call allocations)."""
    order = list(ways)
    for way in order:
        ways[way]()
    times: dict[str, list[float]] = {w: [] for w in order}
    for r in range(rounds):
        for way in order[:: -1 if r % 2 else 1]:
            times[way].append(ways[way]())
    return times


def timed(fn: Callable[[], Any], reps: int = 1, clock: Callable[[], float] = time.perf_counter) -> float:
    """Seconds per call of fn, over `reps` calls."""
    t0 = clock()
    for _ in range(reps):
        fn()
    return (clock() - t0) / reps


def read_cache(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}  # a missing or damaged cache is measured again, never an error
    return data if isinstance(data, dict) else {}


def cached_or_measured(
    key: str, default: str, measure: Callable[[], dict[str, list[float]]], path: Path | None = None
) -> dict[str, Any]:
    """The cached decision for `key` on this machine, or one measured now (`measure` returns each
    option's round times, the default's among them) and written (an unwritable cache only costs a
    measurement next time): {choice, noise, ms: {option: best ms}, source}."""
    path = path if path is not None else probe_path()
    machine = machine_key()
    data = read_cache(path)
    hit = data.get(machine, {}).get(key)
    if (
        isinstance(hit, dict)
        and isinstance(hit.get("ms"), dict)
        and hit.get("choice") in hit["ms"]
        and default in hit["ms"]
        and isinstance(hit.get("noise"), (int, float))
    ):
        return {**hit, "source": "cached"}
    times = measure()
    choice, noise = choose(times, default)
    entry = {
        "choice": choice,
        "default": default,
        "noise": round(noise, 4),
        "ms": {o: round(min(t) * 1e3, 4) if t else None for o, t in times.items()},
    }
    data.setdefault(machine, {})[key] = entry
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, json_text(data, indent=1))
    except (OSError, UserError):
        pass
    return {**entry, "source": "measured now"}
