"""Faults of the machine or of the input that used to end in a traceback: each is one line, exit 2,
and leaves a state a plain re-run (or --resume) continues from. A full disk and a read-only folder
are simulated by patching the writer (no tmpfs or mount in tests)."""

from __future__ import annotations

import errno
import json
import os
import pathlib
import sys

import pytest
from safetensors import SafetensorError

from qkvlab import cli
from qkvlab.base.errors import UserError, as_user_error, mount_point
from qkvlab.base.files import atomic_dir, atomic_file, atomic_path

DISK_FULL = "Error while serializing: I/O error: No space left on device (os error 28)"  # safetensors' words
TRAIN = ["train", "--preset", "tiny", "--tokenizer", "char", "--block-size", "32", "--batch-size", "8",
         "--eval-batches", "2", "--eval-every", "2", "--dtype", "fp32"]  # fmt: skip


def one_line_error(capsys, *words: str) -> str:
    err = capsys.readouterr().err.strip().replace("\r", "\n").splitlines()[-1]
    assert "Traceback" not in err and err.startswith("qkvlab "), err
    for w in words:
        assert w in err, err
    return err


def test_a_full_disk_or_a_forbidden_folder_is_one_line_and_anything_else_is_not():
    full = as_user_error(OSError(errno.ENOSPC, "No space left on device", "/x/y"), needed=12_300_000)
    assert "/x/y: no space left on the device (needs about 12.3 MB" in str(full) and "\n" not in str(full)
    assert "needs more than 0.5 MB" in str(as_user_error(SafetensorError(DISK_FULL), "/x", written=500_000))
    assert str(as_user_error(OSError(errno.EROFS, "Read-only file system", "/ro/p"))) == (
        "/ro/p: cannot write there (Read-only file system)"
    )
    assert "Permission denied" in str(as_user_error(PermissionError(errno.EACCES, "Permission denied", "/p")))
    for bug in (OSError(errno.EBADF, "Bad file descriptor"), ValueError("x"), SafetensorError("header too large")):
        assert as_user_error(bug) is None  # a bug keeps its traceback


@pytest.mark.parametrize("writer", ["file", "path", "dir"])
def test_the_atomic_writers_say_how_much_room_and_keep_the_old_version(tmp_path, writer):
    target = tmp_path / ("d" if writer == "dir" else "f.bin")
    if writer == "dir":
        target.mkdir()
        (target / "old").write_text("old")
    else:
        target.write_text("old")
    with pytest.raises(UserError, match=r"no space left on the device \(needs (about|more than)"):
        if writer == "file":
            with atomic_file(target) as f:
                f.write("x" * 1000)
                f.flush()
                raise OSError(errno.ENOSPC, "No space left on device")
        elif writer == "path":
            with atomic_path(target, needed=2_000_000) as tmp:
                tmp.write_bytes(b"x" * 1000)
                raise SafetensorError(DISK_FULL)
        else:
            with atomic_dir(target, needed=2_000_000) as tmp:
                (tmp / "new").write_text("x")
                raise SafetensorError(DISK_FULL)
    assert sorted(p.name for p in tmp_path.iterdir()) == [target.name]  # no temp left
    assert (target / "old" if writer == "dir" else target).read_text() == "old"


def test_a_file_written_inside_a_folder_being_published_is_named_by_its_final_path(tmp_path):
    target = tmp_path / "model"
    with pytest.raises(UserError) as refused:
        with atomic_dir(target) as tmp:
            with atomic_path(tmp / "model.safetensors", needed=4_300_000):
                raise SafetensorError(DISK_FULL)
    assert str(refused.value).startswith(
        f"{target / 'model.safetensors'}: no space left on the device (needs about 4.3 MB"
    )
    assert list(tmp_path.iterdir()) == []


