"""Training's and inference's `auto` dtype on the CPU is decided by timing (qkvlab.decode.dtype_probe): the
decision rule with fake timings, the cache per machine and shape class, the record a run keeps, the real
timers' ways (each called, never timed for a figure). Nothing here asserts a speed."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import FakeClock, fake_timer
from qkvlab.base.devices import cpu_has_bf16, cpu_name, dtype_name
from qkvlab.base.measured import DECISIONS_FILE, MIN_NOISE, Timer, alternate, choose
from qkvlab.decode import dtype_probe
from qkvlab.decode.dtype_probe import ShapeClass, autocast_dtype, cpu_autocast
from qkvlab.model.config import ModelConfig


@pytest.fixture(autouse=True)
def dtype_probe_fixed():
    """This file tests the real probe: conftest's fixed answer is switched off."""


def fake(clock: FakeClock, fp32: float, bf16: float, calls: list | None = None):
    """The probe's ways on a fake clock: a step of `fp32` / `bf16` seconds; `calls` lists the shapes
    the ways were built for (a measurement, or a cached decision's check)."""

    def ways(shape):
        if calls is not None:
            calls.append(shape)
        return clock.ways(fp32=fp32, bf16=bf16)

    return ways


def decide(fp32: list[float], bf16: list[float]) -> tuple[str, float]:
    return choose({"fp32": fp32, "bf16": bf16}, "fp32")


def test_bf16_only_when_faster_than_fp32_by_more_than_the_noise():
    assert decide([1.0] * 5, [0.5] * 5) == ("bf16", MIN_NOISE)
    assert decide([1.0] * 5, [1.0] * 5)[0] == "fp32"  # a tie is fp32
    assert decide([1.0] * 5, [1.6] * 5)[0] == "fp32"  # slower: fp32
    assert decide([1.0] * 5, [0.99] * 5)[0] == "fp32"  # faster, but within the least noise
    # rounds that spread by 30% raise the bar: 1.25x is not enough, 1.4x is
    noisy = [1.0, 1.3, 1.3, 1.3, 1.0]
    dtype, noise = decide(noisy, [0.8] * 5)
    assert (dtype, noise) == ("fp32", pytest.approx(0.3))
    assert decide(noisy, [1 / 1.4] * 5)[0] == "bf16"
    assert decide([], [0.1])[0] == "fp32" and decide([0.0] * 5, [0.0] * 5)[0] == "fp32"  # nothing to go by


def test_a_decision_is_measured_once_per_machine_and_shape_class_and_says_its_figures(tmp_path):
    cache, clock, calls = tmp_path / DECISIONS_FILE, FakeClock(), []
    timer = fake_timer(clock)
    cfg = ModelConfig(d_model=256, n_head=4, vocab_size=1024, context=128)
    first = cpu_autocast(cfg, 16 * 128, ways=fake(clock, 0.2, 0.1, calls), timer=timer, cache=cache)
    assert (first.dtype, first.source, first.fp32_ms, first.bf16_ms) == ("bf16", "measured now", 200.0, 100.0)
    assert first.speedup == pytest.approx(2.0) and first.machine.startswith(cpu_name())
    line = first.describe()
    assert "bf16" in line and "2.00x" in line and first.shape in line and "\n" not in line
    again = cpu_autocast(cfg, 16 * 128, ways=fake(clock, 0.2, 0.1, calls), timer=timer, cache=cache)
    assert (again.dtype, again.source) == ("bf16", "cached")  # checked, not measured again
    assert again.record() == first.record() and "source" not in first.record()
    # every variant of one size shares the decision: scheme, kv heads, MLP width, depth are not timed
    for other in (cfg.replace(attn="Q-K=V", kv_heads=1), cfg.replace(mlp_hidden=1500, n_layer=6)):
        got = cpu_autocast(other, 16 * 128, ways=fake(clock, 1, 1, calls), timer=timer, cache=cache)
        assert (got.dtype, got.source, got.shape) == ("bf16", "cached", first.shape)  # a tie contradicts nothing
    assert {s.key for s in calls} == {first.shape}
    # another width, or this machine at another thread count: measured anew
    narrow = cpu_autocast(cfg.replace(d_model=64), 2048, ways=fake(clock, 0.1, 0.2), timer=timer, cache=cache)
    assert (narrow.dtype, narrow.source) == ("fp32", "measured now")
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1 if before != 1 else 2)
        other = cpu_autocast(cfg, 16 * 128, ways=fake(clock, 0.1, 0.2), timer=timer, cache=cache)
    finally:
        torch.set_num_threads(before)
    assert (other.dtype, other.source) == ("fp32", "measured now")
    saved = json.loads(cache.read_text())
    assert len(saved) == 2 and all(len(shapes) >= 1 for shapes in saved.values())


