"""`qkvlab compare --sweep`: size notation, the plan (layout and recipe), and a tiny sweep end to
end: trained once, then only re-rendered."""

import csv
import dataclasses
import json
import shutil

import pytest
import torch

from conftest import FakeClock, fake_timer
from qkvlab.base.errors import UserError
from qkvlab.cli import main
from qkvlab.compare import CompareConfig, plan
from qkvlab.compare.sweep import SweepSize, parse_sizes
from qkvlab.decode.dtype_probe import cpu_autocast as real_cpu_autocast  # before conftest fixes its answer
from qkvlab.model.accounting import analytic_params
from qkvlab.model.config import ModelConfig


def test_parse_sizes():
    assert parse_sizes("d32-L1-h2-b4-s2, d48-L2-h3") == [SweepSize(32, 1, 2, 4, 2), SweepSize(48, 2, 3)]
    assert parse_sizes("d64-L3-h4-s3,d8-L1-h1-b2")[0].label == "d64-L3"
    bad_sizes = ("d32-L1", "d32-L1-h2-x4,d8-L1-h1", "d32-L1-h2", "d32-L1-h2,d32-L1-h4", "d0-L1-h1,d8-L1-h1")
    for bad in (*bad_sizes, "d32-L1-h2-s99999999,d8-L1-h1"):  # the last planned for minutes
        with pytest.raises(UserError):
            parse_sizes(bad)


