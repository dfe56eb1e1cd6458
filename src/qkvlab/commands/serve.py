"""Serve a model folder over HTTP, OpenAI-compatible, with continuous batching on the spec-sized KV cache.

POST /v1/completions (prompt, max_tokens, temperature, top_p, stop, seed, stream), GET /v1/models,
GET /health. The cache is a pool of --cache-memory bytes: capacity = cache memory / (KV-cache bytes
per token x context) sequences, so Q-K=V serves twice the sequences of Q-K-V and MQA more. Needs the
`serve` extra: pip install 'qkvlab[serve]'. See docs/serve.md.
"""

from __future__ import annotations

from qkvlab.cli import add_config_options, print_config
from qkvlab.errors import UserError
from qkvlab.serve.server import ServeConfig
from qkvlab.settings import add_options, options_from_args


def add_arguments(p) -> None:
    p.add_argument("model", metavar="MODEL", help="model folder (config.json + model.safetensors), as for generate")
    add_config_options(p, "serve settings")
    add_options(p, ServeConfig)


def config_from_args(args) -> ServeConfig:
    from qkvlab.train.config import read_config_file

    body = read_config_file(args.config) if args.config else {}
    names = set(ServeConfig.__dataclass_fields__)
    unknown = sorted(set(body) - names)
    if unknown:
        raise UserError(f"{args.config}: unknown serve setting {unknown[0]!r}; allowed: {', '.join(sorted(names))}")
    body.update(options_from_args(args, ServeConfig))
    body["model"] = args.model
    try:
        return ServeConfig(**body).validate()
    except TypeError as e:
        raise UserError(f"bad serve settings: {e}") from None


def run(args) -> int:
    cfg = config_from_args(args)
    if print_config(args, cfg.to_dict()):
        return 0
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise UserError(
            f"qkvlab serve needs the serve extra ({e.name} is missing): pip install 'qkvlab[serve]'"
        ) from None
    from qkvlab.serve.server import serve

    return serve(cfg)
