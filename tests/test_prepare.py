"""Streaming `prepare`: ids equal whole-document tokenization for every tokenizer and split rule,
resumable after an interruption, row sources, a cheap cache key, ranks that never tokenize, and
the `qkvlab prepare` command."""

from __future__ import annotations

import json

import numpy as np
import pytest

from qkvlab.base.errors import UserError
from qkvlab.cli import main
from qkvlab.data import prepare as prep
from qkvlab.data import sources, token_writer
from qkvlab.data.prepare import load_prepared, prepare
from qkvlab.data.text import load_shakespeare
from qkvlab.data.tokenizer import find_gpt2_vocab


def _gpt2_vocab():
    try:
        return find_gpt2_vocab()
    except UserError:
        return None


GPT2_VOCAB = _gpt2_vocab()  # found before the tests move the cache


@pytest.fixture(autouse=True)
def cache(isolated_cache, monkeypatch):
    if GPT2_VOCAB is not None:
        monkeypatch.setenv("QKVLAB_GPT2_VOCAB", str(GPT2_VOCAB))


@pytest.fixture(scope="module")
def texts():
    plays = load_shakespeare()
    # CRLF and a lone CR (universal newlines), runs of blank lines and spaces before newlines: the
    # places where a careless cut would change the ids
    odd = "Whose line?  \r\nNo one's.\r\rA  \n\n\n   b\n" * 40
    return [plays[0].text[:40_000], odd, "", plays[5].text[:25_000] + "é ü 漢字\n" * 30]


def reference(docs: list[str], tok, val_fraction: float, rule: str) -> tuple[list[int], list[int]]:
    """The pre-streaming algorithm: whole documents encoded, then split."""
    ids = [tok.encode(t.replace("\r\n", "\n").replace("\r", "\n")) for t in docs if t]
    eot = [] if tok.eot_id is None else [tok.eot_id]
    train, val = [], []
    if rule == "document":
        for x in ids:
            cut = len(x) - int(round(len(x) * val_fraction))
            train += x[:cut] + eot if cut else []
            val += x[cut:] + eot if cut < len(x) else []
        return train, val
    total = sum(len(x) for x in ids)
    n_train, seen = total - int(round(total * val_fraction)), 0
    for x in ids:
        cut = min(max(n_train - seen, 0), len(x))
        train += x[:cut] + eot if cut else []
        val += x[cut:] + eot if cut < len(x) else []
        seen += len(x)
    return train, val


def write_docs(root, docs):
    root.mkdir(parents=True, exist_ok=True)
    for i, t in enumerate(docs):
        (root / f"d{i}.txt").write_bytes(t.encode("utf-8"))
    return root


TOKENIZERS = [
    "char",
    "bpe:400",
    pytest.param("gpt2", marks=pytest.mark.skipif(GPT2_VOCAB is None, reason="no r50k")),
]


@pytest.mark.parametrize("rule", ["document", "stream"])
@pytest.mark.parametrize("spec", TOKENIZERS)
def test_streamed_ids_equal_whole_document_tokenization(tmp_path, texts, spec, rule, monkeypatch):
    monkeypatch.setattr(sources, "CHUNK_BYTES", 512)  # many cuts per document
    monkeypatch.setattr(token_writer, "SPILL_TOKENS", 700)  # long documents go through the file and back
    monkeypatch.setattr(prep, "BATCH_CHUNKS", 3)
    src = write_docs(tmp_path / "corpus", texts)
    data = prepare(str(src), spec, tmp_path / "out", val_fraction=0.15, split=rule, threads=1)
    train, val = reference(texts, data.tokenizer(), 0.15, rule)
    assert data.train.tolist() == train and data.val.tolist() == val
    assert data.meta["documents"] == 3 and not (tmp_path / "out" / "progress.json").exists()