def test_sweep_plan_layout_and_recipe():
    p = plan(
        CompareConfig(sweep=True, out="/nowhere", sizes="d32-L1-h2-b4-s2,d48-L2-h3-b8-s1", variants="Q-K-V,Id-K-V")
    )
    assert [r.rel for r in p.runs] == [
        "d32-L1/Q-K-V/seed0",
        "d32-L1/Q-K-V/seed1",
        "d32-L1/Id-K-V/seed0",
        "d32-L1/Id-K-V/seed1",
        "d48-L2/Q-K-V/seed0",
        "d48-L2/Id-K-V/seed0",
    ]
    for r in p.runs:
        c = r.cfg
        base = ModelConfig(
            d_model=c.model.d_model, n_layer=c.model.n_layer, n_head=c.model.n_head, vocab_size=1024, context=128
        )
        n = analytic_params(base).non_embedding
        assert c.max_steps == round(20 * n / (c.batch_size * 128))  # 20 tokens per parameter of Q-K-V
        assert c.weight_decay == (2**-5 if r.variant.name == "Id-K-V" else 0.1)
        lr = 2e-3 * 64 / c.model.d_model  # lr per size: 1/width
        assert (c.lr, c.min_lr, c.warmup_steps, c.eval_every) == (
            pytest.approx(lr),
            pytest.approx(lr / 10),
            max(5, c.max_steps // 20),
            c.max_steps // 10,
        )
        assert c.task_options == {"tokenizer": "bpe:1024"} and c.model.context == 128
    with pytest.raises(UserError, match="--steps"):
        plan(CompareConfig(sweep=True, max_steps=5))
    with pytest.raises(UserError, match="settings of --sweep"):
        plan(CompareConfig(sizes="d32-L1-h2,d48-L2-h3"))


def test_tiny_sweep_end_to_end_then_render_only(tmp_path, corpus, capsys, monkeypatch):
    out = tmp_path / "sweep"
    sizes = "d8-L1-h2,d16-L1-h2,d24-L1-h2,d32-L2-h2"  # 4 sizes, 0.8k .. 25k non-embedding params
    args = ["compare", "--sweep", "--out", str(out), "--sizes", sizes, "--variants", "Q-K-V,Q-K=V"]
    args += ["--tokens-per-param", "0.05", "--batch-size", "4", "--context", "16", "--eval-every", "4"]
    args += ["--data", str(corpus), "--tokenizer", "char", "--jobs", "1", "--threads", "1", "--seeds", "1"]
    assert main(args) == 0
    assert "[run 8/8]" in capsys.readouterr().out
    rows = list(csv.DictReader((out / "results.csv").open()))
    assert len(rows) == 8 and {r["variant"] for r in rows} == {"Q-K-V", "Q-K=V"}
    assert [r["size"] for r in rows[::2]] == ["d8-L1", "d16-L1", "d24-L1", "d32-L2"]
    for r in rows:
        d = int(r["size"][1:].split("-")[0])
        L = int(r["size"].split("-L")[1])
        model = ModelConfig(d_model=d, n_layer=L, n_head=2, vocab_size=1024, context=16)
        if r["variant"] == "Q-K=V":
            model = model.replace(attn="Q-K=V")
        assert int(r["params"]) == analytic_params(model).non_embedding
    md = (out / "results.md").read_text()
    assert "4 sizes spanning" in md and "`Q-K=V`" in md and "gap with N" in md and "at 300M" not in md
    assert {"gap_vs_params.png", "gap_vs_compute.png", "compare.json"} <= {p.name for p in out.iterdir()}

    # Stopped before its end (no results.csv yet): --render still reads it as a sweep, per size, and
    # names the runs not begun; so do the compare.json files written before the manifest said "sweep".
    stopped = tmp_path / "stopped"
    shutil.copytree(out, stopped)
    for name in ("results.csv", "results.md", "scores.json"):
        (stopped / name).unlink()
    shutil.rmtree(stopped / "d32-L2" / "Q-K=V")
    manifest = json.loads((stopped / "compare.json").read_text())
    assert manifest["sweep"] is True
    for old_manifest in (False, True):
        if old_manifest:
            del manifest["sweep"]
            (stopped / "compare.json").write_text(json.dumps(manifest))
        assert main(["compare", "--render", "--no-plots", "--out", str(stopped)]) == 0
        md = (stopped / "results.md").read_text()
        assert "## Sizes" in md and "d32-L2/Q-K=V/seed0 (not started)" in md
        assert len(list(csv.DictReader((stopped / "results.csv").open()))) == 7

    # Again: every run is finished, nothing trains, the results are rendered again.
    import qkvlab.train.loop as loop

    calls = []
    monkeypatch.setattr(loop, "train", lambda *a, **k: calls.append(a) or pytest.fail("trained again"))
    (out / "results.md").unlink()
    assert main(args + ["--no-plots"]) == 0
    assert calls == [] and "8 finished already, 0 to train" in capsys.readouterr().out
    assert (out / "results.md").is_file()

    # Another checkout: only the committed table and scores, the run folders of two sizes gone. What the
    # table records stands for those runs (scored again, never retrained), and the figures stay the same.
    table = (out / "results.csv").read_text()
    assert "config" in table.splitlines()[0]
    for size in ("d8-L1", "d24-L1"):
        shutil.rmtree(out / size)
    assert main(args + ["--no-plots"]) == 0
    assert calls == [] and "8 finished already, 0 to train" in capsys.readouterr().out
    assert (out / "results.csv").read_text() == table and not (out / "d8-L1").exists()
    assert "4 runs from results.csv: their folders are not on disk" in (out / "results.md").read_text()
    # other settings: a recorded row is refused as a folder would be, in one line (all folders gone now)
    for size in ("d16-L1", "d32-L2"):
        shutil.rmtree(out / size)
    assert main(args + ["--no-plots"]) == 0 and calls == []
    assert (out / "results.csv").read_text() == table
    assert "rendered from results.csv: the run folders are not on disk" in (out / "results.md").read_text()
    assert main(args + ["--no-plots", "--lr", "0.01"]) != 0
    assert "records d8-L1/Q-K-V/seed0 trained with other settings" in capsys.readouterr().err
    # a run the table does not record trains again, alone (the dry run says which)
    rows = table.splitlines()
    (out / "results.csv").write_text("\n".join(r for r in rows if "d8-L1/Q-K=V/seed0" not in r) + "\n")
    assert main(args + ["--no-plots", "--dry-run"]) == 0
    states = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("  d")]
    assert [(rel, state) for rel, state in states if state != "[finished]"] == [("d8-L1/Q-K=V/seed0", "[new]")]


