"""The scaling sweep's files: results.csv (one row per run), results.md (sizes, the gap per size
with its interval, the slope in log N) and the two plots (gap vs N, gap vs compute: scaling_plots.py),
drawn only over the sizes trained."""

from __future__ import annotations

import csv
import io
import json
import math
from collections.abc import Sequence
from pathlib import Path

from qkvlab.analysis.factorial import analyse_factorial, grid_factors
from qkvlab.analysis.rules import provenance_lines
from qkvlab.analysis.rules import rules as rules_of
from qkvlab.analysis.runs import LR_SCAN_FILE, MANIFEST, read_manifest, write_manifest
from qkvlab.analysis.scaling import (
    MAX_EXTRAPOLATION,
    PAPER_SIZES,
    Scaling,
    ScalingRun,
    analyse,
    gap_pct,
    paper_size_params,
    read_runs,
    read_runs_csv,
    write_unit_scores,
)
from qkvlab.analysis.scaling_plots import plot_grid, plot_scaling
from qkvlab.base.errors import UserError
from qkvlab.base.files import atomic_write
from qkvlab.base.units import human
from qkvlab.model.variants import BASELINE

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
    "val_loss_se",
)


def to_csv(sc: Scaling) -> str:
    base = {(r.size, r.seed): r.val_loss for r in sc.runs if r.variant == BASELINE}
    buf = io.StringIO()
    fingerprinted = any(r.config for r in sc.runs)  # tables written before fingerprints keep their columns
    w = csv.DictWriter(buf, fieldnames=CSV_COLUMNS + (("config",) if fingerprinted else ()), lineterminator="\n")
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
                "gap_pct_vs_qkv": round(gap_pct(r.val_loss - b), 4) if b is not None else "",
                "dir": r.dir,
                "val_loss_se": round(r.se, 6) if r.se else "",
            }
            | ({"config": r.config} if fingerprinted else {})
        )
    return buf.getvalue()


def _iv(iv, digits: int = 2) -> str:
    if iv is None:
        return "–"
    f = f"{{:+.{digits}f}}"
    if not iv.defined:
        return f.format(iv.estimate) + " (n=1)"
    return (
        f.format(iv.estimate)
        + f" [{f.format(iv.lo)}, {f.format(iv.hi)}]"
        + (" (n=1: evaluation only)" if iv.n == 1 else "")
    )


def _run_section(sc: Scaling, manifest: dict | None, note: str) -> list[str]:
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
    if note:
        lines.append(f"- {note}")
    return lines + [""]


def _corpus_line(manifest: dict | None) -> list[str]:
    """The training corpus as compare.json recorded it: its source, checksum and split sizes."""
    c = (((manifest or {}).get("metrics") or {}).get("lm") or {}).get("corpus") or {}
    if not c:
        return []
    tokens = c.get("tokens") or {}
    return [
        f"Corpus: `{c.get('source')}` (sha256 {str(c.get('corpus_sha256', ''))[:12]}…), "
        f"{tokens.get('train', 0):,} training and {tokens.get('val', 0):,} held-out tokens.",
        "",
    ]