def test_interrupted_prepare_resumes_to_the_same_files(tmp_path, texts, monkeypatch):
    monkeypatch.setattr(sources, "CHUNK_BYTES", 512)
    monkeypatch.setattr(token_writer, "SPILL_TOKENS", 700)
    monkeypatch.setattr(prep, "BATCH_CHUNKS", 2)
    monkeypatch.setattr(prep, "CHECKPOINT_SECONDS", 0.0)  # progress.json after every batch
    src = write_docs(tmp_path / "corpus", texts)
    real, calls = prep.encode_batch, {"n": 0}

    def dies_on_the_ninth_batch(tok, batch):
        calls["n"] += 1
        if calls["n"] == 9:
            raise KeyboardInterrupt
        return real(tok, batch)

    monkeypatch.setattr(prep, "encode_batch", dies_on_the_ninth_batch)
    calls["n"] = -1000
    whole = prepare(str(src), "bpe:400", tmp_path / "whole", threads=1)
    batches, calls["n"] = calls["n"] + 1000, 0
    with pytest.raises(KeyboardInterrupt):
        prepare(str(src), "bpe:400", tmp_path / "cut", threads=1)
    progress = json.loads((tmp_path / "cut" / "progress.json").read_text())
    assert progress["bytes_done"] > 0 and not (tmp_path / "cut" / "meta.json").exists()
    with open(tmp_path / "cut" / "train.bin", "ab") as f:
        f.write(b"\x07\x00" * 5)  # written after the last checkpoint: must be dropped
    calls["n"] = 100
    hashed = []
    monkeypatch.setattr(prep, "content_hash", lambda units: hashed.append(1))  # resume trusts the recorded hash
    again = prepare(str(src), "bpe:400", tmp_path / "cut", threads=1)
    assert not hashed and calls["n"] - 100 == batches - 8  # resumed after the 8 done, not restarted
    assert np.array_equal(again.train, whole.train) and np.array_equal(again.val, whole.val)
    assert again.meta["bin_sha256"] == whole.meta["bin_sha256"]


def test_row_sources_jsonl_parquet_and_hf(tmp_path):
    rows = [f"row {i}: " + "to be or not to be " * (i % 5 + 1) for i in range(60)]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(rows)))
    data = prepare(str(tmp_path / "a.jsonl"), "char", tmp_path / "j", split="stream")
    tok = data.tokenizer()
    assert data.meta["documents"] == 60 and tok.decode(data.train.tolist() + data.val.tolist()) == "".join(rows)
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": rows}), tmp_path / "b.parquet", row_group_size=7)
    pdata = prepare(str(tmp_path / "b.parquet"), "char", tmp_path / "p", split="stream")
    assert np.array_equal(pdata.train, data.train) and np.array_equal(pdata.val, data.val)
    pytest.importorskip("datasets")
    hdata = prepare(f"hf:{tmp_path / 'a.jsonl'}", "char", tmp_path / "h", split="stream")
    assert np.array_equal(hdata.train, data.train) and hdata.meta["corpus_sha256"] == data.meta["corpus_sha256"]
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n[1, 2]\n')
    with pytest.raises(UserError, match="bad.jsonl.*'text' field"):
        prepare(str(tmp_path / "bad.jsonl"), "char", tmp_path / "x")


def test_cached_lookup_reads_no_content_and_ranks_never_tokenize(tmp_path, texts, monkeypatch):
    src = write_docs(tmp_path / "corpus", texts)
    with pytest.raises(UserError) as e:
        prepare(str(src), "char", tokenize=False)
    msg = str(e.value)
    assert "\n" not in msg and f"qkvlab prepare --data {src} --tokenizer char" in msg
    first = prepare(str(src), "char")  # into the cache, keyed by paths, sizes and mtimes
    monkeypatch.setattr(prep, "pieces", lambda *a: pytest.fail("the cache lookup read the corpus"))
    monkeypatch.setattr(sources, "pieces", lambda *a: pytest.fail("the cache lookup read the corpus"))
    again = prepare(str(src), "char", tokenize=False)
    assert again.cached and again.out_dir == first.out_dir
    folder = prepare(str(first.out_dir), "gpt2", tokenize=False)  # a prepared folder is used as it is
    assert folder.cached and folder.meta == first.meta
    (src / "d1.txt").write_text("changed\n")
    with pytest.raises(UserError, match="not prepared"):
        prepare(str(src), "char", tokenize=False)


