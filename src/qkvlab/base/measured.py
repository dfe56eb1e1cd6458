"""Speed policies decided by measurement: the one mechanism behind them, and the decisions it keeps.

Which of two dtypes trains or decodes faster (decode/dtype_probe.py) and in which order a decode step
reads its weights (decode/layout.py) depend on the chip, not on its flags. Each such policy names its
options, a safe default and a key, and hands `decide` a way to call each option once. A decision
differs from the default only when the timing says so with margin:

- every option's round lasts at least `Timer.min_round_s` (a 2 ms step is called 25 times a round),
  after an untimed warm-up call;
- rounds alternate the options' order (a drift in the machine's speed hits all of them), at least
  `min_rounds`, and go on (up to `max_rounds`) until the last two rounds move no option's best by
  more than STABLE;
- `choose` keeps the default unless another option's best round beats the default's best by more
  than the noise (the larger of MIN_NOISE and each option's spread, median over best).

A decision is cached (`cache_dir()/DECISIONS_FILE`, per machine: CPU, torch, threads; then per key)
only when it was measured on a quiet machine (`qkvlab.base.loadavg`'s verdict on the load before and
the other processes' CPU during) and its estimates settled; otherwise it is used for this run only.
The cached record says when, under what load, from how many rounds, and with which torch and qkvlab.
A cached decision expires when either version changes, and each later use re-times a short check
(`check_rounds` rounds): when that check, on a quiet machine, contradicts the decision by more than
its noise (the chosen option slower than the default by more than it, or the default slower than
another option by more than it), the decision is measured again and replaced. `qkvlab info
--decisions` lists the cached decisions (`cached_lines`), `--forget` removes them (`forget`).
"""

from __future__ import annotations

import json
import math
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from qkvlab import __version__ as QKVLAB_VERSION
from qkvlab.base.devices import cpu_name
from qkvlab.base.errors import UserError
from qkvlab.base.files import atomic_write, cache_dir, json_text
from qkvlab.base.loadavg import LoadWatch

DECISIONS_FILE = "decisions.json"
# where decisions were kept before they recorded their load, rounds and versions: never read, and
# removed by `forget`
OLD_FILES = ("dtype_probe.json",)
MIN_NOISE = 0.03  # the least margin an option must win by: below it two timings of one option differ as much
MIN_ROUND_S = 0.05  # the least time one option's round lasts (its call repeated)
MIN_ROUNDS, MAX_ROUNDS = 5, 15
STABLE = 0.01  # rounds stop once the last two moved no option's best by more than this
CHECK_ROUNDS = 2  # a cached decision's check on each later use
MAX_REPS = 100_000

Ways = Mapping[str, Callable[[], Any]]  # each option's call, run once per repetition


@dataclass(frozen=True)
class Timer:
    """How options are timed: the clock, the load watch (started before the timing, `finish()`ed
    after it: `noisy`, `reasons`, `load_before`, `others_cores`, `cores`, as `loadavg.LoadWatch`), the
    least time a round of each option lasts, the rounds, and a cached decision's check rounds."""

    clock: Callable[[], float] = time.perf_counter
    watch: Callable[[], Any] = LoadWatch.start
    min_round_s: float = MIN_ROUND_S
    min_rounds: int = MIN_ROUNDS
    max_rounds: int = MAX_ROUNDS
    check_rounds: int = CHECK_ROUNDS


@dataclass(frozen=True)
class Rounds:
    """Each option's seconds per call, one figure per round, its calls per round, and whether the
    best of each settled (STABLE) before the rounds ran out."""

    times: dict[str, list[float]] = field(hash=False)
    reps: dict[str, int] = field(hash=False)
    stable: bool

    @property
    def rounds(self) -> int:
        return min((len(t) for t in self.times.values()), default=0)


def decisions_path() -> Path:
    """The cache of measured decisions."""
    return cache_dir() / DECISIONS_FILE


def machine_key() -> str:
    """What the figures depend on besides the shapes: the CPU, torch and its thread count."""
    return f"{cpu_name()} | torch {torch.__version__} | {torch.get_num_threads()} threads"


def versions() -> dict[str, str]:
    """The versions a cached decision was measured with: a change of either expires it."""
    return {"torch": torch.__version__, "qkvlab": QKVLAB_VERSION}


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


def timed(fn: Callable[[], Any], reps: int = 1, clock: Callable[[], float] = time.perf_counter) -> float:
    """Seconds per call of fn, over `reps` calls."""
    t0 = clock()
    for _ in range(reps):
        fn()
    return (clock() - t0) / reps


