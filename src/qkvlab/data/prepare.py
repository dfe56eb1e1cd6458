"""Tokenize a corpus once, streaming, into flat token files that training reads through np.memmap.

Layout of a prepared folder:
  train.bin, val.bin      raw little-endian token ids (no header), dtype from meta.json
  meta.json               tokenizer spec, vocab size, dtype, token counts, split rule, checksums;
                          written last: its presence means complete
  progress.json           while preparing: where to resume (source position, token counts)
  qkvlab_tokenizer.json   (+ bpe.json) the exact tokenizer, see `load_tokenizer`

Sources (`--data`): Shakespeare (default), text files and folders (a file is one document),
`.jsonl` files (one document per line's "text") and `.parquet` files (a "text" column; needs pyarrow),
`hf:NAME?...` datasets (one document per row), or a list of `Document`s; read in pieces by
data/sources.py (UTF-8; encoding_errors="replace" reads what does not decode as U+FFFD, counted in
meta.json's replaced_characters). Pieces are encoded in batches by the tokenizer's parallel batch
encoder and appended to the files by data/token_writer.py.

Split rule ("document", the default): every document's first round((1 - val_fraction) * n) tokens
go to train and the rest to val, so validation covers every document (every play) rather than
whichever came last. Rule "stream": all documents are concatenated and the last val_fraction of the
token stream is val (better for many short documents, e.g. dataset rows).

The cache key is cheap: file paths, sizes and modification times (dataset fingerprints for hf:) plus
tokenizer and split; the content hash (meta.json's corpus_sha256) is computed once, at prepare time.
So training finds a prepared corpus without reading it, and ranks of a multi-process run never
tokenize: they load it or stop with one line naming `qkvlab prepare`. An interrupted prepare resumes
from progress.json (same inputs, same folder).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import islice
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

import qkvlab
from qkvlab.base.errors import UserError
from qkvlab.base.files import atomic_write, cache_dir, file_sha256
from qkvlab.base.folders import LOCK, no_lock_message
from qkvlab.base.model_files import json_key, read_json
from qkvlab.base.settings import setting
from qkvlab.data.sources import (
    ENCODING_ERRORS,
    Texts,
    Unit,
    content_hash,
    corpus_units,
    fingerprint,
    pieces,
)
from qkvlab.data.text import CorpusSource, describe_source
from qkvlab.data.token_writer import TokenWriter
from qkvlab.data.tokenizer import (
    DEFAULT_TOKENIZER,
    Tokenizer,
    TokenizerSpec,
    build_tokenizer,
    encode_batch,
    load_tokenizer,
)

try:
    import fcntl
except ImportError:  # not on Windows: the folder lock is a no-op there
    fcntl = None

FORMAT_VERSION = 2
SPLIT_RULES = ("document", "stream")
META_NAME = "meta.json"
PROGRESS_NAME = "progress.json"
BATCH_CHUNKS = 4  # pieces per encoding thread in one batch call, at most MAX_BATCH
MAX_BATCH = 64  # bounds memory: ~16 MB of text, ids at ~36 B each while they are Python lists
CHECKPOINT_SECONDS = 10.0  # progress.json this often (each one flushes and fsyncs the token files)
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
    meta = read_json(d, META_NAME, missing_ok=True)  # a folder given as --data is data: bounded, typed
    if meta is None:
        raise UserError(f"prepared data folder {str(d)!r} has no {META_NAME}; run prepare first")
    where = d / META_NAME
    if json_key(meta, "dtype", str, where) not in ("uint16", "uint32"):
        raise UserError(f"{where}: key 'dtype' must be 'uint16' or 'uint32', not {meta['dtype']!r}")
    dtype = np.dtype(meta["dtype"])
    json_key(meta, "vocab_size", int, where)
    tokens = json_key(meta, "tokens", dict, where)
    arrays = {}
    for split in ("train", "val"):
        path, count = d / f"{split}.bin", json_key(tokens, split, int, f"{where}'s 'tokens'")
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


# ---------------------------------------------------------------- prepare


def prepare_key(
    source: CorpusSource, spec: TokenizerSpec, split: str, val_fraction: float, encoding_errors: str = "strict"
) -> str:
    """The cache key: cheap (no content read) and the same on every rank."""
    fields = {
        "format": FORMAT_VERSION,
        "corpus": [fingerprint(u) for u in corpus_units(source, encoding_errors)],
        "tokenizer": str(spec),
        "split": split,
        "val_fraction": val_fraction,
    }
    if encoding_errors != "strict":  # strict keys stay as they were before the option existed
        fields["encoding_errors"] = encoding_errors
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


@dataclass
class PrepareConfig:
    """What `qkvlab prepare` reads: the arguments of `prepare`."""

    data: str | None = setting(
        None,
        help="a text file or folder, .jsonl/.parquet ('text' per row), 'shakespeare[:genres]', "
        "'hf:NAME?split=..&text_field=..', or several joined by '+' (default: the Shakespeare plays)",
        metavar="SOURCE",
    )
    tokenizer: str = setting(DEFAULT_TOKENIZER, help="bpe:N, char or gpt2", metavar="SPEC")
    out: str | None = setting(None, help="output folder (default: the cache, where training looks)", metavar="DIR")
    val_fraction: float = setting(0.1, help="validation share, in (0, 1)", metavar="F", positive=True, maximum=1)
    split: str = setting("document", help="per document or stream tail", choices=SPLIT_RULES)
    threads: int | None = setting(None, help="encoding threads (default: every CPU)", minimum=1)
    force: bool = setting(False, help="prepare again even if a finished one exists")
    quiet: bool = setting(False, help="no progress bar")
    encoding_errors: str = setting(
        "strict",
        help="bytes that are not UTF-8: refuse the corpus (strict), or read them as U+FFFD (replace, counted in meta.json)",
        choices=ENCODING_ERRORS,
    )


@dataclass
class _Job:
    """One prepare run's inputs, as `_prepare` and its steps read them."""

    source: CorpusSource
    spec: TokenizerSpec
    out: Path
    key: str
    val_fraction: float
    split: str
    encoding_errors: str


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
    encoding_errors: str = "strict",
) -> PreparedData:
    """Tokenize `source` (see the module doc) into `out_dir` (default: a folder in the cache named by
    the inputs' key); skipped when meta.json records the same key, resumed when progress.json does.
    A prepared folder given as `source` is opened as it is. tokenize=False (ranks of a multi-process
    run): a missing prepared corpus is a UserError naming the prepare command. encoding_errors:
    "strict" refuses text that is not UTF-8, "replace" reads it as U+FFFD and counts it."""
    if not 0.0 < val_fraction < 1.0:
        raise UserError(f"val_fraction must be between 0 and 1 (exclusive), got {val_fraction}")
    if split not in SPLIT_RULES:
        raise UserError(f"unknown split rule {split!r}; choose from {', '.join(SPLIT_RULES)}")
    if is_prepared_folder(source):
        data = load_prepared(Path(source).expanduser())  # type: ignore[arg-type]
        data.cached = True
        return data
    spec = TokenizerSpec.parse(tokenizer_spec)
    key = prepare_key(source, spec, split, val_fraction, encoding_errors)
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
            + ("" if encoding_errors == "strict" else f" --encoding-errors {encoding_errors}")
            + "` once before launching"
        )
    _check_target(d)
    created = not d.exists()
    d.mkdir(parents=True, exist_ok=True)
    try:
        with _exclusive(d):  # two processes preparing the same corpus: the second waits, then reuses
            if not force and (found := _cached(d, key)) is not None:
                return found
            job = _Job(source, spec, d, key, val_fraction, split, encoding_errors)
            return _prepare(job, force=force, progress=progress, threads=threads)
    except UserError:
        if created:  # a refused corpus leaves no half-prepared folder (an interruption keeps it: it resumes)
            shutil.rmtree(d, ignore_errors=True)
        raise


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
    if fcntl is None:
        yield
        return
    fd = os.open(d / LOCK, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as e:
            raise UserError(no_lock_message("--out", d, e)) from None
        yield
    finally:
        os.close(fd)  # closing drops the lock


def _prepare(job: _Job, *, force: bool, progress: bool, threads: int | None) -> PreparedData:
    d = job.out
    units = corpus_units(job.source, job.encoding_errors)
    (d / META_NAME).unlink(missing_ok=True)  # meta.json is written last: its presence means complete
    state = _start_state(job, units, resume=not force)
    if (d / "qkvlab_tokenizer.json").is_file() and state.get("tokenizer_saved"):
        tok = load_tokenizer(d)
    else:  # char and BPE fit the corpus (pass 2, streaming; BPE is cached by content hash)
        sha = state["corpus_sha256"] if job.spec.kind == "bpe" else None
        tok = build_tokenizer(job.spec, Texts(units), corpus_sha=sha)
        tok.save(d)
        state["tokenizer_saved"] = True
    writer = TokenWriter(d, token_dtype(tok.vocab_size), tok.eot_id, job.val_fraction, job.split, state)
    _encode(units, tok, writer, state, d, f"prepare {job.spec}" if progress else None, threads)
    for name in ("train", "val"):
        if writer.counts[name] == 0:
            (d / PROGRESS_NAME).unlink(missing_ok=True)
            raise UserError(
                f"corpus {describe_source(job.source)!r} is too small: the {name} split is empty "
                f"with val_fraction={job.val_fraction}"
            )
    meta = {
        "key": job.key,
        "qkvlab_version": qkvlab.__version__,
        "format": FORMAT_VERSION,
        "source": describe_source(job.source),
        "documents": writer.documents,
        "corpus_sha256": state["corpus_sha256"],
        "tokenizer": str(job.spec),
        "tokenizer_name": tok.name,
        "vocab_size": tok.vocab_size,
        "eot_id": tok.eot_id,
        "dtype": writer.dtype.name,
        "tokens": writer.counts,
        "split": {"rule": job.split, "val_fraction": job.val_fraction},
        "bin_sha256": {name: file_sha256(d / f"{name}.bin") for name in ("train", "val")},
    }
    if job.encoding_errors != "strict":
        meta.update(encoding_errors=job.encoding_errors, replaced_characters=state.get("replaced", 0))
    atomic_write(d / META_NAME, json.dumps(meta, indent=2) + "\n")
    (d / PROGRESS_NAME).unlink(missing_ok=True)
    return load_prepared(d)


def _start_state(job: _Job, units: list[Unit], *, resume: bool) -> dict:
    """What progress.json records for this job (resume), or a fresh state after pass 1, the content
    hash (nothing else is trusted from an earlier run then)."""
    path = job.out / PROGRESS_NAME
    if resume and path.is_file():
        saved = json.loads(path.read_text())
        if saved.get("key") == job.key and not saved.get("finishing") and "corpus_sha256" in saved:
            return saved
    sha, n_docs = content_hash(units)
    if n_docs == 0:
        raise UserError(f"corpus {describe_source(job.source)!r} contains no text")
    state = {
        "key": job.key,
        "corpus_sha256": sha,
        "unit": 0,
        "position": 0,
        "bytes_done": 0,
        "tokens": {"train": 0, "val": 0},
    }
    for split_name in ("train", "val"):
        (job.out / f"{split_name}.bin").unlink(missing_ok=True)
    atomic_write(path, json.dumps(state))
    return state


def _encode(units: list[Unit], tok, writer: TokenWriter, state: dict, d: Path, bar_desc, threads) -> None:
    """Pass 3: every unit from where `state` says, encoded in parallel batches into `writer`;
    progress.json every CHECKPOINT_SECONDS. bar_desc: a progress bar's label (None: no bar)."""
    bar = None
    if bar_desc is not None:
        total = sum(u.size for u in units) or None
        bar = tqdm(
            total=total, initial=state["bytes_done"], unit="B", unit_scale=True, desc=bar_desc, dynamic_ncols=True
        )
    threads = threads or (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
    per_batch = min(MAX_BATCH, BATCH_CHUNKS * threads)
    bytes_done, last_checkpoint = state["bytes_done"], time.monotonic()
    try:
        for ui in range(state["unit"], len(units)):
            stream = pieces(units[ui], state["position"] if ui == state["unit"] else 0)
            while batch := list(islice(stream, per_batch)):
                ids = encode_batch(tok, [p.text for p in batch])  # parallel: tiktoken / tokenizers threads
                for piece, x in zip(batch, ids):
                    writer.add(np.asarray(x, dtype=writer.dtype), piece.end)
                done = sum(p.consumed for p in batch)
                state["replaced"] = state.get("replaced", 0) + sum(p.replaced for p in batch)
                if time.monotonic() - last_checkpoint >= CHECKPOINT_SECONDS:
                    state.update(writer.checkpoint(), unit=ui, position=batch[-1].position)
                    state["bytes_done"] = bytes_done + done
                    atomic_write(d / PROGRESS_NAME, json.dumps(state))
                    last_checkpoint = time.monotonic()
                bytes_done += done
                if bar is not None:
                    bar.update(done)
            state.update(unit=ui + 1, position=0)
        state.update(writer.checkpoint(), finishing=True)  # the last step rewrites the files: not resumable
        atomic_write(d / PROGRESS_NAME, json.dumps(state))
        writer.finish()
    finally:
        if bar is not None:
            bar.close()


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
