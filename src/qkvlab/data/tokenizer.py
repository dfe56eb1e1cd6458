"""Tokenizers behind one small protocol: byte-level BPE trained on the corpus (`tokenizers`),
characters of the corpus, and GPT-2's r50k_base (`tiktoken`, from a local vocabulary file).

Specs are strings: 'bpe' / 'bpe:VOCAB', 'char', 'gpt2'. A tokenizer saves itself into a folder
(`qkvlab_tokenizer.json` plus, for BPE, `bpe.json`) and `load_tokenizer(folder)` restores it,
so a prepared data folder carries the exact tokenizer that made its ids. JSON only.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from qkvlab.base.errors import UserError
from qkvlab.base.files import atomic_write, cache_dir
from qkvlab.base.model_files import json_key, member, model_root, read_json, read_text
from qkvlab.data.fetch_gpt2_vocab import GPT2_VOCAB_FILENAME, GPT2_VOCAB_SHA256

if TYPE_CHECKING:
    import tokenizers

DEFAULT_BPE_VOCAB = 2048
DEFAULT_TOKENIZER = f"bpe:{DEFAULT_BPE_VOCAB}"  # the lm task's and `qkvlab prepare`'s
EOT_TOKEN = "<|endoftext|>"
META_FILE = "qkvlab_tokenizer.json"
BPE_FILE = "bpe.json"
KINDS = ("bpe", "char", "gpt2")


@runtime_checkable
class Tokenizer(Protocol):
    """What the rest of qkvlab relies on. `eot_id` separates documents when not None."""

    name: str
    vocab_size: int
    eot_id: int | None

    @property
    def spec(self) -> str: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def save(self, directory: str | os.PathLike[str]) -> Path: ...


@dataclass(frozen=True)
class TokenizerSpec:
    """Parsed spec string; `vocab_size` is only meaningful for BPE."""

    kind: str
    vocab_size: int | None = None

    @classmethod
    def parse(cls, spec: str | TokenizerSpec) -> TokenizerSpec:
        if isinstance(spec, TokenizerSpec):
            return spec
        kind, _, arg = str(spec).strip().lower().partition(":")
        if kind not in KINDS:
            raise UserError(f"unknown tokenizer {spec!r}; use 'bpe[:VOCAB]', 'char' or 'gpt2'")
        if kind != "bpe":
            if arg:
                raise UserError(f"tokenizer {kind!r} takes no argument, got {spec!r}")
            return cls(kind)
        if not arg:
            return cls("bpe", DEFAULT_BPE_VOCAB)
        if not arg.isdigit() or not 257 <= int(arg) <= 1 << 20:
            raise UserError(f"BPE vocabulary size in {spec!r} must be a whole number from 257 to {1 << 20}")
        return cls("bpe", int(arg))

    def __str__(self) -> str:
        return f"bpe:{self.vocab_size}" if self.kind == "bpe" else self.kind


def _write_json(path: Path, obj: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, json.dumps(obj, indent=2, ensure_ascii=False) + "\n")


# ---------------------------------------------------------------- byte-level BPE


class BPETokenizer:
    """Byte-level BPE (GPT-2 style pre-tokenizer, no prefix space) so any text round-trips."""

    def __init__(self, tok: tokenizers.Tokenizer, requested_vocab: int) -> None:
        self._tok = tok
        tok.encode_special_tokens = True  # a literal "<|endoftext|>" in text stays text, as with gpt2
        self.requested_vocab = requested_vocab
        self.vocab_size = tok.get_vocab_size()
        self.eot_id = tok.token_to_id(EOT_TOKEN)
        self.name = f"bpe-{requested_vocab}"

    @property
    def spec(self) -> str:
        return f"bpe:{self.requested_vocab}"

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int = DEFAULT_BPE_VOCAB) -> BPETokenizer:
        tok = HFTokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=[EOT_TOKEN],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator(texts, trainer=trainer, length=len(texts) if hasattr(texts, "__len__") else None)
        return cls(tok, vocab_size)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        # encode_batch_fast skips offset tracking (about 2x faster); older tokenizers lack it
        encode = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)
        return [e.ids for e in encode(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def save(self, directory: str | os.PathLike[str]) -> Path:
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        atomic_write(d / BPE_FILE, self._tok.to_str(pretty=True))
        _write_json(
            d / META_FILE,
            {"kind": "bpe", "spec": self.spec, "vocab_size": self.vocab_size, "eot_id": self.eot_id, "file": BPE_FILE},
        )
        return d

    @classmethod
    def load(cls, directory: Path, meta: dict) -> BPETokenizer:
        """From a saved folder: its meta file's "file" names the vocabulary, a file inside the folder."""
        where = directory / META_FILE
        spec = TokenizerSpec.parse(json_key(meta, "spec", str, where, default=f"bpe:{DEFAULT_BPE_VOCAB}"))
        if spec.kind != "bpe":
            raise UserError(f"{where}: kind 'bpe' with spec {str(spec)!r}; a BPE tokenizer's spec is 'bpe:VOCAB'")
        path = member(directory, json_key(meta, "file", str, where), "vocabulary", named_by=f"{where}'s 'file'")
        try:  # parsed from text read here, so the library opens no path the folder names
            tok = HFTokenizer.from_str(read_text(path))
        except Exception as e:  # tokenizers raises plain Exception for every malformed file
            raise UserError(f"{path}: not a tokenizers vocabulary ({str(e).splitlines()[0][:160]})") from None
        return cls(tok, spec.vocab_size or 0)