def test_a_busy_machine_decides_this_run_only(tmp_path):
    cache, clock = tmp_path / DECISIONS_FILE, FakeClock()
    cfg = ModelConfig(d_model=64, n_head=4, vocab_size=256, context=64)
    busy = cpu_autocast(cfg, 512, ways=fake(clock, 0.2, 0.1), timer=fake_timer(clock, load=4.0), cache=cache)
    assert busy.dtype == "bf16" and "not cached: machine busy" in busy.source and not cache.exists()
    assert "not cached: machine busy" in busy.describe()


def test_shape_classes_are_capped_so_the_probe_stays_short():
    big = ModelConfig(d_model=2048, n_head=16, vocab_size=50304, context=2048)
    shape = ShapeClass.of(big, 32 * 2048)
    assert shape.T == dtype_probe.MAX_T and shape.T * shape.batch <= dtype_probe.MAX_ROWS
    assert ShapeClass.of(big.replace(context=16), 4 * 16).batch == 4
    assert ShapeClass.of(ModelConfig(d_model=30, n_head=4), 8).model() is not None  # 30 / 4 heads: one head


def test_only_auto_on_the_cpu_is_timed(monkeypatch, tmp_path):
    monkeypatch.setenv("QKVLAB_CACHE", str(tmp_path))
    clock, real = FakeClock(), dtype_probe.cpu_autocast
    timed = lambda cfg, rows: real(cfg, rows, ways=fake(clock, 0.2, 0.1), timer=fake_timer(clock))  # noqa: E731
    monkeypatch.setattr(dtype_probe, "cpu_autocast", timed)
    cfg = ModelConfig(d_model=64, n_head=4)
    assert autocast_dtype("auto", "cuda", cfg, 64) == ("bf16", None)
    assert autocast_dtype("fp32", "cpu", cfg, 64) == ("fp32", None)  # an explicit choice stands
    assert autocast_dtype("bfloat16", "cpu", cfg, 64) == ("bf16", None)
    assert autocast_dtype("auto", "mps", cfg, 64) == ("fp32", None)
    assert clock.calls == {}  # nothing timed so far
    dtype, decision = autocast_dtype("auto", "cpu", cfg, 64)
    assert dtype == decision.dtype == "bf16" and (tmp_path / DECISIONS_FILE).is_file()
    assert dtype_name("auto", device_type="cpu") == "fp32"  # weights and caches (generate, serve): unchanged


def test_the_real_training_step_runs_both_ways_in_rounds(one_thread):
    """The real ways (a forward and backward of one block and the head) under the real clock: rounds
    of both, positive times; a figure of nothing."""
    ways = dtype_probe.training_ways(ShapeClass(d_model=32, n_head=2, vocab=64, T=8, batch=2))
    rounds = alternate(ways, Timer(min_round_s=0.001, min_rounds=3, max_rounds=3))
    fp32, bf16 = rounds.times["fp32"], rounds.times["bf16"]
    assert list(ways) == ["fp32", "bf16"] and len(fp32) == len(bf16) == 3 and min(fp32) > 0 and min(bf16) > 0


def test_the_cpu_flags_describe_the_machine_and_decide_nothing():
    sapphire = "processor : 0\nflags\t\t: fpu sse avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n"
    epyc = "processor : 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse avx avx2 fma\n"
    assert cpu_has_bf16(sapphire) and not cpu_has_bf16(epyc)
    assert cpu_name(epyc) == "AMD EPYC"


