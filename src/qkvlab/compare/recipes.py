"""The comparison recipes: default variants, the CPU-sized recipe per task family, the papers'
grids, and the scaling sweep's named recipes (SWEEP_RECIPES). Measured wall times and results:
docs/results/README.md; the sweep's plan: docs/results/scaling/README.md."""

from __future__ import annotations

import importlib
from typing import Any

from qkvlab.base.errors import UserError

RECIPES = ("cpu", "paper")  # a task grid's recipes; a sweep's are SWEEP_RECIPES (below), by the same --recipe

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
# task options, seeds). Sized so the default comparison of a family fits a short budget on 2 cores;
# the measured wall times and results: docs/results/README.md.
CPU_RECIPES: dict[str, dict[str, Any]] = {
    # BPE-1024 Shakespeare, d64 x 2 layers, context 128: 600 steps x 16 x 128 = 1.2M tokens, ~12 tokens per
    # non-embedding parameter, so every run is well past the initial plateau (the scaling sweep's
    # curves flatten after ~5 tokens/param) while 24 runs stay within the budget on 2 cores. Characters
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
    # 64 patches per canvas make a step dearer than a vision step, hence 2 seeds; mIoU still climbs at 600 steps
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


# ---- quality per cache byte, from scratch (`qkvlab compare --config docs/results/lm-cache/recipe.yaml`) ----
# Every route to a smaller KV cache at equal bytes per token beside Q-K-V: the LM CPU recipe's model (d 64,
# 4 heads of 16, 2 layers, context 128, BPE-1024 Shakespeare) made Llama-like, because MLA needs RoPE (its
# decoupled key) and the models MLA, GQA and the retrofits serve are Llama-family: RoPE for every variant,
# RMSNorm, SwiGLU at 8/3 d (Llama's width rule: the GELU MLP's parameter count). Q-K-V caches 2 x 4 x 16 =
# 128 numbers per token and layer; each route's variant at 50% and 25% of it (exact: tests/test_recipes.py).
# MLA keeps DeepSeek-V2's rotated width d_head / 2 = 8 (d_h^R = d_h / 2) and gives the rest of the budget
# to the latent. 900 steps x 16 x 128 = 0.97 epoch of the training split (no text seen twice); 5 seeds
# from the seed spread of the committed LM runs. Why these numbers, and the time they take: the folder's
# README. The claims it decides were registered before its runs (analysis version 6, paper_claims: cache-*).
CACHE_FRACTIONS = (0.5, 0.25)
CACHE_ROUTES = {  # route -> its variant at each of CACHE_FRACTIONS
    "K=V": ("Q-K=V", "Q-K=V/GQA-2"),
    "GQA/MQA": ("Q-K-V/GQA-2", "Q-K-V/MQA"),
    "latent": ("Q-K-V/latent=64", "Q-K-V/latent=32"),
    "MLA": ("Q-K-V/latent=56/rope=8", "Q-K-V/latent=24/rope=8"),
}
LM_CACHE_RECIPE: dict[str, Any] = dict(  # CompareConfig settings; the folder's recipe.yaml spells the same
    task="lm",
    variants=",".join(("Q-K-V", *(route[i] for i in range(len(CACHE_FRACTIONS)) for route in CACHE_ROUTES.values()))),
    seeds=5,
    max_steps=900,
    dtype="fp32",
    model=dict(pos="rope", norm="rmsnorm", mlp="swiglu", mlp_hidden=172),
)


# ---- the scaling sweep's named recipes (`qkvlab compare --sweep --recipe NAME`) ---------------------
# Fixed before any of their runs; docs/results/scaling/README.md, "next sweep", gives their
# sizes, tokens, epochs and estimated times. Each recipe fills the CompareConfig settings the command
# line leaves unset (sizes, variants, data, tokenizer, tokens per parameter, dtype, device), plus three
# keys no flag spells: first_seed (a scan's seeds never coincide with the sweep's, so the run an lr is
# chosen on is not a run that is scored), lr_scan (the recipe whose runs choose each size's lr) and
# lr_scan_up (next-up: the recipe that extended that grid; only the sizes whose choice it moved train).
#
# The corpus: the Linux 6.12 sources from Debian's linux-source-6.12 (scripts/setup_sweep_corpus.sh),
# 280 MB of text, about 155M BPE-1024 tokens (1.80 characters a token on a 20 MB sample), the held-out
# tail 0.15% of the stream (test half ~116k tokens, ~900 windows of 128): every size below, CPU and GPU
# (the largest, 7.1M x 20 = 142M tokens), sees its training text less than once. 280 MB is also what
# fits the GPU lease's 64 MiB working tree as xz (~48 MiB, benchmarks/gpu_sweep.py).
SWEEP_CORPUS = "data/sweep/prepared-linux-6.12-bpe1024"
SWEEP_CORPUS_PREPARE = dict(tokenizer="bpe:1024", split="stream", val_fraction=0.0015)
SWEEP_CORPUS_MB = 280
# Depth 2 and depth 4 at matched N: the depth-4 width is the depth-2 width / sqrt(2) rounded to a
# multiple of the 4 heads (N within 1-13% of its depth-2 partner), so the arms differ in depth, not size.
CPU_WIDTHS = {2: (48, 80, 128, 208), 4: (36, 56, 92, 148)}
# The GPU's depth-4 arm stops at 2.8M: a 7.1M pair of blocks would not fit the lease (benchmarks/gpu_sweep.py).
GPU_WIDTHS = {2: (128, 208, 336, 544), 4: (92, 148, 240)}
SWEEP_BATCH = 16  # sequences of 128, every CPU size (the old sweep doubled it from d128 on: a confound)
GPU_BATCH = 128  # 16k tokens a step, every GPU size: at 2k tokens a step an H200 waits on kernel launches
SWEEP_SEEDS = 4
# The lr scan, per size: Q-K-V alone at 0.5x, 1x and 2x the 1/width rule (2e-3 * 64 / d), one seed
# (100, outside the sweep's 0..3), the full token budget. The rule that reads it (sweep.scan_lrs): each
# size trains both variants at the lr whose Q-K-V run ended with the lowest validation loss (the fixed
# validation windows, never the test split). One lr for both variants, as the papers ran every variant
# on the baseline's recipe: the two runs of a seed stay paired (same lr, schedule, data order), and the
# gap is Q-K=V's cost at Q-K-V's tuned lr; a per-variant best would select on the very difference tested.
LR_SCAN_FACTORS = (0.5, 1.0, 2.0)
LR_SCAN_SEED = 100
# The grid extended upward, decided AFTER the scans above (and next-L2) had run: every
# depth-4 size and three of four depth-2 sizes chose 2x, the grid's top (docs/results/scaling/README.md,
# "the lr grid's edge"). Same sizes, seed and budget, Q-K-V at 4x and 8x; `--lr-scan A,B` lets both
# scans' lrs compete. The sweeps scored with the first grid stay the registered result.
LR_SCAN_UP_FACTORS = (4.0, 8.0)
# The GPU's lr is fixed now (no time to scan there): the CPU rule scaled by sqrt(batch ratio), Adam's
# square-root rule for an 8x larger batch.
GPU_LR_SCALE = (GPU_BATCH / SWEEP_BATCH) ** 0.5


def rule_lr(d_model: int, scale: float = 1.0) -> float:
    """The 1/width rule (compare/sweep.py size_lr at base 2e-3), times scale, to 3 significant digits."""
    return float(f"{2e-3 * 64 / d_model * scale:.3g}")


def _sizes(widths, depth: int, batch: int, seeds: int, lrs=(None,)) -> str:
    return ",".join(
        f"d{d}-L{depth}-h4-b{batch}-s{seeds}" + (f"-lr{rule_lr(d, f):g}" if f is not None else "")
        for d in widths
        for f in lrs
    )


_SWEEP_COMMON = dict(tokens_per_param=20.0, tokenizer="bpe:1024", data=SWEEP_CORPUS)
SWEEP_RECIPES: dict[str, dict[str, Any]] = {
    # First: which confound made the old sweep's d128 peak, on the peak's own data (Shakespeare, BPE-1024,
    # fp32 as it ran). Cell b32-lr0.001 is the old d128 recipe (seeds 0-1 reproduce its runs); b16 is the
    # batch of the sizes below it, lr 2e-3 the rule's lr at d64.
    "factorial-d128": dict(
        sizes=",".join(f"d128-L2-h4-b{b}-s2-lr{lr:g}" for b in (16, 32) for lr in (1e-3, 2e-3)),
        variants="Q-K-V,Q-K=V",
        tokens_per_param=20.0,
        tokenizer="bpe:1024",
        dtype="fp32",
    ),
    **{
        f"{name}-L{L}": dict(
            sizes=_sizes(CPU_WIDTHS[L], L, SWEEP_BATCH, 1, factors),
            variants="Q-K-V",
            first_seed=LR_SCAN_SEED,
            dtype="fp32",
            **_SWEEP_COMMON,
        )
        for name, factors in (("lr-scan", LR_SCAN_FACTORS), ("lr-scan-up", LR_SCAN_UP_FACTORS))
        for L in (2, 4)
    },
    **{
        f"next-L{L}": dict(
            sizes=_sizes(CPU_WIDTHS[L], L, SWEEP_BATCH, SWEEP_SEEDS),
            variants="Q-K-V,Q-K=V",
            lr_scan=f"lr-scan-L{L}",
            dtype="fp32",  # one dtype at every size (`auto` may pick per shape); why fp32: docs/results/scaling
            **_SWEEP_COMMON,
        )
        for L in (2, 4)
    },
    # The rule recorded with LR_SCAN_UP_FACTORS: where the union of both grids moves a size's lr, that size's
    # pair (the same 4 seeds, both variants) trains again at the new lr, reported beside next-L2/L4.
    **{
        f"next-up-L{L}": dict(
            sizes=_sizes(CPU_WIDTHS[L], L, SWEEP_BATCH, SWEEP_SEEDS),
            variants="Q-K-V,Q-K=V",
            lr_scan=f"lr-scan-L{L}",
            lr_scan_up=f"lr-scan-up-L{L}",
            dtype="fp32",
            **_SWEEP_COMMON,
        )
        for L in (2, 4)
    },
    **{
        f"gpu-L{L}": dict(
            sizes=_sizes(GPU_WIDTHS[L], L, GPU_BATCH, SWEEP_SEEDS, (GPU_LR_SCALE,)),
            variants="Q-K-V,Q-K=V",
            dtype="bf16",
            device="cuda",
            **_SWEEP_COMMON,
        )
        for L in (2, 4)
    },
}
