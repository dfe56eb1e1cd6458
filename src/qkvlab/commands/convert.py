"""Exact weight conversion (Paper A's theorems) and Hugging Face import/export.

  qkvlab convert IN OUT --to SCHEME [--layer L]   remove W_Q/W_K by a change of basis (or insert it)
  qkvlab convert --from-hf IN OUT                 IN: a transformers folder (safetensors) or a .gguf
  qkvlab convert IN OUT --to-hf gpt2|llama        write a GPT2LMHeadModel / LlamaForCausalLM folder
  qkvlab convert IN OUT --to-hf deepseek          an MLA model as a DeepseekV3ForCausalLM folder (convert/hf_deepseek.py)
  qkvlab convert IN OUT.gguf --to-gguf            write a llama.cpp GGUF (F32: llama, or deepseek2 for an MLA model;
                                                  convert/gguf_export.py), checked by the engines that read it

Steps combine (--from-hf with --to, --to with --to-hf). The tokenizer travels with the weights:
into OUT/tokenizer/ for a qkvlab folder, into OUT itself (transformers' files) with --to-hf.
Every step is checked on random inputs;
the last line printed is max_rel_logit_diff=<value> (max |Δlogit| / max |logit|, worst step). A GGUF is
checked by engines, never by qkvlab's own forward: llama.cpp where its binaries are (--llama-bin, else
$QKVLAB_LLAMA_BIN, else the PATH: greedy tokens against qkvlab's), transformers' GGUF reader where it knows
the architecture (llama: logits); a deepseek2 file no engine here reads is checked by its tensors, read back,
against the DeepSeek export that transformers computes, and the output says so.
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
from qkvlab.convert.gguf_export import gguf_tensors, read_vocab, write_gguf
from qkvlab.convert.hf import from_hf, gguf_cache_folder, load_hf, quiet, save_hf, to_hf
from qkvlab.convert.hf_deepseek import DEEPSEEK, check_target, to_deepseek
from qkvlab.convert.llama_cpp import COMPLETION, LLAMA_BIN_ENV, LlamaCppError, check_greedy, find_llama_bin, version
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
    if (
        cfg.to_gguf
    ):  # before any work: a file to write, a format that holds the model, the GGUF its tokenizer comes from
        if Path(cfg.output).exists() and not cfg.overwrite:
            raise UserError(f"{cfg.output} exists; pass --overwrite to replace it, or choose another OUT")
        find_llama_bin(cfg.llama_bin)  # a --llama-bin without llama-completion is refused here
        _check_export(cfg, src)
        cfg.gguf_vocab = str(_gguf_vocab(cfg, src))
    else:
        check_model_target(cfg.output, overwrite=cfg.overwrite, flag="OUT")  # before any work
        _check_export(cfg, src)
    if cfg.from_hf or cfg.to_hf or cfg.to_gguf:  # transformers reads, or writes, what is checked
        quiet()
    try:
        return _run(cfg, src)
    except CheckFailed as e:
        print(f"qkvlab convert: check failed: {e}", file=sys.stderr)
        return 1


def _check_export(opts: ConvertConfig, src: Path) -> None:
    """An export the target format cannot hold is refused from IN's config, before any weights are read."""
    target = "gguf" if opts.to_gguf else opts.to_hf
    if target is None:
        return
    if not opts.from_hf:
        check_target(read_config(find_model_dir(src))[0], target)
    elif target == DEEPSEEK:  # an import is a GPT-2 or a Llama: keys and values, no latent
        raise UserError(
            f"--to-hf {DEEPSEEK}: a --from-hf import caches keys and values, not Multi-head Latent Attention's latent; "
            "retrofit it first (qkvlab retrofit IN OUT --to Q-K-V --kv-latent R --rope-dim P)"
        )


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

            save_hf(to_deepseek(model, cfg) if opts.to_hf == DEEPSEEK else to_hf(model, cfg, opts.to_hf), tmp)
            back = AutoModelForCausalLM.from_pretrained(tmp, dtype=dtype, use_safetensors=True).eval()
            abs_d, rel_d = logit_diff(model, back, cfg.vocab_size, cfg.context)
            rotary = {"llama": 1e-6, DEEPSEEK: 1e-5}.get(opts.to_hf, 0.0)  # HF computes rotary angles in float32
            tol = max(TOLERANCE[dtype], rotary)
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
    """The GGUF whose tokenizer fields the written file carries: --gguf-vocab, or IN itself (--from-hf
    X.gguf). A path a model folder records (retrofit_from, converted_from) is named in the refusal but
    never opened: a folder is data, and what it names outside itself is not read."""
    if opts.gguf_vocab is not None:
        found = Path(opts.gguf_vocab)
    elif opts.from_hf and src.suffix == ".gguf":
        found = src
    else:
        body = read_config(find_model_dir(src))[1]
        origins = [body.get(k) for k in ("retrofit_from", "converted_from")]
        recorded = next((o for o in origins if isinstance(o, str) and o.endswith(".gguf")), None)
        hint = f" (its config records it came from {recorded})" if recorded else ""
        raise UserError(
            f"--to-gguf: pass --gguf-vocab FILE.gguf with the model's tokenizer{hint}; llama.cpp reads the "
            "tokenizer in GGUF form"
        )
    if not found.is_file():
        raise UserError(f"--to-gguf: the tokenizer's GGUF {found} is not a file")

    read_vocab(found)  # a truncated or tokenizer-less file is refused before the model is read
    return found


