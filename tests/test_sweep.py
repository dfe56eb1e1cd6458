"""`qkvlab compare --sweep`: size notation, the plan (layout and recipe), and a tiny sweep end to
end: trained once, then only re-rendered."""

import csv
import dataclasses

import pytest

from qkvlab.accounting import analytic_params
from qkvlab.cli import main
from qkvlab.compare import CompareConfig, plan
from qkvlab.compare.sweep import SweepSize, parse_sizes
from qkvlab.config import ModelConfig
from qkvlab.errors import UserError
from qkvlab.train.dtype_probe import cpu_autocast as real_cpu_autocast  # before conftest fixes its answer


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

    # Again: every run is finished, nothing trains, the results are rendered again.
    import qkvlab.train.loop as loop

    calls = []
    monkeypatch.setattr(loop, "train", lambda *a, **k: calls.append(a) or pytest.fail("trained again"))
    (out / "results.md").unlink()
    assert main(args + ["--no-plots"]) == 0
    assert calls == [] and "8 finished already, 0 to train" in capsys.readouterr().out
    assert (out / "results.md").is_file()


def test_compare_dtype_reaches_every_run_and_the_record_says_what_auto_became(monkeypatch, tmp_path):
    """--dtype is one setting for the whole comparison (grid and sweep); machine_info records the
    dtype it resolved to on this machine (auto: bf16 only where timing the model's shapes says so)."""
    from qkvlab.compare import execute
    from qkvlab.compare.sweep import SWEEP_RECIPE, SWEEP_SIZES
    from qkvlab.settings import check

    for dtype in ("fp32", "bf16"):
        grid = plan(CompareConfig(out="/nowhere", dtype=dtype, seeds=1))
        sweep = plan(CompareConfig(sweep=True, out="/nowhere", dtype=dtype, sizes="d32-L1-h2,d48-L2-h3"))
        assert {r.cfg.dtype for r in grid.runs + sweep.runs} == {dtype}
    assert {r.cfg.dtype for r in plan(CompareConfig(out="/nowhere", seeds=1)).runs} == {"auto"}
    with pytest.raises(UserError, match="fp16"):
        check(CompareConfig(dtype="fp16"))
    wide = plan(CompareConfig(out="/nowhere", seeds=1, model={"d_model": 256, "n_head": 4}))
    sweep = plan(CompareConfig(sweep=True, out="/nowhere", sizes="d64-L1-h2,d256-L1-h4"))
    from qkvlab.train import dtype_probe

    for has_bf16, grid_dtype, sweep_dtype in ((False, "fp32", "fp32"), (True, "bf16", "bf16, fp32")):
        # a fake timer: where bf16 pays, it pays from d_model 192 on
        fast = lambda s, v=has_bf16: ([1.0] * 5, [0.5 if v and s.d_model >= 192 else 1.5] * 5)
        cache = tmp_path / f"{has_bf16}.json"
        timed = lambda m, rows, f=fast, c=cache: real_cpu_autocast(m, rows, measure=f, cache=c)
        monkeypatch.setattr(dtype_probe, "cpu_autocast", timed)
        assert execute._train_dtype(wide, "cpu") == grid_dtype
        assert execute._train_dtype(sweep, "cpu") == sweep_dtype
        assert execute._train_dtype(grid, "cpu") == "bf16"  # the last grid above: --dtype bf16
        assert execute._train_dtype(plan(CompareConfig(out="/nowhere", seeds=1)), "cpu") == "fp32"  # d 64: narrow
    assert execute._train_dtype(wide, "cuda:1") == "bf16"
    assert execute.machine_info(2, 1, "cpu", 1, "bf16, fp32")["train_dtype"] == "bf16, fp32"
    # the help states the sweep's real defaults
    fields = {f.name: f for f in dataclasses.fields(CompareConfig)}
    assert SWEEP_SIZES in fields["sizes"].metadata["help"]
    assert f"default {SWEEP_RECIPE['tokens_per_param']:g}" in fields["tokens_per_param"].metadata["help"]