def test_compare_dtype_reaches_every_run_and_the_record_says_what_auto_became(monkeypatch, tmp_path):
    """--dtype is one setting for the whole comparison (grid and sweep); machine_info records the
    dtype it resolved to on this machine (auto: bf16 only where timing the model's shapes says so)."""
    from qkvlab.base.settings import check
    from qkvlab.compare import execute
    from qkvlab.compare.sweep import SWEEP_RECIPE, SWEEP_SIZES

    for dtype in ("fp32", "bf16"):
        grid = plan(CompareConfig(out="/nowhere", dtype=dtype, seeds=1))
        sweep = plan(CompareConfig(sweep=True, out="/nowhere", dtype=dtype, sizes="d32-L1-h2,d48-L2-h3"))
        assert {r.cfg.dtype for r in grid.runs + sweep.runs} == {dtype}
    assert {r.cfg.dtype for r in plan(CompareConfig(out="/nowhere", seeds=1)).runs} == {"auto"}
    with pytest.raises(UserError, match="fp16"):
        check(CompareConfig(dtype="fp16"))
    wide = plan(CompareConfig(out="/nowhere", seeds=1, model={"d_model": 256, "n_head": 4}))
    sweep = plan(CompareConfig(sweep=True, out="/nowhere", sizes="d64-L1-h2,d256-L1-h4"))
    from qkvlab.decode import dtype_probe

    for has_bf16, grid_dtype, sweep_dtype in ((False, "fp32", "fp32"), (True, "bf16", "bf16, fp32")):
        # fake timings: where bf16 pays, it pays from d_model 192 on
        clock = FakeClock()
        fast = lambda s, v=has_bf16, c=clock: c.ways(fp32=1.0, bf16=0.5 if v and s.d_model >= 192 else 1.5)
        cache = tmp_path / f"{has_bf16}.json"
        timed = lambda m, rows, f=fast, c=cache, t=fake_timer(clock): real_cpu_autocast(
            m, rows, ways=f, timer=t, cache=c
        )
        monkeypatch.setattr(dtype_probe, "cpu_autocast", timed)
        assert execute._train_dtype(wide, "cpu")[0] == grid_dtype
        assert execute._train_dtype(sweep, "cpu")[0] == sweep_dtype
        assert execute._train_dtype(grid, "cpu")[0] == "bf16"  # the last grid above: --dtype bf16
        assert execute._train_dtype(plan(CompareConfig(out="/nowhere", seeds=1)), "cpu")[0] == "fp32"  # d 64: narrow
    assert execute._train_dtype(wide, "cuda:1")[0] == "bf16"
    assert execute.machine_info(2, 1, "cpu", 1, "bf16, fp32")["train_dtype"] == "bf16, fp32"
    # each run's decision is handed to the run, so a worker never times while the others train
    dtypes, per_run = execute._train_dtype(sweep, "cpu")
    assert set(per_run) == {r.rel for r in sweep.runs} and {d for d, _ in per_run.values()} == set(dtypes.split(", "))
    # the help states the sweep's real defaults
    fields = {f.name: f for f in dataclasses.fields(CompareConfig)}
    assert SWEEP_SIZES in fields["sizes"].metadata["help"]
    assert f"default {SWEEP_RECIPE['tokens_per_param']:g}" in fields["tokens_per_param"].metadata["help"]


