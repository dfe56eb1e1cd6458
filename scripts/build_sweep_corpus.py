"""The scaling sweep's training corpus: source text of the Linux kernel from Debian's `linux-source-6.12`
(scripts/setup_sweep_corpus.sh installs it), as .jsonl shards `qkvlab prepare` reads (one document per
file's "text").

Selection, fixed so that the corpus is the same wherever it is built from the same package version:
C and assembly sources, headers, the documentation (.rst, .txt), Kconfig and Makefiles, shell and Python
scripts; not the device trees and YAML bindings (generated-looking data), not AMD's register headers
(asic_reg: 480 MB of near-identical #defines) and no file over 1 MB (generated tables). Files are taken
in the order of sha256(path) until --max-mb of text, so any cap is a uniform sample of files, and written
in that order: `prepare --split stream` then holds out the last files, a random sample, not a directory.
Bytes that are not UTF-8 (a few Latin-1 comments) are read as U+FFFD and counted in manifest.json.

    python scripts/build_sweep_corpus.py /usr/src/linux-source-6.12.tar.xz data/sweep/linux-6.12 --max-mb 300
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tarfile
from pathlib import Path

SUFFIXES = (".c", ".h", ".S", ".rst", ".txt", ".sh", ".py")
PREFIXES = ("Kconfig", "Makefile")
EXCLUDE = ("/asic_reg/",)
MAX_FILE = 1_000_000  # bytes: larger files are generated tables
SHARD_BYTES = 32 << 20  # text per .jsonl shard
FORMAT = "qkvlab sweep corpus 1"


def selected(name: str, size: int) -> bool:
    base = name.rsplit("/", 1)[-1]
    if size > MAX_FILE or any(x in name for x in EXCLUDE):
        return False
    return base.endswith(SUFFIXES) or base.startswith(PREFIXES)


def order_key(name: str) -> str:
    """A file's place in the corpus: sha256 of its path below the tree's top folder."""
    return hashlib.sha256(name.split("/", 1)[-1].encode()).hexdigest()


def build(archive: Path, out: Path, max_bytes: int | None) -> dict:
    if not archive.is_file():
        raise SystemExit(f"{archive}: no such archive (scripts/setup_sweep_corpus.sh installs linux-source-6.12)")
    if out.exists() and any(out.iterdir()):
        raise SystemExit(f"{out}: not empty; remove it or choose another folder")
    with tarfile.open(archive, "r:*") as tar:
        members = [m for m in tar if m.isfile() and selected(m.name, m.size)]  # one pass: the listing
    members.sort(key=lambda m: order_key(m.name))
    if max_bytes is not None:
        kept, total = [], 0
        for m in members:
            if total + m.size > max_bytes:
                break
            kept.append(m)
            total += m.size
        members = kept
    wanted = {m.name: i for i, m in enumerate(members)}
    texts: list[str | None] = [None] * len(members)
    replaced = 0
    with tarfile.open(archive, "r:*") as tar:  # second pass: the contents, in archive order
        for m in tar:
            i = wanted.get(m.name)
            if i is None:
                continue
            data = tar.extractfile(m).read()
            text = data.decode("utf-8", errors="replace")
            replaced += text.count("\ufffd") - data.count("\ufffd".encode())
            texts[i] = text
    out.mkdir(parents=True, exist_ok=True)
    shards, buf, size = [], [], 0

    def flush() -> None:
        nonlocal buf, size
        if buf:
            path = out / f"shard{len(shards):03d}.jsonl"
            path.write_text("".join(buf), encoding="utf-8")
            shards.append(path.name)
            buf, size = [], 0

    for m, text in zip(members, texts):
        if not text or not text.strip():
            continue
        buf.append(json.dumps({"text": text, "path": m.name.split("/", 1)[-1]}, ensure_ascii=False) + "\n")
        size += len(text)
        if size >= SHARD_BYTES:
            flush()
    flush()
    manifest = {
        "format": FORMAT,
        "archive": archive.name,
        "archive_sha256": _sha256(archive),
        "files": sum(1 for t in texts if t and t.strip()),
        "characters": sum(len(t) for t in texts if t and t.strip()),
        "max_mb": max_bytes / 1e6 if max_bytes else None,
        "replaced_characters": replaced,
        "shards": shards,
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("archive", type=Path, help="linux-source-6.12.tar.xz (or any kernel source tarball)")
    p.add_argument("out", type=Path, help="a new folder for the .jsonl shards and manifest.json")
    p.add_argument("--max-mb", type=float, default=None, help="stop after this many MB of text (1 MB = 10^6 bytes)")
    args = p.parse_args(argv)
    if args.max_mb is not None and args.max_mb <= 0:
        p.error(f"--max-mb {args.max_mb:g} must be positive")
    m = build(args.archive, args.out, int(args.max_mb * 1e6) if args.max_mb else None)
    print(f"{args.out}: {m['files']:,} files, {m['characters'] / 1e6:.1f} M characters in {len(m['shards'])} shards")
    return 0


if __name__ == "__main__":
    sys.exit(main())
