"""Score every finished run under the given compare folders on its test split again (test.json),
where test.json is missing or predates per-unit scores (`--all`: every run).

    python scripts/rescore_test.py runs/compare-lm [more folders] [--all]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tqdm import tqdm

from qkvlab.train.rescore import rescore


def stale(run_dir: Path) -> bool:
    test = run_dir / "test.json"
    return not test.is_file() or "per_unit" not in json.loads(test.read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("folders", nargs="+", type=Path)
    p.add_argument("--all", action="store_true", help="rescore every finished run, not only stale ones")
    args = p.parse_args()
    runs = sorted(
        d.parent for f in args.folders for d in f.rglob("model.safetensors") if (d.parent / "metrics.jsonl").is_file()
    )
    todo = [d for d in runs if args.all or stale(d)]
    print(f"{len(todo)} of {len(runs)} runs to score")
    for d in tqdm(todo, desc="test split"):
        rescore(d)


if __name__ == "__main__":
    main()
