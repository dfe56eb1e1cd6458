"""The token files a prepared folder holds, as they are written: documents' ids appended to
train.bin / val.bin under the split rule, resumable from any checkpoint.

Split rule "document": every document's first round((1 - val_fraction) * n) tokens go to train and
the rest to val. Rule "stream": all documents are concatenated and the last val_fraction of the
ids (end-of-text separators not counted) is val. When the tokenizer has an end-of-text id it
follows each piece. Memory stays bounded: a document longer than SPILL_TOKENS goes to train.bin as
it comes, and its val tail is moved over when it ends.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from qkvlab.base.errors import NO_ROOM, no_room

KEPT_UNTIL_CHECKPOINT = "the tokens written up to the last progress.json are kept, and preparing resumes there"
SPILL_TOKENS = 1 << 24  # a document longer than this goes to train.bin as it comes (split at its end)


class TokenWriter:
    """Appends documents' ids to train.bin/val.bin under the split rule. A document is held in
    memory until it ends or passes SPILL_TOKENS; then it goes to train.bin and its val tail is moved
    over when it ends. What `checkpoint()` returns is everything a resume needs."""

    def __init__(self, d: Path, dtype: np.dtype, eot: int | None, val_fraction: float, rule: str, state: dict):
        self.dtype, self.val_fraction, self.rule = dtype, val_fraction, rule
        self.eot = np.asarray([] if eot is None else [eot], dtype=dtype)
        self.files = {}
        self.paths = {split: d / f"{split}.bin" for split in ("train", "val")}
        for split, path in self.paths.items():
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

    @contextlib.contextmanager
    def _writing(self, split: str) -> Iterator[None]:
        """An OS error while writing a split names its file; a full disk is the one-line NoRoom,
        which says that what was written up to the last checkpoint is kept and resumed from."""
        try:
            yield
        except OSError as e:
            if e.errno in NO_ROOM:
                raise no_room(self.paths[split], kept=KEPT_UNTIL_CHECKPOINT) from None
            raise OSError(e.errno, e.strerror, str(self.paths[split])) from None

    def _append(self, split: str, *arrays: np.ndarray) -> None:
        for a in arrays:
            if len(a):
                with self._writing(split):
                    self.files[split].write(a.tobytes())
                self.counts[split] += len(a)

    def _sync(self) -> None:
        for split, f in self.files.items():
            with self._writing(split):
                f.flush()
                os.fsync(f.fileno())

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
        self._sync()
        doc = {"start": self.doc_start, "tokens": self.spilled} if self.spilled else None
        return {"tokens": dict(self.counts), "content_tokens": self.content, "documents": self.documents, "doc": doc}

    def finish(self) -> None:
        """The stream rule's cut: the last val_fraction of the ids (separators not counted) to val."""
        if self.rule == "stream" and self.content:
            n_train = self.content - int(round(self.content * self.val_fraction))
            self._move_tail(self._stream_cut(n_train))
        self._sync()
        for f in self.files.values():
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
            with self._writing("train"):
                f.write(block.tobytes())
            hi = lo
        f.seek(at * size)
        with self._writing("train"):
            f.write(self.eot.tobytes())
        f.seek(0, os.SEEK_END)
        self.counts["train"] += 1
