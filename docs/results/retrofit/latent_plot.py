"""Perplexity against the KV-cache fraction: latent.py's curves beside scored retrofits, one panel per text.

    python docs/results/retrofit/latent_plot.py OUT.png --curve NAME=LATENT.json [...] [--point NAME=SCORES.json ...]

--curve: a latent.py output (its rows with a rank form the line; its "original" row is the baseline for
every ratio, its K=V closed-form row a point); --point: a subset_of_distilled.py output (every row a point,
e.g. a distilled run). Prints the table of ratios the plot shows.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from routes import named_inputs  # noqa: E402  (beside this script)

from qkvlab.base.files import save_figure  # noqa: E402


def read_rows(path: Path) -> list[dict]:
    return json.loads(path.read_text())["rows"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--curve", action="append", required=True, metavar="NAME=LATENT.json")
    ap.add_argument("--point", action="append", default=[], metavar="NAME=SCORES.json")
    args = ap.parse_args()
    curves = named_inputs(args.out, args.curve, read_rows)
    points = named_inputs(args.out, args.point, read_rows)
    first = next(iter(curves.values()))
    base = next(r for r in first if r["route"] == "original")
    texts = [k for k in base if k not in ("route", "cache_fraction")]
    for name, rows in curves.items():  # the closed-form K=V row of a curve file is a point of its own
        for r in rows:
            if "rank" not in r and r["route"] != "original":
                points[r["route"] if r["route"] not in points else f"{r['route']} ({name})"] = [r]
    fig, axes = plt.subplots(1, len(texts), figsize=(4.2 * len(texts), 4.0), sharey=True)
    top = 1.9  # points above it are drawn at the top edge with their value written beside
    print("| route | cache | " + " | ".join(texts) + " |")
    print("|---|---:|" + "---:|" * len(texts))
    for ax, text in zip(axes, texts):
        for name, rows in curves.items():
            line = sorted((r for r in rows if "rank" in r), key=lambda r: r["cache_fraction"])
            ax.plot([r["cache_fraction"] for r in line], [r[text] / base[text] for r in line], "o-", label=name)
        for (name, rows), marker in zip(points.items(), "s^vD*PX"):
            xs, ys = [r["cache_fraction"] for r in rows], [r[text] / base[text] for r in rows]
            ax.plot(xs, [min(y, top * 0.98) for y in ys], marker, ms=8, label=name)
            for x, y in zip(xs, ys):
                if y > top:
                    ax.annotate(f"×{y:.1f}", (x, top * 0.98), xytext=(6, -4), textcoords="offset points", fontsize=7)
        ax.axhline(1.10, color="grey", lw=0.8, ls="--")
        ax.set_title(text, fontsize=9)
        ax.set_xlabel("KV cache, fraction of the original")
        ax.set_ylim(0.95, top)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("perplexity / original's (dashed: ×1.10)")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=7, bbox_to_anchor=(0.5, -0.15))
    for name, rows in [*((n, [r for r in rs if "rank" in r]) for n, rs in curves.items()), *points.items()]:
        for r in rows:
            label = f"{name}, r={r['rank']}" if "rank" in r else name
            cells = " | ".join(f"×{r[t] / base[t]:.3f}" for t in texts)
            print(f"| {label} | {r['cache_fraction']:.3f} | {cells} |")
    fig.suptitle("SmolLM2-135M: a joint low-rank K/V latent against K=V and MQA", fontsize=10)
    save_figure(fig, args.out, dpi=120, bbox_inches="tight")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
