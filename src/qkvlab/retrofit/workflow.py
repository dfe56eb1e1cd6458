"""Retrofit a trained model to K=V and/or fewer key/value heads: fit, then uptrain by distillation.

The fit (retrofit_fit.py) keeps the keys and fits the values on calibration text, folding the fit
into the output projection, then refines each converted layer against the original layer's
attention output (retrofit_refine.py); this module is the whole procedure around it:

- the source, through the one loader (convert/load.py): a qkvlab folder with its tokenizer/, or
  a Hugging Face folder or .gguf with its tokenizer files;
- text: every document's first (1 - f) tokens calibrate and train, its last f are held out;
- uptraining with the training engine (train/loop.py, resumable, checkpoints): the `distill`
  task (tasks/distill.py), LM loss plus KL(teacher || student) at temperature 1;
- the report: held-out perplexity of the original, after the fit and after uptraining, and the
  KV-cache bytes per token before and after (bf16).
"""

from __future__ import annotations

import dataclasses
import math
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save

from qkvlab.base.devices import DEVICE_HELP, TRAIN_DTYPES, check_device, check_dtype, dtype_choices, select_device
from qkvlab.base.errors import RUN_AGAIN, NoRoom, UserError, as_user_error
from qkvlab.base.files import atomic_dir, atomic_write, json_text
from qkvlab.base.folders import claimed, inspect
from qkvlab.base.model_files import read_json
from qkvlab.base.settings import check, resumable_fields, seed_setting, setting
from qkvlab.convert.load import TOKENIZER_DIR, load_any, save_hf_tokenizer
from qkvlab.data.text import describe_source, load_corpus
from qkvlab.data.tokenizer import load_tokenizer
from qkvlab.model.accounting import analytic_params, kv_cache_bytes_per_token
from qkvlab.model.config import ModelConfig
from qkvlab.model.folder import is_model_folder, load_model, read_config, write_model_files
from qkvlab.model.spec import select_layers
from qkvlab.model.transformer import GPT
from qkvlab.retrofit.fit import (
    POOLS,
    STARTS,
    TARGETS,
    FitResult,
    LayerFit,
    attention_inputs,
    candidate_layers,
    check_target,
    fit,
    fit_layer,
)
from qkvlab.retrofit.latent import check_source as check_latent_source
from qkvlab.retrofit.latent import fit_latent
from qkvlab.retrofit.mla import check_source as check_mla_source
from qkvlab.retrofit.mla import fit_mla
from qkvlab.retrofit.refine import REFINE_INPUTS, RefineOptions
from qkvlab.tasks.distill import check_loss_weights
from qkvlab.train.config import TrainConfig
from qkvlab.train.loop import train

# The fit's names, for `from qkvlab.retrofit.workflow import ...` (the library entry point).
__all__ = [
    "POOLS",
    "TARGETS",
    "FitResult",
    "LayerFit",
    "RetrofitOptions",
    "Source",
    "attention_inputs",
    "corpus_tokens",
    "fit",
    "fit_layer",
    "load_source",
    "perplexity",
    "retrofit",
    "summary_line",
]
TOKENS_FILE = "tokens.safetensors"
REPORT = "retrofit.json"


# ---- the source: any model the one loader reads, with its tokenizer ---------------------------------
@dataclass
class Source:
    model: GPT
    cfg: ModelConfig
    encode: Callable[[str], list[int]]
    eot_id: int | None
    kind: str  # "qkvlab" or "hf"
    tokenizer_dir: Path | None = None  # qkvlab: the folder's tokenizer/, copied beside the result
    decode: Callable[[list[int]], str] | None = None
    hf_tokenizer: Any = None  # hf: the transformers tokenizer, saved into the result's tokenizer/
    generation_config: Path | None = None  # hf: its generation_config.json (end-of-turn ids), if any


