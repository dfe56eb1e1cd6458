#!/usr/bin/env bash
# vLLM's MLA backend on qkvlab's DeepSeek export, on a lent GPU (benchmarks/gpu_mla_vllm.py says what runs):
# greedy tokens against qkvlab's and vLLM's KV capacity, MLA export vs the original, at the same cache memory.
#
#   OUT=out bash benchmarks/gpu_mla_vllm.sh              # there: needs vllm importable (the lease has no network)
#   OUT=/tmp/dry bash benchmarks/gpu_mla_vllm.sh --cpu-dry   # here: exports and qkvlab's tokens, vLLM's plan
#
# Extra arguments after --cpu-dry (or alone) go to the script: --mla DIR --original DIR, --tiny, --kv-gib G.
# $OUT gets summary.txt, log.txt and vllm_mla.json. Exit status: 0 when nothing failed, 1 otherwise.
set -u
. "$(dirname "$0")/lease_prologue.sh"
[ -n "$DRY" ] && shift
BUDGET=${BUDGET_S:-480}
set -o pipefail
timeout "$BUDGET" "$PY" "$ROOT/benchmarks/gpu_mla_vllm.py" --out "$OUT" --work "$WORK" ${DRY:+--dry-run} "$@" 2>&1 | tee -a "$OUT/log.txt"
rc=$?
[ -s "$OUT/summary.txt" ] || echo "FAIL gpu_mla_vllm: no summary (see log.txt)" >>"$OUT/summary.txt"
[ $rc -eq 124 ] && echo "FAIL gpu_mla_vllm: stopped at the limit of $BUDGET s" >>"$OUT/summary.txt"
cat "$OUT/summary.txt"
exit $rc
