"""Does llama.cpp itself read qkvlab's GGUF export? (issue 30) Greedy tokens of llama.cpp against qkvlab's.

MODEL (a qkvlab model folder, e.g. a retrofit's OUT, or a .gguf such as SmolLM2's) is exported with
qkvlab's own `convert ... --to-gguf` (llama architecture, F32; a K=V layer as W_V = W_K), then, per
prompt, llama.cpp's `llama-completion` decodes greedily from that file and qkvlab's `generate`
decodes greedily from MODEL itself, both from the same prompt ids, and the generated ids are
compared position by position.

The ids llama.cpp used come from llama.cpp: the prompt's text is tokenized by llama-completion (the
GGUF's tokenizer, its own BOS rule) and the prompt and generated ids are read back from the session
file it writes at the end (--prompt-cache FILE --prompt-cache-all: the tokens, then the state);
qkvlab decodes from exactly those prompt ids, so the comparison does not depend on two tokenizers
agreeing (whether transformers' reading of the GGUF's tokenizer gives the same prompt ids is
printed beside it). llama.cpp runs with --temp 0 --top-k 1 --repeat-penalty 1 --seed, no chat
template (-no-cnv), an F32 KV cache (-ctk f32 -ctv f32) and flash attention off (-fa off): with
it on (llama.cpp's default, -fa auto, is on for the CPU) llama.cpp casts an F32 cache to F16 before
attention (src/llama-graph.cpp, build_attn_mha), which is not qkvlab's precision; --flash-attn auto
checks that setting. The context is the model's own (at most 4096). llama.cpp stops at an end-of-generation token, which then counts as one of its tokens; qkvlab does
not stop. At the first position that differs, the rank of llama.cpp's token among qkvlab's logits and
the gap between the two tokens' logits (in units of the row's std) are printed: a runner-up a hair
below is a near tie that float rounding flips; a large gap is a real difference.

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
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from qkvlab.base.errors import UserError

SESSION_MAGIC, SESSION_VERSION = 0x6767736E, 10  # llama.h: LLAMA_SESSION_MAGIC ('ggsn'), LLAMA_SESSION_VERSION
PROMPTS = ("The capital of France is", "Once upon a time, there was a")
MAX_CONTEXT = 4096  # llama.cpp's KV cache is allocated for the whole context


class Refused(Exception):
    """One line for the user."""


# ---- llama.cpp: the command, its session file, its log ------------------------------------------
def completion_binary(folder: Path) -> Path:
    """llama.cpp's plain completion CLI (llama-cli chats) in `folder`."""
    if not (folder / "llama-completion").is_file():
        raise Refused(f"--llama-bin {folder}: no llama-completion there")
    return folder / "llama-completion"


def completion_command(
    binary: Path,
    gguf: Path,
    prompt: str,
    new_tokens: int,
    session: Path,
    *,
    context: int,
    seed: int,
    threads: int | None,
    flash_attn: str = "off",
) -> list[str]:
    """llama-completion greedy from `prompt`: no chat template, F32 cache, the final tokens saved to `session`."""
    cmd = [str(binary), "-m", str(gguf), "-p", prompt, "-n", str(new_tokens), "-c", str(context), "-s", str(seed)]
    cmd += ["--temp", "0", "--top-k", "1", "--top-p", "1", "--min-p", "0", "--repeat-penalty", "1"]
    cmd += ["-no-cnv", "--no-display-prompt", "--verbose-prompt", "--simple-io", "--no-warmup"]
    cmd += ["-ctk", "f32", "-ctv", "f32", "-fa", flash_attn, "--prompt-cache", str(session), "--prompt-cache-all"]
    return cmd + (["-t", str(threads)] if threads else [])