def load_source(path: str | Path) -> Source:
    """The model (float32 or as stored) and its tokenizer (convert/load.py)."""
    m = load_any(path)
    if m.kind == "qkvlab" and m.tokenizer_dir is None:  # a qkvlab tokenizer (else transformers' files in tokenizer/)
        tok_dir = m.folder / TOKENIZER_DIR
        if not tok_dir.is_dir():
            raise UserError(f"{path}: no tokenizer/ folder (qkvlab train writes one); retrofit needs it to read text")
        tok = load_tokenizer(tok_dir)
        return Source(m.model, m.cfg, tok.encode, tok.eot_id, "qkvlab", tok_dir, tok.decode)
    tok = m.tokenizer
    if tok is None:
        raise UserError(f"{path}: no usable tokenizer beside the weights (no tokenizer files in {m.folder})")

    def encode(text: str) -> list[int]:
        return tok(text, add_special_tokens=False)["input_ids"]

    gen = None if m.tokenizer_dir is None else m.tokenizer_dir / "generation_config.json"
    if m.kind == "qkvlab":  # its tokenizer/ holds transformers' files: copied to the result as they are
        return Source(m.model, m.cfg, encode, tok.eos_token_id, "qkvlab", m.tokenizer_dir, tok.decode)
    return Source(m.model, m.cfg, encode, tok.eos_token_id, "hf", None, tok.decode, tok, gen)


# ---- text: calibration/training tokens and held-out tokens ----------------------------------------
def corpus_tokens(src: Source, data: Any = None, heldout_fraction: float = 0.1) -> tuple[torch.Tensor, torch.Tensor]:
    """Every document's first (1 - f) tokens train (and calibrate), its last f are held out."""
    train: list[int] = []
    held: list[int] = []
    eot = [] if src.eot_id is None else [src.eot_id]
    for doc in load_corpus(data):
        if not doc.text:
            continue
        ids = src.encode(doc.text)
        cut = round(len(ids) * (1 - heldout_fraction))
        train += ids[:cut] + eot
        held += ids[cut:] + eot
    if len(train) < 2 or len(held) < 2:
        raise UserError(f"corpus {data!r} is too small to hold out {heldout_fraction:.0%} of it")
    return torch.tensor(train, dtype=torch.long), torch.tensor(held, dtype=torch.long)


def write_tokens(path: Path, train: torch.Tensor, held: torch.Tensor) -> None:
    """Atomically (qkvlab.model.folder): a resumed retrofit must never read a half-written file."""
    atomic_write(path, save({"train": train.contiguous(), "val": held.contiguous()}))


@torch.no_grad()
def perplexity(model: GPT, tokens: torch.Tensor, *, block: int, max_tokens: int, batch: int = 4) -> float:
    """exp(mean next-token NLL) over consecutive non-overlapping windows of `block` tokens."""
    n = min(len(tokens) - 1, max_tokens) // block
    if n == 0:
        raise UserError(f"held-out text has {len(tokens)} tokens, fewer than one window of {block}")
    p = next(model.parameters())
    model.eval()
    total = 0.0
    for lo in range(0, n, batch):
        rows = range(lo, min(n, lo + batch))
        x = torch.stack([tokens[i * block : (i + 1) * block] for i in rows]).to(p.device)
        y = torch.stack([tokens[i * block + 1 : (i + 1) * block + 1] for i in rows]).to(p.device)
        _, loss = model(x, y)
        total += float(loss) * len(rows)
    return math.exp(total / n)


