"""Exact GELU on the CPU in float32: oneDNN's kernel (PyTorch's default) against ATen's own, by size.

oneDNN pays ~20 us a call whatever the size; ATen's kernel wins on small tensors (a decode step's
(B, 1, 4d)), oneDNN on large ones. qkvlab.model.transformer.gelu takes ATen's up to GELU_ATEN_MAX elements;
this prints both kernels' time per call at sizes around it (alternating rounds, best of each), so
the threshold can be checked on another machine.

    python benchmarks/gelu_kernels.py --threads 2
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.nn.functional as F

from qkvlab.base.flag_values import positive_int
from qkvlab.base.loadavg import ScriptRun, add_options
from qkvlab.model.transformer import GELU_ATEN_MAX

SIZES = (1536, 6144, 24576, 49152, 98304, 393216, 3 * 2**20)  # elements: decode b1 / b4 / b16 ... training


def per_call(x: torch.Tensor, onednn: bool, calls: int) -> float:
    torch.backends.mkldnn.enabled = onednn
    try:
        F.gelu(x)
        t0 = time.perf_counter()
        for _ in range(calls):
            F.gelu(x)
        return (time.perf_counter() - t0) / calls
    finally:
        torch.backends.mkldnn.enabled = True


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=positive_int, help="torch threads (default: torch's)")
    p.add_argument("--rounds", type=positive_int, default=7)
    add_options(p)
    args = p.parse_args()
    run = ScriptRun(args, "gelu_kernels")
    if args.threads:
        torch.set_num_threads(args.threads)
    figures = {"threads": torch.get_num_threads(), "aten_max": GELU_ATEN_MAX, "sizes": {}}
    print(f"{'elements':>10} {'oneDNN us':>10} {'ATen us':>9} {'oneDNN/ATen':>12}  qkvlab uses")
    for n in SIZES:
        x = torch.randn(n)
        calls = max(5, int(2e5 // max(n, 1)) * 10)
        best = {True: float("inf"), False: float("inf")}
        for _ in range(args.rounds):  # alternate the two kernels
            for onednn in (True, False):
                best[onednn] = min(best[onednn], per_call(x, onednn, calls))
        ratio = best[True] / best[False]
        uses = "ATen" if n <= GELU_ATEN_MAX else "oneDNN"
        print(f"{n:>10} {1e6 * best[True]:>10.1f} {1e6 * best[False]:>9.1f} {ratio:>11.2f}x  {uses} {run.tag()}")
        figures["sizes"][str(n)] = {"onednn_s": best[True], "aten_s": best[False], "qkvlab_uses": uses}
    sys.exit(run.finish(figures))


if __name__ == "__main__":
    main()
