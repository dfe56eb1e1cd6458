"""The mechanism behind the speed policies decided by measurement (qkvlab.base.measured): the rule that keeps
a default unless another option wins by more than the noise; rounds of a least duration, alternating,
until the estimates settle; what is cached (quiet and settled only) and what a cached decision records;
expiry on a version change; a later check that contradicts a decision; `qkvlab info --decisions` and
`--forget`. Fake clocks and loads only: nothing here times anything or asserts a speed."""

from __future__ import annotations

import json

import pytest

from conftest import FakeClock, fake_timer
from qkvlab.base import measured
from qkvlab.base.measured import (
    DECISIONS_FILE,
    MIN_NOISE,
    Measured,
    alternate,
    cached_lines,
    choose,
    decide,
    forget,
    machine_key,
    versions,
)
from qkvlab.cli import main


def test_the_default_is_kept_unless_another_option_wins_by_more_than_the_noise():
    times = {"rows": [1.0] * 3, "stored": [0.99] * 3, "columns": [1.2] * 3}
    assert choose(times, "rows") == ("rows", MIN_NOISE)  # 1% faster: inside the least noise
    times["stored"] = [0.5] * 3
    assert choose(times, "rows") == ("stored", MIN_NOISE)
    times["columns"] = [0.4] * 3
    assert choose(times, "rows")[0] == "columns"  # the fastest challenger
    assert choose(times, "columns")[0] == "columns"  # already the fastest: kept
    # a spread of 50% in any option's rounds raises the bar for all of them
    noisy = {"rows": [1.0, 1.5, 1.5], "stored": [0.7] * 3}
    assert choose(noisy, "rows") == ("rows", pytest.approx(0.5))
    assert choose({"rows": [1.0] * 3, "stored": []}, "rows")[0] == "rows"  # nothing to go by
    assert choose({"rows": [1.0] * 3}, "rows")[0] == "rows"  # no other option


def test_a_short_step_is_repeated_for_the_least_round_time_in_alternating_rounds_until_settled():
    clock, order = FakeClock(), []

    def way(name, seconds):
        step = clock.way(seconds, name=name)
        return lambda: (order.append(name), step())

    timer = fake_timer(clock, min_round_s=0.05, min_rounds=3, max_rounds=9)
    rounds = alternate({"a": way("a", 0.002), "b": way("b", 0.01), "c": way("c", 0.2)}, timer)
    # a warm-up call and a timed call each, then 25 calls of 2 ms a round, 5 of 10 ms, one of 200 ms
    assert rounds.reps == {"a": 25, "b": 5, "c": 1}
    assert order[:6] == ["a", "a", "b", "b", "c", "c"]
    runs = [order[i] for i in range(6, len(order)) if i == 6 or order[i] != order[i - 1]]
    assert runs == ["a", "b", "c", "b", "a", "b", "c"]  # a b c, c b a, a b c: reversed every other round
    assert rounds.stable and rounds.rounds == 3  # equal rounds: settled as soon as allowed
    assert rounds.times["a"] == pytest.approx([0.002] * 3) and rounds.times["c"] == pytest.approx([0.2] * 3)
    # a step that keeps getting faster never settles: the rounds run out, and say so
    drifting = clock.way(*(0.002 * 0.97**i for i in range(2000)))
    unsettled = alternate({"a": drifting, "b": clock.way(0.002)}, timer)
    assert not unsettled.stable and unsettled.rounds == 9
    # a check: exactly the rounds asked for
    assert alternate({"a": clock.way(0.002), "b": clock.way(0.002)}, timer, rounds=2).rounds == 2


def ways_counting(built: list, **seconds):
    """A `decide` ways builder on one FakeClock: each option's seconds per call; counts its builds."""
    clock = seconds.pop("clock")

    def build():
        built.append(1)
        return clock.ways(**seconds)

    return build


