"""Per variant: training tokens/s and MFU, decoding tokens/s beside transformers' GPT-2 generate on
the same weights, KV-cache bytes allocated vs analytic, and capacity in a memory budget.
The library behind it: qkvlab.bench (BenchConfig, run)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import qkvlab.bench  # qkvlab.bench.run, looked up per call (tests replace it)
from qkvlab.base.errors import UserError
from qkvlab.base.files import atomic_write, json_text
from qkvlab.base.folders import check_file_target
from qkvlab.base.loadavg import NoisyMachine, describe
from qkvlab.base.settings import add_config_options, add_options, load, print_config
from qkvlab.base.units import cell, nbytes
from qkvlab.bench import BenchConfig


def add_arguments(p) -> None:
    add_config_options(p, "bench settings")
    add_options(p, BenchConfig)


def _is_bench_json(path: Path) -> bool:
    try:
        return "schemes" in json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, TypeError):
        return False


def run(args) -> int:
    cfg = load(BenchConfig, args.config, args)
    if print_config(args, cfg.to_dict()):
        return 0
    if cfg.compare_dir and not (Path(cfg.compare_dir) / "results.csv").is_file():  # before minutes of measuring
        raise UserError(f"{cfg.compare_dir}: no results.csv (expected the output folder of qkvlab compare)")
    if cfg.json:  # before minutes of measuring
        check_file_target(cfg.json, "--json", same_kind=_is_bench_json)
    try:
        result = qkvlab.bench.run(cfg, log=lambda s: print(s, file=sys.stderr, flush=True))
    except NoisyMachine as e:
        print(f"qkvlab bench: {e}", file=sys.stderr)
        return e.exit_code
    print_table(result, cfg)
    print(f"train dtype {result['train_dtype']}; machine: {describe(result['load'])}")
    rows = result["schemes"]
    mismatch = [n for n, r in rows.items() if r["kv_cache_bytes_allocated"] != r["kv_cache_bytes_analytic"]]
    if mismatch:
        print(f"cache bytes differ from the analytic figure for: {', '.join(mismatch)}", file=sys.stderr)
    if cfg.json:
        atomic_write(cfg.json, json_text(result, indent=2))
    if cfg.compare_dir:
        # startup: matplotlib and scipy, for --compare-dir only
        from qkvlab.analysis.plots import plot_cache_vs_quality

        print(f"wrote {plot_cache_vs_quality(cfg.compare_dir, cfg.plot)}")
    if cfg.require_quiet and result["load"]["noisy"]:
        print(
            "qkvlab bench: noisy machine during the run (--require-quiet); figures kept, marked noisy", file=sys.stderr
        )
        return 3
    return 1 if mismatch else 0


def print_table(result: dict, cfg: BenchConfig) -> None:
    """One row per variant: training, prefill/decode per batch beside transformers, cache and capacity."""
    rows = result["schemes"]
    keys = [str(b) for b in dict.fromkeys(cfg.decode_batches)]
    head = ["variant", "train tok/s", "MFU %"]
    for b in keys:
        head += [f"prefill b{b}", f"decode b{b}", "hf", "% limit"]
    head += ["cache B alloc", "analytic", "cache %", "capacity"]
    table = [head]
    for name, r in rows.items():
        ours, theirs = r["decode_tokens_per_s_by_batch"], r["hf_decode_tokens_per_s_by_batch"] or {}
        row = [name, cell(r.get("train_tokens_per_s"), ".0f"), cell(r.get("train_mfu") and 100 * r["train_mfu"], ".1f")]
        for b in keys:
            limit = r["bandwidth_fraction_by_batch"][b]
            hf = "unmeasured" if b in theirs and theirs[b] is None else cell(theirs.get(b))
            mine = "unmeasured" if ours[b] is None else cell(ours[b])
            row += [cell(r["prefill_tokens_per_s_by_batch"][b], ".0f"), mine, hf]
            row += [cell(limit and 100 * limit, ".0f")]
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
        f"cache at context {first['context']} x batch {cfg.batch}; capacity in "
        f"{nbytes(first['memory_budget_bytes'])}; decode prompt {cfg.prompt_len} + {first['decode_new_tokens']} tokens"
    )
    print(
        f"tokens/s; decode = one step per token after the prefill ({first['decode_path']} path), % limit = "
        f"the step's memory-bandwidth limit (weights + cache at {nbytes(result['copy_bytes_per_s'])}/s) / its time"
    )
    for row in table:
        print("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))))