def session_tokens(data: bytes) -> list[int]:
    """The token ids at the head of a llama.cpp session file (magic, version, count, int32 ids, then state)."""
    if len(data) < 12:
        raise Refused(f"llama.cpp's session file holds {len(data)} bytes, not a session")
    magic, version, count = struct.unpack_from("<III", data)
    if magic != SESSION_MAGIC:
        raise Refused(f"llama.cpp's session file starts with {magic:#010x}, not 'ggsn' ({SESSION_MAGIC:#010x})")
    if version != SESSION_VERSION:
        print(f"note: llama.cpp session version {version} (read as {SESSION_VERSION}: magic, version, count, ids)")
    if len(data) < 12 + 4 * count:
        raise Refused(f"llama.cpp's session file names {count} tokens but holds {(len(data) - 12) // 4}")
    return list(struct.unpack_from(f"<{count}i", data, 12))


def prompt_token_count(log: str) -> int:
    """From --verbose-prompt's log: 'main: number of tokens in prompt = N'."""
    for line in log.splitlines():
        if "number of tokens in prompt =" in line:
            return int(line.rsplit("=", 1)[1])
    raise Refused("llama-completion's log has no 'number of tokens in prompt' (--verbose-prompt)")


def run_llama(cmd: list[str], session: Path) -> tuple[list[int], list[int], str]:
    """(prompt ids, generated ids, what it printed) of one llama-completion run."""
    t0 = time.perf_counter()
    got = subprocess.run(cmd, capture_output=True, stdin=subprocess.DEVNULL, timeout=600)
    err = got.stderr.decode("utf-8", "replace")
    if got.returncode != 0 or not session.is_file():
        last = (err.strip().splitlines() or ["(nothing on stderr)"])[-1]
        raise Refused(f"llama-completion exited {got.returncode}: {last}")
    ids = session_tokens(session.read_bytes())
    n = prompt_token_count(err)
    text = got.stdout.decode("utf-8", "replace")
    print(f"  llama-completion: {n} prompt + {len(ids) - n} new tokens in {time.perf_counter() - t0:.1f} s", flush=True)
    return ids[:n], ids[n:], text


# ---- qkvlab ------------------------------------------------------------------------------------
def export_gguf(model: Path, out: Path, gguf_vocab: Path | None) -> None:
    """`qkvlab convert MODEL OUT.gguf --to-gguf` in this process (its own check included)."""
    from qkvlab.cli import main as qkvlab

    argv = ["convert", *(["--from-hf"] if model.suffix == ".gguf" else []), str(model), str(out), "--to-gguf"]
    argv += ["--gguf-vocab", str(gguf_vocab)] if gguf_vocab else []
    print("exporting: qkvlab " + " ".join(argv), flush=True)
    if qkvlab(argv) != 0:
        raise Refused(f"qkvlab convert --to-gguf of {model} failed (its message is above)")


@torch.inference_mode()
def qkvlab_greedy(model, prompt: list[int], new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """(qkvlab's greedy ids after `prompt`, the logits (N, vocab) each was chosen from), no end-of-text stop."""
    from qkvlab.decode.generate import Sampling, generate

    new = generate(model, [prompt], new_tokens, Sampling(temperature=0.0))[0]
    idx = torch.tensor([prompt + new[:-1]])  # (1, P + N - 1)
    logits, _ = model(idx)  # (1, P + N - 1, vocab); row P - 1 + i predicts new[i]
    return new, logits[0, len(prompt) - 1 :].float()


def compare(ours: list[int], theirs: list[int]) -> dict:
    """Equal positions over the shorter list, the equal prefix, the first difference (or None)."""
    n = min(len(ours), len(theirs))
    same = [ours[i] == theirs[i] for i in range(n)]
    first = next((i for i, s in enumerate(same) if not s), None)
    return {"compared": n, "equal": sum(same), "equal_prefix": n if first is None else first, "first_diff": first}


def divergence(logits: torch.Tensor, ours: int, theirs: int) -> tuple[float, int]:
    """At the first differing position, from qkvlab's logits (V,): (the gap between its token and
    llama.cpp's in units of the row's std, the rank of llama.cpp's token: 2 = qkvlab's runner-up)."""
    gap = float(logits[ours] - logits[theirs]) / float(logits.std())
    return gap, 1 + int((logits > logits[theirs]).sum())


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
    except (Refused, UserError) as e:  # UserError: qkvlab refusing MODEL
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
        export_gguf(args.model, gguf, args.gguf_vocab)
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
            prompt_ids, theirs, printed = run_llama(cmd, session)
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
