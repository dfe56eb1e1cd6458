"""A comparison at this machine's pace: a short probe chooses jobs x threads on CPU, and the plan's
wall time is estimated (and printed) before any run starts.

Seeds are separate processes: batching seeds into one model (vmap) does not pay on CPU, since SDPA's
backward has no batching rule (measured: docs/results/speed/history.md), so the only choice is how the cores
are split between parallel runs and threads inside each. The probe times a few optimizer steps of the
plan's own first run both ways, in the processes that would train, and keeps the faster layout.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import re
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import torch

from qkvlab.base.devices import torch_dtype
from qkvlab.base.errors import UserError
from qkvlab.model.accounting import flops_per_token
from qkvlab.tasks import task_from_config
from qkvlab.train.optim import make_optimizer

_DURATION = re.compile(r"^(?:(\d+(?:\.\d*)?)h)?(?:(\d+(?:\.\d*)?)m(?:in)?)?(?:(\d+(?:\.\d*)?)s?)?$")
PROBE_STEPS = 12  # timed steps per probe (after 3 warm-up steps)
MIN_RUNS_TO_PROBE = 8  # fewer runs: the probe would cost more than a wrong layout
MAX_POINTS_PROBED = 8  # grid points timed (a point's first run); the rest are scaled by FLOPs per step


def parse_duration(text: str | float | int) -> float:
    """Seconds from '90m', '2h', '1h30m', '45s' or a number of seconds."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        seconds = float(text)
    else:
        m = _DURATION.match(str(text).strip().lower().replace(" ", ""))
        if not m or not any(m.groups()):
            raise UserError(f"duration {text!r}: write e.g. 45s, 90m, 2h or 1h30m")
        h, mins, s = (float(g) if g else 0.0 for g in m.groups())
        seconds = 3600 * h + 60 * mins + s
    if not math.isfinite(seconds) or seconds <= 0:
        raise UserError(f"duration {text!r} must be a positive, finite time")
    return seconds


@dataclass(frozen=True)
class Layout:
    jobs: int
    threads: int
    step_s: float | None = None  # one run's seconds per optimizer step at this layout (None: not probed)
    note: str = ""
    probed_work: float | None = None  # step_work of the run step_s was measured on
    # (point_key, seconds per step) of each task/grid point probed: a sweep's sizes differ many times over in
    # cost, so one point's pace says little about another's
    point_step_s: tuple[tuple[str, float], ...] = ()

    def step_seconds(self, cfg, key: str = "") -> float | None:
        """Seconds per step of a run at point `key` (point_key): measured there, else step_s scaled by
        training FLOPs per step (points beyond the probe's cap)."""
        measured = dict(self.point_step_s)
        if key in measured:
            return measured[key]
        if self.step_s is None:
            return None
        return self.step_s * (step_work(cfg) / self.probed_work if self.probed_work else 1.0)

    def run_seconds(self, cfg, key: str = "") -> float | None:
        """About how long one run of TrainConfig `cfg` takes at this layout (steps + evaluations)."""
        step = self.step_seconds(cfg, key)
        if step is None:
            return None
        evals = cfg.max_steps // max(1, cfg.eval_every) + 1
        eval_steps = evals * cfg.eval_batches * cfg.val_batch_size / max(1, cfg.batch_size) / 3  # forward ~ 1/3
        return step * (cfg.max_steps + eval_steps) + 3.0  # + start-up

    def run_estimates(self, runs) -> dict[str, float] | None:
        """{PlannedRun.rel: its run_seconds} for `runs`; None when nothing was probed."""
        if self.step_s is None and not self.point_step_s:
            return None
        return {r.rel: self.run_seconds(r.cfg, point_key(r)) for r in runs}

    def plan_seconds(self, runs) -> float | None:
        """Wall time of training PlannedRuns `runs` at this layout: runs go `jobs` at a time."""
        per_run = self.run_estimates(runs)
        return sum(per_run.values()) / self.jobs if per_run else None


def point_key(run) -> str:
    """A PlannedRun's task and grid point: runs that share it share a shape and a pace."""
    return f"{run.task}/{run.point}"


