"""Running a plan: the runs train in parallel processes on CPU (compare/workers.py), or one at a time
over every rank under torchrun; compare.json records the plan, machine and timing; results.md,
results.csv and the plots are written at the end (compare/render.py)."""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from qkvlab.analysis.rules import ANALYSIS_VERSION
from qkvlab.analysis.runs import read_manifest, write_manifest
from qkvlab.base.devices import cpu_name, select_device, torchrun_env
from qkvlab.base.errors import UserError
from qkvlab.base.folders import check_folder, claim_folder, inspect
from qkvlab.base.units import fmt_duration
from qkvlab.compare.pace import choose_layout
from qkvlab.compare.planning import Plan, PlannedRun, run_states
from qkvlab.compare.recipes import CPU_RECIPES, recipe_name
from qkvlab.compare.render import write_after_training
from qkvlab.compare.workers import Progress, train_all
from qkvlab.tasks import FAMILIES, task_from_config
from qkvlab.train import distributed as D


@dataclass
class Outcome:
    """What `run` did: the results (None on ranks other than 0) and the runs that diverged."""

    out: Path
    results: Any = None  # qkvlab.analysis.results.Results (a sweep: qkvlab.analysis.scaling.Scaling)
    failures: list[str] = field(default_factory=list)
    wall_s: float = 0.0


def machine_info(jobs: int, threads: int, device: str, world: int, train_dtype: str) -> dict[str, Any]:
    """Where the runs trained; train_dtype: the autocast dtype(s) the runs' dtype setting resolved to
    here (`_train_dtype`), so a result says whether it was trained in fp32 or under bf16."""
    info = {
        "cpu": cpu_name(),
        "cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "load_avg_at_start": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
        "platform": platform.platform(terse=True),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": device,
        "jobs": jobs,
        "threads_per_job": threads,
        "world_size": world,
        "train_dtype": train_dtype,
    }
    if device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def _check_tasks(plan: list[PlannedRun], family_request: bool, say) -> tuple[list[PlannedRun], dict[str, Any]]:
    """Build each task once per distinct option set (validates options and data, caches a tokenized
    corpus before parallel runs read it); read its metric. With a family, a task whose data is
    missing is skipped with a note, and so is a grid point a task cannot take (e.g. patch 7 on
    32-px images); a task named alone at its default point fails with its one-line error."""
    metrics: dict[str, Any] = {}
    checked: dict[tuple[str, str], bool] = {}
    for run in plan:
        key = (run.task, json.dumps(run.cfg.task_options, sort_keys=True, default=str))
        if key in checked:
            continue
        try:
            t = task_from_config(run.cfg)
            t.adapt_config(run.cfg.model)
        except UserError as e:
            if run.task == "lm" or not (family_request or run.point):
                raise
            say(f"compare: skipping {run.task}{' at ' + run.point if run.point else ''}: {e}")
            checked[key] = False
            continue
        checked[key] = True
        metrics[run.task] = {"metric": t.metric, "higher_is_better": bool(t.higher_is_better)}
        prepared = getattr(t, "prepared", None)
        if prepared is not None and getattr(prepared, "train", None) is not None:
            metrics[run.task]["train_tokens"] = len(prepared.train)  # what epochs are counted in (the sweep)
            meta = getattr(prepared, "meta", None) or {}
            metrics[run.task]["corpus"] = {k: meta[k] for k in ("source", "corpus_sha256", "tokens") if k in meta}
        del t
    keep = [r for r in plan if checked[(r.task, json.dumps(r.cfg.task_options, sort_keys=True, default=str))]]
    return keep, metrics


COMPARE_ADVICE = {
    "run": "that is a training run, not a compare folder: choose another --out",
    "model": "that is a model folder, not a compare folder: choose another --out",
    "file": "give --out a folder path",
}


def preflight(plan: Plan, say: Callable[..., None] = print) -> None:
    """What a dry run checks before printing the plan, as a real run would refuse it: --out (never
    a file, a run or a model), the device, and every task's options and data (tasks are built once,
    which caches a tokenized corpus)."""
    check_folder(plan.out, accept=("compare",), advice=COMPARE_ADVICE)
    select_device(plan.config.device)
    _check_tasks(plan.runs, _family_request(plan.config), say)


