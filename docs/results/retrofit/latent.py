"""A low-rank joint key/value latent at K=V's cache bytes and below, fitted per layer: is K=V the best use of a budget?

Every layer of SOURCE gets key and value rows of rank r (src/qkvlab/convert/retrofit_latent.py: the
closed form on the retrofit's calibration windows, α chosen per layer by held output error, then
--refine-steps Adam steps on the factors per layer, as `qkvlab retrofit` refines K=V layers), and the
model is scored like curves.py: held-out perplexity on the calibration corpus's held-out tenth and on
each --text. K=V's closed-form fit (retrofit_fit.fit, no steps) on the same windows is scored beside it.
A latent of r numbers per token is r / (2 · kv_heads · head_dim) of the cache (a count: qkvlab has no
latent cache yet; module doc of retrofit_latent.py).

Run: python docs/results/retrofit/latent.py SOURCE OUT.json --data CORPUS [--ranks 96 192 288]
         [--refine-steps 0] [--text NAME=PATH ...] [--calib-tokens 8192] [--eval-tokens 8192]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from curves import text_tokens  # beside this script (run as a file, its folder is on sys.path)

from qkvlab.base.files import atomic_write, json_text, labelled_path
from qkvlab.model.accounting import kv_cache_bytes_per_token
from qkvlab.retrofit.fit import attention_inputs, fit
from qkvlab.retrofit.latent import ALPHAS, fit_latent_layer, latent_model
from qkvlab.retrofit.refine import RefineOptions
from qkvlab.retrofit.scoring import perplexity
from qkvlab.retrofit.source import corpus_tokens, load_source


def fitted_latent(model, cfg, xs: list[torch.Tensor], rank: int, refine: RefineOptions | None, say):
    """model as a latent model of rank `rank` (kv_latent: its cache holds the latent), and per layer
    fit_latent_layer's report."""
    layers, report = [], []
    for i, (block, x) in enumerate(zip(model.trunk.blocks, xs)):
        factored, info = fit_latent_layer(block.attn, x, rank, model.trunk.rotary, refine)
        layers.append(factored)
        report.append({"layer": i, **info})
        say(
            f"rank {rank}, layer {i}: alpha {info['alpha']}, held output error {info['error_fit']:.4f} -> {info['error']:.4f}"
        )
    return latent_model(model, cfg, layers)[0], report


def kv_row(model, cfg, train, xs, args, score) -> dict:
    """K=V's closed-form fit on every layer (qkvlab retrofit's fit without refinement), scored."""
    kv = fit(model, cfg, train, to="Q-K=V", inputs=xs, calib_tokens=args.calib_tokens, block=args.block)
    frac = kv_cache_bytes_per_token(kv.cfg) / kv_cache_bytes_per_token(cfg)
    errors = [lf.error_fit for lf in kv.layers]
    row = {"route": "K=V, closed-form fit", "cache_fraction": frac, **score(kv.model.float().eval())}
    return {**row, "mean_output_error": sum(errors) / len(errors)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("source")
    ap.add_argument("out")
    ap.add_argument("--data", required=True, help="the calibration corpus, as `qkvlab retrofit --data` takes it")
    ap.add_argument("--ranks", type=int, nargs="+", default=[96, 192, 288])
    ap.add_argument("--text", action="append", default=[], metavar="NAME=PATH")
    ap.add_argument("--calib-tokens", type=int, default=8192)
    ap.add_argument("--eval-tokens", type=int, default=8192)
    ap.add_argument("--block", type=int, default=256)
    ap.add_argument("--refine-steps", type=int, default=0, help="Adam steps per layer on the factors (0: closed form)")
    ap.add_argument("--no-kv", action="store_true", help="skip K=V's closed-form fit")
    args = ap.parse_args()
    out = Path(args.out)
    if out.exists():
        raise SystemExit(f"{out} exists; choose another OUT")
    t0 = time.time()
    say = lambda s: print(f"[{time.time() - t0:7.1f}s] {s}", flush=True)  # noqa: E731
    src = load_source(args.source)
    model, cfg = src.model.float().eval(), src.cfg
    train, held = corpus_tokens(src, args.data)
    texts = {"heldout": held}
    for item in args.text:
        name, path = labelled_path(item)
        texts[name] = text_tokens(src.encode, path, src.eot_id)
    width = 2 * max(cfg.layer_config(i).n_kv_heads for i in range(cfg.n_layer)) * cfg.head_dim
    bad = [r for r in args.ranks if not 0 < r < width]
    if bad:
        raise SystemExit(f"--ranks {bad}: each must be in [1, {width - 1}] (2 · kv_heads · head_dim = {width})")

    def score(m) -> dict:
        return {name: perplexity(m, t, block=args.block, max_tokens=args.eval_tokens) for name, t in texts.items()}

    xs = attention_inputs(model, train, args.calib_tokens, args.block)
    rows = [{"route": "original", "cache_fraction": 1.0, **score(model)}]
    say(json.dumps(rows[-1]))
    if not args.no_kv:
        rows.append(kv_row(model, cfg, train, xs, args, score))
        say(json.dumps(rows[-1]))
    refine = RefineOptions(steps=args.refine_steps) if args.refine_steps else None
    how = f"{args.refine_steps} steps per layer" if refine else "closed-form fit"
    layers = {}
    for rank in args.ranks:
        m, report = fitted_latent(model, cfg, xs, rank, refine, say)
        row = {"route": f"latent r={rank}, {how}", "rank": rank, "cache_fraction": rank / width, **score(m)}
        row["mean_output_error"] = sum(r["error"] for r in report) / len(report)
        row["mean_output_error_fit"] = sum(r["error_fit"] for r in report) / len(report)
        rows.append(row)
        layers[rank] = report
        say(json.dumps(row))
    body = {"source": args.source, "data": args.data, "calib_tokens": args.calib_tokens, "block": args.block}
    body.update({"eval_tokens": args.eval_tokens, "refine_steps": args.refine_steps, "alphas": ALPHAS})
    body.update({"rows": rows, "layers": layers, "wall_s": round(time.time() - t0, 1)})
    atomic_write(out, json_text(body, indent=2))
    print("| route | cache | " + " | ".join(texts) + " | mean held output error |")
    print("|---|---:|" + "---:|" * (len(texts) + 1))
    base = rows[0]
    for r in rows:
        cells = " | ".join(f"{r[n]:.2f} (×{r[n] / base[n]:.3f})" for n in texts)
        err = f"{r['mean_output_error']:.4f}" if "mean_output_error" in r else "—"
        print(f"| {r['route']} | {r['cache_fraction']:.3f} | {cells} | {err} |")


if __name__ == "__main__":
    main()
