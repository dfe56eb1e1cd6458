"""A comparison's settings (`CompareConfig`) and its plan: one TrainConfig per (task, grid point,
variant, seed), each with its run folder, and each run's state on disk (new, resume, finished)."""

from __future__ import annotations

import dataclasses
import importlib
import itertools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qkvlab.analysis.paper_figures import PAPER_B_SCHEMES
from qkvlab.analysis.runs import run_finished
from qkvlab.base.devices import TRAIN_DTYPES, check_device, dtype_choices
from qkvlab.base.errors import UserError
from qkvlab.base.settings import check, resolve, setting
from qkvlab.compare.auto import PILOT_SEEDS
from qkvlab.compare.pace import first_run_per_point, parse_duration
from qkvlab.compare.recipes import (
    ANOMALY_GRID,
    CPU_RECIPES,
    DEFAULT_LM_VARIANTS,
    FULL_GRID_STEPS,
    RECIPES,
    SWEEP_RECIPES,
    paper_recipe,
    recipe_name,
)
from qkvlab.model.config import PRESETS, ModelConfig
from qkvlab.model.folder import read_config
from qkvlab.model.variants import Variant, parse_variants
from qkvlab.tasks import FAMILIES, TASK_MODULES
from qkvlab.train.config import TRAIN_PRESETS, TrainConfig, changed_fields, config_fingerprint, default_weight_decay
from qkvlab.train.run_folder import first_difference

MAX_SEEDS = 10_000  # per variant (or sweep size): a plan of that many runs still prints in seconds