def test_inference_auto_times_a_decode_step_per_batch_and_caches_each(tmp_path):
    """generate/serve's `auto` on the CPU: bf16 weights when they win at one batch beyond the noise
    and lose at none; each batch's figures cached apart from training's under decode keys."""
    cache, clock, calls = tmp_path / DECISIONS_FILE, FakeClock(), []
    timer = fake_timer(clock)
    cfg = ModelConfig(attn="Q-K-V", kv_heads=2, d_model=64, n_head=4, vocab_size=256, context=64, mlp="swiglu")
    timings = {1: (0.010, 0.010), 16: (0.040, 0.020)}  # a tie at batch 1, bf16 2x at 16

    def ways(shape):
        calls.append(shape)
        fp32, bf16 = timings[shape.batch]
        return clock.ways(fp32=fp32, bf16=bf16)

    both = dtype_probe.cpu_decode_dtype(cfg, (1, 16), ways=ways, timer=timer, cache=cache)
    assert both.dtype == "bf16" and both.step == "decode" and both.source == "measured now"
    assert both.shape.startswith("decode-Q-K-V-d64-h4-kv2-swiglu") and both.shape.endswith("-b1+16")
    assert "decode step" in both.describe() and "bf16 weights" in both.describe()
    assert both.record()["step"] == "decode"
    assert [s.batch for s in calls] == [1, 16]
    one = dtype_probe.cpu_decode_dtype(cfg, (1,), ways=ways, timer=timer, cache=cache)
    assert (one.dtype, one.source) == ("fp32", "cached")  # a tie: fp32
    again = dtype_probe.cpu_decode_dtype(cfg, (16, 1), ways=ways, timer=timer, cache=cache)
    assert again.source == "cached" and again.dtype == "bf16"  # checked, never measured again
    timings[1] = (0.010, 0.020)  # bf16 loses at batch 1: fp32, whatever it gains at 16
    other = dtype_probe.cpu_decode_dtype(cfg, (1, 16), ways=ways, timer=timer, cache=tmp_path / "b.json")
    assert other.dtype == "fp32"
    saved = json.loads(cache.read_text())
    assert all(k.startswith("decode-") for shapes in saved.values() for k in shapes)
    # a training decision's record is as it always was (no "step")
    train = cpu_autocast(cfg, 512, ways=fake(clock, 0.2, 0.1), timer=timer, cache=cache)
    assert "step" not in train.record() and "training step" in train.describe()
    assert dtype_probe.inference_dtype("fp32", "cpu", cfg, (1,)) == ("fp32", None)
    assert dtype_probe.inference_dtype("auto", "cuda", cfg, (1,)) == ("bf16", None)


def test_inference_dtype_probes_for_auto_on_the_cpu_only(monkeypatch):
    """Only `auto` on the CPU asks the decode probe (at the command's batches); a named dtype, or
    `auto` on CUDA, never times anything."""
    calls = []

    def probe(model_cfg, batches=(1,), **_):
        calls.append(tuple(batches))
        return dtype_probe.Decision("bf16", 2.0, 1.0, 0.03, "decode-x", "tests", "cached", step="decode")

    monkeypatch.setattr(dtype_probe, "cpu_decode_dtype", probe)
    cfg = ModelConfig(d_model=32, n_head=4, vocab_size=64, context=32)
    dname, decision = dtype_probe.inference_dtype("auto", "cpu", cfg, (1, 16))
    assert dname == "bf16" and decision.step == "decode" and calls == [(1, 16)]
    assert dtype_probe.inference_dtype("fp32", "cpu", cfg, (1,)) == ("fp32", None)
    assert dtype_probe.inference_dtype("bf16", "cpu", cfg, (1,)) == ("bf16", None)
    assert dtype_probe.inference_dtype("auto", "cuda", cfg, (1,)) == ("bf16", None)
    assert calls == [(1, 16)]


def test_the_decode_probe_times_a_real_step_and_stays_small():
    """The real ways on a tiny model (each call one step at the same cache fill, however often a round
    repeats it): a few rounds each, positive times; the probe's depth is capped."""
    cfg = ModelConfig(d_model=32, n_head=4, vocab_size=128, context=256, n_layer=12, pos="rope")
    shape = dtype_probe.DecodeShape.of(cfg, 2)
    assert shape.layers == dtype_probe.DECODE_LAYERS and shape.batch == 2
    ways = dtype_probe.decode_ways(shape, cfg)
    rounds = alternate(ways, Timer(min_round_s=0.001, min_rounds=2, max_rounds=2))
    fp32, bf16 = rounds.times["fp32"], rounds.times["bf16"]
    assert len(fp32) == len(bf16) == 2 and min(fp32) > 0 and min(bf16) > 0
