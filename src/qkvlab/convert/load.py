"""The one "load any model" path: a qkvlab model folder (or a run folder's checkpoint/), a Hugging
Face GPT-2/Llama folder (safetensors) or a .gguf file -> a qkvlab GPT and its tokenizer.

Every route ends in qkvlab.io.build_model_from_state (meta device, tensors assigned, every key
checked by name and shape, tied weights through io.tied_aliases): a missing tensor is refused by
name, never left at a random initialisation. `retrofit`, the `distill` teacher and `similarity`
read models through `load_any`; commands that take only qkvlab folders use io.load_model.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qkvlab.config import ModelConfig
from qkvlab.errors import UserError
from qkvlab.io import CONFIG, is_model_folder, load_model
from qkvlab.model import GPT

TOKENIZER_DIR = "tokenizer"


@dataclass
class Loaded:
    model: GPT  # on the CPU, eval mode; float32 for imports, as stored for qkvlab folders
    cfg: ModelConfig
    kind: str  # "qkvlab" or "hf"
    folder: Path  # the model folder (qkvlab), or the folder holding the HF tokenizer files
    body: dict[str, Any] | None = None  # a qkvlab folder's config.json
    tokenizer: Any = None  # .encode(str) -> ids; None when the model ships none


def load_any(path: str | Path, tokenizer: str | None = None) -> Loaded:
    """The model at `path` and its tokenizer (qkvlab folders: `tokenizer` (gpt2, bytes or a folder)
    wins over what the folder records; HF: the tokenizer files beside the weights)."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"{path}: no such file or folder")
    if path.is_dir() and not (path / CONFIG).exists() and (path / "checkpoint" / CONFIG).exists():
        path = path / "checkpoint"  # a run folder still training: its checkpoint
    if path.is_dir() and is_model_folder(path):
        from qkvlab.data.tokenizer import resolve_tokenizer

        model, cfg, body = load_model(path)
        return Loaded(model, cfg, "qkvlab", path, body, resolve_tokenizer(tokenizer, path, body))
    from qkvlab.convert.hf import from_hf, gguf_cache_folder, load_hf, quiet

    quiet()
    hf = load_hf(path)
    model, cfg = from_hf(hf)
    del hf
    if path.is_dir() and (path / CONFIG).exists():
        folder = path
    else:
        folder = gguf_cache_folder(path if path.is_file() else sorted(path.glob("*.gguf"))[0])
    if tokenizer is not None:  # the user's choice (gpt2, bytes or a folder) over the shipped one
        from qkvlab.data.tokenizer import resolve_tokenizer

        return Loaded(model, cfg, "hf", folder, None, resolve_tokenizer(tokenizer, folder, {}))
    return Loaded(model, cfg, "hf", folder, None, hf_tokenizer(folder))


def hf_tokenizer(folder: Path):
    """The transformers tokenizer saved in `folder`, or None: no tokenizer files (transformers then
    raises, or returns an empty tokenizer that encodes every text to nothing)."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(folder)
    except Exception:  # transformers raises many kinds for a folder without tokenizer files
        return None
    return tok if len(tok) > 0 and tok.encode("a b", add_special_tokens=False) else None