# ---------------------------------------------------------------- characters


class CharTokenizer:
    """One id per distinct character of the corpus, in code-point order. No end-of-text id."""

    name = "char"
    spec = "char"
    eot_id = None

    def __init__(self, chars: Sequence[str]) -> None:
        self.chars = list(chars)
        self.vocab_size = len(self.chars)
        self._ids = {c: i for i, c in enumerate(self.chars)}

    @classmethod
    def train(cls, texts: Iterable[str]) -> CharTokenizer:
        seen: set[str] = set()
        for t in texts:
            seen.update(t)
        return cls(sorted(seen))

    def encode(self, text: str) -> list[int]:
        try:
            return [self._ids[c] for c in text]
        except KeyError as e:
            raise UserError(f"character {e.args[0]!r} is not in the char tokenizer's vocabulary") from None

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(self.chars[i] for i in ids)

    def save(self, directory: str | os.PathLike[str]) -> Path:
        d = Path(directory)
        _write_json(
            d / META_FILE,
            {"kind": "char", "spec": "char", "vocab_size": self.vocab_size, "eot_id": None, "chars": self.chars},
        )
        return d


# ---------------------------------------------------------------- GPT-2 via tiktoken


def gpt2_vocab_candidates() -> list[Path]:
    """Places searched for r50k_base's vocabulary, in order: $QKVLAB_GPT2_VOCAB, then in
    $TIKTOKEN_CACHE_DIR the names tiktoken's own cache uses (sha1 of its URL) or
    gpt2.tiktoken / r50k_base.tiktoken, then <qkvlab cache>/gpt2.tiktoken."""
    out: list[Path] = []
    if os.environ.get("QKVLAB_GPT2_VOCAB"):
        out.append(Path(os.environ["QKVLAB_GPT2_VOCAB"]).expanduser())
    if os.environ.get("TIKTOKEN_CACHE_DIR"):
        tdir = Path(os.environ["TIKTOKEN_CACHE_DIR"]).expanduser()
        url = "https://openaipublic.blob.core.windows.net/encodings/r50k_base.tiktoken"
        out += [tdir / hashlib.sha1(url.encode()).hexdigest(), tdir / GPT2_VOCAB_FILENAME, tdir / "r50k_base.tiktoken"]
    out.append(cache_dir() / GPT2_VOCAB_FILENAME)
    return out


