"""Decoding speed, measured in one run.

1. qkvlab's cached decoding vs transformers' `generate` (with its cache) on the same weights: tokens/s
   at each batch size and the ratio, the two timed alternately, best of --rounds.
2. What rotating keys on read costs a shared K=V cache with rotary positions: time per decode step
   at several cache fills for
     read   - Q-K=V as built: the cache holds the un-rotated shared tensor, keys rotate on every read;
     write  - the same model with keys rotated once, on write (timing only: with K=V this rotates the
              values too, so its outputs are wrong; it prices the rotation, nothing else);
     table  - of `read`, the part spent building cos/sin for every cached position each step.

    python benchmarks/decode.py                       # preset small, batch 1 and 16
    python benchmarks/decode.py --preset gpt2-124m --batches 1 --new-tokens 16
"""

from __future__ import annotations

import argparse
import time

import torch

from qkvlab.bench import decode_seconds, hf_decode_seconds, hf_twin
from qkvlab.config import preset
from qkvlab.generate import decode_step, left_pad, new_cache, prefill
from qkvlab.model import GPT


def decode_ratio(args) -> None:
    torch.manual_seed(0)
    cfg = preset(args.preset, attn=args.attn, kv_heads=args.kv_heads)
    model = GPT(cfg).eval()
    hf = hf_twin(model)
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    print(
        f"{args.preset} {cfg.spec.name} kv_heads={cfg.n_kv_heads}: prompt {args.prompt_len} + {args.new_tokens} "
        f"tokens, best of {args.rounds} alternating rounds, {torch.get_num_threads()} thread(s)"
    )
    for b in args.batches:
        prompt = torch.randint(0, cfg.vocab_size, (b, args.prompt_len))
        decode_seconds(model, prompt, 2), hf_decode_seconds(hf, prompt, 2)  # warm up
        ours, theirs, ours_cpu, theirs_cpu = [], [], [], []
        for _ in range(args.rounds):
            c0 = time.thread_time()
            ours.append(decode_seconds(model, prompt, args.new_tokens))
            c1 = time.thread_time()
            theirs.append(hf_decode_seconds(hf, prompt, args.new_tokens))
            ours_cpu.append(c1 - c0)
            theirs_cpu.append(time.thread_time() - c1)
        a, h = b * args.new_tokens / min(ours), b * args.new_tokens / min(theirs)
        # with one thread, CPU time of this thread is immune to being descheduled on a busy machine
        cpu = f"   CPU-time ratio {min(theirs_cpu) / min(ours_cpu):.2f}" if torch.get_num_threads() == 1 else ""
        print(f"  batch {b:>3}: qkvlab {a:8.1f} tok/s   transformers {h:8.1f} tok/s   ratio {a / h:.2f}{cpu}")


@torch.inference_mode()
def step_ms(model, fill: int, steps: int, rounds: int, batch: int) -> float:
    prompt = torch.randint(0, model.cfg.vocab_size, (batch, fill)).tolist()
    best = float("inf")
    for _ in range(rounds):
        cache = new_cache(model, batch, fill + steps)
        padded = left_pad(prompt)
        tok = prefill(model, cache, padded).argmax(-1)
        pos = padded.lengths.clone()
        t0 = time.perf_counter()
        for _ in range(steps):
            tok = decode_step(model, cache, tok, pos).argmax(-1)
            pos += 1
        best = min(best, (time.perf_counter() - t0) / steps)
    return best * 1e3


def rope_on_read(args) -> None:
    fills = args.fills
    torch.manual_seed(0)
    cfg = preset(args.preset, attn="Q-K=V", pos="rope", context=max(fills) + args.steps + 1, kv_heads=args.kv_heads)
    model = GPT(cfg).eval()
    write = GPT(cfg).eval()
    write.load_state_dict(model.state_dict())
    write.trunk.cfg = cfg.replace(attn="Q-K-V", kv_heads=None)  # the trunk then builds no key tables
    for i in range(cfg.n_layer):
        write.trunk.layer(i).attn.k_shared_with_v = False  # rotate on write (values too: timing only)
    rot = model.trunk.rotary
    print(
        f"rope on read, {args.preset} Q-K=V kv_heads={cfg.n_kv_heads}, batch {args.rope_batch}, ms per decode step "
        f"(best of {args.rounds} x {args.steps} steps)"
    )
    print(f"  {'cache fill':>10}  {'read':>8}  {'write':>8}  {'read cost':>9}  {'table':>8}")
    for fill in fills:
        for _ in range(2):  # alternate the two models
            r = step_ms(model, fill, args.steps, args.rounds, args.rope_batch)
            w = step_ms(write, fill, args.steps, args.rounds, args.rope_batch)
        pos = torch.arange(fill)[None].expand(args.rope_batch, fill)
        t0 = time.perf_counter()
        for _ in range(50):
            rot.cos_sin(pos, torch.float32)
        table = (time.perf_counter() - t0) / 50 * 1e3
        print(f"  {fill:>10}  {r:8.3f}  {w:8.3f}  {100 * (r - w) / w:8.1f}%  {table:8.3f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="small")
    p.add_argument("--attn", default="Q-K-V")
    p.add_argument("--kv-heads", type=int, default=None)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--fills", type=int, nargs="+", default=[64, 512, 2048])
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--rope-batch", type=int, default=1)
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--skip-rope", action="store_true")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if not args.skip_hf:
        decode_ratio(args)
    if not args.skip_rope:
        rope_on_read(args)


if __name__ == "__main__":
    main()
