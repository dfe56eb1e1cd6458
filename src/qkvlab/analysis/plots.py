"""PNG plots of a compare folder (matplotlib, Agg: no display needed).

- ``val_loss.png``: validation loss against step per variant, mean over seeds, band min..max;
  one panel per task.
- ``ppl_vs_cache.png`` (language modelling): perplexity change vs Q-K-V against KV cache size
  (% of Q-K-V), this run's points with seed error bars, the papers' as hollow markers.
- ``metric_by_task.png`` (task families): grouped bars of the task metric per scheme per task,
  Paper B's figures as black ticks.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import matplotlib

matplotlib.use("Agg")
import csv

import matplotlib.pyplot as plt  # noqa: E402

from qkvlab.analysis import paper_figures as pf
from qkvlab.analysis.trends import plot_gap_trajectories
from qkvlab.base.errors import UserError
from qkvlab.base.files import save_figure  # noqa: E402

if TYPE_CHECKING:
    from qkvlab.analysis.results import Results

DPI = 150


def _colors(variants: list[str]) -> dict[str, tuple]:
    cmap = plt.get_cmap("tab10" if len(variants) <= 10 else "tab20")
    return {v: cmap(i % cmap.N) for i, v in enumerate(variants)}


def _mean_band(curves: list[tuple[list[float], list[float]]]):
    """Mean, min, max over seeds at the steps every seed has."""
    common = sorted(set.intersection(*(set(x) for x, _ in curves)))
    per = [dict(zip(x, y)) for x, y in curves]
    ys = [[p[s] for p in per] for s in common]
    return common, [sum(v) / len(v) for v in ys], [min(v) for v in ys], [max(v) for v in ys]


def plot_loss_curves(res: Results, path: Path) -> Path:
    tasks, variants = res.tasks, res.variants
    colors = _colors(variants)
    cols = min(len(tasks), 3)
    rows = -(-len(tasks) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6.5 * cols, 4.4 * rows), squeeze=False)
    for ax, task in zip(axes.flat, tasks):
        lows = []
        for v in variants:
            runs = [r for r in res.runs if r.task == task and r.variant == v]
            curves = [r.curve("val_loss") for r in runs]
            curves = [c for c in curves if c[0]]
            if not curves:
                continue
            x, mean, lo, hi = _mean_band(curves)
            ax.plot(x, mean, color=colors[v], label=f"{v} (n={len(curves)})", lw=1.6)
            if len(curves) > 1:
                ax.fill_between(x, lo, hi, color=colors[v], alpha=0.18, lw=0)
            lows.append(min(mean))
        ax.set_title(f"{task}: validation loss (mean over seeds, band min–max)", fontsize=10)
        ax.set_xlabel("step")
        ax.set_ylabel("validation loss")
        ax.grid(alpha=0.3)
        if lows:
            # Zoom on the end of training, where variants differ: start the y axis near the minima.
            finals = [l for l in lows]
            span = max(finals) - min(finals)
            ax.set_ylim(bottom=min(finals) - max(0.05, 0.5 * span))
            top = ax.get_ylim()[1]
            ax.set_ylim(top=min(top, min(finals) + max(1.0, 8 * span)))
        ax.legend(fontsize=8, loc="upper right")
    for ax in list(axes.flat)[len(tasks) :]:
        ax.axis("off")
    fig.tight_layout()
    save_figure(fig, path, dpi=DPI)
    plt.close(fig)
    return path


def plot_ppl_vs_cache(res: Results, path: Path, task: str = "lm") -> Path | None:
    rows = [r for r in res.rows if r.task == task and r.ppl_change]
    if not rows:
        return None
    colors = _colors(
        [r.variant for r in rows] + [v for v in pf.PAPER_B_LM_CACHE_FRACTION if v not in {r.variant for r in rows}]
    )
    fig, ax = plt.subplots(figsize=(8, 5.2))
    seen: dict[float, int] = {}
    for r in rows:
        frac = round(r.kv_fraction, 6)
        k = seen[frac] = seen.get(frac, -1) + 1
        # variants with the same cache size sit side by side (log axis: a multiplicative nudge)
        x, (m, s) = 100 * r.kv_fraction * 1.06**k, r.ppl_change_mean_std
        ax.errorbar(x, m, yerr=s if r.n > 1 else None, fmt="o", color=colors[r.variant], ms=7, capsize=3)
        ax.annotate(r.variant, (x, m), textcoords="offset points", xytext=(6, 4), fontsize=8, color=colors[r.variant])
    paper_pts = [(v, 100 * f, pf.lm_ppl_change(v)) for v, f in pf.PAPER_B_LM_CACHE_FRACTION.items()]
    first = True
    for v, x, pv in paper_pts:
        if pv is None:
            continue
        x = x / 1.08  # paper points just left of this run's
        ax.scatter(
            [x],
            [pv.value],
            facecolors="none",
            edgecolors=colors.get(v, "gray"),
            s=70,
            marker="s",
            label="Paper B 300M (hollow squares)" if first else None,
        )
        ax.annotate(
            f"{v} (paper)",
            (x, pv.value),
            textcoords="offset points",
            xytext=(-6, -10),
            fontsize=7,
            color="dimgray",
            ha="right",
        )
        first = False
    ax.axhline(0, color="black", lw=0.8)
    ax.set_xscale("log", base=2)
    ticks = [100 / 32, 100 / 8, 25, 50, 100]
    ax.set_xticks(ticks, [f"{t:.3g}%" for t in ticks])
    ax.set_xlim(1.5, 160)
    ax.set_xlabel("KV cache per token, % of Q-K-V (log scale)")
    ax.set_ylabel("perplexity change vs Q-K-V (%)")
    ax.set_title(f"{task}: perplexity cost against KV cache size (this run: dots, mean ± std over seeds)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    save_figure(fig, path, dpi=DPI)
    plt.close(fig)
    return path


def plot_metric_bars(res: Results, path: Path) -> Path | None:
    rows = [r for r in res.rows if r.metric != "val_loss"]
    if not rows:
        return None
    tasks = list(dict.fromkeys(r.task for r in rows))
    variants = list(dict.fromkeys(r.variant for r in rows))
    colors = _colors(variants)
    width = 0.8 / len(variants)
    fig, ax = plt.subplots(figsize=(max(7.0, 1.2 * len(tasks) * len(variants) * 0.35 + 3), 4.8))
    paper_label = True
    for i, v in enumerate(variants):
        for j, t in enumerate(tasks):
            r = res.row(t, v)
            if r is None:
                continue
            x = j - 0.4 + width * (i + 0.5)
            m, s = r.metric_mean_std
            ax.bar(
                x,
                m,
                width,
                yerr=s if r.n > 1 else None,
                color=colors[v],
                capsize=2,
                label=v if j == tasks.index(next(tt for tt in tasks if res.row(tt, v))) else None,
            )
            if r.paper_metric is not None:
                ax.plot(
                    [x - width / 2, x + width / 2],
                    [r.paper_metric] * 2,
                    color="black",
                    lw=2,
                    label="Paper B" if paper_label else None,
                )
                paper_label = False
    ax.set_xticks(range(len(tasks)), tasks)
    ax.set_ylabel(rows[0].metric)
    lo = min(r.metric_mean_std[0] for r in rows)
    ax.set_ylim(max(0.0, lo - 0.1), 1.0 if all(r.metric_mean_std[0] <= 1 for r in rows) else None)
    ax.set_title(f"{rows[0].metric} per scheme and task (mean ± std over seeds; black: Paper B)", fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(
        fontsize=8, ncol=min(7, len(variants) + 1), loc="upper center", bbox_to_anchor=(0.5, -0.12), framealpha=0.9
    )  # below the axes: never over a bar
    fig.tight_layout()
    save_figure(fig, path, dpi=DPI, bbox_inches="tight")
    plt.close(fig)
    return path


def plot_gap_trends(res: Results, path: Path) -> Path | None:
    """Every variant's gap to Q-K-V over training tokens, one panel per task (analysis/trends.py)."""
    panels: dict[str, list] = {}
    for task, traj, tr in res.trends():
        panels.setdefault(task, []).append((traj, tr))
    return plot_gap_trajectories(panels, path, res.metric) if panels else None


