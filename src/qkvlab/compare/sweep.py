"""The scaling sweep (`qkvlab compare --sweep`): the LM variants at several model sizes, training
tokens proportional to parameters; results are each variant's gap to Q-K-V against size and
compute with intervals and the slope in log N (qkvlab.analysis.scaling; no prediction beyond 10x).

A size is ``d<d_model>-L<n_layer>-h<n_head>[-b<sequences per step>][-s<seeds>]``; sizes are
comma-separated. Per size: the base model is ``ModelConfig(d_model, n_layer, n_head, vocab,
context)`` (plus any model options), N its non-embedding parameter count (qkvlab.model.accounting),
steps = round(tokens_per_param * N / (batch * context)), warm-up max(5, steps / 20), an evaluation
every steps / 10, cosine from lr to lr / 10 with lr = --lr * 64 / d_model (size_lr), weight decay by
variant (2^-5 with an identity role, else 0.1). Runs go to OUT/<d..-L..>/<variant>/seed<k>.

A size may pin its learning rate, ``-lr<value>`` (e.g. ``d128-L2-h4-b16-s2-lr0.001``: that lr at that
size, no 1/width rule). A shape given more than once is a cell of a grid over batch and lr (a factorial,
an lr scan): its folder adds both, OUT/d128-L2-b16-lr0.001/... `--recipe NAME` takes a named sweep
(compare/recipes.py SWEEP_RECIPES) for every setting the command line leaves unset; a recipe with an
lr scan takes each size's lr from the finished scan given by --lr-scan (scan_lrs: Q-K-V's lowest
validation loss). A sweep trains every size in one dtype (execute refuses an `auto` that resolves to two).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import dataclass, replace
from pathlib import Path

from qkvlab.analysis.runs import LR_SCAN_FILE, run_finished
from qkvlab.base.errors import UserError
from qkvlab.base.files import atomic_write
from qkvlab.compare.planning import MAX_SEEDS, Plan, PlannedRun
from qkvlab.compare.recipes import RECIPES, SWEEP_RECIPES
from qkvlab.model.accounting import analytic_params
from qkvlab.model.config import ModelConfig
from qkvlab.model.folder import read_config, read_metrics
from qkvlab.model.variants import parse_variants
from qkvlab.train.config import TrainConfig, default_weight_decay

SWEEP_VARIANTS = ("Q-K-V", "Id-K-V", "Id-K-V/mlp", "Q-K=V", "Q=K-V", "Q=V-K", "Q=K=V", "Q-K=V/MQA")
# 4 widths at depth 2 spanning 19x in non-embedding parameters (55k .. 1.04M, about 2.7x apart), 4
# heads at every size so MQA keeps 1 of 4 kv heads (25% of Q-K=V's cache) throughout; 20 tokens per
# parameter (Chinchilla's ratio); 6 seeds where a run costs seconds, 3 where it costs minutes. Depth
# stays 2 because the cost grows as N^2 (tokens follow N), and the largest size must fit a CPU's budget
# (its measured cost per run: docs/results/scaling/README.md, "Why two variants and depth 2").
SWEEP_SIZES = "d48-L2-h4-b16-s6,d80-L2-h4-b16-s6,d128-L2-h4-b32-s3,d208-L2-h4-b32-s3"
# lr per size: base_lr * (LR_WIDTH / d_model), the 1/width rule of muP-style transfer for Adam's
# hidden matrices, fixed before any run (2e-3 is the CPU LM recipe's lr at d 64).
LR_WIDTH = 64
SWEEP_RECIPE = dict(
    tokens_per_param=20.0, context=128, tokenizer="bpe:1024", vocab_size=1024, lr=2e-3, batch_size=32, seeds=3
)
SWEEP_EVAL = dict(eval_batches=8, eval_batch_size=16)


def size_lr(base_lr: float, d_model: int) -> float:
    """The sweep's learning rate at width d_model (LR_WIDTH's lr is base_lr)."""
    return base_lr * LR_WIDTH / d_model


_NUMBER = r"(?:\d+\.?\d*|\.\d+)(?:[eE]-?\d+)?"
_OPTION = re.compile(rf"-(b|s)(\d+)|-(lr)({_NUMBER})")
_SIZE = re.compile(rf"^d(\d+)-L(\d+)-h(\d+)((?:-[bs]\d+|-lr{_NUMBER})*)$")
SIZE_FORM = "d<d_model>-L<layers>-h<heads>[-b<batch>][-s<seeds>][-lr<lr>], e.g. d64-L2-h4-b16-s2"


@dataclass(frozen=True)
class SweepSize:
    d_model: int
    n_layer: int
    n_head: int
    batch_size: int | None = None  # sequences per step (None: the sweep's default)
    seeds: int | None = None
    lr: float | None = None  # this size's lr (None: the 1/width rule)
    cell: bool = False  # its shape is given more than once: a grid cell, whose folder names batch and lr

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.d_model, self.n_layer, self.n_head)

    @property
    def label(self) -> str:
        """The size's folder: d<d_model>-L<n_layer> (a cell: -b<batch>-lr<lr> added)."""
        base = f"d{self.d_model}-L{self.n_layer}"
        return f"{base}-b{self.batch_size}-lr{self.lr:g}" if self.cell else base