def test_the_parents_dtype_decision_reaches_every_run(monkeypatch):
    """Whatever a worker's own timing would say (here: the opposite), a run trains in what compare decided."""
    from qkvlab.compare import workers
    from qkvlab.train import setup as train_setup

    seen = []
    monkeypatch.setattr(workers.loop, "train", lambda cfg, out, **kw: seen.append(kw["decided"]) or pytest.skip("ok"))
    with pytest.raises(pytest.skip.Exception):
        workers.train_one(None, "/nowhere", False, ("bf16", None))
    assert seen == [("bf16", None)]

    class Env:
        main, distributed = True, False
        device = torch.device("cpu")

    class Cfg:
        dtype = "auto"

        def autocast(self, device_type):
            return ("fp32", None)  # what this process would time

    assert train_setup.resolve_dtype(Cfg(), Env(), None, ("bf16", None)) == ("bf16", None)
    assert train_setup.resolve_dtype(Cfg(), Env(), None) == ("fp32", None)


# ---- issue 27: named sweep recipes, per-size lr, grid cells, the lr scan, one dtype ------------------
def test_sizes_pin_lr_and_a_repeated_shape_is_a_cell_named_by_batch_and_lr():
    a, b = parse_sizes("d128-L2-h4-b16-s2-lr0.001,d128-L2-h4-b32-s2-lr2e-3")
    assert (a.lr, b.lr, a.cell, b.label) == (0.001, 0.002, True, "d128-L2-b32-lr0.002")
    assert parse_sizes("d48-L2-h4-lr1.5e-05,d80-L2-h4")[0].lr == pytest.approx(1.5e-5)
    assert parse_sizes("d48-L2-h4-lr0.001,d80-L2-h4")[0].label == "d48-L2"  # one of its shape: a size
    for bad, why in (
        ("d128-L2-h4-b16-lr0.001,d128-L2-h4-b16-lr0.001", "appears twice"),
        ("d128-L2-h4-b16,d128-L2-h4-b32", "must pin"),  # a cell without its lr
        ("d48-L2-h4-lr0,d80-L2-h4", "positive"),
        ("d48-L2-h4-lr0.1-lr0.2,d80-L2-h4", "given twice"),
        ("d48-L2-h4-lrx,d80-L2-h4", "is not"),
    ):
        with pytest.raises(UserError, match=why):
            parse_sizes(bad)


