"""Whole decode steps of SmolLM2-135M with the products in row blocks or column blocks (issue 28).

decode.layout.PackedProduct splits each Linear's weight into one block per thread in one of two orders:
"rows" (P, N/P, K), computing W_p x, or "columns" (P, K, N/P), computing x W_p^T. Which one a
decode uses by default follows its batch (layout.LAYOUT_ROWS_MAX_BATCH); this measures the two at each
batch, each given as the decode's choices (decode.choices.decode_choices(layout=...)), through
generate's eager path (speed.time_decode, greedy, a prompt of random tokens), alternating
rounds, and prints the ratio, so the threshold is a measured choice. For the products alone:
benchmarks/linear_layouts.py; against llama.cpp: benchmarks/decode_smollm2.py.

    python benchmarks/block_orders.py                       # batches 1 2 4 8 16, fp32, 2 threads
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from qkvlab.base.flag_values import positive_int
from qkvlab.base.loadavg import ScriptRun, add_options
from qkvlab.decode.choices import decode_choices
from qkvlab.decode.layout import LAYOUT_ROWS_MAX_BATCH, linear_shapes
from qkvlab.decode.speed import time_decode

sys.path.insert(0, str(Path(__file__).parent))
from decode_smollm2 import add_decode_options, start_decode_run  # noqa: E402  (a sibling script, not a package)

ORDERS = ("rows", "columns")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_decode_options(p, new_tokens=32, rounds=3)
    p.add_argument("--batches", type=positive_int, nargs="+", default=[1, 2, 4, 8, 16])
    add_options(p)
    args = p.parse_args()
    run, src, model = start_decode_run(args, "block_orders")
    g = torch.Generator().manual_seed(1)
    print(
        f"{src.name}: fp32, {args.threads} thread(s), prompt {args.prompt_len} + {args.new_tokens} new tokens a "
        f"stream, best of {args.rounds} alternating rounds; limit now {LAYOUT_ROWS_MAX_BATCH}  {ScriptRun.tag()}",
        flush=True,
    )
    print(f"{'batch':>5} {'rows ms/step':>12} {'columns ms/step':>15} {'rows vs columns':>15}")
    rows = []
    for b in args.batches:
        prompt = torch.randint(0, model.cfg.vocab_size, (b, args.prompt_len), generator=g)
        best = dict.fromkeys(ORDERS, float("inf"))
        shapes = linear_shapes(model)
        choices = {o: decode_choices(model.cfg, dtype="fp32", layout=o, batch=b, shapes=shapes) for o in ORDERS}
        for r in range(args.rounds):
            for order in ORDERS if r % 2 == 0 else reversed(ORDERS):
                timing = time_decode(model, prompt, args.new_tokens, choices=choices[order])
                best[order] = min(best[order], timing.step_s)
        ratio = best["columns"] / best["rows"]
        print(f"{b:>5} {best['rows'] * 1e3:>12.1f} {best['columns'] * 1e3:>15.1f} {ratio:>14.2f}x  {ScriptRun.tag()}")
        rows.append({"batch": b, "rows_ms": best["rows"] * 1e3, "columns_ms": best["columns"] * 1e3})
    raise SystemExit(run.finish({"results": rows}))


if __name__ == "__main__":
    main()
