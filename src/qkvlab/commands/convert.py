"""Exact weight conversion (Paper A's theorems) and Hugging Face import/export.

  qkvlab convert IN OUT --to SCHEME [--layer L]   remove W_Q/W_K by a change of basis (or insert it)
  qkvlab convert --from-hf IN OUT                 IN: a transformers folder (safetensors) or a .gguf
  qkvlab convert IN OUT --to-hf gpt2|llama        write a GPT2LMHeadModel / LlamaForCausalLM folder
  qkvlab convert IN OUT.gguf --to-gguf            write a llama.cpp GGUF (llama, F32; convert/gguf_export.py)

Steps combine (--from-hf with --to, --to with --to-hf). The tokenizer travels with the weights:
into OUT/tokenizer/ for a qkvlab folder, into OUT itself (transformers' files) with --to-hf.
Every step is checked on random inputs;
the last line printed is max_rel_logit_diff=<value> (max |Δlogit| / max |logit|, worst step).
Exit 0: written and equivalent; 2: refused (the reason on one line); 1: the check failed.
Nothing is written unless every check passed.
"""

from __future__ import annotations

import shutil
import sys
from dataclasses import asdict
from pathlib import Path

import torch

from qkvlab.base.devices import torch_dtype
from qkvlab.base.errors import UserError
from qkvlab.base.files import atomic_dir, atomic_path
from qkvlab.base.folders import check_model_target
from qkvlab.base.settings import add_config_options, add_options, load, print_config
from qkvlab.convert.config import ConvertConfig
from qkvlab.convert.gguf_export import read_vocab, write_gguf
from qkvlab.convert.hf import from_hf, gguf_cache_folder, load_hf, quiet, save_hf, to_hf
from qkvlab.convert.load import TOKENIZER_DIR, hf_tokenizer, model_tokenizer, save_hf_tokenizer
from qkvlab.convert.reparam import TOLERANCE, CheckFailed, check, convert, logit_diff
from qkvlab.data.tokenizer import EOT_TOKEN
from qkvlab.model.folder import find_model_dir, load_model, read_config, write_model_files


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
    if cfg.to_gguf:  # before any work: a file to write, and the GGUF its tokenizer comes from
        if Path(cfg.output).exists() and not cfg.overwrite:
            raise UserError(f"{cfg.output} exists; pass --overwrite to replace it, or choose another OUT")
        cfg.gguf_vocab = str(_gguf_vocab(cfg, src))
    else:
        check_model_target(cfg.output, overwrite=cfg.overwrite, flag="OUT")  # before any work
    if cfg.from_hf or cfg.to_hf:
        quiet()
    try:
        return _run(cfg, src)
    except CheckFailed as e:
        print(f"qkvlab convert: check failed: {e}", file=sys.stderr)
        return 1


def _run(opts: ConvertConfig, src: Path) -> int:

    worst = 0.0
    if opts.from_hf:
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
        tok = _source_tokenizer(src, True)
    else:
        model, cfg, _ = load_model(src)
        stored = model.tok_emb.weight.dtype
        tok = _source_tokenizer(src, False)
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
    if opts.to_gguf:
        return _write_gguf(opts, model, cfg, worst)
    with atomic_dir(opts.output, replace=opts.overwrite) as tmp:
        if opts.to_hf:
            from transformers import AutoModelForCausalLM  # optional: transformers

            save_hf(to_hf(model, cfg, opts.to_hf), tmp)
            back = AutoModelForCausalLM.from_pretrained(tmp, dtype=dtype, use_safetensors=True).eval()
            abs_d, rel_d = logit_diff(model, back, cfg.vocab_size, cfg.context)
            tol = max(TOLERANCE[dtype], 1e-6 if opts.to_hf == "llama" else 0.0)  # HF computes rotary in float32
            if not rel_d <= tol:
                raise CheckFailed(f"exported {opts.to_hf} checkpoint differs: max_rel_logit_diff={rel_d:.3g} > {tol:g}")
            worst = max(worst, _step(f"export {cfg.scheme_label} -> {type(back).__name__}", abs_d, rel_d))
            _export_tokenizer(tok, tmp)
        else:
            meta = {"converted_from": str(src), "conversion": notes, **_keep_tokenizer(tok, tmp / TOKENIZER_DIR)}
            write_model_files(tmp, model, cfg, meta)
            back, _, _ = load_model(tmp)  # what a reader will get, checked before it is published
            abs_d, rel_d = logit_diff(model, back, cfg.vocab_size, cfg.context)
            if not rel_d <= TOLERANCE[dtype]:
                raise CheckFailed(f"the written model differs from the converted one: max_rel_logit_diff={rel_d:.3g}")
    print(f"wrote {opts.output}")
    print(f"max_rel_logit_diff={worst:.3g}")
    return 0


