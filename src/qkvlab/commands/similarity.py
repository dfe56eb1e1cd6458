"""Cosine similarity and effective rank of a model's query, key and value projections.

MODEL is a qkvlab model folder, a Hugging Face GPT-2/Llama folder (safetensors) or a .gguf file.
Definitions: docs/convert.md and qkvlab.analysis.similarity.
"""

from __future__ import annotations

import json
from pathlib import Path

from qkvlab.analysis.similarity import format_report, similarity
from qkvlab.errors import UserError


def add_arguments(p) -> None:
    p.add_argument("model", metavar="MODEL", help="qkvlab model folder, Hugging Face folder, or .gguf file")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def load_any(path: Path):
    """(GPT, ModelConfig) from a qkvlab folder, or imported from a transformers folder / GGUF."""
    if not path.exists():
        raise UserError(f"{path}: no such file or folder")
    cfg_file = path / "config.json"
    if path.is_dir() and cfg_file.exists():
        try:
            body = json.loads(cfg_file.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise UserError(f"{cfg_file}: not valid JSON ({e})") from None
        if isinstance(body, dict) and "model" in body:
            from qkvlab.io import load_model

            model, cfg, _ = load_model(path)
            return model, cfg
    from qkvlab.convert.hf import from_hf, load_hf, quiet

    quiet()
    return from_hf(load_hf(path))


def run(args) -> int:
    model, cfg = load_any(Path(args.model))
    rep = similarity(model, cfg)
    print(json.dumps(rep) if args.json else format_report(rep))
    return 0
