"""Write a randomly initialised model as DIR/model.safetensors + DIR/config.json."""

from __future__ import annotations

import torch

from qkvlab.cli import add_config_options, add_model_options, model_config_from_args, print_config
from qkvlab.errors import UserError
from qkvlab.folders import check_model_target
from qkvlab.io import save_model
from qkvlab.limits import check_model
from qkvlab.model import GPT


def add_arguments(p) -> None:
    add_config_options(p, "model config (ModelConfig keys, or a config.json)")
    p.add_argument("--out", required=True, metavar="DIR", help="model folder to write")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights (default 0)")
    p.add_argument("--overwrite", action="store_true", help="replace DIR if it already holds a model")
    add_model_options(p)


def run(args) -> int:
    cfg = model_config_from_args(args)
    if print_config(args, cfg.to_dict()):
        return 0
    if args.seed < 0:
        raise UserError(f"--seed {args.seed} must be >= 0")
    check_model_target(args.out, overwrite=args.overwrite)  # before any work
    check_model(cfg, "--out model")
    torch.manual_seed(args.seed)
    model = GPT(cfg)
    save_model(args.out, model, cfg, meta={"seed": args.seed}, overwrite=args.overwrite)
    print(f"wrote {args.out} ({cfg.spec.name}, {sum(p.numel() for p in model.parameters()):,} params)")
    return 0