def test_named_recipes_fix_batch_dtype_seeds_depth_arms_and_data():
    from qkvlab.compare.recipes import SWEEP_CORPUS, SWEEP_RECIPES

    fact = plan(CompareConfig(sweep=True, recipe="factorial-d128", out="/nowhere"))
    cells = {(r.cfg.batch_size, r.cfg.lr) for r in fact.runs}
    assert cells == {(16, 1e-3), (16, 2e-3), (32, 1e-3), (32, 2e-3)} and len(fact.runs) == 16  # 2 x 2 x 2 seeds
    assert {r.variant.name for r in fact.runs} == {"Q-K-V", "Q-K=V"} and {r.seed for r in fact.runs} == {0, 1}
    assert "data" not in fact.runs[0].cfg.task_options  # the peak's own data: Shakespeare
    old = next(r for r in fact.runs if r.point == "d128-L2-b32-lr0.001")
    assert old.cfg.max_steps == 1923  # the old sweep's d128 run, step for step
    n = {}
    for L in (2, 4):
        p = plan(CompareConfig(sweep=True, recipe=f"gpu-L{L}", out="/nowhere"))
        assert {r.cfg.dtype for r in p.runs} == {"bf16"} and p.config.device == "cuda"
        assert {r.cfg.batch_size for r in p.runs} == {128} and {r.cfg.model.n_layer for r in p.runs} == {L}
        assert {r.seed for r in p.runs} == {0, 1, 2, 3}
        assert p.runs[0].cfg.task_options["data"] == SWEEP_CORPUS
        n[L] = [analytic_params(r.cfg.model).non_embedding for r in p.runs if r.variant.name == "Q-K-V" and r.seed == 0]
        scan = plan(CompareConfig(sweep=True, recipe=f"lr-scan-L{L}", out="/nowhere"))
        assert {r.seed for r in scan.runs} == {100} and {r.variant.name for r in scan.runs} == {"Q-K-V"}
        assert {r.cfg.dtype for r in scan.runs} == {"fp32"} and {r.cfg.batch_size for r in scan.runs} == {16}
        by_shape = {}
        for r in scan.runs:
            by_shape.setdefault(r.cfg.model.d_model, []).append(r.cfg.lr)
        for d, lrs in by_shape.items():  # 0.5x, 1x, 2x the 1/width rule
            assert sorted(lrs) == pytest.approx([x * 2e-3 * 64 / d for x in (0.5, 1, 2)], rel=5e-3)
        up = plan(CompareConfig(sweep=True, recipe=f"lr-scan-up-L{L}", out="/nowhere"))  # the grid extended upward
        assert {r.seed for r in up.runs} == {100} and {r.cfg.model.d_model for r in up.runs} == set(by_shape)
        for r in up.runs:
            assert r.cfg.lr / (2e-3 * 64 / r.cfg.model.d_model) == pytest.approx(4, rel=5e-3) or r.cfg.lr / (
                2e-3 * 64 / r.cfg.model.d_model
            ) == pytest.approx(8, rel=5e-3)
        assert "lr_scan" in SWEEP_RECIPES[f"next-L{L}"]
    for a, b in zip(n[2], n[4]):  # the depth arms are matched in N
        assert abs(a / b - 1) < 0.15
    with pytest.raises(UserError, match="task grid's recipe"):
        plan(CompareConfig(sweep=True, recipe="cpu"))
    with pytest.raises(UserError, match="add --sweep"):
        plan(CompareConfig(recipe="next-L2"))
    with pytest.raises(UserError, match="lr-scan-L2"):
        plan(CompareConfig(sweep=True, recipe="next-L2"))  # its lr comes from the scan
    with pytest.raises(UserError, match="--batch-size"):
        plan(CompareConfig(sweep=True, recipe="factorial-d128", batch_size=8))


