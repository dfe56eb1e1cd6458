#!/usr/bin/env bash
# The scaling sweep's corpus (compare/recipes.py SWEEP_CORPUS): the Linux 6.12 sources from Debian's
# linux-source-6.12, 280 MB of text as .jsonl shards (scripts/build_sweep_corpus.py says which files),
# tokenized by `qkvlab prepare` (BPE-1024 trained on it, the held-out 0.15% at the stream's end), and
# packed for the GPU lease (benchmarks/gpu_sweep.py --pack: xz, ~48 MiB). Everything lands in
# data/sweep/ (git-ignored). Safe to re-run: each step is skipped when its output is complete.
#
#   bash scripts/setup_sweep_corpus.sh               # the whole corpus: ~10-20 min on 2 cores (niced)
#   MAX_MB=5 OUT_DIR=/tmp/sweep bash scripts/setup_sweep_corpus.sh   # a small subset: the same path in seconds
#
# Where apt is not usable (not root, no network) it says so and stops; the .deb's version is pinned so
# that the corpus (and its sha256, in the prepared meta.json) is the same wherever it is built.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python}
VERSION=${LINUX_SOURCE_VERSION:-6.12.118-1~deb12u1}
ARCHIVE=/usr/src/linux-source-6.12.tar.xz
read -r DEFAULT_MB PREPARED VAL SPLIT TOKENIZER < <(PYTHONPATH="$ROOT/src" $PY -c '
from qkvlab.compare.recipes import SWEEP_CORPUS, SWEEP_CORPUS_MB, SWEEP_CORPUS_PREPARE as p
print(SWEEP_CORPUS_MB, SWEEP_CORPUS, p["val_fraction"], p["split"], p["tokenizer"])')
MAX_MB=${MAX_MB:-$DEFAULT_MB}
OUT_DIR=${OUT_DIR:-$ROOT/data/sweep}
TEXT="$OUT_DIR/linux-6.12"
# the recipes read the full corpus at its fixed path; a subset goes beside it, never in its place
if [ "$MAX_MB" = "$DEFAULT_MB" ] && [ "$OUT_DIR" = "$ROOT/data/sweep" ]; then PREP="$ROOT/$PREPARED"; else PREP="$OUT_DIR/prepared"; fi

if [ ! -f "$ARCHIVE" ]; then
  if ! command -v apt-get >/dev/null || [ "$(id -u)" != 0 ]; then
    echo "setup_sweep_corpus: $ARCHIVE is missing and apt-get is not usable here (needs root): install linux-source-6.12=$VERSION" >&2
    exit 1
  fi
  apt-get update -qq
  # not `apt-cache ... | grep -q`: grep's early exit gives apt-cache SIGPIPE, which pipefail reports as a failure
  offered=$(apt-cache policy linux-source-6.12)
  grep -qF "$VERSION" <<<"$offered" || {
    echo "setup_sweep_corpus: linux-source-6.12=$VERSION is not offered by apt here (apt-cache policy linux-source-6.12)" >&2
    exit 1
  }
  nice -n 19 apt-get install -y -qq "linux-source-6.12=$VERSION" >/dev/null
fi
if [ ! -f "$TEXT/manifest.json" ]; then
  rm -rf "$TEXT"
  nice -n 19 $PY "$ROOT/scripts/build_sweep_corpus.py" "$ARCHIVE" "$TEXT" --max-mb "$MAX_MB"
fi
# --threads 1: the shared machine's other core stays with whatever else runs
PYTHONPATH="$ROOT/src" OMP_NUM_THREADS=1 RAYON_NUM_THREADS=1 nice -n 19 $PY -m qkvlab prepare --data "$TEXT" \
  --tokenizer "$TOKENIZER" --split "$SPLIT" --val-fraction "$VAL" --out "$PREP" --threads 1 --quiet
if [ "$PREP" = "$ROOT/$PREPARED" ] && [ ! -f "$OUT_DIR/gpu-carry/carry.json" ]; then
  PYTHONPATH="$ROOT/src" nice -n 19 $PY "$ROOT/benchmarks/gpu_sweep.py" --pack --carry "$OUT_DIR/gpu-carry"
fi
