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
import sys
from pathlib import Path

from qkvlab.base.config_file import read_config_file
from qkvlab.base.devices import torchrun_env
from qkvlab.base.errors import UserError
from qkvlab.base.folders import inspect
from qkvlab.base.settings import add_config_options, add_options, load, options_from_args, print_config, resolve
from qkvlab.model.config import DEFAULT_PRESET
from qkvlab.train.config import TrainConfig, TrainRun
from qkvlab.train.loop import TrainingDiverged, train
from qkvlab.train.run_folder import TRAIN_CONFIG


def add_arguments(p) -> None:
    add_config_options(p, "training config")
    add_options(p, TrainRun)
    add_options(p, TrainConfig, title="training options (default: the preset's)", defaults_in_help=False)


def train_config(args, run: TrainRun) -> TrainConfig:
    """The TrainConfig the command line describes: preset -> file -> command line (the lm shortcuts
    --data, --tokenizer, --block-size under --task-option), one `settings.resolve`."""
    if args.config and run.config_path and args.config != run.config_path:
        raise UserError(f"two config files given ({run.config_path} and --config {args.config}); give one")
    path = args.config or run.config_path
    command_line = [{"task_options": run.task_options()}, options_from_args(args, TrainConfig)]
    saved = Path(run.out) / TRAIN_CONFIG if run.out else None
    if run.resume and path is None and run.preset is None and saved is not None and saved.is_file():
        # `qkvlab train --out DIR --resume` alone continues DIR's run with the config it started with
        return resolve(TrainConfig, json.loads(saved.read_text()), *command_line)
    file = read_config_file(path) if path else None
    return resolve(TrainConfig, {"preset": DEFAULT_PRESET}, file, {"preset": run.preset}, *command_line, origin=path)


def run(args) -> int:
    run_opts = load(TrainRun, None, args)
    cfg = train_config(args, run_opts)
    if print_config(args, cfg.to_dict()):
        return 0
    if run_opts.out is None:
        raise UserError("--out DIR is required (the run folder)")
    main_rank = torchrun_env()[0] == 0
    if run_opts.resume and main_rank and inspect(run_opts.out).kind in ("missing", "empty"):
        # a typo in --out would otherwise restart from step 0 unannounced
        print(
            f"qkvlab train: nothing to resume in {run_opts.out} (no run there yet): starting a new run", file=sys.stderr
        )
    try:
        result = train(cfg, run_opts.out, resume=run_opts.resume, progress=not run_opts.quiet)
    except TrainingDiverged as e:
        print(f"qkvlab train: error: {e}", file=sys.stderr)
        return 3
    if main_rank:
        m = result.metrics
        keys = dict.fromkeys(("val_loss", "val_ppl", result.metric))
        score = " ".join(f"{k} {m[k]:.4f}" for k in keys if isinstance(m.get(k), float))
        print(
            f"{cfg.model.attn}: {result.step} steps, {result.tokens:,} tokens, {result.params:,} params, "
            f"{score}, {result.tokens_per_s:,.0f} tokens/s{f' ({result.train_dtype})' if result.train_dtype else ''} -> {run_opts.out}"
        )
    return 0
