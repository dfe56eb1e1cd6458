"""qkvlab.base.loadavg: the quiet/noisy verdict, what a LoadWatch records, --require-quiet's exit code, and
timings that measured nothing reported as unmeasured (never as a rate). No timing is asserted."""

from __future__ import annotations

import json

import pytest
import torch

from qkvlab.base import loadavg
from qkvlab.base.loadavg import LoadWatch, NoisyMachine, describe, rate, read_cpu_times, verdict
from qkvlab.decode.speed import DecodeTiming, best_of, time_hf


@pytest.mark.parametrize(
    "cores, load, others, steal, noisy, needle",
    [
        (2, 0.3, 0.0, 0.0, False, None),
        (2, 0.5, 0.1, 0.02, False, None),  # at the limits: still quiet
        (2, 0.51, 0.0, 0.0, True, "cores/4"),
        (16, 3.9, 0.0, 0.0, False, None),
        (16, 4.1, 0.0, 0.0, True, "cores/4"),
        (2, 0.1, 0.25, 0.0, True, "other processes took 0.25 cores"),
        (2, 0.1, 0.0, 0.05, True, "stolen"),
        (2, None, None, None, False, None),  # nothing readable: no verdict of noise
    ],
)
def test_noisy_verdict(cores, load, others, steal, noisy, needle):
    got, reasons = verdict(cores, load, others, steal)
    assert got is noisy and bool(reasons) is noisy
    if needle:
        assert any(needle in r for r in reasons)


def test_watch_counts_other_processes_cpu_from_proc_stat(monkeypatch):
    """Machine busy time minus this process's own CPU time, per second of the run."""
    ticks = iter([(100.0, 1.0, 400.0), (106.0, 1.0, 410.0)])  # busy, steal, all (seconds)
    own = iter([50.0, 52.0])
    clock = iter([10.0, 14.0])
    monkeypatch.setattr(loadavg, "read_cpu_times", lambda: next(ticks))
    monkeypatch.setattr(loadavg, "own_cpu_seconds", lambda: next(own))
    monkeypatch.setattr(loadavg.time, "perf_counter", lambda: next(clock))
    monkeypatch.setattr(loadavg, "read_loadavg", lambda: (0.2, 0.1, 0.0))
    w = LoadWatch.start()
    w.cores = 2
    w.finish()
    assert w.others_cores == pytest.approx((6.0 - 2.0) / 4.0)  # 1 core taken by others
    assert w.steal == 0.0 and w.noisy and "other processes" in w.summary()
    d = w.to_dict()
    assert json.loads(json.dumps(d)) == {**d, "load_start": [0.2, 0.1, 0.0], "load_end": [0.2, 0.1, 0.0]}
    assert describe(d) == w.summary() and d["noisy"] is True


def test_require_quiet_refuses_before_and_after(monkeypatch):
    monkeypatch.setattr(loadavg, "read_loadavg", lambda: (5.0, 5.0, 5.0))
    w = LoadWatch.start()
    w.cores = 2
    assert w.noisy_before
    with pytest.raises(NoisyMachine, match="before starting") as e:
        loadavg.require_quiet(w, during=False)
    assert e.value.exit_code == 3
    monkeypatch.setattr(loadavg, "read_loadavg", lambda: (0.0, 0.0, 0.0))
    quiet = LoadWatch.start()
    quiet.cores = 2
    quiet.others_cores, quiet.steal = 0.0, 0.0
    loadavg.require_quiet(quiet, during=True)  # no raise
    quiet.others_cores = 1.5
    with pytest.raises(NoisyMachine, match="other processes"):
        loadavg.require_quiet(quiet, during=True)


def test_proc_stat_parses_where_present():
    times = read_cpu_times()
    if times is not None:  # Linux
        busy, steal, total = times
        assert 0 <= busy <= total and 0 <= steal <= total


@pytest.mark.parametrize("seconds", [0.0, -1e-3, None])
def test_a_timing_that_is_not_positive_is_unmeasured(seconds):
    assert rate(10, seconds) is None
    t = DecodeTiming(2, 8, 4, prefill_s=0.01, step_s=seconds)
    assert t.decode_tokens_per_s is None and t.end_to_end_tokens_per_s is None
    assert t.prefill_tokens_per_s == pytest.approx(2 * 8 / 0.01)
    assert best_of([t, t]).step_s is None
    ok = DecodeTiming(2, 8, 4, prefill_s=0.01, step_s=0.002)
    assert best_of([t, ok]).step_s == 0.002  # a measured round wins over an unmeasured one


def test_transformers_step_difference_not_positive_is_unmeasured(monkeypatch):
    """transformers' step is (generate(n) - generate(1)) / (n - 1): when the longer call is not
    slower (tiny shapes, noise), that is no measurement (the bench once printed 6.0e9 tok/s)."""

    class Fake:
        def generate(self, prompt, **kw):
            return None

    clock = iter([0.0, 0.5, 1.0, 1.2])  # generate(1) took 0.5 s, generate(4) 0.2 s
    monkeypatch.setattr("qkvlab.decode.speed.time.perf_counter", lambda: next(clock))
    t = time_hf(Fake(), torch.zeros(2, 3, dtype=torch.long), 4)
    assert t.step_s is None and t.decode_tokens_per_s is None and t.prefill_s == pytest.approx(0.5)


def test_cli_bench_require_quiet_exits_3_on_a_noisy_machine(monkeypatch, capsys):
    from qkvlab.cli import main

    monkeypatch.setattr(loadavg, "read_loadavg", lambda: (999.0, 999.0, 999.0))
    assert main(["bench", "--preset", "tiny", "--schemes", "Q-K-V", "--require-quiet", "--no-hf"]) == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert "noisy machine before starting" in err[-1] and "cores/4" in err[-1]


def test_script_run_records_path_options_as_text(tmp_path, monkeypatch, capsys):
    """--json keeps a path option and a list of them as text (a benchmark's GGUFs), and drops what JSON
    cannot hold, instead of failing at the end of a long run."""
    import argparse
    import json
    from pathlib import Path

    from qkvlab.base.loadavg import ScriptRun

    monkeypatch.setattr("qkvlab.base.loadavg.load1", lambda: 0.0)
    out = tmp_path / "run.json"
    args = argparse.Namespace(
        json=str(out), gguf=Path("a/m.gguf"), ggufs=[Path("f32.gguf"), Path("bf16.gguf")], rounds=3, fn=print
    )
    run = ScriptRun(args, "demo")
    assert run.finish({"rows": [1]}) == 0
    body = json.loads(out.read_text())
    assert body["options"]["gguf"] == "a/m.gguf" and body["options"]["ggufs"] == ["f32.gguf", "bf16.gguf"]
    assert body["options"]["rounds"] == 3 and "fn" not in body["options"] and body["rows"] == [1]
