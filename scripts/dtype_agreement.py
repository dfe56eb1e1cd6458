"""Do two comparisons that differ only in their training dtype reach the same test losses?

Runs of one variant at one seed start from the same weights and see the same batches (init.py, the
data order), so the difference of their test losses is the dtype's effect alone. Per variant: the
paired difference B - A over the seeds both folders hold, with its 95% interval, beside A's seed
spread (the sample SD over seeds, the noise every comparison of variants already carries).

    python scripts/dtype_agreement.py runs/compare-lm-fp32 runs/compare-lm   # A = fp32, B = bf16
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from qkvlab.analysis.intervals import mean_interval, paired_differences
from qkvlab.analysis.runs import read_manifest, read_test, test_value


def test_losses(folder: Path) -> dict[tuple[str, int], float]:
    """(variant, seed) -> the run's test loss, for every scored run of the compare folder."""
    out = {}
    for r in read_manifest(folder)["runs"]:
        scored = test_value(read_test(folder / r["dir"]), "val_loss")
        if scored is not None:
            out[(r["variant"], int(r["seed"]))] = scored[0]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("a", type=Path, help="compare folder A (e.g. fp32)")
    p.add_argument("b", type=Path, help="compare folder B (e.g. bf16)")
    args = p.parse_args()
    dtypes = [read_manifest(f).get("machine", {}).get("train_dtype", "?") for f in (args.a, args.b)]
    a, b = test_losses(args.a), test_losses(args.b)
    variants = list(dict.fromkeys(v for v, _ in a))
    print(f"A = {args.a} ({dtypes[0]}), B = {args.b} ({dtypes[1]}); test loss, paired by seed\n")
    print("| variant | seeds | A mean | B mean | B - A (95% CI) | A's seed SD | within A's seed SD |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for v in variants:
        seeds = sorted(s for w, s in a if w == v and (v, s) in b)
        if len(seeds) < 2:
            continue
        diffs = paired_differences({s: b[(v, s)] for s in seeds}, {s: a[(v, s)] for s in seeds})
        iv = mean_interval(diffs)
        sd = statistics.stdev(a[(v, s)] for s in seeds)
        within = "yes" if max(abs(iv.lo), abs(iv.hi)) < sd else ("no" if abs(iv.estimate) >= sd else "interval wider")
        a_mean = statistics.fmean(a[(v, s)] for s in seeds)
        b_mean = statistics.fmean(b[(v, s)] for s in seeds)
        print(
            f"| `{v}` | {len(seeds)} | {a_mean:.4f} | {b_mean:.4f} | {iv.estimate:+.4f} [{iv.lo:+.4f}, {iv.hi:+.4f}] "
            f"| {sd:.4f} | {within} |"
        )


if __name__ == "__main__":
    main()
