"""Tokenize a corpus once into train.bin/val.bin + meta.json, streaming, before any training launch.

Run it once (one process) before `torchrun ... qkvlab train`: ranks of a multi-process run never
tokenize, they find the prepared corpus by the same --data/--tokenizer (or take --data PREPARED_FOLDER).
Interrupted runs resume where they stopped; a finished one is reused.

  qkvlab prepare --data corpus/ --tokenizer gpt2
  qkvlab prepare --data big.jsonl --tokenizer gpt2 --split stream --out /shared/prepared/big
"""

from __future__ import annotations

import time
from dataclasses import asdict

from qkvlab.base.settings import add_config_options, add_options, load, print_config
from qkvlab.data.prepare import PrepareConfig, prepare


def add_arguments(p) -> None:
    add_config_options(p, "prepare settings")
    add_options(p, PrepareConfig)


def run(args) -> int:
    cfg = load(PrepareConfig, args.config, args)
    if print_config(args, asdict(cfg)):
        return 0
    t0 = time.perf_counter()
    data = prepare(
        cfg.data,
        cfg.tokenizer,
        cfg.out,
        val_fraction=cfg.val_fraction,
        split=cfg.split,
        force=cfg.force,
        progress=not cfg.quiet,
        threads=cfg.threads,
        encoding_errors=cfg.encoding_errors,
    )
    m, seconds = data.meta, time.perf_counter() - t0
    tokens = m["tokens"]["train"] + m["tokens"]["val"]
    how = "already prepared" if data.cached else f"prepared in {seconds:.1f} s"
    print(
        f"{data.out_dir}: {how}; {m['documents']:,} documents, {tokens:,} tokens "
        f"(train {m['tokens']['train']:,}, val {m['tokens']['val']:,}, {m['dtype']}), tokenizer {m['tokenizer']}"
        + (f"; {m['replaced_characters']:,} undecodable bytes read as U+FFFD" if m.get("replaced_characters") else "")
    )
    return 0