def test_a_quiet_settled_decision_is_cached_with_when_what_load_how_many_rounds_and_versions(tmp_path):
    path, clock, built = tmp_path / DECISIONS_FILE, FakeClock(), []
    quiet = fake_timer(clock, load=0.1, others=0.02)
    first = decide("k", "x", ways_counting(built, clock=clock, x=0.002, y=0.001), timer=quiet, path=path)
    assert (first.choice, first.source, first.ms) == ("y", "measured now", {"x": 2.0, "y": 1.0})
    assert first.default == "x" and first.noise == MIN_NOISE and first.stable and first.rounds == 5
    assert first.load == {"load_before": 0.1, "others_cores": 0.02, "cores": 2}
    assert (first.torch, first.qkvlab) == (versions()["torch"], versions()["qkvlab"]) and first.when.endswith("UTC")
    saved = json.loads(path.read_text())[machine_key()]["k"]
    assert Measured.from_entry("k", saved, "measured now") == first
    # later: the cache answers after a short check that agrees (one build, 2 rounds each, not 5)
    calls_before = dict(clock.calls)
    again = decide("k", "x", ways_counting(built, clock=clock, x=0.002, y=0.001), timer=quiet, path=path)
    assert (again.choice, again.source, len(built)) == ("y", "cached", 2)
    assert again.when == first.when and json.loads(path.read_text())[machine_key()]["k"] == saved
    assert clock.calls["x"] - calls_before["x"] == 2 + 2 * 25  # warm-up, timed call, two rounds of 25


def test_a_measurement_on_a_busy_machine_or_one_that_never_settled_is_used_but_not_cached(tmp_path):
    """The case that made the README's tests fail: one noisy timing decided a dtype for good."""
    path, clock = tmp_path / DECISIONS_FILE, FakeClock()
    busy = fake_timer(clock, load=1.5, cores=2)  # more than a quarter of the cores busy before
    got = decide("k", "fp32", lambda: clock.ways(fp32=0.003, bf16=0.002), timer=busy, path=path)
    assert got.choice == "bf16" and "not cached: machine busy (1-min load 1.50" in got.source
    assert not path.exists()
    others = fake_timer(clock, others=0.5)  # quiet before, but others took half a core while it ran
    got = decide("k", "fp32", lambda: clock.ways(fp32=0.003, bf16=0.002), timer=others, path=path)
    assert "not cached: machine busy (other processes took 0.50 cores" in got.source and not path.exists()
    drifting = clock.way(*(0.002 * 0.97**i for i in range(4000)))
    got = decide("k", "fp32", lambda: {"fp32": drifting, "bf16": clock.way(0.002)}, timer=fake_timer(clock), path=path)
    assert "not cached: the estimates did not settle in 15 rounds" in got.source and not got.stable
    assert not path.exists()
    quiet = decide("k", "fp32", lambda: clock.ways(fp32=0.003, bf16=0.002), timer=fake_timer(clock), path=path)
    assert quiet.source == "measured now" and json.loads(path.read_text())[machine_key()]["k"]["choice"] == "bf16"


def test_a_version_change_expires_a_decision(tmp_path, monkeypatch):
    path, clock = tmp_path / DECISIONS_FILE, FakeClock()
    timer = fake_timer(clock)
    decide("k", "fp32", lambda: clock.ways(fp32=0.003, bf16=0.002), timer=timer, path=path)
    now = versions()
    monkeypatch.setattr(measured, "versions", lambda: {**now, "qkvlab": "9.9.9"})
    got = decide("k", "fp32", lambda: clock.ways(fp32=0.002, bf16=0.003), timer=timer, path=path)
    assert got.choice == "fp32" and got.qkvlab == "9.9.9"
    assert got.source == f"measured now; measured again: qkvlab {now['qkvlab']} -> 9.9.9"
    assert json.loads(path.read_text())[machine_key()]["k"]["qkvlab"] == "9.9.9"  # replaced
    monkeypatch.setattr(measured, "versions", lambda: {**now, "qkvlab": "9.9.9", "torch": "3.0"})
    assert "torch" in decide("k", "fp32", lambda: clock.ways(fp32=0.002, bf16=0.003), timer=timer, path=path).source


@pytest.mark.parametrize(
    "cached,later,replaced",
    [
        (("bf16", 0.003, 0.002), (0.002, 0.003), "a check timed bf16 1.50x fp32's time"),  # the winner now loses
        (("bf16", 0.003, 0.002), (0.002, 0.00202), None),  # slower by 1%: inside the noise, kept
        (("fp32", 0.002, 0.003), (0.003, 0.002), "a check timed fp32 1.50x bf16's time"),  # the default now loses
        (("fp32", 0.002, 0.003), (0.002, 0.002), None),  # a tie: kept
    ],
)
def test_a_later_quiet_check_that_contradicts_a_decision_by_more_than_its_noise_replaces_it(
    tmp_path, cached, later, replaced
):
    path, clock = tmp_path / DECISIONS_FILE, FakeClock()
    choice, fp32, bf16 = cached
    first = decide("k", "fp32", lambda: clock.ways(fp32=fp32, bf16=bf16), timer=fake_timer(clock), path=path)
    assert first.choice == choice
    fp32, bf16 = later
    busy = decide("k", "fp32", lambda: clock.ways(fp32=fp32, bf16=bf16), timer=fake_timer(clock, load=3.0), path=path)
    assert (busy.choice, busy.source) == (choice, "cached")  # a check on a busy machine is no evidence
    got = decide("k", "fp32", lambda: clock.ways(fp32=fp32, bf16=bf16), timer=fake_timer(clock), path=path)
    saved = json.loads(path.read_text())[machine_key()]["k"]
    if replaced is None:
        assert (got.choice, got.source, saved["when"]) == (choice, "cached", first.when)
    else:
        assert got.source == f"measured now; measured again: {replaced} (noise 3%)"
        assert got.choice != choice and saved["choice"] == got.choice


