"""Distillation runs side by side: the validation KL to the teacher (nats a token) and the validation
perplexity against distillation tokens, one line per run, from each run's `metrics.jsonl` (a retrofit's
`OUT/uptrain/metrics.jsonl`, or the committed copy in a folder here).

    python docs/results/retrofit/distill_curves.py OUT.png NAME=RUN [NAME=RUN ...]   # NAME may hold "=" (K=V)

RUN: a folder holding metrics.jsonl or uptrain/metrics.jsonl. Prints one table row per run and evaluation
step: tokens, validation KL, validation perplexity.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from routes import named_inputs  # noqa: E402  (beside this script: run as a file, its folder is on sys.path)

from qkvlab.base.files import save_figure  # noqa: E402


def read_evaluations(folder: Path) -> list[dict]:
    """The evaluation rows (those with a validation KL) of a run's metrics.jsonl."""
    path = folder / "metrics.jsonl"
    if not path.is_file():
        path = folder / "uptrain" / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if r.get("val_kl") is not None]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("runs", nargs="+", metavar="NAME=RUN")
    args = ap.parse_args()
    runs = named_inputs(args.out, args.runs, read_evaluations)
    print("| run | step | tokens | val KL | val ppl |\n|---|---:|---:|---:|---:|")
    for name, rows in runs.items():
        for r in rows:
            print(f"| {name} | {r['step']} | {r['tokens']:,} | {r['val_kl']:.3f} | {r['val_ppl']:.2f} |")
    fig, (kl, ppl) = plt.subplots(1, 2, figsize=(11, 4))
    for name, rows in runs.items():
        tokens = [r["tokens"] / 1e3 for r in rows]
        kl.plot(tokens, [r["val_kl"] for r in rows], "o-", ms=3, label=name)
        ppl.plot(tokens, [r["val_ppl"] for r in rows], "o-", ms=3, label=name)
    kl.set_ylabel("validation KL(teacher || student), nats a token")
    ppl.set_ylabel("validation perplexity")
    for ax in (kl, ppl):
        ax.set_xlabel("distillation tokens (thousands)")
        ax.grid(alpha=0.3)
    kl.legend(fontsize=8)
    save_figure(fig, args.out, dpi=120, bbox_inches="tight")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
