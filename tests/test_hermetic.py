"""Tests that do not depend on what a machine's cache of timed decisions holds: paths run against a cache
seeded with the opposite of every decision they could look up give what they give against an empty one
(and a pinned dtype never reads it), and the session's watch on the user's own cache (tests/conftest.py
DecisionWatch) sees a test that reads, writes or removes a decision there, failing the session."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import conftest
from conftest import DecisionWatch
from qkvlab.base.measured import DECISIONS_FILE, Measured, machine_key, versions
from qkvlab.base.settings import resolve
from qkvlab.cli import main
from qkvlab.decode import layout as layout_module
from qkvlab.decode.choices import decode_choices
from qkvlab.decode.dtype_probe import DecodeShape, ShapeClass
from qkvlab.decode.generate import generate
from qkvlab.decode.layout import LAYOUT_MAX_BATCH, default_layout, layout_probe, linear_shapes
from qkvlab.decode.sampling import Sampling
from qkvlab.model.config import ModelConfig
from qkvlab.model.folder import save_model
from qkvlab.model.transformer import GPT

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ["train", "--preset", "tiny", "--tokenizer", "char", "--block-size", "32", "--batch-size", "8",
         "--eval-batches", "2", "--eval-every", "2", "--max-steps", "2", "--dtype", "fp32"]  # fmt: skip


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def tiny(dtype=torch.float32) -> GPT:
    cfg = ModelConfig(attn="Q-K=V", pos="rope", n_layer=2, n_head=4, d_model=32, vocab_size=300, context=40)
    torch.manual_seed(0)
    model = GPT(cfg.validate()).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.3)
    return model.to(dtype)


def flipped(key: str, default: str, choice: str) -> dict:
    """A cache entry that looks trustworthy (current versions, a quiet machine, settled rounds) and
    says `choice` beat `default` by half."""
    ms = {default: 2.0, choice: 1.0}
    load = {"load_before": 0.0, "others_cores": 0.0, "cores": 2}
    return Measured(key, choice, default, 0.03, ms, 5, True, "2026-01-01 00:00:00 UTC", load, **versions()).entry()


def opposite_cache(folder: Path, model_cfg, shapes, train_cfgs, monkeypatch) -> Path:
    """`folder` holding the opposite of every decision these paths could look up: bf16 for every
    training shape and decode batch (fp32 the default), a layout other than the default for every
    row count, dtype and thread split (the layout keys as if the model were large); the old file too."""
    entries = {}
    for cfg, rows in train_cfgs:
        entries[ShapeClass.of(cfg, rows).key] = flipped(ShapeClass.of(cfg, rows).key, "fp32", "bf16")
    for b in range(1, LAYOUT_MAX_BATCH + 1):
        key = DecodeShape.of(model_cfg, b).key
        entries[key] = flipped(key, "fp32", "bf16")
    with monkeypatch.context() as m:
        m.setattr(layout_module, "LAYOUT_PROBE_MIN_BYTES", 0)
        for dtype in ("fp32", "fp64"):
            for rows in range(1, LAYOUT_MAX_BATCH + 1):
                for parts in {1, 2, torch.get_num_threads()}:
                    key, _ = layout_probe(shapes, dtype, rows, parts)
                    default = default_layout(rows)
                    entries[key] = flipped(key, default, "stored" if default == "rows" else "kmajor")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / DECISIONS_FILE).write_text(json.dumps({machine_key(): entries}))
    (folder / "dtype_probe.json").write_text(json.dumps({machine_key(): {k: {"choice": "bf16"} for k in entries}}))
    return folder


def digest(folder: Path) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


@pytest.fixture()
def seeded(tmp_path, monkeypatch):
    """A tiny fp32 model folder, a corpus, and a cache seeded with the opposite of every decision."""
    model = tiny()
    save_model(tmp_path / "model", model, model.cfg)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(f"to be or not to be, line {i} of the question" for i in range(400)))
    tiny_train = resolve(ModelConfig, {"preset": "tiny"}, {"context": 32})  # what TRAIN trains
    trains = [(tiny_train, 8 * 32), (tiny_train, 4 * 32)]
    cache = opposite_cache(tmp_path / "opposite", model.cfg, linear_shapes(model), trains, monkeypatch)
    return tmp_path, model, corpus, cache


def run_cli(argv: list[str], cache: Path, monkeypatch, capsys) -> str:
    monkeypatch.setenv("QKVLAB_CACHE", str(cache))
    assert main(argv) == 0
    return capsys.readouterr().out


def test_pinned_generate_and_train_never_read_the_decisions_and_give_what_an_empty_cache_gives(
    seeded, monkeypatch, capsys
):
    root, model, corpus, cache = seeded
    before = digest(cache)
    watch = DecisionWatch(cache)
    conftest.WATCHES.append(watch)
    try:
        gen = ["generate", str(root / "model"), "--prompt-ids", "5,6,7", "--prompt-ids", "9", "--temperature", "0"]
        gen += ["--max-new-tokens", "8", "--dtype", "fp32", "--device", "cpu"]
        against = run_cli(gen, cache, monkeypatch, capsys)
        train = [*TRAIN, "--data", str(corpus), "--device", "cpu"]
        run_cli([*train, "--out", str(root / "run-opposite")], cache, monkeypatch, capsys)
    finally:
        conftest.WATCHES.remove(watch)
    assert watch.problems() == [] and digest(cache) == before
    empty = root / "empty"
    assert run_cli(gen, empty, monkeypatch, capsys) == against
    run_cli([*train, "--out", str(root / "run-empty")], empty, monkeypatch, capsys)
    a, b = (json.loads((root / r / "test.json").read_text()) for r in ("run-opposite", "run-empty"))
    assert a == b  # the same losses to the last digit: nothing the cache held changed the run
    assert (root / "run-opposite" / "model.safetensors").read_bytes() == (
        root / "run-empty" / "model.safetensors"
    ).read_bytes()


def test_a_flipped_layout_decision_changes_no_token(seeded, monkeypatch):
    """A large model's layout is read from the cache (here the opposite of the default, or re-measured
    when this machine's own check contradicts it): whichever decodes, the tokens are the model's."""
    root, _, _, cache = seeded
    monkeypatch.setattr(layout_module, "LAYOUT_PROBE_MIN_BYTES", 0)
    model = tiny(torch.float64)
    prompts = [[5, 6, 7], [9]]
    stored = decode_choices(model.cfg, dtype="fp64", layout="stored", batch=2)
    want = generate(model, prompts, 8, Sampling(temperature=0.0), choices=stored)
    choices = decode_choices(model.cfg, dtype="fp64", batch=2, cache=cache / DECISIONS_FILE)
    assert choices.layout_decision is not None and choices.layout_decision.key.startswith("layout-float64-cpu-r2-")
    assert choices.layout == "stored" or "measured again" in choices.layout_decision.source
    assert generate(model, prompts, 8, Sampling(temperature=0.0), choices=choices) == want


@pytest.mark.skipif(
    not all(importlib.util.find_spec(m) for m in ("fastapi", "uvicorn", "httpx")),
    reason="serve needs fastapi, uvicorn, httpx",
)
def test_a_pinned_server_against_the_opposite_cache_serves_fp32_and_the_models_tokens(seeded):
    """`qkvlab serve --dtype fp32` with QKVLAB_CACHE at the opposite cache: fp32's cache bytes, the
    tokens generate gives, and the cache as it was."""
    import httpx

    root, model, _, cache = seeded
    before = digest(cache)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "QKVLAB_CACHE": str(cache)}
    cmd = [sys.executable, "-m", "qkvlab", "serve", str(root / "model"), "--port", "0", "--cache-memory", "40KB"]
    proc = subprocess.Popen([*cmd, "--dtype", "fp32", "--tokenizer", "bytes"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        line = proc.stdout.readline()
        url = re.search(r"http://127\.0\.0\.1:\d+", line)
        assert url, line + proc.stderr.read() if proc.poll() is not None else line
        with httpx.Client(base_url=url.group(0), timeout=60.0) as client:
            assert client.get("/health").json()["cache_bytes_per_token"] == 2 * 32 * 4  # Q-K=V, fp32
            body = {"prompt": [5, 6, 7], "max_tokens": 8, "temperature": 0}
            got = client.post("/v1/completions", json=body).json()["choices"][0]["token_ids"]
        assert got == generate(model, [[5, 6, 7]], 8, Sampling(temperature=0.0), vocab_limit=256)[0]
    finally:
        proc.terminate()
        proc.wait(60)
    assert digest(cache) == before


# ---- the session's watch on the user's cache ---------------------------------------------------
def test_the_watch_sees_a_read_a_write_a_creation_and_a_removal_of_a_decision(tmp_path):
    home = tmp_path / "home-cache"
    home.mkdir()
    (home / DECISIONS_FILE).write_text("{}")
    (home / "gpt2.tiktoken").write_text("installed data")
    watch = DecisionWatch(home)
    conftest.WATCHES.append(watch)
    try:
        (home / "gpt2.tiktoken").read_text()  # installed data: read freely
        (tmp_path / DECISIONS_FILE).write_text("{}")  # another folder's decisions: not the watched ones
        assert watch.problems() == []
        (home / DECISIONS_FILE).read_text()
        assert watch.problems() == [f"{home / DECISIONS_FILE}: opened by a test (1 times)"]
        watch.opened.clear()
        conftest.WATCHES.remove(watch)  # the writes below are seen by their bytes alone
        (home / DECISIONS_FILE).write_text('{"x": 1}')
        (home / "dtype_probe.json").write_text("{}")
        assert watch.problems() == [
            f"{home / DECISIONS_FILE}: changed by a test",
            f"{home / 'dtype_probe.json'}: created by a test",
        ]
        (home / DECISIONS_FILE).unlink()
        assert f"{home / DECISIONS_FILE}: removed by a test" in watch.problems()
    finally:
        if watch in conftest.WATCHES:
            conftest.WATCHES.remove(watch)


def inner_session(tmp_path: Path, body: str) -> subprocess.CompletedProcess:
    """A pytest session with this conftest, HOME in tmp_path (whose qkvlab cache holds a decision),
    running one test of `body`."""
    inner, user = tmp_path / "inner", tmp_path / "home" / ".cache" / "qkvlab"
    shutil.rmtree(inner, ignore_errors=True)
    shutil.rmtree(user, ignore_errors=True)
    inner.mkdir()
    user.mkdir(parents=True)
    (user / DECISIONS_FILE).write_text("{}")
    shutil.copy(ROOT / "tests" / "conftest.py", inner / "conftest.py")
    (inner / "test_inner.py").write_text(f"import os\nfrom pathlib import Path\n\n\ndef test_inner():\n{body}")
    env = {k: v for k, v in os.environ.items() if k not in ("QKVLAB_CACHE", "QKVLAB_GPT2_VOCAB")}
    env |= {"HOME": str(tmp_path / "home"), "OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_inner.py"]
    return subprocess.run(cmd, cwd=inner, env=env, capture_output=True, text=True, timeout=300)


def test_a_session_that_touches_the_users_decisions_fails_and_says_which(tmp_path):
    """Two inner sessions (their HOME in tmp_path: the real one is never touched): one only reads the
    user's decisions, and its test passes but its session fails, naming the file; one keeps to its own
    cache and passes. (Writes, creations and removals: the watch's test above.)"""
    user = tmp_path / "home" / ".cache" / "qkvlab" / DECISIONS_FILE
    reads = inner_session(
        tmp_path, f'    assert (Path.home() / ".cache/qkvlab/{DECISIONS_FILE}").read_text() == "{{}}"\n'
    )
    assert reads.returncode == 1 and "1 passed" in reads.stdout, reads.stdout + reads.stderr
    assert f"{user}: opened by a test (1 times)" in reads.stderr
    own = inner_session(tmp_path, f'    (Path(os.environ["QKVLAB_CACHE"]) / "{DECISIONS_FILE}").write_text("[]")\n')
    assert own.returncode == 0 and "1 passed" in own.stdout, own.stdout + own.stderr
    assert user.read_text() == "{}"