def test_lr_scan_then_sweep_at_qkv_best_validation_lr(tmp_path, corpus, monkeypatch):
    """The scan's cells train; the sweep then trains both variants at the lr of the scan's Q-K-V run
    with the lowest validation loss (a size the scan did not reach is refused in one line)."""
    from qkvlab.compare.sweep import scan_lrs

    common = ["--data", str(corpus), "--tokenizer", "char", "--context", "16", "--jobs", "1", "--threads", "1"]
    common += ["--tokens-per-param", "0.3", "--no-plots"]
    scan = tmp_path / "scan"
    cells = "d8-L2-h2-b4-s1-lr0.0005,d8-L2-h2-b4-s1-lr0.05,d16-L2-h2-b4-s1-lr0.001,d16-L2-h2-b4-s1-lr0.01"
    assert main(["compare", "--sweep", "--recipe", "lr-scan-L2", "--sizes", cells, "--out", str(scan), *common]) == 0
    assert sorted(p.name for p in scan.iterdir() if p.is_dir()) == [
        "d16-L2-b4-lr0.001",
        "d16-L2-b4-lr0.01",
        "d8-L2-b4-lr0.0005",
        "d8-L2-b4-lr0.05",
    ]
    assert {p.name for p in (scan / "d8-L2-b4-lr0.05" / "Q-K-V").iterdir()} == {"seed100"}
    chosen = scan_lrs(scan)
    assert len(chosen) == 2
    for c in chosen.values():
        assert c["lr"] == min(c["tried"], key=c["tried"].get) and len(c["tried"]) == 2 and c["edge"]
    sweep_cfg = CompareConfig(
        sweep=True,
        recipe="next-L2",
        sizes="d8-L2-h2-b4-s2,d16-L2-h2-b4-s2",
        lr_scan=str(scan),
        data=str(corpus),
        tokenizer="char",
        tokens_per_param=0.3,
        model={"context": 16},
        out=str(tmp_path / "sweep"),
    )
    p = plan(sweep_cfg)
    for r in p.runs:
        assert r.cfg.lr == chosen[(r.cfg.model.d_model, 2, 2)]["lr"] and r.cfg.dtype == "fp32"
    assert {r.seed for r in p.runs} == {0, 1} and {r.variant.name for r in p.runs} == {"Q-K-V", "Q-K=V"}
    for g in p.grid:  # compare.json records each size's lr and the scan it came from
        assert g["lr"] == g["lr_scan"]["lr"] and g["lr_scan"]["dir"] == str(scan) and len(g["lr_scan"]["tried"]) == 2
    # the choice committed without the run folders (a later session's checkout) plans the same sweep
    committed = tmp_path / "committed"
    committed.mkdir()
    shutil.copy(scan / "lr_scan.json", committed / "lr_scan.json")
    assert scan_lrs(committed) == chosen
    assert [r.cfg.lr for r in plan(dataclasses.replace(sweep_cfg, lr_scan=str(committed))).runs] == [
        r.cfg.lr for r in p.runs
    ]
    # a scan resumed in a new checkout: the committed lr_scan.json (here d16 only) and the run folders
    # finished since (d8) both count
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    for run in ("d8-L2-b4-lr0.0005", "d8-L2-b4-lr0.05"):
        shutil.copytree(scan / run, resumed / run)
    body = json.loads((scan / "lr_scan.json").read_text())
    (resumed / "lr_scan.json").write_text(json.dumps({k: v for k, v in body.items() if k.startswith("d16-")}))
    assert scan_lrs(resumed) == chosen
    # a later scan extends the grid: the lrs of both compete, and the edge is the union's
    later = tmp_path / "later"
    later.mkdir()
    d8 = chosen[(8, 2, 2)]
    best8 = min(d8["tried"].values())
    (later / "lr_scan.json").write_text(
        json.dumps({"d8-L2-h2": {"lr": 0.2, "tried": {"0.1": best8 + 1, "0.2": best8 - 0.01}, "edge": True}})
    )
    both = scan_lrs(f"{committed},{later}")
    assert both[(8, 2, 2)]["lr"] == 0.2 and len(both[(8, 2, 2)]["tried"]) == 4 and both[(8, 2, 2)]["edge"]
    assert both[(16, 2, 2)] == chosen[(16, 2, 2)]  # a shape only the first scan tried keeps its choice
    two = plan(dataclasses.replace(sweep_cfg, lr_scan=f"{committed},{later}"))
    assert {r.cfg.lr for r in two.runs if r.cfg.model.d_model == 8} == {0.2}
    # next-up: only the sizes whose lr the extended grid moved train again, both variants, the same seeds
    up_cfg = dataclasses.replace(sweep_cfg, recipe="next-up-L2", lr_scan=f"{committed},{later}")
    up = plan(up_cfg)
    assert {(r.cfg.model.d_model, r.cfg.lr) for r in up.runs} == {(8, 0.2)}
    assert {r.seed for r in up.runs} == {0, 1} and {r.variant.name for r in up.runs} == {"Q-K-V", "Q-K=V"}
    with pytest.raises(UserError, match="give both scans"):
        plan(dataclasses.replace(up_cfg, lr_scan=str(committed)))
    (later / "lr_scan.json").write_text(
        json.dumps({"d8-L2-h2": {"lr": 0.2, "tried": {"0.1": best8 + 1, "0.2": best8 + 0.5}, "edge": True}})
    )
    with pytest.raises(UserError, match="no size's lr moved"):
        plan(up_cfg)
    (committed / "lr_scan.json").write_text('{"d8-L2": {"lr": 0.1}}')
    with pytest.raises(UserError, match="not an lr scan's choice"):
        scan_lrs(committed)
    with pytest.raises(UserError, match="no finished Q-K-V run at d24-L2-h2"):
        plan(dataclasses.replace(sweep_cfg, sizes="d8-L2-h2-b4-s2,d24-L2-h2-b4-s2"))
    with pytest.raises(UserError, match="no such folder"):
        plan(dataclasses.replace(sweep_cfg, lr_scan=str(tmp_path / "nothing")))
    with pytest.raises(UserError, match="--lr-scan goes with"):
        plan(dataclasses.replace(sweep_cfg, recipe=None))