def _write_gguf(opts: ConvertConfig, model, cfg, worst: float) -> int:
    """OUT.gguf, read by the engines that know it and checked against the model before it is published."""

    model = model.float()  # GGUF F32
    llama_bin = find_llama_bin(opts.llama_bin)
    with atomic_path(opts.output) as tmp:  # published only once the checks passed
        arch = write_gguf(model, cfg, tmp, opts.gguf_vocab, name=Path(opts.output).stem)
        what = f"export {cfg.scheme_label} -> GGUF {arch} F32"
        if arch == "llama":
            hf = load_hf(tmp, cache=False)  # transformers' GGUF reader: its LlamaForCausalLM computes
            abs_d, rel_d = logit_diff(model, hf, cfg.vocab_size, min(cfg.context, 64))
            _gguf_step(f"{what}, read by transformers' GGUF reader ({type(hf).__name__})", abs_d, rel_d, 1e-5)
        else:
            _same_tensors(tmp, gguf_tensors(model, cfg))
            hf = to_deepseek(model, cfg)  # the same tensors, computed by transformers' DeepseekV3ForCausalLM
            abs_d, rel_d = logit_diff(model, hf, cfg.vocab_size, min(cfg.context, 64))
            name = type(hf).__name__
            _gguf_step(
                f"{what}: its tensors read back are {name}'s; transformers' {name} vs qkvlab", abs_d, rel_d, 1e-5
            )
        del hf
        worst = max(worst, rel_d)
        if llama_bin is not None:
            _llama_cpp_step(what, llama_bin, tmp, model, cfg)
        else:
            print(
                f"note: llama.cpp not checked (no {COMPLETION}: --llama-bin DIR, ${LLAMA_BIN_ENV} or the PATH)"
                + (
                    "; no engine here read this deepseek2 file (transformers' GGUF reader does not know deepseek2)"
                    if arch != "llama"
                    else ""
                )
            )
    print(f"wrote {opts.output}")
    print(f"max_rel_logit_diff={worst:.3g}")
    return 0


def _gguf_step(what: str, abs_d: float, rel_d: float, tol: float) -> None:
    if not rel_d <= tol:
        raise CheckFailed(f"{what}: the written GGUF differs: max_rel_logit_diff={rel_d:.3g} > {tol:g}")
    _step(what, abs_d, rel_d)


def _same_tensors(file: Path, expected: dict) -> None:
    """Every tensor of `file`, read back by gguf's reader, equal (bit for bit) to the one meant for it."""
    got = {t.name: torch.tensor(t.data) for t in read_vocab(file).tensors}  # a copy: the reader maps the file read-only
    if set(got) != set(expected):
        raise CheckFailed(f"the written GGUF's tensors differ by name: {sorted(set(got) ^ set(expected))[:3]}")
    for name, t in expected.items():
        if got[name].shape != t.shape or not torch.equal(got[name], t):
            raise CheckFailed(f"the written GGUF's {name} differs from the export's")


def _llama_cpp_step(what: str, bin_dir: Path, file: Path, model, cfg) -> None:
    """llama.cpp's greedy tokens from the file against qkvlab's from the same prompt ids."""
    try:
        got = check_greedy(bin_dir, file, model, cfg.context)
    except LlamaCppError as e:
        raise CheckFailed(f"llama.cpp could not run the written GGUF: {e}") from None
    tie = (
        ""
        if got["first_diff"] is None
        else f", then a near tie (llama.cpp took qkvlab's runner-up, {got['gap_at_first_diff']:.2g} std below)"
    )
    line = f"{what}, read by llama.cpp ({COMPLETION} {version(bin_dir / COMPLETION)}): "
    line += f"{got['equal_prefix']} of {got['compared']} greedy tokens equal{tie}"
    if not got["agrees"]:
        rank = got["rank_of_theirs"]
        raise CheckFailed(f"{line}; at token {got['first_diff']} llama.cpp's is qkvlab's rank {rank}, not a near tie")
    print(line)


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
