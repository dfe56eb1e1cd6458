"""Scaling analysis: each variant's gap to Q-K-V against model size and training compute, a fitted
trend, and its extrapolation to the papers' sizes.

Runs are grouped by size (the folder above the variant: OUT/<size>/<variant slug>/seed<k>). A
size's N is the non-embedding parameter count of Q-K-V at that size's shape (qkvlab.accounting;
every variant at a size is compared at the same N, whatever its own count), D the training
tokens of its runs, compute C = 6 N D.

The gap of a variant at a size is the perplexity change vs Q-K-V, 100 (exp(mean d) - 1) % with
d the loss difference to Q-K-V of the same seed, and a paired 95% t-interval over seeds (one
seed: none), as in :mod:`qkvlab.analysis.verdicts`. The trend is the least-squares line
d = a + b log10(N) through every per-seed d (all sizes together; d is the log perplexity ratio,
so gaps map back exactly through exp), because:

- gaps can be negative or cross zero (Id-K-V/mlp), which a power law on the gap cannot fit;
- with 4-5 sizes a two-parameter line is what the data can pin down; any smooth trend is
  this line to first order in log N;
- per-seed points carry the seed noise into the residuals, so the prediction interval at the
  papers' sizes, t(df = points - 2) s sqrt(1 + 1/n + (x - mean x)^2 / Sxx), covers both the
  seed noise of a single run and the fit's uncertainty.

The same line is fitted against log10(C). The extrapolation holds tokens per parameter at the
sweep's ratio, not the papers' (see results.md). The verdict per variant compares the prediction
interval at the paper's size with the paper's figure ± EXTRAPOLATION_MARGIN_PCT percentage points:
reproduced when the interval lies inside, contradicted when it lies outside, else inconclusive.

Over 400 lines: reading, fitting, tables and plots of one analysis; split, each part would
need the others' row types.
"""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from qkvlab.analysis import paper_figures as pf
from qkvlab.analysis.intervals import LEVEL, Fit, Interval, mean_interval, ols
from qkvlab.analysis.verdicts import word_for
from qkvlab.files import save_figure
from qkvlab.units import human
from qkvlab.variants import BASELINE

EXTRAPOLATION_MARGIN_PCT = 2.0
# The papers' model sizes: (label, qkvlab preset); N is its non-embedding count (accounting).
PAPER_SIZES = {"A": ("124M", "gpt2-124m"), "B": ("300M", "paperB-300m")}


def paper_size_params(paper: str) -> int:
    from qkvlab.accounting import analytic_params
    from qkvlab.config import preset

    return analytic_params(preset(PAPER_SIZES[paper][1])).non_embedding


@dataclass(frozen=True)
class ScalingRun:
    """One finished run of a sweep, as plain data."""

    size: str  # size label (folder name)
    variant: str
    seed: int
    params: int  # the run's own non-embedding parameters
    params_total: int
    size_params: int  # N of the size: Q-K-V's non-embedding parameters at this shape
    tokens: int  # training tokens at the end
    val_loss: float
    steps: int
    dir: str = ""
    train_s: float = 0.0  # training time of the run (its last row's elapsed_s)

    @property
    def compute(self) -> float:
        """Training FLOPs 6 N D with the run's own non-embedding N."""
        return 6.0 * self.params * self.tokens


@dataclass
class VariantScaling:
    variant: str
    gaps: dict[str, Interval]  # size -> paired gap (% perplexity) over seeds
    points: list[tuple[str, float]]  # (size, per-seed loss difference in nats) the fits use
    fit_params: Fit | None  # loss difference vs log10 N
    fit_compute: Fit | None  # loss difference vs log10 C
    extrapolated: dict[str, Interval] = field(default_factory=dict)  # paper -> prediction interval, %
    paper: pf.PaperValue | None = None

    @property
    def paper_key(self) -> str | None:
        return self.paper.source[0] if self.paper else None

    @property
    def word(self) -> str | None:
        if self.paper is None or self.paper_key not in self.extrapolated:
            return None
        p = self.paper.value
        return word_for(self.extrapolated[self.paper_key], p - EXTRAPOLATION_MARGIN_PCT, p + EXTRAPOLATION_MARGIN_PCT)