def parse_sizes(text: str) -> list[SweepSize]:
    out: list[SweepSize] = []
    for item in (t.strip() for t in text.split(",")):
        m = _SIZE.match(item)
        if not item or not m:
            raise UserError(f"sweep size {item!r} is not {SIZE_FORM}")
        opts: dict[str, float] = {}
        for o in _OPTION.finditer(m.group(4)):
            key, value = (o.group(1), int(o.group(2))) if o.group(1) else (o.group(3), float(o.group(4)))
            if key in opts:
                raise UserError(f"sweep size {item!r}: -{key} given twice")
            opts[key] = value
        lr = opts.get("lr")
        size = SweepSize(int(m.group(1)), int(m.group(2)), int(m.group(3)), opts.get("b"), opts.get("s"), lr)
        if min(size.d_model, size.n_layer, size.n_head, size.batch_size or 1, size.seeds or 1) < 1:
            raise UserError(f"sweep size {item!r}: every number must be positive")
        if lr is not None and not (math.isfinite(lr) and lr > 0):
            raise UserError(f"sweep size {item!r}: lr {lr:g} must be positive")
        if (size.seeds or 1) > MAX_SEEDS:
            raise UserError(f"sweep size {item!r}: {size.seeds} seeds; at most {MAX_SEEDS:,}")
        out.append(size)
    shapes = [s.shape for s in out]
    out = [replace(s, cell=shapes.count(s.shape) > 1) for s in out]
    seen: dict[str, SweepSize] = {}
    for s in out:
        if s.cell and (s.batch_size is None or s.lr is None):
            raise UserError(
                f"sweep sizes {text!r}: d{s.d_model}-L{s.n_layer} is given more than once, so each is a cell of a "
                "grid and must pin -b<batch> and -lr<lr>"
            )
        if s.label in seen:
            raise UserError(f"sweep sizes {text!r}: {s.label} appears twice (a size's folder is d..-L..)")
        seen[s.label] = s
    if len(out) < 2:
        raise UserError(f"sweep sizes {text!r}: a slope needs at least 2 sizes (or cells)")
    return out


def sweep_recipe(name: str | None) -> dict:
    """The named sweep recipe's settings ({} for none); a task grid's recipe name is refused."""
    if name is None:
        return {}
    if name not in SWEEP_RECIPES:
        raise UserError(
            f"--recipe {name} is a task grid's recipe; a sweep takes one of {', '.join(SWEEP_RECIPES)}"
            if name in RECIPES
            else f"unknown sweep recipe {name!r}; allowed: {', '.join(SWEEP_RECIPES)}"
        )
    return SWEEP_RECIPES[name]


