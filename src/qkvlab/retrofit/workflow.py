"""Retrofit a trained model to a smaller KV cache: fit, then uptrain by distillation, and report.

The fits (retrofit/fit.py: K=V and fewer kv heads; retrofit/latent.py: a key/value latent; retrofit/mla.py:
Multi-head Latent Attention) convert every chosen layer from calibration text and refine it against the original
layer's attention output (retrofit/refine.py); this module is the whole procedure around them:

- the source and text (retrofit/source.py): a qkvlab folder, a Hugging Face folder or a .gguf with its tokenizer;
  every document's first (1 - f) tokens calibrate and train, its last f are held out;
- uptraining with the training engine (train/loop.py, resumable, checkpoints): the `distill` task
  (tasks/distill.py), LM loss plus KL(teacher || student) at temperature 1;
- the report: held-out perplexity of the original, after the fit and after uptraining, each ratio with its
  interval over the held-out windows (retrofit/scoring.py), and the KV-cache bytes per token before and after.

Every phase shows its progress (a bar with rate and ETA where there is a count, a line with its time where not).
"""

from __future__ import annotations

import shutil
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from qkvlab.base.devices import select_device
from qkvlab.base.errors import RUN_AGAIN, NoRoom, UserError, as_user_error
from qkvlab.base.files import atomic_dir, atomic_write, json_text
from qkvlab.base.folders import claimed, inspect
from qkvlab.base.settings import resumable_fields
from qkvlab.convert.load import TOKENIZER_DIR, save_hf_tokenizer
from qkvlab.data.text import describe_source
from qkvlab.model.accounting import analytic_params, kv_cache_bytes_per_token
from qkvlab.model.config import ModelConfig
from qkvlab.model.folder import load_model, write_model_files
from qkvlab.retrofit.fit import FitResult, LayerFit, candidate_layers, fit
from qkvlab.retrofit.latent import check_source as check_latent_source
from qkvlab.retrofit.latent import fit_latent
from qkvlab.retrofit.mla import check_source as check_mla_source
from qkvlab.retrofit.mla import fit_mla
from qkvlab.retrofit.options import FITS_BEFORE_THE_OPTION, RetrofitOptions, check_layers, source_shape
from qkvlab.retrofit.refine import RefineOptions
from qkvlab.retrofit.scoring import ratio_interval, window_nll
from qkvlab.retrofit.source import TOKENS_FILE, Source, corpus_tokens, load_source, write_tokens
from qkvlab.train.config import TrainConfig
from qkvlab.train.loop import train

REPORT = "retrofit.json"


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


class Phases:
    """What the procedure says as it goes: one line per phase with the time it took (`done`), bars inside."""

    def __init__(self, progress: bool):
        self.progress, self.t0 = progress, time.perf_counter()

    def say(self, text: str) -> None:
        if self.progress:
            print(text, flush=True)

    def done(self, text: str) -> None:
        now = time.perf_counter()
        self.say(f"{text} ({now - self.t0:.0f} s)")
        self.t0 = now

    def bar(self, label: str) -> str | None:
        return label if self.progress else None


def _retrofit(source, out: Path, opts: RetrofitOptions, claim, *, resume: bool, progress: bool) -> dict[str, Any]:
    show = Phases(progress)
    device = select_device(opts.device)
    show.say(f"loading {source}")
    src = load_source(source)
    model, cfg = _checked_source(src, opts)
    model = model.float().to(device)
    show.done(f"loaded {cfg.scheme_label}, {analytic_params(cfg).total:,} parameters")
    block = opts.block_size or min(cfg.context, 256)
    train_ids, held_ids = _text(src, opts, progress)
    show.done(f"text: {len(train_ids):,} training and {len(held_ids):,} held-out tokens")
    write_tokens(out / TOKENS_FILE, train_ids, held_ids)
    claim.keep = True  # from here OUT is a retrofit folder that --resume continues
    score = lambda m, label: window_nll(m, held_ids, block=block, max_tokens=opts.eval_tokens, progress=show.bar(label))  # noqa: E731
    nll = {"original": score(model, "scoring the original")}
    show.done(f"original: held-out ppl {nll['original'].mean().exp():.4g} over {len(nll['original'])} windows")
    res = _fitted(model, cfg, train_ids, block, opts, out, resume, show)
    res.model.to(device)
    meta = {"retrofit_from": str(source), "retrofit": asdict(opts)}
    if not (out / "fit" / "config.json").is_file():
        (out / "fit").mkdir(exist_ok=True)
        fit_meta = {**meta, "fit_layers": [asdict(lf) for lf in res.layers], "converted_layers": res.converted}
        write_model_files(out / "fit", res.model, res.cfg, fit_meta)
    nll["fit"] = score(res.model, "scoring the fit")
    show.done(f"fit {res.cfg.scheme_label}: {ratio_interval(nll['fit'], nll['original']).text()} of the original's ppl")
    final, train_info = res.model, None
    if opts.steps > 0:
        trained = res.converted if opts.train == "converted" else None
        result = _uptrain(source, out, opts, res.cfg, block, trained, resume=resume, progress=progress)
        final, _, _ = load_model(out / "uptrain", device=device, dtype=torch.float32)
        nll["uptrained"] = score(final, "scoring the uptrained model")
        train_info = {"steps": result.step, "tokens": result.tokens, "last": result.metrics}
        show.done(f"uptrained ({result.step} steps): {ratio_interval(nll['uptrained'], nll['original']).text()}")
    counts = {"train": len(train_ids), "held": len(held_ids), "block": block}
    report = _report(source, cfg, res, opts, counts, nll, train_info)
    write_model_files(out, final, res.cfg, {**meta, "retrofit_report": REPORT})
    _copy_tokenizer(src, out)
    atomic_write(out / REPORT, json_text(report, indent=2))
    return report