@dataclass
class Scaling:
    runs: list[ScalingRun]
    sizes: list[str]  # ascending N
    size_params: dict[str, int]
    size_tokens: dict[str, int]  # tokens of the size's Q-K-V runs (else any run)
    variants: list[VariantScaling]
    paper_params: dict[str, int]

    def size_compute(self, size: str) -> float:
        return 6.0 * self.size_params[size] * self.size_tokens[size]


def _pct(d: float) -> float:
    """A loss difference (nats) as a perplexity change in percent."""
    return 100.0 * math.expm1(d)


def analyse(runs: Sequence[ScalingRun], paper_params: dict[str, int] | None = None, level=LEVEL) -> Scaling:
    """Per variant: paired gaps per size, line fits vs log10 N and log10 C, extrapolations."""
    if paper_params is None:
        paper_params = {k: paper_size_params(k) for k in PAPER_SIZES}
    size_params: dict[str, int] = {}
    for r in sorted(runs, key=lambda r: r.variant != BASELINE):  # Q-K-V's own count first
        size_params.setdefault(r.size, r.params if r.variant == BASELINE else r.size_params)
    sizes = sorted(size_params, key=size_params.get)
    size_tokens = {}
    for s in sizes:
        base = [r.tokens for r in runs if r.size == s and r.variant == BASELINE] or [
            r.tokens for r in runs if r.size == s
        ]
        size_tokens[s] = max(base)
    base_loss = {(r.size, r.seed): r.val_loss for r in runs if r.variant == BASELINE}
    log_c = {s: math.log10(6.0 * size_params[s] * size_tokens[s]) for s in sizes}
    out = []
    for v in dict.fromkeys(r.variant for r in runs if r.variant != BASELINE):
        gaps, points = {}, []
        for s in sizes:
            per_seed = [
                (r.val_loss - base_loss[(s, r.seed)])
                for r in runs
                if r.variant == v and r.size == s and (s, r.seed) in base_loss
            ]
            if per_seed:
                gaps[s] = mean_interval(per_seed, level).map(_pct)
                points += [(s, d) for d in per_seed]
        distinct = {s for s, _ in points}
        fit_n = fit_c = None
        if len(distinct) >= 2:
            fit_n = ols([math.log10(size_params[s]) for s, _ in points], [g for _, g in points], level)
            fit_c = ols([log_c[s] for s, _ in points], [g for _, g in points], level)
        vs = VariantScaling(v, gaps, points, fit_n, fit_c, paper=pf.lm_ppl_change(v))
        if fit_n is not None:
            vs.extrapolated = {k: fit_n.predict(math.log10(n)).map(_pct) for k, n in paper_params.items()}
        out.append(vs)
    return Scaling(list(runs), sizes, size_params, size_tokens, out, paper_params)


# ---- reading run folders -----------------------------------------------------------------------
def _variant_name(cfg, folder: str) -> str:
    """The variant a run trained, from its model config (scheme, key/value heads, matched MLP);
    the folder name when the config alone does not spell it (e.g. /width=SCHEME)."""
    from qkvlab.spec import parse_scheme
    from qkvlab.variants import Variant

    kv = cfg.kv_heads if cfg.kv_heads not in (None, cfg.n_head) else None
    match = parse_scheme(cfg.match_params).name if cfg.match_params else None
    v = Variant(cfg.spec.name, kv, match)
    return v.name if v.slug == folder else folder