def apply_recipe(cfg):
    """cfg with the named sweep recipe filling what the command line left unset (dtype and device:
    their `auto`), and the recipe's extra keys (first_seed, lr_scan)."""
    recipe = sweep_recipe(cfg.recipe)
    fill = {}
    for key in ("sizes", "variants", "data", "tokenizer", "tokens_per_param"):
        if key in recipe and getattr(cfg, key) is None:
            fill[key] = recipe[key]
    for key in ("dtype", "device"):
        if key in recipe and getattr(cfg, key) == "auto":
            fill[key] = recipe[key]
    return dataclasses.replace(cfg, **fill), recipe


def scan_lrs(scan_dirs: str | Path) -> dict[tuple[int, int, int], dict]:
    """The lr scan's choice per shape (d_model, n_layer, n_head): the lr of the finished Q-K-V run with
    the lowest final validation loss (the fixed validation windows; the test split is never looked
    at), with every lr tried and its loss, and whether the choice lies at the edge of the grid.
    `scan_dirs`: one scan's folder, or several separated by commas (a grid extended by a later scan,
    e.g. lr-scan-up-L4 above lr-scan-L4: every lr tried in any of them competes)."""
    tried: dict[tuple[int, int, int], dict[float, float]] = {}
    for scan_dir in scan_folders(scan_dirs):
        for shape, losses in _scan_losses(scan_dir).items():
            tried.setdefault(shape, {}).update(losses)
    out = {}
    for shape, losses in tried.items():
        best = min(losses, key=losses.get)
        out[shape] = {"lr": best, "tried": dict(sorted(losses.items())), "edge": best in (min(losses), max(losses))}
    return out


def scan_folders(scan_dirs: str | Path) -> list[Path]:
    """--lr-scan's folders: one, or several separated by commas (the first is the registered grid)."""
    return [Path(d.strip()) for d in str(scan_dirs).split(",")]


def _scan_losses(root: Path) -> dict[tuple[int, int, int], dict[float, float]]:
    """{shape: {lr: final validation loss}} of one scan's finished Q-K-V runs: the scan's lr_scan.json (a
    committed scan, whose runs may be gone) with every finished run folder on disk over it, so a scan that
    stopped with its machine and resumed from its committed folder counts the runs of both sessions."""
    if not root.is_dir():
        raise UserError(f"--lr-scan {root}: no such folder (run the scan's recipe first)")
    tried: dict[tuple[int, int, int], dict[float, float]] = {}
    if (root / LR_SCAN_FILE).is_file():
        tried = {shape: c["tried"] for shape, c in read_scan_choice(root / LR_SCAN_FILE).items()}
    for metrics in sorted(root.glob("*/Q-K-V/*/metrics.jsonl")):
        d = metrics.parent
        if not run_finished(d):
            continue
        cfg, body = read_config(d)
        rows = [r for r in read_metrics(d) if r.get("val_loss") is not None]
        lr = ((body.get("train") or {}).get("config") or {}).get("lr")
        if rows and lr is not None:
            tried.setdefault((cfg.d_model, cfg.n_layer, cfg.n_head), {})[float(lr)] = float(rows[-1]["val_loss"])
    return tried


def write_scan_choice(out: str | Path) -> Path | None:
    """OUT/lr_scan.json: scan_lrs of a sweep that tried more than one lr at some shape (a scan), else nothing."""
    chosen = scan_lrs(out)
    if not any(len(c["tried"]) > 1 for c in chosen.values()):
        return None
    body = {
        "d{}-L{}-h{}".format(*shape): {  # the size notation (SIZE_FORM) without options
            "lr": c["lr"],
            "tried": {f"{lr:g}": loss for lr, loss in c["tried"].items()},
            "edge": c["edge"],
        }
        for shape, c in sorted(chosen.items())
    }
    path = Path(out) / LR_SCAN_FILE
    atomic_write(path, json.dumps(body, indent=1) + "\n")
    return path