def repetitions(fn: Callable[[], Any], clock: Callable[[], float], min_s: float) -> int:
    """Calls of fn that last at least `min_s`, from one timed call after an untimed warm-up call
    (first-call allocations)."""
    fn()
    once = timed(fn, 1, clock)
    return MAX_REPS if once <= 0 else max(1, min(MAX_REPS, math.ceil(min_s / once)))


def settled(times: dict[str, list[float]]) -> bool:
    """The last two rounds moved no option's best by more than STABLE."""
    return all(len(t) >= 3 and min(t[:-2]) <= min(t) * (1 + STABLE) for t in times.values())


def alternate(ways: Ways, timer: Timer = Timer(), rounds: int | None = None) -> Rounds:
    """Each way's seconds per call in rounds of at least `timer.min_round_s`, the order of the ways
    reversed every other round; `timer.min_rounds` to `max_rounds` rounds, stopping once `settled`
    (or exactly `rounds`, for a check)."""
    order = list(ways)
    reps = {w: repetitions(ways[w], timer.clock, timer.min_round_s) for w in order}
    times: dict[str, list[float]] = {w: [] for w in order}
    least, most = (rounds, rounds) if rounds else (timer.min_rounds, timer.max_rounds)
    for r in range(most):
        for way in order[:: -1 if r % 2 else 1]:
            times[way].append(timed(ways[way], reps[way], timer.clock))
        if r + 1 >= least and settled(times):
            break
    return Rounds(times, reps, settled(times))


@dataclass(frozen=True)
class Measured:
    """A decision and what it was decided from: each option's best round (ms), the noise the winner
    had to beat, the rounds, when (UTC), the load, the versions; `source` says how this run got it."""

    key: str
    choice: str
    default: str
    noise: float
    ms: dict[str, float | None] = field(hash=False)
    rounds: int
    stable: bool
    when: str
    load: dict[str, Any] = field(hash=False)
    torch: str
    qkvlab: str
    source: str = "measured now"

    def entry(self) -> dict[str, Any]:
        """What the cache file keeps (the key and the source are the file's and the run's)."""
        return {k: v for k, v in asdict(self).items() if k not in ("key", "source")}

    @classmethod
    def from_entry(cls, key: str, entry: Any, source: str = "cached") -> Measured | None:
        """The record of a cache entry; None for an entry of another format (measured again)."""
        try:
            out = cls(key=key, source=source, **entry)
        except TypeError:
            return None
        ms = out.ms if isinstance(out.ms, dict) else {}
        good = out.choice in ms and out.default in ms and isinstance(out.noise, (int, float))
        return out if good and isinstance(out.load, dict) else None

    def expired(self, now: Mapping[str, str]) -> str | None:
        """Why this cached decision no longer holds (a version changed), or None."""
        changed = [f"{k} {getattr(self, k)} -> {now[k]}" for k in ("torch", "qkvlab") if getattr(self, k) != now[k]]
        return "; ".join(changed) or None

    def describe(self) -> str:
        """One line: the key, the choice, its figures and what they were measured under."""
        figures = ", ".join(f"{o} {'?' if v is None else f'{v:.4g}'} ms" for o, v in self.ms.items())
        load = self.load
        busy = "?" if load.get("load_before") is None else f"{load['load_before']:.2f}"
        others = "" if load.get("others_cores") is None else f", others {load['others_cores']:.2f} cores"
        settle = "" if self.stable else ", unsettled"
        return (
            f"{self.key}: {self.choice} (default {self.default}; {figures}; noise {self.noise:.0%}; "
            f"{self.rounds} rounds{settle}; load {busy} on {load.get('cores', '?')} cores{others}; {self.when}; "
            f"torch {self.torch}, qkvlab {self.qkvlab})"
        )


def read_cache(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}  # a missing or damaged cache is measured again, never an error
    return data if isinstance(data, dict) else {}


def _store(path: Path, record: Measured) -> None:
    """Write `record` under this machine (an unwritable cache only costs a measurement next time)."""
    data = read_cache(path)
    machine = data.get(machine_key())
    data[machine_key()] = {**(machine if isinstance(machine, dict) else {}), record.key: record.entry()}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, json_text(data, indent=1))
    except (OSError, UserError):
        pass


def _load(watch: Any) -> dict[str, Any]:
    return {
        "load_before": watch.load_before,
        "others_cores": None if watch.others_cores is None else round(watch.others_cores, 3),
        "cores": watch.cores,
    }


