"""Retrofit a trained model to K=V / GQA / MQA or a key/value latent: fit on real text, then uptrain.

  qkvlab retrofit IN OUT --to Q-K=V [--kv-heads N] [--layers SEL | --cache-budget F] [--steps N]
  qkvlab retrofit IN OUT --to Q-K-V --kv-latent R [--steps N]

Which route: at equal cache bytes the latent keeps far more quality (SmolLM2-135M at half the cache,
before any distillation: within x1.04 of the original where K=V's fit is x1.4-3.8), but every decode
step rebuilds the cached keys (0.73x the original's tokens/s at 1 stream, 0.41x at 16 on a 2-core CPU)
and no other engine reads it; K=V (0.87-0.91x on 15 layers) and MQA export to transformers and
llama.cpp. Measured curves: docs/retrofit.md.

IN: a qkvlab model folder (with its tokenizer/) or a Hugging Face GPT-2/Llama folder or .gguf.
OUT: the retrofitted model folder, with fit/ (the fit alone), uptrain/ (the distillation run:
checkpoints, metrics.jsonl; --resume continues it), tokens.safetensors and retrofit.json (the
report). The last line printed is `ppl_original=… ppl_fit=… ppl_uptrained=… cache_ratio=…`
(held-out perplexity; KV-cache bytes after / before). The library: qkvlab.retrofit.workflow
(RetrofitConfig, RetrofitOptions, retrofit, fit). See docs/retrofit.md.
"""

from __future__ import annotations

import json
from dataclasses import asdict

from qkvlab.base.settings import add_config_options, add_options, load, print_config
from qkvlab.retrofit.options import RetrofitConfig
from qkvlab.retrofit.workflow import retrofit, summary_line


def add_arguments(p) -> None:
    add_config_options(p, "retrofit settings")
    add_options(p, RetrofitConfig)


def run(args) -> int:
    cfg = load(RetrofitConfig, args.config, args)
    if print_config(args, asdict(cfg.options())):
        return 0
    report = retrofit(cfg.input, cfg.output, cfg.options(), resume=cfg.resume, progress=not cfg.quiet)
    if cfg.json:
        print(json.dumps(report))
    print(f"wrote {cfg.output}")
    print(summary_line(report))
    return 0
