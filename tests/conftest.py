"""Fixtures and scheme lists the test modules share.

The scheme lists are derived from the spec's own table (`qkvlab.model.spec.KNOWN_SCHEMES`), so a scheme
added there is tested by every test that walks them. Import them with `from conftest import ...`.
"""

from __future__ import annotations

import dataclasses
import os
import random

import pytest
import torch

from qkvlab.base.measured import MIN_NOISE
from qkvlab.model.spec import KNOWN_SCHEMES, ROLES, format_scheme, parse_scheme


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


@pytest.fixture(scope="session")
def probe_cache(tmp_path_factory):
    """Where in-process tests keep measured speed decisions (qkvlab.base.measured): never the user's cache."""
    return tmp_path_factory.mktemp("measured") / "probe.json"


@pytest.fixture(autouse=True)
def dtype_probe_fixed(monkeypatch, probe_cache):
    """`--dtype auto` on the CPU times a training step, or for generate and serve a decode step
    (qkvlab.decode.dtype_probe); in-process tests get a fixed answer instead (fp32), so what a test
    trains or decodes in does not depend on this machine's speed or load, and no probe figures land
    in a cache. Tests that start a `qkvlab` process pass `--dtype fp32` themselves.
    A real model's decode layout (generate.layout_by_timing) is timed as on a user's machine, its
    decision kept in the session's own cache. tests/test_dtype_probe.py overrides this."""
    from qkvlab.base import measured
    from qkvlab.decode import dtype_probe

    monkeypatch.setattr(measured, "probe_path", lambda: probe_cache)

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
