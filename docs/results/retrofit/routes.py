"""Routes to a smaller KV cache side by side: perplexity against the cache fraction for several
retrofits of one model (e.g. K=V and MQA), each from its own `curves.py` output (with the run's
retrofit.json beside it or at the run), one line per route and text, the distilled points starred.

    python docs/results/retrofit/routes.py OUT.png NAME=CURVES_DIR [NAME=CURVES_DIR ...] [--text heldout]

Prints one table row per (route, point): cache fraction, layers converted, perplexity / original's.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from qkvlab.base.files import labelled_path, save_figure  # noqa: E402

T = TypeVar("T")


def named_inputs(out: Path, items: list[str], read: Callable[[Path], T]) -> dict[str, T]:
    """Refuse an existing OUT (a plot never replaces a file), then NAME=FOLDER items -> {NAME: read(FOLDER)}
    (files.labelled_path: a name and a folder may both hold "=")."""
    if out.exists():
        raise SystemExit(f"{out} exists; choose another OUT")
    return {name: read(Path(folder)) for name, folder in map(labelled_path, items)}


def read_route(folder: Path) -> dict:
    body = json.loads((folder / "curves.json").read_text())
    beside = folder / "retrofit.json"  # the committed copy, else the run's own
    report = json.loads((beside if beside.is_file() else Path(body["run"]) / "retrofit.json").read_text())
    return {"curves": body, "cache_ratio": report["cache_ratio"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("routes", nargs="+", metavar="NAME=CURVES_DIR")
    ap.add_argument("--text", action="append", help="texts to plot (default: every text of the first route)")
    args = ap.parse_args()
    routes = named_inputs(args.out, args.routes, read_route)
    first = next(iter(routes.values()))["curves"]["cache_curve_fit_only"][0]
    texts = args.text or [k for k in first if k not in ("layers_converted", "layers", "cache_fraction")]
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    print("| route | text | cache | layers converted | ppl / original's |")
    print("|---|---|---:|---:|---:|")
    for (name, route), colour in zip(routes.items(), plt.rcParams["axes.prop_cycle"].by_key()["color"]):
        rows = route["curves"]["cache_curve_fit_only"]
        for text, style in zip(texts, ("o-", "s--", "^:")):
            base = rows[0][text]
            xs, ys = [r["cache_fraction"] for r in rows], [r[text] / base for r in rows]
            ax.plot(xs, ys, style, color=colour, label=f"{name}, fit only ({text})")
            for r, y in zip(rows, ys):
                print(f"| {name} | {text} | {r['cache_fraction']:.3f} | {r['layers_converted']} | ×{y:.3f} |")
            distilled = route["curves"].get("uptrained")
            if distilled:
                y = distilled[text] / base
                ax.plot([route["cache_ratio"]], [y], "*", ms=13, color=colour, label=f"{name}, distilled ({text})")
                print(f"| {name}, distilled | {text} | {route['cache_ratio']:.3f} | — | ×{y:.3f} |")
    ax.set_xlabel("KV cache, fraction of the original")
    ax.set_ylabel("perplexity / original's")
    ax.set_title("routes to a smaller cache: cheapest layers first (output error)", fontsize=9)
    ax.invert_xaxis()
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    save_figure(fig, args.out, dpi=120, bbox_inches="tight")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
