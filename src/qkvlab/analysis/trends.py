"""Gap trajectories: each variant's gap to Q-K-V over training, and whether it is closing.

Input is plain data: per pairing key (seed, or (grid point, seed)) a run's evaluation history as
(tokens, value) pairs. The gap at an evaluation is the paired difference with the Q-K-V run of the
same key at the same token count: for language modelling (``val_loss``) the perplexity change in
percent, 100 (exp(loss - loss of Q-K-V) - 1), its seed mean 100 (exp(mean loss difference) - 1)
as in :mod:`qkvlab.analysis.verdicts`; for tasks the metric difference in points.

The trend fits a line by ordinary least squares to the seed-mean gap over the last half of
training (evaluations at >= 50% of the final token count), with a 95% t-interval on the slope
(df = points - 2; fewer than 3 points: no trend). The word: ``flat`` when the interval contains 0,
else ``shrinking`` when the slope moves the gap toward 0 (its sign is the last half's mean gap's)
and ``growing`` when away from it. The slope is reported per 10% of training (and per 1M tokens).
Evaluations of one run are not independent (the same weights evolve), so the interval is a
description of the curve's noise, not a sampling guarantee.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from qkvlab.analysis.intervals import LEVEL, Interval, ols
from qkvlab.analysis.verdicts import PERPLEXITY_METRIC, pairing_key
from qkvlab.base.files import save_figure

SHRINKING, FLAT, GROWING = "shrinking", "flat", "growing"
History = Sequence[tuple[float, float]]  # (tokens, value) per evaluation


@dataclass(frozen=True)
class Trajectory:
    variant: str
    unit: str  # "%" (perplexity change) or "pts"
    tokens: list[float]  # evaluations every key has
    per_key: dict[Hashable, list[tuple[float, float]]]  # key -> (tokens, gap) at its own evaluations
    mean: list[float]  # mean gap over keys at tokens

    @property
    def n(self) -> int:
        return len(self.per_key)


def _display(d: float, perplexity: bool) -> float:
    """A raw difference (nats of loss, or metric units) in the gap's display unit."""
    return 100.0 * math.expm1(d) if perplexity else 100.0 * d


def gap_trajectory(
    variant: str, runs: Mapping[Hashable, History], base: Mapping[Hashable, History], *, perplexity: bool
) -> Trajectory | None:
    """The variant's paired gap to the baseline at every evaluation both runs of a key have; None
    when no key has a baseline run with a common evaluation. The seed mean is taken over the raw
    differences (loss: the mean log perplexity ratio), then shown in the gap's unit, as verdicts do."""
    raw: dict[Hashable, dict[float, float]] = {}
    for key, hist in runs.items():
        if key not in base:
            continue
        ref = {t: y for t, y in base[key] if y is not None}
        diffs = {t: y - ref[t] for t, y in hist if y is not None and t in ref}
        if diffs:
            raw[key] = diffs
    if not raw:
        return None
    common = sorted(set.intersection(*(set(d) for d in raw.values())))
    mean = [_display(sum(d[t] for d in raw.values()) / len(raw), perplexity) for t in common]
    per_key = {k: [(t, _display(d[t], perplexity)) for t in sorted(d)] for k, d in raw.items()}
    return Trajectory(variant, "%" if perplexity else "pts", common, per_key, mean)


@dataclass(frozen=True)
class Trend:
    word: str | None  # shrinking / flat / growing; None with fewer than 3 last-half points
    per_10pct: Interval  # slope: change of the gap per 10% of training, in the gap's unit
    per_m_tokens: Interval  # slope per 1M training tokens
    points: int  # evaluations in the last half
    last_half_mean: float
    unit: str


def trend(traj: Trajectory, level: float = LEVEL) -> Trend:
    total = max(traj.tokens) if traj.tokens else 0.0
    pts = [(t, y) for t, y in zip(traj.tokens, traj.mean) if t >= 0.5 * total]
    mean = sum(y for _, y in pts) / len(pts) if pts else math.nan
    if len(pts) < 3 or total <= 0:
        nan = Interval(math.nan)
        return Trend(None, nan, nan, len(pts), mean, traj.unit)
    fit = ols([t / 1e6 for t, _ in pts], [y for _, y in pts], level)
    per_m = fit.slope_interval()
    per_10 = per_m.scale(0.1 * total / 1e6)
    if per_m.contains(0.0):
        word = FLAT
    else:
        word = GROWING if (per_m.estimate > 0) == (mean >= 0) else SHRINKING
    return Trend(word, per_10, per_m, len(pts), mean, traj.unit)


def trajectories_from_runs(
    runs: Sequence, metric: Mapping[str, str], baseline: str = "Q-K-V"
) -> list[tuple[str, Trajectory, Trend]]:
    """Runs (task, variant, seed, history, optionally point) -> (task, trajectory, trend) for every
    variant of every task that has the baseline, paired by (grid point, seed)."""
    hist: dict[str, dict[str, dict[Hashable, list[tuple[float, float]]]]] = {}
    for r in runs:
        if r.task not in metric:
            continue
        m = metric[r.task]
        pts = [(float(row["tokens"]), float(row[m])) for row in r.history if row.get(m) is not None and "tokens" in row]
        hist.setdefault(r.task, {}).setdefault(r.variant, {})[pairing_key(r)] = pts
    out = []
    for task, by_variant in hist.items():
        if baseline not in by_variant:
            continue
        for variant, runs_of in by_variant.items():
            if variant == baseline:
                continue
            traj = gap_trajectory(variant, runs_of, by_variant[baseline], perplexity=metric[task] == PERPLEXITY_METRIC)
            if traj is not None:
                out.append((task, traj, trend(traj)))
    return out