def test_training_ranks_report_the_missing_prepare(tmp_path, monkeypatch):
    from qkvlab.tasks.lm import LMTask

    (tmp_path / "c.txt").write_text("some text\n" * 200)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(UserError, match="qkvlab prepare --data"):
        LMTask(data=str(tmp_path / "c.txt"), tokenizer="char")
    monkeypatch.setenv("WORLD_SIZE", "1")
    prepare(str(tmp_path / "c.txt"), "char")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert LMTask(data=str(tmp_path / "c.txt"), tokenizer="char").prepared.cached


def test_prepare_command(tmp_path, capsys):
    (tmp_path / "c.txt").write_text("The quick brown fox.\n" * 300)
    out = tmp_path / "prepared"
    assert main(["prepare", "--data", str(tmp_path / "c.txt"), "--tokenizer", "char", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert str(out) in printed and "tokens" in printed
    assert load_prepared(out).meta["tokens"]["train"] > 0
    assert main(["prepare", "--data", str(tmp_path / "c.txt"), "--tokenizer", "char", "--out", str(out)]) == 0
    assert "already prepared" in capsys.readouterr().out
    assert main(["prepare", "--data", str(tmp_path / "none.txt"), "--tokenizer", "char"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_a_users_folder_is_refused_and_two_preparers_share_one_result(tmp_path, texts):
    import os
    import subprocess
    import sys

    src = write_docs(tmp_path / "corpus", texts)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    with pytest.raises(UserError, match="not a prepared data folder .it holds .notes.txt"):
        prepare(str(src), "char", mine)
    assert [p.name for p in mine.iterdir()] == ["notes.txt"]
    cmd = [sys.executable, "-m", "qkvlab", "prepare", "--data", str(src), "--tokenizer", "bpe:400", "--quiet"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen([*cmd, "--out", str(tmp_path / "same")], env=env, stdout=subprocess.PIPE) for _ in range(2)
    ]
    outs = [p.communicate(timeout=300)[0].decode() for p in procs]
    assert [p.returncode for p in procs] == [0, 0] and sum("already prepared" in o for o in outs) == 1, outs
    alone = prepare(str(src), "bpe:400", tmp_path / "alone")
    assert load_prepared(tmp_path / "same").meta["bin_sha256"] == alone.meta["bin_sha256"]


def test_a_mail_folder_with_latin1_files_is_refused_by_full_path_or_read_with_replacement(tmp_path, capsys):
    mail = tmp_path / "mail"
    (mail / "inbox").mkdir(parents=True)
    (mail / "1.txt").write_text("Hello Bob,\nall well \ufffd here.\n", encoding="utf-8")  # one U+FFFD of its own
    latin = "Caf\xe9 d\xe9j\xe0 vu,\nna\xefve r\xe9sum\xe9.\n"  # 6 characters that are not ASCII
    (mail / "inbox" / "2.txt").write_bytes(latin.encode("latin-1"))
    (mail / "inbox" / "3.txt").write_text("Lunch at noon?\n" * 20, encoding="utf-8")
    bad = str(mail / "inbox" / "2.txt")
    assert main(["prepare", "--data", str(mail), "--tokenizer", "char", "--out", str(tmp_path / "o"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert f"{bad}: not UTF-8 text (byte 0xe9 at offset 3)" in err and "--encoding-errors replace" in err
    assert len(err.splitlines()) == 1
    data = prepare(str(mail), "char", tmp_path / "r", encoding_errors="replace")
    assert data.meta["encoding_errors"] == "replace" and data.meta["replaced_characters"] == 6
    text = data.tokenizer().decode(np.concatenate([data.train, data.val]).tolist())
    assert text.count("\ufffd") == 7 and "Caf\ufffd d\ufffdj\ufffd vu" in text
    strict_key = prep.prepare_key(str(mail), prep.TokenizerSpec.parse("char"), "document", 0.1)
    assert data.meta["key"] != strict_key  # a replaced corpus is never mistaken for a strict one
    with pytest.raises(UserError, match="encoding_errors='ignore' is not allowed"):
        prepare(str(mail), "char", tmp_path / "x", encoding_errors="ignore")
