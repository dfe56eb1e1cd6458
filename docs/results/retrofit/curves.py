"""A retrofit's curves: held-out perplexity against the KV-cache fraction (fit only, the layers with
the lowest output error converted first) and against distillation tokens, on the run's held-out
text and on other texts the retrofit never read.

Run after `qkvlab retrofit SOURCE RUN ...` (every layer converted; README.md here has the command):

    python docs/results/retrofit/curves.py SOURCE RUN OUT [--text NAME=PATH ...] [--layers 0,4,8,...]

SOURCE: the original model (what the retrofit read); RUN: the retrofit's OUT (fit/, retrofit.json,
tokens.safetensors, uptrain/metrics.jsonl); OUT: a new folder for curves.json, ppl_vs_cache.png,
ppl_vs_tokens.png and samples.md. Each --text is scored on its first --eval-tokens tokens in
windows of the run's block (e.g. moby=path/to/moby-dick, see scripts/get_eval_texts.sh).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from qkvlab.base.files import atomic_write, json_text, labelled_path, save_figure
from qkvlab.convert.load import load_any
from qkvlab.data.text import load_corpus
from qkvlab.decode.generate import generate
from qkvlab.decode.sampling import Sampling
from qkvlab.model.accounting import kv_cache_bytes_per_token
from qkvlab.model.folder import load_model
from qkvlab.retrofit.fit import with_layers
from qkvlab.retrofit.scoring import perplexity
from qkvlab.retrofit.source import load_source
from qkvlab.tasks import get_task
from qkvlab.train.config import TrainConfig
from qkvlab.train.run_folder import TRAIN_CONFIG

PROMPTS = [
    "The capital of France is",
    "To be, or not to be, that is",
    "Call me Ishmael. Some years ago",
    "The best way to learn a new language is",
]


def text_tokens(encode, path: str, eot: int | None) -> torch.Tensor:
    ids: list[int] = []
    for doc in load_corpus(path):
        ids += encode(doc.text) + ([] if eot is None else [eot])
    return torch.tensor(ids, dtype=torch.long)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("source")
    ap.add_argument("run", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--text", action="append", default=[], metavar="NAME=PATH")
    ap.add_argument("--layers", default="0,4,8,12,15,20,25,30", help="numbers of layers converted, fit only")
    ap.add_argument("--eval-tokens", type=int, default=8192)
    ap.add_argument("--new-tokens", type=int, default=24)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=False)  # a new folder: nothing of the user's is overwritten
    t0 = time.time()
    say = lambda s: print(f"[{time.time() - t0:6.0f}s] {s}", flush=True)  # noqa: E731
    report = json.loads((args.run / "retrofit.json").read_text())
    src = load_source(args.source)
    model, cfg = src.model.float().eval(), src.cfg
    fitted, fitted_cfg, _ = load_model(args.run / "fit", dtype=torch.float32)
    block = report["options"]["block_size"] or min(cfg.context, 256)
    texts = {"heldout": load_file(str(args.run / "tokens.safetensors"))["val"]}
    for item in args.text:
        name, path = labelled_path(item)
        texts[name] = text_tokens(src.encode, path, src.eot_id)
    score = lambda m: {  # noqa: E731
        name: perplexity(m, toks, block=block, max_tokens=args.eval_tokens) for name, toks in texts.items()
    }
    by_cost = [lf["layer"] for lf in sorted(report["layers"], key=lambda lf: (lf["error"], lf["layer"]))]
    cache_rows = []
    for k in [int(x) for x in args.layers.split(",")]:
        layers = sorted(by_cost[:k])
        m, m_cfg = (model, cfg) if k == 0 else with_layers(model, cfg, fitted, fitted_cfg, layers)
        fraction = kv_cache_bytes_per_token(m_cfg) / kv_cache_bytes_per_token(cfg)
        row = {"layers_converted": k, "layers": layers, "cache_fraction": fraction, **score(m)}
        cache_rows.append(row)
        say(f"K={k}: " + ", ".join(f"{n} {v:.2f}" for n, v in row.items() if n in texts))
    final = load_any(args.run).model.float().eval() if report.get("ppl_uptrained") else None
    final_scores = score(final) if final is not None else None
    log = args.run / "uptrain" / "metrics.jsonl"
    metrics = [json.loads(line) for line in log.read_text().splitlines()] if log.is_file() else []
    opts = report["options"]
    per_step = opts["batch_size"] * block
    token_rows = [
        {"step": r["step"], "tokens": r["step"] * per_step, "val_ppl": r["val_ppl"], "val_kl": r.get("val_kl")}
        for r in metrics
        if "val_ppl" in r
    ]
    teacher_val = None
    if token_rows:  # the original on the same validation windows the loop scored (the distill task's evaluation)
        task = get_task(
            "distill",
            teacher=str(args.source),
            student=str(args.run / "fit"),
            tokens=str(args.run / "tokens.safetensors"),
            block_size=block,
        )
        tc = TrainConfig.from_dict(json.loads((args.run / "uptrain" / TRAIN_CONFIG).read_text()))
        teacher_val = task.evaluate(model, batch_size=tc.val_batch_size, max_batches=tc.eval_batches)["val_ppl"]
    samples = []
    for prompt in PROMPTS:
        ids = src.encode(prompt)[-(cfg.context - args.new_tokens) :]
        row = {"prompt": prompt}
        for name, m in (("original", model), ("fit", fitted), ("uptrained", final)):
            if m is not None:
                row[name] = src.decode(ids + generate(m, [ids], args.new_tokens, Sampling(temperature=0))[0])
        samples.append(row)
    body = {
        "source": str(args.source),
        "run": str(args.run),
        "block": block,
        "eval_tokens": {n: min(len(t) - 1, args.eval_tokens) // block * block for n, t in texts.items()},
        "layers_by_output_error": by_cost,
        "cache_curve_fit_only": cache_rows,
        "uptrained": final_scores,
        "distillation_curve": token_rows,
        "original_val_ppl": teacher_val,
        "samples": samples,
        "wall_s": round(time.time() - t0),
    }
    atomic_write(args.out / "curves.json", json_text(body, indent=2))
    plot(args.out, cache_rows, token_rows, final_scores, report, list(texts), teacher_val)
    lines = ["# Greedy continuations (original | fit only | fit + distillation)", ""]
    for row in samples:
        lines += [f"**{row['prompt']}**", ""] + [f"- {k}: {v!r}" for k, v in row.items() if k != "prompt"] + [""]
    atomic_write(args.out / "samples.md", "\n".join(lines))
    say(f"wrote {args.out}")


def plot(out: Path, cache_rows, token_rows, final_scores, report, names, teacher_val: float | None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name in names:
        base = cache_rows[0][name]
        ax.plot([r["cache_fraction"] for r in cache_rows], [r[name] / base for r in cache_rows], "o-", label=name)
        if final_scores is not None:
            ax.plot(
                [cache_rows[-1]["cache_fraction"]], [final_scores[name] / base], "*", ms=12, label=f"{name}, distilled"
            )
    ax.set_xlabel("KV cache, fraction of the original")
    ax.set_ylabel("perplexity / original's")
    ax.set_title(f"{report['scheme']} on the layers with the lowest output error, fit only", fontsize=9)
    ax.invert_xaxis()
    ax.grid(alpha=0.3)
    ax.legend()
    save_figure(fig, out / "ppl_vs_cache.png", dpi=120, bbox_inches="tight")
    plt.close(fig)
    if teacher_val is None:  # a fit-only run: no distillation curve
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([r["tokens"] for r in token_rows], [r["val_ppl"] / teacher_val for r in token_rows], "o-")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xlabel("distillation tokens")
    ax.set_ylabel("perplexity / original's (held-out validation windows)")
    ax.set_title(f"{report['scheme']}: cache {report['cache_ratio']:.2f} of the original")
    ax.grid(alpha=0.3)
    save_figure(fig, out / "ppl_vs_tokens.png", dpi=120, bbox_inches="tight")
    plt.close(fig)


if __name__ == "__main__":
    main()
