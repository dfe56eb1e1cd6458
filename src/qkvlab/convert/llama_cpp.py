"""llama.cpp as an engine that reads qkvlab's GGUF: its binaries found, its greedy tokens read back, its own
printed KV-cache size and speed parsed. `convert --to-gguf` checks a file with it where the binaries are
(`check_greedy`); docs/results/retrofit/llamacpp_parity.py and mla_llamacpp.py measure with it.

The ids llama.cpp used come from llama.cpp: the prompt's text is tokenized by llama-completion (the GGUF's
tokenizer, its own BOS rule) and the prompt and generated ids are read back from the session file it writes
at the end (--prompt-cache FILE --prompt-cache-all: magic, version, count, int32 ids, then the state);
qkvlab decodes from exactly those prompt ids, so no two tokenizers need agree. llama.cpp runs greedy
(--temp 0 --top-k 1 --repeat-penalty 1), without a chat template (-no-cnv), with an F32 KV cache and
flash attention off: with it on (llama.cpp's default on the CPU) an F32 cache is cast to F16 before
attention (src/llama-graph.cpp, build_attn_mha), which is not qkvlab's precision. llama.cpp stops at an
end-of-generation token; qkvlab does not: tokens are compared over the shorter list. At the first
difference, the rank of llama.cpp's token among qkvlab's logits and the gap between the two (in units of
the row's std) say whether it is a near tie that float rounding flips (`NEAR_TIE_STD`) or a real difference.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from qkvlab.base.errors import UserError
from qkvlab.decode.generate import generate
from qkvlab.decode.sampling import Sampling

LLAMA_BIN_ENV = "QKVLAB_LLAMA_BIN"  # a llama.cpp bin/ folder, when --llama-bin is not given
COMPLETION = "llama-completion"  # llama.cpp's plain completion CLI (llama-cli chats)
SESSION_MAGIC, SESSION_VERSION = 0x6767736E, 10  # llama.h: LLAMA_SESSION_MAGIC ('ggsn'), LLAMA_SESSION_VERSION
NEAR_TIE_STD = 0.01  # a first difference where llama.cpp took qkvlab's runner-up less than this many std below
CHECK_PROMPT = "The capital of France is"
_KV_LINE = re.compile(
    r"llama_kv_cache: size = +([\d.]+) MiB \( *(\d+) cells, +(\d+) layers.*?K \((\w+)\): +([\d.]+) MiB, V \((\w+)\): +([\d.]+) MiB"
)


class LlamaCppError(Exception):
    """llama.cpp did not give what was asked (its exit status, a session file it did not write)."""


def find_llama_bin(given: str | Path | None) -> Path | None:
    """The folder holding llama-completion: `given` (refused without it), else $QKVLAB_LLAMA_BIN, else the
    PATH's; None when there is none."""
    if given is not None:
        if not (Path(given) / COMPLETION).is_file():
            raise UserError(f"--llama-bin {given}: no {COMPLETION} there (a llama.cpp build's bin/ folder)")
        return Path(given)
    env = os.environ.get(LLAMA_BIN_ENV)
    if env and (Path(env) / COMPLETION).is_file():
        return Path(env)
    found = shutil.which(COMPLETION)
    return Path(found).parent if found else None


def version(binary: Path) -> str:
    """'0.5.0-dev (build 1, commit 0c1e570)' from `binary --version`, or what it printed first."""
    got = subprocess.run([str(binary), "--version"], capture_output=True, stdin=subprocess.DEVNULL, timeout=60)
    text = (got.stdout + got.stderr).decode("utf-8", "replace")
    m = re.search(r"version: (.+)", text)
    return m.group(1).strip() if m else (text.strip().splitlines() or ["?"])[0]


# ---- llama-completion: the command, its session file, its log ------------------------------------------
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
        raise LlamaCppError(f"llama.cpp's session file holds {len(data)} bytes, not a session")
    magic, version_, count = struct.unpack_from("<III", data)
    if magic != SESSION_MAGIC:
        raise LlamaCppError(f"llama.cpp's session file starts with {magic:#010x}, not 'ggsn' ({SESSION_MAGIC:#010x})")
    if version_ != SESSION_VERSION:
        print(f"note: llama.cpp session version {version_} (read as {SESSION_VERSION}: magic, version, count, ids)")
    if len(data) < 12 + 4 * count:
        raise LlamaCppError(f"llama.cpp's session file names {count} tokens but holds {(len(data) - 12) // 4}")
    return list(struct.unpack_from(f"<{count}i", data, 12))


