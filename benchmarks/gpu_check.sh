#!/usr/bin/env bash
# The GPU checks, as one prepared script for a session that has an accelerator (the `device`
# tool: run from the repository root with a venv carried or built there). Writes to ${OUT:-out}.
# CPU sessions never run this; the test suite never needs a GPU.
set -euo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
python - <<'PY'
import torch
print("cuda", torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
PY
# bf16 + SDPA decode/train throughput and cache bytes per scheme, eager then compiled decode step
qkvlab bench --preset small --device cuda --dtype bf16 --variants Q-K-V,Id-K-V,Q-K=V,Q=K=V,Id-K=V,Q-K=V/MQA \
  --json "$OUT/bench_bf16.json" | tee "$OUT/bench_bf16.txt"
qkvlab bench --preset small --device cuda --dtype bf16 --variants Q-K-V,Q-K=V --compile --no-hf \
  --json "$OUT/bench_bf16_compile.json" | tee "$OUT/bench_bf16_compile.txt"
# decode: eager dynamic/static vs the static step compiled with CUDA graphs (reduce-overhead), bf16,
# prefill and decode apart, fraction of the bandwidth limit; the compiled step must beat eager
# (perf_hints logs it if CUDA graphs were skipped, e.g. for mutated inputs)
TORCH_LOGS=perf_hints python benchmarks/decode.py --device cuda --dtype bf16 --modes dynamic,static,reduce-overhead \
  --variants Q-K-V,Q-K=V/MQA,Id-K=V/MQA --batches 1 16 --skip-rope | tee "$OUT/decode_bf16.txt"
# the same through the CLI: compile time reported once on stderr
qkvlab init --out "$OUT/m" --preset small --attn Q-K=V --pos rope
qkvlab generate "$OUT/m" --prompt-ids 1,2,3 --max-new-tokens 64 --temperature 0 --device cuda \
  --compile reduce-overhead 2>&1 | tail -2 | tee "$OUT/generate_cudagraphs.txt"
# bf16 autocast training with torch.compile: loss must fall and stay finite
qkvlab train --out "$OUT/train_compile" --preset small --attn Id-K=V --kv-heads 1 --device cuda --compile \
  --max-steps 200 | tail -3 | tee "$OUT/train_compile.txt"
