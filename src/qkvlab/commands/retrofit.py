"""Retrofit a trained model to K=V / GQA / MQA: keep the keys, fit the values on real text, uptrain.

  qkvlab retrofit IN OUT --to Q-K=V [--kv-heads N] [--layers SEL | --cache-budget F] [--steps N]

IN: a qkvlab model folder (with its tokenizer/) or a Hugging Face GPT-2/Llama folder or .gguf.
OUT: the retrofitted model folder, with fit/ (the fit alone), uptrain/ (the distillation run:
checkpoints, metrics.jsonl; --resume continues it), tokens.safetensors and retrofit.json (the
report). The last line printed is `ppl_original=… ppl_fit=… ppl_uptrained=… cache_ratio=…`
(held-out perplexity; KV-cache bytes after / before). The library: qkvlab.convert.retrofit
(RetrofitOptions, retrofit, fit). See docs/retrofit.md.
"""

from __future__ import annotations

import json

from qkvlab.cli import add_config_options, print_config
from qkvlab.convert.retrofit import RetrofitOptions, retrofit, summary_line
from qkvlab.errors import UserError
from qkvlab.settings import add_options, options_from_args


def add_arguments(p) -> None:
    p.add_argument("input", metavar="IN", help="qkvlab model folder, or a Hugging Face GPT-2/Llama folder or .gguf")
    p.add_argument("output", metavar="OUT", help="folder to write (new or empty, or a retrofit to --resume)")
    add_config_options(p, "retrofit settings")
    add_options(p, RetrofitOptions)
    p.add_argument("--resume", action="store_true", help="continue the uptraining in OUT")
    p.add_argument("--json", action="store_true", help="print the report as JSON before the last line")
    p.add_argument("--quiet", action="store_true", help="no progress output")


def options_from(args) -> RetrofitOptions:
    from qkvlab.train.config import read_config_file

    body = read_config_file(args.config) if args.config else {}
    names = set(RetrofitOptions.__dataclass_fields__)
    unknown = sorted(set(body) - names)
    if unknown:
        raise UserError(f"{args.config}: unknown retrofit setting {unknown[0]!r}; allowed: {', '.join(sorted(names))}")
    body.update(options_from_args(args, RetrofitOptions))
    try:
        return RetrofitOptions(**body).validate()
    except TypeError as e:
        raise UserError(f"bad retrofit settings: {e}") from None


def run(args) -> int:
    from dataclasses import asdict

    opts = options_from(args)
    if print_config(args, asdict(opts)):
        return 0
    report = retrofit(args.input, args.output, opts, resume=args.resume, progress=not args.quiet)
    if args.json:
        print(json.dumps(report))
    print(f"wrote {args.output}")
    print(summary_line(report))
    return 0
