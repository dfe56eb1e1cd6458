"""A compare folder's results files: written after its runs trained (`write_after_training`), and
re-derived from what the folder stores (`render`: `qkvlab compare --render`, no planning, no training)."""

from __future__ import annotations

from pathlib import Path

from qkvlab.analysis.runs import MANIFEST, read_manifest, write_manifest
from qkvlab.base.errors import UserError
from qkvlab.base.units import fmt_duration
from qkvlab.compare.planning import Plan
from qkvlab.compare.sweep import write_scan_choice

# function-level imports: startup: qkvlab.analysis.report, qkvlab.analysis.results, qkvlab.analysis.scaling
# and qkvlab.analysis.scaling_report import scipy; they load when results are written, so `compare --help`
# and `--dry-run` start without.


def write_after_training(
    plan: Plan, manifest: dict, trained_before: dict | None, n_runs: int, n_trained: int, wall: float, command, say
):
    """The timing into compare.json, then results.md/csv and plots (the sweep's own writer for --sweep);
    returns what the writer analysed (Results, or a sweep's Scaling)."""
    from qkvlab.analysis.report import write_results
    from qkvlab.analysis.results import collect

    out, cfg = plan.out, plan.config
    if cfg.sweep:  # its scores.json is the sweep's own (per-window losses), not a family's
        from qkvlab.analysis.scaling import read_runs

        train_s = [r.train_s for r in read_runs(out)[0]]
    else:
        res = collect(out)
        train_s = [float(r.final.get("elapsed_s") or 0) for r in res.runs]
    manifest["timing"] = (trained_before or {}).get("timing") or {
        "wall_s": round(wall, 1),
        "trained": n_trained,
        "skipped": n_runs - n_trained,
        "train_s_total": round(sum(train_s), 1),
    }
    write_manifest(out, manifest)
    if cfg.sweep:
        from qkvlab.analysis.scaling_report import write_scaling_results

        if (choice := write_scan_choice(out)) is not None:  # first: results.md shows it
            say(f"compare: wrote {choice}, the lr each size's sweep takes (--lr-scan {out})")
        results = write_scaling_results(out, out, command=command or "", plots=cfg.plots)
    else:
        res.manifest = manifest
        results = write_results(out, res, plots=cfg.plots)
    plots = " and plots" if cfg.plots else ""
    say(
        f"compare: wrote {out / 'results.md'}, {out / 'results.csv'}{plots}; wall time {fmt_duration(wall)} ({wall:.0f} s)"
    )
    return results


def render(out: str | Path, analysis_version: int | None = None, *, plots: bool = True, say=print):
    """`qkvlab compare --render`: no planning, no training. Re-derive OUT's results.md, results.csv
    and plots from what OUT stores (its run folders, else scores.json; a sweep: its run folders, else
    its per-seed results.csv) under the analysis rules of analysis_version (default: the current)."""
    out = Path(out)
    if not out.is_dir():
        raise UserError(f"{out}: no such folder (--render re-derives the results of a compare folder)")
    if is_sweep(out):
        from qkvlab.analysis.scaling_report import write_scaling_results

        write_scan_choice(out)
        result = write_scaling_results(out, out, plots=plots, analysis_version=analysis_version)
    elif (out / MANIFEST).is_file():
        from qkvlab.analysis.report import write_results

        result = write_results(out, plots=plots, analysis_version=analysis_version)
    else:
        raise UserError(f"{out}: neither a compare folder ({MANIFEST}) nor a sweep's results.csv")
    say(f"compare: re-derived {out / 'results.md'} and {out / 'results.csv'} from the stored scores")
    return result


def is_sweep(out: Path) -> bool:
    """OUT holds a sweep: its compare.json says so (manifests before that key: every grid point carries
    its own steps, as only a sweep's sizes do), or its results.csv has a size column. Deciding by the
    results.csv alone rendered a sweep stopped before its end as one pooled grid point."""
    if (out / MANIFEST).is_file():
        m = read_manifest(out)
        if "sweep" in m:
            return bool(m["sweep"])
        if m.get("grid") and all("steps" in g for g in m["grid"]):
            return True
    if (out / "results.csv").is_file():
        with (out / "results.csv").open() as f:
            return "size" in f.readline().split(",")
    return False