def _sizes_section(sc: Scaling) -> list[str]:
    seeds = {s: sorted({r.seed for r in sc.runs if r.size == s}) for s in sc.sizes}
    out = [
        "## Sizes",
        "",
        "| size | N (non-emb., Q-K-V) | tokens D | D / N | epochs of the training split | compute 6ND | seeds |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for s in sc.sizes:
        n, d, ep = sc.size_params[s], sc.size_tokens[s], sc.epochs(s)
        epochs = f"{ep:.2f}" if ep is not None else "not recorded"
        out.append(
            f"| {s} | {human(n)} | {human(d)} | {d / n:.2f} | {epochs} | {sc.size_compute(s):.3g} | {len(seeds[s])} |"
        )
    span = sc.size_params[sc.sizes[-1]] / sc.size_params[sc.sizes[0]] if sc.sizes else 0
    decades = " and ".join(
        f"{PAPER_SIZES[k][0]} {math.log10(paper_size_params(k) / sc.largest):.1f}" for k in sorted(PAPER_SIZES)
    )
    split = (
        f"Epochs: D over the training split's {sc.train_tokens:,} tokens (compare.json); above 1 a size "
        "trains on repeated text, so its gap mixes model size with repetition."
        if sc.train_tokens
        else "Epochs: the training split's size is not recorded in compare.json."
    )
    return out + [
        "",
        split,
        "",
        f"{len(sc.sizes)} size{'' if len(sc.sizes) == 1 else 's'} spanning {span:.1f}x in non-embedding parameters; "
        f"the largest, N {human(sc.largest)}, is where every statement here stops (no prediction beyond "
        f"{MAX_EXTRAPOLATION:g}x it; the papers' models lie further by, in decades of N: {decades}).",
        "",
    ]


def _lof(v) -> str:
    f = v.lack_of_fit
    if f is None:
        return "–"
    verdict = "rejects the line" if f.rejects else "line not rejected"
    return f"F({f.df_lack}, {f.df_pure}) = {f.f:.3g}, p = {f.p:.2g}: {verdict}"


def _gap_section(sc: Scaling) -> list[str]:
    means = sc.rules.sweep_slope == "size means"
    through = "the size means" if means else "every per-seed point"
    header = (
        ["variant"]
        + [f"{s} gap (95% CI)" for s in sc.sizes]
        + [
            f"slope: Δ loss per 10x N, nats ({through}, 95% CI)",
            "lack of fit of the line",
            "gap with N",
            "paper (its size, for reference)",
        ]
    )
    out = [
        f"## Gap to Q-K-V per size (perplexity change, %; {sc.source}) and its slope in log N",
        "",
        "| " + " | ".join(header) + " |",
        "| --- " + "| ---: " * (len(header) - 4) + "| --- | --- | --- |",
    ]
    for v in sc.variants:
        cells = [f"`{v.variant}`"] + [_iv(v.gaps.get(s)) for s in sc.sizes]
        cells.append(_iv(v.fit_params.slope_interval(), 4) if v.fit_params else "–")
        cells.append(_lof(v))
        cells.append(v.slope_word or "–")
        cells.append(str(v.paper) if v.paper else "–")
        out.append("| " + " | ".join(cells) + " |")
    return out + [
        "",
        "Gap: exp(loss − loss of Q-K-V at the same size and seed) − 1, mean with a paired 95% interval over the "
        "size's seeds (plus the evaluation's own error when scored on the test split; n=1: one seed, no interval). "
        f"Slope: least squares Δ = a + b·log10 N through {through} of the loss difference Δ (the log "
        "perplexity ratio; 0.01 nats ≈ 1% perplexity), 95% t-interval. Lack of fit: the line through every "
        "per-seed Δ against one mean per size (pure error from the seeds), F test at 5%. Gap with N: `no line` "
        "when that test rejects the line (the per-size gaps are then the statement), else `flat` when the "
        "slope's interval contains 0, `shrinking` when the gap moves toward 0 as N grows, `growing` otherwise. "
        "The papers' figures come from far larger models trained on far more tokens per parameter: they are "
        "shown, not tested.",
        "",
    ]


def _factorial_section(sc: Scaling) -> list[str]:
    """Where the sizes are the cells of a two-level grid at one N: each variant's cells and contrasts."""
    out: list[str] = []
    for v in sc.variants:
        f = analyse_factorial(sc.runs, v.variant)
        if f is None:
            continue
        names = list(f.factors)
        if not out:
            out += [
                "## The grid's contrasts (one N, two levels a factor)",
                "",
                "Cells: the mean of d = loss − loss of Q-K-V per seed (nats) and its perplexity change. "
                "Effects: contrasts of the cell means (a factor's second level minus its first; an interaction: "
                "the first factor's effect at the second's second level minus at its first), 95% t interval from "
                f"the pooled within-cell variance of d ({f.df} df; seed spread only, every cell scored on the same "
                "test windows); `qkvlab.analysis.factorial`.",
                "",
            ]
        out += [
            f"`{v.variant}`:",
            "",
            "| " + " | ".join(names) + " | seeds | d per seed (nats) | mean d | gap |",
            "| " + "--- | " * len(names) + "---: | --- | ---: | ---: |",
        ]
        for cell, d in sorted(f.cells.items()):
            mean = sum(d) / len(d)
            per_seed = ", ".join(f"{x:+.4f}" for x in d)
            out.append("| " + " | ".join(cell) + f" | {len(d)} | {per_seed} | {mean:+.4f} | {gap_pct(mean):+.2f}% |")
        out += ["", "| effect on d | nats (95% CI) | reading |", "| --- | ---: | --- |"]
        out += [f"| {e.name} | {_iv(e.interval, 4)} | {e.word} |" for e in f.effects]
        out.append("")
    return out


def to_markdown(
    sc: Scaling,
    plots: Sequence[str] = (),
    unfinished: Sequence[str] = (),
    command: str = "",
    manifest: dict | None = None,
    note: str = "",
    scan: dict | None = None,
) -> str:
    out = ["# Scaling: gap to Q-K-V against model size", ""]
    if command:
        out += [f"Command: `{command}`", ""]
    out += provenance_lines(sc.rules.version, (manifest or {}).get("trained_under_analysis")) + [""]
    out += _sizes_section(sc) + _corpus_line(manifest)
    out += (_gap_section(sc) if sc.variants else []) + _factorial_section(sc) + _scan_section(scan)
    if plots:
        out += ["## Plots", ""] + [f"![{Path(p).stem}]({Path(p).name})" for p in plots] + [""]
    if unfinished:
        more = " ..." if len(unfinished) > 12 else ""
        out += [f"Not finished ({len(unfinished)}): " + ", ".join(unfinished[:12]) + more, ""]
    out += _run_section(sc, manifest, note)
    return "\n".join(out)


def _scan_section(scan: dict | None) -> list[str]:
    """An lr scan's choice (its lr_scan.json) as a table: every lr tried with its validation loss."""
    if not scan:
        return []
    out = [
        "## The lr scan",
        "",
        "Q-K-V's final validation loss (the fixed validation windows; the test split is never read) per lr; "
        "the sweep takes each shape's lowest (compare/sweep.py scan_lrs), used even at the grid's edge, and flagged.",
        "",
        "| shape | validation loss per lr | chosen lr | at the grid's edge |",
        "| --- | --- | ---: | --- |",
    ]
    for shape, c in scan.items():
        tried = ", ".join(f"{lr}: {loss:.4f}" for lr, loss in c["tried"].items())
        out.append(f"| {shape} | {tried} | {c['lr']:g} | {'**yes**' if c['edge'] else 'no'} |")
    return out + [""]


def recorded_runs(runs_dir: str | Path) -> dict[str, ScalingRun]:
    """The runs runs_dir's results.csv records (with scores.json's per-window losses), by folder."""
    table = Path(runs_dir) / "results.csv"
    return {r.dir: r for r in read_runs_csv(table)} if table.is_file() else {}


def _with_recorded(root: Path, runs, unfinished, source) -> tuple[list[ScalingRun], str, str]:
    """The run folders' runs plus the runs results.csv records whose folders are gone (a sweep resumed
    in another checkout from its committed table), and the note results.md says about them."""
    on_disk = {r.dir for r in runs} | set(unfinished)
    recorded = [r for d, r in recorded_runs(root).items() if d not in on_disk]
    if not recorded:
        return runs, source, ""
    recorded_source = "test split" if all(r.se > 0 for r in recorded) else "validation"
    if runs and recorded_source != source:
        raise UserError(
            f"{root}: its run folders are scored on the {source} and the runs results.csv records on the "
            f"{recorded_source}; one sweep is scored on one"
        )
    if not runs and not unfinished:
        return recorded, recorded_source, "rendered from results.csv: the run folders are not on disk"
    n = len(recorded)
    return runs + recorded, source, f"{n} run{'s' if n > 1 else ''} from results.csv: their folders are not on disk"


def write_scaling_results(
    runs_dir: str | Path,
    out_dir: str | Path,
    *,
    command: str = "",
    plots: bool = True,
    analysis_version: int | None = None,
) -> Scaling:
    """Read the sweep's finished runs under runs_dir (or, with no run folders there, its
    results.csv: the per-seed scores); write results.md, results.csv, gap_vs_params.png and
    gap_vs_compute.png (for a grid of cells at one N, grid_gaps.png) into out_dir (created; only these
    files written), scored under the analysis
    rules of analysis_version (default: the current one)."""
    runs, unfinished, source = read_runs(runs_dir)
    runs, source, note = _with_recorded(Path(runs_dir), runs, unfinished, source)
    manifest = read_manifest(runs_dir) if (Path(runs_dir) / MANIFEST).is_file() else None
    command = command or (manifest or {}).get("command") or ""
    seen = {r.dir for r in runs} | set(unfinished)  # a sweep stopped early: its planned runs not begun
    unfinished += [f"{p['dir']} (not started)" for p in (manifest or {}).get("runs", []) if p["dir"] not in seen]
    if not runs:
        raise UserError(f"{runs_dir}: no finished run (expected run folders at <size>/<variant>/seed<k>)")
    lm = ((manifest or {}).get("metrics") or {}).get("lm") or {}
    sc = analyse(runs, source=source, rules=rules_of(analysis_version), train_tokens=lm.get("train_tokens"))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    grid = len(sc.size_params) > 1 and len(set(sc.size_params.values())) == 1 and grid_factors(sc.sizes)
    if plots and grid and all(len(v.gaps) == len(sc.sizes) for v in sc.variants):
        written = [plot_grid(sc, out / "grid_gaps.png")]  # one N: a line in N or C has nothing to show
    elif plots and any(v.gaps for v in sc.variants):
        written = [
            plot_scaling(sc, out / "gap_vs_params.png"),
            plot_scaling(sc, out / "gap_vs_compute.png", against="compute"),
        ]
    atomic_write(out / "results.csv", to_csv(sc))
    write_unit_scores(out, sc.runs)
    if manifest is not None and Path(out).resolve() == Path(runs_dir).resolve():
        write_manifest(out, {**manifest, "analysis_version": sc.rules.version})
    scan_file = Path(runs_dir) / LR_SCAN_FILE
    scan = json.loads(scan_file.read_text()) if scan_file.is_file() else None
    atomic_write(
        out / "results.md", to_markdown(sc, [str(p) for p in written], unfinished, command, manifest, note, scan)
    )
    return sc
