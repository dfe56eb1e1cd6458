"""Decoding speed, measured in one run: prefill and decode apart, against transformers and against
the memory-bandwidth limit.

1. This machine's copy rate (a large tensor copy, bytes read + written per second), measured first.
2. Per variant and batch (rounds alternate over variants and paths): prefill tokens/s, decode ms per step and tokens/s, and new tokens/s end to
   end (prefill included), for each decode path
     eager    - generate's eager default: dynamic on the CPU, static on CUDA;
     dynamic  - eager, attention reads the filled cache slots (a view that grows each token);
     static   - eager, every step the same shapes (full-length cache reads, unfilled slots masked);
     compiled - the static step under torch.compile, compiled once per (batch, cache length) before
                the prompt (compile seconds reported apart);
   and transformers' `generate` with its cache on the same weights (qkvlab.bench.hf_twin; its
   prefill is generate(1), its step the difference of generate(new) and generate(1); "unmeasured"
   when that difference is not positive). All timed alternately, best of rounds. Eager paths on the
   CPU at batch <= layout.LAYOUT_MAX_BATCH (16) decode through the layout generate chooses (decode.choices; its
   tree built inside the prefill's time).
   Every figure carries the 1-min load when it was printed; the run's verdict (qkvlab.base.loadavg) comes
   last; --require-quiet exits 3 on a noisy machine; --json writes the figures and the load.
   The bandwidth limit of a step reads the weights once and each row's cache at its mean fill
   (prompt + new/2 tokens); `of limit` is limit / measured.
3. What rotating keys on read costs a shared K=V cache with rotary positions (ms per decode step at
   several cache fills): `read` (as built: the cache holds the un-rotated shared tensor, keys rotate
   on every read) against `write` (the same model with keys rotated once, on write: timing only, with
   K=V this rotates the values too, so its outputs are wrong; it prices the rotation, nothing else).

    python benchmarks/decode.py --threads 2                        # the README's shape and rows
    python benchmarks/decode.py --threads 2 --skip-rope --variants Q-K-V --batches 1 --modes eager,compiled
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from qkvlab.base.devices import DTYPES, torch_dtype
from qkvlab.base.errors import UserError
from qkvlab.base.flag_values import positive_int
from qkvlab.base.loadavg import ScriptRun, add_options, fmt, load1
from qkvlab.bench import hf_twin
from qkvlab.decode.speed import (
    bandwidth_limit_step_s,
    best_of,
    copy_rate,
    decode_step_fn,
    time_decode,
    time_hf,
)
from qkvlab.model.config import ModelConfig
from qkvlab.model.transformer import GPT
from qkvlab.model.variants import parse_variants


def variant_configs(text: str, base: ModelConfig) -> list[tuple[str, ModelConfig]]:
    return [(v.name, v.apply(base)) for v in parse_variants(text)]


def ms(seconds: float | None) -> float | None:
    return None if seconds is None else 1e3 * seconds


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or not b > 0 else a / b


def decode_table(args, base: ModelConfig, rate: float, figures: dict) -> None:
    print(
        f"{base.n_layer} layers, {base.n_head} heads, d {base.d_model}, vocab {base.vocab_size}, context "
        f"{base.context}, {args.dtype} on {args.device}; prompt {args.prompt_len} + {args.new_tokens} new tokens; best of {args.rounds} "
        f"alternating rounds; {torch.get_num_threads()} thread(s); copy rate {rate / 1e9:.1f} GB/s"
    )
    head = (
        f"  {'scheme':<14} {'batch':>5} {'path':<12} {'prefill tok/s':>13} {'ms/step':>8} {'decode tok/s':>12} "
        f"{'end-to-end tok/s':>16} {'limit ms':>8} {'of limit':>8} {'compile s':>9}  load"
    )
    print(head)
    by_key: dict[tuple[str, int, str], float] = {}
    models = {}  # every variant's model and twin, built first: rounds alternate across variants too
    for name, cfg in variant_configs(args.variants, base):
        torch.manual_seed(0)
        model = GPT(cfg).eval().to(args.device, torch_dtype(args.dtype))
        hf = None
        if not args.skip_hf:
            try:
                hf = hf_twin(model).to(args.device, torch_dtype(args.dtype))
            except UserError as e:
                print(f"  {name}: no transformers twin ({e})")
        models[name] = (model, hf)
    for b in args.batches:
        prompt = torch.randint(0, base.vocab_size, (b, args.prompt_len), device=args.device)
        paths = {n: list(args.modes) + (["transformers"] if hf is not None else []) for n, (_, hf) in models.items()}
        compile_s = {}
        for name, (model, _) in models.items():
            for p in args.modes:  # warm up (and compile, timed once inside)
                compile_s[(name, p)] = time_decode(model, prompt, args.new_tokens, p).compile_s
        runs: dict[tuple[str, str], list] = {(n, p): [] for n in models for p in paths[n]}
        for _ in range(args.rounds):  # load drifts: every variant and path once per round
            for name, (model, hf) in models.items():
                for p in paths[name]:
                    if p == "transformers":
                        runs[(name, p)].append(time_hf(hf, prompt, args.new_tokens))
                    else:
                        runs[(name, p)].append(time_decode(model, prompt, args.new_tokens, p))
        for name, (model, _) in models.items():
            limit = bandwidth_limit_step_s(model, b, args.prompt_len + args.new_tokens / 2, rate)
            for p in paths[name]:
                t = best_of(runs[(name, p)])
                by_key[(name, b, p)] = t.step_s
                by_key[(name, b, p + ":e2e")] = ratio(1.0, t.end_to_end_tokens_per_s)
                cs = compile_s.get((name, p))
                figures.setdefault("rows", []).append(
                    dict(
                        variant=name,
                        batch=b,
                        path=p,
                        prefill_tokens_per_s=t.prefill_tokens_per_s,
                        step_ms=ms(t.step_s),
                        decode_tokens_per_s=t.decode_tokens_per_s,
                        end_to_end_tokens_per_s=t.end_to_end_tokens_per_s,
                        limit_ms=1e3 * limit,
                        of_limit=ratio(limit, t.step_s),
                        compile_s=cs,
                        load_1min=load1(),
                    )
                )
                print(
                    f"  {name:<14} {b:>5} {p:<12} {fmt(t.prefill_tokens_per_s, '.0f'):>13} {fmt(ms(t.step_s), '.2f'):>8} "
                    f"{fmt(t.decode_tokens_per_s):>12} {fmt(t.end_to_end_tokens_per_s):>16} {1e3 * limit:>8.2f} "
                    f"{fmt(ratio(limit, t.step_s), '.0%'):>8} {'-' if cs is None else f'{cs:.1f}':>9}  {ScriptRun.tag()}"
                )
    print("  ratios (decode step time, same batch; > 1 = faster):")
    names = [n for n, _ in variant_configs(args.variants, base)]
    for name in names:
        for b in args.batches:
            ours = {p: by_key[(name, b, p)] for p in args.modes}
            best = min((p for p in ours if ours[p] is not None), key=ours.get, default=args.modes[0])
            parts = []
            if (name, b, "transformers") in by_key:
                vs = ratio(by_key[(name, b, "transformers")], ours[best])
                parts.append(f"{best} vs transformers {fmt(vs, '.2f')}x")
                e2e = ratio(by_key[(name, b, "transformers:e2e")], by_key[(name, b, best + ":e2e")])
                parts.append(f"end-to-end {fmt(e2e, '.2f')}x")
                figures.setdefault("speedup_vs_transformers", {})[f"{name} b{b}"] = vs
            eager = ("eager", "dynamic", "static")
            for m in [m for m in ours if m not in eager]:  # compiled paths vs eager ones
                parts += [f"{m} vs {e} {fmt(ratio(ours[e], ours[m]), '.2f')}x" for e in eager if e in ours]
            if name != names[0]:  # same path, rounds alternated across variants
                parts += [f"vs {names[0]} {m} {fmt(ratio(by_key[(names[0], b, m)], ours[m]), '.2f')}x" for m in ours]
            print(f"    {name:<14} batch {b:>3}: " + ", ".join(parts) + f"  {ScriptRun.tag()}")


@torch.inference_mode()
def step_ms(model, fill: int, steps: int, rounds: int, batch: int, mode: str) -> float:
    from qkvlab.decode.steps import left_pad, new_cache, prefill

    step, static = decode_step_fn(mode)
    prompt = torch.randint(0, model.cfg.vocab_size, (batch, fill)).tolist()
    best = float("inf")
    for _ in range(rounds):
        cache = new_cache(model, batch, fill + steps, static=static)
        padded = left_pad(prompt)
        tok = prefill(model, cache, padded).argmax(-1)
        pos = padded.lengths.clone()
        t0 = time.perf_counter()
        for _ in range(steps):
            tok = step(model, cache, tok, pos).argmax(-1)
            pos += 1
        best = min(best, (time.perf_counter() - t0) / steps)
    return best * 1e3


def rope_on_read(args, base: ModelConfig, figures: dict) -> None:
    fills = args.fills
    torch.manual_seed(0)
    cfg = base.replace(attn="Q-K=V", pos="rope", context=max(fills) + args.steps + 1)
    model = GPT(cfg).eval()
    write = GPT(cfg).eval()
    write.load_state_dict(model.state_dict())
    write.trunk.rope_on_read = False  # the trunk then builds no key tables
    for i in range(cfg.n_layer):
        write.trunk.layer(i).attn.k_shared_with_v = False  # rotate on write (values too: timing only)
    print(
        f"rope on read, Q-K=V kv_heads={cfg.n_kv_heads}, batch {args.rope_batch}, ms per decode step "
        f"(best of {args.rounds} x {args.steps} steps), eager {args.rope_mode} path"
    )
    print(f"  {'cache fill':>10}  {'read':>8}  {'write':>8}  {'read cost':>9}")
    for fill in fills:
        for _ in range(2):  # alternate the two models
            r = step_ms(model, fill, args.steps, args.rounds, args.rope_batch, args.rope_mode)
            w = step_ms(write, fill, args.steps, args.rounds, args.rope_batch, args.rope_mode)
        figures.setdefault("rope_on_read", []).append(dict(fill=fill, read_ms=r, write_ms=w))
        print(f"  {fill:>10}  {r:8.3f}  {w:8.3f}  {100 * (r - w) / w:8.1f}%  {ScriptRun.tag()}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n-layer", type=positive_int, default=6)
    p.add_argument("--n-head", type=positive_int, default=6)
    p.add_argument("--d-model", type=positive_int, default=384)
    p.add_argument("--vocab-size", type=positive_int, default=4096)
    p.add_argument("--context", type=positive_int, default=1024)
    p.add_argument("--variants", default="Q-K-V,Q-K=V/MQA,Id-K=V/MQA", help="as for qkvlab bench (/MQA, /GQA-g)")
    p.add_argument(
        "--modes",
        default="eager,static,compiled",
        help="decode paths: eager, dynamic, static, compiled, or a torch.compile mode (reduce-overhead: CUDA graphs)",
    )
    p.add_argument("--batches", type=positive_int, nargs="+", default=[1, 16])
    p.add_argument("--prompt-len", type=positive_int, default=448)
    p.add_argument("--new-tokens", type=positive_int, default=64)
    p.add_argument("--rounds", type=positive_int, default=3)
    p.add_argument("--threads", type=positive_int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--device", default="cpu", help="cpu, cuda (the rope section always runs on the CPU)")
    p.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    p.add_argument("--fills", type=positive_int, nargs="+", default=[64, 512, 2048])
    p.add_argument("--steps", type=positive_int, default=16)
    p.add_argument("--rope-batch", type=positive_int, default=1)
    p.add_argument("--rope-mode", default="dynamic", choices=["dynamic", "static"])
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--skip-decode", action="store_true")
    p.add_argument("--skip-rope", action="store_true")
    add_options(p)
    args = p.parse_args()
    run = ScriptRun(args, "decode")
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if args.threads:
        torch.set_num_threads(args.threads)
    base = ModelConfig(
        n_layer=args.n_layer,
        n_head=args.n_head,
        d_model=args.d_model,
        vocab_size=args.vocab_size,
        context=args.context,
    ).validate()
    rate = copy_rate(args.device)
    figures: dict = {"copy_bytes_per_s": rate, "threads": torch.get_num_threads(), "dtype": args.dtype}
    if not args.skip_decode:
        decode_table(args, base, rate, figures)
    if not args.skip_rope:
        rope_on_read(args, base, figures)
    sys.exit(run.finish(figures))


if __name__ == "__main__":
    main()
