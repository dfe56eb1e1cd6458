"""`qkvlab compare`: variants notation, results tables against the runs' metrics, skipping finished
runs, one-line errors, and the papers' orderings as checkable claims."""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import random

import pytest

from qkvlab.analysis import paper_figures as pf
from qkvlab.analysis.report import write_results
from qkvlab.analysis.results import collect
from qkvlab.analysis.rules import ANALYSIS_VERSION
from qkvlab.analysis.runs import run_finished, write_manifest
from qkvlab.base.errors import UserError
from qkvlab.cli import main
from qkvlab.model.accounting import analytic_params, kv_cache_bytes_per_token
from qkvlab.model.config import preset
from qkvlab.model.folder import read_metrics
from qkvlab.model.variants import parse_variant, parse_variants


# ---- variants --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "text,name,kv,match",
    [
        ("Q-K-V", "Q-K-V", None, None),
        ("q-k=v/mqa", "Q-K=V/MQA", 1, None),
        ("Q-K=V/GQA4", "Q-K=V/GQA-4", 4, None),
        ("Id-K-V/mlp", "Id-K-V/mlp", None, "Q-K-V"),
        ("Q=K-V+/GQA-2/mlp=Q-K=V", "(Q=K-V)+/GQA-2/mlp=Q-K=V", 2, "Q-K=V"),
        ("id-k-v/latent=32/mqa", "Id-K-V/MQA/latent=32", 1, None),
    ],
)
def test_parse_variant(text, name, kv, match):
    v = parse_variant(text)
    assert (v.name, v.kv_heads, v.match) == (name, kv, match)
    assert parse_variant(v.name) == v
    assert not set("/()+ ") & set(v.slug)


@pytest.mark.parametrize(
    "text,needle",
    [
        ("Q-K-X", "not one of"),
        ("Q-K=V/XQA", "'XQA'"),
        ("Q-K=V/MQA/MQA", "at most once"),
        ("", "names no variant"),
        ("Q-K-V/GQA-0", "'GQA-0'"),
        ("Q-K-V/latent=0", "latent='0' must be a positive whole number"),
        ("Q-K-V/latent=8/latent=8", "at most once"),
    ],
)
def test_parse_variant_errors(text, needle):
    with pytest.raises(UserError, match=needle):
        parse_variants(text)


def test_variant_apply():
    base = preset("tiny")
    cfg = parse_variant("Id-K-V/mlp").apply(base)
    assert analytic_params(cfg).total == analytic_params(base).total  # matched to Q-K-V (even d: exact)
    assert parse_variant("Q-K=V/MQA").apply(base).n_kv_heads == 1
    assert kv_cache_bytes_per_token(parse_variant("Q-K=V/MQA").apply(base)) * 8 == kv_cache_bytes_per_token(base)
    with pytest.raises(UserError, match="variant Q=K-V/MQA"):
        parse_variant("Q=K-V/MQA").apply(base)  # one projection serves q and k: no fewer k heads
    latent = parse_variant("Q-K-V/latent=16").apply(base)  # 16 of 2 x 4 heads x 16 numbers per token and layer
    assert latent.kv_latent == 16 and kv_cache_bytes_per_token(latent) * 8 == kv_cache_bytes_per_token(base)
    with pytest.raises(UserError, match="variant Q-K=V/latent=16: kv_latent=16 with Q-K=V"):
        parse_variant("Q-K=V/latent=16").apply(base)


