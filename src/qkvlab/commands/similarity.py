"""How alike are a model's query, key and value projections: linear CKA of their outputs on real text
(Paper B's measure), next to the weight cosine and the effective rank.

MODEL is a qkvlab model folder, a Hugging Face GPT-2/Llama folder (safetensors) or a .gguf file.
Text: --text FILE, else the default corpus (qkvlab.data.text). Definitions: docs/convert.md and
qkvlab.analysis.similarity.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from qkvlab.analysis.similarity import format_report, similarity
from qkvlab.convert.load import load_any
from qkvlab.errors import UserError

MAX_ROW = 1024  # tokens per sequence of the batch (at most the model's context)


def add_arguments(p) -> None:
    p.add_argument("model", metavar="MODEL", help="qkvlab model folder, Hugging Face folder, or .gguf file")
    p.add_argument("--text", metavar="FILE", help="UTF-8 text for the activation CKA (default: the default corpus)")
    p.add_argument("--tokens", type=int, default=1024, metavar="N", help="tokens of text to run (default 1024)")
    p.add_argument("--tokenizer", metavar="gpt2|bytes|DIR", help="tokenizer when a qkvlab folder records none")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def text_ids(tok, text_file: str | None, n_tokens: int, context: int, vocab_size: int) -> torch.Tensor:
    """The first n_tokens of the text as a batch (rows, L), L = min(context, MAX_ROW, n_tokens)."""
    if n_tokens < 2:
        raise UserError(f"--tokens={n_tokens} must be an integer >= 2")
    if text_file is not None:
        from qkvlab.io import read_user_text

        text = read_user_text(text_file, f"--text {text_file}")
    else:
        from qkvlab.data.text import load_corpus

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
    loaded = load_any(Path(args.model), args.tokenizer)
    model, cfg, tok = loaded.model, loaded.cfg, loaded.tokenizer
    ids = None
    if tok is not None:
        ids = text_ids(tok, args.text, args.tokens, cfg.context, cfg.vocab_size)
    elif args.text is not None:
        raise UserError(f"{args.model}: no tokenizer for --text; pass --tokenizer gpt2|bytes|DIR (qkvlab folders)")
    else:
        print(f"no CKA: {args.model} records no tokenizer; pass --tokenizer gpt2|bytes|DIR", file=sys.stderr)
    model.eval().float()
    rep = similarity(model, cfg, ids)
    if rep["cka"] is not None:
        rep["cka"]["text"] = args.text or "default corpus"
    print(json.dumps(rep) if args.json else format_report(rep))
    return 0
