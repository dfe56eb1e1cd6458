"""Generate text from a model folder with a KV cache, streaming tokens to the terminal.

The tokenizer comes from the model folder (a `tokenizer/` folder beside the weights, or the GPT-2
tokenizer its training config names); otherwise pass --tokenizer (gpt2, bytes, or a folder holding a
saved qkvlab tokenizer), or give token ids with --prompt-ids.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from qkvlab.cli import find_model_dir
from qkvlab.devices import DEVICE_HELP, INFERENCE_DTYPES, dtype_choices
from qkvlab.errors import UserError
from qkvlab.generate import FINISHED, Sampling, stream

TOKENIZER_DIR = "tokenizer"


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255: works with any model of vocab >= 256, no files needed."""

    name = spec = "bytes"
    vocab_size = 256
    eot_id = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


def _parse_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        raise UserError(f"--prompt-ids {text!r} must be integers separated by commas or spaces") from None


def resolve_tokenizer(choice: str | None, model_dir: Path, body: dict):
    """--tokenizer wins; else what the model folder records; else None."""
    from qkvlab.data.tokenizer import GPT2Tokenizer, load_tokenizer

    if choice is not None:
        if choice == "bytes":
            return ByteTokenizer()
        if choice == "gpt2":
            return GPT2Tokenizer()
        if Path(choice).is_dir():
            return load_tokenizer(choice)
        raise UserError(f"--tokenizer {choice!r}: use gpt2, bytes, or a folder holding a saved qkvlab tokenizer")
    for folder in (model_dir / TOKENIZER_DIR, model_dir.parent / TOKENIZER_DIR):
        if (folder / "qkvlab_tokenizer.json").is_file():
            return load_tokenizer(folder)
    recorded = body.get("tokenizer")
    if recorded is None:
        train = body.get("train") if isinstance(body.get("train"), dict) else {}
        recorded = (train.get("task_options") or {}).get("tokenizer")
    if isinstance(recorded, str):
        if recorded == "gpt2":
            return GPT2Tokenizer()
        if recorded == "bytes":
            return ByteTokenizer()
        if (model_dir / recorded).is_dir():
            return load_tokenizer(model_dir / recorded)
    return None


def add_arguments(p) -> None:
    p.add_argument("model_dir", metavar="MODEL_DIR", help="model folder (config.json + model.safetensors)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", action="append", metavar="TEXT", help="prompt text (repeat for a batch)")
    src.add_argument(
        "--prompt-ids", action="append", metavar="IDS", help="prompt as token ids, e.g. '1,2,3' (repeatable)"
    )
    p.add_argument(
        "--max-new-tokens", type=int, default=100, metavar="N", help="tokens to generate per prompt (default 100)"
    )
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy (default 0.8)")
    p.add_argument("--top-k", type=int, default=0, metavar="K", help="keep the K most likely tokens (0 = off)")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P", help="nucleus sampling mass in (0, 1] (1 = off)")
    p.add_argument("--seed", type=int, default=None, help="seed for sampling (default: random)")
    p.add_argument("--tokenizer", metavar="gpt2|bytes|DIR", help="tokenizer when the model folder records none")
    p.add_argument("--device", default="auto", metavar="DEVICE", help=f"{DEVICE_HELP} (default auto)")
    p.add_argument(
        "--dtype",
        choices=dtype_choices(INFERENCE_DTYPES),
        default="auto",
        help="weights and cache dtype (auto: bf16 on GPU, fp32 on CPU)",
    )
    p.add_argument(
        "--compile",
        nargs="?",
        const="default",
        default="auto",
        choices=["auto", "off", "default", "reduce-overhead", "max-autotune"],
        help="torch.compile the static decode step with this mode (bare --compile: default). auto: "
        "reduce-overhead (CUDA graphs) on a GPU, off on a CPU, where compiling takes longer than it saves "
        "in one run (docs/inference.md)",
    )


def run(args) -> int:
    from qkvlab.devices import select_device, torch_dtype
    from qkvlab.io import load_model, read_config

    sampling = Sampling(args.temperature, args.top_k, args.top_p).validate()
    if args.max_new_tokens < 1:
        raise UserError(f"--max-new-tokens={args.max_new_tokens} must be an integer >= 1")
    model_dir = find_model_dir(args.model_dir)
    cfg, body = read_config(model_dir)  # validates the folder before weights are read
    tok = resolve_tokenizer(args.tokenizer, model_dir, body)
    if args.prompt is not None:
        if tok is None:
            raise UserError(
                f"{args.model_dir}: no tokenizer recorded; pass --tokenizer gpt2|bytes|DIR, or --prompt-ids"
            )
        if tok.vocab_size > cfg.vocab_size:
            raise UserError(
                f"tokenizer {tok.name} has {tok.vocab_size} ids but the model's vocabulary is {cfg.vocab_size}"
            )
        if any(not text for text in args.prompt):
            raise UserError("empty prompt: give at least one character to start from")
        prompts = [tok.encode(text) for text in args.prompt]
    else:
        prompts = [_parse_ids(ids) for ids in args.prompt_ids]
    device = select_device(args.device)
    dtype = torch_dtype(args.dtype, device.type)
    model, cfg, _ = load_model(model_dir, device=device, dtype=dtype)
    eot = getattr(tok, "eot_id", None)
    compile_mode = args.compile if args.compile != "auto" else ("reduce-overhead" if device.type == "cuda" else "off")

    def report(seconds: float) -> None:
        print(
            f"qkvlab generate: compiled the decode step ({compile_mode}, batch {len(prompts)}) in {seconds:.1f} s",
            file=sys.stderr,
            flush=True,
        )

    tokens = stream(
        model,
        prompts,
        args.max_new_tokens,
        sampling,
        eot_id=eot,
        seed=args.seed,
        compile=False if compile_mode == "off" else compile_mode,
        vocab_limit=tok.vocab_size if tok is not None else None,
        on_compiled=report,
    )
    longest = max(len(p) for p in prompts)
    if longest + args.max_new_tokens > cfg.context + 1:
        print(f"qkvlab generate: note: stopping at the model's context of {cfg.context} tokens", file=sys.stderr)
    show = (lambda ids: tok.decode(ids)) if tok is not None else (lambda ids: " ".join(map(str, ids)) + " ")
    out = sys.stdout
    if len(prompts) == 1:  # stream: print each piece as soon as it decodes to whole characters
        ids: list[int] = []
        shown = ""
        out.write(show(prompts[0]) if tok is not None else "")
        for step in tokens:
            t = int(step[0])
            if t == FINISHED or t == eot:
                break
            ids.append(t)
            text = show(ids)
            if not text.endswith("\ufffd"):
                out.write(text[len(shown) :])
                out.flush()
                shown = text
        out.write(show(ids)[len(shown) :] + "\n")
        return 0
    rows: list[list[int]] = [[] for _ in prompts]
    done = [False] * len(prompts)
    for step in tokens:
        for r, t in enumerate(step.tolist()):
            if done[r] or t == FINISHED or t == eot:
                done[r] = True
                continue
            rows[r].append(t)
    for r, (p, ids) in enumerate(zip(prompts, rows)):
        out.write(f"--- sample {r}\n{show(p) if tok is not None else ''}{show(ids)}\n")
    return 0