def test_a_full_disk_at_a_checkpoint_keeps_the_last_good_one_and_resume_continues(
    plays_file, tmp_path, monkeypatch, capsys
):
    from qkvlab.train import checkpoint as ck
    from qkvlab.train.checkpoint import find_checkpoint

    real, calls = ck.save_file, []

    def fills_up(tensors, filename, metadata=None):
        calls.append(filename)
        if len(calls) > 2:  # the first checkpoint's two files fit, the second's do not
            raise SafetensorError(DISK_FULL)
        return real(tensors, filename, metadata=metadata)

    monkeypatch.setattr(ck, "save_file", fills_up)
    out = tmp_path / "run"
    args = [*TRAIN, "--data", str(plays_file), "--out", str(out), "--max-steps", "4"]
    assert cli.main(args) == 2
    one_line_error(
        capsys,
        f"{out / 'checkpoint'}: no space left on the device (needs about",
        f"MB free on {mount_point(out)})",  # the free space of the checkpoint's own filesystem
        f"free some room, then run `qkvlab train --out {out} --resume` (it continues from the checkpoint at step 2)",
    )
    assert json.loads((find_checkpoint(out) / "state.json").read_text())["step"] == 2
    monkeypatch.setattr(ck, "save_file", real)
    assert cli.main(args) == 2  # the plain re-run after freeing room says exactly what the line said
    one_line_error(capsys, "holds a training run (checkpoint at step 2); pass --resume to continue it")
    assert cli.main([*args, "--resume"]) == 0
    assert json.loads((find_checkpoint(out) / "state.json").read_text())["step"] == 4

    # a plain write that fills the disk (no file name in the OSError), during a resumed run
    calls.clear()
    monkeypatch.setattr(ck, "save_file", lambda *a, **k: (_ for _ in ()).throw(OSError(errno.ENOSPC, "full")))
    assert cli.main([*args, "--max-steps", "6", "--resume"]) == 2
    one_line_error(
        capsys,
        f"{out / 'checkpoint'}: no space left",
        "then run the same command again (it continues from the checkpoint at step 4)",
    )
    monkeypatch.setattr(ck, "save_file", real)

    # full at the very first checkpoint: OUT is removed, so a plain re-run starts it
    calls.clear()
    monkeypatch.setattr(ck, "save_file", lambda *a, **k: (_ for _ in ()).throw(SafetensorError(DISK_FULL)))
    fresh = [*TRAIN, "--data", str(plays_file), "--out", str(tmp_path / "fresh"), "--max-steps", "2"]
    assert cli.main(fresh) == 2
    one_line_error(capsys, "no space left", "then run the same command again (no checkpoint was kept")
    assert not (tmp_path / "fresh").exists()


class _FillsUp:
    """A token file whose writes fail with ENOSPC (no file name, as a write(2) reports it) once
    `room` bytes are written."""

    def __init__(self, f, room: int):
        self._f, self.room = f, room

    def write(self, data):
        self.room -= len(data)
        if self.room < 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        return self._f.write(data)

    def __getattr__(self, name):
        return getattr(self._f, name)


def test_a_full_cache_while_tokenizing_names_the_file_its_filesystem_and_the_rerun(
    plays_file, tmp_path, monkeypatch, capsys
):
    from qkvlab.base import errors
    from qkvlab.data import token_writer

    cache = tmp_path / "cache"
    monkeypatch.setenv("QKVLAB_CACHE", str(cache))
    real_open, real_usage = open, errors.shutil.disk_usage
    monkeypatch.setattr(token_writer, "open", lambda p, mode: _FillsUp(real_open(p, mode), 20_000), raising=False)

    def usage(path):  # the cache's filesystem has 12.3 MB free, every other one plenty
        free = 12_300_000 if str(path).startswith(str(tmp_path)) else 999_000_000_000
        return real_usage(path)._replace(free=free)

    monkeypatch.setattr(errors.shutil, "disk_usage", usage)
    out = tmp_path / "run"
    args = [*TRAIN, "--data", str(plays_file), "--out", str(out), "--max-steps", "2"]
    assert cli.main(args) == 2
    err = one_line_error(
        capsys, "/train.bin: no space left on the device (12.3 MB free on", "then run the same command again"
    )
    assert err.split(": error: ")[1].startswith(str(cache / "prepared"))
    assert "the tokens written up to the last progress.json are kept" in err
    assert not out.exists()  # the run had no checkpoint: nothing left that a plain re-run would refuse
    monkeypatch.setattr(token_writer, "open", real_open, raising=False)
    assert cli.main(args) == 0  # the plain re-run, once there is room


def test_a_full_disk_during_retrofit_says_resume_once_out_holds_a_retrofit(tmp_path, monkeypatch, capsys):
    import qkvlab.retrofit.workflow as rf
    from qkvlab.data.tokenizer import BPETokenizer
    from qkvlab.model.config import preset
    from qkvlab.model.folder import save_model
    from qkvlab.model.transformer import GPT

    text = "the quick brown fox jumps over the lazy dog. " * 400
    (tmp_path / "t.txt").write_text(text)
    tok = BPETokenizer.train([text], 300)
    cfg = preset("tiny", vocab_size=tok.vocab_size)
    save_model(tmp_path / "m", GPT(cfg), cfg)
    tok.save(tmp_path / "m" / "tokenizer")
    out = tmp_path / "rf"
    argv = ["retrofit", str(tmp_path / "m"), str(out), "--data", str(tmp_path / "t.txt"), "--steps", "0", "--quiet",
            "--calib-tokens", "256", "--eval-tokens", "256", "--refine-steps", "2"]  # fmt: skip

    def full(folder, *a, **k):
        raise OSError(errno.ENOSPC, "No space left on device", str(folder / "model.safetensors"))

    real = rf.write_model_files
    monkeypatch.setattr(rf, "write_model_files", full)
    assert cli.main(argv) == 2
    one_line_error(
        capsys,
        f"{out / 'fit'}/model.safetensors: no space left",
        f"free on {mount_point(out)}",
        "then run the same command with --resume",
    )
    monkeypatch.setattr(rf, "write_model_files", real)
    assert cli.main(argv) == 2  # a plain re-run is refused, saying what the line said
    one_line_error(capsys, "holds a retrofit; pass --resume to continue it")
    assert cli.main([*argv, "--resume"]) == 0


