"""The scaling sweep (`qkvlab compare --sweep`): the LM variants at several model sizes, training
tokens proportional to parameters; results are each variant's gap to Q-K-V against size and
compute with intervals and the slope in log N (qkvlab.analysis.scaling; no prediction beyond 10x).

A size is ``d<d_model>-L<n_layer>-h<n_head>[-b<sequences per step>][-s<seeds>]``; sizes are
comma-separated. Per size: the base model is ``ModelConfig(d_model, n_layer, n_head, vocab,
context)`` (plus any model options), N its non-embedding parameter count (qkvlab.accounting),
steps = round(tokens_per_param * N / (batch * context)), warm-up max(5, steps / 20), an evaluation
every steps / 10, cosine from lr to lr / 10 with lr = --lr * 64 / d_model (size_lr), weight decay by
variant (2^-5 with an identity role, else 0.1). Runs go to OUT/<d..-L..>/<variant>/seed<k>.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from qkvlab.accounting import analytic_params
from qkvlab.compare.planning import MAX_SEEDS, Plan, PlannedRun
from qkvlab.config import ModelConfig
from qkvlab.errors import UserError
from qkvlab.train.config import TrainConfig, default_weight_decay
from qkvlab.variants import parse_variants

SWEEP_VARIANTS = ("Q-K-V", "Id-K-V", "Id-K-V/mlp", "Q-K=V", "Q=K-V", "Q=V-K", "Q=K=V", "Q-K=V/MQA")
# 4 widths at depth 2 spanning 19x in non-embedding parameters (55k .. 1.04M, about 2.7x apart), 4
# heads at every size so MQA keeps 1 of 4 kv heads (25% of Q-K=V's cache) throughout; 20 tokens per
# parameter (Chinchilla's ratio); 6 seeds where a run costs seconds, 3 where it costs minutes. Depth
# stays 2 because the cost grows as N^2 (tokens follow N): the largest size is ~21 min per run on one
# CPU core (measured under bf16 autocast, which the old `auto` rule chose there), the 8 variants about 6 h of 2 cores.
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


_SIZE = re.compile(r"^d(\d+)-L(\d+)-h(\d+)((?:-[bs]\d+)*)$")


@dataclass(frozen=True)
class SweepSize:
    d_model: int
    n_layer: int
    n_head: int
    batch_size: int | None = None  # sequences per step (None: the sweep's default)
    seeds: int | None = None

    @property
    def label(self) -> str:
        """The size's folder: d<d_model>-L<n_layer>."""
        return f"d{self.d_model}-L{self.n_layer}"


def parse_sizes(text: str) -> list[SweepSize]:
    out: list[SweepSize] = []
    for item in (t.strip() for t in text.split(",")):
        m = _SIZE.match(item)
        if not item or not m:
            raise UserError(
                f"sweep size {item!r} is not d<d_model>-L<layers>-h<heads>[-b<batch>][-s<seeds>], e.g. d64-L2-h4-b16-s2"
            )
        opts = dict((o[0], int(o[1:])) for o in m.group(4).split("-")[1:])
        size = SweepSize(int(m.group(1)), int(m.group(2)), int(m.group(3)), opts.get("b"), opts.get("s"))
        if min(size.d_model, size.n_layer, size.n_head, size.batch_size or 1, size.seeds or 1) < 1:
            raise UserError(f"sweep size {item!r}: every number must be positive")
        if (size.seeds or 1) > MAX_SEEDS:
            raise UserError(f"sweep size {item!r}: {size.seeds} seeds; at most {MAX_SEEDS:,}")
        if any(s.label == size.label for s in out):
            raise UserError(f"sweep sizes {text!r}: {size.label} appears twice (a size's folder is d..-L..)")
        out.append(size)
    if len(out) < 2:
        raise UserError(f"sweep sizes {text!r}: a slope needs at least 2 sizes")
    return out


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
    r = SWEEP_RECIPE
    sizes = parse_sizes(cfg.sizes or SWEEP_SIZES)
    variants = parse_variants(cfg.variants if cfg.variants is not None else list(SWEEP_VARIANTS))
    tpp = cfg.tokens_per_param if cfg.tokens_per_param is not None else r["tokens_per_param"]
    if tpp <= 0:
        raise UserError(f"--tokens-per-param {tpp} must be positive")
    lr = cfg.lr if cfg.lr is not None else r["lr"]
    task_options = {"tokenizer": cfg.tokenizer or r["tokenizer"], **({"data": cfg.data} if cfg.data else {})}
    task_options.update(cfg.task_options)
    out = Path(cfg.out or "runs/sweep")
    runs: list[PlannedRun] = []
    per_size = []
    for size in sizes:
        fields = {"vocab_size": r["vocab_size"], "context": r["context"], **cfg.model}
        base = ModelConfig(d_model=size.d_model, n_layer=size.n_layer, n_head=size.n_head, **fields).validate()
        n = analytic_params(base).non_embedding
        batch = cfg.batch_size or size.batch_size or r["batch_size"]
        steps = max(1, round(tpp * n / (batch * base.context)))
        seeds = cfg.seeds or size.seeds or r["seeds"]
        size_rate = size_lr(lr, size.d_model)
        per_size.append((batch, steps))
        for v in variants:
            model = v.apply(base)
            for seed in range(seeds):
                train_cfg = TrainConfig.from_dict(
                    dict(
                        task="lm",
                        task_options=dict(task_options),
                        model=model,
                        seed=seed,
                        max_steps=steps,
                        batch_size=batch,
                        lr=size_rate,
                        min_lr=size_rate / 10,
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
    seeds_all = sorted({r.seed for r in runs})
    grid = [
        {"label": s.label, "d_model": s.d_model, "n_layer": s.n_layer, "n_head": s.n_head, "batch_size": b, "steps": k}
        for s, (b, k) in zip(sizes, per_size)
    ]
    return Plan(cfg, runs, "lm", ["lm"], variants, seeds_all, grid, out)
