"""Exact weight conversion (Paper A's theorems) and Hugging Face import/export.

  qkvlab convert IN OUT --to SCHEME [--layer L]   remove W_Q/W_K by a change of basis (or insert it)
  qkvlab convert --from-hf IN OUT                 IN: a transformers folder (safetensors) or a .gguf
  qkvlab convert IN OUT --to-hf gpt2|llama        write a GPT2LMHeadModel / LlamaForCausalLM folder

Steps combine (--from-hf with --to, --to with --to-hf). Every step is checked on random inputs;
the last line printed is max_rel_logit_diff=<value> (max |Δlogit| / max |logit|, worst step).
Exit 0: written and equivalent; 2: refused (the reason on one line); 1: the check failed.
Nothing is written unless every check passed.
"""

from __future__ import annotations

import sys
from dataclasses import asdict
from pathlib import Path

import torch

from qkvlab.convert.config import ConvertConfig
from qkvlab.convert.reparam import TOLERANCE, CheckFailed, check, convert, logit_diff
from qkvlab.devices import torch_dtype
from qkvlab.errors import UserError
from qkvlab.folders import check_model_target
from qkvlab.io import load_model
from qkvlab.settings import add_config_options, add_options, load, print_config


def add_arguments(p) -> None:
    add_config_options(p, "convert settings")
    add_options(p, ConvertConfig)


def _step(name: str, abs_d: float, rel_d: float) -> float:
    print(f"{name}: max_abs_logit_diff={abs_d:.3g} max_rel_logit_diff={rel_d:.3g}")
    return rel_d


def run(args) -> int:
    cfg = load(ConvertConfig, args.config, args)
    if print_config(args, asdict(cfg)):
        return 0
    src = Path(cfg.input)
    if src.resolve() == Path(cfg.output).resolve() and cfg.to_hf:
        raise UserError("OUT must differ from IN when exporting")
    check_model_target(cfg.output, overwrite=cfg.overwrite, flag="OUT")  # before any work
    if cfg.from_hf or cfg.to_hf:
        from qkvlab.convert.hf import quiet

        quiet()
    try:
        return _run(cfg, src)
    except CheckFailed as e:
        print(f"qkvlab convert: check failed: {e}", file=sys.stderr)
        return 1


def _run(opts: ConvertConfig, src: Path) -> int:
    from qkvlab.io import atomic_dir, write_model_files

    worst = 0.0
    if opts.from_hf:
        from qkvlab.convert.hf import from_hf, load_hf

        hf = load_hf(src)
        model, cfg = from_hf(hf)
        abs_d, rel_d = logit_diff(hf, model, cfg.vocab_size, cfg.context)
        if not rel_d <= TOLERANCE[torch.float32]:
            raise CheckFailed(
                f"import differs from transformers: max_rel_logit_diff={rel_d:.3g} > {TOLERANCE[torch.float32]:g}"
            )
        worst = max(worst, _step(f"import {hf.config.model_type} -> {cfg.scheme_label}", abs_d, rel_d))
        del hf
        stored = torch.float32
    else:
        model, cfg, _ = load_model(src)
        stored = model.tok_emb.weight.dtype
    dtype = torch_dtype(opts.dtype) if opts.dtype else stored
    model = model.to(dtype)
    notes: list[str] = []
    if opts.to:
        res = convert(model, cfg, opts.to, layer=opts.layer, max_cond=opts.max_cond, dtype=dtype)
        for note in res.notes:
            print(note)
        notes += res.notes
        abs_d, rel_d = check(model, res.model, dtype, f"{cfg.scheme_label} -> {res.cfg.scheme_label}")
        worst = max(
            worst, _step(f"convert {cfg.scheme_label} -> {res.cfg.scheme_label} ({str(dtype)[6:]})", abs_d, rel_d)
        )
        model, cfg = res.model, res.cfg
    with atomic_dir(opts.output, replace=opts.overwrite) as tmp:
        if opts.to_hf:
            from transformers import AutoModelForCausalLM

            from qkvlab.convert.hf import save_hf, to_hf

            save_hf(to_hf(model, cfg, opts.to_hf), tmp)
            back = AutoModelForCausalLM.from_pretrained(tmp, dtype=dtype, use_safetensors=True).eval()
            abs_d, rel_d = logit_diff(model, back, cfg.vocab_size, cfg.context)
            tol = max(TOLERANCE[dtype], 1e-6 if opts.to_hf == "llama" else 0.0)  # HF computes rotary in float32
            if not rel_d <= tol:
                raise CheckFailed(f"exported {opts.to_hf} checkpoint differs: max_rel_logit_diff={rel_d:.3g} > {tol:g}")
            worst = max(worst, _step(f"export {cfg.scheme_label} -> {type(back).__name__}", abs_d, rel_d))
        else:
            meta = {"converted_from": str(src), "conversion": notes}
            write_model_files(tmp, model, cfg, meta)
            back, _, _ = load_model(tmp)  # what a reader will get, checked before it is published
            abs_d, rel_d = logit_diff(model, back, cfg.vocab_size, cfg.context)
            if not rel_d <= TOLERANCE[dtype]:
                raise CheckFailed(f"the written model differs from the converted one: max_rel_logit_diff={rel_d:.3g}")
    print(f"wrote {opts.output}")
    print(f"max_rel_logit_diff={worst:.3g}")
    return 0