def _checked_source(src: Source, opts: RetrofitOptions):
    """The source's model and config, with what the chosen fit cannot do refused before any text is read."""
    cfg = src.cfg
    check_layers((cfg.n_layer, cfg.n_head), opts)  # a .gguf: known only now, still before any perplexity
    if opts.kv_latent is None:
        candidate_layers(cfg, opts.layers, opts.kv_heads, opts.to)
    elif opts.rope_dim is not None:
        check_mla_source(cfg, opts.kv_latent, opts.rope_dim)
    else:
        check_latent_source(cfg, opts.kv_latent)
    return src.model, cfg


def _text(src: Source, opts: RetrofitOptions, progress: bool):
    train_ids, held_ids = corpus_tokens(src, opts.data, opts.heldout_fraction, progress=progress)
    if len(train_ids) - 1 < opts.calib_tokens:  # calibration_windows would quietly take fewer windows than asked
        raise UserError(
            f"corpus {describe_source(opts.data)!r} has {len(train_ids):,} training tokens, fewer than "
            f"--calib-tokens {opts.calib_tokens:,}; give more text or a smaller --calib-tokens"
        )
    return train_ids, held_ids


def _fitted(model, cfg: ModelConfig, train_ids, block: int, opts: RetrofitOptions, out: Path, resume: bool, show):
    """The fit OUT holds (on --resume), or a new one by the route the options name."""
    res = _reuse_fit(out / "fit", opts) if resume else None
    if res is not None:
        show.done(f"fit: reused {out / 'fit'} (written by the run being resumed)")
        return res
    common = dict(calib_tokens=opts.calib_tokens, block=block, seed=opts.seed, say=show.say)
    refine = RefineOptions(opts.refine_steps, opts.refine_lr, seed=opts.seed, inputs="original")
    if opts.rope_dim is not None:
        res = fit_mla(model, cfg, train_ids, rank=opts.kv_latent, rope_dim=opts.rope_dim, refine=refine, **common)
    elif opts.kv_latent is not None:
        res = fit_latent(model, cfg, train_ids, rank=opts.kv_latent, refine=refine, **common)
    else:
        refine = RefineOptions(opts.refine_steps, opts.refine_lr, seed=opts.seed, inputs=opts.refine_inputs)
        res = fit(model, cfg, train_ids, to=opts.to, kv_heads=opts.kv_heads, layers=opts.layers,
                  cache_budget=opts.cache_budget, pool=opts.pool, start=opts.start, refine=refine, **common)  # fmt: skip
    for lf in res.layers:
        mark = "converted" if lf.layer in res.converted else "kept"
        show.say(
            f"layer {lf.layer}: output error {lf.error:.4f} cache/token {lf.cache_bytes_before} -> "
            f"{lf.cache_bytes_after} B ({mark})"
        )
    show.done(f"fitted {len(res.converted)} of {cfg.n_layer} layers")
    return res


def _copy_tokenizer(src: Source, out: Path) -> None:
    """The result reads and serves text as its source did."""
    if src.tokenizer_dir is None and src.hf_tokenizer is None:
        return
    with atomic_dir(out / TOKENIZER_DIR) as tmp:
        if src.tokenizer_dir is not None:
            shutil.copytree(src.tokenizer_dir, tmp, dirs_exist_ok=True)
        else:
            save_hf_tokenizer(src.hf_tokenizer, tmp, src.generation_config)


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


def _report(source, cfg: ModelConfig, res: FitResult, opts: RetrofitOptions, counts, nll, train_info) -> dict:
    """The report: perplexities (ppl_original, ppl_fit, ppl_uptrained) and each ratio to the original with its
    95% interval over the held-out windows (ratio_fit, ratio_uptrained: [estimate, lo, hi])."""
    before, after = kv_cache_bytes_per_token(cfg), kv_cache_bytes_per_token(res.cfg)
    block = counts["block"]
    ppls = {f"ppl_{k}": float(v.mean().exp()) for k, v in nll.items()}
    ratios = {}
    for k in ("fit", "uptrained"):
        r = ratio_interval(nll[k], nll["original"]) if k in nll else None
        ratios[f"ratio_{k}"] = None if r is None else [r.estimate, r.lo, r.hi]
    return {
        "source": str(source),
        "original_scheme": cfg.scheme_label,
        "scheme": res.cfg.scheme_label,
        "converted_layers": res.converted,
        "layers": [asdict(lf) for lf in res.layers],
        "options": asdict(opts),
        "heldout_tokens_evaluated": min(counts["held"] - 1, opts.eval_tokens) // block * block,
        "heldout_windows": len(nll["original"]),
        "calibration_tokens": min(opts.calib_tokens, counts["train"] - 1) // block * block,
        "params_before": analytic_params(cfg).total,
        "params_after": analytic_params(res.cfg).total,
        "kv_cache_bytes_per_token_before": before,
        "kv_cache_bytes_per_token_after": after,
        "cache_ratio": after / before,
        "ppl_uptrained": None,
        **ppls,
        **ratios,
        "uptraining": train_info,
    }


def summary_line(report: dict[str, Any]) -> str:
    up = report["ppl_uptrained"]
    return (
        f"ppl_original={report['ppl_original']:.4g} ppl_fit={report['ppl_fit']:.4g} "
        f"ppl_uptrained={'none' if up is None else f'{up:.4g}'} cache_ratio={report['cache_ratio']:.4g}"
    )
