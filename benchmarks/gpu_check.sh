#!/usr/bin/env bash
# The GPU checks, as one prepared script for a session that has an accelerator (the `device`
# tool: run from the repository root with a venv carried or built there). Writes to ${OUT:-out}.
# CPU sessions never run this; the test suite never needs a GPU. docs/gpu.md has the recipes it runs.
set -euo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
export QKVLAB_CACHE=${QKVLAB_CACHE:-$OUT/cache}
NGPU=$(python -c "import torch; print(torch.cuda.device_count())")
python - <<'PY'
import torch
print("cuda", torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "", torch.__version__)
PY
# 1. prepare once (streaming), then train on it: one GPU, bf16 autocast, torch.compile (device auto = cuda:0)
qkvlab prepare --data shakespeare --tokenizer bpe:2048 --out "$OUT/prepared" --quiet | tee "$OUT/prepare.txt"
qkvlab train --out "$OUT/train_compile" --preset small --data "$OUT/prepared" --attn Id-K=V --kv-heads 1 --compile \
  --max-steps 200 --quiet | tail -3 | tee "$OUT/train_compile.txt"
# 2. every scheme trains a few steps on one GPU (finite loss), "+" included
for s in Q-K-V Id-K-V Q=K-V Q-K=V Q=K=V Id-K=V '(Q=K-V)+' '(Q=K=V)+' '(Q-K=V)+'; do
  qkvlab train --out "$OUT/schemes/$s" --preset small --data "$OUT/prepared" --attn "$s" --max-steps 20 --eval-every 20 --quiet \
    | tail -1 | sed "s/^/$s: /" | tee -a "$OUT/schemes.txt"
done
# 3. "+" on the flash kernel (forced: fails if not eligible), q/k in bf16, memory estimate vs measured peak
python - <<'PY' | tee "$OUT/flash_memory.txt"
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from qkvlab.accounting import memory_estimate
from qkvlab.config import ModelConfig
from qkvlab.model import GPT
from qkvlab.train.optim import make_optimizer
dev = torch.device("cuda", 0)
for scheme in ("(Q=K-V)+", "(Q=K=V)+", "Q-K=V"):
    cfg = ModelConfig(attn=scheme, pos="rope", n_layer=4, n_head=8, d_model=512, vocab_size=4096, context=1024).validate()
    model = GPT(cfg).to(dev)
    x = torch.randint(0, 4096, (4, 1025), device=dev)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION), torch.autocast("cuda", dtype=torch.bfloat16):
        model(x[:, :-1], x[:, 1:])[1].backward()
    print(scheme, "flash attention forward+backward in bf16: ok")
for sharding in ("ddp",):
    cfg = ModelConfig(attn="Q-K-V", n_layer=6, n_head=8, d_model=512, vocab_size=8192, context=1024).validate()
    torch.cuda.reset_peak_memory_stats(dev)
    model = GPT(cfg).to(dev)
    opt = make_optimizer(model, 1e-3, 0.1, (0.9, 0.95), dev)
    x = torch.randint(0, 8192, (8, 1025), device=dev)
    for _ in range(2):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x[:, :-1], x[:, 1:])[1]
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    peak = torch.cuda.max_memory_allocated(dev)
    est = memory_estimate(cfg, micro_batch=8, world=1, sharding="ddp", dtype="bf16")
    est_single = est["total"] - est["comm_buffers"]  # one process: no DDP buckets
    print(f"memory: measured peak {peak / 1e9:.3f} GB, estimate {est_single / 1e9:.3f} GB, ratio {peak / est_single:.2f}")
PY
python benchmarks/plus_term.py --device cuda --dtype bfloat16 --T 2048 --B 8 --heads 16 | tee "$OUT/plus_term.txt"
# 4. bf16 + SDPA decode/train throughput and cache bytes per scheme; identity schemes export their twin on the GPU
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
# 5. with 2+ GPUs: the torchrun recipes (DDP and FSDP), then resume at world size 1
if [ "$NGPU" -ge 2 ]; then
  for sh in ddp fsdp; do
    torchrun --standalone --nproc-per-node 2 -m qkvlab train --preset small --data "$OUT/prepared" --attn '(Q=K-V)+' \
      --sharding "$sh" --max-steps 40 --eval-every 20 --dist-timeout-s 600 --out "$OUT/torchrun_$sh" --quiet | tail -1
    qkvlab train --preset small --data "$OUT/prepared" --attn '(Q=K-V)+' --sharding "$sh" --max-steps 60 --eval-every 20 \
      --out "$OUT/torchrun_$sh" --resume --quiet | tail -1
  done 2>&1 | tee "$OUT/torchrun.txt"
else
  echo "one GPU: torchrun recipes (docs/gpu.md sections 3-4) not run" | tee "$OUT/torchrun.txt"
fi
