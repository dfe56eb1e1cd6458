"""scripts/build_sweep_corpus.py on a tiny kernel-like tarball: which files it takes, their order
(sha256 of the path, so a cap is a uniform sample), the cap, bytes that are not UTF-8, and that
`qkvlab prepare` reads the shards it writes."""

import io
import json
import sys
import tarfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import build_sweep_corpus as bsc  # noqa: E402


def _tarball(path: Path, files: dict[str, bytes]) -> Path:
    with tarfile.open(path, "w:xz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(f"linux-source-6.12/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


FILES = {
    "kernel/sched/core.c": b"int schedule(void) { return 0; }\n" * 20,
    "include/linux/list.h": b"#define LIST_HEAD(x) x\n" * 20,
    "Documentation/admin-guide/README.rst": b"Linux kernel\n============\n" * 20,
    "drivers/net/Kconfig": b"config NET\n\tbool\n" * 20,
    "arch/x86/boot/Makefile": b"obj-y += boot.o\n" * 20,
    "drivers/gpu/drm/amd/include/asic_reg/gc/gc_9_0.h": b"#define REG 0x1\n" * 20,  # register tables: out
    "arch/arm/boot/dts/board.dts": b'/ { model = "x"; };\n' * 20,  # device trees: out
    "lib/huge_table.c": b"0," * 600_000,  # over 1 MB: generated, out
    "fs/latin1.c": b"/* caf\xe9 */\nint x;\n" * 5,  # not UTF-8: read as U+FFFD, counted
    "scripts/empty.sh": b"   \n",  # nothing to learn: skipped
}


def test_selection_order_and_undecodable_bytes(tmp_path):
    archive = _tarball(tmp_path / "linux.tar.xz", FILES)
    m = bsc.build(archive, tmp_path / "out", None)
    rows = [json.loads(line) for line in (tmp_path / "out" / "shard000.jsonl").read_text().splitlines()]
    paths = [r["path"] for r in rows]
    kept = ["kernel/sched/core.c", "include/linux/list.h", "Documentation/admin-guide/README.rst"]
    kept += ["drivers/net/Kconfig", "arch/x86/boot/Makefile", "fs/latin1.c"]
    assert sorted(paths) == sorted(kept)
    assert paths == sorted(paths, key=lambda p: bsc.order_key("linux-source-6.12/" + p))
    assert m["files"] == 6 and m["replaced_characters"] == 5 and m["shards"] == ["shard000.jsonl"]
    assert "\ufffd" in next(r["text"] for r in rows if r["path"] == "fs/latin1.c")
    with pytest.raises(SystemExit, match="not empty"):
        bsc.build(archive, tmp_path / "out", None)


def test_a_cap_keeps_a_prefix_of_the_same_order_and_prepare_reads_it(tmp_path, isolated_cache):
    from qkvlab.data.prepare import prepare

    archive = _tarball(tmp_path / "linux.tar.xz", FILES)
    full = bsc.build(archive, tmp_path / "full", None)
    cap = bsc.build(archive, tmp_path / "cap", 2000)
    full_paths = [json.loads(x)["path"] for x in (tmp_path / "full" / "shard000.jsonl").read_text().splitlines()]
    cap_paths = [json.loads(x)["path"] for x in (tmp_path / "cap" / "shard000.jsonl").read_text().splitlines()]
    assert 0 < len(cap_paths) < len(full_paths) and cap_paths == full_paths[: len(cap_paths)]
    assert cap["characters"] <= 2000 < full["characters"]
    data = prepare(tmp_path / "full", "char", tmp_path / "prepared", val_fraction=0.1, split="stream")
    assert data.meta["documents"] == 6 and data.meta["tokens"]["train"] > 0
    with pytest.raises(SystemExit, match="no such archive"):
        bsc.build(tmp_path / "missing.tar.xz", tmp_path / "x", None)
