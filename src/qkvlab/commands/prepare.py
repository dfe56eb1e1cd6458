"""Tokenize a corpus once into train.bin/val.bin + meta.json, streaming, before any training launch.

Run it once (one process) before `torchrun ... qkvlab train`: ranks of a multi-process run never
tokenize, they find the prepared corpus by the same --data/--tokenizer (or take --data PREPARED_FOLDER).
Interrupted runs resume where they stopped; a finished one is reused.

  qkvlab prepare --data corpus/ --tokenizer gpt2
  qkvlab prepare --data big.jsonl --tokenizer gpt2 --split stream --out /shared/prepared/big
"""

from __future__ import annotations

import time

from qkvlab.data.prepare import SPLIT_RULES, prepare
from qkvlab.settings import finite_float, nonempty, positive_int
from qkvlab.tasks.lm import DEFAULT_TOKENIZER


def add_arguments(p) -> None:
    p.add_argument(
        "--data",
        type=nonempty,
        metavar="SOURCE",
        help="a text file or folder, .jsonl/.parquet ('text' per row), 'shakespeare[:genres]' or "
        "'hf:NAME?split=..&text_field=..' (default: the Shakespeare plays)",
    )
    p.add_argument(
        "--tokenizer",
        metavar="SPEC",
        default=DEFAULT_TOKENIZER,
        help=f"bpe:N, char or gpt2 (default {DEFAULT_TOKENIZER})",
    )
    p.add_argument(
        "--out", type=nonempty, metavar="DIR", help="output folder (default: the cache, where training looks)"
    )
    p.add_argument("--val-fraction", type=finite_float, default=0.1, metavar="F", help="validation share (default 0.1)")
    p.add_argument("--split", choices=SPLIT_RULES, default="document", help="per document (default) or stream tail")
    p.add_argument("--threads", type=positive_int, metavar="N", help="encoding threads (default: every CPU)")
    p.add_argument("--force", action="store_true", help="prepare again even if a finished one exists")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def run(args) -> int:
    t0 = time.perf_counter()
    data = prepare(
        args.data,
        args.tokenizer,
        args.out,
        val_fraction=args.val_fraction,
        split=args.split,
        force=args.force,
        progress=not args.quiet,
        threads=args.threads,
    )
    m, seconds = data.meta, time.perf_counter() - t0
    tokens = m["tokens"]["train"] + m["tokens"]["val"]
    how = "already prepared" if data.cached else f"prepared in {seconds:.1f} s"
    print(
        f"{data.out_dir}: {how}; {m['documents']:,} documents, {tokens:,} tokens "
        f"(train {m['tokens']['train']:,}, val {m['tokens']['val']:,}, {m['dtype']}), tokenizer {m['tokenizer']}"
    )
    return 0
