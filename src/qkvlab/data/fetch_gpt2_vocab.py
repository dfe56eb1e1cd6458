"""Fetch the GPT-2 (r50k_base) vocabulary without the tiktoken download site: the MIT-licensed
`openai-whisper` sdist on PyPI carries the exact file as `whisper/assets/gpt2.tiktoken`.
Only that one file is extracted (the package is never installed or imported) and its sha256
is checked against the digest tiktoken itself pins for r50k_base.

    python -m qkvlab.data.fetch_gpt2_vocab [--dest FILE]
"""

from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from qkvlab.base.errors import UserError
from qkvlab.base.files import atomic_write, cache_dir

WHISPER_REQUIREMENT = "openai-whisper==20250625"
ASSET_SUFFIX = "whisper/assets/gpt2.tiktoken"
GPT2_VOCAB_FILENAME = "gpt2.tiktoken"
GPT2_VOCAB_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"


def default_vocab_path() -> Path:
    """Where the vocabulary is cached: `<cache_dir>/gpt2.tiktoken`."""
    return cache_dir() / GPT2_VOCAB_FILENAME


def _extract_asset(sdist: Path) -> bytes:
    with tarfile.open(sdist, "r:gz") as tar:
        for member in tar.getmembers():
            if member.isfile() and member.name.endswith(ASSET_SUFFIX):
                f = tar.extractfile(member)
                assert f is not None
                return f.read()
    raise UserError(f"{sdist.name} does not contain {ASSET_SUFFIX}")


def fetch_gpt2_vocab(dest: Path | None = None) -> Path:
    """Download the whisper sdist with pip, pull out the vocabulary, verify it, and write it
    atomically to `dest` (default: the qkvlab cache). Returns the path."""
    dest = Path(dest) if dest is not None else default_vocab_path()
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--no-binary",
            ":all:",
            WHISPER_REQUIREMENT,
            "-d",
            tmp,
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        sdists = sorted(Path(tmp).glob("*.tar.gz"))
        if proc.returncode != 0 or not sdists:
            last = (proc.stderr.strip().splitlines() or ["no sdist downloaded"])[-1]
            raise UserError(f"pip download {WHISPER_REQUIREMENT} failed: {last}")
        data = _extract_asset(sdists[0])
    digest = hashlib.sha256(data).hexdigest()
    if digest != GPT2_VOCAB_SHA256:
        raise UserError(f"gpt2.tiktoken from {WHISPER_REQUIREMENT} has sha256 {digest}, expected {GPT2_VOCAB_SHA256}")
    dest.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(dest, data)
    return dest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dest", type=Path, default=None, help=f"output file (default {default_vocab_path()})")
    args = parser.parse_args(argv)
    try:
        print(fetch_gpt2_vocab(args.dest))
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
