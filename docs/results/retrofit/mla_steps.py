"""Where an MLA retrofit's quality goes: each lossy step of retrofit/mla.py applied one after the other to every
layer of SOURCE, each model scored on every text against the original on the same windows (ratio of perplexities
with its 95% interval over the windows, retrofit/scoring.py).

Steps, cumulative: `rope` (RoPE kept on one head's worth, RoRoPE; the latent as wide as the keys and values, no
norm), `latent` (the rank-R latent, no norm), `norm` (the latent norm, kept linear), `eps` (the main norms at the
latent norm's eps: the model `qkvlab retrofit` fits before refining), `refined` (the per-layer refinement steps:
the retrofit's fit, refined here on the original's inputs; --refine-steps 0 leaves it out) and, with --distilled RUN
(a `qkvlab retrofit` OUT of the same SOURCE, R and P), `fit` (the run's own fit/, as `retrofit` refined it) and
`distilled`.
The held-out text is the retrofit's own split of --data (the run's tokens.safetensors with --distilled).

Run: python docs/results/retrofit/mla_steps.py SOURCE OUT.json --rank R --rope-dim P [--distilled RUN]
         [--data SOURCE] [--text NAME=PATH ...] [--refine-steps 150] [--calib-tokens 8192] [--eval-tokens 8192]
         [--run-only]   (with --distilled: the run's fit and distilled model alone, no cumulative steps)
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

import torch
from curves import text_tokens  # beside this script (run as a file, its folder is on sys.path)
from safetensors.torch import load_file

from qkvlab.base.files import atomic_write, json_text, labelled_path
from qkvlab.base.loadavg import ScriptRun, add_options
from qkvlab.convert.load import load_any
from qkvlab.retrofit.fit import attention_inputs
from qkvlab.retrofit.latent import role_rows
from qkvlab.retrofit.mla import (
    LINEAR_LATENT_EPS,
    best_alpha,
    build_layer,
    choose_stride,
    fit_layer_at,
    kept_frequencies,
    mla_config,
    mla_rotary,
    plan_layer,
    split_rope,
)
from qkvlab.retrofit.refine import RefineOptions, refine_layer
from qkvlab.retrofit.scoring import ratio_interval, window_nll
from qkvlab.retrofit.source import corpus_tokens, load_source


def rope_only_layer(attn, plan, cfg, stride: int, rope_dim: int):
    """RoRoPE alone: the keys without RoPE and the values read back exactly (a latent as wide as both), no norm."""
    w = attn.in_proj.weight.detach().double()
    rows = split_rope(w[role_rows(attn, "q")], w[role_rows(attn, "k")], plan.dirs,
                      kept_frequencies(attn.head_dim, rope_dim, stride), attn.n_head, attn.kv_heads, attn.head_dim)  # fmt: skip
    n = attn.kv_heads * attn.head_dim
    eye = torch.eye(2 * n, dtype=torch.float64)
    full = mla_config(cfg, 2 * n, rope_dim, stride)
    return build_layer(attn, full, rows, torch.cat((rows.k_nope, w[role_rows(attn, "v")])), eye[:n], eye[n:], None)


def with_layers(model, layers, rotary, norm_eps: float | None = None):
    """A copy of model with every block's attention replaced (and its rotary; its main norms' eps when given)."""
    new = copy.deepcopy(model)
    for block, layer in zip(new.trunk.blocks, layers):
        block.attn = copy.deepcopy(layer).float()
    new.trunk.rotary = rotary
    if norm_eps is not None:  # the blocks' and the final norm, not the latent's own (kv_norm)
        for name, m in new.named_modules():
            if isinstance(m, torch.nn.RMSNorm) and not name.endswith("kv_norm"):
                m.eps = norm_eps
    return new.eval()


def step_models(model, cfg, calib, args, say):
    """(name, model) for every cumulative step."""
    xs = attention_inputs(model, calib, args.calib_tokens, min(cfg.context, 256), 0)
    plans = [plan_layer(b.attn, x, model.trunk.rotary) for b, x in zip(model.trunk.blocks, xs)]
    stride = choose_stride(model, cfg, plans, args.rank, args.rope_dim, say)
    mcfg = mla_config(cfg, args.rank, args.rope_dim, stride)
    rotary = mla_rotary(mcfg, model.trunk.rotary)
    blocks = list(model.trunk.blocks)
    alphas = [best_alpha(b.attn, p, mcfg, stride, rotary)[1] for b, p in zip(blocks, plans)]
    yield "rope", with_layers(model, [rope_only_layer(b.attn, p, cfg, stride, args.rope_dim) for b, p in zip(blocks, plans)], rotary)  # fmt: skip
    for norm in (False, True):
        layers = [fit_layer_at(b.attn, p, mcfg, stride, a, norm=norm) for b, p, a in zip(blocks, plans, alphas)]
        yield ("norm" if norm else "latent"), with_layers(model, layers, rotary)
    yield "eps", with_layers(model, layers, rotary, mcfg.norm_eps)
    if args.refine_steps == 0:
        return
    refine = RefineOptions(args.refine_steps, 1e-3, seed=0, inputs="original")
    for layer, b, x in zip(layers, blocks, xs):
        refine_layer(layer, b.attn, x, model.trunk.rotary, refine, new_rotary=rotary)
    yield "refined", with_layers(model, layers, rotary, mcfg.norm_eps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("source")
    ap.add_argument("out", type=Path)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--rope-dim", type=int, required=True)
    ap.add_argument("--distilled", type=Path, default=None)
    ap.add_argument("--data", default="shakespeare")
    ap.add_argument("--text", action="append", default=[], metavar="NAME=PATH")
    ap.add_argument("--refine-steps", type=int, default=150)
    ap.add_argument("--calib-tokens", type=int, default=8192)
    ap.add_argument("--eval-tokens", type=int, default=8192)
    ap.add_argument("--run-only", action="store_true", help="score only --distilled's fit and distilled models")
    add_options(ap)
    args = ap.parse_args()
    if args.run_only and args.distilled is None:
        raise SystemExit("--run-only scores a run's own models: give the run with --distilled RUN")
    if args.out.exists():
        raise SystemExit(f"{args.out} exists; choose another OUT")
    run = ScriptRun(args, "mla_steps")
    src = load_source(args.source)
    model, cfg = src.model.float().eval(), src.cfg
    calib, held = corpus_tokens(src, args.data, 0.1)
    if args.distilled is not None:  # the run's own split (the same text by construction; checked)
        held = load_file(str(args.distilled / "tokens.safetensors"))["val"]
    texts = {
        "shakespeare": held,
        **{n: text_tokens(src.encode, p, src.eot_id) for n, p in map(labelled_path, args.text)},
    }
    block = min(cfg.context, 256)  # the retrofit's default --block-size
    score = lambda m, t: window_nll(m, t, block=block, max_tokens=args.eval_tokens)  # noqa: E731
    base = {name: score(model, t) for name, t in texts.items()}
    rows = [{"step": "original", **{n: float(v.mean().exp()) for n, v in base.items()}}]
    models = [] if args.run_only else step_models(model, cfg, calib, args, print)
    if args.distilled is not None:  # the run's own fit (its fit/ folder), then the distilled model
        fitted = [("fit", load_any(args.distilled / "fit").model.float().eval())]
        models = [*models, *fitted, ("distilled", load_any(args.distilled).model.float().eval())]
    for name, m in models:
        t0 = time.perf_counter()
        row = {"step": name}
        for text, t in texts.items():
            r = ratio_interval(score(m, t), base[text])
            row[text] = [r.estimate, r.lo, r.hi]
        row["seconds"] = round(time.perf_counter() - t0, 1)
        rows.append(row)
        print(json.dumps(row), flush=True)
    run.watch.finish()
    print(f"machine during the run: {run.watch.summary()}", flush=True)
    body = {"source": args.source, "rank": args.rank, "rope_dim": args.rope_dim, "latent_norm_eps": LINEAR_LATENT_EPS,
            "windows": {n: len(v) for n, v in base.items()}, "rows": rows, "load": run.watch.to_dict()}  # fmt: skip
    atomic_write(args.out, json_text(body, indent=2))


if __name__ == "__main__":
    main()
