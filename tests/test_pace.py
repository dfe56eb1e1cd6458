"""compare at this machine's pace: durations, the jobs x threads layout, the plan's time estimate,
and how --seeds auto chooses n from a pilot."""

import math
from types import SimpleNamespace

import pytest

from qkvlab.base.errors import UserError
from qkvlab.compare import CompareConfig, pace, plan
from qkvlab.compare.auto import MAX_AUTO_SEEDS, choose_seeds
from qkvlab.compare.pace import Layout, choose_layout, parse_duration, point_key, step_work


@pytest.mark.parametrize("text, seconds", [("45s", 45), ("90m", 5400), ("2h", 7200), ("1h30m", 5400), (12, 12)])
def test_parse_duration(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("bad", ["", "soon", "0m", "-5s", "1e400", "h"])
def test_parse_duration_refuses(bad):
    with pytest.raises(UserError, match="duration"):
        parse_duration(bad)


def test_layout_estimates_and_user_choice_wins():
    todo = plan(CompareConfig()).runs
    cfg = todo[0].cfg  # 600 steps, eval every 60 of 8 batches
    lay = Layout(2, 1, step_s=0.01)
    one = lay.run_seconds(cfg)
    assert one == pytest.approx(0.01 * (600 + 11 * 8 * cfg.val_batch_size / 16 / 3) + 3.0)
    assert lay.plan_seconds(todo[:4]) == pytest.approx(2 * one)
    assert Layout(2, 1).plan_seconds(todo[:1]) is None  # not probed: no estimate
    assert choose_layout(cfg, todo, cpus=2, jobs=1, threads=None) == Layout(1, 2)
    assert choose_layout(cfg, todo[:3], cpus=4, jobs=None, threads=None) == Layout(3, 1)  # too few to probe


def test_a_sweep_is_estimated_per_size(monkeypatch):
    """Each size is timed where it would train (the first size's pace said 23 min for a 80 min sweep);
    sizes beyond the probe's cap are scaled by FLOPs per step; the ETA weighs runs by that estimate."""
    from qkvlab.compare.workers import Progress

    sweep = plan(CompareConfig(sweep=True, variants="Q-K-V,Q-K=V", sizes="d16-L1-h2,d32-L1-h2,d64-L2-h2"))
    timed = []

    def fake_step_seconds(cfg, threads, steps=pace.PROBE_STEPS):
        timed.append(cfg.model.d_model)
        return 1e-9 * step_work(cfg) * (2.0 if cfg.model.d_model == 64 else 1.0)  # the largest runs slower

    monkeypatch.setattr(pace, "step_seconds", fake_step_seconds)
    lay = choose_layout(sweep.runs[0].cfg, sweep.runs, cpus=1, jobs=None, threads=None)
    assert sorted(set(timed)) == [16, 32, 64] and len(lay.point_step_s) == 3
    by_size = {r.point: lay.run_seconds(r.cfg, point_key(r)) for r in sweep.runs}
    first = sweep.runs[0]
    flat = Layout(1, 1, lay.step_s, probed_work=step_work(first.cfg))  # first size's pace, scaled by FLOPs
    big = next(r for r in sweep.runs if r.point == "d64-L2")
    assert by_size["d64-L2"] - 3.0 == pytest.approx(2 * (flat.run_seconds(big.cfg) - 3.0))
    assert lay.plan_seconds(sweep.runs) == pytest.approx(sum(by_size[r.point] for r in sweep.runs))
    monkeypatch.setattr(pace, "MAX_POINTS_PROBED", 2)  # the third size is scaled, not timed
    timed.clear()
    capped = choose_layout(sweep.runs[0].cfg, sweep.runs, cpus=1, jobs=None, threads=None)
    assert sorted(set(timed)) == [16, 32]
    assert capped.run_seconds(big.cfg, point_key(big)) == pytest.approx(flat.run_seconds(big.cfg))

    lines = []
    progress = Progress(2, 0, 2, say=lambda *a, **k: lines.append(a[0]), work={"a": 1.0, "b": 9.0})
    progress.t0 -= 10.0  # the cheap run took 10 s: the expensive one is 9x its work
    progress.update(
        SimpleNamespace(rel="a", task="lm", point="", variant=SimpleNamespace(name="Q-K-V"), seed=0),
        {"metric": "val_loss", "metrics": {"val_loss": 1.0}, "seconds": 10.0},
    )
    eta = lines[-1].split("ETA ")[1]
    assert eta in ("1:30", "1:31"), lines[-1]


def test_choose_seeds_from_the_pilot():
    # the most any claim needs; claims beyond the cap are named and not run
    assert choose_seeds({"a": 8, "b": 20}, 3, 9, 30.0, None) == (20, "the claims need 20 seeds")
    n, why = choose_seeds({"a": 8, "b": math.inf}, 3, 9, 30.0, None)
    assert n == 8 and f"b need more than {MAX_AUTO_SEEDS}" in why
    # the budget: 9 runs per seed at 30 s = 270 s a seed; 1000 s buys 3 more than the pilot's 3
    n, why = choose_seeds({"a": 20}, 3, 9, 30.0, 1000.0)
    assert n == 6 and "budget buys 6" in why
    assert choose_seeds({}, 3, 9, 30.0, None)[0] == 3  # nothing to decide: the pilot stands


def test_seeds_auto_settings():
    assert plan(CompareConfig(seeds="auto", budget="2h")).seeds == [0, 1, 2]  # the pilot's plan
    for kw, match in [
        (dict(seeds="many"), "positive integer or auto"),
        (dict(seeds=3, budget="1h"), "--budget goes with --seeds auto"),
        (dict(seeds="auto", budget="-1m"), "duration"),
    ]:
        with pytest.raises(UserError, match=match):
            plan(CompareConfig(**kw))


def test_seeds_auto_end_to_end(tmp_path, monkeypatch, capsys):
    """The pilot trains 3 seeds, the claims' projection (forced here to 4) plans the decisive run,
    which reuses the pilot's runs and trains seed 3 only."""
    import random

    import qkvlab.analysis.seeds as seeds
    from qkvlab.analysis.runs import read_manifest
    from qkvlab.cli import main

    monkeypatch.setenv("QKVLAB_CACHE", str(tmp_path / "cache"))
    rng = random.Random(0)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(" ".join(rng.choice("abcdefgh") for _ in range(40)) for _ in range(300)))
    monkeypatch.setattr(
        seeds, "seeds_for_claims", lambda verdicts: {"forced": 4} if isinstance(verdicts, list) else None
    )
    out = tmp_path / "auto"
    args = ["compare", "--seeds", "auto", "--out", str(out), "--variants", "Q-K-V,Q-K=V", "--steps", "3"]
    args += ["--data", str(corpus), "--tokenizer", "char", "--jobs", "1", "--threads", "1", "--no-plots"]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "pilot of 3 seeds" in printed and "4 seeds per variant (the claims need 4 seeds)" in printed
    assert "6 finished already, 2 to train" in printed
    assert read_manifest(out)["seeds"] == [0, 1, 2, 3]
