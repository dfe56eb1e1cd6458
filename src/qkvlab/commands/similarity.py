"""How alike are a model's query, key and value projections: linear CKA of their outputs on real text
(Paper B's measure), next to the weight cosine and the effective rank.

MODEL is a qkvlab model folder, a Hugging Face GPT-2/Llama folder (safetensors) or a .gguf file.
Text: --text FILE, else the default corpus (qkvlab.data.text). Definitions: docs/convert.md and
qkvlab.analysis.similarity.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from pathlib import Path

import torch

from qkvlab.analysis.similarity import SimilarityConfig, format_report, similarity
from qkvlab.base.errors import UserError
from qkvlab.base.files import read_user_text
from qkvlab.base.settings import add_config_options, add_options, load, print_config
from qkvlab.convert.load import load_any
from qkvlab.data.text import load_corpus

MAX_ROW = 1024  # tokens per sequence of the batch (at most the model's context)


def add_arguments(p) -> None:
    add_config_options(p, "similarity settings")
    add_options(p, SimilarityConfig)


def text_ids(tok, text_file: str | None, n_tokens: int, context: int, vocab_size: int) -> torch.Tensor:
    """The first n_tokens of the text as a batch (rows, L), L = min(context, MAX_ROW, n_tokens)."""
    if n_tokens < 2:
        raise UserError(f"--tokens={n_tokens} must be an integer >= 2")
    if text_file is not None:
        text = read_user_text(text_file, f"--text {text_file}")
    else:
        text, docs = "", iter(load_corpus(None))
        while len(text) < 8 * n_tokens:  # a token is at most a few characters of English
            doc = next(docs, None)
            if doc is None:
                break
            text += doc.text + "\n\n"
    ids = list(tok.encode(text))[:n_tokens]
    if len(ids) < 2:
        raise UserError(f"{text_file or 'the default corpus'}: fewer than 2 tokens of text")
    if max(ids) >= vocab_size:
        raise UserError(f"the tokenizer gives id {max(ids)}, beyond the model's vocabulary of {vocab_size}")
    row = min(context, MAX_ROW, len(ids))
    rows = len(ids) // row
    return torch.tensor(ids[: rows * row]).view(rows, row)


def run(args) -> int:
    cfg = load(SimilarityConfig, args.config, args)
    if print_config(args, asdict(cfg)):
        return 0
    loaded = load_any(Path(cfg.model), cfg.tokenizer)
    model, model_cfg, tok = loaded.model, loaded.cfg, loaded.tokenizer
    ids = None
    if tok is not None:
        ids = text_ids(tok, cfg.text, cfg.tokens, model_cfg.context, model_cfg.vocab_size)
    elif cfg.text is not None:
        raise UserError(
            f"{cfg.model}: no tokenizer for --text (no tokenizer files, none recorded); pass --tokenizer gpt2|bytes|DIR"
        )
    else:
        print(
            f"no CKA: {cfg.model} has no tokenizer (no tokenizer files, none recorded); pass --tokenizer gpt2|bytes|DIR",
            file=sys.stderr,
        )
    model.eval().float()
    rep = similarity(model, model_cfg, ids)
    if rep["cka"] is not None:
        rep["cka"]["text"] = cfg.text or "default corpus"
    print(json.dumps(rep) if cfg.json else format_report(rep))
    return 0