@dataclass
class CompareConfig:
    """What `qkvlab compare` reads; usable as is from Python (`plan(CompareConfig(task="reverse"))`)."""

    task: str = setting(
        "lm",
        help="a task (lm, reverse, mnist5k, ...) or a family (synthetic, vision, anomaly, segmentation)",
        metavar="NAME",
    )
    variants: str | None = setting(
        None,
        help="comma-separated SCHEME[/MQA|/GQA-g][/mlp[=SCHEME]|/width=SCHEME] "
        "(default: the 9 LM variants, or Paper B's 6 schemes)",
        metavar="LIST",
    )
    out: str | None = setting(None, help="compare folder (default runs/compare-<task>)", metavar="DIR")
    seeds: int | str | None = setting(
        None,
        help="seeds 0..N-1 per variant (default: 3 for lm, synthetic, anomaly; 2 for vision, segmentation), or auto: "
        "a 3-seed pilot, then as many seeds as its undecided claims need at their margins (compare/auto.py)",
        metavar="N|auto",
        minimum=1,
        maximum=MAX_SEEDS,
    )
    budget: str | None = setting(
        None, help="with --seeds auto: the most extra training time to spend, e.g. 90m, 2h, 1h30m", metavar="DURATION"
    )
    preset: str | None = setting(None, help="training preset (default: the CPU recipe)", choices=PRESETS)
    max_steps: int | None = setting(
        None, help="optimizer steps per run (default: the recipe's)", flags=("--steps",), minimum=1
    )
    batch_size: int | None = setting(None, help="global examples per step (default: the recipe's)", minimum=1)
    lr: float | None = setting(None, help="peak learning rate, min_lr = lr / 10 (default: the recipe's)", positive=True)
    eval_every: int | None = setting(None, help="steps between evaluations (default: the recipe's)", minimum=1)
    full_grid: bool = setting(False, help="the paper's grid for the task family (long)")
    recipe: str | None = setting(
        None,
        choices=(*RECIPES, *SWEEP_RECIPES),
        help="cpu: the CPU-sized recipe (compare/recipes.py); paper: the papers' own recipe where the task "
        "module defines one (synthetic, vision, anomaly: PAPER_RECIPE); default: paper with --full-grid where one exists, else cpu. "
        "With --sweep: a named sweep (SWEEP_RECIPES: factorial-d128, lr-scan-L2/L4, lr-scan-up-L2/L4, next-L2/L4, next-up-L2/L4, gpu-L2/L4) for every "
        "setting not given",
    )
    data: str | None = setting(
        None, help="lm corpus: a text file or folder, or hf:NAME (default Shakespeare)", metavar="PATH"
    )
    tokenizer: str | None = setting(None, help="lm tokenizer: bpe:N, char or gpt2", metavar="SPEC")
    task_options: dict[str, Any] = setting(
        help="a task option (repeatable; VALUE read as YAML), e.g. length=64, root=/data/cifar10",
        default_factory=dict,
        flag="--task-option",
        metavar="KEY=VALUE",
    )
    model: dict[str, Any] = setting(help="model options", default_factory=dict, group=ModelConfig)
    jobs: int | None = setting(
        None, help="runs trained at once on CPU, one thread each (default: CPU count, max 8)", minimum=1
    )
    threads: int | None = setting(None, help="torch threads per job on CPU (default: CPU count / jobs)", minimum=1)
    device: str = setting("auto", help="auto, cpu, cuda, cuda:N or mps", metavar="DEVICE")
    dtype: str = setting(
        "auto",
        help="training autocast dtype of every run (auto: bf16 on CUDA; on the CPU bf16 only where timing the "
        "model's shapes here shows it faster than fp32; compare.json and results.md record what it resolved to)",
        choices=dtype_choices(TRAIN_DTYPES),
    )
    plots: bool = setting(True, help="write the plots")
    render: bool = setting(
        False,
        help="no training: re-derive --out's results.md, results.csv and plots from its stored scores (run "
        "folders, else scores.json; a sweep: its per-seed results.csv) under the analysis rules",
    )
    analysis_version: int | None = setting(
        None,
        help="with --render: the analysis rules to score under (default: the current version; 2-4 apply; "
        "docs/analysis.md tells their history)",
        metavar="N",
        minimum=2,
    )
    sweep: bool = setting(
        False,
        help="the scaling sweep: the LM variants at several sizes, tokens proportional to parameters; "
        "writes the gap to Q-K-V per size with intervals and its slope in log N (no prediction beyond 10x the largest size)",
    )
    sizes: str | None = setting(
        None,
        help="sweep sizes, comma-separated d<d_model>-L<layers>-h<heads>[-b<batch>][-s<seeds>][-lr<lr>] "
        "(default d48-L2-h4-b16-s6,d80-L2-h4-b16-s6,d128-L2-h4-b32-s3,d208-L2-h4-b32-s3)",
        metavar="LIST",
    )
    tokens_per_param: float | None = setting(
        None,
        help="sweep: training tokens per non-embedding parameter of Q-K-V (default 20)",
        metavar="X",
        positive=True,
    )
    lr_scan: str | None = setting(
        None,
        help="sweep: a finished lr scan's folder, or several separated by commas (a grid extended upward); each "
        "size trains at the lr of its Q-K-V run with the lowest validation loss (with --recipe next-L2/L4, next-up-L2/L4)",
        metavar="DIR[,DIR]",
    )
    dry_run: bool = setting(False, help="print the plan, train nothing")

    def validate(self) -> CompareConfig:
        check(self)  # types, choices and bounds of every field; below: the rules across fields
        for key in ("attn", "kv_heads", "match_params"):
            if self.model.get(key) is not None:
                raise UserError(
                    f"--{key.replace('_', '-')} sets one variant; compare takes --variants, "
                    "e.g. --variants Q-K-V,Q-K=V/MQA,Id-K-V/mlp"
                )
        if self.seeds == "auto":
            if self.budget is not None:
                parse_duration(self.budget)
        elif isinstance(self.seeds, str):
            raise UserError(f"seeds={self.seeds!r} must be a positive integer or auto")
        elif self.budget is not None:
            raise UserError("--budget goes with --seeds auto")

        check_device(self.device)
        return self

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class PlannedRun:
    task: str
    variant: Variant
    seed: int
    point: str  # grid point label ("" for the default point; the size's d..-L.. in a sweep)
    cfg: Any  # TrainConfig
    dir: Path
    task_folder: bool = True  # False in a sweep: OUT/<size>/<variant>/seed<k>

    @property
    def rel(self) -> str:
        head = (self.task,) if self.task_folder else ()
        return str(Path(*head, self.point, self.variant.slug, f"seed{self.seed}"))


@dataclass
class Plan:
    config: CompareConfig
    runs: list[PlannedRun]
    family: str
    tasks: list[str]
    variants: list[Variant]
    seeds: list[int]
    grid: list[dict[str, Any]]
    out: Path

    @property
    def info(self) -> dict[str, Any]:
        """The plan's part of compare.json."""
        return {
            "family": self.family,
            "tasks": self.tasks,
            "variants": [v.name for v in self.variants],
            "seeds": self.seeds,
            "grid": [{"label": point_label(p) or "default", **p} for p in self.grid],
            "sweep": bool(self.config.sweep),
            "out": str(self.out),
        }

    def describe(self, limit: int = 12) -> list[str]:
        """Lines of a dry run: the totals, the per-run recipe, the first runs with their state."""
        lines = [
            f"compare plan: {len(self.runs)} runs into {self.out}: tasks {', '.join(self.tasks)}; "
            f"variants {', '.join(v.name for v in self.variants)}; seeds {len(self.seeds)}; "
            f"grid points {len(self.grid)}"
        ]
        for r in list(first_run_per_point(self.runs).values())[:limit]:  # each task/grid point's recipe, once
            c, where = r.cfg, "/".join(x for x in (r.task if len(self.tasks) > 1 else "", r.point) if x)
            lines.append(
                f"  per run{' at ' + where if where else ''}: {c.max_steps} steps x {c.batch_size} examples, "
                f"lr {c.lr:.3g}, model d{c.model.d_model} L{c.model.n_layer} h{c.model.n_head}"
            )
        shown = self.runs[:limit]
        lines += [f"  {r.rel}  [{state}]" for r, state in zip(shown, run_states(shown, self.out, self.config.sweep))]
        if len(self.runs) > limit:
            lines.append(f"  ... {len(self.runs) - limit} more")
        return lines