def write_plots(res: Results, out_dir: str | Path) -> list[Path]:
    out_dir = Path(out_dir)
    made = [
        plot_loss_curves(res, out_dir / "val_loss.png"),
        plot_ppl_vs_cache(res, out_dir / "ppl_vs_cache.png"),
        plot_metric_bars(res, out_dir / "metric_by_task.png"),
        plot_gap_trends(res, out_dir / "gap_trend.png"),
    ]
    return [p for p in made if p is not None]


def cache_vs_quality_points(compare_dir: str | Path) -> list[tuple[str, float, float]]:
    """(label, KV-cache bytes per token, validation loss) per row of a compare run's results.csv;
    the label carries the perplexity change vs Q-K-V where the CSV has one."""
    path = Path(compare_dir) / "results.csv"
    if not path.is_file():
        raise UserError(f"{compare_dir}: no results.csv (expected the output folder of qkvlab compare)")
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    need = ("variant", "kv_cache_bytes_per_token", "val_loss_mean", "ppl_change_pct_mean")
    missing = [c for c in need if not rows or c not in rows[0]]
    if missing:
        raise UserError(f"{path}: column {missing[0]!r} missing (needs {', '.join(need)})")
    out = []
    for r in rows:
        if r["kv_cache_bytes_per_token"] in (None, ""):
            continue  # encoders keep no cache
        change = r["ppl_change_pct_mean"]
        note = f" ({float(change):+.1f}%)" if change not in (None, "") else ""
        out.append((r["variant"] + note, float(r["kv_cache_bytes_per_token"]), float(r["val_loss_mean"])))
    return out


def plot_cache_vs_quality(compare_dir: str | Path, out_file: str | Path) -> Path:
    """Scatter of KV-cache bytes/token against validation loss from a compare run's results.csv."""
    points = cache_vs_quality_points(compare_dir)
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, x, y in points:
        ax.scatter(x, y)
        ax.annotate(label, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set_xscale("log")
    ax.set_xlabel("KV cache bytes per token")
    ax.set_ylabel("validation loss")
    ax.set_title("cache bytes vs quality")
    fig.tight_layout()
    out_file = Path(out_file)
    save_figure(fig, out_file, dpi=DPI)
    plt.close(fig)
    return out_file
