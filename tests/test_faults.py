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
from qkvlab.base.errors import UserError, as_user_error
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
    one_line_error(capsys, "no space left on the device (needs about", "MB", "--resume")
    assert json.loads((find_checkpoint(out) / "state.json").read_text())["step"] == 2
    monkeypatch.setattr(ck, "save_file", real)
    assert cli.main([*args, "--resume"]) == 0
    assert json.loads((find_checkpoint(out) / "state.json").read_text())["step"] == 4

    # full at the very first checkpoint: OUT is removed, so a plain re-run starts it
    calls.clear()
    monkeypatch.setattr(ck, "save_file", lambda *a, **k: (_ for _ in ()).throw(SafetensorError(DISK_FULL)))
    fresh = [*TRAIN, "--data", str(plays_file), "--out", str(tmp_path / "fresh"), "--max-steps", "2"]
    assert cli.main(fresh) == 2
    one_line_error(capsys, "no space left")
    assert not (tmp_path / "fresh").exists()


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
