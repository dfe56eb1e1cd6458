"""Parameters, KV-cache bytes and training FLOPs of a model config (analytic; no weights built)."""

from __future__ import annotations

import json

from qkvlab.accounting import DTYPE_BYTES, report
from qkvlab.cli import add_model_options, model_config_from_args
from qkvlab.errors import UserError
from qkvlab.spec import KNOWN_SCHEMES


def add_arguments(p) -> None:
    add_model_options(p)
    p.add_argument("--dtype", choices=list(DTYPE_BYTES), default="bf16", help="cache dtype (default bf16)")
    p.add_argument(
        "--cache-tokens",
        type=int,
        metavar="T",
        help="tokens held in the KV cache figure (default: the model's --context)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _human(n: float, unit: str = "") -> str:
    for suffix, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{suffix}{unit}"
    return f"{n:g}{unit}"


def run(args) -> int:
    cfg = model_config_from_args(args)
    if args.cache_tokens is not None and args.cache_tokens <= 0:
        raise UserError(f"--cache-tokens={args.cache_tokens} must be a positive integer")
    info = report(cfg, dtype=args.dtype, context=args.cache_tokens)
    if args.json:
        print(json.dumps(info))
        return 0
    meaning = KNOWN_SCHEMES.get(info["scheme"], "")
    rows = [
        ("scheme", f"{info['scheme']}" + (f"  ({meaning})" if meaning else "")),
        ("layers x heads x d_head", f"{cfg.n_layer} x {cfg.n_head} x {cfg.head_dim} (kv_heads {cfg.n_kv_heads})"),
        ("d_model / MLP hidden", f"{cfg.d_model} / {cfg.hidden}"),
        ("attention scale", f"{cfg.scale:.6g}"),
        ("params total", f"{info['params_total']:,} ({_human(info['params_total'])})"),
        ("params non-embedding", f"{info['params_non_embedding']:,} ({_human(info['params_non_embedding'])})"),
        ("params attention", f"{info['params_attention']:,} ({_human(info['params_attention'])})"),
        (f"KV cache / token ({args.dtype})", f"{info['kv_cache_bytes_per_token']:,} B"),
        (
            f"KV cache @ {info['context']} tokens",
            f"{info['kv_cache_bytes']:,} B ({_human(info['kv_cache_bytes'], 'B')})",
        ),
        ("train FLOPs / token", f"{info['flops_per_token']:,} ({_human(info['flops_per_token'])})"),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    return 0
