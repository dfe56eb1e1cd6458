#!/usr/bin/env bash
# Issue 18's speed table, measured on a quiet machine (nothing else running), ~15 min on 2 cores.
#   OUT=quiet bash benchmarks/quiet_figures.sh        # from the repository root
#   STEPS="train schemes heap" OUT=quiet bash benchmarks/quiet_figures.sh   # some steps only
# Every step records its load and says quiet/NOISY on its last line; $OUT gets one .txt and one
# .json per step. The anchor shape: L6 H6 D384 V4096, 2 threads; decode at context 1024, prompt 448 +
# 64 new tokens; training at T256 B8, no biases. Which README/docs rows each replaces: docs/inference.md.
set -u
OUT=${OUT:-quiet}
if [ -e "$OUT" ] && { [ ! -d "$OUT" ] || [ -n "$(ls -A "$OUT")" ]; }; then  # never overwrite earlier figures
  echo "quiet_figures: $OUT exists and is not an empty folder; choose another OUT" >&2
  exit 2
fi
mkdir -p "$OUT"
ROOT=$(cd "$(dirname "$0")/.." && pwd)
export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
# Each step waits (up to 5 min) until the 1-min load falls under cores/4 - 0.15: the previous step's own
# threads keep it high for a minute or two, and a figure taken then would be marked noisy.
wait_quiet() {
  "$PY" - <<'PYEOF'
import os, time
limit, t0 = (os.cpu_count() or 1) / 4 - 0.15, time.time()  # margin: our own start-up adds load
while os.getloadavg()[0] > limit and time.time() - t0 < 300:
    time.sleep(5)
print(f"load {os.getloadavg()[0]:.2f} after waiting {time.time() - t0:.0f} s")
PYEOF
}
step() {
  local name=$1
  shift
  case " ${STEPS:-$name} " in *" $name "*) ;; *) return 0 ;; esac  # STEPS="train heap": only those
  wait_quiet
  echo "== $name: $*"
  "$@" 2>&1 | tee "$OUT/$name.txt"
}
SHAPE="--n-layer 6 --n-head 6 --d-model 384 --vocab-size 4096 --context 1024"
# 1. decode per step, batch 1 and 16: eager (default), static, compiled, transformers; bandwidth fraction
step decode "$PY" "$ROOT/benchmarks/decode.py" --threads 2 $SHAPE --variants Q-K-V --batches 1 16 \
  --modes eager,static,compiled --rounds 3 --skip-rope --json "$OUT/decode.json"
# 2. the same through `qkvlab bench`, eager and --compile (tok/s as the CLI prints them)
step bench "$PY" -m qkvlab bench $SHAPE --schemes Q-K-V --decode-batches 1,16 --prompt-len 448 --new-tokens 64 \
  --threads 2 --no-train --rounds 3 --json "$OUT/bench.json"
step bench_compile "$PY" -m qkvlab bench $SHAPE --schemes Q-K-V --decode-batches 1 --prompt-len 448 --new-tokens 64 \
  --threads 2 --no-train --no-hf --rounds 3 --compile --json "$OUT/bench_compile.json"
# 3. training fp32 vs nanoGPT's model.py, eager and compiled, 7 alternating rounds (+ bf16 where the CPU has it)
step train "$PY" "$ROOT/benchmarks/train_throughput.py" --threads 2 --rounds 7 --json "$OUT/train.json"
# 4. the reduced schemes keep their FLOP savings
step schemes "$PY" "$ROOT/benchmarks/train_throughput.py" --threads 2 --rounds 7 \
  --schemes Q-K-V,Id-K-V,Q-K=V,Q=K=V --json "$OUT/schemes.json"
# 5. what holding freed memory (qkvlab.base.heap, set by CPU training) buys the anchor, alternating child processes
step heap "$PY" "$ROOT/benchmarks/heap_hold.py" --threads 2 --rounds 4 --json "$OUT/heap.json"
# 6. where CPU bf16 autocast pays (the crossover behind the old `auto` rule; auto is now timed: qkvlab.decode.dtype_probe)
step bf16_widths bash "$ROOT/benchmarks/bf16_widths.sh"
grep -h "machine during the run" "$OUT"/*.txt 2>/dev/null
