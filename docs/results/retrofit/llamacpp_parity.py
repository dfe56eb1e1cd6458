"""Does llama.cpp itself read qkvlab's GGUF export? (issue 30) Greedy tokens of llama.cpp against qkvlab's.

MODEL (a qkvlab model folder, e.g. a retrofit's OUT, or a .gguf such as SmolLM2's) is exported with
qkvlab's own `convert ... --to-gguf` (llama architecture, F32; a K=V layer as W_V = W_K), then, per
prompt, llama.cpp's `llama-completion` decodes greedily from that file and qkvlab's `generate`
decodes greedily from MODEL itself, both from the same prompt ids, and the generated ids are
compared position by position.

llama.cpp is driven, and its ids read back, by qkvlab.convert.llama_cpp (the session file it writes holds the
prompt and generated ids; greedy, no chat template, an F32 KV cache and flash attention off: that module
says why): qkvlab decodes from exactly llama.cpp's prompt ids, so the comparison does not depend on two
tokenizers agreeing (whether transformers' reading of the GGUF's tokenizer gives the same prompt ids is
printed beside it). --flash-attn auto checks llama.cpp's own default. The context is the model's own (at
most 4096). At the first position that differs, the rank of llama.cpp's token among qkvlab's logits and
the gap between the two tokens' logits (in units of the row's std) are printed: a runner-up a hair below
is a near tie that float rounding flips; a large gap is a real difference.

OUT (a new folder; an existing one is refused) gets parity.json and parity.md; the GGUF is written
to a temporary folder unless --keep-gguf (then OUT/model.gguf).

    python docs/results/retrofit/llamacpp_parity.py MODEL OUT --llama-bin /tmp/llbuild/bin
    python docs/results/retrofit/llamacpp_parity.py retrofit_out OUT --llama-bin DIR --prompt "Once upon a time" -n 16
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import sys
import tempfile
from pathlib import Path

import torch

from qkvlab.base.errors import UserError
from qkvlab.convert.llama_cpp import (
    COMPLETION,
    LlamaCppError,
    compare,
    completion_command,
    divergence,
    qkvlab_greedy,
    run_completion,
)

PROMPTS = ("The capital of France is", "Once upon a time, there was a")
MAX_CONTEXT = 4096  # llama.cpp's KV cache is allocated for the whole context


class Refused(Exception):
    """One line for the user."""


# ---- llama.cpp ----------------------------------------------------------------------------------
def completion_binary(folder: Path) -> Path:
    """llama.cpp's plain completion CLI (llama-cli chats) in `folder`."""
    if not (folder / COMPLETION).is_file():
        raise Refused(f"--llama-bin {folder}: no {COMPLETION} there")
    return folder / COMPLETION


# ---- qkvlab ------------------------------------------------------------------------------------
def export_gguf(model: Path, out: Path, gguf_vocab: Path | None, llama_bin: Path | None = None) -> None:
    """`qkvlab convert MODEL OUT.gguf --to-gguf` in this process (its own checks included: with llama_bin,
    llama.cpp's greedy tokens from the written file)."""
    from qkvlab.cli import main as qkvlab

    argv = ["convert", *(["--from-hf"] if model.suffix == ".gguf" else []), str(model), str(out), "--to-gguf"]
    argv += ["--gguf-vocab", str(gguf_vocab)] if gguf_vocab else []
    argv += ["--llama-bin", str(llama_bin)] if llama_bin else []
    print("exporting: qkvlab " + " ".join(argv), flush=True)
    if qkvlab(argv) != 0:
        raise Refused(f"qkvlab convert --to-gguf of {model} failed (its message is above)")


# ---- the report --------------------------------------------------------------------------------
def piece(tok, i: int) -> str:
    if tok is None:
        return ""
    return tok.decode([i]).replace("\n", "\\n").replace("|", "\\|")


def side_by_side(ours: list[int], theirs: list[int], tok) -> list[str]:
    """A markdown table: position, qkvlab's id and text, llama.cpp's id and text, equal."""
    lines = ["| # | qkvlab id | qkvlab text | llama.cpp id | llama.cpp text | equal |", "|---|---|---|---|---|---|"]
    for i in range(max(len(ours), len(theirs))):
        a = ours[i] if i < len(ours) else None
        b = theirs[i] if i < len(theirs) else None
        cells = [str(i), "—" if a is None else str(a), "" if a is None else piece(tok, a)]
        cells += ["—" if b is None else str(b), "" if b is None else piece(tok, b)]
        lines.append("| " + " | ".join(cells + ["yes" if a == b else "—" if None in (a, b) else "**no**"]) + " |")
    return lines


def gguf_tokenizer(gguf: Path):
    """transformers' reading of the exported GGUF's tokenizer (for text and a prompt-id check), or None."""
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except Exception as e:  # transformers missing or its GGUF reader refusing: ids only
        print(f"note: no transformers tokenizer from {gguf.name} ({str(e).splitlines()[0][:100]}); ids only")
        return None


