"""The "+" score term: explicit additive mask (before) vs the key term inside the dot product (now).

Before: S * sum(w) + a(i) + c(j) + b as a (B, 1, T, T) float mask, causal mask folded in, which
forces SDPA off flash attention and makes autograd keep T x T tensors. Now (attention.ride_key_term):
q' = [q sum(w), 1/scale, 0..], k' = [k, c(j), 0..], v' = [v, 0..] with is_causal=True. Both give the
same output (tests/test_gpu_ready.py, float64, 1e-10). Measured in one run, the two alternated, median
of --rounds: forward+backward time of one attention call and the bytes autograd keeps for backward.
The machine's load is recorded (qkvlab.base.loadavg; --require-quiet exits 3 when noisy, --json FILE).

    python benchmarks/plus_term.py                    # B 4, 8 heads, T 512, d_head 64, fp32, CPU
    python benchmarks/plus_term.py --T 1024 --device cuda --dtype bfloat16
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from qkvlab.base.flag_values import positive_int
from qkvlab.base.loadavg import ScriptRun, add_options
from qkvlab.model.attention import ride_key_term
from qkvlab.model.positions import ScoreTerm2D


def before(term, q, k, v, pos, scale):
    a, c = term.row_col_terms(pos, pos)
    T = q.shape[2]
    add = (a[:, :, None] + c[:, None, :] + 0.1)[:, None].to(q.dtype)
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    mask = add.masked_fill(~causal, float("-inf"))
    return F.scaled_dot_product_attention(q * term.score_scale(), k, v, attn_mask=mask, scale=scale)


def now(term, q, k, v, pos, scale):
    q2, k2, v2 = ride_key_term(term, q, k, v, pos, scale)
    return F.scaled_dot_product_attention(q2, k2, v2, is_causal=True, scale=scale)[..., : q.shape[-1]]


def saved_bytes(fn, *args) -> int:
    seen: dict[int, int] = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args)
    return sum(seen.values())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--B", type=positive_int, default=4)
    p.add_argument("--heads", type=positive_int, default=8)
    p.add_argument("--T", type=positive_int, default=512)
    p.add_argument("--d-head", type=positive_int, default=64)
    p.add_argument("--rounds", type=positive_int, default=7)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    add_options(p)
    args = p.parse_args()
    run = ScriptRun(args, "plus_term")
    dev, dtype = torch.device(args.device), getattr(torch, args.dtype)
    torch.manual_seed(0)
    term = ScoreTerm2D(10, args.T).to(dev)
    shape = (args.B, args.heads, args.T, args.d_head)
    q, k, v = (torch.randn(shape, device=dev, dtype=dtype, requires_grad=True) for _ in range(3))
    pos = torch.arange(args.T, device=dev)[None].expand(args.B, -1)
    scale = args.d_head**-0.5
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    def step(fn) -> float:
        sync()
        t0 = time.perf_counter()
        fn(term, q, k, v, pos, scale).sum().backward()
        sync()
        return time.perf_counter() - t0

    err = (before(term, q, k, v, pos, scale) - now(term, q, k, v, pos, scale)).abs().max().item()
    times = {"before": [], "now": []}
    for fn in (before, now):
        step(fn)  # warm up
    for _ in range(args.rounds):
        for name, fn in (("before", before), ("now", now)):
            times[name].append(step(fn))
    mem = {name: saved_bytes(fn, term, q, k, v, pos, scale) for name, fn in (("before", before), ("now", now))}
    t = {name: statistics.median(ts) for name, ts in times.items()}
    print(f"B {args.B} heads {args.heads} T {args.T} d_head {args.d_head} {args.dtype} {dev}; max |diff| {err:.2e}")
    for name in ("before", "now"):
        print(f"  {name:<6} fwd+bwd {t[name] * 1e3:8.2f} ms   kept for backward {mem[name] / 2**20:8.2f} MiB")
    print(f"  now/before: time {t['now'] / t['before']:.3f}  memory {mem['now'] / mem['before']:.3f}  {run.tag()}")
    figures = {"max_abs_diff": err, "median_s": t, "saved_bytes": mem, "dtype": args.dtype, "device": str(dev)}
    sys.exit(run.finish(figures))


if __name__ == "__main__":
    main()
