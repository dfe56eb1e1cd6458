"""Train every attention variant on a task (or a task family) over seeds; write a results table
beside the papers' figures, CSV and plots.

With no arguments: Q-K-V, Id-K-V, Id-K-V/mlp, Q-K=V, Q=K-V, Q=K=V, Id-K=V and Q-K=V/MQA on the
Shakespeare corpus, 3 seeds each, at a CPU-sized model (24 runs, minutes on 2 cores).
`--task synthetic|vision|anomaly|segmentation` (or one task, e.g. `reverse`) runs Paper B's six
schemes (the '+' forms included) over a small grid; `--full-grid` runs the paper's grid.

Variants: SCHEME[/MQA|/GQA-g][/mlp], comma-separated, e.g. `--variants Q-K-V,Q-K=V/MQA,Id-K-V/mlp`
(`/mlp`: MLP widened to Q-K-V's parameter count; '+' stays the 2D score term, as in `(Q=K-V)+`).

Runs go to OUT/<task>/<variant>/seed<k> (OUT/<task>/<grid point>/... on a grid); a finished run
(final model + metrics) is skipped when compare runs again, an interrupted one resumes. On CPU the
runs train in parallel, one thread each (`--jobs`). On GPUs, one run at a time over every rank:
`torchrun --nproc_per_node 8 -m qkvlab.cli compare --preset paperB-300m --data PATH --seeds 1`.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qkvlab.analysis.paper_figures import PAPER_B_SCHEMES
from qkvlab.analysis.results import Variant, parse_variants, run_finished, write_manifest, write_results
from qkvlab.cli import _positive_int, add_model_options, model_overrides
from qkvlab.errors import UserError

DEFAULT_LM_VARIANTS = ("Q-K-V", "Id-K-V", "Id-K-V/mlp", "Q-K=V", "Q=K-V", "Q=K=V", "Id-K=V", "Q-K=V/MQA")

# CPU-sized recipes used when no --preset is given: (training preset, overrides, model overrides,
# task options, seeds). Sized so the default comparison of a family fits its budget on 2 cores
# (lm: 24 runs in <= 15 min; each family <= 20 min); measured wall times and results (2 jobs x 1
# thread, 2-core Xeon): docs/results/README.md (lm 8.3, synthetic 7.5, vision 6.7, anomaly 4.0, segmentation 8.6 min).
CPU_RECIPES: dict[str, dict[str, Any]] = {
    # characters of Shakespeare: attention matters within a few hundred steps (Q=K=V falls behind)
    "lm": dict(
        preset="tiny",
        train=dict(max_steps=600, batch_size=32, lr=3e-3, min_lr=3e-4, warmup_steps=60, eval_every=100, eval_batches=8),
        model=dict(),
        task_options=dict(tokenizer="char"),
        seeds=3,
    ),
    # length 16 at lr 1e-2: Reverse/Swap sit on a ~0.24 plateau until attention locks on to positions,
    # at step ~250-350 for Q-K-V and later for Q=K=V; 400 steps end inside that window, where schemes
    # differ (length 32 x 300 steps left every scheme on the plateau). 3 seeds: the jump is noisy.
    "synthetic": dict(
        preset="tiny",
        train=dict(max_steps=400, batch_size=64, lr=1e-2, min_lr=1e-3, warmup_steps=30, eval_every=50, eval_batches=8),
        model=dict(d_model=64, n_layer=2, n_head=4),
        task_options=dict(length=16),
        seeds=3,
    ),
    # lr 1e-3 x 500 steps left every scheme still falling (mnist5k 0.68-0.86): faster lr, more steps
    "vision": dict(
        preset="tiny",
        train=dict(max_steps=800, batch_size=64, lr=2e-3, min_lr=2e-4, warmup_steps=50, eval_every=100, eval_batches=8),
        model=dict(d_model=64, n_layer=2, n_head=4),
        task_options=dict(),
        seeds=2,
    ),
    # mnist5k, not digits: on digits every scheme reaches ~0.95 within 200 steps; on mnist5k lr 1e-3 is
    # at 0.36-0.60 after 300 steps and still climbing, so 1000 steps at lr 2e-3 end below saturation
    "anomaly": dict(
        preset="tiny",
        train=dict(
            max_steps=1000, batch_size=64, lr=2e-3, min_lr=2e-4, warmup_steps=50, eval_every=100, eval_batches=8
        ),
        model=dict(d_model=64, n_layer=2, n_head=4),
        task_options=dict(dataset="mnist5k"),
        seeds=3,
    ),
    # 64 patches per canvas make a step ~3x a vision step, hence 2 seeds; mIoU still climbs at 600 steps
    # of lr 2e-3 (0.21-0.25), at 1000 steps 0.25-0.30 with Q=K=V (and its '+') last
    "segmentation": dict(
        preset="tiny",
        train=dict(
            max_steps=1000, batch_size=64, lr=2e-3, min_lr=2e-4, warmup_steps=50, eval_every=100, eval_batches=8
        ),
        model=dict(d_model=64, n_layer=2, n_head=4),
        task_options=dict(),
        seeds=2,
    ),
}
# The paper's grids (--full-grid): the task modules' PAPER_GRID where they define one; Paper B's
# anomaly reference setup; segmentation (details not public) reuses the vision grid.
ANOMALY_GRID = dict(d_model=(256,), n_layer=(4,), n_head=(4,), seeds=3)
FULL_GRID_STEPS = {"synthetic": 4000, "vision": 4000, "anomaly": 4000, "segmentation": 4000}

RESUMABLE_KEYS = ("eval_every", "checkpoint_every", "compile", "log_tensorboard", "log_every", "sharding", "device")


# ---- command line ---------------------------------------------------------------------------
def add_arguments(p) -> None:
    p.add_argument("--out", metavar="DIR", help="compare folder (default runs/compare-<task>)")
    p.add_argument(
        "--task",
        default="lm",
        metavar="NAME",
        help="a task (lm, reverse, mnist5k, ...) or a family (synthetic, vision, anomaly, segmentation)",
    )
    p.add_argument(
        "--variants",
        metavar="LIST",
        help="comma-separated SCHEME[/MQA|/GQA-g][/mlp] (default: the 8 LM variants, or Paper B's 6 schemes)",
    )
    p.add_argument(
        "--seeds",
        type=_positive_int,
        metavar="N",
        help="seeds 0..N-1 per variant (default: 3 for lm, synthetic and anomaly; 2 for vision and segmentation)",
    )
    p.add_argument("--max-steps", "--steps", dest="max_steps", type=_positive_int, metavar="N")
    p.add_argument("--batch-size", type=_positive_int, metavar="N", help="global examples per step")
    p.add_argument("--lr", type=float, metavar="LR")
    p.add_argument("--eval-every", type=_positive_int, metavar="N")
    p.add_argument("--full-grid", action="store_true", help="the paper's grid for the task family (long)")
    p.add_argument("--data", metavar="PATH", help="lm corpus: a text file or folder, or hf:NAME (default Shakespeare)")
    p.add_argument("--tokenizer", metavar="SPEC", help="lm tokenizer: bpe:N, char or gpt2")
    p.add_argument(
        "--task-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a task option (repeatable), e.g. length=64, root=/data/cifar10",
    )
    p.add_argument(
        "--jobs",
        type=_positive_int,
        metavar="N",
        help="runs trained at once on CPU, one thread each (default: the CPU count, at most 8)",
    )
    p.add_argument(
        "--threads", type=_positive_int, metavar="N", help="torch threads per job on CPU (default: CPU count / jobs)"
    )
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    p.add_argument("--dry-run", action="store_true", help="print the plan, train nothing")
    p.add_argument("--no-plots", action="store_true")
    add_model_options(p, with_preset_default=False)


# ---- the plan ---------------------------------------------------------------------------------
@dataclass
class PlannedRun:
    task: str
    variant: Variant
    seed: int
    point: str  # grid point label ("" for the default point)
    cfg: Any  # TrainConfig
    dir: Path

    @property
    def rel(self) -> str:
        return str(Path(self.task, self.point, self.variant.slug, f"seed{self.seed}"))


def resolve_tasks(name: str) -> tuple[list[str], str]:
    """--task value -> (task names, family). Unknown -> one-line error listing what is allowed."""
    from qkvlab.tasks import FAMILIES, TASK_MODULES

    if name in FAMILIES:
        return list(FAMILIES[name]), name
    if name in TASK_MODULES:
        family = next((f for f, tasks in FAMILIES.items() if name in tasks), "vision")
        return [name], family
    raise UserError(
        f"unknown task {name!r}; allowed: a family ({', '.join(FAMILIES)}) or a task ({', '.join(TASK_MODULES)})"
    )


def _parse_value(text: str) -> Any:
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return {"true": True, "false": False, "none": None}.get(text.lower(), text)


def parse_task_options(items: list[str]) -> dict[str, Any]:
    out = {}
    for item in items:
        if "=" not in item:
            raise UserError(f"--task-option {item!r} must be KEY=VALUE, e.g. length=64")
        k, v = item.split("=", 1)
        out[k.strip()] = _parse_value(v.strip())
    return out


def grid_points(family: str, full: bool) -> tuple[list[dict[str, Any]], int | None]:
    """Grid points (dicts of overrides) and the grid's seed count (None: no opinion)."""
    if not full:
        return [{}], None
    if family == "lm":
        raise UserError(
            "--full-grid is for the task families (synthetic, vision, anomaly, segmentation); "
            "for lm use --preset paperB-300m or gpt2-124m"
        )
    import importlib

    if family == "anomaly":
        grid = ANOMALY_GRID
    else:
        module = "qkvlab.tasks.vision" if family == "segmentation" else f"qkvlab.tasks.{family}"
        grid = dict(importlib.import_module(module).PAPER_GRID)
        if family == "segmentation":
            grid.pop("patch", None)  # the canvas fixes the patch grid
    axes = {k: v for k, v in grid.items() if isinstance(v, (tuple, list))}
    seeds = grid.get("seeds", grid.get("runs"))
    fixed = {k: v for k, v in grid.items() if k == "batch_size"}
    points = [{**fixed, **dict(zip(axes, values))} for values in itertools.product(*axes.values())]
    return points, seeds