def find_gpt2_vocab() -> Path:
    for p in gpt2_vocab_candidates():
        if p.is_file():
            return p
    raise UserError(
        "GPT-2 vocabulary (gpt2.tiktoken) not found; run `python -m qkvlab.data.fetch_gpt2_vocab`, or "
        "`pip download --no-deps openai-whisper==20250625`, extract whisper/assets/gpt2.tiktoken and set "
        f"QKVLAB_GPT2_VOCAB to it (searched: {', '.join(str(p) for p in gpt2_vocab_candidates())})"
    )


class GPT2Tokenizer:
    """r50k_base (50,257 ids, <|endoftext|> = 50256) built offline from a local file."""

    name = "gpt2"
    spec = "gpt2"
    vocab_size = 50257
    eot_id = 50256

    def __init__(self, vocab_path: Path | None = None) -> None:
        try:
            import tiktoken  # optional: tiktoken
            from tiktoken.load import load_tiktoken_bpe
            from tiktoken_ext.openai_public import r50k_pat_str
        except ImportError:
            raise UserError("tokenizer 'gpt2' needs tiktoken: pip install 'qkvlab[gpt2]'") from None

        self.vocab_path = vocab_path or find_gpt2_vocab()
        try:
            ranks = load_tiktoken_bpe(str(self.vocab_path), expected_hash=GPT2_VOCAB_SHA256)
        except ValueError:
            raise UserError(f"{str(self.vocab_path)!r} is not r50k_base's gpt2.tiktoken (sha256 mismatch)") from None
        self._enc = tiktoken.Encoding(
            name="r50k_base",
            pat_str=r50k_pat_str,
            mergeable_ranks=ranks,
            special_tokens={EOT_TOKEN: self.eot_id},
            explicit_n_vocab=self.vocab_size,
        )

    def encode(self, text: str) -> list[int]:
        """Ordinary encoding: a literal '<|endoftext|>' in user text is not the special id."""
        return self._enc.encode_ordinary(text)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self._enc.encode_ordinary_batch(list(texts))

    def decode(self, ids: Sequence[int]) -> str:
        return self._enc.decode(list(ids))

    def save(self, directory: str | os.PathLike[str]) -> Path:
        """Records only the spec and vocabulary digest; the 835 kB vocabulary stays in the cache."""
        d = Path(directory)
        _write_json(
            d / META_FILE,
            {
                "kind": "gpt2",
                "spec": "gpt2",
                "vocab_size": self.vocab_size,
                "eot_id": self.eot_id,
                "vocab_sha256": GPT2_VOCAB_SHA256,
            },
        )
        return d


# ---------------------------------------------------------------- construction


def bpe_cache_path(corpus_sha: str, vocab_size: int) -> Path:
    return cache_dir() / "tokenizers" / f"bpe-{vocab_size}-{corpus_sha[:16]}"


def build_tokenizer(
    spec: str | TokenizerSpec, texts: Iterable[str] | None = None, corpus_sha: str | None = None
) -> Tokenizer:
    """A tokenizer for `spec`. BPE and char are fitted to `texts`; a trained BPE is cached on
    disk under the corpus checksum and vocabulary size, so passing `corpus_sha` avoids retraining
    (texts are then only needed on a cache miss)."""
    s = TokenizerSpec.parse(spec)
    if s.kind == "gpt2":
        return GPT2Tokenizer()
    if s.kind == "char":
        if texts is None:
            raise UserError("the char tokenizer needs the corpus text to build its vocabulary")
        return CharTokenizer.train(texts)
    assert s.vocab_size is not None
    cached = bpe_cache_path(corpus_sha, s.vocab_size) if corpus_sha else None
    if cached is not None and (cached / META_FILE).is_file():
        return load_tokenizer(cached)
    if texts is None:
        raise UserError(f"BPE tokenizer {s} is not cached for this corpus and no text was given to train it")
    tok = BPETokenizer.train(texts, s.vocab_size)
    if cached is not None:
        tok.save(cached)
    return tok


