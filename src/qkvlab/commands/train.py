"""Train a model: a preset or config file (YAML/TOML/JSON) plus command-line overrides.

  qkvlab train --preset tiny --out runs/tiny
  qkvlab train run.yaml --out runs/a --attn Id-K-V --weight-decay 0.03125
  qkvlab train --out runs/a --resume                 # continue after a crash or kill
  qkvlab train --preset tiny --attn Id-K-V --print-config
  torchrun --nproc-per-node 2 -m qkvlab train --preset small --out runs/ddp

OUT gets metrics.jsonl, checkpoint/, and the final model (OUT is a model folder).
Exit status: 0 done, 2 bad input, 3 the loss became non-finite.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from qkvlab.cli import DEFAULT_PRESET, add_config_options, add_model_options, model_overrides, print_config
from qkvlab.errors import UserError
from qkvlab.settings import add_options, nonempty, options_from_args, parse_key_values, positive_int


def add_arguments(p) -> None:
    p.add_argument(
        "config_path", nargs="?", type=nonempty, metavar="CONFIG", help="training config file (same as --config)"
    )
    add_config_options(p, "training config")
    p.add_argument("--out", type=nonempty, metavar="DIR", help="run folder (metrics, checkpoint, final model)")
    p.add_argument("--resume", action="store_true", help="continue from DIR's last complete checkpoint")
    p.add_argument(
        "--data",
        type=nonempty,
        metavar="SOURCE",
        help="lm corpus: a path, 'shakespeare[:genres]' or 'hf:NAME?split=..'",
    )
    p.add_argument("--tokenizer", type=nonempty, metavar="SPEC", help="lm tokenizer: bpe:N, char or gpt2")
    p.add_argument(
        "--block-size", type=positive_int, metavar="T", help="lm training window (default: the model context)"
    )
    p.add_argument(
        "--task-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any task option (VALUE read as YAML), repeatable",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    from qkvlab.train.config import TrainConfig

    add_options(p, TrainConfig, title="training options (default: the preset's)", defaults_in_help=False)
    add_model_options(p)


def overrides_from_args(args) -> dict:
    from qkvlab.train.config import TrainConfig

    over: dict = options_from_args(args, TrainConfig)
    if args.preset is not None:
        over["preset"] = args.preset
    opts = {k: getattr(args, k) for k in ("data", "tokenizer", "block_size") if getattr(args, k) is not None}
    opts.update(parse_key_values(args.task_option))
    if opts:
        over["task_options"] = opts
    model = model_overrides(args)
    if model:
        over["model"] = model
    return over


def resolve(args):
    """The TrainConfig the command line describes."""
    from qkvlab.train.config import TrainConfig, load_train_config, merge
    from qkvlab.train.loop import TRAIN_CONFIG

    if args.config and args.config_path and args.config != args.config_path:
        raise UserError(f"two config files given ({args.config_path} and --config {args.config}); give one")
    path = args.config or args.config_path
    overrides = overrides_from_args(args)
    saved = Path(args.out) / TRAIN_CONFIG if args.out else None
    if args.resume and path is None and "preset" not in overrides and saved is not None and saved.is_file():
        # `qkvlab train --out DIR --resume` alone continues DIR's run with the config it started with
        return TrainConfig.from_dict(merge(json.loads(saved.read_text()), overrides))
    return load_train_config(path, overrides, default_preset=DEFAULT_PRESET)


def run(args) -> int:
    from qkvlab.train.loop import TrainingDiverged, train

    cfg = resolve(args)
    if print_config(args, cfg.to_dict()):
        return 0
    if args.out is None:
        raise UserError("--out DIR is required (the run folder)")
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