# ---- results from run folders ------------------------------------------------------------------
def fake_run(d, cfg, losses, metric=None, values=None):
    """A run folder as the train loop leaves it (weights content is irrelevant here)."""
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps({"model": cfg.to_dict(), "train": {"finished": True}}))
    (d / "model.safetensors").write_bytes(b"\0")
    rows = []
    for i, loss in enumerate(losses):
        row = {
            "step": 10 * i,
            "tokens": 640 * i,
            "train_loss": loss + 0.1 if i else None,
            "val_loss": loss,
            "lr": 1e-3,
            "tokens_per_s": 1000.0 + i if i else None,
            "elapsed_s": float(i),
        }
        if metric:
            row[metric] = values[i]
        rows.append(row)
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_results_from_synthetic_runs(tmp_path):
    rng = random.Random(1)
    base = preset("tiny")
    runs, finals = [], {}
    for v in ("Q-K-V", "Q-K=V", "Q=K=V"):
        for s in range(3):
            final = {"Q-K-V": 3.0, "Q-K=V": 3.02, "Q=K=V": 3.3}[v] + rng.gauss(0, 0.01)
            finals[v, s] = final
            rel = f"lm/{parse_variant(v).slug}/seed{s}"
            fake_run(tmp_path / rel, parse_variant(v).apply(base), [6.0, 4.0, 3.5, 3.2, 3.1, final])
            runs.append({"task": "lm", "variant": v, "seed": s, "dir": rel})
    runs.append({"task": "lm", "variant": "Q=K-V", "seed": 0, "dir": "lm/never"})  # planned, not run
    (tmp_path / "lm/half").mkdir(parents=True)  # unfinished folders are not read
    write_manifest(
        tmp_path,
        {
            "task_label": "lm",
            "runs": runs,
            "seeds": [0, 1, 2],
            "metrics": {"lm": {"metric": "val_loss", "higher_is_better": False}},
        },
    )
    res = write_results(tmp_path)
    assert res.missing == [("lm", "Q=K-V", 0)]
    rows = {r["variant"]: r for r in csv.DictReader(open(tmp_path / "results.csv"))}
    assert list(rows) == ["Q-K-V", "Q-K=V", "Q=K=V"]
    for v, r in rows.items():
        losses = [finals[v, s] for s in range(3)]
        mean = sum(losses) / 3
        assert float(r["val_loss_mean"]) == pytest.approx(mean, abs=1e-12)
        assert float(r["val_loss_std"]) == pytest.approx(math.sqrt(sum((x - mean) ** 2 for x in losses) / 2), abs=1e-12)
        diffs = [finals[v, s] - finals["Q-K-V", s] for s in range(3)]  # paired by seed, mean in log space
        assert float(r["ppl_change_pct_mean"]) == pytest.approx(100 * math.expm1(sum(diffs) / 3), abs=1e-9)
        if v != "Q-K-V":
            m = sum(diffs) / 3
            half = 4.302652729749464 * math.sqrt(sum((d - m) ** 2 for d in diffs) / 2) / math.sqrt(3)
            assert float(r["gap_vs_qkv"]) == pytest.approx(100 * math.expm1(m), abs=1e-5)
            assert float(r["gap_vs_qkv_lo"]) == pytest.approx(100 * math.expm1(m - half), abs=1e-5)
            assert float(r["gap_vs_qkv_hi"]) == pytest.approx(100 * math.expm1(m + half), abs=1e-5)
            assert r["gap_trend"] in ("shrinking", "flat", "growing")
        cfg = parse_variant(v).apply(base)
        assert int(r["params_total"]) == analytic_params(cfg).total
        assert int(r["kv_cache_bytes_per_token"]) == kv_cache_bytes_per_token(cfg, "bf16")
        assert float(r["tokens_per_s"]) == pytest.approx(1003.0)
    assert rows["Q-K=V"]["kv_cache_fraction"] == "0.5" and rows["Q-K=V"]["paper_ppl_change_pct"] == "3.1"
    md = (tmp_path / "results.md").read_text()
    assert "| `Q=K=V` |" in md and "+25.4% (B 300M)" in md and "Q=K=V is the worst variant" in md
    assert "reproduced" in md and "84.95M" in md
    for png in ("val_loss.png", "ppl_vs_cache.png"):
        data = (tmp_path / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_results_family_table(tmp_path):
    base = preset("tiny").replace(causal=False)
    runs = []
    for task in ("reverse", "swap"):
        for v in ("Q-K-V", "Q=K=V", "(Q=K=V)+"):
            for s in range(2):
                acc = pf.task_metric(task, v) + 0.01 * s
                rel = f"{task}/{parse_variant(v).slug}/seed{s}"
                fake_run(tmp_path / rel, parse_variant(v).apply(base), [2.0, 1.0], "accuracy", [0.1, acc])
                runs.append({"task": task, "variant": v, "seed": s, "dir": rel})
    write_manifest(tmp_path, {"task_label": "synthetic", "runs": runs})  # metric inferred from the rows
    res = write_results(tmp_path)
    r = res.row("swap", "(Q=K=V)+")
    assert r.metric == "accuracy" and r.higher_is_better
    assert r.metric_mean_std[0] == pytest.approx(pf.task_metric("swap", "(Q=K=V)+") + 0.005)
    md = (tmp_path / "results.md").read_text()
    assert "0.586 ± 0.007 (0.581)" in md  # reverse, (Q=K=V)+: ours (paper)
    got = {v.claim.id: v.word for v in res.verdicts()}
    # swap is solve-or-fail: compared as solve rates; at the paper's accuracies no scheme solves (< .95),
    # and 0 of 2 against 0 of 2 decides nothing
    assert got["syn-qkeqv-worst-swap"] == "inconclusive" and got["syn-plus-helps-qkeqv"] is None  # not tested
    assert "McNemar" in md and "| validation |" in md and "seeds to decide" in md
    assert "## Gap to Q-K-V over training" in md and "(Q=K=V)+" in md
    assert (tmp_path / "metric_by_task.png").read_bytes()[:4] == b"\x89PNG"
    # scored on the test split once every run of a task has test.json: its values, its se
    for e in runs:
        acc = 0.2 if e["variant"] == "Q=K=V" else 1.0
        test = {"split": "test", "metric": "accuracy", "accuracy": acc, "n": 10000, "se": 0.001, "units": "lists"}
        (tmp_path / e["dir"] / "test.json").write_text(json.dumps(test))
    res = write_results(tmp_path, plots=False)
    assert res.row("swap", "Q=K=V").metric_values == [0.2, 0.2]
    md = (tmp_path / "results.md").read_text()
    assert "accuracy per task (test split, n=10000 (lists))" in md and "| test split, n=10000 (lists) |" in md
    assert not (tmp_path / "ppl_vs_cache.png").exists()


def test_render_from_stored_scores_reproduces_results(tmp_path):
    """scores.json holds what results.md reads: with the run folders gone, `compare --render`
    re-derives the same tables and verdicts; under analysis version 2 (se_A^2 + se_B^2) the same
    scores give wider intervals; compare.json and results.md name the version scored with."""
    import shutil

    from qkvlab.compare.render import render

    rng = random.Random(2)
    base = preset("tiny")
    units = [rng.gauss(4.0, 0.5) for _ in range(40)]
    runs = []
    for v, off in (("Q-K-V", 0.0), ("Q-K=V", 0.02), ("Q=K-V", 0.05), ("Q=K=V", 0.2)):
        for s in range(4):
            rel = f"lm/{parse_variant(v).slug}/seed{s}"
            shift = off + rng.gauss(0, 0.005)
            fake_run(tmp_path / rel, parse_variant(v).apply(base), [6.0, 4.0, 3.0 + shift])
            per_unit = [u + shift + rng.gauss(0, 0.01) for u in units]
            mean = sum(per_unit) / 40
            sd = math.sqrt(sum((x - mean) ** 2 for x in per_unit) / 39)
            test = {"split": "test", "metric": "loss", "loss": mean, "n": 40, "se": sd / math.sqrt(40)}
            (tmp_path / rel / "test.json").write_text(json.dumps({**test, "units": "windows", "per_unit": per_unit}))
            runs.append({"task": "lm", "variant": v, "seed": s, "dir": rel})
    manifest = {"task_label": "lm", "runs": runs, "seeds": [0, 1, 2, 3], "trained_under_analysis": 2}
    write_manifest(tmp_path, {**manifest, "metrics": {"lm": {"metric": "val_loss", "higher_is_better": False}}})
    first = write_results(tmp_path, plots=False)
    md = (tmp_path / "results.md").read_text()
    assert f"analysis rules: version {ANALYSIS_VERSION}" in md and "trained and first scored under version 2" in md
    assert "## qkvlab ranking (every variant run; not a claim of either paper)" in md
    assert "`Q=K=V` worse than each of the 3 others: **yes**" in md
    assert json.loads((tmp_path / "compare.json").read_text())["analysis_version"] == ANALYSIS_VERSION
    shutil.rmtree(tmp_path / "lm")
    again = render(tmp_path, plots=False, say=lambda *a: None)
    assert again.from_scores and {v.claim.id: v.word for v in again.verdicts()} == {
        v.claim.id: v.word for v in first.verdicts()
    }
    rendered = (tmp_path / "results.md").read_text()
    note = "- re-derived from scores.json (every run's stored scores); the run folders are not on disk\n"
    assert rendered.replace(note, "") == md  # per-unit scores rounded to 1e-6 change no printed figure
    old = render(tmp_path, 2, plots=False, say=lambda *a: None)
    assert "analysis rules: version 2" in (tmp_path / "results.md").read_text()
    g4, g2 = first.gaps()["lm", "Q-K=V"], old.gaps()["lm", "Q-K=V"]
    assert g4.estimate == pytest.approx(g2.estimate) and g2.hi - g2.lo > g4.hi - g4.lo
    with pytest.raises(UserError, match="analysis version 1"):
        render(tmp_path, 1, plots=False)


# ---- the command, end to end ---------------------------------------------------------------------
def compare_args(out, corpus, *extra):
    return [
        "compare",
        "--out",
        str(out),
        "--data",
        str(corpus),
        "--tokenizer",
        "char",
        "--preset",
        "tiny",
        "--n-layer",
        "1",
        "--d-model",
        "32",
        "--context",
        "32",
        "--batch-size",
        "8",
        "--max-steps",
        "4",
        "--eval-every",
        "2",
        "--jobs",
        "1",
        "--threads",
        "1",
        "--no-plots",
        *extra,
    ]


def test_compare_end_to_end_and_skip(tmp_path, corpus, capsys, monkeypatch):
    out = tmp_path / "cmp"
    assert main(compare_args(out, corpus, "--variants", "Q-K-V,Q-K=V/MQA", "--seeds", "2")) == 0
    printed = capsys.readouterr().out
    assert "[run 4/4]" in printed and "ETA" in printed
    rows = {r["variant"]: r for r in csv.DictReader(open(out / "results.csv"))}
    assert set(rows) == {"Q-K-V", "Q-K=V/MQA"}
    for v, r in rows.items():
        finals = [read_metrics(out / "lm" / parse_variant(v).slug / f"seed{s}")[-1] for s in (0, 1)]
        assert all(f["step"] == 4 for f in finals)
        assert float(r["val_loss_mean"]) == pytest.approx(sum(f["val_loss"] for f in finals) / 2, abs=1e-12)
        assert r["seeds"] == "2" and int(r["steps"]) == 4
    assert rows["Q-K=V/MQA"]["kv_cache_fraction"] == "0.125"  # K=V halves, 1 of 4 heads quarters
    assert "Q-K=V/MQA" in (out / "results.md").read_text()

    # Re-running trains nothing; widening --seeds trains only the new runs.
    import qkvlab.train.loop as loop

    calls = []
    real = loop.train
    monkeypatch.setattr(loop, "train", lambda cfg, d, **kw: calls.append(d) or real(cfg, d, **kw))
    weights = out / "lm" / "Q-K-V" / "seed0" / "model.safetensors"
    mtime = weights.stat().st_mtime_ns
    assert main(compare_args(out, corpus, "--variants", "Q-K-V,Q-K=V/MQA", "--seeds", "2")) == 0
    assert calls == [] and weights.stat().st_mtime_ns == mtime
    assert "4 finished already, 0 to train" in capsys.readouterr().out
    assert main(compare_args(out, corpus, "--variants", "Q-K-V,Q-K=V/MQA", "--seeds", "3")) == 0
    assert sorted(calls) == sorted(str(out / "lm" / s / "seed2") for s in ("Q-K-V", "Q-K=V_MQA"))
    assert weights.stat().st_mtime_ns == mtime
    assert run_finished(out / "lm" / "Q-K=V_MQA" / "seed2")
    assert collect(out).row("lm", "Q-K-V").n == 3
    # Another recipe into the same folder is refused, never overwritten.
    assert main(compare_args(out, corpus, "--variants", "Q-K-V", "--lr", "0.5")) == 2
    assert "use another --out" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--variants", "Q-K-X"], "Q-K-X"),
        (["--variants", "Q-K=V/XQA"], "XQA"),
        (["--variants", "Q=K-V/MQA"], "Q=K-V/MQA"),
        (["--task", "nosuch"], "unknown task 'nosuch'"),
        (["--attn", "Q-K=V"], "--variants"),
        (["--task", "lm", "--full-grid"], "--full-grid"),
        (["--task-option", "length"], "KEY=VALUE"),
        (["--render"], "no such folder"),
        (["--analysis-version", "3"], "goes with --render"),
        (["--render", "--analysis-version", "1"], "analysis-version"),
    ],
)
def test_compare_bad_input_one_line(tmp_path, capsys, argv, needle):
    out = tmp_path / "never"
    assert main(["compare", "--out", str(out), *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and needle in err
    assert not out.exists()


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--tokenizer", "foo"], "unknown tokenizer 'foo'"),
        (["--data", "{empty}"], "has no *.txt"),
        (["--out", "{file}"], "holds a file"),
        (["--device", "nosuch"], "nosuch"),
        (["--pos", "rope", "--rope-theta", "0"], "--rope-theta: 0.0 must be positive"),
        (["--init-std", "-1"], "--init-std: -1.0 must be >= 0"),
        (["--norm-eps", "-1"], "--norm-eps: -1.0 must be >= 0"),
    ],
)
def test_a_dry_run_refuses_what_the_run_would(tmp_path, capsys, argv, needle):
    """--dry-run checks --out, the device and each task's options and data as a real run does (it
    printed a plan for a bad tokenizer, an empty corpus folder, a file as --out); nothing is created."""
    (tmp_path / "empty").mkdir()
    (tmp_path / "file.txt").write_text("mine")
    argv = [a.format(empty=tmp_path / "empty", file=tmp_path / "file.txt") for a in argv]
    out = ["--out", str(tmp_path / "never")] if "--out" not in argv else []
    assert main(["compare", "--dry-run", *out, *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and needle in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "file.txt"]
    assert (tmp_path / "file.txt").read_text() == "mine"


def test_full_grid_plan(tmp_path, capsys):
    assert main(["compare", "--task", "synthetic", "--full-grid", "--dry-run", "--out", str(tmp_path / "g")]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    # Paper B: d {32,64,256} x layers {2,4} x heads {2,4} x length {16,64,128}, 3 seeds, 5 tasks, 6 schemes
    assert f"{3 * 2 * 2 * 3 * 3 * 5 * 6} runs" in first and "grid points 36" in first


def test_full_grid_fits_the_image_size():
    """Paper B's vision grid has patch 4 and the image's own (None: 7 on 28 px, 8 on 32 px, 2 on the
    8-px digits), so no point is invalid for any image size; nothing is trained here."""
    from qkvlab.compare import CompareConfig
    from qkvlab.compare import plan as make_plan
    from qkvlab.compare.execute import _check_tasks

    plan = make_plan(CompareConfig(task="digits", full_grid=True, variants="Q-K-V", seeds=1)).runs
    notes = []
    keep, metrics = _check_tasks(plan, False, notes.append)
    assert {r.point.split("-")[0] for r in plan} == {"p4", "pNone"}
    assert len(keep) == len(plan) and not notes and metrics["digits"]["metric"] == "accuracy"


def test_real_compare_feeds_the_cache_plot_and_sets_the_identity_recipe(tmp_path, corpus, capsys, monkeypatch):
    """A real (seconds-long) compare: the cache-vs-quality plot labels each variant with its
    perplexity change (it read a column compare never wrote); Id-K-V trains with weight decay 2**-5;
    a run folder written by an older qkvlab (config keys missing) still counts as finished."""
    from qkvlab.analysis.plots import cache_vs_quality_points, plot_cache_vs_quality
    from qkvlab.model.folder import read_config

    out = tmp_path / "cmp"
    assert main(compare_args(out, corpus, "--variants", "Q-K-V,Id-K-V", "--seeds", "1")) == 0
    labels = {label.split(" ")[0]: label for label, _, _ in cache_vs_quality_points(out)}
    change = float(
        next(r for r in csv.DictReader(open(out / "results.csv")) if r["variant"] == "Id-K-V")["ppl_change_pct_mean"]
    )
    assert labels["Id-K-V"] == f"Id-K-V ({change:+.1f}%)" and labels["Q-K-V"] == "Q-K-V (+0.0%)"
    png = plot_cache_vs_quality(out, tmp_path / "c.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"

    decay = {
        v: read_config(out / "lm" / v / "seed0")[1]["train"]["config"]["weight_decay"] for v in ("Q-K-V", "Id-K-V")
    }
    assert decay == {"Q-K-V": 0.1, "Id-K-V": 0.03125}

    for v in ("Q-K-V", "Id-K-V"):  # what an older qkvlab wrote: fewer keys
        path = out / "lm" / v / "seed0" / "config.json"
        body = json.loads(path.read_text())
        del body["train"]["config"]["log_every"], body["train"]["config"]["model"]["init_std"]
        path.write_text(json.dumps(body))
    capsys.readouterr()
    assert main(compare_args(out, corpus, "--variants", "Q-K-V,Id-K-V", "--seeds", "1")) == 0
    assert "2 finished already, 0 to train" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--variants", ""], "''"),
        (["--variants", " "], "' '"),
        (["--out", ""], "--out"),
        (["--lr", "nan"], "finite"),
        (["--d-model", "x"], "'x'"),
        (["--seeds", "0"], "--seeds: 0 must be a positive integer"),
        (["--lr", "-1"], "--lr: -1.0 must be positive"),
    ],
)
def test_compare_refuses_empty_and_non_finite_values(tmp_path, capsys, argv, needle):
    assert main(["compare", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and needle in err, err


def test_compare_print_config_and_config_file(tmp_path, capsys):
    (tmp_path / "c.yaml").write_text("task: reverse\nvariants: Q-K-V,Q-K=V/MQA\nseeds: 1\nmax_steps: 7\n")
    assert main(["compare", "--config", str(tmp_path / "c.yaml"), "--seeds", "2", "--print-config", "json"]) == 0
    body = json.loads(capsys.readouterr().out)
    assert (body["task"], body["variants"], body["seeds"], body["max_steps"]) == ("reverse", "Q-K-V,Q-K=V/MQA", 2, 7)
    (tmp_path / "bad.yaml").write_text("varients: Q-K-V\n")
    assert main(["compare", "--config", str(tmp_path / "bad.yaml"), "--dry-run"]) == 2
    assert "'varients'" in capsys.readouterr().err


def test_paper_recipe_is_the_full_grid_default_and_named():
    from qkvlab.base.errors import UserError
    from qkvlab.compare import CompareConfig, plan

    paper = plan(CompareConfig(task="reverse", variants="Q-K-V", seeds=1, recipe="paper")).runs[0].cfg
    assert (paper.max_steps, paper.batch_size, paper.weight_decay, paper.grad_clip) == (780, 128, 0.0, 5.0)
    m = paper.model
    assert (m.norm_position, m.pos, m.mlp, m.head, m.dropout, m.hidden) == (
        "post",
        "sinusoidal",
        "relu",
        "norm_mlp",
        0.1,
        2 * m.d_model,
    )
    cpu = plan(CompareConfig(task="reverse", variants="Q-K-V", seeds=1)).runs[0].cfg
    assert (cpu.max_steps, cpu.model.norm_position) == (400, "pre")  # the CPU recipe unless asked
    grid = plan(CompareConfig(task="reverse", variants="Q-K-V", seeds=1, full_grid=True)).runs
    assert {r.cfg.max_steps for r in grid} == {780} and {r.cfg.model.d_model for r in grid} == {32, 64, 256}
    seg = plan(CompareConfig(task="segmentation", variants="Q-K-V", seeds=1, full_grid=True)).runs[0].cfg
    assert seg.model.norm_position == "pre"  # no paper recipe: the CPU one on the paper's grid
    with pytest.raises(UserError, match="no paper recipe for 'segmentation'"):
        plan(CompareConfig(task="segmentation", variants="Q-K-V", seeds=1, recipe="paper"))


def test_compare_help_names_the_default_lm_variants():
    import qkvlab.commands.compare as command
    from qkvlab.compare.planning import CompareConfig
    from qkvlab.compare.recipes import DEFAULT_LM_VARIANTS

    doc = " ".join(command.__doc__.split())
    assert all(v in doc for v in DEFAULT_LM_VARIANTS)
    assert f"{len(DEFAULT_LM_VARIANTS) * 3} runs" in doc
    help_text = next(f.metadata["help"] for f in dataclasses.fields(CompareConfig) if f.name == "variants")
    assert f"the {len(DEFAULT_LM_VARIANTS)} LM variants" in help_text


@pytest.mark.parametrize(
    "family, scores",
    [
        ("lm-v5", "scores.json"),
        ("lm-v5-1500", "scores.json"),
        ("synthetic-v5", "scores.json.xz"),
        ("synthetic-v5-len32/reverse", "scores.json.xz"),
        ("synthetic-v5-len32/swap", "scores.json.xz"),
    ],
)
def test_committed_families_rerender_from_their_scores(tmp_path, family, scores):
    """docs/results/lm-v5, lm-v5-1500, synthetic-v5 and synthetic-v5-len32 (analysis version 5, fixed before their runs) are what
    `compare --render` derives from their committed scores alone (xz-compressed where per-unit scores
    are many): every figure and word, no run folder needed."""
    import re
    from pathlib import Path

    from qkvlab.compare.render import render

    src = Path(__file__).resolve().parents[1] / "docs" / "results" / family
    for name in (scores, "compare.json"):
        (tmp_path / name).write_bytes((src / name).read_bytes())
    scored_with = json.loads((src / "compare.json").read_text())["analysis_version"]  # a later version adds claims
    outcome = render(tmp_path, scored_with, plots=False, say=lambda *a: None)
    assert outcome.from_scores

    def text(path):  # without the plots section (not drawn here) and the line saying where scores came from
        md = path.read_text()
        md = md.replace(
            "- re-derived from scores.json (every run's stored scores); the run folders are not on disk\n", ""
        )
        return re.sub(r"## Plots\n\n(!\[.*\n)*\n*", "", md)

    assert text(tmp_path / "results.md") == text(src / "results.md")
    assert json.loads((src / "compare.json").read_text())["trained_under_analysis"] == 5
