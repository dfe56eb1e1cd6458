"""Serve a model over HTTP, OpenAI/vLLM-compatible, with continuous batching on the spec-sized KV cache.

MODEL: a qkvlab folder, a Hugging Face folder or a .gguf, with its own tokenizer and chat template.
POST /v1/completions, /v1/chat/completions (streaming, logprobs, n, echo), /tokenize, /detokenize;
GET /v1/models, /health, /metrics (Prometheus, vLLM's names). The cache is a pool of --cache-memory bytes in
blocks of --block-size tokens: capacity = cache memory / KV-cache bytes per token, so Q-K=V holds twice the
tokens of Q-K-V and MQA more. Needs the `serve` extra: pip install 'qkvlab[serve]'. See docs/serve.md.
The settings: ServeConfig (qkvlab/serve/server.py).
"""

from __future__ import annotations

from qkvlab.base.errors import UserError
from qkvlab.base.settings import add_config_options, add_options, load, print_config
from qkvlab.serve.server import ServeConfig


def add_arguments(p) -> None:
    add_config_options(p, "serve settings")
    add_options(p, ServeConfig)


def run(args) -> int:
    cfg = load(ServeConfig, args.config, args)
    if print_config(args, cfg.to_dict()):
        return 0
    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise UserError(
            f"qkvlab serve needs the serve extra ({e.name} is missing): pip install 'qkvlab[serve]'"
        ) from None
    from qkvlab.serve.server import serve

    return serve(cfg)
