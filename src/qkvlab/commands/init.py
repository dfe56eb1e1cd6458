"""Write a randomly initialised model as DIR/model.safetensors + DIR/config.json.
The settings: InitConfig (qkvlab/model/config.py); `--config FILE`: a model config (ModelConfig keys,
or a config.json)."""

from __future__ import annotations

import torch

from qkvlab.base.folders import check_model_target
from qkvlab.base.settings import add_config_options, add_options, load, print_config, resolve
from qkvlab.model.config import DEFAULT_PRESET, InitConfig, ModelConfig, model_file_settings
from qkvlab.model.folder import save_model
from qkvlab.model.limits import check_model
from qkvlab.model.transformer import GPT


def add_arguments(p) -> None:
    add_config_options(p, "model config (ModelConfig keys, or a config.json)")
    add_options(p, InitConfig)


def run(args) -> int:
    opts = load(InitConfig, None, args)
    saved = model_file_settings(args.config) if args.config else None
    cfg = resolve(
        ModelConfig, saved if saved is not None else {"preset": DEFAULT_PRESET}, {"preset": opts.preset, **opts.model}
    )
    if print_config(args, cfg.to_dict()):
        return 0
    check_model_target(opts.out, overwrite=opts.overwrite)  # before any work
    check_model(cfg, "--out model")
    torch.manual_seed(opts.seed)
    model = GPT(cfg)
    save_model(opts.out, model, cfg, meta={"seed": opts.seed}, overwrite=opts.overwrite)
    print(f"wrote {opts.out} ({cfg.spec.name}, {sum(p.numel() for p in model.parameters()):,} params)")
    return 0
