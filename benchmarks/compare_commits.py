"""The main job's wall time at several commits on one machine, in alternating rounds: did `compare` get slower?

    python benchmarks/compare_commits.py COMMIT [COMMIT ...] [--variants Q-K-V,Q-K=V] [--seeds 1] [--jobs 2]
        [--rounds 3] [--max-steps N] [--require-quiet] [--json FILE]

Each commit's `src/` is extracted (`git archive`, into a temporary folder; the repository is not touched) and
run by this venv's Python as `python -m qkvlab compare --variants V --seeds N --jobs J --out FRESH`, each run
with an empty `QKVLAB_CACHE` (a fresh machine's: no timed decision carried from an earlier run). Rounds
alternate the commits' order (reversed every other round); the median wall time of each commit is printed
with its ratio to the first commit's, and every run's time, so a reader sees the spread.
Commits whose dependencies differ from this venv's are not comparable this way (the script does not install).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from qkvlab.base.flag_values import positive_int
from qkvlab.base.loadavg import ScriptRun, add_options

REPO = Path(__file__).resolve().parent.parent


def extract(commit: str, into: Path) -> Path:
    """COMMIT's src/ under into/COMMIT (a tar stream from git, read without a shell)."""
    dest = into / commit
    dest.mkdir(parents=True)
    archive = dest / "src.tar"
    with open(archive, "wb") as f:
        subprocess.run(["git", "-C", str(REPO), "archive", commit, "src"], stdout=f, check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(dest, filter="data")
    archive.unlink()
    return dest / "src"


def one_run(src: Path, out: Path, cache: Path, args) -> float:
    env = {**os.environ, "PYTHONPATH": str(src), "QKVLAB_CACHE": str(cache)}
    cmd = [sys.executable, "-m", "qkvlab", "compare", "--variants", args.variants, "--seeds", str(args.seeds)]
    cmd += ["--jobs", str(args.jobs), "--out", str(out)]
    if args.max_steps:
        cmd += ["--max-steps", str(args.max_steps)]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, env=env, cwd=out.parent, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    seconds = time.perf_counter() - t0
    if done.returncode != 0:
        tail = done.stderr.strip().splitlines()[-1:] or ["(no message)"]
        raise SystemExit(f"compare_commits: {src.parent.name}: compare exited {done.returncode}: {tail[0]}")
    return seconds


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("commits", nargs="+", metavar="COMMIT")
    p.add_argument("--variants", default="Q-K-V,Q-K=V", help="compare's --variants (default: two, one per job)")
    p.add_argument("--seeds", type=positive_int, default=1)
    p.add_argument("--jobs", type=positive_int, default=2)
    p.add_argument("--rounds", type=positive_int, default=3)
    p.add_argument("--max-steps", type=positive_int, default=None, help="compare's --max-steps (default: its own)")
    add_options(p)
    args = p.parse_args()
    for c in args.commits:
        if (
            subprocess.run(
                ["git", "-C", str(REPO), "rev-parse", "--verify", "-q", f"{c}^{{commit}}"], capture_output=True
            ).returncode
            != 0
        ):
            raise SystemExit(f"compare_commits: {c!r} is not a commit of {REPO}; give a hash or branch it has")
    run = ScriptRun(args, "compare_commits")
    times: dict[str, list[float]] = {c: [] for c in args.commits}
    with tempfile.TemporaryDirectory(prefix="qkvlab-commits-") as tmp:
        root = Path(tmp)
        srcs = {c: extract(c, root) for c in args.commits}
        for r in range(args.rounds):
            for c in args.commits if r % 2 == 0 else args.commits[::-1]:
                work = root / f"round{r}-{c}"
                (work / "cache").mkdir(parents=True)
                seconds = one_run(srcs[c], work / "out", work / "cache", args)
                times[c].append(seconds)
                print(f"round {r + 1}: {c} {seconds:.1f} s {run.tag()}", flush=True)
    first = statistics.median(times[args.commits[0]])
    rows = []
    print(f"\n{'commit':<14} {'median s':>9} {'vs first':>9}  every run (s)")
    for c in args.commits:
        med = statistics.median(times[c])
        rows.append({"commit": c, "median_s": med, "ratio_to_first": med / first, "runs_s": times[c]})
        print(f"{c:<14} {med:>9.1f} {med / first:>8.2f}x  " + ", ".join(f"{t:.1f}" for t in times[c]))
    return run.finish({"variants": args.variants, "seeds": args.seeds, "jobs": args.jobs, "rows": rows})


if __name__ == "__main__":
    sys.exit(main())
