"""Decoding speed of trained models side by side: e.g. a model and its retrofits (K=V, a key/value latent).

    python benchmarks/decode_models.py NAME=MODEL [NAME=MODEL ...] [--batches 1 16] [--prompt-len 200]
        [--new-tokens 64] [--rounds 3] [--threads N] [--mode eager|compiled] [--require-quiet] [--json FILE]

MODEL: anything `qkvlab generate` reads (a qkvlab model folder, a Hugging Face folder, a .gguf), in fp32.
Each round runs every model once at each batch (random prompt tokens, the same for every model; greedy),
in alternating order (reversed every other round), through generate's path (speed.time_decode; eager, or
compiled as `generate --compile` runs it, its compile time apart);
the best round of each is printed with its KV-cache bytes per token and the ratio to the first model.
A retrofit's cache is smaller but its step may cost more: a latent rebuilds every cached key each step.
"""

from __future__ import annotations

import argparse
import sys

import torch

from qkvlab.base.files import labelled_path
from qkvlab.base.flag_values import positive_int
from qkvlab.base.loadavg import ScriptRun, add_options, fmt
from qkvlab.convert.load import load_any
from qkvlab.decode.speed import best_of, cache_bytes_per_token, time_decode


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("models", nargs="+", metavar="NAME=MODEL")
    p.add_argument("--batches", type=positive_int, nargs="+", default=[1, 16])
    p.add_argument("--prompt-len", type=positive_int, default=200)
    p.add_argument("--new-tokens", type=positive_int, default=64)
    p.add_argument("--rounds", type=positive_int, default=3)
    p.add_argument("--threads", type=positive_int, default=None, help="torch threads (default: torch's)")
    p.add_argument(
        "--mode", default="eager", help="eager (generate's default on the CPU) or compiled (generate --compile)"
    )
    add_options(p)
    args = p.parse_args()
    run = ScriptRun(args, "decode_models")
    if args.threads:
        torch.set_num_threads(args.threads)
    models = {}
    for item in args.models:
        name, path = labelled_path(item)
        models[name] = load_any(path).model.float().eval()
    vocab = min(m.cfg.vocab_size for m in models.values())
    gen = torch.Generator().manual_seed(0)
    prompts = {b: torch.randint(0, vocab, (b, args.prompt_len), generator=gen) for b in args.batches}
    timings: dict[tuple[str, int], list] = {(n, b): [] for n in models for b in args.batches}
    order = list(models)
    with torch.inference_mode():
        for r in range(args.rounds):
            for name in order if r % 2 == 0 else order[::-1]:
                for b in args.batches:
                    timings[name, b].append(time_decode(models[name], prompts[b], args.new_tokens, args.mode))
            print(f"round {r + 1} of {args.rounds} done", flush=True)
    figures = {"threads": torch.get_num_threads(), "prompt_len": args.prompt_len, "new_tokens": args.new_tokens}
    figures["mode"] = args.mode
    print(
        f"\nfp32, {args.mode}, {figures['threads']} threads, prompt {args.prompt_len} + {args.new_tokens} new, "
        f"best of {args.rounds}"
    )
    print("| model | cache bytes/token (fp32) | batch | prefill s | ms/step | tok/s | vs first | load |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    rows = []
    for b in args.batches:
        first = best_of(timings[order[0], b]).decode_tokens_per_s
        for name in order:
            t = best_of(timings[name, b])
            tok = t.decode_tokens_per_s
            ratio = None if tok is None or not first else tok / first
            row = {"model": name, "batch": b, "cache_bytes_per_token": cache_bytes_per_token(models[name])}
            row.update({"prefill_s": t.prefill_s, "step_s": t.step_s, "tokens_per_s": tok, "vs_first": ratio})
            rows.append(row)
            step_ms = None if t.step_s is None else 1e3 * t.step_s
            print(
                f"| {name} | {row['cache_bytes_per_token']:,} | {b} | {t.prefill_s:.3f} | {fmt(step_ms)} | "
                f"{fmt(tok)} | {fmt(ratio, '.2f')}x | {run.tag()} |"
            )
    figures["rows"] = rows
    sys.exit(run.finish(figures))


if __name__ == "__main__":
    main()
