"""Count crashes of tests/fsdp_worker.py's pattern (FSDP2 on two gloo ranks, then teardown and exit).

    python scripts/repro_fsdp_gloo.py [--runs 100] [--schemes Q-K-V ...] [--mode fork|exec]
                                      [--exit normal|now] [--out DIR]

Each run starts two fresh ranks (fork: forked from this process after its imports, so a run costs
the work and not torch's import; exec: two new interpreters running the worker itself, as torchrun
starts them), lets them train tiny models as the worker does, and records how each rank ended (exit
code or signal). faulthandler is on in the ranks, so a crash prints its Python stack to
DIR/run-N-rank-R.err. fork mode also records the threads each rank still has after the teardown
(gloo's are named gloo_tcp_loop and pt_gloo_runloop), then leaves through the interpreter's normal
exit (--exit normal, the worker's old way) or os._exit (--exit now, the worker's way). Prints one
line per failed run and a summary: runs, failed runs by outcome, ranks that still had gloo threads.
"""

from __future__ import annotations

import argparse
import collections
import faulthandler
import os
import signal
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path

WORKER = Path(__file__).resolve().parent.parent / "tests" / "fsdp_worker.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank: int, port: int) -> dict:
    return {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": "2",
        "LOCAL_WORLD_SIZE": "2",
        "OMP_NUM_THREADS": "1",
    }


def ended(status: int) -> str:
    if os.WIFSIGNALED(status):
        return signal.Signals(os.WTERMSIG(status)).name
    return f"exit {os.WEXITSTATUS(status)}"


def threads() -> list[str]:
    return sorted(Path(f"/proc/self/task/{t}/comm").read_text().strip() for t in os.listdir("/proc/self/task"))


def run_forked(schemes: list[str], port: int, err: Path, worker_main, exit_now: bool) -> list[str]:
    pids = []
    for rank in range(2):
        pid = os.fork()
        if pid == 0:  # the rank: run the worker, then leave as --exit says
            fd = os.open(err.with_name(f"{err.name}-rank-{rank}.err"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(fd, 2)
            os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
            os.environ.update(rank_env(rank, port))
            faulthandler.enable(all_threads=True)
            code = 0
            try:
                worker_main(schemes)
                print(f"threads after teardown: {' '.join(threads())}", file=sys.stderr, flush=True)
            except BaseException:
                traceback.print_exc()
                code = 1
            if exit_now:
                os._exit(code)
            raise SystemExit(code)  # unwinds this (copied) stack: the interpreter's normal exit
        pids.append(pid)
    return [ended(os.waitpid(pid, 0)[1]) for pid in pids]


def run_exec(schemes: list[str], port: int, err: Path, timeout: float) -> list[str]:
    procs = []
    for rank in range(2):
        with open(err.with_name(f"{err.name}-rank-{rank}.err"), "w") as f:
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-X", "faulthandler", str(WORKER), *schemes],
                    env={**os.environ, **rank_env(rank, port)},
                    stdout=subprocess.DEVNULL,
                    stderr=f,
                )
            )
    out = []
    for p in procs:
        try:
            code = p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            out.append("timeout")
            continue
        out.append(signal.Signals(-code).name if code < 0 else f"exit {code}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=100)
    ap.add_argument("--schemes", nargs="+", default=["Q-K-V"])
    ap.add_argument("--mode", choices=["fork", "exec"], default="fork")
    ap.add_argument("--exit", choices=["normal", "now"], default="normal", help="fork mode: how a rank leaves")
    ap.add_argument("--out", type=Path, default=Path("repro-fsdp-gloo"))
    ap.add_argument("--timeout", type=float, default=300)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    worker_main = None
    if args.mode == "fork":
        sys.path.insert(0, str(WORKER.parent))
        from torch.distributed.checkpoint import state_dict  # noqa: F401
        from torch.distributed.fsdp import fully_shard  # noqa: F401

        import fsdp_worker  # torch, FSDP and DCP imported once, before the forks

        worker_main = fsdp_worker.main
    counts: collections.Counter = collections.Counter()
    start = time.monotonic()
    for i in range(args.runs):
        err = args.out / f"run-{i}"
        if args.mode == "fork":
            res = run_forked(args.schemes, free_port(), err, worker_main, args.exit == "now")
        else:
            res = run_exec(args.schemes, free_port(), err, args.timeout)
        bad = res != ["exit 0", "exit 0"]
        counts["failed" if bad else "ok"] += 1
        if bad:
            counts[" / ".join(res)] += 1
            print(f"run {i}: rank 0 {res[0]}, rank 1 {res[1]} (stderr: {err}-rank-*.err)", flush=True)
    mins = (time.monotonic() - start) / 60
    alive = [
        f for f in args.out.glob("run-*-rank-*.err") if "gloo" in f.read_text().partition("threads after teardown:")[2]
    ]
    print(f"{args.runs} runs in {mins:.1f} min: {counts['failed']} failed {dict(counts)}", flush=True)
    if args.mode == "fork":
        print(f"ranks with gloo threads still running after the teardown: {len(alive)} of {2 * args.runs}", flush=True)


if __name__ == "__main__":
    main()