def point_label(point: dict[str, Any]) -> str:
    short = {"d_model": "d", "n_layer": "L", "n_head": "h", "length": "len", "patch": "p", "lr": "lr"}
    return "-".join(
        f"{short.get(k, k)}{v:g}" if isinstance(v, float) else f"{short.get(k, k)}{v}"
        for k, v in point.items()
        if k != "batch_size"
    )


def split_overrides(point: dict[str, Any]) -> tuple[dict, dict, dict]:
    """A grid point -> (model keys, train keys, task options)."""
    from qkvlab.config import ModelConfig
    from qkvlab.train.config import TrainConfig

    model_keys = {f.name for f in dataclasses.fields(ModelConfig)}
    train_keys = {f.name for f in dataclasses.fields(TrainConfig)}
    model = {k: v for k, v in point.items() if k in model_keys}
    train = {k: v for k, v in point.items() if k in train_keys and k not in model}
    task = {k: v for k, v in point.items() if k not in model and k not in train}
    return model, train, task


def base_train_config(args, family: str, task: str, point: dict[str, Any]):
    """The TrainConfig of one grid point before the variant: preset recipe (or the CPU recipe),
    grid point, then the command line's overrides."""
    from qkvlab.config import preset as model_preset
    from qkvlab.train.config import TRAIN_PRESETS, TrainConfig

    recipe = CPU_RECIPES[family]
    name = args.preset or recipe["preset"]
    body = dict(TRAIN_PRESETS[name])
    model_name = body.pop("model")
    preset_task_options = body.pop("task_options", {})
    if args.preset is None:
        body.update(recipe["train"])
    g_model, g_train, g_task = split_overrides(point)
    body.update(g_train)
    if args.full_grid and args.max_steps is None and "max_steps" not in g_train:
        body["max_steps"] = FULL_GRID_STEPS.get(family, body["max_steps"])
    for key in ("max_steps", "batch_size", "lr", "eval_every"):
        if getattr(args, key, None) is not None:
            body[key] = getattr(args, key)
    if args.lr is not None and "min_lr" in body:
        body["min_lr"] = args.lr / 10
    if body.get("warmup_steps", 0) >= body["max_steps"]:
        body["warmup_steps"] = max(0, body["max_steps"] // 10)
    body["eval_every"] = min(body["eval_every"], body["max_steps"])

    task_options = dict(preset_task_options) if task == "lm" else {}
    if args.preset is None:
        task_options.update(recipe["task_options"])
    task_options.update(g_task)
    if task == "lm":
        if args.data is not None:
            task_options["data"] = args.data
        if args.tokenizer is not None:
            task_options["tokenizer"] = args.tokenizer
    elif args.data is not None or args.tokenizer is not None:
        raise UserError(f"--data and --tokenizer are lm options; task {task} takes --task-option KEY=VALUE")
    task_options.update(parse_task_options(args.task_option))

    overrides = dict(recipe["model"]) if args.preset is None else {}
    overrides.update(g_model)
    overrides.update(model_overrides(args))
    model = model_preset(model_name, **overrides)
    body.update(task=task, task_options=task_options, model=model, device=args.device, log_tensorboard=False)
    return TrainConfig.from_dict(body)


def make_plan(args) -> tuple[list[PlannedRun], dict[str, Any]]:
    tasks, family = resolve_tasks(args.task)
    for key in ("attn", "kv_heads", "match_params"):
        if getattr(args, key, None) is not None:
            raise UserError(
                f"--{key.replace('_', '-')} sets one variant; compare takes --variants, "
                "e.g. --variants Q-K-V,Q-K=V/MQA,Id-K-V/mlp"
            )
    default_variants = DEFAULT_LM_VARIANTS if family == "lm" else PAPER_B_SCHEMES
    variants = parse_variants(args.variants if args.variants else list(default_variants))
    points, grid_seeds = grid_points(family, args.full_grid)
    n_seeds = args.seeds or grid_seeds or (CPU_RECIPES[family]["seeds"] if args.preset is None else 1)
    out = Path(args.out or f"runs/compare-{args.task}")
    plan: list[PlannedRun] = []
    for task in tasks:
        for point in points:
            base = base_train_config(args, family, task, point)
            label = point_label(point)
            for v in variants:
                model = v.apply(base.model)
                for seed in range(n_seeds):
                    cfg = dataclasses.replace(base, model=model, seed=seed)  # both validated already
                    run = PlannedRun(task, v, seed, label, cfg, out)
                    run.dir = out / run.rel
                    plan.append(run)
    info = {
        "family": family,
        "tasks": tasks,
        "variants": [v.name for v in variants],
        "seeds": list(range(n_seeds)),
        "grid": [{"label": point_label(p) or "default", **p} for p in points],
        "out": str(out),
    }
    return plan, info


# ---- run state --------------------------------------------------------------------------------
def _saved_config(run_dir: Path) -> dict[str, Any] | None:
    try:
        body = json.loads((run_dir / "config.json").read_text())
        return body.get("train", {}).get("config")
    except (OSError, json.JSONDecodeError):
        return None


def run_state(run: PlannedRun) -> str:
    """'finished' (skip), 'resume' (train continues or extends it), 'new'. A finished or started
    run with another recipe is a one-line error: compare never overwrites a run."""
    if run_finished(run.dir):
        saved = _saved_config(run.dir)
        if saved is not None:
            now = run.cfg.to_dict()
            diff = [
                k
                for k in sorted(set(saved) | set(now))
                if k not in RESUMABLE_KEYS and k != "max_steps" and saved.get(k) != now.get(k)
            ]
            if diff:
                raise UserError(
                    f"{run.dir} was trained with another {diff[0]} ({json.dumps(saved.get(diff[0]))}); "
                    "use another --out or the same settings"
                )
            if saved.get("max_steps") != now.get("max_steps"):
                return "resume"
        return "finished"
    return "resume" if (run.dir / "checkpoint").exists() else "new"


# ---- execution --------------------------------------------------------------------------------
def _worker_init(threads: int) -> None:
    import torch

    torch.set_num_threads(threads)


def _train_one(cfg, out_dir: str, progress: bool):
    from qkvlab.train.loop import TrainingDiverged, train

    t0 = time.perf_counter()
    try:
        res = train(cfg, out_dir, resume=True, progress=progress)
    except TrainingDiverged as e:
        return {"error": str(e), "seconds": time.perf_counter() - t0}
    return {
        "metrics": res.metrics,
        "metric": res.metric,
        "higher_is_better": res.higher_is_better,
        "seconds": time.perf_counter() - t0,
    }


def _fmt_time(s: float) -> str:
    s = int(round(s))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


class Progress:
    """One line per finished run: run i/N, its score, elapsed and ETA."""

    def __init__(self, total: int, done: int, to_train: int, enabled: bool = True):
        self.total, self.done, self.to_train, self.trained = total, done, to_train, 0
        self.t0 = time.perf_counter()
        self.enabled = enabled

    def update(self, run: PlannedRun, result: dict[str, Any]) -> None:
        self.done += 1
        self.trained += 1
        elapsed = time.perf_counter() - self.t0
        eta = elapsed / self.trained * (self.to_train - self.trained)
        if "error" in result:
            score = f"FAILED: {result['error']}"
        else:
            m = result["metric"]
            score = f"{m} {result['metrics'].get(m, float('nan')):.4f}"
        where = f"{run.task}{'/' + run.point if run.point else ''} {run.variant.name} seed {run.seed}"
        if self.enabled:
            print(
                f"[run {self.done}/{self.total}] {where}: {score} ({result['seconds']:.0f} s)  "
                f"elapsed {_fmt_time(elapsed)}  ETA {_fmt_time(eta)}",
                flush=True,
            )


def machine_info(jobs: int, threads: int, device: str, world: int) -> dict[str, Any]:
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = {
        "cpu": cpu,
        "cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "load_avg_at_start": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
        "platform": platform.platform(terse=True),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": device,
        "jobs": jobs,
        "threads_per_job": threads,
        "world_size": world,
    }
    if device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def _check_tasks(plan: list[PlannedRun], family_request: bool, say) -> tuple[list[PlannedRun], dict[str, Any]]:
    """Build each task once per distinct option set (validates options and data, caches a tokenized
    corpus before parallel runs read it); read its metric. With a family, a task whose data is
    missing is skipped with a note, and so is a grid point a task cannot take (e.g. patch 7 on
    32-px images); a task named alone at its default point fails with its one-line error."""
    from qkvlab.tasks import get_task

    metrics: dict[str, Any] = {}
    checked: dict[tuple[str, str], bool] = {}
    for run in plan:
        key = (run.task, json.dumps(run.cfg.task_options, sort_keys=True, default=str))
        if key in checked:
            continue
        try:
            t = get_task(run.task, **run.cfg.task_options)
            t.adapt_config(run.cfg.model)
        except UserError as e:
            if run.task == "lm" or not (family_request or run.point):
                raise
            say(f"compare: skipping {run.task}{' at ' + run.point if run.point else ''}: {e}")
            checked[key] = False
            continue
        checked[key] = True
        metrics[run.task] = {"metric": t.metric, "higher_is_better": bool(t.higher_is_better)}
        del t
    keep = [r for r in plan if checked[(r.task, json.dumps(r.cfg.task_options, sort_keys=True, default=str))]]
    return keep, metrics


def run(args) -> int:
    from qkvlab.tasks import FAMILIES

    t_start = time.perf_counter()
    plan, info = make_plan(args)
    out = Path(info["out"])
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    main = rank == 0
    say = print if main else (lambda *a, **k: None)

    if args.dry_run:
        say(
            f"compare plan: {len(plan)} runs into {out}: tasks {', '.join(info['tasks'])}; "
            f"variants {', '.join(info['variants'])}; seeds {len(info['seeds'])}; grid points {len(info['grid'])}"
        )
        c = plan[0].cfg
        say(
            f"  per run: {c.max_steps} steps x {c.batch_size} examples, lr {c.lr}, model d{c.model.d_model} "
            f"L{c.model.n_layer} h{c.model.n_head}"
        )
        for r in plan[:12]:
            say(f"  {r.rel}  [{run_state(r)}]")
        if len(plan) > 12:
            say(f"  ... {len(plan) - 12} more")
        return 0

    # Under torchrun every rank walks the same plan; each run is one distributed train() call.
    env = None
    if world > 1:
        from qkvlab.train import distributed as D

        env = D.setup(args.device)
    try:
        return _run_plan(args, plan, info, out, env, main, say, t_start, args.task in FAMILIES and args.task != "lm")
    finally:
        if env is not None:
            from qkvlab.train import distributed as D

            D.teardown(env)


def _run_plan(args, plan, info, out, env, main, say, t_start, family_request) -> int:
    from qkvlab.train import distributed as D

    world = env.world if env is not None else 1
    metrics: dict[str, Any] = {}
    if main:
        plan, metrics = _check_tasks(plan, family_request, say)
        if not plan:
            raise UserError(f"no task of {args.task!r} could be loaded")
    if env is not None:  # rank 0's view of tasks and finished runs is everyone's
        plan_rel, metrics = D.all_gather_object(env, ([r.rel for r in plan], metrics))[0]
        plan = [r for r in plan if r.rel in set(plan_rel)]
    states = [run_state(r) for r in plan]
    if env is not None:
        states = D.all_gather_object(env, states)[0]
    todo = [r for r, s in zip(plan, states) if s != "finished"]

    device = args.device
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    parallel = device == "cpu" and world == 1
    jobs = min(args.jobs or min(cpus, 8), max(1, len(todo))) if parallel else 1
    threads = (args.threads or max(1, cpus // jobs)) if parallel else None

    manifest = {
        "command": "qkvlab " + " ".join(sys.argv[1:]) if "compare" in sys.argv[1:] else None,
        "task_label": args.task,
        **info,
        "train": {
            "preset": args.preset or f"compare default ({CPU_RECIPES[info['family']]['preset']} + CPU recipe)",
            **{k: v for k, v in plan[0].cfg.to_dict().items() if k not in ("model", "task_options")},
        },
        "model": plan[0].cfg.model.to_dict(),
        "task_options": plan[0].cfg.task_options,
        "metrics": metrics,
        "runs": [
            {"task": r.task, "variant": r.variant.name, "seed": r.seed, "point": r.point, "dir": r.rel} for r in plan
        ],
        "machine": machine_info(jobs, threads or 0, device, world),
    }
    if main:
        write_manifest(out, manifest)
        say(
            f"compare: {len(plan)} runs in {out} ({len(plan) - len(todo)} finished already, {len(todo)} to train; "
            + (
                f"{jobs} parallel jobs x {threads} thread{'s' if threads > 1 else ''}"
                if parallel
                else f"one at a time on {device}" + (f" x {world} ranks" if world > 1 else "")
            )
            + ")",
            flush=True,
        )

    progress = Progress(len(plan), len(plan) - len(todo), len(todo), enabled=main)
    failures: list[str] = []

    def record(r: PlannedRun, result: dict[str, Any]) -> None:
        progress.update(r, result)
        if "error" in result:
            failures.append(f"{r.rel}: {result['error']}")

    if parallel and jobs > 1:
        import multiprocessing as mp
        from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

        with ProcessPoolExecutor(
            jobs, mp_context=mp.get_context("spawn"), initializer=_worker_init, initargs=(threads,)
        ) as pool:
            pending = {pool.submit(_train_one, r.cfg, str(r.dir), False): r for r in todo}
            try:
                while pending:
                    done, _ = wait(pending, return_when=FIRST_COMPLETED)
                    for fut in done:
                        record(pending.pop(fut), fut.result())
            except BaseException:
                for fut in pending:
                    fut.cancel()
                raise
    else:
        if parallel:
            _worker_init(threads)
        for r in todo:
            record(r, _train_one(r.cfg, str(r.dir), progress=not parallel and main))

    wall = time.perf_counter() - t_start
    if main:
        from qkvlab.analysis.results import collect

        res = collect(out)
        manifest["timing"] = {
            "wall_s": round(wall, 1),
            "trained": len(todo),
            "skipped": len(plan) - len(todo),
            "train_s_total": round(sum(float(r.final.get("elapsed_s") or 0) for r in res.runs), 1),
        }
        write_manifest(out, manifest)
        res.manifest = manifest
        write_results(out, res, plots=not args.no_plots)
        say(
            f"compare: wrote {out / 'results.md'}, {out / 'results.csv'}"
            + ("" if args.no_plots else " and plots")
            + f"; wall time {_fmt_time(wall)} ({wall:.0f} s)"
        )
    if env is not None:
        D.barrier(env)
    if failures:
        print(f"qkvlab compare: {len(failures)} run(s) diverged, first: {failures[0]}", file=sys.stderr)
        return 3
    return 0
