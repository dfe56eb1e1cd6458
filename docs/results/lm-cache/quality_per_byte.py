"""Quality per cache byte: every route to a smaller KV cache (compare/recipes.py CACHE_ROUTES) against the
fraction of Q-K-V's cache it keeps, from a finished compare folder of that recipe (its run folders, or its
committed scores.json: docs/results/lm-cache).

    python docs/results/lm-cache/quality_per_byte.py FOLDER OUT.png

Prints one markdown table, a row per variant: what it caches, its parameters, its test perplexity (exp of
the mean test loss over seeds, 95% t-interval with the test split's own error), its perplexity change
against Q-K-V (paired by seed, 95%: the interval results.md shows) and its rank within its budget. Draws
OUT.png: the same two figures against the cache fraction, one line per route from Q-K-V, 95% bars.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from qkvlab.analysis.estimates import level_estimate  # noqa: E402
from qkvlab.analysis.intervals import LEVEL, Interval  # noqa: E402
from qkvlab.analysis.results import collect  # noqa: E402
from qkvlab.base.files import save_figure  # noqa: E402
from qkvlab.compare.recipes import CACHE_ROUTES  # noqa: E402
from qkvlab.model.variants import BASELINE  # noqa: E402

ROUTES = {"MHA (Q-K-V)": (BASELINE,), **CACHE_ROUTES}


def points(folder: Path) -> list[dict]:
    """One dict per variant run: route, variant, cache fraction, numbers cached per token and layer,
    non-embedding parameters, test perplexity and paired change vs Q-K-V (Intervals), seeds."""
    res = collect(folder)
    values, gaps = res.values()["lm"], res.gaps()
    out = []
    for route, variants in ROUTES.items():
        for name in variants:
            row = res.row("lm", name)
            if row is None:
                continue
            ppl = level_estimate(values[name]).interval(LEVEL).map(math.exp)
            change = gaps.get(("lm", name), Interval(0.0, 0.0, 0.0, row.n))  # Q-K-V: the reference
            numbers = row.kv_bytes // (2 * row.cfg.n_layer)  # bf16 bytes over layers -> numbers per layer
            params = row.params.non_embedding
            out.append(dict(route=route, variant=name, fraction=row.kv_fraction, numbers=numbers, params=params))
            out[-1].update(ppl=ppl, change=change, seeds=row.n)
    return out


def table(pts: list[dict]) -> str:
    lines = [
        "| cache vs Q-K-V | route | variant | cached per token and layer | non-emb. params | test perplexity "
        f"({LEVEL:.0%} CI) | vs Q-K-V (paired {LEVEL:.0%} CI) | rank in its budget | seeds |",
        "| ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for frac in sorted({p["fraction"] for p in pts}, reverse=True):
        budget = sorted((p for p in pts if p["fraction"] == frac), key=lambda p: p["change"].estimate)
        for rank, p in enumerate(budget, 1):
            ppl, ch = p["ppl"], p["change"]
            change = "reference" if p["variant"] == BASELINE else f"{ch.estimate:+.2f}% [{ch.lo:+.2f}, {ch.hi:+.2f}]"
            lines.append(
                f"| {frac:.0%} | {p['route']} | `{p['variant']}` | {p['numbers']} | {p['params']:,} "
                f"| {ppl.estimate:.2f} [{ppl.lo:.2f}, {ppl.hi:.2f}] | {change} | {rank} of {len(budget)} | {p['seeds']} |"
            )
    return "\n".join(lines) + "\n"


def plot(pts: list[dict], out: Path) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    base = next(p for p in pts if p["variant"] == BASELINE)
    for k, route in enumerate(r for r in ROUTES if r != "MHA (Q-K-V)"):
        line = [base] + [p for p in pts if p["route"] == route]
        nudge = 1.025 ** (k - 1.5)  # routes side by side at each budget (log axis)
        for ax, key in zip(axes, ("change", "ppl")):
            xs = [100 * p["fraction"] * (nudge if p is not base else 1) for p in line]
            ys = [p[key].estimate for p in line]
            err = [[p[key].estimate - p[key].lo for p in line], [p[key].hi - p[key].estimate for p in line]]
            ax.errorbar(xs, ys, yerr=err, fmt="o-", ms=5, capsize=3, label=route, color=f"C{k}")
    seeds = max(p["seeds"] for p in pts)
    titles = (
        f"perplexity vs Q-K-V (%), paired by seed, {LEVEL:.0%} CI",
        f"test perplexity, {LEVEL:.0%} CI over seeds",
    )
    for ax, title in zip(axes, titles):
        ax.set_xscale("log", base=2)
        ax.set_xticks([25, 50, 100], ["25%", "50%", "100%"])
        ax.set_xlim(20, 125)
        ax.set_xlabel("KV cache per token, % of Q-K-V's")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
    axes[0].axhline(0, color="black", lw=0.8)
    axes[0].legend(fontsize=8)
    fig.suptitle(
        f"quality per cache byte, trained from scratch ({seeds} seed{'s' * (seeds != 1)} per variant)", fontsize=11
    )
    fig.tight_layout()
    save_figure(fig, out, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", type=Path, help="a finished compare folder of the lm-cache recipe")
    ap.add_argument("out", type=Path, help="the plot to write (never replaces a file)")
    args = ap.parse_args()
    if args.out.exists():
        raise SystemExit(f"{args.out} exists; choose another OUT")
    pts = points(args.folder)
    plot(pts, args.out)
    print(table(pts), end="")


if __name__ == "__main__":
    main()
