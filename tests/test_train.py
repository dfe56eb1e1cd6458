"""Training engine: loop, checkpoints (kill + resume bit-exact), DDP/FSDP on CPU, config validation."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import random
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from qkvlab import cli
from qkvlab.base.config_file import read_config_file
from qkvlab.base.errors import UserError
from qkvlab.base.settings import resolve
from qkvlab.cli import main
from qkvlab.model.folder import load_model, read_metrics
from qkvlab.train import checkpoint as ck
from qkvlab.train.config import TrainConfig
from qkvlab.train.loop import TIMING_FIELDS, TrainingDiverged, train
from qkvlab.train.optim import lr_at, param_groups


def tiny(plays_file, **over) -> TrainConfig:
    base = dict(
        task_options={"data": str(plays_file), "tokenizer": "char", "block_size": 32},
        batch_size=8,
        eval_batches=2,
        log_tensorboard=False,
        dtype="fp32",  # exact comparisons: "auto" is bf16 autocast on CPUs with native bf16
    )
    return TrainConfig.from_dict({"preset": "tiny", **base, **over})


CLI_BASE = [
    "--preset",
    "tiny",
    "--tokenizer",
    "char",
    "--block-size",
    "32",
    "--batch-size",
    "8",
    "--eval-batches",
    "2",
    "--dtype",
    "fp32",  # as tiny(): exact comparisons need fp32 where "auto" would pick bf16
    "--quiet",
]


def _env(**extra) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", **extra}


def _without_timing(rows):
    return [{k: v for k, v in r.items() if k not in TIMING_FIELDS} for r in rows]


# ---------------------------------------------------------------- the loop


def test_tiny_run_learns_writes_metrics_and_a_model_folder(plays_file, tmp_path):
    out = tmp_path / "run"
    res = train(tiny(plays_file, max_steps=40, eval_every=20, warmup_steps=5), out, progress=False)
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [0, 20, 40] and res.history == rows and res.step == 40
    for r in rows:
        assert {"step", "tokens", "train_loss", "val_loss", "val_ppl", "lr", "tokens_per_s"} <= set(r)
        assert r["tokens"] == r["step"] * 8 * 32 and math.isclose(r["val_ppl"], math.exp(r["val_loss"]))
    assert rows[0]["train_loss"] is None and all(r["train_loss"] > 0 for r in rows[1:])
    assert rows[-1]["val_loss"] < rows[0]["val_loss"] - 0.5 and rows[-1]["train_loss"] < rows[1]["train_loss"]
    assert res.tokens == 40 * 256 and res.tokens_per_s > 0 and res.metric == "val_loss"
    # OUT is a model folder whose weights are the last checkpoint's
    model, cfg, body = load_model(out)
    assert body["train"]["finished"] and cfg.vocab_size % 64 == 0
    saved = load_file(str(out / "checkpoint" / "model.safetensors"))
    assert all(torch.equal(model.state_dict()[k], v) for k, v in saved.items())
    # a finished run is not retrained; a fresh run refuses to overwrite it
    again = train(tiny(plays_file, max_steps=40, eval_every=20, warmup_steps=5), out, resume=True, progress=False)
    assert again.history == rows and again.tokens_per_s == pytest.approx(sum(r["tokens_per_s"] for r in rows[1:]) / 2)
    with pytest.raises(UserError, match="--resume"):
        train(tiny(plays_file, max_steps=40, eval_every=20, warmup_steps=5), out, progress=False)
    with pytest.raises(UserError, match="lr="):  # resuming with a changed recipe is refused
        train(tiny(plays_file, max_steps=40, eval_every=20, warmup_steps=5, lr=1e-4), out, resume=True, progress=False)


def test_killed_anywhere_then_resumed_is_bit_identical(plays_file, tmp_path):
    """Real subprocesses, SIGKILL mid-checkpoint-write and mid-step, resumed with --resume."""
    args = [
        sys.executable,
        "-m",
        "qkvlab.cli",
        "train",
        *CLI_BASE,
        "--data",
        str(plays_file),
        "--max-steps",
        "24",
        "--eval-every",
        "8",
        "--checkpoint-every",
        "4",
        "--dropout",
        "0.1",
    ]
    ref = subprocess.Popen([*args, "--out", str(tmp_path / "ref")], env=_env(), stderr=subprocess.PIPE)
    out = tmp_path / "killed"
    ckpt = out / "checkpoint"
    rng = random.Random()
    delays = []

    def run_until(condition, extra_env=None, resume=True):
        p = subprocess.Popen(
            [*args, "--out", str(out), *(["--resume"] if resume else [])],
            env=_env(**(extra_env or {})),
            stderr=subprocess.PIPE,
        )
        deadline = time.time() + 60
        while not condition():
            assert p.poll() is None, p.stderr.read().decode()
            assert time.time() < deadline
            time.sleep(0.01)
        p.send_signal(signal.SIGKILL)
        p.wait()

    def ckpt_step():
        try:
            return json.loads((ckpt / "state.json").read_text())["step"]
        except (OSError, ValueError):
            return 0

    # 1) mid-checkpoint: the second checkpoint's temp folder is half written (sleep hook widens it)
    run_until(
        lambda: ckpt_step() >= 4 and any((p / "optimizer.safetensors").exists() for p in out.glob(".checkpoint.tmp-*")),
        {ck.SLOW_HOOK: "1.5"},
        resume=False,
    )
    assert ckpt_step() == 4 and list(out.glob(".checkpoint.tmp-*"))  # the old checkpoint is intact
    # 2) and 3) mid-step, at random moments after some progress
    for target in (8, 16):
        delays.append(rng.uniform(0.0, 0.4))
        run_until(lambda: ckpt_step() >= target and not time.sleep(delays[-1]))
    # the last resume names only the folder: the run's own train_config.json supplies the rest
    done = subprocess.run(
        [sys.executable, "-m", "qkvlab.cli", "train", "--out", str(out), "--resume", "--quiet"],
        env=_env(),
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    assert ref.wait() == 0, ref.stderr.read().decode()
    a, b = load_file(str(tmp_path / "ref" / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), f"kill delays {delays}"
    oa = load_file(str(tmp_path / "ref" / "checkpoint" / "optimizer.safetensors"))
    ob = load_file(str(ckpt / "optimizer.safetensors"))
    assert all(torch.equal(oa[k], ob[k]) for k in oa)
    ra, rb = read_metrics(tmp_path / "ref"), read_metrics(out)
    assert [r["step"] for r in rb] == [0, 8, 16, 24]
    assert _without_timing(ra) == _without_timing(rb), f"kill delays {delays}"
    assert not list(out.glob(".checkpoint.*"))


def test_checkpoint_parked_between_renames_is_recovered(tmp_path):
    """atomic_dir renames the old folder away, then the new one in: a kill in between leaves
    only `.checkpoint.old-*` (complete) and `.checkpoint.tmp-*` (ignored)."""
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    from qkvlab.model.config import ModelConfig
    from qkvlab.train.distributed import full_state

    w, o = full_state(model, opt)
    ck.save_checkpoint(tmp_path, w, o, ModelConfig(), "gpt", {"step": 7, "metrics": []})
    os.replace(tmp_path / "checkpoint", tmp_path / ".checkpoint.old-123")
    (tmp_path / ".checkpoint.tmp-abc").mkdir()
    (tmp_path / ".checkpoint.tmp-abc" / "model.safetensors").write_bytes(b"partial")
    found = ck.find_checkpoint(tmp_path)
    assert found == tmp_path / "checkpoint" and not list(tmp_path.glob(".checkpoint.*"))
    w2, o2, state = ck.load_checkpoint(found)
    assert state["step"] == 7 and all(torch.equal(w[k], w2[k]) for k in w)
    assert all(torch.equal(o["state"][n][k], o2["state"][n][k]) for n in o["state"] for k in o["state"][n])


def test_ddp_and_fsdp_on_two_cpu_processes_match_one_and_resume_at_world_size_one(plays_file, tmp_path):
    common = [*CLI_BASE, "--data", str(plays_file), "--max-steps", "6", "--eval-every", "3", "--grad-accum", "2"]
    assert (
        cli.main(["prepare", "--data", str(plays_file), "--tokenizer", "char", "--quiet"]) == 0
    )  # ranks never tokenize
    launch = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "qkvlab",  # as the docs write it: torchrun ... -m qkvlab train
        "train",
        *common,
    ]
    procs = {
        s: subprocess.Popen(
            [*launch, "--sharding", s, "--out", str(tmp_path / s)],
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for s in ("ddp", "fsdp")
    }
    one = train(tiny(plays_file, max_steps=6, eval_every=3, grad_accum=2), tmp_path / "one", progress=False)
    for p in procs.values():
        assert p.wait(timeout=120) == 0, p.stdout.read().decode()[-3000:]
    for s in procs:
        rows = read_metrics(tmp_path / s)
        assert [r["step"] for r in rows] == [r["step"] for r in one.history] == [0, 3, 6]
        for r, q in zip(rows, one.history):
            for key in ("train_loss", "val_loss"):
                if q[key] is not None:
                    assert abs(r[key] - q[key]) < 1e-5, (s, key, r[key], q[key])
        final, ref = (
            load_file(str(tmp_path / s / "model.safetensors")),
            load_file(str(tmp_path / "one" / "model.safetensors")),
        )
        assert all(torch.allclose(final[k], ref[k], atol=1e-4) for k in ref)
        # written by 2 ranks, continued by 1 (sharding switched too): full state dicts load anywhere
        more = train(
            tiny(plays_file, max_steps=8, eval_every=3, grad_accum=2), tmp_path / s, resume=True, progress=False
        )
        assert more.step == 8 and [r["step"] for r in more.history] == [0, 3, 6, 8]
        assert json.loads((tmp_path / s / "checkpoint" / "state.json").read_text())["world_size"] == 1


def test_fsdp_resumes_on_two_processes_from_rank_0_and_bf16_mixed_precision_runs(plays_file, tmp_path):
    """FSDP at world size 2: a run stopped at step 3 and resumed (only rank 0 reads the checkpoint's
    tensors, then broadcasts) ends like one process; bf16 (MixedPrecisionPolicy) trains finite."""
    assert cli.main(["prepare", "--data", str(plays_file), "--tokenizer", "char", "--quiet"]) == 0
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "qkvlab"]
    common = [
        *CLI_BASE,
        "--data",
        str(plays_file),
        "--eval-every",
        "3",
        "--sharding",
        "fsdp",
        "--dist-timeout-s",
        "120",
    ]

    def run(*extra):
        done = subprocess.run([*launch, "train", *common, *extra], env=_env(), capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-3000:]

    run("--max-steps", "3", "--out", str(tmp_path / "fsdp"))
    run("--max-steps", "6", "--out", str(tmp_path / "fsdp"), "--resume")
    one = train(tiny(plays_file, max_steps=6, eval_every=3), tmp_path / "one", progress=False)
    rows = read_metrics(tmp_path / "fsdp")
    assert [r["step"] for r in rows] == [0, 3, 6]
    assert all(abs(r["val_loss"] - q["val_loss"]) < 1e-5 for r, q in zip(rows, one.history))
    final, ref = (
        load_file(str(tmp_path / "fsdp" / "model.safetensors")),
        load_file(str(tmp_path / "one" / "model.safetensors")),
    )
    assert all(torch.allclose(final[k], ref[k], atol=1e-4) for k in ref)
    run("--max-steps", "3", "--dtype", "bfloat16", "--out", str(tmp_path / "bf16"))
    assert all(math.isfinite(r["val_loss"]) for r in read_metrics(tmp_path / "bf16"))


# ---------------------------------------------------------------- failures


def test_non_finite_loss_stops_with_the_last_good_checkpoint_intact(plays_file, tmp_path, monkeypatch):
    from qkvlab.tasks.lm import LMTask

    real, calls = LMTask.loss, []

    def poisoned(self, model, x, y):
        loss = real(self, model, x, y)
        if model.training:
            calls.append(1)
            if len(calls) == 8:
                return loss * float("nan")
        return loss

    monkeypatch.setattr(LMTask, "loss", poisoned)
    out = tmp_path / "nan"
    with pytest.raises(TrainingDiverged) as e:
        train(tiny(plays_file, max_steps=20, eval_every=5, checkpoint_every=3), out, progress=False)
    msg = str(e.value)
    assert "\n" not in msg and "nan" in msg and "step 8" in msg and "step 6" in msg
    w, _, state = ck.load_checkpoint(out / "checkpoint")
    assert state["step"] == 6 and all(torch.isfinite(t).all() for t in w.values())
    assert not (out / "model.safetensors").exists() and [r["step"] for r in read_metrics(out)] == [0, 5]


HAS_TENSORBOARD = importlib.util.find_spec("tensorboard") is not None


@pytest.mark.skipif(HAS_TENSORBOARD, reason="tensorboard is installed: the refusal needs it absent")
def test_tensorboard_refused_with_the_extra_to_install_when_missing(plays_file, tmp_path):
    assert TrainConfig().log_tensorboard is False
    with pytest.raises(UserError, match=r"qkvlab\[tb\]"):
        train(tiny(plays_file, log_tensorboard=True), tmp_path / "tb", progress=False)
    assert not (tmp_path / "tb").exists()


@pytest.mark.skipif(not HAS_TENSORBOARD, reason="needs tensorboard (pip install 'qkvlab[tb]'; in the test extra)")
def test_tensorboard_events_hold_the_metrics_rows(plays_file, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "tb"
    train(tiny(plays_file, log_tensorboard=True, max_steps=6, eval_every=3), out, progress=False)
    events = EventAccumulator(str(out / "tb")).Reload()
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [0, 3, 6]
    for key in ("train_loss", "val_loss", "lr"):
        logged = [(e.step, e.value) for e in events.Scalars(key)]
        expected = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
        assert len(expected) >= 2 and [s for s, _ in logged] == [s for s, _ in expected]
        assert [v for _, v in logged] == pytest.approx([v for _, v in expected], rel=1e-6)  # float32 in the file
    assert not any(f.name.startswith("events") for f in out.iterdir())  # events only under OUT/tb


def test_cli_exits_3_when_the_loss_diverges(plays_file, tmp_path, capsys):
    rc = cli.main(
        [
            "train",
            *CLI_BASE,
            "--data",
            str(plays_file),
            "--max-steps",
            "20",
            "--lr",
            "1e6",
            "--warmup-steps",
            "0",
            "--grad-clip",
            "0",
            "--out",
            str(tmp_path / "x"),
        ]
    )
    err = capsys.readouterr().err.strip()
    assert rc == 3 and "\n" not in err and re.search(r"loss is (nan|inf)", err) and "step" in err


@pytest.mark.parametrize(
    "name, text, args, needle",
    [
        ("a.yaml", "lrr: 0.1\n", [], "'lrr'"),
        ("a.yaml", "model:\n  n_layers: 3\n", [], "'n_layers'"),
        ("a.toml", 'dtype = "fp8"\n', [], "dtype='fp8'"),
        ("a.toml", "max_steps = [1\n", [], "cannot parse"),
        ("a.yaml", "model:\n  preset: huge\n", [], "'huge'"),
        (None, None, ["--lr", "-1"], "--lr: -1.0 must be positive"),
        (None, None, ["--batch-size", "10", "--grad-accum", "3"], "batch_size=10"),
        (None, None, ["--betas", "0.9,1.5"], "betas="),
        (None, None, ["--task-option", "colour=red"], "'colour'"),
    ],
)
def test_config_errors_are_one_line_exit_2(tmp_path, capsys, name, text, args, needle, plays_file):
    argv = [
        "train",
        "--out",
        str(tmp_path / "o"),
        "--preset",
        "tiny",
        "--data",
        str(plays_file),
        "--tokenizer",
        "char",
        *args,
    ]
    if name:
        (tmp_path / name).write_text(text)
        argv.insert(1, str(tmp_path / name))
    rc = cli.main(argv)
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and needle in err, err
    assert not (tmp_path / "o" / "checkpoint").exists()


def test_config_files_and_overrides(tmp_path):
    (tmp_path / "r.yaml").write_text(
        "preset: tiny\nlr: 0.002\nmodel:\n  attn: Id-K-V\ntask_options:\n  tokenizer: char\n"
    )
    # preset -> file -> command line, as `qkvlab train r.yaml --weight-decay 0.03125 --kv-heads 1` resolves it
    file = read_config_file(tmp_path / "r.yaml")
    cfg = resolve(TrainConfig, {"preset": "small"}, file, {"weight_decay": 2**-5, "model": {"kv_heads": 1}})
    assert (cfg.lr, cfg.weight_decay, cfg.model.attn, cfg.model.kv_heads, cfg.model.n_layer) == (
        0.002,
        0.03125,
        "Id-K-V",
        1,
        2,
    )
    assert cfg.task_options == {"tokenizer": "char"} and cfg.max_steps == 300
    (tmp_path / "r.toml").write_text('max_steps = 7\nbetas = [0.8, 0.9]\n[model]\npreset = "small"\nattn = "Q-K=V"\n')
    cfg2 = resolve(TrainConfig, {"preset": "tiny"}, read_config_file(tmp_path / "r.toml"))
    assert cfg2.max_steps == 7 and cfg2.betas == (0.8, 0.9) and cfg2.model.d_model == 128 and cfg2.model.attn == "Q-K=V"
    assert TrainConfig.from_dict(cfg2.to_dict()) == cfg2
    a = TrainConfig.from_dict({"preset": "gpt2-124m"})
    assert a.batch_size * a.model.context == 491_520 and a.accum_steps(1) == 40 and a.accum_steps(8) == 5
    b = TrainConfig.from_dict({"preset": "paperB-300m"})
    assert b.batch_size * b.model.context == 2_359_296 and (b.lr, b.final_lr, b.warmup_steps) == (2e-4, 2e-5, 500)
    c = TrainConfig.from_dict({"preset": "paperB-1.2b"})
    assert c.batch_size * c.model.context == 1_179_648 and c.sharding == "fsdp" and c.final_lr == 6e-6


def test_weight_decay_groups_and_schedule():
    from qkvlab.model.config import preset
    from qkvlab.model.transformer import GPT

    model = GPT(preset("tiny", bias=True))
    decay, no_decay = param_groups(model, 0.1)
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() < 2 for p in no_decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))
    assert model.tok_emb.weight in decay["params"] and no_decay["weight_decay"] == 0.0
    lrs = [lr_at(s, lr=1.0, min_lr=0.1, warmup=10, total=100) for s in range(120)]
    assert lrs[0] == pytest.approx(1 / 11) and lrs[9] == pytest.approx(10 / 11) and lrs[10] == 1.0
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:])) and lrs[100] == lrs[119] == 0.1
    assert lrs[55] == pytest.approx(0.55)


def test_direct_full_state_matches_torch_distributed_checkpoint_layout():
    """Single-process/DDP checkpoints skip torch.distributed.checkpoint; FSDP ones use it: same layout."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    from qkvlab.model.config import preset
    from qkvlab.model.transformer import GPT
    from qkvlab.train.distributed import full_state, load_full_state
    from qkvlab.train.optim import make_optimizer

    torch.manual_seed(0)
    model = GPT(preset("tiny", bias=True))
    opt = make_optimizer(model, 1e-3, 0.1, (0.9, 0.95), torch.device("cpu"))
    x = torch.randint(0, 512, (3, 9))
    model(x[:, :-1], x[:, 1:])[1].backward()
    opt.step()
    w, o = full_state(model, opt)
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    w2, o2 = get_model_state_dict(model, options=opts), get_optimizer_state_dict(model, opt, options=opts)
    assert w.keys() == w2.keys() and all(torch.equal(w[k], w2[k]) for k in w)
    assert o["param_groups"] == o2["param_groups"] and o["state"].keys() == o2["state"].keys()
    assert all(torch.equal(o["state"][n][k], o2["state"][n][k]) for n in o["state"] for k in o["state"][n])
    fresh = GPT(preset("tiny", bias=True))
    fresh_opt = make_optimizer(fresh, 1e-3, 0.1, (0.9, 0.95), torch.device("cpu"))
    load_full_state(fresh, fresh_opt, w2, o2)  # DCP's dicts load through the direct route
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))
    assert str(fresh_opt.state_dict()) == str(opt.state_dict())


