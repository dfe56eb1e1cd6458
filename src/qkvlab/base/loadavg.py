"""How busy the machine was while a benchmark ran, so every speed figure carries its load.

A `LoadWatch` is started before a benchmark's own work and finished after it. It records the load
average (1, 5, 15 min) at both ends, the CPU time the whole machine spent busy (/proc/stat) minus the
CPU time of this process and its children (getrusage): what *other* processes took while it ran,
in cores, and the share of CPU time the hypervisor stole (/proc/stat's steal column), where the system
reports these. The run is "noisy" when

- the 1-minute load before the work started exceeds a quarter of the cores (NOISY_LOAD_PER_CORE), or
- other processes took more than a tenth of a core on average while it ran (NOISY_OTHERS_CORES), or
- more than 2% of the CPU time was stolen (NOISY_STEAL).

A benchmark's load figure reads the machine, not the benchmark's own threads: the 1-minute load at
the end includes the benchmark itself, which is why the verdict uses the load before and the others'
CPU during. `--require-quiet` (qkvlab bench, benchmarks/*) exits with QUIET_EXIT_CODE when noisy.
"""

from __future__ import annotations

import os
import resource
import time
from dataclasses import dataclass, field

from qkvlab.base.files import atomic_write, json_text
from qkvlab.base.folders import check_file_target

NOISY_LOAD_PER_CORE = 0.25  # 1-min load before the work, per core
NOISY_OTHERS_CORES = 0.1  # other processes' CPU while the work ran, in cores
NOISY_STEAL = 0.02  # share of the machine's CPU time stolen by the hypervisor
QUIET_EXIT_CODE = 3  # --require-quiet on a noisy machine


def read_loadavg(path: str = "/proc/loadavg") -> tuple[float, float, float] | None:
    try:
        return tuple(os.getloadavg())  # type: ignore[return-value]
    except (OSError, AttributeError):
        try:
            with open(path, encoding="ascii") as f:
                return tuple(float(x) for x in f.read().split()[:3])  # type: ignore[return-value]
        except (OSError, ValueError):
            return None


def read_cpu_times(path: str = "/proc/stat") -> tuple[float, float, float] | None:
    """(busy seconds, steal seconds, all seconds) of the whole machine since boot, or None where
    /proc/stat is absent. Busy: user + nice + system + irq + softirq (guest time is inside user)."""
    try:
        with open(path, encoding="ascii") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    user, nice, system, idle, iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    busy = user + nice + system + irq + softirq
    return busy / tick, steal / tick, (busy + idle + iowait + steal) / tick


def own_cpu_seconds() -> float:
    """CPU seconds of this process (all threads) and its waited-for children."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def verdict(
    cores: int, load_before: float | None, others_cores: float | None, steal: float | None
) -> tuple[bool, list[str]]:
    """(noisy?, reasons): the rules of this module's docstring, on the figures that could be read."""
    reasons = []
    if load_before is not None and load_before > NOISY_LOAD_PER_CORE * cores:
        reasons.append(f"1-min load {load_before:.2f} before the work > {NOISY_LOAD_PER_CORE * cores:g} (cores/4)")
    if others_cores is not None and others_cores > NOISY_OTHERS_CORES:
        reasons.append(f"other processes took {others_cores:.2f} cores while it ran (> {NOISY_OTHERS_CORES:g})")
    if steal is not None and steal > NOISY_STEAL:
        reasons.append(f"{steal:.1%} of CPU time stolen (> {NOISY_STEAL:.0%})")
    return bool(reasons), reasons


@dataclass
class LoadWatch:
    """Start before the work (`LoadWatch.start()`), `finish()` after; `summary()` prints it."""

    cores: int = field(default_factory=lambda: os.cpu_count() or 1)
    load_start: tuple[float, float, float] | None = None
    load_end: tuple[float, float, float] | None = None
    others_cores: float | None = None  # other processes' mean CPU use while it ran
    steal: float | None = None  # share of the machine's CPU time stolen while it ran
    seconds: float = 0.0
    _t0: float = 0.0
    _cpu0: tuple[float, float, float] | None = None
    _own0: float = 0.0

    @classmethod
    def start(cls) -> LoadWatch:
        w = cls(load_start=read_loadavg())
        w._t0, w._cpu0, w._own0 = time.perf_counter(), read_cpu_times(), own_cpu_seconds()
        return w

    def finish(self) -> LoadWatch:
        self.seconds = time.perf_counter() - self._t0
        self.load_end = read_loadavg()
        cpu1, own = read_cpu_times(), own_cpu_seconds() - self._own0
        if self._cpu0 is not None and cpu1 is not None and self.seconds > 0:
            busy, steal, total = (b - a for a, b in zip(self._cpu0, cpu1))
            self.others_cores = max(0.0, busy - own) / self.seconds
            self.steal = steal / total if total > 0 else None
        return self

    @property
    def load_before(self) -> float | None:
        return None if self.load_start is None else self.load_start[0]

    @property
    def noisy(self) -> bool:
        return verdict(self.cores, self.load_before, self.others_cores, self.steal)[0]

    @property
    def reasons(self) -> list[str]:
        return verdict(self.cores, self.load_before, self.others_cores, self.steal)[1]

    def to_dict(self) -> dict:
        return {
            "cores": self.cores,
            "load_start": self.load_start,
            "load_end": self.load_end,
            "others_cores": self.others_cores,
            "steal_fraction": self.steal,
            "seconds": self.seconds,
            "noisy": self.noisy,
            "noisy_reasons": self.reasons,
        }

    def summary(self) -> str:
        return describe(self.to_dict())

    def before_summary(self) -> str:
        """The verdict on the load before the work alone (for --require-quiet's early refusal)."""
        noisy, reasons = verdict(self.cores, self.load_before, None, None)
        load = "?" if self.load_before is None else f"{self.load_before:.2f}"
        return f"load {load} (1-min, {self.cores} cores): " + (
            "NOISY (" + "; ".join(reasons) + ")" if noisy else "quiet"
        )

    @property
    def noisy_before(self) -> bool:
        return verdict(self.cores, self.load_before, None, None)[0]


