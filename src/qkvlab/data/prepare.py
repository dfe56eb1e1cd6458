"""Tokenize a corpus once into flat token files that training reads through np.memmap.

Layout of a prepared folder:
  train.bin, val.bin      raw little-endian token ids (no header), dtype from meta.json
  meta.json               tokenizer spec, vocab size, dtype, token counts, split rule, checksums
  qkvlab_tokenizer.json   (+ bpe.json) the exact tokenizer, see `load_tokenizer`

Split rule ("document", the default): every document is tokenized whole, its first
round((1 - val_fraction) * n) tokens go to train and the rest to val, so validation covers every
document (every play) rather than whichever came last. Rule "stream": all documents are
concatenated and the last val_fraction of the token stream is val (better for many short
documents, e.g. dataset rows). When the tokenizer has an end-of-text id it follows each piece.

Re-running `prepare` with the same corpus text, tokenizer spec and split returns the existing
files untouched (`PreparedData.cached` is True).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

import qkvlab
from qkvlab.data.text import CorpusSource, cache_dir, corpus_checksum, describe_source, load_corpus
from qkvlab.data.tokenizer import Tokenizer, TokenizerSpec, build_tokenizer, encode_batch, load_tokenizer
from qkvlab.errors import UserError
from qkvlab.io import atomic_file, atomic_write

FORMAT_VERSION = 1
SPLIT_RULES = ("document", "stream")
META_NAME = "meta.json"


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


def _write_bin(path: Path, pieces: list[list[int]], eot: list[int], dtype: np.dtype) -> tuple[int, str]:
    """Stream pieces (each followed by `eot`) to `path` atomically; returns (token count, sha256
    of the bytes)."""
    h, count = hashlib.sha256(), 0
    with atomic_file(path, "wb") as f:
        for piece in pieces:
            if not piece:
                continue
            data = np.asarray(piece + eot, dtype=dtype).tobytes()
            f.write(data)
            h.update(data)
            count += len(piece) + len(eot)
    return count, h.hexdigest()


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


def _split_pieces(ids: list[list[int]], val_fraction: float, rule: str) -> tuple[list[list[int]], list[list[int]]]:
    if rule == "document":
        cuts = [len(x) - int(round(len(x) * val_fraction)) for x in ids]
        return [x[:c] for x, c in zip(ids, cuts)], [x[c:] for x, c in zip(ids, cuts)]
    total = sum(len(x) for x in ids)
    n_train = total - int(round(total * val_fraction))
    train, val, seen = [], [], 0
    for x in ids:
        cut = min(max(n_train - seen, 0), len(x))
        if cut:
            train.append(x[:cut])
        if cut < len(x):
            val.append(x[cut:])
        seen += len(x)
    return train, val


def prepare(
    source: CorpusSource = None,
    tokenizer_spec: str | TokenizerSpec = "bpe",
    out_dir: str | os.PathLike[str] | None = None,
    val_fraction: float = 0.1,
    split: str = "document",
    force: bool = False,
) -> PreparedData:
    """Tokenize `source` (see `load_corpus`) into `out_dir` (default: a folder in the cache
    named by the inputs' key). Skipped when meta.json records the same inputs key."""
    if not 0.0 < val_fraction < 1.0:
        raise UserError(f"val_fraction must be between 0 and 1 (exclusive), got {val_fraction}")
    if split not in SPLIT_RULES:
        raise UserError(f"unknown split rule {split!r}; choose from {', '.join(SPLIT_RULES)}")
    spec = TokenizerSpec.parse(tokenizer_spec)
    docs = load_corpus(source)
    texts = [d.text for d in docs if d.text]
    if not texts:
        raise UserError(f"corpus {describe_source(source)!r} contains no text")
    corpus_sha = corpus_checksum(docs)
    key_fields = {
        "format": FORMAT_VERSION,
        "corpus_sha256": corpus_sha,
        "tokenizer": str(spec),
        "split": split,
        "val_fraction": val_fraction,
    }
    key = hashlib.sha256(json.dumps(key_fields, sort_keys=True).encode()).hexdigest()
    d = Path(out_dir) if out_dir is not None else cache_dir() / "prepared" / key[:16]

    if not force and (d / META_NAME).is_file():
        try:
            existing = load_prepared(d)
            if existing.meta.get("key") == key:
                existing.cached = True
                return existing
        except (UserError, ValueError, KeyError):
            pass  # stale or broken: prepare again
    d.mkdir(parents=True, exist_ok=True)
    (d / META_NAME).unlink(missing_ok=True)  # meta.json is written last: its presence means complete

    tok = build_tokenizer(spec, texts, corpus_sha=corpus_sha if spec.kind == "bpe" else None)
    dtype = token_dtype(tok.vocab_size)
    train_pieces, val_pieces = _split_pieces(encode_batch(tok, texts), val_fraction, split)
    eot = [] if tok.eot_id is None else [tok.eot_id]
    counts, bin_sha = {}, {}
    for name, pieces in (("train", train_pieces), ("val", val_pieces)):
        counts[name], bin_sha[name] = _write_bin(d / f"{name}.bin", pieces, eot, dtype)
        if counts[name] == 0:
            raise UserError(
                f"corpus {describe_source(source)!r} is too small: the {name} split is empty "
                f"with val_fraction={val_fraction}"
            )
    tok.save(d)
    meta = {
        "key": key,
        "qkvlab_version": qkvlab.__version__,
        "format": FORMAT_VERSION,
        "source": describe_source(source),
        "documents": len(texts),
        "corpus_sha256": corpus_sha,
        "tokenizer": str(spec),
        "tokenizer_name": tok.name,
        "vocab_size": tok.vocab_size,
        "eot_id": tok.eot_id,
        "dtype": dtype.name,
        "tokens": counts,
        "split": {"rule": split, "val_fraction": val_fraction},
        "bin_sha256": bin_sha,
    }
    atomic_write(d / META_NAME, json.dumps(meta, indent=2) + "\n")
    return load_prepared(d)


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