# ---- the whole procedure ------------------------------------------------------------------------------
@dataclass
class RetrofitOptions:
    # resumable=True: a field the fit does not read, so --resume reuses OUT/fit when only those differ (the
    # uptraining's own run folder still refuses what its training loop cannot resume)
    to: str = setting("Q-K=V", help="target scheme: Q-K=V, or Q-K-V with --kv-heads (plain GQA/MQA)", metavar="SCHEME")
    kv_heads: int | None = setting(
        None, help="key/value heads after pooling (GQA; 1: MQA; default: unchanged)", minimum=1
    )
    kv_latent: int | None = setting(
        None,
        help="with --to Q-K-V: every layer caches a latent of this many numbers per token, its keys and values "
        "read back from it (a joint low-rank fit; docs/retrofit.md)",
        minimum=1,
    )
    rope_dim: int | None = setting(
        None,
        help="with --kv-latent: Multi-head Latent Attention, a RoPE key of this many numbers shared by every head "
        "cached beside the latent (RoRoPE keeps the original frequencies; docs/retrofit.md)",
        minimum=2,
    )
    layers: str | None = setting(
        None,
        help="layers to convert: 'every4', '0,5,7', '-4:' (default: all, or as --cache-budget picks)",
        metavar="SEL",
    )
    cache_budget: float | None = setting(
        None,
        help="convert the layers with the lowest output error after the fit until the KV cache is at most this fraction",
        metavar="F",
        positive=True,
        maximum=1,
    )
    pool: str = setting("fit", help="value heads: least-squares fit folded into out_proj, or plain mean", choices=POOLS)
    start: str = setting(
        "keys",
        help="K=V's shared tensor starts as the keys (exact rotary) or the mean of keys and values",
        choices=STARTS,
    )
    refine_steps: int = setting(
        150, help="Adam steps per converted layer on the original layer's attention output (0: none)", minimum=0
    )
    refine_lr: float = setting(1e-3, help="refinement peak learning rate (cosine to 0)", positive=True)
    refine_inputs: str = setting(
        "converted",
        help="refine each layer on the original model's inputs only, or then again, in order, on the inputs it reads "
        "in the converted model",
        choices=REFINE_INPUTS,
    )
    data: str | None = setting(
        None,
        help="text: a path, 'shakespeare[:genres]', 'hf:NAME?split=..', or several joined by '+' (default Shakespeare)",
        metavar="SOURCE",
    )
    heldout_fraction: float = setting(
        0.1, help="last fraction of every document held out for perplexity, in (0, 1)", positive=True
    )
    calib_tokens: int = setting(
        8192, help="calibration tokens for the fit and refinement (random windows of the training text)", minimum=1
    )
    eval_tokens: int = setting(8192, help="held-out tokens scored for perplexity", minimum=1, resumable=True)
    block_size: int | None = setting(None, help="window length (default min(context, 256))", metavar="T", minimum=1)
    steps: int = setting(200, help="uptraining steps (0: fit only)", minimum=0, resumable=True)
    batch_size: int = setting(8, help="uptraining sequences per step", minimum=1, resumable=True)
    lr: float = setting(3e-4, help="uptraining peak learning rate (cosine to lr/10)", positive=True, resumable=True)
    warmup_steps: int = setting(20, help="uptraining warmup steps", minimum=0, resumable=True)
    kl_weight: float = setting(
        1.0, help="weight of KL(teacher || student) on logits, temperature 1", minimum=0, resumable=True
    )
    lm_weight: float = setting(1.0, help="weight of the LM loss (0: pure distillation)", minimum=0, resumable=True)
    train: str = setting(
        "converted",
        help="what uptraining trains: the converted layers' attention weights, or every weight",
        choices=("converted", "all"),
        resumable=True,
    )
    rest_lr: float | None = setting(
        None,
        help="with --train converted: every other weight trains too, at this peak lr (default a tenth of --lr; "
        "0: they stay frozen)",
        minimum=0,
        resumable=True,
    )
    eval_every: int = setting(
        50, help="uptraining steps between evaluations and checkpoints", minimum=1, resumable=True
    )
    eval_batches: int = setting(10, help="validation batches per uptraining evaluation", minimum=1, resumable=True)
    seed: int = seed_setting(0, help="calibration windows, refinement and uptraining batch order")
    device: str = setting(
        "auto", help=f"device for calibration and uptraining: {DEVICE_HELP}", metavar="DEVICE", resumable=True
    )
    dtype: str = setting(
        "auto",
        help="uptraining autocast dtype (auto: bf16 on CUDA; on the CPU as the timing probe decides)",
        choices=dtype_choices(TRAIN_DTYPES),
        resumable=True,
    )

    def validate(self) -> RetrofitOptions:
        check(self)  # types, choices and bounds of every field; below: the rules across fields
        if not self.heldout_fraction < 1:
            raise UserError(f"heldout_fraction={self.heldout_fraction} must be in (0, 1)")
        if self.steps:  # the uptraining's distill task would refuse them only after the fit
            check_loss_weights(self.kl_weight, self.lm_weight, "nothing to uptrain on (or --steps 0: fit only)")
        if self.rest_lr and self.train == "all":
            raise UserError(
                f"--rest-lr {self.rest_lr} is for --train converted (--train all trains every weight at --lr)"
            )
        if self.rest_lr is None:  # decided by measurement: docs/results/retrofit, "a tenth of the rate" (2026-12-06)
            self.rest_lr = self.lr / 10 if self.train == "converted" else 0.0
        if self.layers is not None and self.cache_budget is not None:
            raise UserError("give --layers or --cache-budget, not both (the budget chooses the layers)")
        if self.kv_latent is not None:
            if self.to != "Q-K-V":
                raise UserError(
                    f"--kv-latent {self.kv_latent} with --to {self.to}: a latent keeps the query and replaces separate "
                    "keys and values; give --to Q-K-V"
                )
            extra = [f for f in ("kv_heads", "layers", "cache_budget") if getattr(self, f) is not None]
            if extra:
                flags = ", ".join("--" + f.replace("_", "-") for f in extra)
                raise UserError(f"--kv-latent {self.kv_latent} with {flags}: a latent is one rank for every layer")
        elif self.rope_dim is not None:
            raise UserError(
                f"--rope-dim {self.rope_dim} needs --kv-latent R: it is the RoPE part of Multi-head Latent Attention"
            )
        check_target(self.to, self.pool, self.cache_budget)  # before any model is loaded
        check_dtype(self.dtype, TRAIN_DTYPES)
        check_device(self.device)
        return self


