"""A model folder from someone else is data: seeded mutations of every file of two valid tiny folders
(a qkvlab model with its BPE tokenizer/, read by `generate`; a Llama written by transformers with its
tokenizer, read by `similarity`), each run in-process through the CLI's main.

For every case: exit 0 or 2 and nothing else (no traceback, no other exception, no hang: 20 s alarm);
exit 2 prints exactly one line; a mutation that must be refused (truncation, invalid JSON, a path or a
link leading outside, a declared size the weights cannot hold, a pipe or a folder where a file was) is
refused; a mutation that may be harmless (flipped bytes, a key of another type or missing, a missing
optional file, a link inside the folder) may succeed, and then its output is checked; the folder is
byte for byte as before (nothing written), and no file outside it was read: the sentinel copies
outside have their access time reset to 0 before every case (ext4's relatime then records any read,
also by Rust libraries: tokenizers, safetensors) and an audit hook records every Python-level open
and listing under them.

Mutations that may succeed: "flip", "retype", "drop", "missing" (of generation_config.json and the
HF tokenizer_config.json only), "link_inside". Every other kind must exit 2.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import random
import shutil
import signal
import struct
import sys
from collections import Counter
from pathlib import Path

import pytest

from qkvlab import cli

SEED = 56
MAY_PASS = {"flip", "retype", "drop", "missing", "link_inside"}
HUGE = (10**12, 2**62, 10**18)
WRONG_VALUES = (None, 0, -1, 1.5, "x", [], {}, True, [1, "a"], {"a": 1})

_AUDIT = {"root": None, "seen": []}


def _audit(event: str, args: tuple) -> None:
    root = _AUDIT["root"]
    if root is None or event not in ("open", "os.listdir", "os.scandir") or not args:
        return
    path = args[0]
    if isinstance(path, (str, bytes, os.PathLike)):
        real = os.path.realpath(os.fsdecode(path))
        if real == root or real.startswith(root + os.sep):
            _AUDIT["seen"].append((event, real))


sys.addaudithook(_audit)  # cannot be removed: it does nothing while _AUDIT["root"] is None


# ---- the two valid folders ------------------------------------------------------------------------
def _qkvlab_folder(folder: Path) -> None:
    import torch

    from qkvlab.data.tokenizer import BPETokenizer
    from qkvlab.model.config import ModelConfig
    from qkvlab.model.folder import save_model
    from qkvlab.model.transformer import GPT

    tok = BPETokenizer.train(["the quick brown fox jumps over the lazy dog. " * 40], 300)
    cfg = ModelConfig(n_layer=1, n_head=2, d_model=16, vocab_size=tok.vocab_size, context=32).validate()
    torch.manual_seed(0)
    save_model(folder, GPT(cfg), cfg)
    tok.save(folder / "tokenizer")


def _hf_folder(folder: Path) -> None:
    tf = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    cfg = tf.LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, vocab_size=300, max_position_embeddings=32)  # fmt: skip
    tf.LlamaForCausalLM(cfg).save_pretrained(folder)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<eot>"], initial_alphabet=alphabet)
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog. " * 40], trainer)
    tf.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eot>").save_pretrained(folder)


@pytest.fixture(scope="module")
def place(tmp_path_factory):
    """root/pristine/{q,hf} (the valid folders), root/outside/{q,hf} (sentinel copies a mutation
    points at), root/cases/ (where each case's copy lives), root/text.txt (similarity's --text)."""
    root = tmp_path_factory.mktemp("fuzz")
    _qkvlab_folder(root / "pristine" / "q")
    _hf_folder(root / "pristine" / "hf")
    for name in ("q", "hf"):
        shutil.copytree(root / "pristine" / name, root / "outside" / name)
    (root / "cases").mkdir()
    (root / "text.txt").write_text("the quick brown fox jumps over the lazy dog. " * 8)
    return root


# ---- mutations: each (rng, folder, file, place) -> None, changing the case's copy ------------------
def _json(path: Path):
    return json.loads(path.read_text())


def _write_json(path: Path, body) -> None:
    path.write_text(json.dumps(body))


def truncate(rng, folder, file, place):
    data = (folder / file).read_bytes()
    (folder / file).write_bytes(data[: rng.randrange(0, max(1, len(data) - 2))])


def flip(rng, folder, file, place):
    data = bytearray((folder / file).read_bytes())
    for _ in range(rng.randint(1, 8)):
        data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    (folder / file).write_bytes(bytes(data))


def invalid_json(rng, folder, file, place):
    garbage = ["", "{", "[1, 2", "not json", '{"a": }', "\ufeff{}", "[" * 5000 + "]" * 5000, "[" * 100_000,
               '{"n": ' + "9" * 5000 + "}", "null", "[]", "3", '"text"', "{\"a\": NaN}"]  # fmt: skip
    text = rng.choice(garbage)
    (folder / file).write_bytes(text.encode() if rng.random() < 0.9 else b"\xff\xfe" + text.encode())


def _keys(body, prefix=()):
    """Every key path of a JSON object (nested objects included)."""
    for k, v in body.items():
        yield (*prefix, k)
        if isinstance(v, dict):
            yield from _keys(v, (*prefix, k))


def _set(body, path, value=...):
    for k in path[:-1]:
        body = body[k]
    if value is ...:
        del body[path[-1]]
    else:
        body[path[-1]] = value


def retype(rng, folder, file, place):
    body = _json(folder / file)
    path = rng.choice(list(_keys(body)))
    _set(body, path, rng.choice(WRONG_VALUES))
    _write_json(folder / file, body)


def drop(rng, folder, file, place):
    body = _json(folder / file)
    _set(body, rng.choice(list(_keys(body))))
    _write_json(folder / file, body)


def _remove(path: Path) -> None:
    shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()


def missing(rng, folder, file, place):
    _remove(folder / file)


def _outside(place, folder, file) -> Path:
    return place / "outside" / folder.name / file


def link_outside(rng, folder, file, place):
    target = _outside(place, folder, file)
    _remove(folder / file)
    os.symlink(target if rng.random() < 0.5 else os.path.relpath(target, (folder / file).parent), folder / file)


def link_inside(rng, folder, file, place):
    copy = (folder / file).with_name("copy-" + Path(file).name)
    (shutil.copytree if (folder / file).is_dir() else shutil.copyfile)(folder / file, copy)
    _remove(folder / file)
    os.symlink(copy.name, folder / file)


def fifo(rng, folder, file, place):
    (folder / file).unlink()
    os.mkfifo(folder / file)


def folder_in_place(rng, folder, file, place):
    (folder / file).unlink()
    (folder / file).mkdir()


def _escape(rng, folder, base: Path, target: Path) -> str:
    """A name leading from `base` to `target` outside the folder: relative with .., or absolute."""
    return str(target) if rng.random() < 0.4 else os.path.relpath(target, base)


def escape(rng, folder, file, place):
    """Every path-valued key a loader follows, pointed at the sentinel copy outside."""
    body = _json(folder / file) if file.endswith(".json") else {}
    if file == "tokenizer/qkvlab_tokenizer.json":
        body["file"] = _escape(rng, folder, folder / "tokenizer", _outside(place, folder, "tokenizer/bpe.json"))
    elif file == "config.json" and "model" in body:  # a qkvlab config's recorded tokenizer folder
        shutil.rmtree(folder / "tokenizer")  # so that the recorded one is what is read
        target = _escape(rng, folder, folder, _outside(place, folder, "tokenizer"))
        body.update({"tokenizer": target} if rng.random() < 0.5 else {"train": {"task_options": {"tokenizer": target}}})
    elif file == "tokenizer_config.json":
        key = rng.choice(["tokenizer_file", "vocab_file", "merges_file", "chat_template_file"])
        body[key] = _escape(rng, folder, folder, _outside(place, folder, "tokenizer.json"))
    else:  # an HF folder's weights index naming shards outside
        names = list(json.loads(_header(folder / "model.safetensors")[1]))
        shard = _escape(rng, folder, folder, _outside(place, folder, "model.safetensors"))
        body = {"metadata": {}, "weight_map": {n: shard for n in names if n != "__metadata__"}}
        file = "model.safetensors.index.json"
    _write_json(folder / file, body)


def _header(path: Path) -> tuple[int, bytes, bytes]:
    data = path.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    return n, data[8 : 8 + n], data[8 + n :]


HUGE_KEYS = {
    "config.json": {
        "q": [("model", "vocab_size"), ("model", "d_model"), ("model", "n_layer"), ("model", "context"),
              ("model", "mlp_hidden"), ("model", "n_head")],
        "hf": [("vocab_size",), ("hidden_size",), ("num_hidden_layers",), ("intermediate_size",),
               ("max_position_embeddings",), ("head_dim",)],
    },
}  # fmt: skip


def huge(rng, folder, file, place):
    """A declared size the files cannot hold: a config's dimensions, a safetensors header length or a
    tensor's shape, a BPE vocabulary."""
    if file.endswith(".safetensors"):
        n, header, rest = _header(folder / file)
        if rng.random() < 0.5:
            (folder / file).write_bytes(struct.pack("<Q", rng.choice([2**40, 2**60, 2**64 - 1])) + header + rest)
        else:
            body = json.loads(header)
            name = rng.choice([k for k in body if k != "__metadata__"])
            body[name]["shape"] = [rng.choice(HUGE), *body[name]["shape"][1:]]
            new = json.dumps(body).encode()
            (folder / file).write_bytes(struct.pack("<Q", len(new)) + new + rest)
        return
    body = _json(folder / file)
    if file == "tokenizer/qkvlab_tokenizer.json":
        body["spec"] = f"bpe:{rng.choice(HUGE)}"
    else:
        _set(body, rng.choice(HUGE_KEYS[file][folder.name]), rng.choice(HUGE))
    _write_json(folder / file, body)


