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
from pathlib import Path

import torch

from qkvlab.convert.reparam import DEFAULT_MAX_COND, TOLERANCE, CheckFailed, check, convert, logit_diff
from qkvlab.devices import EXACT_DTYPES, dtype_choices, torch_dtype
from qkvlab.errors import UserError
from qkvlab.folders import check_model_target
from qkvlab.io import load_model


def add_arguments(p) -> None:
    p.add_argument(
        "input", metavar="IN", help="qkvlab model folder (or, with --from-hf, a transformers folder or .gguf)"
    )
    p.add_argument("output", metavar="OUT", help="folder to write (a new or empty one, or a model with --overwrite)")
    p.add_argument("--overwrite", action="store_true", help="replace OUT if it already holds a model")
    p.add_argument(
        "--to", metavar="SCHEME", help="target scheme, e.g. Id-K-V (remove W_Q), Q-Id-V (remove W_K), Q-K-V (insert)"
    )
    p.add_argument("--layer", type=int, metavar="L", help="remove the projection of layer L only (theorem a)")
    p.add_argument("--from-hf", action="store_true", help="IN is a Hugging Face GPT-2/Llama folder or a .gguf file")
    p.add_argument("--to-hf", choices=["gpt2", "llama"], help="write a transformers checkpoint of this class")
    p.add_argument(
        "--dtype",
        choices=dtype_choices(EXACT_DTYPES, auto=False),
        help="dtype of the result (default: the input's, fp32 or fp64)",
    )
    p.add_argument(
        "--max-cond",
        type=float,
        default=DEFAULT_MAX_COND,
        metavar="X",
        help=f"refuse a W_Q/W_K whose condition number exceeds X (default {DEFAULT_MAX_COND:g})",
    )


def _step(name: str, abs_d: float, rel_d: float) -> float:
    print(f"{name}: max_abs_logit_diff={abs_d:.3g} max_rel_logit_diff={rel_d:.3g}")
    return rel_d


def run(args) -> int:
    if not (args.to or args.from_hf or args.to_hf):
        raise UserError("nothing to do: give --to SCHEME, --from-hf or --to-hf gpt2|llama")
    if args.layer is not None and not args.to:
        raise UserError("--layer needs --to SCHEME")
    if not args.max_cond > 0:
        raise UserError(f"--max-cond {args.max_cond} must be positive")
    src = Path(args.input)
    if src.resolve() == Path(args.output).resolve() and args.to_hf:
        raise UserError("OUT must differ from IN when exporting")
    check_model_target(args.output, overwrite=args.overwrite, flag="OUT")  # before any work
    if args.from_hf or args.to_hf:
        from qkvlab.convert.hf import quiet

        quiet()
    try:
        return _run(args, src)
    except CheckFailed as e:
        print(f"qkvlab convert: check failed: {e}", file=sys.stderr)
        return 1


def _run(args, src: Path) -> int:
    from qkvlab.io import atomic_dir, write_model_files

    worst = 0.0
    if args.from_hf:
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
    dtype = torch_dtype(args.dtype) if args.dtype else stored
    model = model.to(dtype)
    notes: list[str] = []
    if args.to:
        res = convert(model, cfg, args.to, layer=args.layer, max_cond=args.max_cond, dtype=dtype)
        for note in res.notes:
            print(note)
        notes += res.notes
        abs_d, rel_d = check(model, res.model, dtype, f"{cfg.scheme_label} -> {res.cfg.scheme_label}")
        worst = max(
            worst, _step(f"convert {cfg.scheme_label} -> {res.cfg.scheme_label} ({str(dtype)[6:]})", abs_d, rel_d)
        )
        model, cfg = res.model, res.cfg
    with atomic_dir(args.output, replace=args.overwrite) as tmp:
        if args.to_hf:
            from transformers import AutoModelForCausalLM

            from qkvlab.convert.hf import save_hf, to_hf

            save_hf(to_hf(model, cfg, args.to_hf), tmp)
            back = AutoModelForCausalLM.from_pretrained(tmp, dtype=dtype, use_safetensors=True).eval()
            abs_d, rel_d = logit_diff(model, back, cfg.vocab_size, cfg.context)
            tol = max(TOLERANCE[dtype], 1e-6 if args.to_hf == "llama" else 0.0)  # HF computes rotary in float32
            if not rel_d <= tol:
                raise CheckFailed(f"exported {args.to_hf} checkpoint differs: max_rel_logit_diff={rel_d:.3g} > {tol:g}")
            worst = max(worst, _step(f"export {cfg.scheme_label} -> {type(back).__name__}", abs_d, rel_d))
        else:
            meta = {"converted_from": str(src), "conversion": notes}
            write_model_files(tmp, model, cfg, meta)
            back, _, _ = load_model(tmp)  # what a reader will get, checked before it is published
            abs_d, rel_d = logit_diff(model, back, cfg.vocab_size, cfg.context)
            if not rel_d <= TOLERANCE[dtype]:
                raise CheckFailed(f"the written model differs from the converted one: max_rel_logit_diff={rel_d:.3g}")
    print(f"wrote {args.output}")
    print(f"max_rel_logit_diff={worst:.3g}")
    return 0
