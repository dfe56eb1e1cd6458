"""The scaling sweep's plots: each variant's gap against model size or compute (per-size means with
their intervals, the fitted line with its band), and a grid's cells at one N. Drawn only over the sizes
trained; matplotlib loads when the first figure is drawn."""

from __future__ import annotations

import math
from pathlib import Path

from qkvlab.analysis.factorial import grid_factors, settings
from qkvlab.analysis.scaling import Scaling, gap_pct
from qkvlab.base.files import save_figure
from qkvlab.base.units import human


def pyplot():
    """matplotlib.pyplot on the Agg backend."""
    # startup: matplotlib, imported when a figure is drawn
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # startup: as above

    return plt


def plot_scaling(sc: Scaling, path: str | Path, *, against: str = "params") -> Path:
    """Gap vs N (against='params') or vs compute 6ND ('compute'), log x: per variant the per-size
    mean with its interval and the fitted line with its 95% confidence band, over the sizes trained."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8.5, 5.5))
    cmap = plt.get_cmap("tab10")
    xs = {s: sc.size_params[s] if against == "params" else sc.size_compute(s) for s in sc.sizes}
    lo_x, hi_x = math.log10(min(xs.values())), math.log10(max(xs.values()))
    grid = [lo_x + (hi_x - lo_x) * k / 60 for k in range(61)]
    for i, v in enumerate(sc.variants):
        c = cmap(i % 10)
        sizes = [s for s in sc.sizes if s in v.gaps]
        ys = [v.gaps[s] for s in sizes]
        err = [
            [iv.estimate - iv.lo if iv.defined else 0 for iv in ys],
            [iv.hi - iv.estimate if iv.defined else 0 for iv in ys],
        ]
        nudge = 1.04 ** (i - (len(sc.variants) - 1) / 2)  # side by side at a size (log axis)
        ax.errorbar(
            [xs[s] * nudge for s in sizes],
            [iv.estimate for iv in ys],
            yerr=err,
            fmt="o",
            color=c,
            capsize=3,
            label=v.variant,
        )
        fit = v.fit_params if against == "params" else v.fit_compute
        if fit is None:
            continue
        line = [fit.predict(x, new_observation=False).map(gap_pct) for x in grid]
        ax.plot([10**x for x in grid], [p.estimate for p in line], color=c, lw=1.2, ls="--")
        if line[0].defined:
            ax.fill_between(
                [10**x for x in grid], [p.lo for p in line], [p.hi for p in line], color=c, alpha=0.08, lw=0
            )
    ax.axhline(0, color="black", lw=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("non-embedding parameters N (log)" if against == "params" else "training compute 6·N·D, FLOPs (log)")
    ax.set_ylabel("perplexity vs Q-K-V (%)")
    title = "gap to Q-K-V vs " + ("model size" if against == "params" else "training compute")
    ax.set_title(
        title + " (dots: mean, 95% CI over seeds; dashed: fit, band: its 95% CI; sizes trained only)", fontsize=9
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=4, framealpha=0.9)
    fig.tight_layout()
    path = Path(path)
    save_figure(fig, path, dpi=150, bbox_inches="tight")
    plt.close(fig)
    return path


def plot_grid(sc: Scaling, path: str | Path) -> Path:
    """Cells of a grid at one N (a factorial): each variant's gap per cell against the last factor's
    levels, one line per setting of the others (lines that are not parallel are an interaction)."""
    plt = pyplot()
    factors = grid_factors(sc.sizes)
    names = list(factors)
    x_name, others = names[-1], names[:-1]
    fig, axes = plt.subplots(1, len(sc.variants), figsize=(5.5 * len(sc.variants), 4.5), squeeze=False)
    for ax, v in zip(axes[0], sc.variants):
        lines: dict[tuple[str, ...], list[tuple[int, str]]] = {}
        for s in sc.sizes:
            setting = dict(settings(s))
            lines.setdefault(tuple(setting[n] for n in others), []).append((factors[x_name].index(setting[x_name]), s))
        for k, (key, cells) in enumerate(sorted(lines.items())):
            cells.sort()
            xs = [i + 0.03 * (k - (len(lines) - 1) / 2) for i, _ in cells]
            ivs = [v.gaps[s] for _, s in cells]
            err = [[iv.estimate - iv.lo for iv in ivs], [iv.hi - iv.estimate for iv in ivs]]
            label = ", ".join(f"{n} {val}" for n, val in zip(others, key)) or v.variant
            ax.errorbar(xs, [iv.estimate for iv in ivs], yerr=err, fmt="o-", capsize=3, label=label)
            for x, (_, s) in zip(xs, cells):
                seeds = [gap_pct(d) for size, d in v.points if size == s]
                ax.plot([x] * len(seeds), seeds, "x", color="grey", ms=4)
        ax.set_xticks(range(2), [f"{x_name} {lv}" for lv in factors[x_name]])
        ax.set_xlim(-0.5, 1.5)
        ax.axhline(0, color="black", lw=0.8)
        ax.set_ylabel(f"{v.variant}: perplexity vs Q-K-V (%)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"gap per cell at N {human(sc.largest)} (dots: mean, 95% CI over seeds; x: each seed)", fontsize=9)
    fig.tight_layout()
    path = Path(path)
    save_figure(fig, path, dpi=150, bbox_inches="tight")
    plt.close(fig)
    return path
