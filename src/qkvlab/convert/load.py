"""The one "load any model" path: a qkvlab model folder (or a run folder's checkpoint/), a Hugging
Face GPT-2/Llama folder (safetensors) or a .gguf file -> a qkvlab GPT and its tokenizer.

A tokenizer comes with the model: a qkvlab folder's tokenizer/ holds a qkvlab tokenizer or the
transformers tokenizer files `convert --from-hf` carried over (special tokens, chat template,
generation_config.json's end-of-turn ids); an HF folder's and a GGUF's are transformers'.

Every route ends in qkvlab.model.folder.build_model_from_state (meta device, tensors assigned, every key
checked by name and shape, tied weights through io.tied_aliases): a missing tensor is refused by
name, never left at a random initialisation. `retrofit`, the `distill` teacher and `similarity`
read models through `load_any`; commands that take only qkvlab folders use io.load_model.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qkvlab.base.errors import UserError
from qkvlab.base.model_files import HF_FILES, check_folder, member, model_root, read_json
from qkvlab.convert.hf import from_hf, gguf_cache_folder, load_hf, quiet
from qkvlab.data.tokenizer import META_FILE, resolve_tokenizer
from qkvlab.model.config import ModelConfig
from qkvlab.model.folder import CONFIG, is_model_folder, load_model, run_checkpoint
from qkvlab.model.transformer import GPT

TOKENIZER_DIR = "tokenizer"
HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")  # either marks a transformers tokenizer folder
TOKENIZER_FILES = (*HF_TOKENIZER_FILES, "vocab.json", "merges.txt", "tokenizer.model")  # any: a tokenizer to read


@dataclass
class Loaded:
    model: GPT  # on the CPU, eval mode; float32 for imports, as stored for qkvlab folders
    cfg: ModelConfig
    kind: str  # "qkvlab" or "hf"
    folder: Path  # the model folder (qkvlab), or the folder holding the HF tokenizer files
    body: dict[str, Any] | None = None  # a qkvlab folder's config.json
    tokenizer: Any = None  # .encode(str) -> ids; None when the model ships none
    tokenizer_dir: Path | None = None  # the folder a transformers tokenizer was read from


def load_any(path: str | Path, tokenizer: str | None = None) -> Loaded:
    """The model at `path` and its tokenizer (`tokenizer`: gpt2, bytes, a saved qkvlab tokenizer's
    folder or a transformers tokenizer's, wins over what the model carries)."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"{path}: no such file or folder")
    path = run_checkpoint(path) or path  # a run folder still training: its checkpoint
    if path.is_dir() and is_model_folder(path):
        model, cfg, body = load_model(path)
        tok, tok_dir = model_tokenizer(tokenizer, path, body)
        return Loaded(model, cfg, "qkvlab", path, body, tok, tok_dir)
    quiet()
    hf = load_hf(path)
    model, cfg = from_hf(hf)
    del hf
    if path.is_dir() and (path / CONFIG).exists():
        folder = path
    else:
        folder = gguf_cache_folder(path if path.is_file() else sorted(path.glob("*.gguf"))[0])
    if tokenizer is not None:  # the user's choice over the shipped one
        tok, tok_dir = model_tokenizer(tokenizer, folder, {})
        return Loaded(model, cfg, "hf", folder, None, tok, tok_dir)
    tok = hf_tokenizer(folder)
    return Loaded(model, cfg, "hf", folder, None, tok, folder if tok is not None else None)


def is_hf_tokenizer_folder(folder: Path) -> bool:
    return (
        folder.is_dir()
        and not (folder / META_FILE).exists()
        and any((folder / f).is_file() for f in HF_TOKENIZER_FILES)
    )


def model_tokenizer(choice: str | None, model_dir: Path, body: dict) -> tuple[Any, Path | None]:
    """The tokenizer of a model folder and, for a transformers one, the folder it was read from:
    `choice` wins; else the folder's tokenizer/ (qkvlab's or transformers' files, inside the folder);
    else what its config records (data/tokenizer.py's resolve_tokenizer)."""
    if choice is not None and is_hf_tokenizer_folder(Path(choice)):
        tok = hf_tokenizer(Path(choice))
        if tok is None:
            raise UserError(f"--tokenizer {choice}: transformers could not read a tokenizer there")
        return tok, Path(choice)
    if choice is None:
        root = model_root(model_dir)
        tok_dir = member(model_dir, TOKENIZER_DIR, "folder", within=root, missing_ok=True)
        if tok_dir is not None and is_hf_tokenizer_folder(tok_dir):
            tok = hf_tokenizer(tok_dir, within=root)
            return tok, tok_dir if tok is not None else None
    return resolve_tokenizer(choice, model_dir, body), None


def save_hf_tokenizer(tok, folder: Path, generation_config: Path | None = None) -> None:
    """A transformers tokenizer's files (and the generation_config.json holding a model's end-of-turn
    ids, when there is one) into `folder`, so the model it belongs to keeps its text, special tokens
    and chat template."""
    folder.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(folder)
    if generation_config is not None and generation_config.is_file():
        shutil.copyfile(generation_config, folder / "generation_config.json")


def hf_tokenizer(folder: Path, *, within: Path | None = None):
    """The transformers tokenizer saved in `folder`, or None when it holds no tokenizer files. Its
    files are read as data first (qkvlab.base.model_files: inside `folder`, or the model folder
    `within` that holds it; bounded; JSON settings parsed, no path-valued key pointing elsewhere);
    files transformers cannot read are one line naming the folder."""
    from transformers import AutoTokenizer  # optional: transformers

    if not any(os.path.lexists(folder / name) for name in TOKENIZER_FILES):
        return None
    check_folder(folder, within=within)
    for name, kind in HF_FILES.items():
        if name.endswith(".json") and kind == "tokenizer settings":
            _check_named_files(folder, read_json(folder, name, kind, within=within, missing_ok=True), name, within)
    try:
        tok = AutoTokenizer.from_pretrained(folder, local_files_only=True, trust_remote_code=False)
        empty = len(tok) == 0 or not tok.encode("a b", add_special_tokens=False)
    except Exception as e:  # transformers and tokenizers raise many kinds for damaged files
        raise UserError(
            f"{folder}: transformers could not read its tokenizer files ({str(e).splitlines()[0][:160]})"
        ) from None
    if empty:
        raise UserError(f"{folder}: its tokenizer files give an empty tokenizer (it encodes text to nothing)")
    return tok


def _check_named_files(folder: Path, body: dict | None, name: str, within: Path | None) -> None:
    """A tokenizer settings file's keys that name files (vocab_file, tokenizer_file, ...): each a file
    inside the folder, or null."""
    for k, v in (body or {}).items():
        if k.endswith(("_file", "_files")) and v is not None:
            for each in v if isinstance(v, list) else [v]:
                member(folder, each, "vocabulary", within=within, named_by=f"{folder / name}'s {k!r}", missing_ok=True)
