"""A user's work is never lost (issue 12): refusals leave disk unchanged, resume is exact or refuses,
one run per folder, last good means good, strict JSON, bounds before allocation, one-line errors.
Data-loss cases run as real subprocesses of the CLI."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from qkvlab.base.errors import UserError
from qkvlab.base.folders import check_model_target, claim_folder, inspect
from qkvlab.model.config import preset
from qkvlab.model.folder import load_model, read_metrics, save_model
from qkvlab.model.transformer import GPT
from qkvlab.train import checkpoint as ck
from qkvlab.train.config import TrainConfig
from qkvlab.train.loop import TIMING_FIELDS, TrainingDiverged, train

TINY = ["--preset", "tiny", "--tokenizer", "char", "--block-size", "32", "--batch-size", "8", "--eval-batches", "2"]


def cli(*args, env=None, wait=True, **kw):
    """`python -m qkvlab.cli ARGS` as a real process (OMP_NUM_THREADS=1)."""
    cmd = [sys.executable, "-m", "qkvlab.cli", *map(str, args)]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    if not wait:
        return subprocess.Popen(cmd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return subprocess.run(cmd, env=full_env, capture_output=True, text=True, **kw)


def one_line_exit_2(proc, *needles):
    err = proc.stderr.strip()
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    for n in needles:
        assert n in err, (n, err)
    return err


def snapshot(root: Path) -> dict[str, str]:
    """Every path under root (hidden ones too) -> sha256 of its bytes (or 'dir')."""
    out = {}
    for p in sorted(root.rglob("*")):
        out[str(p.relative_to(root))] = "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def tiny_cfg(plays_file, **over):
    base = dict(
        task_options={"data": str(plays_file), "tokenizer": "char", "block_size": 32},
        batch_size=8,
        eval_batches=2,
        max_steps=6,
        eval_every=3,
    )
    return TrainConfig.from_dict({"preset": "tiny", **base, **over})


@pytest.fixture(scope="module")
def finished_run(plays_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("runs") / "run"
    train(tiny_cfg(plays_file), out, progress=False)
    return out


@pytest.fixture(scope="module")
def short_run(plays_file, tmp_path_factory):
    """A run stopped at step 3 of 6 (max_steps=3, resumed with --max-steps 6)."""
    out = tmp_path_factory.mktemp("runs") / "short"
    train(tiny_cfg(plays_file, max_steps=3), out, progress=False)
    return out


# ---------------------------------------------------------------- 1-3: a run folder is the user's


def test_inspect_names_what_is_there(tmp_path, finished_run):
    (tmp_path / "f").write_text("x")
    (tmp_path / "empty").mkdir()
    save_model(tmp_path / "m", GPT(preset("tiny")), preset("tiny"))
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    kinds = {n: inspect(tmp_path / n).kind for n in ("f", "empty", "m", "other", "missing", "f/sub")}
    assert kinds == {
        "f": "file",
        "empty": "empty",
        "m": "model",
        "other": "other",
        "missing": "missing",
        "f/sub": "unusable",
    }
    assert inspect(finished_run).kind == "run" and "step 6" in inspect(finished_run).what


@pytest.mark.parametrize("target", ["f", "run", "other", "f/sub"])
def test_model_writers_refuse_what_is_not_a_model_folder(tmp_path, finished_run, target):
    (tmp_path / "f").write_text("x")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    path = finished_run if target == "run" else tmp_path / target
    before = snapshot(path.parent)
    with pytest.raises(UserError) as e:
        check_model_target(path, overwrite=True)
    assert "\n" not in str(e.value) and snapshot(path.parent) == before


def test_model_writers_replace_a_model_only_with_overwrite(tmp_path):
    save_model(tmp_path / "m", GPT(preset("tiny")), preset("tiny"))
    with pytest.raises(UserError, match="--overwrite"):
        check_model_target(tmp_path / "m", overwrite=False)
    check_model_target(tmp_path / "m", overwrite=True)
    for bad in ("", ".", "a/.."):
        with pytest.raises(UserError, match="names no new folder"):
            check_model_target(bad, overwrite=True)
    check_model_target(tmp_path / "new" / "deeper", overwrite=False)
    assert not (tmp_path / "new").exists()


def test_train_refuses_a_model_folder_a_file_and_another_run(plays_file, tmp_path, finished_run):
    """Items 2-3 as real processes: nothing on disk changes."""
    save_model(tmp_path / "m", GPT(preset("tiny")), preset("tiny"))
    (tmp_path / "f").write_text("precious")
    before = snapshot(tmp_path), snapshot(finished_run)
    for out, extra, needle in [
        (tmp_path / "m", [], "holds a model"),
        (tmp_path / "m", ["--resume"], "holds a model"),
        (tmp_path / "f", [], "holds a file"),
        (tmp_path / "f" / "sub", [], "which is a file"),
        (finished_run, [], "--resume"),
    ]:
        one_line_exit_2(cli("train", *TINY, "--data", plays_file, "--max-steps", 6, "--out", out, *extra), needle)
    assert (snapshot(tmp_path), snapshot(finished_run)) == before


def test_a_refused_run_leaves_no_empty_folder(plays_file, tmp_path):
    with pytest.raises(UserError):
        train(tiny_cfg(tmp_path / "no-such-corpus.txt"), tmp_path / "new", progress=False)
    assert not (tmp_path / "new").exists()
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError):
        train(tiny_cfg(tmp_path / "no-such-corpus.txt"), tmp_path / "empty", progress=False)
    assert list((tmp_path / "empty").iterdir()) == []


def test_empty_out_is_refused():
    with pytest.raises(UserError, match="names no folder"):
        claim_folder("", accept=(), advice={})


# ---------------------------------------------------------------- 4-5: resume is exact or refuses


def _damage(run: Path, what: str) -> None:
    c = run / "checkpoint"
    if what == "state-truncated":
        (c / "state.json").write_bytes((c / "state.json").read_bytes()[:100])
    elif what == "weights-truncated":
        (c / "model.safetensors").write_bytes((c / "model.safetensors").read_bytes()[:1000])
    elif what == "weights-missing":
        (c / "model.safetensors").unlink()
    elif what == "weights-bitflip":
        data = bytearray((c / "model.safetensors").read_bytes())
        data[-10] ^= 1
        (c / "model.safetensors").write_bytes(bytes(data))
    elif what == "optimizer-not-safetensors":
        (c / "optimizer.safetensors").write_bytes(b"\x80\x04K\x01.")  # a pickle
    elif what == "header-garbage":
        (c / "model.safetensors").write_bytes(b"\xff" * 8 + (c / "model.safetensors").read_bytes()[8:])


@pytest.mark.parametrize(
    "what, file",
    [
        ("state-truncated", "state.json"),
        ("weights-truncated", "model.safetensors"),
        ("weights-missing", "model.safetensors"),
        ("weights-bitflip", "model.safetensors"),
        ("optimizer-not-safetensors", "optimizer.safetensors"),
        ("header-garbage", "model.safetensors"),
    ],
)
def test_a_damaged_checkpoint_is_refused_naming_the_file(plays_file, tmp_path, what, file, short_run):
    out = tmp_path / "run"
    shutil.copytree(short_run, out)
    _damage(out, what)
    before = snapshot(out)
    err = one_line_exit_2(cli("train", "--out", out, "--resume", "--max-steps", 6, "--quiet"), file)
    assert str(out / "checkpoint") in err
    assert snapshot(out) == before  # not restarted over it


@pytest.mark.parametrize(
    "file, change, words",
    [
        ("config.json", lambda b: b["model"].update(d_model="wide"), "model: d_model='wide' must be an integer"),
        ("config.json", lambda b: b.update(model=[]), "key 'model' must be an object, not a list"),
        ("state.json", lambda b: b.update(loss_sum="x"), "key 'loss_sum' must be a number, not a string"),
        ("state.json", lambda b: b.update(rng=[5]), "state.json's rng[0] must be an object, not a whole number"),
        ("state.json", lambda b: b.pop("elapsed_s"), "state.json: missing key 'elapsed_s'"),
    ],
)
def test_a_checkpoint_json_of_wrong_types_is_refused_naming_the_key(tmp_path, capsys, short_run, file, change, words):
    """checkpoint/config.json (what `generate OUT` reads) and state.json (what resuming reads) are
    checked key by key on resume, not ignored or read into a crash at the first step."""
    from qkvlab.cli import main

    out = tmp_path / "run"
    shutil.copytree(short_run, out)
    body = json.loads((out / "checkpoint" / file).read_text())
    change(body)
    (out / "checkpoint" / file).write_text(json.dumps(body))
    before = snapshot(out)
    assert main(["train", "--out", str(out), "--resume", "--max-steps", "6", "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(out / "checkpoint" / file) in err and words in err, err
    assert snapshot(out) == before


def test_checkpoint_of_another_shape_is_refused(plays_file, tmp_path):
    model = GPT(preset("tiny"))
    other = GPT(preset("tiny", d_model=32, n_head=2))
    opt = torch.optim.AdamW(other.parameters())
    other(torch.randint(0, 64, (1, 4)))[0].sum().backward()
    opt.step()
    from qkvlab.train.distributed import full_state

    w, o = full_state(other, opt)
    w.pop("lm_head.weight")
    with pytest.raises(UserError, match="shape"):
        ck.check_against_model(w, o, model, {"lm_head.weight": "tok_emb.weight"}, tmp_path)
    w = {k: v for k, v in full_state(model, torch.optim.AdamW(model.parameters()))[0].items() if k != "lm_head.weight"}
    w["trunk.norm.weight"] = w["trunk.norm.weight"].long()
    with pytest.raises(UserError, match="int64"):
        ck.check_against_model(w, {"state": {}}, model, {"lm_head.weight": "tok_emb.weight"}, tmp_path)


def test_killed_in_the_first_second_resumes_its_own_config(plays_file, tmp_path):
    """Item 5: the run's config is on disk before any step, so `--out RUN --resume` alone trains it."""
    out = tmp_path / "run"
    args = [*TINY, "--data", plays_file, "--max-steps", 5, "--eval-every", 5, "--d-model", 48, "--seed", 3, "--quiet"]
    p = cli("train", *args, "--out", out, wait=False)
    deadline = time.time() + 60
    while not (out / "train_config.json").exists():
        assert p.poll() is None and time.time() < deadline, p.stderr.read() if p.poll() is not None else "timeout"
        time.sleep(0.005)
    p.send_signal(signal.SIGKILL)
    p.wait()
    assert not (out / "checkpoint").exists()
    done = cli("train", "--out", out, "--resume", "--quiet")
    assert done.returncode == 0, done.stderr
    body = json.loads((out / "config.json").read_text())
    assert body["model"]["d_model"] == 48 and body["train"]["config"]["seed"] == 3 and body["train"]["step"] == 5


