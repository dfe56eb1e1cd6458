"""`qkvlab compare`'s worker processes die with it: a SIGKILLed compare leaves nothing training and
no run folder locked (compare.workers.die_with_parent)."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from qkvlab.base.folders import LOCK

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def _children(pid: int) -> list[int]:
    kids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                kids.append(int(entry.name))
    return kids


def _alive(pid: int) -> bool:
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _is_worker(pid: int) -> bool:
    try:
        return b"spawn_main" in (Path("/proc") / str(pid) / "cmdline").read_bytes()
    except OSError:
        return False


def _wait(cond, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.1)
    return cond()


def test_a_sigkilled_compare_takes_its_workers_and_their_locks_with_it(tmp_path, corpus):
    out = tmp_path / "cmp"
    cmd = [sys.executable, "-m", "qkvlab", "compare", "--out", str(out), "--data", str(corpus), "--tokenizer", "char",
           "--preset", "tiny", "--n-layer", "1", "--d-model", "32", "--context", "32", "--batch-size", "8",
           "--max-steps", "100000", "--eval-every", "50", "--variants", "Q-K-V,Q-K=V", "--seeds", "1",
           "--jobs", "2", "--threads", "1", "--dtype", "fp32", "--no-plots"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    workers: list[int] = []
    try:

        def training() -> bool:
            workers[:] = [p for p in _children(proc.pid) if _is_worker(p)]
            started = list(out.glob(f"lm/*/seed0/{LOCK}"))
            return len(workers) == 2 and len(started) == 2

        assert _wait(training, 120), f"the workers did not start: {proc.poll()} {workers}"
        locks = list(out.glob(f"lm/*/seed0/{LOCK}"))
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        assert _wait(lambda: not any(_alive(p) for p in workers), 10), "workers outlived their compare"
        for lock in locks:  # nothing holds a run's lock: a re-run may start at once
            fd = os.open(lock, os.O_RDWR)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            finally:
                os.close(fd)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in workers:  # on a failure: leave nothing of this test running
            if _alive(pid) and _is_worker(pid):
                os.kill(pid, signal.SIGKILL)
