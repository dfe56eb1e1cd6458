"""What holding freed memory (qkvlab.base.heap) buys a CPU training step, measured alternately.

The setting is process-wide, so the two ways cannot share a process: each round runs
train_throughput.py's anchor (L6 H6 D384 T256 V4096 B8) twice, in child processes, once with
`--heap hold` (what `qkvlab train` sets on the CPU) and once with `--heap glibc` (its defaults),
in alternating order, and reads each child's best tokens/s and page faults per step. Reported: best
and median per way, and hold / glibc from the best. The load is the parent's (its children count as
its own work).

    python benchmarks/heap_hold.py --threads 2 --rounds 4
    python benchmarks/heap_hold.py --threads 2 --contestant qkvlab@bf16
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from qkvlab.base.flag_values import positive_int
from qkvlab.base.loadavg import ScriptRun, add_options
from train_throughput import parse_contestants  # this folder: run as a script, it is on the path

HERE = Path(__file__).resolve().parent
WAYS = ("hold", "glibc")


def one(way: str, args, json_path: Path) -> dict:
    cmd = [sys.executable, str(HERE / "train_throughput.py"), "--contestants", args.contestant, "--heap", way]
    cmd += ["--rounds", str(args.child_rounds), "--steps", str(args.steps), "--no-ceiling", "--json", str(json_path)]
    cmd += ["--threads", str(args.threads)] if args.threads else []
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"heap_hold: the {way} child failed:\n{done.stdout}{done.stderr}")
    figures = json.loads(json_path.read_text())
    json_path.unlink()
    return figures["contestants"][args.contestant]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contestant", default="qkvlab", help="one train_throughput.py contestant (default qkvlab)")
    p.add_argument("--rounds", type=positive_int, default=4, help="alternating rounds (two children each)")
    p.add_argument("--child-rounds", type=positive_int, default=2, help="each child's own rounds")
    p.add_argument("--steps", type=positive_int, default=3, help="timed steps per child round")
    p.add_argument("--threads", type=positive_int, default=None)
    add_options(p)
    args = p.parse_args()
    if len(parse_contestants(args.contestant, "fp32")) != 1:  # its own one-line refusal for a bad name
        raise SystemExit(f"--contestant: {args.contestant!r} is not one contestant")
    run = ScriptRun(args, "heap_hold")
    best: dict[str, list[float]] = {w: [] for w in WAYS}
    faults: dict[str, list[float]] = {w: [] for w in WAYS}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for way in WAYS if r % 2 == 0 else WAYS[::-1]:
                fig = one(way, args, Path(tmp) / f"{way}.json")
                best[way].append(fig["best_tokens_per_s"])
                faults[way].append(fig["page_faults_per_step"])
                print(
                    f"  round {r + 1} {way:>5}: {fig['best_tokens_per_s']:8,.0f} tok/s, "
                    f"{fig['page_faults_per_step']:8,.0f} page faults a step  {run.tag()}",
                    flush=True,
                )
    figures = {"contestant": args.contestant, "rounds": best, "page_faults_per_step": faults}
    for way in WAYS:
        print(
            f"  {way:>5}: best {max(best[way]):8,.0f} tok/s, median {statistics.median(best[way]):8,.0f}; "
            f"median {statistics.median(faults[way]):,.0f} page faults a step  {run.tag()}"
        )
    figures["hold_over_glibc"] = max(best["hold"]) / max(best["glibc"])
    print(f"  {args.contestant}: hold / glibc {figures['hold_over_glibc']:.3f}x (best of rounds)  {run.tag()}")
    sys.exit(run.finish(figures))


if __name__ == "__main__":
    main()