# ---------------------------------------------------------------- 7: last good means good, strict JSON


def _strict(text: str):
    def refuse(token):
        raise ValueError(f"non-standard JSON token {token}")

    return json.loads(text, parse_constant=refuse)


def test_non_finite_validation_stops_before_a_bad_checkpoint(plays_file, tmp_path, monkeypatch):
    from qkvlab.tasks.lm import LMTask

    real, calls = LMTask.evaluate, []

    def poisoned(self, model, **kw):
        calls.append(1)
        scores = real(self, model, **kw)
        return {**scores, "val_loss": float("nan")} if len(calls) == 3 else scores

    monkeypatch.setattr(LMTask, "evaluate", poisoned)
    out = tmp_path / "nan"
    with pytest.raises(TrainingDiverged) as e:
        train(tiny_cfg(plays_file, max_steps=12, eval_every=3, checkpoint_every=3), out, progress=False)
    msg = str(e.value)
    assert "\n" not in msg and "val_loss is nan at step 6" in msg and "checkpoint" in msg and "(step 3)" in msg
    state = _strict((out / "checkpoint" / "state.json").read_text())
    assert state["step"] == 3
    rows = [_strict(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == 6 and rows[-1]["val_loss"] is None and rows[-1]["nonfinite"] == ["val_loss"]


def test_non_finite_weights_are_never_checkpointed(plays_file, tmp_path, monkeypatch):
    from qkvlab.train import loop

    real = loop.train_step

    def poisoned(run, state, lr):
        loss = real(run, state, lr)
        if state.step == 6:
            with torch.no_grad():
                next(run.raw.parameters())[0, 0] = float("inf")
        return loss

    monkeypatch.setattr(loop, "train_step", poisoned)
    with pytest.raises(
        TrainingDiverged, match=r"not finite after step 6; stopped, last good checkpoint: .* \(step 3\)"
    ):
        train(tiny_cfg(plays_file, max_steps=12, eval_every=100, checkpoint_every=3), tmp_path / "w", progress=False)


def test_non_finite_weights_are_refused_when_loading(tmp_path):
    cfg = preset("tiny")
    model = GPT(cfg)
    with torch.no_grad():
        model.trunk.norm.weight[3] = float("nan")
    save_model(tmp_path / "m", model, cfg)
    with pytest.raises(UserError, match="trunk.norm.weight holds NaN"):
        load_model(tmp_path / "m")


# ---------------------------------------------------------------- 8: one run per folder


def test_two_trainings_on_one_folder_one_is_refused(plays_file, tmp_path):
    """Item 8: while one process trains into OUT (it holds the lock), another one started on OUT is
    refused (with or without --resume, any seed); the first is then killed mid-checkpoint and its
    run resumes: the lock died with it."""
    out = tmp_path / "run"
    args = ["train", *TINY, "--data", plays_file, "--max-steps", 8, "--eval-every", 4, "--quiet", "--out", out]
    first = cli(*args, env={ck.SLOW_HOOK: "600"}, wait=False)  # parks in its first checkpoint write
    deadline = time.time() + 120
    while not any(out.glob(".checkpoint.tmp-*/optimizer.safetensors")):
        assert first.poll() is None and time.time() < deadline, first.stderr.read()
        time.sleep(0.01)
    one_line_exit_2(cli(*args, "--seed", 1), "holds a training run", "--resume")
    one_line_exit_2(cli(*args, "--resume"), "in use by another qkvlab process")
    assert first.poll() is None  # the refusals happened while it was running
    first.send_signal(signal.SIGKILL)
    first.wait()
    done = cli("train", "--out", out, "--resume", "--quiet")
    assert done.returncode == 0, done.stderr
    assert [r["step"] for r in read_metrics(out)] == [0, 4, 8]  # one run's rows, once each
    assert json.loads((out / "train_config.json").read_text())["seed"] == 0


def test_two_trainings_started_at_once_one_is_refused(plays_file, tmp_path):
    out = tmp_path / "run"
    args = ["train", *TINY, "--data", plays_file, "--max-steps", 8, "--eval-every", 4, "--quiet", "--out", out]
    procs = [
        cli(*args, env={ck.SLOW_HOOK: "2"}, wait=False),
        cli(*args, "--seed", 1, env={ck.SLOW_HOOK: "2"}, wait=False),
    ]
    results = sorted((p.wait(timeout=300), p.stderr.read()) for p in procs)
    assert [r[0] for r in results] == [0, 2], results
    assert len(results[1][1].strip().splitlines()) == 1
    assert [r["step"] for r in read_metrics(out)] == [0, 4, 8]


def test_a_refused_racer_never_removes_the_folder_its_rival_works_in(tmp_path, monkeypatch):
    """Both processes saw the folder missing; this one created it, the other locked it first: the
    refusal must leave the folder (and what the holder writes there) alone. And a folder another
    process created between the look and the mkdir is not this process's to remove."""
    from qkvlab.base import folders

    out = tmp_path / "run"

    def rival_holds_it(path, flag):
        (path / "train_config.json").write_text("{}")  # the holder is writing
        raise folders.FolderInUse(f"{flag} {path} is in use by another qkvlab process")

    monkeypatch.setattr(folders, "_lock", rival_holds_it)
    with pytest.raises(folders.FolderInUse):
        folders.claim_folder(out, accept=(), advice={})
    assert (out / "train_config.json").is_file()

    other = tmp_path / "other"
    real_mkdir = type(other).mkdir

    def created_by_another_first(self, *args, **kwargs):
        real_mkdir(self)  # the rival's mkdir lands between this process's look and its own mkdir
        return real_mkdir(self, *args, **kwargs)

    def refuse(path, flag):
        raise UserError(f"{flag} {path}: cannot write there")

    monkeypatch.setattr(type(other), "mkdir", created_by_another_first)
    monkeypatch.setattr(folders, "_lock", refuse)
    with pytest.raises(UserError):
        folders.claim_folder(other, accept=(), advice={})
    assert other.is_dir()  # not created by this process: not removed by its refusal


def test_two_racing_trainings_killed_then_resumed_is_bit_identical(plays_file, tmp_path):
    """Both racers are SIGKILLed (one mid-run); the lock dies with them; one resume finishes the run
    exactly as an uninterrupted one."""
    common = [*TINY, "--data", plays_file, "--max-steps", 12, "--eval-every", 4, "--checkpoint-every", 2, "--quiet"]
    ref = cli("train", *common, "--out", tmp_path / "ref", wait=False)
    out = tmp_path / "run"
    racers = [cli("train", *common, "--out", out, env={ck.SLOW_HOOK: "1"}, wait=False) for _ in range(2)]
    deadline = time.time() + 120
    while (
        not (out / "checkpoint" / "state.json").exists()
        or json.loads((out / "checkpoint" / "state.json").read_text())["step"] < 4
    ):
        assert time.time() < deadline and any(p.poll() is None for p in racers)
        time.sleep(0.01)
    for p in racers:
        if p.poll() is None:
            p.send_signal(signal.SIGKILL)
        p.wait()
    assert sorted(p.returncode for p in racers) in ([-9, 2], [-9, -9], [0, 2])  # 0: the winner beat the kill
    done = cli("train", "--out", out, "--resume", "--quiet")
    assert done.returncode == 0, done.stderr
    assert ref.wait(timeout=300) == 0, ref.stderr.read()
    a, b = load_file(str(tmp_path / "ref" / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    strip = lambda rows: [{k: v for k, v in r.items() if k not in TIMING_FIELDS} for r in rows]  # noqa: E731
    assert strip(read_metrics(tmp_path / "ref")) == strip(read_metrics(out))


# ---------------------------------------------------------------- 9: one line instead of a traceback


def test_bounds_are_checked_before_allocation(plays_file, tmp_path):
    one_line_exit_2(cli("train", *TINY, "--data", plays_file, "--context", 99999999999, "--out", tmp_path / "a"), "GB")
    one_line_exit_2(
        cli("train", *TINY[:6], "--batch-size", 100000000, "--data", plays_file, "--out", tmp_path / "b"),
        "--batch-size",
    )
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_hostile_config_json_is_refused_before_allocation(tmp_path):
    cfg = preset("tiny", pos="rope")
    save_model(tmp_path / "m", GPT(cfg), cfg)
    body = json.loads((tmp_path / "m" / "config.json").read_text())
    body["model"]["context"] = 10**12
    (tmp_path / "m" / "config.json").write_text(json.dumps(body))
    with pytest.raises(UserError, match="GB"):
        load_model(tmp_path / "m")


def test_non_utf8_config_file_is_one_line(plays_file, tmp_path):
    (tmp_path / "c.yaml").write_bytes(b"lr: 0.1\n# \xff\xfe\n")
    one_line_exit_2(cli("train", tmp_path / "c.yaml", "--out", tmp_path / "o"), "not UTF-8")
    assert not (tmp_path / "o").exists()


def test_unwritable_out_is_one_line(plays_file, tmp_path):
    one_line_exit_2(cli("train", *TINY, "--data", plays_file, "--out", "/proc/qkvlab-run"), "/proc/qkvlab-run")


def test_hf_data_without_network_fails_fast(tmp_path):
    pytest.importorskip("datasets")
    from qkvlab.data.text import _hub_reachable

    if _hub_reachable():
        pytest.skip("the Hub is reachable from here")
    t0 = time.time()
    p = cli(
        "train",
        "--preset",
        "tiny",
        "--data",
        "hf:nonexistent/x",
        "--out",
        tmp_path / "o",
        env={"HF_HOME": str(tmp_path)},
    )
    one_line_exit_2(p, "no network")
    assert "Retrying" not in p.stdout + p.stderr and time.time() - t0 < 120  # importing datasets is the slow part
    assert not (tmp_path / "o").exists()


# ---------------------------------------------------------------- 1-2 (and 9, 10) for init, convert, compare, bench


def test_init_and_convert_never_replace_what_is_not_their_model(tmp_path, finished_run):
    """Items 1-2 as real processes: a file, a training run, a folder of other files stay untouched
    (no hidden `.NAME.old-*` either); a model is replaced only with --overwrite."""
    (tmp_path / "F").write_text("x\n")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    save_model(tmp_path / "m", GPT(preset("tiny")), preset("tiny"))
    before, run_before = snapshot(tmp_path), snapshot(finished_run)
    for out, needle in [
        (tmp_path / "F", "holds a file"),
        (finished_run, "holds a training run"),
        (tmp_path / "other", "holds a folder of other files"),
        (tmp_path / "m", "--overwrite"),
        (tmp_path / "F" / "sub", "which is a file"),
    ]:
        one_line_exit_2(cli("init", "--preset", "tiny", "--out", out), needle)
        one_line_exit_2(cli("convert", tmp_path / "m", out, "--to", "Id-K-V"), needle)
    assert (snapshot(tmp_path), snapshot(finished_run)) == (before, run_before)
    done = cli("init", "--preset", "tiny", "--seed", 1, "--out", tmp_path / "m", "--overwrite")
    assert done.returncode == 0, done.stderr
    assert snapshot(tmp_path / "m") != {k[2:]: v for k, v in before.items() if k.startswith("m/")}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["F", "m", "other"]


def test_compare_refuses_a_file_and_a_training_run(tmp_path, finished_run):
    (tmp_path / "F").write_text("x\n")
    before, run_before = snapshot(tmp_path), snapshot(finished_run)
    for out, needle in [(tmp_path / "F", "holds a file"), (finished_run, "training run")]:
        args = ["compare", "--variants", "Q-K-V", "--seeds", 1, "--max-steps", 2, "--no-plots", "--out", out]
        one_line_exit_2(cli(*args, "--preset", "tiny", "--tokenizer", "char"), needle)
    assert (snapshot(tmp_path), snapshot(finished_run)) == (before, run_before)


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["init", "--preset", "tiny", "--out", "."], "names no new folder"),
        (["init", "--preset", "tiny", "--out", ""], "--out: '' is empty"),
        (["init", "--preset", "tiny", "--out", "/proc/qkvlab-model"], "/proc/qkvlab-model"),
        (["init", "--preset", "tiny", "--seed", "-1", "--out", "{tmp}/s"], "--seed: -1 must be >= 0"),
        (["init", "--preset", "tiny", "--context", "99999999999", "--out", "{tmp}/c"], "GB"),
        (["bench", "--preset", "tiny", "--json", "/proc/qkvlab/b.json"], "--json"),
        (["bench", "--preset", "tiny", "--json", "{tmp}"], "is a folder"),
        (["bench", "--preset", "tiny", "--memory-budget", "1e400GB"], "--memory-budget '1e400GB' is not a finite size"),
        (["bench", "--preset", "tiny", "--memory-budget", "nanGB"], "--memory-budget 'nanGB' is not a finite size"),
        (["bench", "--preset", "tiny", "--context", "100000000000", "--no-hf"], "GB"),
    ],
)
def test_bad_paths_and_sizes_are_one_line(tmp_path, capsys, argv, needle):
    from qkvlab.cli import main

    rc = main([a.replace("{tmp}", str(tmp_path)) for a in argv])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and needle in err, err
    assert list(tmp_path.iterdir()) == []  # nothing left behind


def test_bench_refuses_an_unwritable_json_before_measuring(tmp_path, capsys, monkeypatch):
    import qkvlab.bench
    from qkvlab.cli import main

    monkeypatch.setattr(qkvlab.bench, "run", lambda *a, **k: pytest.fail("measured before refusing"))
    for target in ("/proc/qkvlab-bench.json", "/proc/self/qkvlab-bench.json"):  # root passes os.access here
        assert main(["bench", "--preset", "tiny", "--json", target]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and f"--json {target}" in err, err


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--to", "Id-K-V"], "retrofit fits Q-K-V or Q-K=V"),
        (["--to", "Q=K"], "Q=K"),
        (["--layers", "99"], "layer 99 is out of range for n_layer=2"),
        (["--layers=-5:"], "slice '-5:' reaches past the model's 2 layers"),
        (["--kv-heads", "3"], "--kv-heads 3 must divide n_head=4"),
    ],
)
def test_retrofit_refuses_before_loading_the_model(tmp_path, capsys, monkeypatch, flags, needle):
    import qkvlab.retrofit.workflow as rf
    from qkvlab.cli import main

    save_model(tmp_path / "m", GPT(preset("tiny")), preset("tiny"))  # 2 layers, 4 heads
    monkeypatch.setattr(rf, "load_source", lambda *a, **k: pytest.fail("loaded the model before refusing"))
    monkeypatch.setattr(rf, "window_nll", lambda *a, **k: pytest.fail("measured perplexity before refusing"))
    assert main(["retrofit", str(tmp_path / "m"), str(tmp_path / "out"), *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err, err
    assert not (tmp_path / "out").exists()


def test_retrofit_refusals_of_out_advise_only_what_works(tmp_path, capsys, monkeypatch):
    import qkvlab.retrofit.workflow as rf
    from qkvlab.cli import main

    save_model(tmp_path / "m", GPT(preset("tiny")), preset("tiny"))
    monkeypatch.setattr(rf, "load_source", lambda *a, **k: pytest.fail("loaded the model before refusing"))
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    owned = tmp_path / "owned"
    owned.mkdir()
    (owned / rf.TOKENS_FILE).write_bytes(b"")  # what a retrofit writes first
    cases = [
        (mine, [], "holds a folder of other files (notes.txt), not written by qkvlab retrofit; choose another OUT"),
        (mine, ["--resume"], "not written by qkvlab retrofit; choose another OUT (nothing was changed)"),
        (tmp_path / "none", ["--resume"], "does not exist, so there is no retrofit to continue; drop --resume"),
        (owned, [], "holds a retrofit; pass --resume to continue it, or choose another OUT"),
    ]
    for out, flags, words in cases:
        before = snapshot(tmp_path)
        assert main(["retrofit", str(tmp_path / "m"), str(out), "--steps", "0", "--quiet", *flags]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and words in err, err
        assert "pass --resume" not in err or out == owned, err  # never advised where it would be refused
        assert snapshot(tmp_path) == before


TOKENIZER_DAMAGE = {  # what is done to a model folder's tokenizer/ -> the words its one line holds
    "truncated": (lambda t: (t / "bpe.json").write_text((t / "bpe.json").read_text()[:200]), "bpe.json: not a tokenizers"),
    "missing": (lambda t: (t / "bpe.json").unlink(), "bpe.json: no such file"),
    "no meta": (lambda t: (t / "qkvlab_tokenizer.json").unlink(), "missing qkvlab_tokenizer.json"),
    "invalid meta": (lambda t: (t / "qkvlab_tokenizer.json").write_text('{"kind": "bpe",'), "not valid JSON"),
    "meta types": (lambda t: (t / "qkvlab_tokenizer.json").write_text('{"kind": ["bpe"]}'), "key 'kind' must be a string"),
    "escape": (
        lambda t: (t / "qkvlab_tokenizer.json").write_text('{"kind": "bpe", "file": "../../../../etc/passwd"}'),
        "'file' names '../../../../etc/passwd', outside the folder",
    ),
}  # fmt: skip


@pytest.mark.parametrize("damage", sorted(TOKENIZER_DAMAGE))
def test_a_broken_tokenizer_is_one_line_from_every_command_that_reads_it(tmp_path, capsys, damage):
    from qkvlab.cli import main
    from qkvlab.data.tokenizer import BPETokenizer

    text = "the quick brown fox jumps over the lazy dog. " * 60
    (tmp_path / "t.txt").write_text(text)
    tok = BPETokenizer.train([text], 300)
    cfg = preset("tiny", vocab_size=tok.vocab_size)
    save_model(tmp_path / "m", GPT(cfg), cfg)
    tok.save(tmp_path / "m" / "tokenizer")
    mutate, words = TOKENIZER_DAMAGE[damage]
    mutate(tmp_path / "m" / "tokenizer")
    model, t = str(tmp_path / "m"), str(tmp_path / "t.txt")
    commands = [
        ["generate", model, "--prompt", "the fox", "--max-new-tokens", "2", "--dtype", "fp32"],
        ["similarity", model, "--tokens", "16", "--text", t],
        ["convert", model, str(tmp_path / "c"), "--to", "Id-K-V"],
        ["retrofit", model, str(tmp_path / "r"), "--data", t, "--steps", "0", "--quiet"],
    ]
    before = snapshot(tmp_path)
    for argv in commands:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith(f"qkvlab {argv[0]}: error: ") and words in err, err
    assert snapshot(tmp_path) == before  # nothing written, no OUT left behind
    assert main(["info", model]) == 0  # info reads the config alone
    pytest.importorskip("fastapi")
    from qkvlab.serve.server import ServeConfig, load_served

    with pytest.raises(UserError, match=words.replace("(", r"\(")):
        load_served(ServeConfig(model=model, dtype="fp32"))


def test_similarity_says_an_exported_folder_has_no_tokenizer(tmp_path, capsys):
    pytest.importorskip("transformers")
    from qkvlab.cli import main

    save_model(tmp_path / "m", GPT(preset("tiny")), preset("tiny"))
    assert main(["convert", str(tmp_path / "m"), str(tmp_path / "hf"), "--to-hf", "gpt2"]) == 0
    capsys.readouterr()
    assert main(["similarity", str(tmp_path / "hf"), "--json"]) == 0  # weights only, and why
    out = capsys.readouterr()
    assert "has no tokenizer" in out.err and json.loads(out.out)["cka"] is None
    (tmp_path / "t.txt").write_text("some text to read\n")
    assert main(["similarity", str(tmp_path / "hf"), "--text", str(tmp_path / "t.txt")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no tokenizer for --text" in err, err
    assert main(["similarity", str(tmp_path / "hf"), "--tokenizer", "bytes", "--json"]) == 0  # the way through
    assert json.loads(capsys.readouterr().out)["cka"] is not None


def test_generate_similarity_export_refuse_hostile_or_broken_models(tmp_path, capsys):
    from qkvlab.cli import main

    cfg = preset("tiny", pos="rope")
    model = GPT(cfg)
    save_model(tmp_path / "huge", model, cfg)
    body = json.loads((tmp_path / "huge" / "config.json").read_text())
    body["model"]["context"] = 10**12
    (tmp_path / "huge" / "config.json").write_text(json.dumps(body))
    with torch.no_grad():
        model.tok_emb.weight[0, 0] = float("nan")
    save_model(tmp_path / "nan", model, cfg)
    save_model(tmp_path / "cut", GPT(cfg), cfg)
    data = (tmp_path / "cut" / "model.safetensors").read_bytes()
    (tmp_path / "cut" / "model.safetensors").write_bytes(data[: len(data) // 2])
    for folder, needle in [("huge", "GB"), ("nan", "NaN"), ("cut", "safetensors")]:
        for argv in (
            ["generate", str(tmp_path / folder), "--prompt-ids", "1,2", "--max-new-tokens", "2"],
            ["similarity", str(tmp_path / folder)],
            ["convert", str(tmp_path / folder), str(tmp_path / "x"), "--to", "Id-K-V"],
        ):
            rc = main(argv)
            err = capsys.readouterr().err.strip()
            assert rc == 2 and len(err.splitlines()) == 1 and needle in err, (argv, err)
    assert not (tmp_path / "x").exists()


def test_bench_json_is_checked_before_measuring_and_replaces_only_bench_output(tmp_path):
    from qkvlab.base.folders import check_file_target

    (tmp_path / "notes.json").write_text('{"mine": 1}')
    (tmp_path / "old.json").write_text('{"schemes": {}}')
    same = lambda p: "schemes" in json.loads(p.read_text())  # noqa: E731
    with pytest.raises(UserError, match="not an earlier output"):
        check_file_target(tmp_path / "notes.json", "--json", same_kind=same)
    check_file_target(tmp_path / "old.json", "--json", same_kind=same)
    check_file_target(tmp_path / "new.json", "--json", same_kind=same)
    with pytest.raises(UserError, match="not an existing folder"):
        check_file_target(tmp_path / "no" / "new.json", "--json")


def test_a_run_folder_has_ordinary_file_modes(finished_run):
    """Item 10: weights, configs, metrics and checkpoint files alike get 0666 minus the umask."""
    mask = os.umask(0)
    os.umask(mask)
    modes = {str(p.relative_to(finished_run)): p.stat().st_mode & 0o777 for p in finished_run.rglob("*") if p.is_file()}
    assert "model.safetensors" in modes and "checkpoint/optimizer.safetensors" in modes
    assert set(modes.values()) == {0o666 & ~mask}, modes
