"""qkvlab retrofit: the fit keeps what it claims exactly, layer choice by budget, distillation task,
and the whole command end to end on a tiny model trained here."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch

from qkvlab.base.errors import UserError
from qkvlab.cli import main
from qkvlab.convert.reparam import logit_diff, role_weights
from qkvlab.model.accounting import kv_cache_bytes_per_token
from qkvlab.model.cache import KVCache
from qkvlab.model.config import ModelConfig
from qkvlab.model.transformer import GPT
from qkvlab.retrofit.fit import attention_inputs, calibration_windows, fit


def model_with(seed=0, **kw) -> tuple[GPT, ModelConfig]:
    base = dict(n_layer=3, n_head=4, d_model=32, vocab_size=40, context=32, pos="rope", norm="rmsnorm")
    base.update(kw)
    cfg = ModelConfig(**base).validate()
    torch.manual_seed(seed)
    model = GPT(cfg).double().eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, p.shape[1] ** -0.5)
    return model, cfg


def calib(n=512, vocab=40, seed=1):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def test_values_linear_in_keys_fit_exactly():
    """If every value head is a linear map of its key head, K=V plus the folded map is exact."""
    model, cfg = model_with(bias=True, kv_heads=2)
    hd = cfg.head_dim
    with torch.no_grad():
        for blk in model.trunk.blocks:
            (wk, bk), (wv, bv) = role_weights(blk, blk.attn.spec)["k"], role_weights(blk, blk.attn.spec)["v"]
            for g in range(cfg.n_kv_heads):
                M = torch.randn(hd, hd, dtype=torch.float64) / hd**0.5
                c = torch.randn(hd, dtype=torch.float64)
                rows = slice(g * hd, (g + 1) * hd)
                wv[rows] = M.T @ wk[rows]  # v = k M + c (row vectors)
                bv[rows] = bk[rows] @ M + c
    res = fit(model, cfg, calib(), to="Q-K=V", block=32)
    assert res.cfg.spec.name == "Q-K=V" and res.converted == [0, 1, 2]
    assert all(lf.r2 > 1 - 1e-12 for lf in res.layers)
    # float64; the fit's ridge (1e-10 x the mean Gram diagonal) bounds exactness near 1e-9 over 3 layers
    assert logit_diff(model, res.model, cfg.vocab_size, cfg.context)[1] <= 1e-8
    # the keys were kept: the same tensors, so rotary stays exact
    for a, b in zip(model.trunk.blocks, res.model.trunk.blocks):
        assert torch.equal(role_weights(a, a.attn.spec)["k"][0], role_weights(b, b.attn.spec)["k"][0])


def test_mean_pooling_of_equal_heads_is_exact():
    """GQA pooling (the GQA paper's mean) of kv heads that are already equal within each group."""
    model, cfg = model_with()
    hd = cfg.head_dim
    with torch.no_grad():
        for blk in model.trunk.blocks:
            for r in ("k", "v"):
                w, _ = role_weights(blk, blk.attn.spec)[r]
                for g in (1, 3):
                    w[g * hd : (g + 1) * hd] = w[(g - 1) * hd : g * hd]
    for pool in ("mean", "fit"):
        res = fit(model, cfg, calib(), to="Q-K-V", kv_heads=2, pool=pool, block=32)
        assert res.cfg.n_kv_heads == 2
        assert logit_diff(model, res.model, cfg.vocab_size, cfg.context)[1] <= 1e-9  # the fit: a 1e-10 ridge


def test_layer_selection_and_mqa_cache():
    model, cfg = model_with()
    res = fit(model, cfg, calib(), to="Q-K=V", kv_heads=1, layers="-1", block=32)
    assert [lc.spec.name for lc in res.cfg.layer_configs()] == ["Q-K-V", "Q-K-V", "Q-K=V"]
    assert [lc.n_kv_heads for lc in res.cfg.layer_configs()] == [4, 4, 1]
    per_layer = cfg.n_head * cfg.head_dim * 2 * 2  # K and V, bf16
    assert kv_cache_bytes_per_token(res.cfg) == 2 * per_layer + cfg.head_dim * 2
    assert (
        KVCache(res.cfg, 1, 5, dtype=torch.float32).bytes_allocated() == kv_cache_bytes_per_token(res.cfg, "fp32") * 5
    )
    # cached decoding of the retrofitted (mixed) model equals its full forward
    idx = calib(12).view(1, 12)
    m = res.model
    with torch.no_grad():
        full, _ = m(idx)
        cache = KVCache(res.cfg, 1, 12, dtype=torch.float64)
        steps = [m(idx[:, :4], cache=cache)[0]] + [m(idx[:, t : t + 1], cache=cache)[0] for t in range(4, 12)]
    assert (torch.cat(steps, 1) - full).abs().max().item() <= 1e-12


def test_cache_budget_picks_the_layers_with_the_lowest_output_error():
    model, cfg = model_with(n_layer=4)
    res = fit(model, cfg, calib(), to="Q-K=V", cache_budget=0.75, block=32)
    err = {lf.layer: lf.error for lf in res.layers}
    assert len(res.converted) == 2 and len(set(err.values())) == 4
    assert max(err[i] for i in res.converted) <= min(err[i] for i in err if i not in res.converted)
    assert kv_cache_bytes_per_token(res.cfg) <= 0.75 * kv_cache_bytes_per_token(cfg)
    with pytest.raises(UserError, match="cache-budget 0.2"):
        fit(model, cfg, calib(), to="Q-K=V", cache_budget=0.2, block=32)


def test_output_error_and_refinement():
    """The error is 0 for the original layer itself; refinement lowers it on windows it never saw,
    from the very start the closed-form fit gives; the converted layers' rotary keys stay a K=V layer."""
    from qkvlab.retrofit.refine import RefineOptions, output_error, targets

    model, cfg = model_with(n_layer=2, kv_heads=2)
    toks = calib(4096, seed=3)
    xs = attention_inputs(model, toks, 4096, 32)
    attn, rot = model.trunk.blocks[0].attn, model.trunk.rotary
    assert xs[0].shape == (127, 32, cfg.d_model)  # (4096 - 1) // 32 whole windows
    assert output_error(attn, xs[0], targets(attn, xs[0], rot), rot) == 0.0
    plain = fit(model, cfg, toks, to="Q-K=V", block=32, inputs=xs)
    refined = fit(model, cfg, toks, to="Q-K=V", block=32, inputs=xs, refine=RefineOptions(steps=100, lr=3e-3))
    for a, b in zip(plain.layers, refined.layers):
        assert a.error == a.error_fit == pytest.approx(b.error_fit, rel=1e-12) and a.error_fit > 0.05
        assert b.error < 0.7 * b.error_fit  # held windows: not the ones the steps saw
    again = fit(model, cfg, toks, to="Q-K=V", block=32, inputs=xs, refine=RefineOptions(steps=100, lr=3e-3))
    assert [lf.error for lf in again.layers] == [lf.error for lf in refined.layers]  # seeded: the same steps
    assert refined.cfg.spec.name == "Q-K=V"


def test_refinement_on_the_converted_models_own_inputs():
    """inputs="converted": the stream is the converted model's own, float64-exact where no converted
    layer is upstream (layer 0's inputs are the original's, so its error there is the first pass's);
    a later layer reads another stream; the pass never ends a layer worse than it found it."""
    from qkvlab.retrofit.refine import RefineOptions, refine_in_sequence

    model, cfg = model_with(n_layer=3, kv_heads=2)
    toks = calib(2048, seed=5)
    xs = attention_inputs(model, toks, 2048, 32)
    windows = calibration_windows(toks, 2048, 32)
    opts = RefineOptions(20, 3e-3, inputs="original")
    first = fit(model, cfg, toks, to="Q-K=V", layers="0,2", block=32, inputs=xs, refine=opts)
    looked = refine_in_sequence(first.model, model, [0, 2], windows, xs, RefineOptions(steps=0))
    error = {lf.layer: lf.error for lf in first.layers}
    assert looked[0] == pytest.approx((error[0], error[0]), rel=1e-12)
    assert abs(looked[2][0] - error[2]) > 1e-6 * error[2]  # layer 2 reads what converted layer 0 passes on
    opts = RefineOptions(steps=20, lr=3e-3, inputs="converted")
    both = fit(model, cfg, toks, to="Q-K=V", layers="0,2", block=32, inputs=xs, calib_tokens=2048, refine=opts)
    in_model = {lf.layer: lf.error_in_model for lf in both.layers}
    assert in_model[0] <= looked[0][0] + 1e-15  # the same start, and steps that end worse are undone
    assert in_model[2] is not None and in_model[2] >= 0
    assert both.converted == [0, 2] and both.cfg.layer_config(1).spec.name == "Q-K-V"
    assert both.cfg.layer_config(2).spec.name == "Q-K=V"


def test_calibration_windows_cover_the_corpus_and_mean_start():
    toks = torch.arange(10_000)
    w = calibration_windows(toks, 32 * 20, 32, seed=0)
    assert w.shape == (20, 32) and len({int(r[0]) for r in w}) == 20
    assert all(int(r[0]) % 32 == 0 and torch.equal(r, toks[int(r[0]) : int(r[0]) + 32]) for r in w)
    assert int(w[-1, 0]) > 5_000  # spread over the corpus, not its first 640 tokens
    assert calibration_windows(toks, 10**9, 32).shape == (312, 32)  # at most every window
    model, cfg = model_with(n_layer=1)
    res = fit(model, cfg, calib(), to="Q-K=V", start="mean", block=32)
    src, dst = role_weights(model.trunk.blocks[0], model.trunk.blocks[0].attn.spec), None
    dst = role_weights(res.model.trunk.blocks[0], res.model.trunk.blocks[0].attn.spec)
    assert torch.allclose(dst["k"][0], (src["k"][0] + src["v"][0]) / 2, rtol=0, atol=1e-15)
    with pytest.raises(UserError, match="start='median'"):
        fit(model, cfg, calib(), to="Q-K=V", start="median", block=32)


@pytest.mark.parametrize(
    "kw,needle",
    [
        (dict(to="Id-K-V"), "retrofit fits"),
        (dict(to="Q-K=V", kv_heads=3), "must divide n_head"),
        (dict(to="Q-K=V", cache_budget=1.5), "fraction"),
        (dict(to="Q-K=V", layers="7"), "out of range"),
        (dict(to="Q-K=V", pool="max"), "pool='max'"),
        (dict(to="Q-K-V"), "nothing to retrofit"),  # Q-K-V already: it fitted and uptrained a copy
    ],
)
def test_refusals_one_line(kw, needle):
    model, cfg = model_with()
    with pytest.raises(UserError) as e:
        fit(model, cfg, calib(), block=32, **kw)
    assert needle in str(e.value) and "\n" not in str(e.value)


# ---- end to end: train a tiny model here, retrofit it with uptraining ---------------------------
@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    from qkvlab.data.text import load_shakespeare
    from qkvlab.train.config import TrainConfig
    from qkvlab.train.loop import train

    root = tmp_path_factory.mktemp("retrofit")
    (root / "plays.txt").write_text("".join(d.text for d in load_shakespeare()[:2])[:120_000])
    old, threads = os.environ.get("QKVLAB_CACHE"), torch.get_num_threads()
    os.environ["QKVLAB_CACHE"] = str(root / "cache")
    torch.set_num_threads(1)
    tc = TrainConfig.from_dict(
        {
            "preset": "tiny",
            "task_options": {"data": str(root / "plays.txt"), "tokenizer": "char", "block_size": 32},
            "model": {"context": 32, "pos": "rope"},
            "batch_size": 16,
            "max_steps": 120,
            "eval_every": 120,
            "eval_batches": 2,
            "lr": 3e-3,
            "log_tensorboard": False,
        }
    )
    train(tc, root / "teacher", progress=False)
    yield root
    torch.set_num_threads(threads)
    if old is None:
        os.environ.pop("QKVLAB_CACHE", None)
    else:
        os.environ["QKVLAB_CACHE"] = old


def test_retrofit_command_end_to_end(trained, capsys, monkeypatch):
    out = trained / "rf"
    argv = ["retrofit", str(trained / "teacher"), str(out), "--to", "Q-K=V", "--data", str(trained / "plays.txt")]
    argv += ["--steps", "40", "--batch-size", "16", "--lr", "2e-3", "--eval-every", "40", "--quiet"]
    argv += ["--calib-tokens", "1024", "--eval-tokens", "4096"]
    assert main(argv) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    report = json.loads((out / "retrofit.json").read_text())
    assert last.startswith("ppl_original=") and last.endswith(f"cache_ratio={report['cache_ratio']:.4g}")
    assert report["cache_ratio"] == 0.5 and report["converted_layers"] == [0, 1]
    assert report["ppl_uptrained"] < report["ppl_fit"]
    # OUT is a model folder with the retrofitted scheme; the run folder is resumable and finished
    from qkvlab.model.folder import load_model

    model, cfg, _ = load_model(out)
    assert cfg.spec.name == "Q-K=V" and (out / "tokenizer").is_dir()
    assert (out / "uptrain" / "metrics.jsonl").is_file() and (out / "uptrain" / "checkpoint").is_dir()
    # a second run without --resume refuses to touch OUT; with --resume it finds the run finished
    assert main(argv) == 2
    assert "pass --resume" in capsys.readouterr().err
    from qkvlab.retrofit import workflow as rf

    monkeypatch.setattr(rf, "fit", lambda *a, **k: pytest.fail("fitted again on --resume"))
    assert main(argv + ["--resume"]) == 0  # the fit in OUT/fit is reused
    again = json.loads((out / "retrofit.json").read_text())
    assert again["ppl_uptrained"] == pytest.approx(report["ppl_uptrained"], rel=1e-6)


def test_rest_lr_trains_the_unconverted_weights_at_their_rate(trained, capsys):
    """--rest-lr: the MLPs and embedding move too, the loop's step lr is the scheduled one times each
    group's scale (read back from the checkpoint); refused beside --train all."""
    from qkvlab.model.folder import load_model

    out = trained / "rf_rest"
    argv = ["retrofit", str(trained / "teacher"), str(out), "--data", str(trained / "plays.txt"), "--steps", "3"]
    argv += ["--calib-tokens", "512", "--eval-tokens", "512", "--refine-steps", "2", "--quiet", "--lr", "1e-3"]
    assert main(argv + ["--rest-lr", "2.5e-4", "--train", "all"]) == 2
    assert "--rest-lr 0.00025 is for --train converted" in capsys.readouterr().err and not out.exists()
    assert main(argv + ["--rest-lr", "2.5e-4", "--warmup-steps", "0"]) == 0
    fit, _, _ = load_model(out / "fit")
    final, _, _ = load_model(out)
    fit_w, final_w = dict(fit.named_parameters()), dict(final.named_parameters())
    assert all(not torch.equal(fit_w[n], final_w[n]) for n in fit_w if n.endswith("weight") and ".norm" not in n)
    state = json.loads((out / "uptrain" / "checkpoint" / "state.json").read_text())
    lrs = {g["lr_scale"]: g["lr"] for g in state["optimizer_param_groups"]}
    assert set(lrs) == {1.0, 0.25} and lrs[0.25] == pytest.approx(lrs[1.0] * 0.25, rel=1e-12)
    # the default, decided by the pre-registered SmolLM2 run (docs/results/retrofit): a tenth of --lr; 0 freezes
    for flags, scales in (([], [0.1, 1.0]), (["--rest-lr", "0"], [1.0])):
        out = trained / f"rf_rest_default{len(flags)}"
        assert main(argv[:2] + [str(out)] + argv[3:] + flags) == 0
        rest_lr = json.loads((out / "retrofit.json").read_text())["options"]["rest_lr"]
        assert rest_lr == pytest.approx(1e-4 if not flags else 0, abs=1e-15)
        state = json.loads((out / "uptrain" / "checkpoint" / "state.json").read_text())
        assert sorted({round(g["lr_scale"], 12) for g in state["optimizer_param_groups"]}) == pytest.approx(
            sorted(scales)
        )


def test_a_fit_from_before_an_option_is_reused_only_for_what_it_did(trained, capsys):
    """A fit written before --refine-inputs existed had only the first pass: --resume reuses it for
    --refine-inputs original and refuses converted (today's default) in one line: the uptraining in OUT
    distils that fit, so another fit cannot continue it."""
    from qkvlab.retrofit.options import RetrofitOptions
    from qkvlab.retrofit.workflow import _reuse_fit

    out = trained / "old_fit"
    argv = ["retrofit", str(trained / "teacher"), str(out), "--data", str(trained / "plays.txt"), "--steps", "0"]
    assert main(argv + ["--calib-tokens", "512", "--eval-tokens", "512", "--refine-steps", "2", "--quiet"]) == 0
    body = json.loads((out / "fit" / "config.json").read_text())
    made = body["retrofit"]
    assert made["refine_inputs"] == "converted"
    del made["refine_inputs"]
    (out / "fit" / "config.json").write_text(json.dumps(body))
    opts = {k: v for k, v in made.items()}
    assert _reuse_fit(out / "fit", RetrofitOptions(**opts, refine_inputs="original")) is not None
    with pytest.raises(UserError, match="fitted with --refine-inputs original, not --refine-inputs converted") as e:
        _reuse_fit(out / "fit", RetrofitOptions(**opts))
    assert "\n" not in str(e.value)


def test_retrofit_refuses_foreign_out(trained, capsys):
    foreign = trained / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    argv = ["retrofit", str(trained / "teacher"), str(foreign), "--steps", "0", "--resume", "--quiet"]
    assert main(argv) == 2
    assert "not written by qkvlab retrofit" in capsys.readouterr().err
    assert (foreign / "notes.txt").read_text() == "keep me" and len(list(foreign.iterdir())) == 1


def test_kl_and_distill_options():
    import torch.nn.functional as F

    from qkvlab.tasks import get_task
    from qkvlab.tasks.distill import kl_teacher_student

    t, s = torch.randn(2, 3, 7), torch.randn(2, 3, 7)
    assert kl_teacher_student(t, t).item() == pytest.approx(0.0, abs=1e-6)
    ref = F.kl_div(F.log_softmax(s, -1), F.log_softmax(t, -1), log_target=True, reduction="none").sum(-1).mean()
    assert kl_teacher_student(t, s).item() == pytest.approx(ref.item(), rel=1e-5)
    with pytest.raises(UserError, match="unknown distill option 'temp'"):
        get_task("distill", teacher="a", student="b", tokens="c", temp=2)
    with pytest.raises(UserError, match="both 0"):
        get_task("distill", teacher="a", student="b", tokens="c", kl_weight=0, lm_weight=0)
    with pytest.raises(UserError, match="needs the option teacher"):
        get_task("distill", student="b", tokens="c")


def test_distill_trains_only_the_chosen_layers_attention(tmp_path):
    from qkvlab.model.folder import save_model
    from qkvlab.retrofit.source import write_tokens
    from qkvlab.tasks import get_task

    model, cfg = model_with(n_layer=3)
    save_model(tmp_path / "student", model.float(), cfg)
    write_tokens(tmp_path / "t.safetensors", calib(400), calib(100, seed=2))
    opts = dict(
        teacher=str(tmp_path / "student"), student=str(tmp_path / "student"), tokens=str(tmp_path / "t.safetensors")
    )
    task = get_task("distill", **opts, train_layers=[2, 0])
    trainable = {n for n, p in task.build_model(cfg).named_parameters() if p.requires_grad}
    assert trainable == {f"trunk.blocks.{i}.attn.{w}.weight" for i in (0, 2) for w in ("in_proj", "out_proj")}
    assert all(p.requires_grad for p in get_task("distill", **opts).build_model(cfg).parameters())
    for bad in ([3], [-1], "0", [True]):
        with pytest.raises(UserError, match="train_layers="):
            get_task("distill", **opts, train_layers=bad)


def test_distill_rest_lr_scale_trains_the_rest_slower(tmp_path):
    """rest_lr_scale > 0: every weight trains, the chosen layers' attention at the lr, the rest at the
    fraction; the loop's optimizer groups carry the scale and each step's lr is multiplied by it."""
    from qkvlab.model.folder import save_model
    from qkvlab.retrofit.source import write_tokens
    from qkvlab.tasks import get_task
    from qkvlab.train.optim import make_optimizer

    model, cfg = model_with(n_layer=3)
    save_model(tmp_path / "student", model.float(), cfg)
    write_tokens(tmp_path / "t.safetensors", calib(400), calib(100, seed=2))
    opts = dict(
        teacher=str(tmp_path / "student"), student=str(tmp_path / "student"), tokens=str(tmp_path / "t.safetensors")
    )
    task = get_task("distill", **opts, train_layers=[1], rest_lr_scale=0.1)
    student = task.build_model(cfg)
    assert all(p.requires_grad for p in student.parameters())
    full = {f"trunk.blocks.1.attn.{w}.weight" for w in ("in_proj", "out_proj")}
    scales = {n: task.lr_scale(n) for n, _ in student.named_parameters()}
    assert {n for n, s in scales.items() if s == 1.0} == full and set(scales.values()) == {1.0, 0.1}
    opt = make_optimizer(student, 1e-3, 0.1, (0.9, 0.95), torch.device("cpu"), task.lr_scale)
    by_scale = {g["lr_scale"]: sum(p.numel() for p in g["params"]) for g in opt.param_groups if g["weight_decay"]}
    named = dict(student.named_parameters())
    assert by_scale[1.0] == sum(named[n].numel() for n in full)
    assert sum(len(g["params"]) for g in opt.param_groups) == len(named)
    assert get_task("distill", **opts, train_layers=[1]).lr_scale("trunk.blocks.0.mlp.fc.weight") == 0.0
    with pytest.raises(UserError, match="rest_lr_scale=0.5 needs train_layers"):
        get_task("distill", **opts, rest_lr_scale=0.5)
    with pytest.raises(UserError, match="rest_lr_scale=-1"):
        get_task("distill", **opts, train_layers=[1], rest_lr_scale=-1)


def test_command_settings(capsys, tmp_path):
    assert main(["retrofit", "a", str(tmp_path / "b"), "--layers", "0", "--cache-budget", "0.5"]) == 2
    assert "not both" in capsys.readouterr().err
    assert main(["retrofit", "a", str(tmp_path / "b"), "--steps", "-1"]) == 2
    assert "--steps: -1 must be >= 0" in capsys.readouterr().err
    assert main(["retrofit", "a", str(tmp_path / "b"), "--kv-heads", "1", "--print-config", "json"]) == 0
    body = json.loads(capsys.readouterr().out)
    assert body["kv_heads"] == 1 and body["to"] == "Q-K=V" and not (tmp_path / "b").exists()


def test_retrofit_refuses_bad_target_and_layers_before_any_work(trained, capsys, monkeypatch):
    """--to is refused before a model is loaded, --layers before any text is read or scored."""
    from qkvlab.retrofit import workflow as rf

    monkeypatch.setattr(rf, "load_source", lambda *a: pytest.fail("loaded the model before checking --to"))
    argv = ["retrofit", str(trained / "teacher"), str(trained / "bad"), "--steps", "0", "--quiet"]
    assert main(argv + ["--to", "Id-K-V"]) == 2
    err = capsys.readouterr().err
    assert "--to Id-K-V: retrofit fits" in err and len(err.strip().splitlines()) == 1
    monkeypatch.undo()
    monkeypatch.setattr(rf, "corpus_tokens", lambda *a: pytest.fail("read text before checking --layers"))
    assert main(argv + ["--layers", "99"]) == 2
    err = capsys.readouterr().err
    assert "layer 99 is out of range" in err and len(err.strip().splitlines()) == 1
    assert main(argv + ["--to", "Q-K-V"]) == 2  # the teacher is Q-K-V already
    assert "nothing to retrofit" in capsys.readouterr().err
    monkeypatch.undo()
    monkeypatch.setattr(rf, "load_source", lambda *a: pytest.fail("loaded the model before checking the weights"))
    argv[argv.index("--steps") + 1] = "5"  # both weights 0 refused before the fit (it used to write OUT/fit first)
    assert main(argv + ["--to", "Q-K=V", "--kl-weight", "0", "--lm-weight", "0"]) == 2
    assert "both 0: nothing to uptrain on" in capsys.readouterr().err
    assert not (trained / "bad").exists()


def test_retrofit_refuses_a_corpus_smaller_than_the_calibration(trained, capsys):
    small = trained / "small.txt"
    small.write_text((trained / "plays.txt").read_text()[:3000])
    out = trained / "too_small"
    argv = ["retrofit", str(trained / "teacher"), str(out), "--data", str(small), "--steps", "0", "--quiet"]
    assert main(argv + ["--calib-tokens", "4096"]) == 2
    err = capsys.readouterr().err.strip()
    assert "training tokens, fewer than --calib-tokens 4,096" in err and len(err.splitlines()) == 1
    assert not out.exists()  # nothing half-written


def test_retrofit_reads_and_keeps_a_transformers_tokenizer_in_a_qkvlab_folder(tmp_path, capsys):
    """A qkvlab folder whose tokenizer/ holds transformers' files (what `convert --from-hf` writes)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from qkvlab.convert.load import save_hf_tokenizer
    from qkvlab.model.folder import save_model
    from qkvlab.retrofit.source import load_source

    text = "the quick brown fox jumps over the lazy dog. " * 200
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([text], trainers.BpeTrainer(vocab_size=40, special_tokens=["<eot>"]))
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eot>")
    model, cfg = model_with(n_layer=2, vocab_size=len(hf))
    save_model(tmp_path / "m", model.float(), cfg)
    save_hf_tokenizer(hf, tmp_path / "m" / "tokenizer")
    src = load_source(tmp_path / "m")
    assert src.encode("the lazy dog") == hf.encode("the lazy dog") and src.eot_id == hf.eos_token_id
    (tmp_path / "t.txt").write_text(text)
    argv = ["retrofit", str(tmp_path / "m"), str(tmp_path / "rf"), "--data", str(tmp_path / "t.txt"), "--steps", "0"]
    assert main(argv + ["--calib-tokens", "256", "--eval-tokens", "256", "--refine-steps", "2", "--quiet"]) == 0
    kept = AutoTokenizer.from_pretrained(tmp_path / "rf" / "tokenizer")
    assert kept.encode("the lazy dog") == hf.encode("the lazy dog")
    # `qkvlab generate` reads text through those files too (it once wanted a qkvlab tokenizer only)
    from qkvlab.decode.generate import generate
    from qkvlab.decode.sampling import Sampling
    from qkvlab.model.folder import load_model

    capsys.readouterr()
    argv = ["generate", str(tmp_path / "rf"), "--prompt", "the lazy", "--max-new-tokens", "6", "--temperature", "0"]
    assert main(argv + ["--dtype", "fp32"]) == 0
    rf_model, _, _ = load_model(tmp_path / "rf", dtype=torch.float32)
    ids = hf("the lazy")["input_ids"]
    greedy = generate(rf_model, [ids], 6, Sampling(temperature=0.0), eot_id=hf.eos_token_id)[0]
    assert capsys.readouterr().out.strip() == hf.decode(ids + greedy, skip_special_tokens=True).strip()


def test_with_layers_is_the_fit_of_those_layers():
    from qkvlab.retrofit.fit import with_layers

    model, cfg = model_with(n_layer=3, kv_heads=2)
    every = fit(model, cfg, calib(), to="Q-K=V", block=32)
    one = fit(model, cfg, calib(), to="Q-K=V", layers="1", block=32)
    built, built_cfg = with_layers(model, cfg, every.model, every.cfg, [1])
    assert built_cfg == one.cfg and [lc.spec.name for lc in built_cfg.layer_configs()] == ["Q-K-V", "Q-K=V", "Q-K-V"]
    mine, theirs = built.state_dict(), one.model.state_dict()
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)


def test_retrofit_to_a_latent_end_to_end(trained, capsys, monkeypatch):
    """--to Q-K-V --kv-latent R: every layer caches R numbers per token (a quarter of the tiny model's
    2 x 4 heads x 16), distillation lowers the fit's perplexity, OUT decodes through its latent cache,
    --resume reuses the fit; what a latent cannot be is refused in one line before any text is read."""
    from qkvlab.model.cache import KVCache
    from qkvlab.model.folder import load_model
    from qkvlab.retrofit import workflow as rf

    out = trained / "rf_latent"
    argv = ["retrofit", str(trained / "teacher"), str(out), "--data", str(trained / "plays.txt"), "--quiet"]
    argv += ["--steps", "30", "--batch-size", "16", "--lr", "2e-3", "--eval-every", "30", "--refine-steps", "20"]
    argv += ["--calib-tokens", "1024", "--eval-tokens", "4096", "--to", "Q-K-V"]
    for bad, needle in [
        (["--kv-latent", "32", "--to", "Q-K=V"], "--kv-latent 32 with --to Q-K=V: a latent keeps the query"),
        (["--kv-latent", "32", "--kv-heads", "2"], "--kv-latent 32 with --kv-heads: a latent is one rank"),
        (["--kv-latent", "128"], r"kv_latent=128 must be below 2 \* kv_heads \* d_head = 128"),
    ]:
        assert main(argv + bad) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and re.search(needle, err), err
        assert not (out / "tokens.safetensors").exists()
    assert main(argv + ["--kv-latent", "32"]) == 0
    report = json.loads((out / "retrofit.json").read_text())
    assert report["cache_ratio"] == 0.25 and report["converted_layers"] == [0, 1]
    assert report["ppl_uptrained"] < report["ppl_fit"] and 0 < report["layers"][0]["r2"] <= 1
    model, cfg, _ = load_model(out)
    assert cfg.kv_latent == 32 and cfg.spec.name == "Q-K-V"
    cache = KVCache(cfg, 1, 8)
    model(torch.tensor([[1, 2, 3]]), cache=cache)
    assert {tuple(t.shape) for layer in cache.layers for t in layer.store.values()} == {(1, 1, 8, 32)}
    monkeypatch.setattr(rf, "fit_latent", lambda *a, **k: pytest.fail("fitted again on --resume"))
    assert main(argv + ["--kv-latent", "32", "--resume"]) == 0