def first_run_per_point(runs) -> dict:
    """{point_key: the first PlannedRun at that task/grid point}, in plan order."""
    firsts: dict = {}
    for run in runs:
        firsts.setdefault(point_key(run), run)
    return firsts


def step_work(cfg) -> float:
    """Training FLOPs of one optimizer step of TrainConfig `cfg` (a cost proxy across sizes)."""
    return float(flops_per_token(cfg.model) * cfg.model.context * cfg.batch_size)


def step_seconds(cfg, threads: int, steps: int = PROBE_STEPS) -> float:
    """Seconds per optimizer step of TrainConfig `cfg` in this process at `threads` threads, under the
    autocast the run would train with (cfg.dtype; auto as timed here, train.dtype_probe)."""
    torch.set_num_threads(threads)
    task = task_from_config(cfg)
    model = task.build_model(task.adapt_config(cfg.model))
    opt = make_optimizer(model, cfg.lr, cfg.weight_decay, cfg.betas, torch.device("cpu"))
    dtype = torch_dtype(cfg.train_dtype("cpu"))
    autocast = torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32)
    t0 = 0.0
    for k in range(steps + 3):
        if k == 3:
            t0 = time.perf_counter()
        with autocast:
            loss = task.loss(model, *task.batch(k, cfg.batch_size, cfg.seed))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return (time.perf_counter() - t0) / steps


def probe(todo: list, cpus: int, say=print) -> Layout:
    """Time `cpus` parallel one-thread runs against one run on `cpus` threads on the first run; keep
    the faster; then time the first run of each other grid point (up to MAX_POINTS_PROBED) that way."""
    cfg = todo[0].cfg
    first = point_key(todo[0])
    others = [(k, r.cfg) for k, r in first_run_per_point(todo).items() if k != first][: MAX_POINTS_PROBED - 1]
    if cpus < 2:
        steps = {first: step_seconds(cfg, 1)} | {k: step_seconds(c, 1) for k, c in others}
        return Layout(1, 1, steps[first], "one core", step_work(cfg), tuple(steps.items()))
    with ProcessPoolExecutor(cpus, mp_context=mp.get_context("spawn")) as pool:
        list(pool.map(_warm, range(cpus)))  # imports outside the timing
        parallel = max(pool.map(step_seconds, [cfg] * cpus, [1] * cpus))
        threaded = pool.submit(step_seconds, cfg, cpus).result()
        # throughput in runs' steps per second: cpus runs at 1/parallel each, or one run at 1/threaded
        jobs = cpus if cpus / parallel >= 1 / threaded else 1
        steps = {first: parallel if jobs > 1 else threaded}
        for key, c in others:  # timed as they would train: `jobs` side by side
            steps[key] = max(pool.map(step_seconds, [c] * jobs, [cpus // jobs] * jobs))
    if jobs > 1:
        note = f"probe: {cpus} jobs x 1 thread {cpus / parallel:.1f} steps/s"
    else:
        note = f"probe: 1 job x {cpus} threads {1 / threaded:.1f} steps/s"
    layout = Layout(jobs, cpus // jobs, steps[first], note, step_work(cfg), tuple(steps.items()))
    say(
        f"compare: {layout.note} (vs {'1 job' if layout.jobs > 1 else f'{cpus} jobs'}: "
        f"{1 / threaded if layout.jobs > 1 else cpus / parallel:.1f} steps/s)"
        + (f"; {len(steps)} grid points timed" if len(steps) > 1 else ""),
        flush=True,
    )
    return layout


def _warm(_: int) -> None:
    """Nothing: a spawned worker unpickling it imports this module, and with it torch, the model and
    the tasks, before any step is timed."""


def choose_layout(cfg, todo: list, cpus: int, jobs: int | None, threads: int | None, say=print) -> Layout:
    """The user's jobs/threads when given, else the probe's choice when the plan is long enough."""
    if jobs is not None or threads is not None or len(todo) < MIN_RUNS_TO_PROBE:
        j = min(jobs or min(cpus, 8), max(1, len(todo)))
        return Layout(j, threads or max(1, cpus // j))
    return probe(todo, min(cpus, 8), say)
