"""qkvlab.base.model_files: what a model folder names is read as data (inside the folder, bounded,
parsed and typed), and the readers' own errors (tokenizers, safetensors, gguf) become one line naming
the file. The whole loaders are fuzzed in tests/test_model_folder_fuzz.py."""

from __future__ import annotations

import json
import os

import pytest

from qkvlab.base.errors import UserError
from qkvlab.base.files import read_json as read_user_json
from qkvlab.base.model_files import check_folder, containment_root, json_key, member, read_json


@pytest.fixture()
def folder(tmp_path):
    (tmp_path / "secret.json").write_text('{"secret": 1}')
    m = tmp_path / "m"
    (m / "sub").mkdir(parents=True)
    (m / "config.json").write_text('{"a": 1}')
    return m


@pytest.mark.parametrize(
    "name, words",
    [
        ("../secret.json", "names '../secret.json', outside the folder"),
        ("sub/../../secret.json", "outside the folder"),
        ("sub/../config.json", "outside the folder"),  # no `..` at all, even one that stays inside
        ("/etc/passwd", "names '/etc/passwd', outside the folder"),
        ("", 'must be the name of a file inside the folder, got ""'),
        (3, "must be the name of a file inside the folder, got 3"),
        (None, "got null"),
        ("a\x00b", "must be the name of a file inside the folder"),
    ],
)
def test_a_name_leading_outside_or_not_a_name_is_refused(folder, name, words):
    with pytest.raises(UserError, match="^" + str(folder / "x.json") + "'s 'file' ") as e:
        member(folder, name, "settings", named_by=f"{folder / 'x.json'}'s 'file'")
    assert words in str(e.value) and "\n" not in str(e.value)


def test_links_may_stay_inside_never_lead_out(folder, tmp_path):
    os.symlink(tmp_path / "secret.json", folder / "out.json")
    os.symlink("../../secret.json", folder / "sub" / "rel.json")
    os.symlink(tmp_path, folder / "parent")
    os.symlink("config.json", folder / "in.json")
    for name in ("out.json", "sub/rel.json", "parent/secret.json"):
        with pytest.raises(UserError, match=f"a link to {tmp_path / 'secret.json'}, outside {folder}"):
            member(folder, name, "settings")
    assert member(folder, "in.json", "settings") == folder / "in.json"
    assert read_json(folder, "in.json") == {"a": 1}
    with pytest.raises(UserError, match="a link to .*, outside"):
        check_folder(folder)


def test_a_file_must_be_regular_and_within_its_kinds_bound(folder):
    os.mkfifo(folder / "pipe.json")
    with pytest.raises(UserError, match="pipe.json: not a regular file"):
        member(folder, "pipe.json", "settings")  # never opened: it would block
    with pytest.raises(UserError, match="sub: not a regular file"):
        member(folder, "sub", "settings")
    with pytest.raises(UserError, match=r"config.json: 8 bytes, more than a settings file may hold \(0 MiB\)"):
        member(folder, "config.json", "settings", limit=4)
    with pytest.raises(UserError, match="nope.json: no such file"):
        member(folder, "nope.json", "settings")
    assert member(folder, "nope.json", "settings", missing_ok=True) is None
    assert member(folder, "sub", "folder") == folder / "sub"
    with pytest.raises(UserError, match="not a regular file"):
        check_folder(folder)  # the pipe, among the entries transformers could read


def test_a_hub_cache_snapshot_reads_the_blobs_of_its_own_repository(tmp_path):
    repo = tmp_path / "models--org--name"
    (repo / "blobs").mkdir(parents=True)
    snap = repo / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    (repo / "blobs" / "h1").write_text('{"model_type": "llama"}')
    os.symlink("../../blobs/h1", snap / "config.json")
    (tmp_path / "elsewhere").write_text("{}")
    os.symlink(tmp_path / "elsewhere", snap / "tokenizer.json")
    assert containment_root(snap) == repo.resolve()
    assert read_json(snap, "config.json") == {"model_type": "llama"}
    with pytest.raises(UserError, match="a link to .*elsewhere, outside"):
        member(snap, "tokenizer.json", "vocabulary")


@pytest.mark.parametrize(
    "text, words",
    [
        ("{", "not valid JSON (Expecting property name"),
        ('{"a": NaN}', "not valid JSON (NaN is not a JSON number)"),
        ('{"a": -Infinity}', "not valid JSON (-Infinity is not a JSON number)"),
        ("[" * 100_000 + "]" * 100_000, "not valid JSON (nested too deeply)"),
        ('{"a": ' + "9" * 5000 + "}", "not valid JSON (Exceeds the limit (4300 digits)"),
        ("[1, 2]", "must hold a JSON object, not a list"),
        ("null", "must hold a JSON object, not null"),
    ],
)
def test_json_is_parsed_strictly_and_its_fault_named(folder, text, words):
    (folder / "bad.json").write_text(text)
    with pytest.raises(UserError, match="^" + str(folder / "bad.json")) as e:
        read_json(folder, "bad.json")
    assert words in str(e.value)
    if "object" not in words:  # the user's own JSON files are read as strictly
        with pytest.raises(UserError, match=words.replace("(", r"\(").replace(")", r"\)")):
            read_user_json(folder / "bad.json")


