"""Record the LM training split's size in a compare folder's compare.json (metrics.lm.train_tokens),
for folders written before compare recorded it: the sweep's epochs are counted in it.

    python scripts/record_split_tokens.py docs/results/scaling --tokenizer bpe:1024 [--data PATH]

It tokenizes the corpus as the runs did (qkvlab.data.prepare caches it) and counts the training
split; nothing else in compare.json changes.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from qkvlab.analysis.runs import read_manifest, write_manifest
from qkvlab.tasks.lm import LMTask


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("folder", type=Path)
    p.add_argument("--tokenizer", required=True, help="the runs' tokenizer, e.g. bpe:1024")
    p.add_argument("--data", default=None, help="the runs' corpus (default: the Shakespeare plays)")
    args = p.parse_args()
    manifest = read_manifest(args.folder)
    task = LMTask(data=args.data, tokenizer=args.tokenizer)
    n = len(task.prepared.train)
    lm = manifest.setdefault("metrics", {}).setdefault("lm", {"metric": "val_loss", "higher_is_better": False})
    lm["train_tokens"] = n
    write_manifest(args.folder, manifest)
    print(f"{args.folder}: training split {n:,} tokens ({args.tokenizer})")


if __name__ == "__main__":
    main()