def describe(load: dict) -> str:
    """One line from `LoadWatch.to_dict()`, e.g.
    'load 0.12 -> 2.01 (1-min, 2 cores), others 0.02 cores, steal 0.0%: quiet'."""

    def one(x):
        return "?" if x is None else f"{x[0]:.2f}"

    parts = [f"load {one(load['load_start'])} -> {one(load['load_end'])} (1-min, {load['cores']} cores)"]
    if load.get("others_cores") is not None:
        parts.append(f"others {load['others_cores']:.2f} cores")
    if load.get("steal_fraction") is not None:
        parts.append(f"steal {load['steal_fraction']:.1%}")
    tail = "NOISY (" + "; ".join(load["noisy_reasons"]) + ")" if load["noisy"] else "quiet"
    return ", ".join(parts) + ": " + tail


def load1() -> float | None:
    """The 1-minute load average now (None where the system does not say)."""
    now = read_loadavg()
    return None if now is None else now[0]


def rate(count: float, seconds: float | None) -> float | None:
    """count / seconds, or None ("unmeasured") when the time is not positive: a difference of two
    timings that came out zero or negative measured nothing, and must never print as a rate."""
    if seconds is None or not seconds > 0:
        return None
    return count / seconds


def fmt(x: float | None, spec: str = ".1f", unmeasured: str = "unmeasured") -> str:
    return unmeasured if x is None else format(x, spec)


class NoisyMachine(Exception):
    """--require-quiet on a noisy machine: the message is one line; the exit code QUIET_EXIT_CODE."""

    exit_code = QUIET_EXIT_CODE


def require_quiet(watch: LoadWatch, *, during: bool) -> None:
    """Raise NoisyMachine if `watch` is noisy: before the work (the load alone) or, with `during`, the
    whole verdict (call after `finish`)."""
    if during and watch.noisy:
        raise NoisyMachine(f"noisy machine: {watch.summary()} (--require-quiet)")
    if not during and watch.noisy_before:
        raise NoisyMachine(f"noisy machine before starting: {watch.before_summary()} (--require-quiet)")


# ---- for the scripts in benchmarks/ -------------------------------------------------------------
def add_options(parser) -> None:
    """--require-quiet and --json FILE, as `qkvlab bench` has them."""
    parser.add_argument(
        "--require-quiet", action="store_true", help="exit 3 if the machine is noisy (qkvlab.base.loadavg)"
    )
    parser.add_argument("--json", metavar="FILE", help="also write the figures and the load as JSON to FILE")


_DROP = object()


def _option_value(v):
    """A command-line option as JSON holds it: paths as text (one or a list of them), other
    non-JSON values (a callable default, an enum) left out."""
    if isinstance(v, os.PathLike):
        return os.fspath(v)
    if isinstance(v, (list, tuple)):
        items = [_option_value(x) for x in v]
        return _DROP if any(x is _DROP for x in items) else items
    return v if isinstance(v, (int, float, str, bool, type(None))) else _DROP


class ScriptRun:
    """A benchmark script's load record: `ScriptRun(args)` first (prints the load before, exits 3 under
    --require-quiet on a busy machine), `tag()` beside each printed figure, `finish(figures)` last
    (prints the verdict, writes --json, returns the exit code: 3 if noisy under --require-quiet)."""

    def __init__(self, args, name: str):
        self.args, self.name = args, name
        json_path = getattr(args, "json", None)
        if json_path:
            check_file_target(json_path, "--json", same_kind=lambda p: True)
        self.watch = LoadWatch.start()
        print(f"machine before the run: {self.watch.before_summary()}", flush=True)
        if getattr(args, "require_quiet", False) and self.watch.noisy_before:
            print(f"{name}: noisy machine, not measuring (--require-quiet)", flush=True)
            raise SystemExit(QUIET_EXIT_CODE)

    @staticmethod
    def tag() -> str:
        """'[load 0.42]': the 1-min load now, printed beside a figure."""
        return f"[load {fmt(load1(), '.2f', '?')}]"

    def finish(self, figures: dict) -> int:
        self.watch.finish()
        print(f"machine during the run: {self.watch.summary()}", flush=True)
        if getattr(self.args, "json", None):
            options = {k: v for k, v in ((k, _option_value(v)) for k, v in vars(self.args).items()) if v is not _DROP}
            body = {"benchmark": self.name, "options": options, "load": self.watch.to_dict(), **figures}
            atomic_write(self.args.json, json_text(body, indent=2))
        return QUIET_EXIT_CODE if getattr(self.args, "require_quiet", False) and self.watch.noisy else 0