def read_runs(runs_dir: str | Path) -> tuple[list[ScalingRun], list[str]]:
    """Every finished run under runs_dir (OUT/<size>/<variant>/seed<k>) and the unfinished ones'
    folders. A run's variant and N come from its config.json (the model as trained)."""
    from qkvlab.accounting import analytic_params
    from qkvlab.analysis.runs import run_finished
    from qkvlab.io import read_config, read_metrics

    root = Path(runs_dir)
    done, unfinished = [], []
    for metrics in sorted(root.glob("*/*/*/metrics.jsonl")):
        d = metrics.parent
        rel = d.relative_to(root)
        if not run_finished(d):
            unfinished.append(str(rel))
            continue
        cfg, body = read_config(d)
        train = body.get("train", {})
        base = cfg.replace(attn=BASELINE, kv_heads=None, match_params=None)
        rows = [r for r in read_metrics(d) if r.get("val_loss") is not None]
        if not rows:
            unfinished.append(str(rel))
            continue
        seed = (train.get("config") or {}).get("seed")
        done.append(
            ScalingRun(
                size=rel.parts[0],
                variant=_variant_name(cfg, rel.parts[-2]),
                seed=int(seed if seed is not None else rel.parts[-1].removeprefix("seed")),
                params=analytic_params(cfg).non_embedding,
                params_total=analytic_params(cfg).total,
                size_params=analytic_params(base).non_embedding,
                tokens=int(train.get("tokens") or rows[-1].get("tokens") or 0),
                val_loss=float(rows[-1]["val_loss"]),
                steps=int(train.get("step") or rows[-1].get("step") or 0),
                train_s=float(rows[-1].get("elapsed_s") or 0.0),
                dir=str(rel),
            )
        )
    return done, unfinished


# ---- writing -----------------------------------------------------------------------------------
CSV_COLUMNS = (
    "size",
    "variant",
    "seed",
    "params",
    "params_total",
    "size_params",
    "tokens",
    "tokens_per_param",
    "compute_flops",
    "steps",
    "train_s",
    "val_loss",
    "val_ppl",
    "gap_pct_vs_qkv",
    "dir",
)


def to_csv(sc: Scaling) -> str:
    base = {(r.size, r.seed): r.val_loss for r in sc.runs if r.variant == BASELINE}
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=CSV_COLUMNS, lineterminator="\n")
    w.writeheader()
    order = {s: i for i, s in enumerate(sc.sizes)}
    for r in sorted(sc.runs, key=lambda r: (order[r.size], r.variant != BASELINE, r.variant, r.seed)):
        b = base.get((r.size, r.seed))
        w.writerow(
            {
                "size": r.size,
                "variant": r.variant,
                "seed": r.seed,
                "params": r.params,
                "params_total": r.params_total,
                "size_params": r.size_params,
                "tokens": r.tokens,
                "tokens_per_param": round(r.tokens / r.size_params, 3),
                "compute_flops": f"{r.compute:.4g}",
                "steps": r.steps,
                "train_s": round(r.train_s, 1),
                "val_loss": round(r.val_loss, 6),
                "val_ppl": round(math.exp(r.val_loss), 4),
                "gap_pct_vs_qkv": round(_pct(r.val_loss - b), 4) if b is not None else "",
                "dir": r.dir,
            }
        )
    return buf.getvalue()


def _iv(iv: Interval | None, digits: int = 2) -> str:
    if iv is None:
        return "–"
    f = f"{{:+.{digits}f}}"
    return f.format(iv.estimate) + (f" [{f.format(iv.lo)}, {f.format(iv.hi)}]" if iv.defined else " (n=1)")


def _run_section(sc: Scaling, manifest: dict | None) -> list[str]:
    """What ran: the command, wall time and machine when compare wrote compare.json, and the
    training time summed per size (from the runs themselves)."""
    lines = ["## Run", ""]
    m = manifest or {}
    t = m.get("timing") or {}
    if t.get("wall_s") is not None:
        lines.append(
            f"- wall time of the last invocation: {t['wall_s'] / 60:.1f} min ({t.get('trained', 0)} runs trained, "
            f"{t.get('skipped', 0)} already finished)"
        )
    mach = m.get("machine") or {}
    if mach:
        lines.append("- machine: " + ", ".join(f"{k} {v}" for k, v in mach.items() if v is not None))
    per_size = {s: sum(r.train_s for r in sc.runs if r.size == s) for s in sc.sizes}
    lines.append(
        f"- training time summed over {len(sc.runs)} finished runs: {sum(per_size.values()) / 60:.1f} min ("
        + ", ".join(f"{s} {v / 60:.1f}" for s, v in per_size.items())
        + ")"
    )
    return lines + [""]


