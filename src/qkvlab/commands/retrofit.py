"""Retrofit a trained model to K=V / GQA / MQA: keep the keys, fit the values on real text, uptrain.

  qkvlab retrofit IN OUT --to Q-K=V [--kv-heads N] [--layers SEL | --cache-budget F] [--steps N]

IN: a qkvlab model folder (with its tokenizer/) or a Hugging Face GPT-2/Llama folder or .gguf.
OUT: the retrofitted model folder, with fit/ (the fit alone), uptrain/ (the distillation run:
checkpoints, metrics.jsonl; --resume continues it), tokens.safetensors and retrofit.json (the
report). The last line printed is `ppl_original=… ppl_fit=… ppl_uptrained=… cache_ratio=…`
(held-out perplexity; KV-cache bytes after / before). See docs/retrofit.md.
"""

from __future__ import annotations

import json

from qkvlab.convert.retrofit import POOLS, RetrofitOptions, retrofit, summary_line


def add_arguments(p) -> None:
    d = RetrofitOptions()
    p.add_argument("input", metavar="IN", help="qkvlab model folder, or a Hugging Face GPT-2/Llama folder or .gguf")
    p.add_argument("output", metavar="OUT", help="folder to write (must be new or empty, or a retrofit to --resume)")
    p.add_argument("--to", metavar="SCHEME", default=d.to, help=f"Q-K=V or Q-K-V (default {d.to})")
    p.add_argument("--kv-heads", type=int, metavar="N", help="key/value heads after pooling (GQA; 1: MQA)")
    sel = p.add_mutually_exclusive_group()
    sel.add_argument("--layers", metavar="SEL", help="layers to convert: 'every4', '0,5,7', '-4:' (default: all)")
    sel.add_argument(
        "--cache-budget",
        type=float,
        metavar="F",
        help="convert the best-fitting layers (R^2) until the KV cache is at most F of the original's",
    )
    p.add_argument("--pool", choices=POOLS, default=d.pool, help="value heads: fitted (default) or plain mean")
    p.add_argument("--data", metavar="SOURCE", help="text: a path, 'shakespeare', 'hf:NAME' (default Shakespeare)")
    p.add_argument("--calib-tokens", type=int, default=d.calib_tokens, metavar="N", help="calibration tokens")
    p.add_argument("--eval-tokens", type=int, default=d.eval_tokens, metavar="N", help="held-out tokens scored")
    p.add_argument("--block-size", type=int, metavar="T", help="window length (default min(context, 256))")
    p.add_argument("--steps", type=int, default=d.steps, metavar="N", help=f"uptraining steps, 0: fit only ({d.steps})")
    p.add_argument("--batch-size", type=int, default=d.batch_size, metavar="B")
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--warmup-steps", type=int, default=d.warmup_steps, metavar="N")
    p.add_argument("--kl-weight", type=float, default=d.kl_weight, help="weight of KL(teacher||student) (default 1)")
    p.add_argument(
        "--lm-weight", type=float, default=d.lm_weight, help="weight of the LM loss (default 1; 0: pure distillation)"
    )
    p.add_argument("--eval-every", type=int, default=d.eval_every, metavar="N")
    p.add_argument(
        "--eval-batches", type=int, default=d.eval_batches, metavar="N", help="validation batches per uptraining eval"
    )
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--device", default=d.device)
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default=d.dtype, help="training autocast")
    p.add_argument("--resume", action="store_true", help="continue the uptraining in OUT")
    p.add_argument("--json", action="store_true", help="print the report as JSON before the last line")
    p.add_argument("--quiet", action="store_true", help="no progress output")


def run(args) -> int:
    opts = RetrofitOptions(
        to=args.to,
        kv_heads=args.kv_heads,
        layers=args.layers,
        cache_budget=args.cache_budget,
        pool=args.pool,
        data=args.data,
        calib_tokens=args.calib_tokens,
        eval_tokens=args.eval_tokens,
        block_size=args.block_size,
        steps=args.steps,
        batch_size=args.batch_size,
        lr=args.lr,
        warmup_steps=args.warmup_steps,
        kl_weight=args.kl_weight,
        lm_weight=args.lm_weight,
        eval_every=args.eval_every,
        eval_batches=args.eval_batches,
        seed=args.seed,
        device=args.device,
        dtype=args.dtype,
    )
    report = retrofit(args.input, args.output, opts, resume=args.resume, progress=not args.quiet)
    if args.json:
        print(json.dumps(report))
    print(f"wrote {args.output}")
    print(summary_line(report))
    return 0
