"""Retrofit a trained model to K=V / GQA / MQA, a key/value latent or MLA: fit on real text, then uptrain.

  qkvlab retrofit IN OUT --to Q-K=V [--kv-heads N] [--layers SEL | --cache-budget F] [--steps N]
  qkvlab retrofit IN OUT --to Q-K-V --kv-latent R [--rope-dim P] [--steps N]

Which route: at equal cache bytes the latent keeps far more quality than K=V or merged heads. With
--rope-dim P it is DeepSeek's Multi-head Latent Attention (the latent plus one rotated key of P numbers
shared by all heads): it decodes in the absorbed form, never rebuilding a key, and exports (`convert
--to-hf deepseek`, `--to-gguf`) to the layout llama.cpp and vLLM cache. Without it the latent stays
inside qkvlab. K=V and MQA export as stock Llama models, whose engines cache keys and values apart.
Measured curves: docs/retrofit.md.

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
