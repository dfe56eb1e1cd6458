#!/usr/bin/env bash
# The scaling sweep on a lent H200 in one call of ~9 minutes (benchmarks/gpu_sweep.py says what runs,
# in which order, and the budget arithmetic).
#
#   OUT=out bash benchmarks/gpu_sweep.sh             # there, carry data/sweep/gpu-carry (~48 MiB)
#   OUT=/tmp/dry bash benchmarks/gpu_sweep.sh --cpu-dry   # here: a tiny corpus, tiny shapes, every code path
#
# Runs from the source tree (PYTHONPATH=src), unbuffered; work files (the corpus, the run folders with
# their weights) in a temporary folder, removed at the end. $OUT gets summary.txt, log.txt, sweep.json
# and gpu-sweep.tar.gz (each arm's results and the runs' small files). A hard stop at BUDGET_S + 60 s
# keeps the call inside its lease even if a block overruns its prediction.
# Exit status: 0 when no step failed, 1 otherwise.
set -u
. "$(dirname "$0")/lease_prologue.sh"
export QKVLAB_SWEEP_WORK="$WORK"
BUDGET=${BUDGET_S:-510}
[ -n "$DRY" ] && BUDGET=${BUDGET_S:-150}
set -o pipefail
timeout $((${BUDGET%.*} + 60)) "$PY" "$ROOT/benchmarks/gpu_sweep.py" --out "$OUT" --budget-s "$BUDGET" \
  --carry "${CARRY:-$ROOT/data/sweep/gpu-carry}" $DRY 2>&1 | tee "$OUT/log.txt"
rc=$?
[ -s "$OUT/summary.txt" ] || echo "FAIL gpu_sweep: no summary (see log.txt)" >>"$OUT/summary.txt"
[ $rc -eq 124 ] && echo "FAIL gpu_sweep: stopped at the hard limit of $((${BUDGET%.*} + 60)) s" >>"$OUT/summary.txt"
cat "$OUT/summary.txt"
exit $rc
