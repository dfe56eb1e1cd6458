#!/usr/bin/env bash
# Where CPU bf16 autocast pays: qkvlab fp32 vs qkvlab under bf16 autocast, one thread (compare's layout:
# parallel one-thread jobs), 5 alternating rounds, at widths 64 .. 384. The crossover sets
# the old `auto` rule (bf16 from d_model 192 on bf16-native CPUs; auto is now timed: qkvlab.decode.dtype_probe).
#   bash benchmarks/bf16_widths.sh            # from the repository root; ~3 min; needs avx512_bf16/AMX
set -u
ROOT=$(cd "$(dirname "$0")/.." && pwd)
export PYTHONPATH="$ROOT/src:$ROOT/benchmarks${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
# layers heads d_model context vocab batch: the main job's shape (d64), then wider models
for spec in "2 4 64 128 1024 16" "2 4 128 128 1024 16" "4 4 192 256 4096 8" "4 4 256 256 4096 8" "6 6 384 256 4096 8"; do
  set -- $spec
  echo "== L$1 h$2 d$3 T$4 V$5 B$6"
  "$PY" "$ROOT/benchmarks/train_throughput.py" --threads 1 --rounds 5 --n-layer "$1" --n-head "$2" --d-model "$3" \
    --context "$4" --vocab-size "$5" --batch "$6" --contestants qkvlab,qkvlab@bf16 --no-ceiling 2>&1 |
    grep -E "qkvlab:|qkvlab@bf16:|bf16 / qkvlab:|machine during"
done
