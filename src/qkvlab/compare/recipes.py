"""The comparison recipes: default variants, the CPU-sized recipe per task family, the papers'
grids. Measured wall times and results: docs/results/README.md."""

from __future__ import annotations

import importlib
from typing import Any

from qkvlab.errors import UserError

RECIPES = ("cpu", "paper")

DEFAULT_LM_VARIANTS = (
    "Q-K-V",
    "Id-K-V",
    "Id-K-V/mlp",
    "Q-K=V",
    "Q=K-V",
    "Q=V-K",
    "Q=K=V",
    "Id-K=V",
    "Q-K=V/MQA",
)

# CPU-sized recipes used when no --preset is given: (training preset, overrides, model overrides,
# task options, seeds). Sized so the default comparison of a family fits its budget on 2 cores
# (lm: 24 runs in <= 15 min; each family <= 20 min); measured wall times and results (2 jobs x 1
# thread, 2-core Xeon): docs/results/README.md (lm 8.3, synthetic 7.5, vision 6.7, anomaly 4.0, segmentation 8.6 min).
CPU_RECIPES: dict[str, dict[str, Any]] = {
    # BPE-1024 Shakespeare, d64 x 2 layers, context 128: 600 steps x 16 x 128 = 1.2M tokens, ~12 tokens per
    # non-embedding parameter, so every run is well past the initial plateau (the scaling sweep's
    # curves flatten after ~5 tokens/param) while 24 runs stay within ~15 min on 2 cores. Characters
    # (the first default) spent the budget learning spelling: every variant was still falling steeply.
    "lm": dict(
        preset="tiny",
        train=dict(max_steps=600, batch_size=16, lr=2e-3, min_lr=2e-4, warmup_steps=30, eval_every=60, eval_batches=8),
        model=dict(context=128),
        task_options=dict(tokenizer="bpe:1024"),
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

# Task families whose module defines the paper's recipe (PAPER_RECIPE + paper_recipe(task, point)).
PAPER_RECIPE_MODULES = {
    "synthetic": "qkvlab.tasks.synthetic",
    "vision": "qkvlab.tasks.vision",
    "anomaly": "qkvlab.tasks.anomaly",
}


def paper_recipe(family: str, task: str, point: dict[str, Any]) -> dict[str, Any]:
    """The paper's recipe for one task at one grid point, in CPU_RECIPES' shape (preset, train, model,
    task_options); the task module's paper_recipe gives the TrainConfig overrides."""
    if family not in PAPER_RECIPE_MODULES:
        allowed = ", ".join(PAPER_RECIPE_MODULES)
        raise UserError(
            f"--recipe paper: no paper recipe for {family!r} (the papers give one for {allowed}); use --recipe cpu"
        )
    module = importlib.import_module(PAPER_RECIPE_MODULES[family])
    cpu = CPU_RECIPES[family]
    overrides = dict(module.paper_recipe(task, {**cpu["model"], "lr": cpu["train"]["lr"], **point}))
    model = overrides.pop("model", {})
    task_options = overrides.pop("task_options", {})
    return dict(preset="tiny", train=overrides, model=model, task_options=task_options)


def recipe_name(requested: str | None, full_grid: bool, family: str) -> str:
    """`requested` (cpu or paper), else the paper's recipe on the paper's grid where one exists."""
    if requested is not None:
        return requested
    return "paper" if full_grid and family in PAPER_RECIPE_MODULES else "cpu"