def test_an_entry_of_another_format_or_default_is_measured_again_and_the_old_file_is_never_read(tmp_path):
    clock = FakeClock()
    timer = fake_timer(clock)
    path = tmp_path / DECISIONS_FILE
    path.write_text(json.dumps({machine_key(): {"k": {"choice": "y", "default": "x", "noise": 0.03, "ms": {}}}}))
    assert decide("k", "x", lambda: clock.ways(x=0.002, y=0.002), timer=timer, path=path).source == "measured now"
    assert decide("k", "z", lambda: clock.ways(z=0.002, x=0.002), timer=timer, path=path).source == "measured now"
    assert set(json.loads(path.read_text())[machine_key()]["k"]["ms"]) == {"z", "x"}
    old = tmp_path / "dtype_probe.json"  # the old file: bf16 for a tiny shape from one noisy timing
    old.write_text(json.dumps({machine_key(): {"j": {"choice": "bf16", "default": "fp32", "noise": 0.09, "ms": {}}}}))
    got = decide("j", "fp32", lambda: clock.ways(fp32=0.002, bf16=0.003), timer=timer, path=path)
    assert (got.choice, got.source) == ("fp32", "measured now")


def test_a_damaged_or_unwritable_cache_only_costs_a_measurement(tmp_path):
    clock = FakeClock()
    damaged = tmp_path / DECISIONS_FILE
    damaged.write_text("{not json")
    assert decide("k", "x", lambda: clock.ways(x=0.002, y=0.001), timer=fake_timer(clock), path=damaged).choice == "y"
    assert json.loads(damaged.read_text())  # replaced by a good one
    (tmp_path / "file").write_text("x")
    unwritable = tmp_path / "file" / DECISIONS_FILE  # its folder is a file
    for _ in range(2):
        got = decide("k", "x", lambda: clock.ways(x=0.002, y=0.001), timer=fake_timer(clock), path=unwritable)
        assert (got.choice, got.source) == ("y", "measured now")
    assert (tmp_path / "file").read_text() == "x"


def test_info_lists_the_decisions_one_line_each_and_forget_removes_them(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("QKVLAB_CACHE", str(tmp_path))
    assert main(["info", "--decisions"]) == 0
    assert capsys.readouterr().out == f"no timed decisions in {tmp_path}\n"
    clock = FakeClock()
    for key in ("decode-a-b1", "layout-float32-cpu-r1"):
        decide(key, "fp32", lambda: clock.ways(fp32=0.003, bf16=0.002), timer=fake_timer(clock, load=0.25))
    (tmp_path / "dtype_probe.json").write_text(json.dumps({"old machine": {"x": {}}}))
    assert len(cached_lines(tmp_path)) == 3
    assert main(["info", "--decisions"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3 and lines[0].startswith("decode-a-b1: bf16 (default fp32; fp32 3 ms, bf16 2 ms; noise 3%")
    assert "5 rounds; load 0.25 on 2 cores" in lines[0] and lines[0].endswith(machine_key())
    assert f"qkvlab {versions()['qkvlab']}" in lines[0] and "UTC" in lines[0]
    assert "dtype_probe.json: decisions of an older qkvlab, never read" in lines[2]
    (tmp_path / "gpt2.tiktoken").write_text("installed data: not a decision")
    assert main(["info", "--forget"]) == 0
    assert (
        capsys.readouterr().out == f"removed 3 timed decisions ({DECISIONS_FILE}, dtype_probe.json) from {tmp_path}\n"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpt2.tiktoken"]
    assert forget(tmp_path) == f"no timed decisions in {tmp_path}: nothing removed"
