"""Generate text from a model folder with a KV cache, streaming tokens to the terminal.

The tokenizer comes from the model folder (a `tokenizer/` folder beside the weights: a qkvlab tokenizer,
or transformers' files as `retrofit` and `convert --from-hf` write them; or the GPT-2 tokenizer its
training config names); otherwise pass --tokenizer (gpt2, bytes, or a folder holding a saved qkvlab or
transformers tokenizer), or give token ids with --prompt-ids. The settings: GenerateConfig
(qkvlab/decode/config.py); the decoding: qkvlab.decode.generate, as the DecodeChoices built once here say
(qkvlab.decode.choices: the dtype, timed for `auto` on the CPU, and the weights' layout).
"""

from __future__ import annotations

import sys
from dataclasses import asdict

from qkvlab.base.devices import compile_mode, select_device, torch_dtype
from qkvlab.base.errors import UserError
from qkvlab.base.settings import add_config_options, add_options, load, print_config
from qkvlab.convert.load import model_tokenizer
from qkvlab.decode.choices import decode_choices
from qkvlab.decode.config import GenerateConfig
from qkvlab.decode.generate import FINISHED, generate, stream
from qkvlab.decode.steps import check_prompts
from qkvlab.model.folder import find_model_dir, load_model, read_config
from qkvlab.serve.tokens import serve_tokenizer


def add_arguments(p) -> None:
    add_config_options(p, "generate settings")
    add_options(p, GenerateConfig)


def encode_prompts(cfg: GenerateConfig, tok, vocab_size: int) -> list[list[int]]:
    if cfg.prompt is None:
        return cfg.prompt_token_ids()
    if tok is None:
        raise UserError(f"{cfg.model_dir}: no tokenizer recorded; pass --tokenizer gpt2|bytes|DIR, or --prompt-ids")
    if tok.vocab_size > vocab_size:
        raise UserError(f"tokenizer {tok.name} has {tok.vocab_size} ids but the model's vocabulary is {vocab_size}")
    return [tok.encode(text) for text in cfg.prompt]


def run(args) -> int:
    cfg = load(GenerateConfig, args.config, args)
    if print_config(args, asdict(cfg)):
        return 0
    sampling = cfg.sampling
    model_dir = find_model_dir(cfg.model_dir)
    model_cfg, body = read_config(model_dir)  # validates the folder before weights are read
    tok, tok_dir = model_tokenizer(cfg.tokenizer, model_dir, body)
    if hasattr(tok, "apply_chat_template"):  # transformers' files: read as serve reads them (stop ids included)
        tok = serve_tokenizer(tok, tok_dir)
    prompts = encode_prompts(cfg, tok, model_cfg.vocab_size)
    device = select_device(cfg.device)
    # dtype auto on the CPU and a real model's layout: timed (or cached) before the weights are read
    choices = decode_choices(model_cfg, device=device, dtype=cfg.dtype, batch=len(prompts))
    model, model_cfg, _ = load_model(model_dir, device=device, dtype=torch_dtype(choices.dtype, device.type))
    mode = compile_mode(cfg.compile, device.type)

    def report(seconds: float) -> None:
        print(
            f"qkvlab generate: compiled the decode step ({mode}, batch {len(prompts)}) in {seconds:.1f} s",
            file=sys.stderr,
            flush=True,
        )

    eot = getattr(tok, "eot_id", None)
    how = dict(choices=choices, eot_id=eot, seed=cfg.seed, compile=mode or False, on_compiled=report)
    how["vocab_limit"] = tok.vocab_size if tok is not None else None
    check_prompts(model, prompts)  # before the notes below: a refusal is one line
    if choices.dtype_decision is not None:  # what auto resolved to, from which figures (a decode step, or the cache)
        print(f"qkvlab generate: {choices.dtype_decision.describe()}", file=sys.stderr, flush=True)
    if max(len(p) for p in prompts) + cfg.max_new_tokens > model_cfg.context + 1:
        print(f"qkvlab generate: note: stopping at the model's context of {model_cfg.context} tokens", file=sys.stderr)
    show = (lambda ids: tok.decode(ids)) if tok is not None else (lambda ids: " ".join(map(str, ids)) + " ")
    if len(prompts) == 1:
        print_stream(
            stream(model, prompts, cfg.max_new_tokens, sampling, **how), prompts[0], show, eot, tok is not None
        )
        return 0
    rows = generate(model, prompts, cfg.max_new_tokens, sampling, **how)
    for r, (p, ids) in enumerate(zip(prompts, rows)):
        sys.stdout.write(f"--- sample {r}\n{show(p) if tok is not None else ''}{show(ids)}\n")
    return 0


def print_stream(tokens, prompt: list[int], show, eot: int | None, echo: bool) -> None:
    """One row: print each piece as soon as it decodes to whole characters."""
    out = sys.stdout
    ids: list[int] = []
    shown = ""
    out.write(show(prompt) if echo else "")
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