def load_tokenizer(directory: str | os.PathLike[str], *, within: str | os.PathLike[str] | None = None) -> Tokenizer:
    """Restore a tokenizer saved with `.save(directory)` (e.g. a prepared data folder). Its files are
    data (qkvlab.base.model_files): inside `directory` (or the folder `within` that holds it), bounded
    in size, every key typed; anything else is one line naming the file."""
    d = Path(directory)
    if within is not None:  # a folder a model folder holds: inside it
        member(d.parent, d.name, "folder", within=within)
    meta = read_json(d, META_FILE, "tokenizer settings", within=within or d, missing_ok=True)
    if meta is None:
        raise UserError(f"no tokenizer in {str(d)!r} (missing {META_FILE})")
    path = d / META_FILE
    kind = json_key(meta, "kind", str, path)
    if kind == "bpe":
        return BPETokenizer.load(d, meta)
    if kind == "char":
        chars = json_key(meta, "chars", list, path)
        if not all(isinstance(c, str) and len(c) == 1 for c in chars) or len(set(chars)) != len(chars):
            raise UserError(f"{path}: key 'chars' must be a list of distinct single characters")
        return CharTokenizer(chars)
    if kind == "gpt2":
        return GPT2Tokenizer()
    raise UserError(f"{path}: names unknown tokenizer kind {kind!r}; known: {', '.join(KINDS)}")


def encode_batch(tok: Tokenizer, texts: Sequence[str]) -> list[list[int]]:
    """Batch-encode with the tokenizer's fast path when it has one."""
    fast = getattr(tok, "encode_batch", None)
    return fast(texts) if fast is not None else [tok.encode(t) for t in texts]


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255: works with any model of vocab >= 256, no files needed."""

    name = spec = "bytes"
    vocab_size = 256
    eot_id = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


TOKENIZER_DIR = "tokenizer"  # a model folder's (or its run's) saved tokenizer


def resolve_tokenizer(choice: str | None, model_dir: Path, body: dict) -> Tokenizer | None:
    """The tokenizer of a model folder: `choice` (gpt2, bytes, or a folder holding a saved qkvlab
    tokenizer) wins; else the folder's tokenizer/ (or its run's); else what its config records;
    else None. `body`: the folder's config.json."""
    if choice is not None:
        if choice == "bytes":
            return ByteTokenizer()
        if choice == "gpt2":
            return GPT2Tokenizer()
        if Path(choice).is_dir():
            return load_tokenizer(choice)
        raise UserError(f"--tokenizer {choice!r}: use gpt2, bytes, or a folder holding a saved qkvlab tokenizer")
    root = model_root(model_dir)  # a run's checkpoint/ reads the run's tokenizer/ beside it
    for folder in dict.fromkeys((model_dir / TOKENIZER_DIR, root / TOKENIZER_DIR)):
        if member(folder.parent, folder.name, "folder", within=root, missing_ok=True):  # there: it must load
            return load_tokenizer(folder, within=root)
    recorded = recorded_tokenizer(body, model_dir / "config.json")
    if recorded in ("gpt2", "bytes"):
        return GPT2Tokenizer() if recorded == "gpt2" else ByteTokenizer()
    if recorded is not None and member(model_dir, recorded, "folder", within=root, missing_ok=True):
        return load_tokenizer(model_dir / recorded, within=root)
    return None


def recorded_tokenizer(body: dict, where: Path) -> str | None:
    """The tokenizer a model's config.json records (its own "tokenizer" key, or the training task's
    option): a name (gpt2, bytes) or a folder inside the model folder; None when it records none."""
    recorded = json_key(body, "tokenizer", (str, type(None)), where, default=None)
    if recorded is None:
        train = json_key(body, "train", (dict, type(None)), where, default=None) or {}
        options = json_key(train, "task_options", (dict, type(None)), f"{where}'s 'train'", default=None) or {}
        recorded = json_key(options, "tokenizer", (str, type(None)), f"{where}'s 'train.task_options'", default=None)
    return recorded