def test_a_sweep_refuses_an_auto_dtype_that_splits_its_sizes(monkeypatch, tmp_path, corpus):
    from qkvlab.compare import run
    from qkvlab.decode import dtype_probe

    clock = FakeClock()
    fast = lambda s: clock.ways(fp32=1.0, bf16=0.5 if s.d_model >= 32 else 1.5)  # noqa: E731  bf16 pays from d 32
    cache, timer = tmp_path / "probe.json", fake_timer(clock)
    monkeypatch.setattr(
        dtype_probe, "cpu_autocast", lambda m, rows: real_cpu_autocast(m, rows, ways=fast, timer=timer, cache=cache)
    )
    cfg = CompareConfig(
        sweep=True, out=str(tmp_path / "mixed"), sizes="d8-L1-h2,d32-L1-h2", data=str(corpus), tokenizer="char",
        device="cpu", jobs=1, threads=1, seeds=1, tokens_per_param=0.05, model={"context": 16},
    )  # fmt: skip
    with pytest.raises(UserError, match="resolves to bf16, fp32 .* one dtype"):
        run(plan(cfg))
    assert not list((tmp_path / "mixed").glob("*/*/seed0"))  # refused before any run started


def test_factorial_cells_at_one_n_render_gaps_without_a_line(tmp_path, corpus):
    """Cells share N: each has its gap, no slope is fitted (a line through one x is not defined), and
    the corpus the runs read is named in results.md."""
    out = tmp_path / "fact"
    args = ["compare", "--sweep", "--out", str(out), "--variants", "Q-K-V,Q-K=V", "--seeds", "1"]
    args += ["--sizes", "d8-L1-h2-b4-lr0.001,d8-L1-h2-b8-lr0.002", "--tokens-per-param", "0.5", "--context", "16"]
    args += ["--data", str(corpus), "--tokenizer", "char", "--jobs", "1", "--threads", "1", "--no-plots"]
    assert main(args) == 0
    rows = list(csv.DictReader((out / "results.csv").open()))
    assert sorted({r["size"] for r in rows}) == ["d8-L1-b4-lr0.001", "d8-L1-b8-lr0.002"]
    md = (out / "results.md").read_text()
    assert "`Q-K=V`" in md and "Corpus: `" in md and str(corpus) in md
    line = next(x for x in md.splitlines() if x.startswith("| `Q-K=V`"))
    assert line.count("–") >= 2  # no slope, no lack-of-fit test


def test_no_recipe_on_the_sweep_corpus_repeats_its_data():
    """Every size of every recipe that reads the Linux corpus trains on fewer tokens than its training
    split holds (estimated from the 280 MB at 1.80 characters a token until it is prepared)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    import sweep_plan
    from qkvlab.compare.recipes import SWEEP_RECIPES

    for name, recipe in SWEEP_RECIPES.items():
        lines, totals = sweep_plan.table(name)
        tokens, _ = sweep_plan.train_tokens(recipe)
        p = sweep_plan.recipe_plan(name)
        most = max(r.cfg.max_steps * r.cfg.batch_size * r.cfg.model.context for r in p.runs)
        if "data" in recipe:
            assert most < tokens, name
        else:  # the factorial: the old sweep's d128 on Shakespeare, its 4.13 epochs kept on purpose
            assert 4.1 < most / tokens < 4.2
        assert all(v > 0 for v in totals.values()) and len(lines) > 4