def check_layers(shape: tuple[int, int] | None, opts: RetrofitOptions) -> None:
    """--layers and --kv-heads against the source's (n_layer, n_head), before any weight is read or
    any perplexity measured."""
    if shape is None:
        return
    n_layer, n_head = shape
    if opts.layers is not None:
        select_layers(opts.layers, n_layer)
    if opts.kv_heads is not None and n_head % opts.kv_heads:
        raise UserError(f"--kv-heads {opts.kv_heads} must divide n_head={n_head}")


def source_shape(path: str | Path) -> tuple[int, int] | None:
    """(n_layer, n_head) from the source's config alone; None where only the weights say (.gguf)."""
    path = Path(path)
    if is_model_folder(path):
        cfg = read_config(path)[0]
        return cfg.n_layer, cfg.n_head
    try:  # as data (qkvlab.base.model_files): the loader refuses what is wrong with it, in one line
        body = read_json(path, "config.json", missing_ok=True) if path.is_dir() else None
    except UserError:
        return None
    if body is None:
        return None
    n_layer = body.get("num_hidden_layers", body.get("n_layer"))
    n_head = body.get("num_attention_heads", body.get("n_head"))
    return (n_layer, n_head) if isinstance(n_layer, int) and isinstance(n_head, int) else None


@dataclass
class RetrofitConfig(RetrofitOptions):
    """`qkvlab retrofit`'s command line: the method's options plus where from and where to."""

    input: str = setting(
        help="qkvlab model folder, or a Hugging Face GPT-2/Llama folder or .gguf", positional=True, metavar="IN"
    )
    output: str = setting(
        help="folder to write (new or empty, or a retrofit to --resume)", positional=True, metavar="OUT"
    )
    resume: bool = setting(False, help="continue the uptraining in OUT")
    json: bool = setting(False, help="print the report as JSON before the last line")
    quiet: bool = setting(False, help="no progress output")

    def options(self) -> RetrofitOptions:
        """The method's part (what the report records)."""
        return RetrofitOptions(**{f.name: getattr(self, f.name) for f in dataclasses.fields(RetrofitOptions)})