def test_a_run_records_the_dtype_it_trained_in(plays_file, tmp_path, monkeypatch, capsys):
    """The dtype setting resolved (auto: timed on the CPU, train.dtype_probe) is what the checkpoint,
    the result and test.json record, with the timing that decided auto; a resumed run keeps the
    dtype it started in whatever a new timing would say."""
    from qkvlab.decode import dtype_probe

    def probe(dtype):
        def decided(model_cfg, rows, **_):
            shape = dtype_probe.ShapeClass.of(model_cfg, rows).key
            return dtype_probe.Decision(dtype, 2.0, 1.0 if dtype == "bf16" else 3.0, 0.03, shape, "fake")

        monkeypatch.setattr(dtype_probe, "cpu_autocast", decided)

    for dtype, timed, short, long in (("bf16", "fp32", "bf16", "bfloat16"), ("auto", "fp32", "fp32", "float32"),
                                      ("auto", "bf16", "bf16", "bfloat16")):  # fmt: skip
        probe(timed)
        cfg = tiny(plays_file, max_steps=2, eval_every=2, dtype=dtype)
        out = tmp_path / f"{dtype}-{timed}"
        result = train(cfg, out, progress=False)
        assert result.train_dtype == short
        state = json.loads((out / "checkpoint" / "state.json").read_text())
        assert state["train_dtype"] == short
        assert (state["dtype_probe"] or {}).get("dtype") == (timed if dtype == "auto" else None)
        test = out / "test.json"
        assert json.loads(test.read_text())["dtype"] == long  # the test split was scored in it
    probe("fp32")  # the machine now says fp32: the bf16 run resumed under auto stays bf16
    resumed = train(tiny(plays_file, max_steps=4, eval_every=2, dtype="auto"), out, resume=True)
    assert resumed.train_dtype == "bf16" and "kept from the checkpoint" in capsys.readouterr().out
    assert cli.main(["train", *CLI_BASE[:-3], "--dtype", "bf16", "--max-steps", "2", "--data", str(plays_file),
                     "--out", str(tmp_path / "cli")]) == 0  # fmt: skip
    assert "tokens/s (bf16) ->" in capsys.readouterr().out