# which mutations apply to which file of each folder
Q_FILES = ["config.json", "model.safetensors", "tokenizer/qkvlab_tokenizer.json", "tokenizer/bpe.json"]
HF_FILES = ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
JSON_ONLY = {invalid_json, retype, drop}


def plan(name: str, files: list[str], per_kind: dict) -> list[tuple]:
    """The seeded cases: (folder name, file, mutation, seed)."""
    cases = []
    for file in files:
        for mutate, n in per_kind.items():
            if mutate in JSON_ONLY and not file.endswith(".json"):
                continue
            if mutate is escape and file not in ESCAPES[name]:
                continue
            if mutate is huge and not (
                file.endswith(".safetensors") or file in HUGE_KEYS or "qkvlab_tokenizer" in file
            ):
                continue
            cases += [(name, file, mutate, seed) for seed in range(n)]
    if name == "q":  # the tokenizer folder itself
        cases += [("q", "tokenizer", m, seed) for m in (link_outside, link_inside, missing) for seed in range(2)]
    return cases


ESCAPES = {
    "q": ["config.json", "tokenizer/qkvlab_tokenizer.json"],
    "hf": ["tokenizer_config.json", "model.safetensors"],
}
Q_PLAN = {truncate: 6, flip: 8, invalid_json: 6, retype: 10, drop: 5, missing: 1, link_outside: 3, link_inside: 1,
          fifo: 1, folder_in_place: 1, escape: 8, huge: 6}  # fmt: skip