def _owned(out: Path) -> bool:
    """An OUT this command wrote before (so --resume may continue it)."""
    return (out / TOKENS_FILE).is_file()  # written first, before any other file


def retrofit(
    source: str | Path, out: str | Path, opts: RetrofitOptions, *, resume: bool = False, progress: bool = True
) -> dict[str, Any]:
    """Fit, uptrain and report into OUT (the final model folder). Returns the report dict.
    OUT is claimed and locked for the run (qkvlab.base.folders): missing, empty, or with resume=True a
    folder an earlier retrofit wrote; anything else is refused before writing."""
    opts.validate()
    check_layers(source_shape(source), opts)
    out = Path(out)
    found = inspect(out)
    if found.kind == "missing" and resume:
        raise UserError(
            f"--resume: {out} does not exist, so there is no retrofit to continue; drop --resume to start one"
        )
    if found.kind not in ("missing", "empty"):
        if not _owned(out):  # --resume cannot continue what retrofit did not write: advise only what works
            raise UserError(
                f"{out} holds {found.what}, not written by qkvlab retrofit; choose another OUT (nothing was changed)"
            )
        if not resume:
            raise UserError(f"{out} holds a retrofit; pass --resume to continue it, or choose another OUT")
    with claimed(out, accept=("model", "other", "run"), advice={}, flag="OUT") as claim:
        try:
            return _retrofit(source, out, opts, claim, resume=resume, progress=progress)
        except (NoRoom, OSError) as e:  # a full disk: once OUT holds a retrofit, --resume continues it
            err = as_user_error(e)
            if not isinstance(err, NoRoom):
                raise
            raise err.then("run the same command with --resume" if claim.keep and not resume else RUN_AGAIN) from None