def test_resume_with_nothing_to_resume_says_it_starts_anew(plays_file, tmp_path, capsys):
    """`--resume` into a folder with no run (a typo, a first launch of a requeue script) trains from
    step 0, and says so in one line instead of silently."""
    out = tmp_path / "typo"
    argv = ["train", *CLI_BASE[:-3], "--max-steps", "2", "--data", str(plays_file), "--out", str(out), "--resume"]
    assert cli.main(argv) == 0
    assert f"nothing to resume in {out} (no run there yet): starting a new run" in capsys.readouterr().err
    assert cli.main(argv) == 0  # now there is a run: finished, nothing said
    assert "nothing to resume" not in capsys.readouterr().err


def test_a_preset_with_another_task_leaves_its_corpus_options_behind(tmp_path, capsys):
    """README's `qkvlab train --task reverse --preset tiny` failed: the preset's lm options (its
    tokenizer) were handed to the reverse task, which has no such option."""
    assert TrainConfig.from_dict({"preset": "tiny"}).task_options == {"tokenizer": "bpe:512"}
    assert TrainConfig.from_dict({"preset": "tiny", "task": "reverse"}).task_options == {}
    assert TrainConfig.from_dict({"preset": "tiny", "task": "reverse", "task_options": {"length": 8}}).task_options == {
        "length": 8
    }
    argv = ["train", "--out", str(tmp_path / "rev"), "--task", "reverse", "--preset", "tiny", "--attn", "(Q=K=V)+"]
    assert main([*argv, "--max-steps", "2", "--eval-every", "2", "--eval-batches", "1", "--quiet"]) == 0
    assert (tmp_path / "rev" / "model.safetensors").is_file()


def test_a_kill_between_the_last_checkpoint_and_the_test_scores_is_scored_on_resume(tmp_path):
    """A run killed after its last checkpoint but before test.json (compare's Reverse at length 32 lost one
    that way) was republished on resume without test scores, and compare then scored the whole task on
    validation. Resumed, it is scored: the same test.json as the uninterrupted run's."""
    out = tmp_path / "rev"
    argv = ["train", "--out", str(out), "--task", "reverse", "--preset", "tiny", "--task-option", "length=8"]
    argv += ["--max-steps", "3", "--eval-every", "3", "--eval-batches", "1", "--dtype", "fp32", "--quiet"]
    assert main(argv) == 0
    scored = json.loads((out / "test.json").read_text())
    for name in ("test.json", "model.safetensors", "config.json"):  # the kill: only the checkpoint is left
        (out / name).unlink()
    assert main([*argv, "--resume"]) == 0
    assert json.loads((out / "test.json").read_text()) == scored
    assert (out / "model.safetensors").is_file()