def read_scan_choice(path: str | Path) -> dict[tuple[int, int, int], dict]:
    """What write_scan_choice wrote, back as scan_lrs returns it."""
    try:
        body = json.loads(Path(path).read_text())
        out = {}
        for key, c in body.items():
            m = _SIZE.match(key)  # the size notation, options left out
            if m is None or m.group(4):
                raise ValueError(f"shape {key!r}")
            shape = (int(m[1]), int(m[2]), int(m[3]))
            out[shape] = {
                "lr": float(c["lr"]),
                "tried": {float(lr): float(loss) for lr, loss in c["tried"].items()},
                "edge": bool(c["edge"]),
            }
        return out
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise UserError(f"{path}: not an lr scan's choice ({e})") from None


def _scan_lr(size: SweepSize, chosen: dict, scan: str, recipe_name: str) -> float:
    found = chosen.get(size.shape)
    if found is None:
        raise UserError(
            f"--lr-scan {scan} has no finished Q-K-V run at d{size.d_model}-L{size.n_layer}-h{size.n_head}; "
            f"finish `qkvlab compare --sweep --recipe {SWEEP_RECIPES[recipe_name]['lr_scan']} --out {scan}` first"
        )
    return found["lr"]


def _moved_sizes(sizes: list[SweepSize], scan_dirs: str, recipe: dict) -> list[SweepSize]:
    """next-up: the sizes whose lr the extended grid (every folder after the first) moved away from the first
    scan's choice, which is the registered sweep's; the others would train the same runs again."""
    dirs = scan_folders(scan_dirs)
    if len(dirs) < 2:
        raise UserError(
            f"--lr-scan {scan_dirs}: this recipe reruns the sizes whose lr the extended grid moved; give both "
            f"scans, e.g. --lr-scan runs/{recipe['lr_scan']},runs/{recipe['lr_scan_up']}"
        )
    first = scan_lrs(dirs[0])
    moved = [s for s in sizes if s.shape in first and s.lr != first[s.shape]["lr"]]
    if not moved:
        raise UserError(
            f"--lr-scan {scan_dirs}: no size's lr moved from {dirs[0]}'s choice, so nothing trains again "
            "(the registered sweep stands)"
        )
    return moved


def _check_sweep_settings(cfg) -> None:
    """Settings a sweep decides itself are refused with the reason."""
    for key, flag in (("max_steps", "--steps"), ("preset", "--preset"), ("full_grid", "--full-grid")):
        if getattr(cfg, key):
            raise UserError(f"{flag} does not apply to --sweep: steps follow from --tokens-per-param and each size")
    shape = [k for k in ("d_model", "n_layer", "n_head") if k in cfg.model]
    if shape:
        raise UserError(f"--{shape[0].replace('_', '-')} does not apply to --sweep: --sizes sets each size's shape")
    if cfg.task != "lm":
        raise UserError(f"--sweep trains language models; --task {cfg.task!r} is not lm")


def plan_sweep(cfg):
    """The sweep's Plan: one TrainConfig per (size, variant, seed)."""
    _check_sweep_settings(cfg)
    cfg, recipe = apply_recipe(cfg)
    sizes, chosen = _sizes_with_lrs(cfg, recipe)
    if any(s.lr is not None for s in sizes) and cfg.lr is not None:
        raise UserError("--lr sets the 1/width rule's base lr, and these sizes pin their own (-lr..)")
    if any(s.cell for s in sizes) and cfg.batch_size is not None:
        raise UserError("--batch-size would override the batch of each cell of this grid (-b..); drop it")
    variants = parse_variants(cfg.variants if cfg.variants is not None else list(SWEEP_VARIANTS))
    tpp = cfg.tokens_per_param if cfg.tokens_per_param is not None else SWEEP_RECIPE["tokens_per_param"]
    if tpp <= 0:
        raise UserError(f"--tokens-per-param {tpp} must be positive")
    out = Path(cfg.out or "runs/sweep")
    runs: list[PlannedRun] = []
    grid = []
    for size in sizes:
        size_runs, point = _size_runs(cfg, size, variants, tpp, recipe.get("first_seed", 0), out)
        runs += size_runs
        if cfg.lr_scan and size.shape in chosen:
            point["lr_scan"] = {"dir": str(cfg.lr_scan), **chosen[size.shape]}
        grid.append(point)
    return Plan(cfg, runs, "lm", ["lm"], variants, sorted({r.seed for r in runs}), grid, out)


