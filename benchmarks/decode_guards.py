"""What dynamo's guards cost a compiled decode step of SmolLM2-135M, fp32 (issue 28).

A compiled step's calls after the first of a decode run with the guards skipped, bar those that tell
its compiled graphs apart (decode.compiled.steady). This times one compiled step (one model, one compiled
graph, through the tree of generate's decode layout) called both ways, and generate's eager step beside them, in
alternating rounds in one process: each round prefills a prompt of random tokens and decodes
--new-tokens greedy tokens with every contestant; the best and the median step of each are printed,
with the ratio per round, and the tokens of every contestant are checked equal.

    python benchmarks/decode_guards.py                  # one stream, 2 threads, 7 rounds
    python benchmarks/decode_guards.py --batch 16

Tried in the same way on 2026-12-06 and not kept (no gain beyond the rounds' spread, so not worth
their code; commits 1e6de5e, e2e90fb): a SwiGLU's gate and up as one product (0.99x eager, 0.98x
compiled) and a one-token query's attention written out for inductor instead of SDPA's kernel (1.00x).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from qkvlab.base.flag_values import positive_int
from qkvlab.base.loadavg import ScriptRun, add_options
from qkvlab.decode.choices import model_choices
from qkvlab.decode.compiled import compiled_step, steady, warm_up
from qkvlab.decode.steps import decode_step, left_pad, new_cache, prefill

sys.path.insert(0, str(Path(__file__).parent))
from decode_smollm2 import add_decode_options, start_decode_run  # noqa: E402  (a sibling script, not a package)


@torch.inference_mode()
def decode(model, step, prompt: torch.Tensor, steps: int, cache) -> tuple[float, list[list[int]]]:
    """Prefill, then `steps` greedy steps of `step` -> (seconds a step, the tokens of every row)."""
    if cache is None:  # the eager step: a dynamic cache
        cache = new_cache(model, prompt.shape[0], prompt.shape[1] + steps + 1)
    else:
        cache.reset()
    batch = left_pad(prompt.tolist())
    tok = prefill(model, cache, batch).argmax(-1)
    positions, out = batch.lengths.clone(), [tok]
    t0 = time.perf_counter()
    for _ in range(steps):
        tok = step(model, cache, tok, positions).argmax(-1)
        positions += 1
        out.append(tok)
    seconds = (time.perf_counter() - t0) / steps
    return seconds, torch.stack(out, dim=1).tolist()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_decode_options(p, new_tokens=48, rounds=7)
    p.add_argument("--batch", type=positive_int, default=1, help="streams decoded together")
    add_options(p)
    args = p.parse_args()
    run, src, model = start_decode_run(args, "decode_guards")
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, model.cfg.vocab_size, (args.batch, args.prompt_len), generator=g)
    model = model_choices(model, args.batch).decode_model(model)  # the tree generate decodes through, for the run
    cache = new_cache(model, args.batch, args.prompt_len + args.new_tokens + 1, static=True)
    compiled = compiled_step()
    print(f"  compiled in {warm_up(compiled, model, cache):.1f} s", flush=True)
    contestants = {  # name: (a decode's step, made anew for each decode; static cache or None)
        "eager": (lambda: decode_step, None),
        "compiled, guards skipped": (lambda: steady(compiled), cache),
        "compiled, guards checked": (lambda: compiled, cache),
    }
    print(
        f"{src.name}: fp32, {args.threads} thread(s), {args.batch} stream(s), prompt {args.prompt_len} + "
        f"{args.new_tokens} new tokens, {args.rounds} alternating rounds  {ScriptRun.tag()}",
        flush=True,
    )
    times: dict[str, list[float]] = {n: [] for n in contestants}
    tokens: dict[str, list[list[int]]] = {}
    names = list(contestants)
    for r in range(args.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            make_step, static_cache = contestants[name]
            seconds, tokens[name] = decode(model, make_step(), prompt, args.new_tokens, static_cache)
            times[name].append(seconds)
    figures = {}
    print(f"  {'contestant':26s} {'best ms':>8} {'median ms':>9} {'tok/s':>7}  same tokens as eager")
    for name in names:
        best, median = min(times[name]), statistics.median(times[name])
        figures[name] = {"best_ms": best * 1e3, "median_ms": median * 1e3, "rounds_ms": [t * 1e3 for t in times[name]]}
        print(
            f"  {name:26s} {best * 1e3:8.2f} {median * 1e3:9.2f} {args.batch / best:7.1f}  {tokens[name] == tokens['eager']}",
            flush=True,
        )
    a, b = "compiled, guards skipped", "compiled, guards checked"
    per_round = sorted(tb / ta for ta, tb in zip(times[a], times[b]))
    figures["skipped vs checked"] = {"best": min(times[b]) / min(times[a]), "per_round": per_round}
    print(
        f"  guards skipped vs checked: {min(times[b]) / min(times[a]):.3f}x (best vs best; per round "
        f"{per_round[0]:.3f}-{per_round[-1]:.3f}x, median {statistics.median(per_round):.3f}x)  {ScriptRun.tag()}",
        flush=True,
    )
    sys.exit(run.finish(figures))


if __name__ == "__main__":
    main()
