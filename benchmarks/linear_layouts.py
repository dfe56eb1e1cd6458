"""The Linear products of one decode step, in four weight layouts, at 1..N threads (issue 28).

A one-token decode step of SmolLM2-135M (the default shape) is 151 matrix-vector products, 538 MB of
fp32 weights read once each: bound by memory. This times those products alone, in the order a step
runs them (each weight read from memory, as in a real step: together they are far larger than the
caches), in four layouts of the same values:

  row-major        F.linear on the weight as stored (N, K)
  long-contiguous  the Linears with more outputs than inputs held transposed (qkvlab's layout
                   until this benchmark: same shape, other strides)
  K-major          every weight held transposed (x @ W^T with W^T contiguous)
  blocks           decode.layout.PackedProduct, what generate and serve use since: (P, K, N/P) blocks,
                   P = the thread count, one bmm whose batch the threads share

Rounds alternate the order of layouts and thread counts; the best round of each is printed, with
the read rate of the weights and the ratio to row-major at the same thread count. Random weights
(values do not change the speed). For a whole step against llama.cpp: benchmarks/decode_smollm2.py.

    python benchmarks/linear_layouts.py                     # SmolLM2-135M's shape, fp32, 1 and 2 threads
    python benchmarks/linear_layouts.py --dtype bf16 --rows 1 4
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from qkvlab.base.flag_values import positive_int
from qkvlab.base.loadavg import ScriptRun, add_options
from qkvlab.decode.layout import PackedProduct

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
LAYOUTS = ("row-major", "long-contiguous", "K-major", "blocks", "row-blocks")


def step_shapes(layers: int, d: int, qkv: int, hidden: int, vocab: int) -> list[tuple[int, int]]:
    """(outputs, inputs) of every Linear of a step, in order: fused q/k/v, out, gate, up, down; the head."""
    return [s for _ in range(layers) for s in ((qkv, d), (d, d), (hidden, d), (hidden, d), (d, hidden))] + [(vocab, d)]


def products(weights: list[torch.Tensor], layout: str, threads: int):
    """-> a function of {inputs: (R, K)} computing every product of the step in `layout`."""
    if layout in ("blocks", "row-blocks"):
        packed, order = [], "columns" if layout == "blocks" else "rows"
        for w in weights:
            lin = nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=w.dtype)
            lin.weight.data = w
            packed.append(PackedProduct(lin, threads, max_rows=2**31, order=order))  # blocks at any rows
        return lambda xs: [p(xs[p.linear.in_features]) for p in packed]
    if layout == "row-major":
        held = weights
    elif layout == "long-contiguous":
        held = [w.t().contiguous().t() if w.shape[0] > w.shape[1] else w for w in weights]
    else:  # K-major
        held = [w.t().contiguous().t() for w in weights]
    return lambda xs: [F.linear(xs[w.shape[1]], w) for w in held]


def best_seconds(fn, xs, repeats: int) -> float:
    fn(xs)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(xs)
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=positive_int, default=30)
    p.add_argument("--d-model", type=positive_int, default=576)
    p.add_argument(
        "--qkv", type=positive_int, default=960, help="the fused projection's outputs (9 + 2 x 3 heads of 64)"
    )
    p.add_argument("--hidden", type=positive_int, default=1536)
    p.add_argument("--vocab", type=positive_int, default=49152)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--threads", type=positive_int, nargs="+", default=[1, 2])
    p.add_argument("--rows", type=positive_int, nargs="+", default=[1], help="rows a product (decode streams)")
    p.add_argument("--rounds", type=positive_int, default=3)
    p.add_argument("--repeats", type=positive_int, default=5, help="timed steps in a round (its best counts)")
    add_options(p)
    args = p.parse_args()
    run = ScriptRun(args, "linear_layouts")
    dtype = DTYPES[args.dtype]
    shapes = step_shapes(args.layers, args.d_model, args.qkv, args.hidden, args.vocab)
    weights = [torch.randn(n, k, dtype=dtype) for n, k in shapes]
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    print(
        f"{len(shapes)} products a step, {nbytes / 1e6:.0f} MB of {args.dtype} weights; best of {args.rounds} alternating "
        f"rounds of {args.repeats} steps  {ScriptRun.tag()}",
        flush=True,
    )
    cases = [(t, r, layout) for t in args.threads for r in args.rows for layout in LAYOUTS]
    fns = {}
    for t, _, layout in cases:
        if (t, layout) not in fns:
            torch.set_num_threads(t)
            fns[t, layout] = products(weights, layout, t)
    inputs = {r: {k: torch.randn(r, k, dtype=dtype) for k in {k for _, k in shapes}} for r in args.rows}
    best = dict.fromkeys(cases, float("inf"))
    with torch.inference_mode():
        for i in range(args.rounds):
            for case in cases if i % 2 == 0 else reversed(cases):
                t, r, layout = case
                torch.set_num_threads(t)
                best[case] = min(best[case], best_seconds(fns[t, layout], inputs[r], args.repeats))
    rows = []
    print(f"{'threads':>7} {'rows':>4} {'layout':<16} {'ms a step':>9} {'GB/s':>6} {'vs row-major':>12}")
    for t, r, layout in cases:
        s, base = best[t, r, layout], best[t, r, "row-major"]
        print(f"{t:>7} {r:>4} {layout:<16} {s * 1e3:>9.2f} {nbytes / s / 1e9:>6.1f} {base / s:>11.2f}x")
        rows.append({"threads": t, "rows": r, "layout": layout, "ms": s * 1e3, "gb_per_s": nbytes / s / 1e9})
    print(ScriptRun.tag())
    raise SystemExit(run.finish({"weight_bytes": nbytes, "results": rows}))


if __name__ == "__main__":
    main()