def markdown(report: dict, tables: list[list[str]]) -> str:
    lines = [
        f"# llama.cpp reads qkvlab's GGUF export: {report['model']}",
        "",
        f"Scheme {report['scheme']}; {report['new_tokens']} greedy tokens a prompt; llama.cpp: "
        f"`{shlex.join(report['llama_command_first'])}`.",
        "",
        f"**{report['equal']} of {report['compared']} generated tokens equal** over {len(report['prompts'])} prompt(s).",
        "",
    ]
    for p, table in zip(report["prompts"], tables):
        gap = (
            ""
            if p["gap_at_first_diff"] is None
            else f"; at the first difference llama.cpp's token is qkvlab's rank {p['rank_of_theirs']}, "
            f"{p['gap_at_first_diff']:.2g} logit std below qkvlab's"
        )
        lines += [
            f"## {p['prompt']!r}",
            "",
            f"{len(p['prompt_ids'])} prompt ids (llama.cpp's); transformers' tokenizer gives the same ids: "
            f"{p['prompt_ids_agree']}. Equal {p['equal']} of {p['compared']}, equal prefix {p['equal_prefix']}{gap}.",
            "",
            *table,
            "",
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", type=Path, help="a qkvlab model folder or a .gguf")
    p.add_argument("out", type=Path, help="a new folder for parity.json and parity.md")
    p.add_argument("--llama-bin", type=Path, required=True, help="the folder holding llama.cpp's llama-completion")
    p.add_argument("--prompt", action="append", default=None, help=f"a prompt (repeatable; default {list(PROMPTS)})")
    p.add_argument("-n", "--new-tokens", type=int, default=16)
    p.add_argument("--gguf-vocab", type=Path, default=None, help="the GGUF with the model's tokenizer (convert's flag)")
    p.add_argument("--threads", type=int, default=None, help="torch and llama.cpp threads (default: their own)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--flash-attn", choices=("auto", "on", "off"), default="off", help="llama.cpp's -fa (its own default: auto)"
    )
    p.add_argument("--keep-gguf", action="store_true", help="keep the export as OUT/model.gguf")
    args = p.parse_args(argv)
    try:
        return run(args)
    except (Refused, UserError, LlamaCppError) as e:  # UserError: qkvlab refusing MODEL
        print(f"llamacpp_parity: error: {e}", file=sys.stderr)
        return 2


def run(args) -> int:
    if args.out.exists():
        raise Refused(f"{args.out} exists; choose a new OUT")
    if not args.model.exists():
        raise Refused(f"{args.model}: no such file or folder")
    if args.new_tokens < 1:
        raise Refused(f"--new-tokens {args.new_tokens} must be >= 1")
    binary = completion_binary(args.llama_bin)
    if args.threads:
        torch.set_num_threads(args.threads)
    from qkvlab.convert.load import load_any

    loaded = load_any(args.model)
    model, cfg = loaded.model.float().eval(), loaded.cfg
    context = min(cfg.context, MAX_CONTEXT)
    prompts = args.prompt or list(PROMPTS)
    with tempfile.TemporaryDirectory() as work:
        gguf = Path(work) / "model.gguf"
        export_gguf(args.model, gguf, args.gguf_vocab, args.llama_bin)
        tok = gguf_tokenizer(gguf)
        report: dict = {"model": str(args.model), "scheme": cfg.scheme_label, "new_tokens": args.new_tokens}
        report.update(binary=str(binary), gguf=str(args.out / gguf.name) if args.keep_gguf else None, prompts=[])
        tables = []
        for k, prompt in enumerate(prompts):
            session = Path(work) / f"session{k}.bin"
            cmd = completion_command(
                binary,
                gguf,
                prompt,
                args.new_tokens,
                session,
                context=context,
                seed=args.seed,
                threads=args.threads,
                flash_attn=args.flash_attn,
            )
            report.setdefault("llama_command_first", cmd)
            prompt_ids, theirs, printed = run_completion(cmd, session)
            if len(prompt_ids) + args.new_tokens > context:
                raise Refused(f"{len(prompt_ids)} prompt + {args.new_tokens} new tokens exceed the context {context}")
            ours, logits = qkvlab_greedy(model, prompt_ids, args.new_tokens)
            got = compare(ours, theirs)
            i = got["first_diff"]
            gap, rank = (None, None) if i is None else divergence(logits[i], ours[i], theirs[i])
            agree = None if tok is None else tok.encode(prompt) == prompt_ids
            report["prompts"].append(
                dict(prompt=prompt, prompt_ids=prompt_ids, qkvlab=ours, llama_cpp=theirs, **got)
                | dict(gap_at_first_diff=gap, rank_of_theirs=rank, prompt_ids_agree=agree, llama_cpp_printed=printed)
            )
            tables.append(side_by_side(ours, theirs, tok))
            print(f"prompt {prompt!r} ({len(prompt_ids)} ids):")
            print("\n".join(tables[-1]))
            where = "" if i is None else f"; llama.cpp's token at {i} is qkvlab's rank {rank}, {gap:.2g} std below"
            print(
                f"  equal {got['equal']} of {got['compared']} (equal prefix {got['equal_prefix']}{where})", flush=True
            )
        args.out.mkdir(parents=True)  # only once every prompt ran
        if args.keep_gguf:
            shutil.move(gguf, args.out / gguf.name)
    report["equal"] = sum(x["equal"] for x in report["prompts"])
    report["compared"] = sum(x["compared"] for x in report["prompts"])
    (args.out / "parity.json").write_text(json.dumps(report, indent=1) + "\n")
    (args.out / "parity.md").write_text(markdown(report, tables))
    print(f"{report['equal']} of {report['compared']} generated tokens equal; wrote {args.out}/parity.json, parity.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