def format_trend(tr: Trend) -> str:
    """e.g. 'growing, +0.41 %/10% [+0.12, +0.70]'; '–' without a trend."""
    if tr.word is None:
        return f"– ({tr.points} evaluations in the last half; needs 3)"
    iv = tr.per_10pct
    u = "%" if tr.unit == "%" else " pts"
    return f"{tr.word}, {iv.estimate:+.2f}{u} per 10% of training [{iv.lo:+.2f}, {iv.hi:+.2f}]"


def trends_markdown(rows: Sequence[tuple[str, Trajectory, Trend]], finals: Mapping | None = None) -> str:
    """A table: task, variant, gap at the end (with its interval when finals[(task, variant)] gives
    one), last-half trend with its slope interval."""
    if not rows:
        return "No variant has a Q-K-V run of the same seed to compare its history with.\n"
    lines = [
        "| task | variant | gap at the end (95% CI) | last half: trend, slope per 10% of training [95% CI] | seeds |",
        "| --- | --- | ---: | --- | ---: |",
    ]
    for task, traj, tr in rows:
        u = "%" if traj.unit == "%" else " pts"
        iv = (finals or {}).get((task, traj.variant))
        if iv is not None and iv.defined:
            end = f"{iv.estimate:+.2f}{u} [{iv.lo:+.2f}, {iv.hi:+.2f}]" + (
                " (1 seed: evaluation only)" if iv.n == 1 else ""
            )
        else:
            end = f"{traj.mean[-1]:+.2f}{u}" if traj.mean else "–"
        lines.append(f"| {task} | `{traj.variant}` | {end} | {format_trend(tr)} | {traj.n} |")
    return "\n".join(lines) + "\n"


def plot_gap_trajectories(
    panels: Mapping[str, Sequence[tuple[Trajectory, Trend]]], path: str | Path, metric: Mapping[str, str] | None = None
) -> Path:
    """One panel per task: each variant's seed-mean gap (line) and per-seed gaps (faint), the
    last half shaded, the trend word in the legend (below the axes)."""
    # startup: matplotlib, imported when a figure is drawn
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # startup: as above

    tasks = list(panels)
    cols = min(len(tasks), 3) or 1
    rows = -(-len(tasks) // cols) or 1
    fig, axes = plt.subplots(rows, cols, figsize=(6.5 * cols, 4.8 * rows), squeeze=False)
    variants = list(dict.fromkeys(tj.variant for items in panels.values() for tj, _ in items))
    cmap = plt.get_cmap("tab10" if len(variants) <= 10 else "tab20")
    color = {v: cmap(i % cmap.N) for i, v in enumerate(variants)}
    for ax, task in zip(axes.flat, tasks):
        unit = "%"
        total = 0.0
        for traj, tr in panels[task]:
            unit = traj.unit
            c = color[traj.variant]
            for pts in traj.per_key.values():
                ax.plot([t / 1e6 for t, _ in pts], [y for _, y in pts], color=c, alpha=0.25, lw=0.8)
            label = f"{traj.variant}: {tr.word or 'n/a'}"
            if tr.word is not None:
                label += f" ({tr.per_10pct.estimate:+.2g}{'%' if unit == '%' else ' pts'}/10%)"
            ax.plot([t / 1e6 for t in traj.tokens], traj.mean, color=c, lw=1.8, marker="o", ms=3, label=label)
            total = max(total, max(traj.tokens, default=0.0))
        if total:
            ax.axvspan(0.5 * total / 1e6, total / 1e6, color="gray", alpha=0.08, lw=0)
            # y range from the last half (seed means and each seed): an early spike (one seed's
            # loss jump at warm-up) would flatten the part of the curve the trend reads
            later = [y for tj, _ in panels[task] for t, y in zip(tj.tokens, tj.mean) if t >= 0.5 * total]
            later += [y for tj, _ in panels[task] for pts in tj.per_key.values() for t, y in pts if t >= 0.5 * total]
            lo, hi = min(later + [0.0]), max(later + [0.0])
            pad = max(0.5, 0.15 * (hi - lo))
            ax.set_ylim(lo - pad, hi + pad)
        ax.axhline(0, color="black", lw=0.8)
        ax.set_xlabel("training tokens (M)")
        name = (metric or {}).get(task, "metric")
        ax.set_ylabel("perplexity vs Q-K-V (%)" if unit == "%" else f"{name} vs Q-K-V (points)")
        ax.set_title(f"{task}: gap to Q-K-V (mean over seeds; faint: each seed; shaded: last half)", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2, framealpha=0.9)
    for ax in list(axes.flat)[len(tasks) :]:
        ax.axis("off")
    fig.tight_layout()
    path = Path(path)
    save_figure(fig, path, dpi=150, bbox_inches="tight")
    plt.close(fig)
    return path