HF_PLAN = {truncate: 3, flip: 4, invalid_json: 3, retype: 4, drop: 2, missing: 1, link_outside: 2, link_inside: 1,
           fifo: 1, folder_in_place: 1, escape: 4, huge: 3}  # fmt: skip
CASES = plan("q", Q_FILES, Q_PLAN) + plan("hf", HF_FILES, HF_PLAN)


# ---- running one case -----------------------------------------------------------------------------
def _snapshot(folder: Path) -> dict[str, tuple]:
    out = {}
    for dirpath, dirnames, filenames in os.walk(folder):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            st = os.lstat(p)
            if os.path.islink(p):
                out[str(p)] = ("link", os.readlink(p))
            elif p.is_file():
                out[str(p)] = ("file", st.st_size, st.st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
            else:
                out[str(p)] = ("other", st.st_mode)
    return out


def _reset_atimes(outside: Path) -> list[Path]:
    files = [p for p in outside.rglob("*") if p.is_file()]
    for p in files:
        os.utime(p, (0, os.stat(p).st_mtime))
    return files


def _timeout(signum, frame):
    raise TimeoutError("a case ran for 20 s (a read that blocks?)")


def run_cli(argv: list[str]) -> tuple[object, str, str]:
    out, err = io.StringIO(), io.StringIO()
    previous = signal.signal(signal.SIGALRM, _timeout)
    signal.alarm(20)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                rc = cli.main(argv)
            except SystemExit as e:
                rc = e.code
            except BaseException as e:  # anything else is a finding: reported with its type
                rc = f"{type(e).__name__}: {str(e)[:300]}"
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    return rc, out.getvalue(), err.getvalue()


def command(name: str, folder: Path, place: Path) -> list[str]:
    if name == "q":
        return ["generate", str(folder), "--prompt", "the fox", "--max-new-tokens", "2", "--dtype", "fp32",
                "--temperature", "0"]  # fmt: skip
    return ["similarity", str(folder), "--tokens", "16", "--text", str(place / "text.txt")]


def check_case(place: Path, name: str, file: str, mutate, seed: int) -> str:
    """Run one case; returns "refused" or "passed", or raises AssertionError describing the finding."""
    folder = place / "cases" / name
    for previous in (place / "cases").iterdir():
        shutil.rmtree(previous)
    shutil.copytree(place / "pristine" / name, folder, symlinks=True)
    rng = random.Random(f"{SEED}-{name}-{file}-{mutate.__name__}-{seed}")
    mutate(rng, folder, file, place)
    before, sentinels = _snapshot(folder), _reset_atimes(place / "outside")
    _AUDIT["root"], _AUDIT["seen"] = str(Path(os.path.realpath(place / "outside"))), []
    try:
        rc, out, err = run_cli(command(name, folder, place))
    finally:
        _AUDIT["root"] = None
    what = f"{name}/{file} {mutate.__name__} seed {seed}: rc={rc!r} stderr={err.strip()[-300:]!r}"
    lines = [line for line in err.replace("\r", "\n").splitlines() if line.strip()]
    assert rc in (0, 2), what
    assert "Traceback" not in err, what
    read = [p for p in sentinels if os.stat(p).st_atime != 0]
    assert not read and not _AUDIT["seen"], f"{what}: read outside the folder: {read or _AUDIT['seen']}"
    assert _snapshot(folder) == before, f"{what}: the folder changed"
    assert os.listdir(place / "cases") == [name], f"{what}: wrote beside the folder"
    if rc == 2:
        assert len(lines) == 1 and lines[0].startswith("qkvlab "), what
        return "refused"
    assert mutate.__name__ in MAY_PASS and not (mutate is missing and file not in OPTIONAL), f"{what}: not refused"
    if name == "q":
        assert out.strip(), f"{what}: no text generated"
    else:
        assert "measured (mean)" in out or "no CKA" in out, f"{what}: {out[-200:]!r}"
    return "passed"


OPTIONAL = {"generation_config.json", "tokenizer_config.json"}  # an HF folder loads without them


def test_the_plan_has_enough_cases():
    kinds = Counter(m.__name__ for _, _, m, _ in CASES)
    assert len(CASES) >= 300, len(CASES)
    assert set(kinds) >= {"truncate", "flip", "retype", "drop", "escape", "link_outside", "huge", "fifo"}


def test_every_mutation_of_a_model_folder_is_refused_in_one_line_or_harmless(place, isolated_cache, one_thread):
    findings, outcomes = [], Counter()
    for name, file, mutate, seed in CASES:
        try:
            outcomes[check_case(place, name, file, mutate, seed)] += 1
        except AssertionError as e:
            findings.append(str(e).splitlines()[0])
    assert findings == [], f"{len(findings)} of {len(CASES)} cases:\n" + "\n".join(findings[:40])
    assert outcomes["refused"] > outcomes["passed"]  # most mutations must be refused, not shrugged off
    print(f"{len(CASES)} cases: {dict(outcomes)}")