def _retrofit(source, out: Path, opts: RetrofitOptions, claim, *, resume: bool, progress: bool) -> dict[str, Any]:
    device = select_device(opts.device)
    src = load_source(source)
    check_layers((src.cfg.n_layer, src.cfg.n_head), opts)  # a .gguf: known only now, still before any perplexity
    model, cfg = src.model.float().to(device), src.cfg
    if opts.kv_latent is None:  # refused before any text is read or scored
        candidate_layers(cfg, opts.layers, opts.kv_heads, opts.to)
    elif opts.rope_dim is not None:
        check_mla_source(cfg, opts.kv_latent, opts.rope_dim)
    else:
        check_latent_source(cfg, opts.kv_latent)
    block = opts.block_size or min(cfg.context, 256)
    train_ids, held_ids = corpus_tokens(src, opts.data, opts.heldout_fraction)
    if len(train_ids) - 1 < opts.calib_tokens:  # calibration_windows would quietly take fewer windows than asked
        raise UserError(
            f"corpus {describe_source(opts.data)!r} has {len(train_ids):,} training tokens, fewer than "
            f"--calib-tokens {opts.calib_tokens:,}; give more text or a smaller --calib-tokens"
        )
    write_tokens(out / TOKENS_FILE, train_ids, held_ids)
    claim.keep = True  # from here OUT is a retrofit folder that --resume continues
    say = print if progress else (lambda *a, **k: None)
    ppl = lambda m: perplexity(m, held_ids, block=block, max_tokens=opts.eval_tokens)  # noqa: E731
    ppls = {"ppl_original": ppl(model)}
    say(f"original {cfg.scheme_label}: held-out ppl {ppls['ppl_original']:.4g}")
    res = _reuse_fit(out / "fit", opts) if resume else None
    if res is not None:
        say(f"fit: reused {out / 'fit'} (written by the run being resumed)")
    elif opts.rope_dim is not None:
        refine = RefineOptions(opts.refine_steps, opts.refine_lr, seed=opts.seed, inputs="original")
        res = fit_mla(model, cfg, train_ids, rank=opts.kv_latent, rope_dim=opts.rope_dim, refine=refine,
                      calib_tokens=opts.calib_tokens, block=block, seed=opts.seed, say=say)  # fmt: skip
    elif opts.kv_latent is not None:
        refine = RefineOptions(opts.refine_steps, opts.refine_lr, seed=opts.seed, inputs="original")
        res = fit_latent(model, cfg, train_ids, rank=opts.kv_latent, refine=refine, calib_tokens=opts.calib_tokens,
                         block=block, seed=opts.seed, say=say)  # fmt: skip
    else:
        res = fit(
            model,
            cfg,
            train_ids,
            to=opts.to,
            kv_heads=opts.kv_heads,
            layers=opts.layers,
            cache_budget=opts.cache_budget,
            pool=opts.pool,
            start=opts.start,
            refine=RefineOptions(opts.refine_steps, opts.refine_lr, seed=opts.seed, inputs=opts.refine_inputs),
            calib_tokens=opts.calib_tokens,
            block=block,
            seed=opts.seed,
            say=say,
        )
    res.model.to(device)
    for lf in res.layers:
        mark = "converted" if lf.layer in res.converted else "kept"
        say(
            f"layer {lf.layer}: output error {lf.error:.4f} cache/token {lf.cache_bytes_before} -> "
            f"{lf.cache_bytes_after} B ({mark})"
        )
    meta = {"retrofit_from": str(source), "retrofit": asdict(opts)}
    if not (out / "fit" / "config.json").is_file():
        (out / "fit").mkdir(exist_ok=True)
        fit_meta = {**meta, "fit_layers": [asdict(lf) for lf in res.layers], "converted_layers": res.converted}
        write_model_files(out / "fit", res.model, res.cfg, fit_meta)
    ppls["ppl_fit"] = ppl(res.model)
    say(f"fit {res.cfg.scheme_label}: held-out ppl {ppls['ppl_fit']:.4g}")
    final, ppls["ppl_uptrained"], train_info = res.model, None, None
    if opts.steps > 0:
        trained = res.converted if opts.train == "converted" else None
        result = _uptrain(source, out, opts, res.cfg, block, trained, resume=resume, progress=progress)
        final, _, _ = load_model(out / "uptrain", device=device, dtype=torch.float32)
        ppls["ppl_uptrained"] = ppl(final)
        train_info = {"steps": result.step, "tokens": result.tokens, "last": result.metrics}
        say(f"uptrained ({result.step} steps): held-out ppl {ppls['ppl_uptrained']:.4g}")
    counts = {"train": len(train_ids), "held": len(held_ids), "block": block}
    report = _report(source, cfg, res, opts, counts, ppls, train_info)
    write_model_files(out, final, res.cfg, {**meta, "retrofit_report": REPORT})
    if src.tokenizer_dir is not None or src.hf_tokenizer is not None:
        with atomic_dir(out / TOKENIZER_DIR) as tmp:  # the result reads and serves text as its source did
            if src.tokenizer_dir is not None:
                shutil.copytree(src.tokenizer_dir, tmp, dirs_exist_ok=True)
            else:
                save_hf_tokenizer(src.hf_tokenizer, tmp, src.generation_config)
    atomic_write(out / REPORT, json_text(report, indent=2))
    return report


# options added after fits were written without them, and the value that says what those fits did
FITS_BEFORE_THE_OPTION = {"refine_inputs": "original", "rope_dim": None}


