#!/usr/bin/env bash
# The GPU's first-day checks for a bare GPU machine with a 10-minute budget (the whole script: <= 7 min).
#
#   OUT=out bash benchmarks/gpu_check.sh           # from the repository root; nothing to install
#   OUT=/tmp/dry bash benchmarks/gpu_check.sh --cpu-dry   # here, on the CPU: tiny shapes, CUDA-only checks SKIP
#
# Runs from the source tree (PYTHONPATH=src python3 -m qkvlab), unbuffered. Never stops at a failed
# check: each check writes one PASS/FAIL/SKIP line with its figure to $OUT/summary.txt as it ends.
# $OUT receives only summary.txt, log.txt (everything printed) and checks.json (the figures); work
# files go to a temporary folder, removed at the end. Most valuable first: benchmarks/gpu_checks.py in
# one process (flash kernel per scheme and head dim, "+" on flash in bf16, memory estimate, compiled
# gpt2-124m MFU, FSDP2 + DCP on one rank, CUDA-graph decode), then the command line end to end.
# Exit status: 0 when no check failed, 1 otherwise. docs/gpu.md says what each check means.
set -u
. "$(dirname "$0")/lease_prologue.sh"
LOG="$OUT/log.txt"
: >"$LOG"
START=$SECONDS
BUDGET=${BUDGET_S:-420}  # the whole script's seconds (7 min); --cpu-dry: no budget
[ -n "$DRY" ] && BUDGET=100000

# 1. the library checks, one process (writes summary.txt and checks.json itself)
timeout $((BUDGET * 6 / 10)) "$PY" "$ROOT/benchmarks/gpu_checks.py" --out "$OUT" $DRY 2>&1 | tee -a "$LOG"
[ -s "$OUT/summary.txt" ] || echo "FAIL gpu_checks: no summary (see log.txt)" >>"$OUT/summary.txt"

# 2. the command line end to end: check NAME SECONDS COMMAND... -> one line with the output's last line
check() {
  local name=$1 limit=$2
  shift 2
  local t0=$SECONDS out rc left=$((START + BUDGET - SECONDS))
  if [ "$left" -lt 15 ]; then
    echo "FAIL cli-$name: not run, the ${BUDGET} s budget is spent" | tee -a "$LOG" >>"$OUT/summary.txt"
    return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  out=$(timeout "$limit" "$@" 2>&1)
  rc=$?
  printf '%s\n' "$out" >>"$LOG"
  local last
  last=$(printf '%s\n' "$out" | grep -v '^\s*$' | tail -1 | cut -c1-200)
  if [ $rc -eq 0 ]; then verdict=PASS why=""; else verdict=FAIL why="exit $rc, "; fi
  echo "$verdict cli-$name: $last (${why}$((SECONDS - t0)) s)" | tee -a "$LOG" >>"$OUT/summary.txt"
}
Q="$PY -m qkvlab"
if [ -n "$DRY" ]; then
  DEV="--device cpu"
  SIZE="--preset tiny"
  STEPS=4
  COMPILE="--compile off"
  BENCH="--no-hf --no-train --rounds 1 --decode-batches 1"
else
  DEV="--device cuda"
  SIZE="--preset small"
  STEPS=100
  COMPILE="--compile reduce-overhead"
  BENCH="--rounds 2 --decode-batches 1,8"
fi
check prepare 90 $Q prepare --data shakespeare --tokenizer char --out "$WORK/prepared" --quiet
check train 150 $Q train --out "$WORK/run" $SIZE --data "$WORK/prepared" --attn '(Q-K=V)+' --kv-heads 1 \
  --max-steps $STEPS --eval-every $STEPS --batch-size 8 $DEV --quiet
check generate 90 $Q generate "$WORK/run" --prompt-ids 1,2,3 --max-new-tokens 32 --temperature 0 $DEV $COMPILE
check bench 120 $Q bench $SIZE --schemes Q-K-V,Q-K=V/MQA $DEV $BENCH --prompt-len 16 --new-tokens 16 \
  --json "$WORK/bench.json"
if [ -z "$DRY" ] && [ "$($PY -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
  check torchrun-fsdp 150 "$PY" -m torch.distributed.run --standalone --nproc-per-node 2 -m qkvlab train \
    --out "$WORK/fsdp" $SIZE --data "$WORK/prepared" --attn '(Q=K-V)+' --sharding fsdp --max-steps 20 --eval-every 20 --quiet
fi
echo "total $((SECONDS - START)) s" | tee -a "$LOG"
cat "$OUT/summary.txt"
! grep -q '^FAIL' "$OUT/summary.txt"
