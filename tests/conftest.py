"""Fixtures and scheme lists the test modules share, and the test session's own cache.

The scheme lists are derived from the spec's own table (`qkvlab.model.spec.KNOWN_SCHEMES`), so a scheme
added there is tested by every test that walks them. Import them with `from conftest import ...`.

Hermetic tests: the session runs with its own QKVLAB_CACHE (set before collection, so module fixtures
and `qkvlab` subprocesses inherit it), and every test with its own (`own_cache`), unless a module
fixture shares one folder on purpose (its own, never the user's). Installed data stays where set-up
put it: the GPT-2 vocabulary through QKVLAB_GPT2_VOCAB, the dequantised GGUF copies through a `gguf`
link. `DecisionWatch` watches the user's cache (`qkvlab.base.files.cache_dir` without the variable):
a test session that read, wrote or removed a timed decision there (qkvlab.base.measured) fails, its
lines printed at the end. `FakeClock` and `fake_timer` time options without a real clock or load, for
the tests of the decisions themselves.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import os
import random
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from qkvlab.base.loadavg import LoadWatch
from qkvlab.base.measured import DECISIONS_FILE, MIN_NOISE, OLD_FILES, Timer
from qkvlab.model.spec import KNOWN_SCHEMES, ROLES, format_scheme, parse_scheme

DECISION_FILES = (DECISIONS_FILE, *OLD_FILES)


# ---- the session's cache, and the watch on the user's ---------------------------------------------
def user_cache() -> Path:
    """Where `qkvlab.base.files.cache_dir` resolves without QKVLAB_CACHE (the user's cache)."""
    return Path.home() / ".cache" / "qkvlab"


class DecisionWatch:
    """The timed-decision files of one cache folder: their bytes when the watch starts, and every
    open of one in this process (an audit hook calls `saw`); `problems` says what changed or was opened."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.opened: list[str] = []
        self.reading = False  # the watch's own reads are not a test's
        self.before = self.snapshot()

    def snapshot(self) -> dict[str, str | None]:
        out = {}
        self.reading = True
        try:
            for name in DECISION_FILES:
                path = self.folder / name
                out[name] = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None
        finally:
            self.reading = False
        return out

    def saw(self, path) -> None:
        if self.reading:
            return
        try:
            text = os.fsdecode(os.fspath(path))
        except TypeError:
            return  # a file descriptor
        if os.path.basename(text) in DECISION_FILES and Path(text).resolve().parent == self.folder.resolve():
            self.opened.append(text)

    def problems(self) -> list[str]:
        after = self.snapshot()
        out = [
            f"{self.folder / n}: opened by a test ({len(self.opened)} times)"
            for n in DECISION_FILES
            if any(os.path.basename(p) == n for p in self.opened)
        ]
        for name in DECISION_FILES:
            if after[name] != self.before[name]:
                what = "created" if self.before[name] is None else "removed" if after[name] is None else "changed"
                out.append(f"{self.folder / name}: {what} by a test")
        return out


WATCHES: list[DecisionWatch] = []  # the session's watch first; a test of the watch adds its own for a while
SESSION: dict[str, str | None] = {}  # the session's cache folder, and the variables it replaced


def _audit(event: str, args: tuple) -> None:
    if event == "open" and WATCHES and args:
        for watch in WATCHES:
            watch.saw(args[0])


def link_installed(folder: Path) -> Path:
    """`folder` made, with a `gguf` link to where the dequantised GGUF copies live (the user's cache's
    when set-up made one, else the session's): converting SmolLM2 once a session, not once a test."""
    folder.mkdir(parents=True, exist_ok=True)
    gguf = user_cache() / "gguf"
    target = gguf if gguf.is_dir() else Path(SESSION["folder"]) / "gguf-shared"
    target.mkdir(parents=True, exist_ok=True)
    if not (folder / "gguf").exists():
        (folder / "gguf").symlink_to(target, target_is_directory=True)
    return folder


def pytest_configure(config):
    if SESSION:
        return
    SESSION["QKVLAB_CACHE"] = os.environ.get("QKVLAB_CACHE")
    SESSION["QKVLAB_GPT2_VOCAB"] = os.environ.get("QKVLAB_GPT2_VOCAB")
    vocab = user_cache() / "gpt2.tiktoken"
    if SESSION["QKVLAB_GPT2_VOCAB"] is None and vocab.is_file():
        os.environ["QKVLAB_GPT2_VOCAB"] = str(vocab)
    SESSION["folder"] = tempfile.mkdtemp(prefix="qkvlab-tests-")
    os.environ["QKVLAB_CACHE"] = str(link_installed(Path(SESSION["folder"]) / "cache"))
    SESSION["cache"] = os.environ["QKVLAB_CACHE"]
    WATCHES.insert(0, DecisionWatch(user_cache()))
    sys.addaudithook(_audit)  # for good: a process cannot remove one


def pytest_sessionfinish(session, exitstatus):
    problems = WATCHES[0].problems() if WATCHES else []
    if problems:
        sys.stderr.write("\nThe tests touched the user's timed decisions (tests/conftest.py DecisionWatch):\n")
        sys.stderr.write("".join(f"  {line}\n" for line in problems))
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_unconfigure(config):
    for name in ("QKVLAB_CACHE", "QKVLAB_GPT2_VOCAB"):
        if SESSION.get(name) is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = SESSION[name]
    shutil.rmtree(SESSION.get("folder") or "/nonexistent", ignore_errors=True)


@pytest.fixture(autouse=True)
def own_cache(tmp_path_factory, monkeypatch):
    """This test's own QKVLAB_CACHE (subprocesses inherit it), or the folder a module fixture set for
    the module's tests (never the user's: the session's default is replaced, a module's kept)."""
    current = os.environ.get("QKVLAB_CACHE")
    if current is not None and current != SESSION.get("cache"):
        yield Path(current)
        return
    folder = link_installed(tmp_path_factory.mktemp("qkvlab-cache"))
    monkeypatch.setenv("QKVLAB_CACHE", str(folder))
    yield folder


# ---- fake timings, for the tests of timed decisions ----------------------------------------------
class FakeClock:
    """A clock that moves only when a fake option runs: `way(*seconds)` is an option whose calls take
    these seconds in turn (cycling); `ways(name=seconds, ...)` makes several."""

    def __init__(self):
        self.now = 0.0
        self.calls: dict[str, int] = {}

    def __call__(self) -> float:
        return self.now

    def way(self, *seconds: float, name: str = "") -> callable:
        durations = itertools.cycle(seconds)

        def call() -> None:
            self.now += next(durations)
            self.calls[name] = self.calls.get(name, 0) + 1

        return call

    def ways(self, **seconds) -> dict:
        return {o: self.way(*(s if isinstance(s, tuple) else (s,)), name=o) for o, s in seconds.items()}


class FakeWatch(LoadWatch):
    """A LoadWatch whose figures are given: the real verdict on them (qkvlab.base.loadavg)."""

    def finish(self) -> FakeWatch:
        return self


def fake_timer(clock: FakeClock, load: float = 0.0, others: float = 0.0, cores: int = 2, **rounds) -> Timer:
    """A Timer on `clock`, its load watch reading `load` before and `others` cores of other processes."""
    watch = lambda: FakeWatch(cores=cores, load_start=(load, load, load), others_cores=others, steal=0.0)  # noqa: E731
    return Timer(clock=clock, watch=watch, **rounds)


def _canonical(name: str) -> str:
    return parse_scheme(name).name


def _with_plus(name: str) -> str:
    return format_scheme(dataclasses.replace(parse_scheme(name), plus=True))


# The named schemes without the "+" term, and the identity in each role (Q-K-Id is not named).
BASE_SCHEMES = list(
    dict.fromkeys(
        [_canonical(s) for s in KNOWN_SCHEMES if not parse_scheme(s).plus]
        + [_canonical("-".join("Id" if r == role else r.upper() for r in ROLES)) for role in ROLES]
    )
)
PLUS_SCHEMES = [_with_plus(s) for s in BASE_SCHEMES]  # every base scheme with the 2D score term
SCHEMES = BASE_SCHEMES + PLUS_SCHEMES  # every scheme a one-scheme model can have (kv heads apart)
assert set(map(_canonical, KNOWN_SCHEMES)) <= set(SCHEMES)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny tensors: a second OpenMP thread gains nothing and, on a shared machine, only
    spin-waits for a busy core (it made some files 8x slower)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def dtype_probe_fixed(monkeypatch):
    """`--dtype auto` on the CPU times a training step, or for generate and serve a decode step
    (qkvlab.decode.dtype_probe); in-process tests get a fixed answer instead (fp32), so what a test
    trains or decodes in does not depend on this machine's speed or load. Tests that assert a dtype
    or a byte count pin the dtype (`--dtype fp32`), module fixtures and `qkvlab` processes included.
    A real model's decode layout (qkvlab.decode.layout.choose_layout) is timed as on a user's machine,
    its decision kept in the test's own cache. tests/test_dtype_probe.py overrides this."""
    from qkvlab.decode import dtype_probe

    def fixed(model_cfg, rows, **_):
        shape = dtype_probe.ShapeClass.of(model_cfg, rows).key
        return dtype_probe.Decision("fp32", 1.0, 1.0, MIN_NOISE, shape, "tests", "fixed by the tests")

    def fixed_decode(model_cfg, batches=(1,), **_):
        shape = dtype_probe.DecodeShape.of(model_cfg, max(batches)).key
        return dtype_probe.Decision("fp32", 1.0, 1.0, MIN_NOISE, shape, "tests", "fixed by the tests", step="decode")

    monkeypatch.setattr(dtype_probe, "cpu_autocast", fixed)
    monkeypatch.setattr(dtype_probe, "cpu_decode_dtype", fixed_decode)


@pytest.fixture()
def tiny_llama_config():
    """A factory of 32-wide Llama-shaped configs (RoPE, RMSNorm, SwiGLU, 4 query / 2 kv heads) with
    SmolLM2's vocabulary, so that its GGUF lends the tokenizer: what the GGUF export and llama.cpp
    tests write out; keyword arguments override."""
    from qkvlab.model.config import ModelConfig

    def make(**overrides):
        shape = dict(n_head=4, kv_heads=2, d_model=32, vocab_size=49152, context=64, pos="rope", rope_theta=100000.0)
        shape |= dict(norm="rmsnorm", mlp="swiglu", tie_embeddings=True)
        return ModelConfig(**(shape | overrides)).validate()

    return make


@pytest.fixture()
def decode_probe_bf16(monkeypatch):
    """The decode-step probe answers bf16 at 2.00x (as on a machine where it pays); the fixture's value
    lists the batches each call asked about."""
    from qkvlab.decode import dtype_probe

    calls = []

    def probe(model_cfg, batches=(1,), **_):
        calls.append(tuple(batches))
        shape = dtype_probe.DecodeShape.of(model_cfg, max(batches)).key
        return dtype_probe.Decision("bf16", 2.0, 1.0, MIN_NOISE, shape, "tests", "cached", step="decode")

    monkeypatch.setattr(dtype_probe, "cpu_decode_dtype", probe)
    return calls


@pytest.fixture()
def isolated_cache(tmp_path, monkeypatch):
    """This test's own qkvlab cache (QKVLAB_CACHE): nothing leaks into ~/.cache or between tests."""
    monkeypatch.setenv("QKVLAB_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture()
def corpus(tmp_path, isolated_cache):
    """A small text file of random words (about 30 kB) with the test's own cache."""
    rng = random.Random(0)
    words = ["to", "be", "or", "not", "that", "is", "the", "question", "whether", "tis", "nobler"]
    path = tmp_path / "corpus.txt"
    path.write_text("\n".join(" ".join(rng.choice(words) for _ in range(12)) for _ in range(600)))
    return path


@pytest.fixture(scope="module")
def plays_file(tmp_path_factory, one_thread):
    """A 200 kB slice of the plays as a text file, and a cache folder shared by the module's runs
    (in-process and subprocesses: QKVLAB_CACHE) so the corpus is tokenized once; one torch thread,
    like the subprocesses (OMP_NUM_THREADS=1)."""
    from qkvlab.data.text import load_shakespeare

    root = tmp_path_factory.mktemp("corpus")
    (root / "plays.txt").write_text("".join(d.text for d in load_shakespeare()[:3])[:200_000])
    old = os.environ.get("QKVLAB_CACHE")
    os.environ["QKVLAB_CACHE"] = str(root / "cache")
    yield root / "plays.txt"
    if old is None:
        os.environ.pop("QKVLAB_CACHE", None)
    else:
        os.environ["QKVLAB_CACHE"] = old