def to_markdown(
    sc: Scaling,
    plots: Sequence[str] = (),
    unfinished: Sequence[str] = (),
    command: str = "",
    manifest: dict | None = None,
) -> str:
    out = ["# Scaling: gap to Q-K-V against model size", ""]
    if command:
        out += [f"Command: `{command}`", ""]
    seeds = {s: sorted({r.seed for r in sc.runs if r.size == s}) for s in sc.sizes}
    out += [
        "## Sizes",
        "",
        "| size | N (non-emb., Q-K-V) | tokens D | D / N | compute 6ND | seeds |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for s in sc.sizes:
        n, d = sc.size_params[s], sc.size_tokens[s]
        out.append(f"| {s} | {human(n)} | {human(d)} | {d / n:.2f} | {sc.size_compute(s):.3g} | {len(seeds[s])} |")
    span = sc.size_params[sc.sizes[-1]] / sc.size_params[sc.sizes[0]] if sc.sizes else 0
    out += [
        "",
        f"{len(sc.sizes)} size{'' if len(sc.sizes) == 1 else 's'} spanning {span:.1f}x in non-embedding parameters.",
        "",
    ]
    a_n, b_n = sc.paper_params.get("A"), sc.paper_params.get("B")
    header = (
        ["variant"]
        + [f"{s} gap (95% CI)" for s in sc.sizes]
        + [
            "slope: Δ loss per 10x N, nats (95% CI)",
            f"at 124M (N {human(a_n)}) (95% PI)" if a_n else "at 124M",
            f"at 300M (N {human(b_n)}) (95% PI)" if b_n else "at 300M",
            "paper",
            "verdict",
        ]
    )
    out += [
        "## Gap to Q-K-V (perplexity change, %), fit and extrapolation",
        "",
        "| " + " | ".join(header) + " |",
        "| --- " + "| ---: " * (len(header) - 3) + "| --- | --- |",
    ]
    for v in sc.variants:
        cells = [f"`{v.variant}`"] + [_iv(v.gaps.get(s)) for s in sc.sizes]
        cells.append(_iv(v.fit_params.slope_interval(), 4) if v.fit_params else "–")
        cells += [_iv(v.extrapolated.get("A")), _iv(v.extrapolated.get("B"))]
        cells.append(str(v.paper) if v.paper else "–")
        cells.append(f"**{v.word}**" if v.word else "–")
        out.append("| " + " | ".join(cells) + " |")
    out += [
        "",
        "Gap: exp(val loss − val loss of Q-K-V at the same size and seed) − 1, mean with a paired 95% "
        "t-interval over seeds (n=1: one seed, no interval). Fit: least squares Δ = a + b·log10 N over every "
        "per-seed loss difference Δ (the log perplexity ratio); the 124M/300M columns are exp(Δ) − 1 at the "
        "papers' non-embedding N with a 95% prediction interval for one run. The extrapolation keeps this sweep's tokens per parameter (the papers "
        f"trained far longer per parameter). Verdict: the prediction interval at the paper's size against the paper's "
        f"figure ± {EXTRAPOLATION_MARGIN_PCT:g} points: reproduced inside, contradicted outside, inconclusive otherwise.",
        "",
    ]
    if plots:
        out += ["## Plots", ""] + [f"![{Path(p).stem}]({Path(p).name})" for p in plots] + [""]
    if unfinished:
        out += [
            f"Not finished ({len(unfinished)}): "
            + ", ".join(unfinished[:12])
            + (" ..." if len(unfinished) > 12 else ""),
            "",
        ]
    out += _run_section(sc, manifest)
    return "\n".join(out)


def plot_scaling(sc: Scaling, path: str | Path, *, against: str = "params") -> Path:
    """Gap vs N (against='params') or vs compute 6ND ('compute'), log x: per variant the per-size
    mean with its interval, the fitted line extended to the papers' sizes (params) with its 95%
    prediction band, and the papers' figures as hollow squares."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8.5, 5.5))
    cmap = plt.get_cmap("tab10")
    xs = {s: sc.size_params[s] if against == "params" else sc.size_compute(s) for s in sc.sizes}
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
        lo_x = math.log10(min(xs.values()))
        hi_x = math.log10(max(xs.values()))
        if against == "params":
            hi_x = max([hi_x] + [math.log10(n) for n in sc.paper_params.values()])
        grid = [lo_x + (hi_x - lo_x) * k / 60 for k in range(61)]
        preds = [fit.predict(x).map(_pct) for x in grid]
        ax.plot([10**x for x in grid], [p.estimate for p in preds], color=c, lw=1.2, ls="--")
        if preds[0].defined:
            ax.fill_between(
                [10**x for x in grid], [p.lo for p in preds], [p.hi for p in preds], color=c, alpha=0.08, lw=0
            )
        if against == "params" and v.paper is not None and v.paper_key in sc.paper_params:
            ax.scatter(
                [sc.paper_params[v.paper_key]], [v.paper.value], marker="s", facecolors="none", edgecolors=c, s=60
            )
    if against == "params":
        for key, n in sc.paper_params.items():
            ax.axvline(n, color="gray", lw=0.8, ls=":")
            ax.annotate(
                f"{PAPER_SIZES[key][0]} (Paper {key})",
                (n, 0),
                xycoords=("data", "axes fraction"),
                xytext=(-3, 4),
                textcoords="offset points",
                fontsize=7,
                color="dimgray",
                ha="right",
                va="bottom",
                rotation=90,
            )
    ax.axhline(0, color="black", lw=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("non-embedding parameters N (log)" if against == "params" else "training compute 6·N·D, FLOPs (log)")
    ax.set_ylabel("perplexity vs Q-K-V (%)")
    title = "gap to Q-K-V vs " + ("model size" if against == "params" else "training compute")
    ax.set_title(title + " (dots: mean, 95% CI over seeds; dashed: fit, band: 95% PI; squares: papers)", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=4, framealpha=0.9)
    fig.tight_layout()
    path = Path(path)
    save_figure(fig, path, dpi=150, bbox_inches="tight")
    plt.close(fig)
    return path


def write_scaling_results(
    runs_dir: str | Path, out_dir: str | Path, *, command: str = "", plots: bool = True
) -> Scaling:
    """Read the sweep's finished runs under runs_dir; write results.md, results.csv,
    gap_vs_params.png and gap_vs_compute.png into out_dir (created; only these files written)."""
    from qkvlab.analysis.runs import MANIFEST, read_manifest
    from qkvlab.errors import UserError
    from qkvlab.io import atomic_write

    runs, unfinished = read_runs(runs_dir)
    manifest = read_manifest(runs_dir) if (Path(runs_dir) / MANIFEST).is_file() else None
    command = command or (manifest or {}).get("command") or ""
    if not runs:
        raise UserError(f"{runs_dir}: no finished run (expected run folders at <size>/<variant>/seed<k>)")
    sc = analyse(runs)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    if plots and any(v.gaps for v in sc.variants):
        written = [
            plot_scaling(sc, out / "gap_vs_params.png"),
            plot_scaling(sc, out / "gap_vs_compute.png", against="compute"),
        ]
    atomic_write(out / "results.csv", to_csv(sc))
    atomic_write(out / "results.md", to_markdown(sc, [str(p) for p in written], unfinished, command, manifest))
    return sc