def resolve_tasks(name: str) -> tuple[list[str], str]:
    """A task or family name -> (task names, family). Unknown -> one-line error listing what is allowed."""
    if name in FAMILIES:
        return list(FAMILIES[name]), name
    if name in TASK_MODULES:
        family = next((f for f, tasks in FAMILIES.items() if name in tasks), "vision")
        return [name], family
    raise UserError(
        f"unknown task {name!r}; allowed: a family ({', '.join(FAMILIES)}) or a task ({', '.join(TASK_MODULES)})"
    )


def grid_points(family: str, full: bool) -> tuple[list[dict[str, Any]], int | None]:
    """Grid points (dicts of overrides) and the grid's seed count (None: no opinion)."""
    if not full:
        return [{}], None
    if family == "lm":
        raise UserError(
            "--full-grid is for the task families (synthetic, vision, anomaly, segmentation); "
            "for lm use --preset paperB-300m or gpt2-124m"
        )
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
    model_keys = {f.name for f in dataclasses.fields(ModelConfig)}
    train_keys = {f.name for f in dataclasses.fields(TrainConfig)}
    model = {k: v for k, v in point.items() if k in model_keys}
    train = {k: v for k, v in point.items() if k in train_keys and k not in model}
    task = {k: v for k, v in point.items() if k not in model and k not in train}
    return model, train, task


