"""Per scheme: training tokens/s and MFU, decoding tokens/s beside transformers' GPT-2 generate on the
same weights, KV-cache bytes allocated vs analytic, and capacity in a memory budget."""

from __future__ import annotations

import json
import sys

from qkvlab.bench import BenchOptions, parse_scheme_list, plot_cache_vs_quality, run_bench
from qkvlab.cli import _positive_int, add_model_options, model_config_from_args
from qkvlab.errors import UserError
from qkvlab.io import atomic_write_text

DEFAULT_SCHEMES = "Q-K-V,Id-K-V,Q-K=V,Q=K=V,Id-K=V,Q-K=V:mqa"


def _size(text: str) -> int:
    units = {"": 1, "B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
    t = text.strip().upper()
    num = t.rstrip("KMGTIB")
    unit = t[len(num) :]
    try:
        value = float(num) * units[unit]
    except (ValueError, KeyError):
        raise UserError(f"--memory-budget {text!r}: write a size like 24GB, 80GiB or 512MB") from None
    if value <= 0:
        raise UserError(f"--memory-budget {text!r} must be positive")
    return int(value)


def add_arguments(p) -> None:
    add_model_options(p)
    p.add_argument(
        "--schemes",
        default=DEFAULT_SCHEMES,
        metavar="LIST",
        help=f"comma-separated schemes; ':kvN' or ':mqa' sets key/value heads (default {DEFAULT_SCHEMES})",
    )
    p.add_argument("--batch", type=_positive_int, default=16, metavar="B", help="sequences in the cache-bytes figure")
    p.add_argument("--decode-batches", default="1,16", metavar="LIST", help="decode batch sizes (default 1,16)")
    p.add_argument("--prompt-len", type=_positive_int, default=16, metavar="T")
    p.add_argument("--new-tokens", type=_positive_int, default=32, metavar="N", help="tokens decoded per sequence")
    p.add_argument("--rounds", type=_positive_int, default=3, help="alternating timing rounds (best is reported)")
    p.add_argument("--train-batch", type=_positive_int, default=4, metavar="B")
    p.add_argument("--train-steps", type=_positive_int, default=3, metavar="N")
    p.add_argument("--memory-budget", metavar="SIZE", help="capacity budget, e.g. 24GB (default: this device's memory)")
    p.add_argument("--device", default="auto")
    p.add_argument(
        "--dtype", choices=["auto", "fp32", "bf16", "fp16"], default="auto", help="auto: bf16 on GPU, fp32 on CPU"
    )
    p.add_argument("--compile", action="store_true", help="torch.compile the decode step")
    p.add_argument("--no-hf", dest="hf", action="store_false", help="skip the transformers comparison")
    p.add_argument("--no-train", dest="train", action="store_false", help="skip the training throughput")
    p.add_argument("--threads", type=_positive_int, metavar="N", help="torch CPU threads (default: torch's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    p.add_argument("--compare-dir", metavar="DIR", help="a qkvlab compare output: plot cache bytes vs quality")
    p.add_argument("--plot", metavar="FILE", default="cache_vs_quality.png", help="where the plot goes")


def _fmt(x, spec=".1f") -> str:
    return "-" if x is None else format(x, spec)


def run(args) -> int:
    from qkvlab.commands.generate import pick_device

    cfg = model_config_from_args(args)
    schemes = parse_scheme_list(args.schemes, cfg)
    try:
        batches = tuple(int(b) for b in args.decode_batches.split(","))
    except ValueError:
        batches = ()
    if not batches or min(batches) < 1:
        raise UserError(f"--decode-batches {args.decode_batches!r}: positive integers separated by commas")
    if args.prompt_len >= cfg.context:
        raise UserError(f"--prompt-len {args.prompt_len} leaves no room to decode in a context of {cfg.context}")
    device = pick_device(args.device)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    opts = BenchOptions(
        batch=args.batch,
        decode_batches=batches,
        prompt_len=args.prompt_len,
        new_tokens=args.new_tokens,
        rounds=args.rounds,
        train_batch=args.train_batch,
        train_steps=args.train_steps,
        memory_budget=_size(args.memory_budget) if args.memory_budget else None,
        device=str(device),
        dtype=args.dtype,
        compile=args.compile,
        hf=args.hf,
        train=args.train,
        seed=args.seed,
        log=lambda s: print(s, file=sys.stderr, flush=True),
    )
    if args.compare_dir:  # check the compare folder before spending minutes measuring
        from pathlib import Path

        if not (Path(args.compare_dir) / "results.csv").is_file():
            raise UserError(f"{args.compare_dir}: no results.csv (expected the output folder of qkvlab compare)")
    result = run_bench(schemes, opts)
    rows = result["schemes"]
    keys = [str(b) for b in dict.fromkeys(batches)]
    head = ["scheme", "train tok/s", "MFU %"]
    for b in keys:
        head += [f"decode b{b}", "hf"]
    head += ["cache B alloc", "analytic", "cache %", "capacity"]
    table = [head]
    for name, r in rows.items():
        ours, theirs = r["decode_tokens_per_s_by_batch"], r["hf_decode_tokens_per_s_by_batch"] or {}
        row = [name, _fmt(r.get("train_tokens_per_s"), ".0f"), _fmt(r.get("train_mfu") and 100 * r["train_mfu"], ".1f")]
        for b in keys:
            row += [_fmt(ours[b]), _fmt(theirs.get(b))]
        row += [
            f"{r['kv_cache_bytes_allocated']:,}",
            f"{r['kv_cache_bytes_analytic']:,}",
            f"{100 * r['kv_cache_fraction_of_first']:.2f}",
            f"{r['capacity_sequences']:,}",
        ]
        table.append(row)
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    first = rows[next(iter(rows))]
    print(
        f"{result['device']} {result['dtype']}, matmul {result['matmul_flops_per_s'] / 1e9:.1f} GFLOP/s; "
        f"cache at context {first['context']} x batch {args.batch}; capacity in "
        f"{first['memory_budget_bytes'] / 1e9:.1f} GB; decode prompt {args.prompt_len} + {first['decode_new_tokens']} tokens"
    )
    for row in table:
        print("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))))
    mismatch = [n for n, r in rows.items() if r["kv_cache_bytes_allocated"] != r["kv_cache_bytes_analytic"]]
    if mismatch:
        print(f"cache bytes differ from the analytic figure for: {', '.join(mismatch)}", file=sys.stderr)
    if args.json:
        atomic_write_text(args.json, json.dumps(result, indent=2) + "\n")
    if args.compare_dir:
        print(f"wrote {plot_cache_vs_quality(args.compare_dir, args.plot)}")
    return 1 if mismatch else 0