def _family_request(cfg) -> bool:
    """A task family other than lm was asked for: a task whose data is missing is skipped, not fatal."""
    return cfg.task in FAMILIES and cfg.task != "lm"


def run(plan: Plan, *, command: str | None = None, say: Callable[..., None] = print) -> Outcome:
    """Train every run of `plan` that is not finished (resuming interrupted ones), then write the
    results. `command` is recorded in compare.json; `say` gets the progress lines (rank 0 only)."""
    t_start = time.perf_counter()
    rank, world, _ = torchrun_env()
    if rank != 0:
        say = lambda *a, **k: None  # noqa: E731
    env = None
    if world > 1:  # under torchrun every rank walks the same plan; each run is one distributed train()
        env = D.setup(plan.config.device)
    claim = None
    try:
        if rank == 0:  # one compare per folder at a time; never into a run or a file
            claim = claim_folder(plan.out, accept=("compare",), advice=COMPARE_ADVICE)
        return _run_plan(plan, env, say, t_start, command)
    except UserError:
        if claim is not None and inspect(plan.out).kind == "empty":
            claim.undo()  # refused before anything was written: leave no empty folder behind
        raise
    finally:
        if claim is not None:
            claim.release()
        if env is not None:
            D.teardown(env)


def _training_record(out: Path) -> dict[str, Any] | None:
    """The machine, timing and estimate that the folder's last training invocation recorded."""
    try:
        old = read_manifest(out)
    except UserError:
        return None
    if not (old.get("timing") or {}).get("trained"):
        return None
    return {k: old[k] for k in ("machine", "timing", "estimate_s", "trained_under_analysis") if k in old}


def _quiet(*args, **kwargs) -> None:
    pass


def _train_dtype(
    plan: Plan, device: str, threads: int | None = None, say: Callable[..., None] = _quiet, records: list | None = None
) -> tuple[str, dict[str, tuple]]:
    """What the runs' dtype setting resolves to on `device` (auto is timed on the CPU per model
    shape, so a sweep may train its narrow sizes in fp32 and its wide ones under bf16), and each run's
    (dtype, Decision) by its `rel`. Decided here, at the workers' thread count, before any worker
    starts, and handed to every worker: none of them times while the others train, and all train in
    what was decided here. Each CPU decision is said once, with its figures, and its record appended
    to `records`."""
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        decided = [r.cfg.autocast(device.split(":")[0]) for r in plan.runs]
    finally:
        torch.set_num_threads(before)
    first = {p.shape: p for _, p in reversed(decided) if p is not None}  # each shape's first word
    for p in first.values():
        say(f"compare: {p.describe()}")
    if records is not None:
        records.extend(p.record() for p in first.values())
    per_run = {r.rel: d for r, d in zip(plan.runs, decided)}
    return ", ".join(sorted({dtype for dtype, _ in decided})) or "fp32", per_run


