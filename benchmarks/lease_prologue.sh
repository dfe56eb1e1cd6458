# Sourced by the GPU lease scripts (gpu_check.sh, gpu_sweep.sh): --cpu-dry as DRY, OUT as an absolute
# folder, ROOT (this checkout), a WORK folder removed on exit, this checkout's src on PYTHONPATH, a
# private QKVLAB_CACHE and PY. The lease's machine is bare: nothing is assumed installed but torch.
DRY=""
[ "${1:-}" = "--cpu-dry" ] && DRY="--cpu-dry"
OUT=${OUT:-out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
ROOT=$(cd "$(dirname "$0")/.." && pwd)
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 QKVLAB_CACHE="$WORK/cache"
PY=${PYTHON:-python3}
