"""The mechanism behind the speed policies decided by measurement (qkvlab.base.measured): the rule that keeps
a default unless another option wins by more than the noise, alternating rounds, the per-machine
cache. Fake timings only: nothing here asserts a speed."""

from __future__ import annotations

import json

import pytest

from qkvlab.base.measured import MIN_NOISE, alternate, cached_or_measured, choose, machine_key


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


def test_rounds_alternate_their_order_after_a_warm_up():
    calls = []

    def way(name):
        return lambda: calls.append(name) or float(len(calls))

    times = alternate({"a": way("a"), "b": way("b"), "c": way("c")}, rounds=3)
    assert calls == ["a", "b", "c", "a", "b", "c", "c", "b", "a", "a", "b", "c"]  # warm-up, then alternating
    assert {k: len(v) for k, v in times.items()} == {"a": 3, "b": 3, "c": 3}


def test_a_decision_is_cached_per_machine_with_its_figures_and_an_old_entry_is_measured_again(tmp_path):
    path, calls = tmp_path / "probe.json", []

    def measure():
        calls.append(1)
        return {"x": [0.002] * 3, "y": [0.001] * 3}

    first = cached_or_measured("k", "x", measure, path)
    assert (first["choice"], first["source"], first["ms"]) == ("y", "measured now", {"x": 2.0, "y": 1.0})
    assert first["default"] == "x" and first["noise"] == MIN_NOISE
    again = cached_or_measured("k", "x", measure, path)
    assert (again["choice"], again["source"], len(calls)) == ("y", "cached", 1)
    # an entry in an older format, or one that never timed this default: measured again, and replaced
    saved = json.loads(path.read_text())
    saved[machine_key()]["k"] = {"dtype": "bf16", "noise": 0.03, "fp32_ms": 1.0, "bf16_ms": 0.5}
    path.write_text(json.dumps(saved))
    assert cached_or_measured("k", "x", measure, path)["source"] == "measured now" and len(calls) == 2
    assert cached_or_measured("k", "z", lambda: {"z": [1.0], "x": [1.0]}, path)["source"] == "measured now"
    assert set(json.loads(path.read_text())[machine_key()]["k"]["ms"]) == {"z", "x"}
