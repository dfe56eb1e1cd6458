#!/bin/bash
# Evidence (a): a Q-K-V model trained here, retrofitted to Q-K=V with uptraining worth ~10% of its
# training compute, against Q-K=V trained from scratch with the same total compute.
# FLOPs/token (qkvlab info --preset small --pos rope): Q-K-V 7,077,888, Q-K=V 6,684,672 (training, 3x forward).
# Uptraining costs student training + a teacher forward: 6,684,672 + 7,077,888/3 = 9,043,968 per token.
# Teacher 300 steps; uptraining 23 steps = 9.8% of the teacher's compute; the same total buys Q-K=V 349 steps.
set -e
export OMP_NUM_THREADS=1
qkvlab train --preset small --pos rope --attn Q-K-V --batch-size 16 --max-steps 300 --eval-every 100 \
  --warmup-steps 50 --no-tensorboard --out qkv
qkvlab retrofit qkv rf2 --to Q-K=V --rest-lr 0 --steps 23 --batch-size 16 --lr 3e-4 --warmup-steps 5 --eval-every 23 \
  --eval-batches 10 --calib-tokens 2048 --eval-tokens 8192
# the same with --lr 1e-3 (the second uptraining row of the table)
qkvlab retrofit qkv rf --to Q-K=V --rest-lr 0 --steps 23 --batch-size 16 --lr 1e-3 --warmup-steps 5 --eval-every 23 \
  --eval-batches 10 --calib-tokens 2048 --eval-tokens 8192
qkvlab train --preset small --pos rope --attn Q-K=V --batch-size 16 --max-steps 349 --eval-every 100 \
  --warmup-steps 50 --no-tensorboard --out qkeqv_scratch
# the same held-out measure for the scratch model (a no-op fit: Q-K=V -> Q-K=V is exact)
qkvlab retrofit qkeqv_scratch scratch_eval --to Q-K=V --steps 0 --calib-tokens 256 --eval-tokens 8192