def _sizes_with_lrs(cfg, recipe: dict) -> tuple[list[SweepSize], dict]:
    """The sweep's sizes, each with the lr its recipe's scan chose where the recipe takes one (next-up:
    only the sizes whose lr the extended grid moved), and the scan's choices by shape."""
    sizes = parse_sizes(cfg.sizes or SWEEP_SIZES)
    if cfg.lr_scan is not None and "lr_scan" not in recipe:
        raise UserError(
            "--lr-scan goes with a sweep recipe that takes its lr from a scan (--recipe next-L2/L4, next-up-L2/L4)"
        )
    if "lr_scan" not in recipe:
        return sizes, {}
    if cfg.lr_scan is None:
        raise UserError(
            f"--recipe {cfg.recipe} takes each size's lr from its lr scan: run `qkvlab compare --sweep "
            f"--recipe {recipe['lr_scan']} --out runs/{recipe['lr_scan']}`, then add --lr-scan runs/{recipe['lr_scan']}"
        )
    chosen = scan_lrs(cfg.lr_scan)
    sizes = [s if s.lr is not None else replace(s, lr=_scan_lr(s, chosen, cfg.lr_scan, cfg.recipe)) for s in sizes]
    if "lr_scan_up" in recipe:
        sizes = _moved_sizes(sizes, cfg.lr_scan, recipe)
    return sizes, chosen


def _size_runs(cfg, size: SweepSize, variants, tpp: float, first_seed: int, out: Path) -> tuple[list, dict]:
    """One size's runs (every variant x seed) and its grid entry for compare.json."""
    r = SWEEP_RECIPE
    fields = {"vocab_size": r["vocab_size"], "context": r["context"], **cfg.model}
    base = ModelConfig(d_model=size.d_model, n_layer=size.n_layer, n_head=size.n_head, **fields).validate()
    batch = cfg.batch_size or size.batch_size or r["batch_size"]
    steps = max(1, round(tpp * analytic_params(base).non_embedding / (batch * base.context)))
    rate = size.lr if size.lr is not None else size_lr(cfg.lr if cfg.lr is not None else r["lr"], size.d_model)
    task_options = {"tokenizer": cfg.tokenizer or r["tokenizer"], **({"data": cfg.data} if cfg.data else {})}
    task_options.update(cfg.task_options)
    runs = []
    for v in variants:
        model = v.apply(base)
        for seed in range(first_seed, first_seed + (cfg.seeds or size.seeds or r["seeds"])):
            train_cfg = TrainConfig.from_dict(
                dict(
                    task="lm",
                    task_options=dict(task_options),
                    model=model,
                    seed=seed,
                    max_steps=steps,
                    batch_size=batch,
                    lr=rate,
                    min_lr=rate / 10,
                    warmup_steps=max(5, steps // 20),
                    weight_decay=default_weight_decay(model),
                    eval_every=cfg.eval_every or max(1, steps // 10),
                    log_tensorboard=False,
                    device=cfg.device,
                    dtype=cfg.dtype,
                    **SWEEP_EVAL,
                )
            )
            run = PlannedRun("lm", v, seed, size.label, train_cfg, out, task_folder=False)
            run.dir = out / run.rel
            runs.append(run)
    point = {"label": size.label, "d_model": size.d_model, "n_layer": size.n_layer, "n_head": size.n_head}
    return runs, point | {"batch_size": batch, "steps": steps, "lr": rate}
