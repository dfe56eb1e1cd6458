"""The retrofit's source and text: any model the one loader reads (convert/load.py) with its tokenizer, and the
corpus split into training text (every document's first 1 - f) and held-out text (its last f)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save
from tqdm.auto import tqdm

from qkvlab.base.errors import UserError
from qkvlab.base.files import atomic_write
from qkvlab.convert.load import TOKENIZER_DIR, load_any
from qkvlab.data.text import load_corpus
from qkvlab.data.tokenizer import load_tokenizer
from qkvlab.model.config import ModelConfig
from qkvlab.model.transformer import GPT

TOKENS_FILE = "tokens.safetensors"


# ---- the source: any model the one loader reads, with its tokenizer ---------------------------------
@dataclass
class Source:
    model: GPT
    cfg: ModelConfig
    encode: Callable[[str], list[int]]
    eot_id: int | None
    kind: str  # "qkvlab" or "hf"
    tokenizer_dir: Path | None = None  # qkvlab: the folder's tokenizer/, copied beside the result
    decode: Callable[[list[int]], str] | None = None
    hf_tokenizer: Any = None  # hf: the transformers tokenizer, saved into the result's tokenizer/
    generation_config: Path | None = None  # hf: its generation_config.json (end-of-turn ids), if any


def load_source(path: str | Path) -> Source:
    """The model (float32 or as stored) and its tokenizer (convert/load.py)."""
    m = load_any(path)
    if m.kind == "qkvlab" and m.tokenizer_dir is None:  # a qkvlab tokenizer (else transformers' files in tokenizer/)
        tok_dir = m.folder / TOKENIZER_DIR
        if not tok_dir.is_dir():
            raise UserError(f"{path}: no tokenizer/ folder (qkvlab train writes one); retrofit needs it to read text")
        tok = load_tokenizer(tok_dir)
        return Source(m.model, m.cfg, tok.encode, tok.eot_id, "qkvlab", tok_dir, tok.decode)
    tok = m.tokenizer
    if tok is None:
        raise UserError(f"{path}: no usable tokenizer beside the weights (no tokenizer files in {m.folder})")

    def encode(text: str) -> list[int]:
        return tok(text, add_special_tokens=False)["input_ids"]

    gen = None if m.tokenizer_dir is None else m.tokenizer_dir / "generation_config.json"
    if m.kind == "qkvlab":  # its tokenizer/ holds transformers' files: copied to the result as they are
        return Source(m.model, m.cfg, encode, tok.eos_token_id, "qkvlab", m.tokenizer_dir, tok.decode)
    return Source(m.model, m.cfg, encode, tok.eos_token_id, "hf", None, tok.decode, tok, gen)


# ---- text: calibration/training tokens and held-out tokens ----------------------------------------
def corpus_tokens(
    src: Source, data: Any = None, heldout_fraction: float = 0.1, *, progress: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every document's first (1 - f) tokens train (and calibrate), its last f are held out."""
    train: list[int] = []
    held: list[int] = []
    eot = [] if src.eot_id is None else [src.eot_id]
    for doc in tqdm(load_corpus(data), desc="tokenizing", unit="doc", disable=not progress, leave=False):
        if not doc.text:
            continue
        ids = src.encode(doc.text)
        cut = round(len(ids) * (1 - heldout_fraction))
        train += ids[:cut] + eot
        held += ids[cut:] + eot
    if len(train) < 2 or len(held) < 2:
        raise UserError(f"corpus {data!r} is too small to hold out {heldout_fraction:.0%} of it")
    return torch.tensor(train, dtype=torch.long), torch.tensor(held, dtype=torch.long)


def write_tokens(path: Path, train: torch.Tensor, held: torch.Tensor) -> None:
    """Atomically (qkvlab.model.folder): a resumed retrofit must never read a half-written file."""
    atomic_write(path, save({"train": train.contiguous(), "val": held.contiguous()}))
