"""Parameters, KV-cache bytes and training FLOPs of a model config (analytic; no weights built).

The config is a preset with overrides, or the one saved in a model or run folder:
  qkvlab info --preset gpt2-124m --attn Id-K-V
  qkvlab info --preset gpt2-124m --variant Q-K-V/width=Id-K-V   # Paper A's original_smaller_overall
  qkvlab info runs/tiny                                         # a model folder or a training run
  qkvlab info --preset paperB-1.2b --memory --batch 4 --world 8 --sharding fsdp   # memory per GPU
"""

from __future__ import annotations

import json

from qkvlab.accounting import memory_estimate, report
from qkvlab.cli import add_config_options, add_model_options, find_model_dir, model_config_from_args, print_config
from qkvlab.devices import SHARDINGS, dtype_choices
from qkvlab.settings import nonempty, positive_int
from qkvlab.spec import KNOWN_SCHEMES
from qkvlab.units import human, nbytes


def add_arguments(p) -> None:
    add_config_options(p, "model config (ModelConfig keys, or a config.json)")
    p.add_argument(
        "folder",
        nargs="?",
        type=nonempty,
        metavar="RUN_OR_MODEL_DIR",
        help="a model folder or a training run folder (its config; options below override it)",
    )
    p.add_argument(
        "--variant",
        type=nonempty,
        metavar="VARIANT",
        help="apply a compare variant, e.g. Q-K=V/MQA, Id-K-V/mlp, Q-K-V/width=Id-K-V",
    )
    p.add_argument("--dtype", choices=dtype_choices(auto=False), default="bf16", help="cache dtype (default bf16)")
    p.add_argument(
        "--cache-tokens",
        type=positive_int,
        metavar="T",
        help="tokens held in the KV cache figure (default: the model's --context)",
    )
    g = p.add_argument_group("training memory per GPU (--memory)")
    g.add_argument("--memory", action="store_true", help="estimate a training step's memory per GPU")
    g.add_argument("--batch", type=positive_int, default=8, metavar="B", help="micro-batch per GPU (default 8)")
    g.add_argument("--world", type=positive_int, default=1, metavar="W", help="GPUs (ranks) in all (default 1)")
    g.add_argument("--sharding", choices=SHARDINGS, default="ddp", help="ddp (replicated, default) or fsdp")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    add_model_options(p)


def folder_config(path: str):
    """The model config saved in a model folder, or in a run folder (its final model, else its
    last checkpoint)."""
    from qkvlab.io import read_config

    return read_config(find_model_dir(path))[0]


def run(args) -> int:
    base = folder_config(args.folder) if args.folder else None
    cfg = model_config_from_args(args, base)
    if args.variant:
        from qkvlab.variants import parse_variant

        cfg = parse_variant(args.variant).apply(cfg)
    if print_config(args, cfg.to_dict()):
        return 0
    info = report(cfg, dtype=args.dtype, context=args.cache_tokens)
    if args.memory:
        mem = memory_estimate(cfg, micro_batch=args.batch, world=args.world, sharding=args.sharding, dtype=args.dtype)
        info["memory_per_gpu"] = {"micro_batch": args.batch, "world": args.world, "sharding": args.sharding, **mem}
    if args.json:
        print(json.dumps(info))
        return 0
    meaning = KNOWN_SCHEMES.get(info["scheme"], "")
    rows = [
        ("scheme", f"{info['scheme']}" + (f"  ({meaning})" if meaning else "")),
        ("layers x heads x d_head", f"{cfg.n_layer} x {cfg.n_head} x {cfg.head_dim} (kv_heads {cfg.n_kv_heads})"),
        *([("per-layer scheme/kv_heads", " ".join(info["layers"]))] if info["layers"] else []),
        ("d_model / MLP hidden", f"{cfg.d_model} / {cfg.hidden}"),
        ("attention scale", f"{cfg.scale:.6g}"),
        ("params total", f"{info['params_total']:,} ({human(info['params_total'])})"),
        ("params non-embedding", f"{info['params_non_embedding']:,} ({human(info['params_non_embedding'])})"),
        ("params attention", f"{info['params_attention']:,} ({human(info['params_attention'])})"),
        (f"KV cache / token ({args.dtype})", f"{info['kv_cache_bytes_per_token']:,} B"),
        (
            f"KV cache @ {info['context']} tokens",
            f"{info['kv_cache_bytes']:,} B ({nbytes(info['kv_cache_bytes'])})",
        ),
        ("train FLOPs / token", f"{info['flops_per_token']:,} ({human(info['flops_per_token'])})"),
    ]
    if args.memory:
        m = info["memory_per_gpu"]
        where = f"{args.sharding} x{args.world}, micro-batch {args.batch} x {cfg.context} tokens, {args.dtype}"
        rows.append((f"memory / GPU ({where})", ""))
        for key in ("params", "grads", "optimizer", "comm_buffers", "activations", "logits", "total"):
            rows.append((f"  {key.replace('_', ' ')}", nbytes(m[key])))
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    return 0