def _run_plan(plan: Plan, env, say, t_start: float, command: str | None) -> Outcome:
    cfg, out = plan.config, plan.out
    world = env.world if env is not None else 1
    main = env is None or env.main
    runs, metrics, todo = _runs_to_train(plan, env, say)
    device = str(select_device(cfg.device))
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    parallel = device == "cpu" and world == 1
    layout = choose_layout(cfg, todo, cpus, cfg.jobs, cfg.threads, say if main else _quiet) if parallel else None
    jobs, threads = (layout.jobs, layout.threads) if layout is not None else (1, None)
    work = (layout.run_estimates(todo) if layout is not None else None) or {}  # seconds per run, once
    probes: list = []
    train_dtype, decided = _train_dtype(plan, device, threads, say if main else _quiet, probes)
    if cfg.sweep and "," in train_dtype:  # a gap's change with size must not be a change of precision
        raise UserError(
            f"--dtype {cfg.dtype} resolves to {train_dtype} across this sweep's sizes; a sweep trains every size in "
            "one dtype: pass --dtype fp32 or --dtype bf16"
        )
    manifest = _manifest(plan, runs, metrics, command, machine_info(jobs, threads or 0, device, world, train_dtype))
    if probes:  # the timings that decided "auto" on this CPU (beside machine: results.md lists that one)
        manifest["dtype_probe"] = probes
    trained_before = _training_record(out) if not todo else None
    if trained_before:  # only re-rendering: the folder keeps the record of the invocation that trained
        manifest.update(trained_before)
        if "trained_under_analysis" not in trained_before:
            manifest.pop("trained_under_analysis")  # trained before the version was recorded: unknown
    if main:
        write_manifest(out, manifest)
        how = (
            f"{jobs} parallel jobs x {threads} thread{'s' if threads > 1 else ''}"
            if parallel
            else f"one at a time on {device}" + (f" x {world} ranks" if world > 1 else "")
        )
        say(
            f"compare: {len(runs)} runs in {out} ({len(runs) - len(todo)} finished already, {len(todo)} to train; {how})"
        )
        estimate = sum(work.values()) / layout.jobs if work else None
        if estimate is not None:
            say(f"compare: about {fmt_duration(estimate)} of training at this machine's measured pace", flush=True)
            manifest["estimate_s"] = round(estimate, 1)
    outcome = Outcome(out)
    progress = Progress(len(runs), len(runs) - len(todo), len(todo), say=say, work=work)
    outcome.failures += train_all(todo, progress, parallel, jobs, threads, main, decided)
    outcome.wall_s = wall = time.perf_counter() - t_start
    if main:
        outcome.results = write_after_training(plan, manifest, trained_before, len(runs), len(todo), wall, command, say)
    if env is not None:
        D.barrier(env)
    return outcome


def _runs_to_train(plan: Plan, env, say) -> tuple[list[PlannedRun], dict[str, Any], list[PlannedRun]]:
    """(the runs whose tasks load, their tasks' metrics, the runs not finished yet); under torchrun
    rank 0's view is everyone's."""
    cfg, runs, metrics = plan.config, plan.runs, {}
    if env is None or env.main:
        runs, metrics = _check_tasks(runs, _family_request(cfg), say)
        if not runs:
            raise UserError(f"no task of {cfg.task!r} could be loaded")
    if env is not None:
        plan_rel, metrics = D.all_gather_object(env, ([r.rel for r in runs], metrics))[0]
        runs = [r for r in runs if r.rel in set(plan_rel)]
    states = run_states(runs, plan.out, plan.config.sweep)
    if env is not None:
        states = D.all_gather_object(env, states)[0]
    return runs, metrics, [r for r, s in zip(runs, states) if s != "finished"]


def _manifest(plan: Plan, runs: list[PlannedRun], metrics, command: str | None, machine) -> dict[str, Any]:
    """compare.json: the command, the plan, the recipe of its first run, every run, the machine."""
    cfg = plan.config
    if cfg.sweep:
        recipe = f"scaling sweep ({cfg.recipe})" if cfg.recipe else "scaling sweep"
    elif cfg.preset:
        recipe = cfg.preset
    elif recipe_name(cfg.recipe, cfg.full_grid, plan.family) == "paper":
        recipe = f"the paper's recipe (PAPER_RECIPE of qkvlab.tasks.{plan.family})"
    else:
        recipe = f"compare default ({CPU_RECIPES[plan.family]['preset']} + CPU recipe)"
    first = runs[0].cfg.to_dict()
    return {
        "command": command,
        "task_label": cfg.task,
        **plan.info,
        "train": {"preset": recipe, **{k: v for k, v in first.items() if k not in ("model", "task_options")}},
        "model": runs[0].cfg.model.to_dict(),
        "task_options": runs[0].cfg.task_options,
        "metrics": metrics,
        "runs": [
            {"task": r.task, "variant": r.variant.name, "seed": r.seed, "point": r.point, "dir": r.rel} for r in runs
        ],
        "machine": machine,
        "trained_under_analysis": ANALYSIS_VERSION,  # a re-render keeps the training invocation's (below)
    }