def prompt_token_count(log: str) -> int:
    """From --verbose-prompt's log: 'main: number of tokens in prompt = N'."""
    for line in log.splitlines():
        if "number of tokens in prompt =" in line:
            return int(line.rsplit("=", 1)[1])
    raise LlamaCppError("llama-completion's log has no 'number of tokens in prompt' (--verbose-prompt)")


def kv_cache_sizes(log: str) -> list[dict]:
    """Each 'llama_kv_cache: size = ...' line llama.cpp printed: its MiB, cells, layers and K/V types and MiB."""
    return [
        dict(mib=float(m[1]), cells=int(m[2]), layers=int(m[3]), k_type=m[4], k_mib=float(m[5]))
        | dict(v_type=m[6], v_mib=float(m[7]))
        for m in _KV_LINE.finditer(log)
    ]


def run_completion(cmd: list[str], session: Path) -> tuple[list[int], list[int], str]:
    """(prompt ids, generated ids, its log on stderr) of one llama-completion run."""
    t0 = time.perf_counter()
    got = subprocess.run(cmd, capture_output=True, stdin=subprocess.DEVNULL, timeout=600)
    err = got.stderr.decode("utf-8", "replace")
    if got.returncode != 0 or not session.is_file():
        last = (err.strip().splitlines() or ["(nothing on stderr)"])[-1]
        raise LlamaCppError(f"{COMPLETION} exited {got.returncode}: {last}")
    ids = session_tokens(session.read_bytes())
    n = prompt_token_count(err)
    print(f"  {COMPLETION}: {n} prompt + {len(ids) - n} new tokens in {time.perf_counter() - t0:.1f} s", flush=True)
    return ids[:n], ids[n:], err


# ---- llama-bench ---------------------------------------------------------------------------------------
def bench_command(binary: Path, gguf: Path, *, prompt: int, gen: int, depths: str, reps: int, threads: int | None):
    cmd = [str(binary), "-m", str(gguf), "-p", str(prompt), "-n", str(gen), "-d", depths, "-r", str(reps), "-o", "json"]
    return cmd + (["-t", str(threads)] if threads else [])


def bench_rows(stdout: str) -> list[dict]:
    """llama-bench -o json's tests: n_prompt, n_gen, n_depth, threads, avg_ts and stddev_ts of each."""
    keys = ("n_prompt", "n_gen", "n_depth", "n_threads", "type_k", "type_v", "avg_ts", "stddev_ts")
    return [{k: row.get(k) for k in keys} for row in json.loads(stdout[stdout.index("[") :])]


# ---- qkvlab against it ---------------------------------------------------------------------------------
@torch.inference_mode()
def qkvlab_greedy(model, prompt: list[int], new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """(qkvlab's greedy ids after `prompt`, the logits (N, vocab) each was chosen from), no end-of-text stop."""
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


def agrees(got: dict, gap: float | None, rank: int | None) -> bool:
    """Equal everywhere compared, or apart only from a near tie on (llama.cpp took qkvlab's runner-up, a hair below)."""
    return got["first_diff"] is None or (rank == 2 and gap is not None and gap < NEAR_TIE_STD)


def check_greedy(bin_dir: Path, gguf: Path, model, context: int, new_tokens: int = 16) -> dict:
    """llama.cpp decodes `gguf` greedily from CHECK_PROMPT and qkvlab's `model` from the same ids: the comparison
    (`compare`, plus gap, rank and `agrees`)."""
    context = min(context, 4096)
    with tempfile.TemporaryDirectory() as work:
        session = Path(work) / "session.bin"
        cmd = completion_command(
            bin_dir / COMPLETION,
            gguf,
            CHECK_PROMPT,
            min(new_tokens, context // 2),
            session,
            context=context,
            seed=0,
            threads=None,
        )
        prompt, theirs, _ = run_completion(cmd, session)
    ours, logits = qkvlab_greedy(model, prompt, min(new_tokens, context // 2))
    got = compare(ours, theirs)
    i = got["first_diff"]
    gap, rank = (None, None) if i is None else divergence(logits[i], ours[i], theirs[i])
    return got | {"gap_at_first_diff": gap, "rank_of_theirs": rank, "agrees": agrees(got, gap, rank)}
