"""Parameters, KV-cache bytes and training FLOPs of a model config (analytic; no weights built).

The config is a preset with overrides, or the one saved in a model or run folder:
  qkvlab info --preset gpt2-124m --attn Id-K-V
  qkvlab info --preset gpt2-124m --variant Q-K-V/width=Id-K-V   # Paper A's original_smaller_overall
  qkvlab info runs/tiny                                         # a model folder or a training run
  qkvlab info --preset paperB-1.2b --memory --batch 4 --world 8 --sharding fsdp   # memory per GPU
  qkvlab info --decisions                                       # timed decisions cached here, one a line
  qkvlab info --forget                                          # remove them (measured again when needed)
"""

from __future__ import annotations

import json

from qkvlab.base.files import cache_dir
from qkvlab.base.measured import cached_lines, forget
from qkvlab.base.settings import add_config_options, add_options, load, print_config, resolve
from qkvlab.base.units import human, nbytes
from qkvlab.model.accounting import memory_estimate, report
from qkvlab.model.config import DEFAULT_PRESET, ModelConfig, model_file_settings
from qkvlab.model.folder import find_model_dir, read_config
from qkvlab.model.info import InfoConfig
from qkvlab.model.spec import KNOWN_SCHEMES
from qkvlab.model.variants import parse_variant


def add_arguments(p) -> None:
    add_config_options(p, "model config (ModelConfig keys, or a config.json)")
    add_options(p, InfoConfig)


def folder_config(path: str):
    """The model config saved in a model folder, or in a run folder (its final model, else its
    last checkpoint)."""
    return read_config(find_model_dir(path))[0]


def run(args) -> int:
    opts = load(InfoConfig, None, args)
    if opts.decisions or opts.forget:
        return decisions(opts)
    saved = folder_config(opts.folder) if opts.folder else model_file_settings(args.config) if args.config else None
    # the folder's config or the file (else the default preset), the command line over it; a --preset
    # replaces a folder's whole config, and a file's keys apply over it
    cfg = resolve(
        ModelConfig, saved if saved is not None else {"preset": DEFAULT_PRESET}, {"preset": opts.preset, **opts.model}
    )
    if opts.variant:
        cfg = parse_variant(opts.variant).apply(cfg)
    if print_config(args, cfg.to_dict()):
        return 0
    info = report(cfg, dtype=opts.dtype, context=opts.cache_tokens)
    if opts.memory:
        mem = memory_estimate(cfg, micro_batch=opts.batch, world=opts.world, sharding=opts.sharding, dtype=opts.dtype)
        info["memory_per_gpu"] = {"micro_batch": opts.batch, "world": opts.world, "sharding": opts.sharding, **mem}
    if opts.json:
        print(json.dumps(info))
        return 0
    meaning = KNOWN_SCHEMES.get(info["scheme"], "")
    rows = [
        ("scheme", f"{info['scheme']}" + (f"  ({meaning})" if meaning else "")),
        ("layers x heads x d_head", f"{cfg.n_layer} x {cfg.n_head} x {cfg.head_dim} (kv_heads {cfg.n_kv_heads})"),
        *([("per-layer scheme/kv_heads", " ".join(info["layers"]))] if info["layers"] else []),
        *([("kv latent", latent_line(cfg))] if cfg.kv_latent else []),
        ("d_model / MLP hidden", f"{cfg.d_model} / {cfg.hidden}"),
        ("attention scale", f"{cfg.scale:.6g}"),
        ("params total", f"{info['params_total']:,} ({human(info['params_total'])})"),
        ("params non-embedding", f"{info['params_non_embedding']:,} ({human(info['params_non_embedding'])})"),
        ("params attention", f"{info['params_attention']:,} ({human(info['params_attention'])})"),
        (f"KV cache / token ({opts.dtype})", f"{info['kv_cache_bytes_per_token']:,} B"),
        (
            f"KV cache @ {info['context']} tokens",
            f"{info['kv_cache_bytes']:,} B ({nbytes(info['kv_cache_bytes'])})",
        ),
        ("train FLOPs / token", f"{info['flops_per_token']:,} ({human(info['flops_per_token'])})"),
    ]
    if opts.memory:
        m = info["memory_per_gpu"]
        where = f"{opts.sharding} x{opts.world}, micro-batch {opts.batch} x {cfg.context} tokens, {opts.dtype}"
        rows.append((f"memory / GPU ({where})", ""))
        for key in ("params", "grads", "optimizer", "comm_buffers", "activations", "logits", "total"):
            rows.append((f"  {key.replace('_', ' ')}", nbytes(m[key])))
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    return 0


def latent_line(cfg) -> str:
    """What a latent layer caches, in words."""
    if cfg.rope_dim is None:
        return f"{cfg.kv_latent} numbers per token and layer, keys and values read back"
    return (
        f"MLA: {cfg.kv_latent} + {cfg.rope_dim} numbers per token and layer (the normalised latent, then a RoPE key "
        "shared by every head); decoded absorbed"
    )


def decisions(opts: InfoConfig) -> int:
    """--decisions: the cached timed decisions, one line each; --forget: remove them, one line."""
    if opts.decisions:
        print("\n".join(cached_lines()) or f"no timed decisions in {cache_dir()}")
    if opts.forget:
        print(forget())
    return 0
