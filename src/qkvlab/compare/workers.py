"""Training a compare's runs: in parallel worker processes on CPU (one thread each, or the layout
compare/pace.py chose), else one after another in this process; one progress line per finished run.
A worker dies with its compare (`die_with_parent`), so a killed compare leaves nothing training."""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from typing import Any

import torch

from qkvlab.base.units import fmt_duration
from qkvlab.compare.planning import PlannedRun
from qkvlab.train import loop  # loop.train, looked up per run (tests wrap it)

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent(parent: int) -> None:
    """A worker trains only for its compare: when that process dies (SIGKILL included) the worker is
    killed too, so it neither trains on nor holds a run's lock against the re-run. On Linux the
    kernel sends the signal (PR_SET_PDEATHSIG); elsewhere a thread polls the parent id. SIGKILL is
    safe: checkpoints are written atomically and an interrupted run resumes bit for bit."""
    armed = False
    if sys.platform.startswith("linux"):
        try:
            armed = ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL) == 0
        except (OSError, AttributeError):
            armed = False
    if os.getppid() != parent:  # it died before the signal was armed
        os._exit(1)
    if not armed:

        def watch() -> None:
            while os.getppid() == parent:
                time.sleep(1.0)
            os._exit(1)

        threading.Thread(target=watch, daemon=True, name="qkvlab-parent-watch").start()


def worker_init(threads: int, parent: int | None = None) -> None:
    if parent is not None:
        die_with_parent(parent)
    torch.set_num_threads(threads)


def train_one(cfg, out_dir: str, progress: bool, decided: tuple | None = None):
    """One run, in a worker or here; `decided`: the dtype the parent resolved "auto" to for it, so that every
    worker trains in what the parent decided even when a busy machine kept that timing out of the cache."""
    t0 = time.perf_counter()
    try:
        res = loop.train(cfg, out_dir, resume=True, progress=progress, decided=decided)
    except loop.TrainingDiverged as e:
        return {"error": str(e), "seconds": time.perf_counter() - t0}
    return {
        "metrics": res.metrics,
        "metric": res.metric,
        "higher_is_better": res.higher_is_better,
        "seconds": time.perf_counter() - t0,
    }


class Progress:
    """One line per finished run: run i/N, its score, elapsed and ETA. The ETA weighs each run by
    `work` (its estimated seconds, by PlannedRun.rel) where given, so a sweep whose last size costs
    many times its first is not promised early."""

    def __init__(
        self,
        total: int,
        done: int,
        to_train: int,
        say: Callable[..., None] = print,
        work: dict[str, float] | None = None,
    ):
        self.total, self.done, self.to_train, self.trained = total, done, to_train, 0
        self.work = work or {}
        self.work_total, self.work_done = sum(self.work.values()), 0.0
        self.t0 = time.perf_counter()
        self.say = say

    def update(self, run: PlannedRun, result: dict[str, Any]) -> None:
        self.done += 1
        self.trained += 1
        elapsed = time.perf_counter() - self.t0
        if run.rel in self.work:
            self.work_done += self.work[run.rel]
            eta = elapsed / self.work_done * max(0.0, self.work_total - self.work_done) if self.work_done > 0 else 0.0
        else:
            eta = elapsed / self.trained * (self.to_train - self.trained)
        if "error" in result:
            score = f"FAILED: {result['error']}"
        else:
            m = result["metric"]
            score = f"{m} {result['metrics'].get(m, float('nan')):.4f}"
        where = f"{run.task}{'/' + run.point if run.point else ''} {run.variant.name} seed {run.seed}"
        self.say(
            f"[run {self.done}/{self.total}] {where}: {score} ({result['seconds']:.0f} s)  "
            f"elapsed {fmt_duration(elapsed)}  ETA {fmt_duration(eta)}",
            flush=True,
        )


def train_all(
    todo, progress: Progress, parallel: bool, jobs: int, threads, main: bool, decided: dict | None = None
) -> list[str]:
    """Train `todo`: in `jobs` spawned processes on CPU, else one after another in this process. Returns
    the failures (a run that diverged: its folder and why). decided: each run's resolved dtype by its `rel`."""
    decided = decided or {}
    failures: list[str] = []

    def record(r: PlannedRun, result: dict[str, Any]) -> None:
        progress.update(r, result)
        if "error" in result:
            failures.append(f"{r.rel}: {result['error']}")

    if not (parallel and jobs > 1):
        if parallel:
            worker_init(threads)
        for r in todo:
            record(r, train_one(r.cfg, str(r.dir), not parallel and main, decided.get(r.rel)))
        return failures
    with ProcessPoolExecutor(
        jobs, mp_context=mp.get_context("spawn"), initializer=worker_init, initargs=(threads, os.getpid())
    ) as pool:
        pending = {pool.submit(train_one, r.cfg, str(r.dir), False, decided.get(r.rel)): r for r in todo}
        try:
            while pending:
                done, _ = wait(pending, return_when=FIRST_COMPLETED)
                for fut in done:
                    record(pending.pop(fut), fut.result())
        except BaseException:
            for fut in pending:
                fut.cancel()
            raise
    return failures