def base_train_config(cfg: CompareConfig, family: str, task: str, point: dict[str, Any]):
    """The TrainConfig of one grid point before the variant: preset recipe (or the CPU or paper
    recipe), grid point, then the settings' overrides; and whether the recipe fixed the weight decay
    (else each variant gets its scheme's default)."""
    recipe = CPU_RECIPES[family]
    if cfg.preset is None and recipe_name(cfg.recipe, cfg.full_grid, family) == "paper":
        recipe = paper_recipe(family, task, point)  # the paper's own optimiser, schedule, model and steps
    own = cfg.preset is None  # the recipe's own train, model and task settings (a named preset has its own)
    g_model, g_train, g_task = split_overrides(point)
    task_options = {**(recipe["task_options"] if own else {}), **g_task}
    if task == "lm":
        task_options.update({k: v for k, v in (("data", cfg.data), ("tokenizer", cfg.tokenizer)) if v is not None})
    elif cfg.data is not None or cfg.tokenizer is not None:
        raise UserError(f"--data and --tokenizer are lm options; task {task} takes --task-option KEY=VALUE")
    layers = [
        {"preset": cfg.preset or recipe["preset"], "task": task},
        {**recipe["train"], "model": recipe["model"]} if own else None,
        {**g_train, "model": g_model},
        {k: getattr(cfg, k) for k in ("max_steps", "batch_size", "lr", "eval_every") if getattr(cfg, k) is not None},
        {"min_lr": cfg.lr / 10} if cfg.lr is not None else None,
        {"task_options": {**task_options, **cfg.task_options}, "model": cfg.model},
        {"device": cfg.device, "dtype": cfg.dtype, "log_tensorboard": False},
    ]
    if cfg.full_grid and cfg.max_steps is None and "max_steps" not in g_train and "max_steps" not in recipe["train"]:
        layers.append({"max_steps": FULL_GRID_STEPS.get(family, _top(layers, "max_steps"))})
    steps = _top(layers, "max_steps")  # a recipe's warmup and evaluations fit within its steps
    if _top(layers, "warmup_steps") >= steps:
        layers.append({"warmup_steps": max(0, steps // 10)})
    layers.append({"eval_every": min(_top(layers, "eval_every"), steps)})
    fixed_decay = any(x and x.get("weight_decay") is not None for x in layers)
    return resolve(TrainConfig, *layers), fixed_decay


def _top(layers: list[dict[str, Any] | None], key: str) -> Any:
    """`key`'s value in the highest of `layers` that sets it, else in the preset the first names."""
    return next((x[key] for x in reversed(layers) if x and key in x), TRAIN_PRESETS[layers[0]["preset"]].get(key))


def plan(cfg: CompareConfig) -> Plan:
    """Every run of a grid comparison, with its TrainConfig and folder (nothing is trained or
    written). `qkvlab.compare.plan` is the entry: it sends --sweep to compare.sweep instead."""
    cfg.validate()
    if cfg.seeds == "auto":  # the plan of the pilot; compare/auto.py plans the decisive run from it
        cfg = dataclasses.replace(cfg, seeds=PILOT_SEEDS)
    if cfg.sweep:
        raise ValueError("a sweep's plan is qkvlab.compare.sweep.plan_sweep (qkvlab.compare.plan picks it)")
    if cfg.sizes is not None or cfg.tokens_per_param is not None or cfg.lr_scan is not None:
        raise UserError("--sizes, --tokens-per-param and --lr-scan are settings of --sweep")
    if cfg.recipe in SWEEP_RECIPES:
        raise UserError(f"--recipe {cfg.recipe} is a scaling sweep's recipe: add --sweep")
    tasks, family = resolve_tasks(cfg.task)
    default_variants = DEFAULT_LM_VARIANTS if family == "lm" else _paper_b_schemes()
    variants = parse_variants(cfg.variants if cfg.variants is not None else list(default_variants))
    points, grid_seeds = grid_points(family, cfg.full_grid)
    n_seeds = cfg.seeds or grid_seeds or (CPU_RECIPES[family]["seeds"] if cfg.preset is None else 1)
    out = Path(cfg.out or f"runs/compare-{cfg.task}")
    runs: list[PlannedRun] = []
    for task in tasks:
        for point in points:
            base, fixed_decay = base_train_config(cfg, family, task, point)
            label = point_label(point)
            for v in variants:
                model = v.apply(base.model)
                # a recipe's own decay (Paper B's Adam: 0) holds; else 2**-5 with an identity role, 0.1 without
                decay = base.weight_decay if fixed_decay else default_weight_decay(model)
                for seed in range(n_seeds):
                    train_cfg = dataclasses.replace(base, model=model, seed=seed, weight_decay=decay)
                    run = PlannedRun(task, v, seed, label, train_cfg, out)
                    run.dir = out / run.rel
                    runs.append(run)
    return Plan(cfg, runs, family, tasks, variants, list(range(n_seeds)), points, out)


def _paper_b_schemes() -> tuple[str, ...]:
    return PAPER_B_SCHEMES


# ---- run state --------------------------------------------------------------------------------
def _saved_config(run_dir: Path) -> dict[str, Any] | None:
    try:
        _, body = read_config(run_dir)
    except UserError:
        return None
    return (body.get("train") or {}).get("config")


def run_states(runs: list[PlannedRun], out: Path, sweep: bool) -> list[str]:
    """run_state of each run; in a sweep, a run with no folder that OUT/results.csv records with the same
    config is 'finished': a sweep continues in another checkout from its committed table and scores.json
    (what it records is scored again, never retrained). A recorded row with another config is refused in
    one line, as run_state refuses a folder."""
    states = [run_state(r) for r in runs]
    if not sweep:
        return states
    # startup: scaling_report imports scipy; only a sweep with a table pays it
    from qkvlab.analysis.scaling_report import recorded_runs

    recorded = recorded_runs(out)
    for i, r in enumerate(runs):
        row = recorded.get(r.rel)
        if states[i] == "new" and row is not None and not r.dir.exists():
            if not row.config or row.config != config_fingerprint(r.cfg):
                raise UserError(
                    f"{Path(out) / 'results.csv'} records {r.rel} trained with other settings (or without a "
                    "config fingerprint); use another --out or the same settings"
                )
            states[i] = "finished"
    return states


def run_state(run: PlannedRun) -> str:
    """'finished' (skip), 'resume' (train continues or extends it), 'new'. A finished or started
    run with another recipe is a one-line error: compare never overwrites a run. A run folder
    written by an older qkvlab (fewer config keys) is read with today's defaults for those keys."""
    if run_finished(run.dir):
        saved = _saved_config(run.dir)
        if saved is not None:
            for key, (old, new) in changed_fields(saved, run.cfg).items():
                name, old, _ = first_difference(key, old, new)
                raise UserError(
                    f"{run.dir} was trained with another {name} ({json.dumps(old)}); "
                    "use another --out or the same settings"
                )
            if saved.get("max_steps") != run.cfg.max_steps:
                return "resume"
        return "finished"
    return "resume" if (run.dir / "checkpoint").exists() else "new"