# ---- GGUF ------------------------------------------------------------------------------------
def _gguf_vocab(opts: ConvertConfig, src: Path) -> Path:
    """The GGUF whose tokenizer fields the written file carries: --gguf-vocab, IN itself (--from-hf
    X.gguf), or the GGUF a qkvlab folder records it came from (retrofit_from / converted_from)."""
    if opts.gguf_vocab is not None:
        found = Path(opts.gguf_vocab)
    elif opts.from_hf and src.suffix == ".gguf":
        found = src
    else:
        body = read_config(find_model_dir(src))[1]
        origins = [body.get(k) for k in ("retrofit_from", "converted_from")]
        found = next((Path(o) for o in origins if isinstance(o, str) and o.endswith(".gguf")), None)
        if found is None:
            raise UserError(
                f"--to-gguf: {src} did not come from a GGUF; pass --gguf-vocab FILE.gguf with the model's tokenizer "
                "(llama.cpp reads the tokenizer in GGUF form)"
            )
    if not found.is_file():
        raise UserError(f"--to-gguf: the tokenizer's GGUF {found} is not a file")

    read_vocab(found)  # a truncated or tokenizer-less file is refused before the model is read
    return found


def _write_gguf(opts: ConvertConfig, model, cfg, worst: float) -> int:
    """OUT.gguf, read back through transformers' GGUF reader and checked against the model."""

    model = model.float()  # GGUF F32
    with atomic_path(opts.output) as tmp:  # published only once the check passed
        write_gguf(model, cfg, tmp, opts.gguf_vocab, name=Path(opts.output).stem)
        back, _ = from_hf(load_hf(tmp, cache=False))
        abs_d, rel_d = logit_diff(model, back, cfg.vocab_size, min(cfg.context, 64))
        if not rel_d <= 1e-5:
            raise CheckFailed(f"the written GGUF differs: max_rel_logit_diff={rel_d:.3g} > 1e-05")
    worst = max(worst, _step(f"export {cfg.scheme_label} -> GGUF llama F32 (read back by transformers)", abs_d, rel_d))
    print(f"wrote {opts.output}")
    print(f"max_rel_logit_diff={worst:.3g}")
    return 0


# ---- the tokenizer, carried beside the weights -------------------------------------------------
def _source_tokenizer(src: Path, from_hf: bool) -> tuple[str, object, Path | None] | None:
    """(kind, tokenizer, its folder) of IN: ("hf", a transformers tokenizer, the folder with its
    files and generation_config.json), ("qkvlab", a qkvlab tokenizer, its saved folder or None),
    or None when IN has none. A GGUF's tokenizer is read by load_hf into its cache folder."""

    if from_hf:  # read once load_hf has run (a GGUF's tokenizer is written into its cache folder then)
        ggufs = sorted(src.glob("*.gguf")) if src.is_dir() and not (src / "config.json").exists() else [src]
        return "hf", None, gguf_cache_folder(ggufs[0]) if ggufs and ggufs[0].suffix == ".gguf" else src

    folder = find_model_dir(src)
    tok, tok_dir = model_tokenizer(None, folder, read_config(folder)[1])
    if tok is None:
        return None
    if tok_dir is not None:
        return "hf", tok, tok_dir
    saved = folder / TOKENIZER_DIR
    return "qkvlab", tok, saved if saved.is_dir() else None


def _hf_of(source) -> tuple[object, Path | None] | None:
    """A transformers tokenizer for the source tokenizer (None: it has no transformers form)."""

    kind, tok, folder = source
    if kind == "hf":
        tok = tok if tok is not None else hf_tokenizer(folder)  # a GGUF's: written when load_hf read it
        return None if tok is None else (tok, folder)
    if hasattr(tok, "_tok"):  # a qkvlab BPE is a `tokenizers` tokenizer: transformers wraps it as it is
        from transformers import PreTrainedTokenizerFast  # optional: transformers

        return PreTrainedTokenizerFast(tokenizer_object=tok._tok, eos_token=EOT_TOKEN), None
    return None


def _keep_tokenizer(source, out: Path) -> dict:
    """OUT/tokenizer/: a qkvlab tokenizer's saved folder as it is, a transformers one's files ->
    what config.json must record (a tokenizer known by name: gpt2, bytes)."""

    if source is None:
        return {}
    kind, tok, folder = source
    if kind == "qkvlab":
        if folder is None:
            return {"tokenizer": tok.spec}
        shutil.copytree(folder, out)
        return {}
    hf = _hf_of(source)
    if hf is None:
        print(f"note: no tokenizer found beside {folder}; OUT has none")
        return {}
    save_hf_tokenizer(hf[0], out, None if hf[1] is None else hf[1] / "generation_config.json")
    return {}


def _export_tokenizer(source, out: Path) -> None:
    """transformers' tokenizer files beside the exported weights, so AutoTokenizer reads OUT."""

    if source is None:
        return
    hf = _hf_of(source)
    if hf is None:
        print(f"note: tokenizer {source[1].name} has no transformers form here; OUT has no tokenizer files")
        return
    # the source's generation_config.json (its end-of-turn ids) over the one the export derived
    save_hf_tokenizer(hf[0], out, None if hf[1] is None else hf[1] / "generation_config.json")