def test_not_utf8_is_named_with_its_byte(folder):
    (folder / "bad.json").write_bytes(b'{"a": "\xff"}')
    with pytest.raises(UserError, match=r"bad.json: not UTF-8 text \(byte 0xff at offset 7\)"):
        read_json(folder, "bad.json")


def test_json_key_names_the_key_and_what_it_must_be():
    body = {"n": 3, "flag": True, "x": 1.5, "s": "a", "none": None}
    assert json_key(body, "n", int, "f.json") == 3
    assert json_key(body, "n", float, "f.json") == 3  # an integer is a number
    assert json_key(body, "gone", str, "f.json", default="d") == "d"
    with pytest.raises(UserError, match="^f.json: missing key 'gone'$"):
        json_key(body, "gone", str, "f.json")
    with pytest.raises(UserError, match=r"^f.json: key 'flag' must be a whole number, not true or false \(true\)$"):
        json_key(body, "flag", int, "f.json")  # bool is not an int here
    with pytest.raises(UserError, match=r"key 's' must be a whole number or null, not a string \(\"a\"\)"):
        json_key(body, "s", (int, type(None)), "f.json")


# ---- the libraries' errors, each one line naming the file ------------------------------------------
def test_a_damaged_tokenizer_vocabulary_is_named(tmp_path):
    from qkvlab.data.tokenizer import BPETokenizer, load_tokenizer

    BPETokenizer.train(["the quick brown fox jumps over the lazy dog. " * 20], 280).save(tmp_path / "tok")
    text = (tmp_path / "tok" / "bpe.json").read_text()
    (tmp_path / "tok" / "bpe.json").write_text(text[: len(text) // 2])
    with pytest.raises(UserError, match=r"tok/bpe.json: not a tokenizers vocabulary \(EOF while parsing"):
        load_tokenizer(tmp_path / "tok")
    (tmp_path / "tok" / "bpe.json").write_text('{"model": {"type": "Nonsense"}}')
    with pytest.raises(UserError, match="tok/bpe.json: not a tokenizers vocabulary"):
        load_tokenizer(tmp_path / "tok")
    meta = json.loads((tmp_path / "tok" / "qkvlab_tokenizer.json").read_text())
    (tmp_path / "tok" / "qkvlab_tokenizer.json").write_text(json.dumps({**meta, "file": "../../etc/passwd"}))
    with pytest.raises(UserError, match="qkvlab_tokenizer.json's 'file' names '../../etc/passwd', outside the folder"):
        load_tokenizer(tmp_path / "tok")


def test_a_damaged_safetensors_file_is_named(tmp_path):
    import torch
    from safetensors.torch import save_file

    from qkvlab.model.folder import load_weights, safetensors_keys

    save_file({"w": torch.zeros(64, 64)}, tmp_path / "w.safetensors")
    data = (tmp_path / "w.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[: len(data) // 2])
    (tmp_path / "huge.safetensors").write_bytes((2**60).to_bytes(8, "little") + data[8:])
    for name in ("cut", "huge"):
        with pytest.raises(UserError, match=f"{name}.safetensors: not a readable safetensors file"):
            safetensors_keys(tmp_path / f"{name}.safetensors")
        with pytest.raises(UserError, match=f"{name}.safetensors: not safetensors; qkvlab reads weights only"):
            load_weights(tmp_path / f"{name}.safetensors")


def test_a_damaged_or_inconsistent_gguf_is_named_before_transformers_reads_it(tmp_path):
    gguf = pytest.importorskip("gguf")
    import numpy as np

    from qkvlab.convert.hf import check_gguf

    (tmp_path / "junk.gguf").write_bytes(b"GGUF" + os.urandom(200))
    with pytest.raises(UserError, match="junk.gguf: not a readable GGUF file"):
        check_gguf(tmp_path / "junk.gguf")

    def write(name: str, layers: int) -> None:
        w = gguf.GGUFWriter(str(tmp_path / name), "llama")
        w.add_embedding_length(8)
        w.add_block_count(layers)
        w.add_feed_forward_length(16)
        w.add_tensor("token_embd.weight", np.zeros((32, 8), dtype=np.float32))
        w.add_tensor("blk.0.ffn_up.weight", np.zeros((16, 32), dtype=np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()

    write("small.gguf", 1)
    check_gguf(tmp_path / "small.gguf")  # 1 layer of width 8 declares at least 8*8 + 2*8*16 = 320 of its 768
    write("deep.gguf", 10**6)
    with pytest.raises(UserError, match=r"deep.gguf: its metadata declare 1,000,000 layers of width 8"):
        check_gguf(tmp_path / "deep.gguf")