def _read_only_under(monkeypatch, root: pathlib.Path) -> None:
    """Folders under `root` cannot be created, as on a read-only mount (tests may run as root,
    where a chmod would not stop a write)."""
    real = pathlib.Path.mkdir

    def mkdir(self, *args, **kwargs):
        if pathlib.Path(os.path.abspath(self)).is_relative_to(root) and not self.exists():
            raise OSError(errno.EROFS, "Read-only file system", str(self))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "mkdir", mkdir)


def test_a_read_only_out_or_cache_is_one_line(plays_file, tmp_path, monkeypatch, capsys):
    ro = tmp_path / "ro"
    ro.mkdir()
    _read_only_under(monkeypatch, ro)
    assert cli.main(["prepare", "--data", str(plays_file), "--tokenizer", "char", "--out", str(ro / "p")]) == 2
    one_line_error(capsys, f"{ro / 'p'}: cannot write there (Read-only file system)")
    monkeypatch.setenv("QKVLAB_CACHE", str(ro))
    out = tmp_path / "run"
    assert cli.main([*TRAIN, "--data", str(plays_file), "--out", str(out), "--max-steps", "2"]) == 2
    one_line_error(capsys, "cannot write there (Read-only file system)")
    assert not out.exists()  # nothing left that a plain re-run would refuse


def damaged_page(path: pathlib.Path, groups: int) -> pathlib.Path:
    """A snappy parquet file of `groups` row groups of 700 rows whose last data page has bytes flipped
    mid-page: its footer and schema read fine, the page does not decompress."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = [f"document {i} " + "lorem ipsum dolor sit amet " * (i % 7 + 1) for i in range(700 * groups)]
    pq.write_table(pa.table({"text": texts}), path, compression="snappy", use_dictionary=False, row_group_size=700)
    column = pq.ParquetFile(path).metadata.row_group(groups - 1).column(0)
    data = bytearray(path.read_bytes())
    middle = column.data_page_offset + column.total_compressed_size // 2
    for i in range(middle, middle + 64):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))
    return path


def test_prepare_refuses_bad_sources_in_one_line_and_leaves_no_folder(tmp_path, capsys):
    pytest.importorskip("pyarrow")
    corrupt = tmp_path / "corrupt.parquet"
    corrupt.write_bytes(os.urandom(3000))
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    numbers = tmp_path / "numbers.jsonl"
    numbers.write_text("".join(json.dumps({"text": f"words and more words {i}"}) + "\n" for i in range(300)))
    with numbers.open("a") as f:
        f.write(json.dumps({"text": 12345}) + "\n")
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("ab")
    cases = [
        (corrupt, "not a readable parquet file (Parquet magic bytes not found"),
        (
            damaged_page(tmp_path / "page.parquet", groups=1),
            "not a readable parquet file (Corrupt snappy compressed data.",
        ),
        (
            damaged_page(tmp_path / "later.parquet", groups=3),
            "damaged after row 1,024 (Corrupt snappy compressed data.",
        ),
        (fifo, "is not a regular file or a folder"),
        (numbers, "has a 'text' that is a JSON int (12345), not a string"),
        (tiny, "is too small"),  # refused at the end, after the tokenizer and bins were written
    ]
    if sys.platform.startswith("linux"):
        cases.append((pathlib.Path("/dev/zero"), "is not a regular file or a folder"))
    for source, words in cases:
        out = tmp_path / "p"
        assert cli.main(["prepare", "--data", str(source), "--tokenizer", "bpe:300", "--out", str(out)]) == 2, source
        one_line_error(capsys, words)
        assert not out.exists(), source  # refused before anything is kept: no bpe.json, no train.bin


def test_a_resume_mismatch_names_the_differing_key_not_the_whole_config(plays_file, tmp_path, capsys):
    out = tmp_path / "run"
    args = [*TRAIN, "--data", str(plays_file), "--out", str(out), "--max-steps", "2"]
    assert cli.main(args) == 0
    capsys.readouterr()
    assert cli.main([*args, "--resume", "--max-steps", "4", "--d-model", "48"]) == 2
    err = one_line_error(capsys, "was trained with model.d_model=64, not 48; resume with the same model.d_model")
    assert len(err) < 300
    from qkvlab.train.run_folder import first_difference  # compare's refusal of a changed recipe uses it too

    assert first_difference("model", {"d_model": 64, "n_head": 4}, {"d_model": 48, "n_head": 4}) == (
        "model.d_model",
        64,
        48,
    )
    assert first_difference("task_options", {"a": 1}, {}) == ("task_options.a", 1, None)
    assert first_difference("lr", 0.1, 0.2) == ("lr", 0.1, 0.2)