def measure(key: str, default: str, ways: Ways, timer: Timer = Timer()) -> tuple[Measured, str | None]:
    """The decision measured now, and why it must not be cached (a busy machine, unsettled
    estimates), or None when it may be."""
    watch = timer.watch()
    rounds = alternate(ways, timer)
    watch.finish()
    choice, noise = choose(rounds.times, default)
    ms = {o: round(min(t) * 1e3, 4) if t else None for o, t in rounds.times.items()}
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    record = Measured(
        key, choice, default, round(noise, 4), ms, rounds.rounds, rounds.stable, when, _load(watch), **versions()
    )
    if watch.noisy:
        return record, "machine busy (" + "; ".join(watch.reasons) + ")"
    return record, None if rounds.stable else f"the estimates did not settle in {rounds.rounds} rounds"


def contradiction(record: Measured, times: dict[str, list[float]]) -> str | None:
    """How a check's times contradict a cached decision by more than its noise, or None: the chosen
    option slower than the default, or (the default chosen) another option faster than it."""
    best = {o: min(t) for o, t in times.items() if t and min(t) > 0}
    c, d, n = record.choice, record.default, record.noise
    if c not in best or d not in best:
        return None
    if c != d and best[c] > best[d] * (1 + n):
        return f"a check timed {c} {best[c] / best[d]:.2f}x {d}'s time (noise {n:.0%})"
    rival = min((o for o in best if o != d), key=best.__getitem__, default=None)
    if c == d and rival is not None and best[d] > best[rival] * (1 + n):
        return f"a check timed {d} {best[d] / best[rival]:.2f}x {rival}'s time (noise {n:.0%})"
    return None


def check(record: Measured, ways: Ways, timer: Timer) -> str | None:
    """A short re-timing of a cached decision (`timer.check_rounds` rounds of the options it needs):
    its contradiction, or None (also when the machine was busy: a busy check is no evidence)."""
    needed = list(ways) if record.choice == record.default else [record.default, record.choice]
    watch = timer.watch()
    rounds = alternate({o: ways[o] for o in needed if o in ways}, timer, rounds=timer.check_rounds)
    watch.finish()
    return None if watch.noisy else contradiction(record, rounds.times)


def decide(
    key: str, default: str, ways: Callable[[], Ways], *, timer: Timer = Timer(), path: Path | None = None
) -> Measured:
    """The decision for `key` on this machine: the cached one while its versions hold and a quiet
    check does not contradict it, else measured now (`ways()` builds each option's call, once) and
    cached when it may be. `source` says which, and why a decision was measured again."""
    path = path if path is not None else decisions_path()
    machine = read_cache(path).get(machine_key())
    cached = Measured.from_entry(key, machine.get(key) if isinstance(machine, dict) else None)
    why = None if cached is not None and cached.default == default else "no cached decision"
    if why is None:
        why = cached.expired(versions())
    built = None
    if why is None:
        built = ways()
        why = check(cached, built, timer)
        if why is None:
            return cached
    record, not_cached = measure(key, default, built if built is not None else ways(), timer)
    if not_cached is None:
        _store(path, record)
    again = "" if why == "no cached decision" else f"; measured again: {why}"
    source = "measured now" + ("" if not_cached is None else f", not cached: {not_cached}") + again
    return replace(record, source=source)


def cached_lines(folder: Path | None = None) -> list[str]:
    """One line per cached decision (its machine last), and one per old file that is never read."""
    folder = folder if folder is not None else cache_dir()
    lines = []
    now = versions()
    for machine, entries in read_cache(folder / DECISIONS_FILE).items():
        for key, entry in (entries if isinstance(entries, dict) else {}).items():
            record = Measured.from_entry(key, entry)
            if record is None:
                lines.append(f"{key}: an entry of another format (measured again when next needed); {machine}")
                continue
            expired = record.expired(now) if machine == machine_key() else None
            lines.append(record.describe() + (f"; expired: {expired}" if expired else "") + f"; {machine}")
    for name in OLD_FILES:
        if (folder / name).is_file():
            lines.append(f"{folder / name}: decisions of an older qkvlab, never read (no versions or load recorded)")
    return lines


def forget(folder: Path | None = None) -> str:
    """Remove the cached decisions (and the old files qkvlab kept them in) -> one line saying what."""
    folder = folder if folder is not None else cache_dir()
    removed, count = [], 0
    for name in (DECISIONS_FILE, *OLD_FILES):
        path = folder / name
        if path.is_file():
            count += sum(len(v) for v in read_cache(path).values() if isinstance(v, dict))
            path.unlink()
            removed.append(name)
    if not removed:
        return f"no timed decisions in {folder}: nothing removed"
    return f"removed {count} timed decision{'' if count == 1 else 's'} ({', '.join(removed)}) from {folder}"