def _reuse_fit(folder: Path, opts: RetrofitOptions) -> FitResult | None:
    """The fit an interrupted run wrote (its weights are written before the config, each atomically); None when
    there is none yet (then it is fitted). A fit made with other fit options is refused in one line."""
    if not (folder / "config.json").is_file():
        return None
    model, cfg, body = load_model(folder, dtype=torch.float32)
    made, free = body.get("retrofit") or {}, resumable_fields(RetrofitOptions)  # the rest is what the fit read
    made = {**FITS_BEFORE_THE_OPTION, **made}  # an option added since that fit was made: it did what the fit did then
    if "fit_layers" not in body:
        return None
    changed = [k for k, v in asdict(opts).items() if k not in free and made.get(k) != v]
    if changed:  # the uptraining in OUT distils that fit: another one cannot continue it
        was = ", ".join(f"--{k.replace('_', '-')} {made.get(k)}" for k in changed)
        now = ", ".join(f"--{k.replace('_', '-')} {getattr(opts, k)}" for k in changed)
        raise UserError(
            f"{folder.parent} was fitted with {was}, not {now}; --resume with the options it was made with, "
            "or choose another OUT"
        )
    return FitResult(model, cfg, [LayerFit(**lf) for lf in body["fit_layers"]], body["converted_layers"])


def _uptrain(source, out: Path, opts: RetrofitOptions, cfg: ModelConfig, block: int, layers, *, resume, progress):
    """Distil the source into out/fit with the training engine, into out/uptrain (resumable)."""
    tc = TrainConfig(
        task="distill",
        task_options={
            "teacher": str(Path(source).resolve()),
            "student": str((out / "fit").resolve()),
            "tokens": str((out / TOKENS_FILE).resolve()),
            "kl_weight": opts.kl_weight,
            "lm_weight": opts.lm_weight,
            "block_size": block,
            "train_layers": layers,
            "rest_lr_scale": opts.rest_lr / opts.lr if layers is not None else 0.0,
        },
        model=cfg,
        seed=opts.seed,
        max_steps=opts.steps,
        batch_size=opts.batch_size,
        lr=opts.lr,
        warmup_steps=min(opts.warmup_steps, opts.steps),
        eval_every=min(opts.eval_every, opts.steps),
        eval_batches=opts.eval_batches,
        device=opts.device,
        dtype=opts.dtype,
        log_tensorboard=False,
    )
    return train(tc, out / "uptrain", resume=resume, progress=progress)


def _report(source, cfg: ModelConfig, res: FitResult, opts: RetrofitOptions, counts, ppls, train_info) -> dict:
    before, after = kv_cache_bytes_per_token(cfg), kv_cache_bytes_per_token(res.cfg)
    block = counts["block"]
    return {
        "source": str(source),
        "original_scheme": cfg.scheme_label,
        "scheme": res.cfg.scheme_label,
        "converted_layers": res.converted,
        "layers": [asdict(lf) for lf in res.layers],
        "options": asdict(opts),
        "heldout_tokens_evaluated": min(counts["held"] - 1, opts.eval_tokens) // block * block,
        "calibration_tokens": min(opts.calib_tokens, counts["train"] - 1) // block * block,
        "params_before": analytic_params(cfg).total,
        "params_after": analytic_params(res.cfg).total,
        "kv_cache_bytes_per_token_before": before,
        "kv_cache_bytes_per_token_after": after,
        "cache_ratio": after / before,
        **ppls,
        "uptraining": train_info,
    }


def summary_line(report: dict[str, Any]) -> str:
    up = report["ppl_uptrained"]
    return (
        f"ppl_original={report['ppl_original']:.4g} ppl_fit={report['ppl_fit']:.4g} "
        f"ppl_uptrained={'none' if up is None else f'{up:.4g}'} cache_ratio={report['cache_ratio']:.4g}"
    )
