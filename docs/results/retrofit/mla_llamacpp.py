"""Does the halved cache leave qkvlab? llama.cpp serves qkvlab's MLA export (a deepseek2 GGUF) beside the
original model (a llama GGUF): greedy tokens against qkvlab's, llama.cpp's own printed KV-cache size, tokens/s.

Both models are exported with qkvlab's own `convert ... --to-gguf` (F32; the MLA one as deepseek2: its
cache holds kv_lora_rank + rope dims per token and layer, K only), through llamacpp_parity.py's export_gguf.
Then, for each model:

- greedy: per prompt, llama-completion decodes NEW tokens from the GGUF (F32 cache, flash attention off)
  and qkvlab decodes from the same prompt ids (read back from llama.cpp's session file), compared token by
  token; a prompt agrees when every token is equal or the first difference is a near tie (llama.cpp took
  qkvlab's runner-up less than NEAR_TIE_STD logit std below: float rounding, after which the texts part).
  `greedy_equal`: every prompt of the MLA model agrees (`greedy_equal_original`: the original's).
- KV cache: llama-completion at --context (4096) with llama.cpp's default cache types, one token, its log at
  verbosity 4: the `llama_kv_cache: size = ... MiB` line it prints (`kv_mib_*`), beside what the config says
  (`kv_expected_mib_*`: layers x the cells it printed x numbers per token x bytes, unrounded).
- speed: llama-bench's token generation (-p --bench-prompt -n --bench-gen -d --bench-depths, -r --bench-reps,
  the same threads for both): `tok_s_*` is tg at the first depth; every row is kept.

The machine's load over the whole run (qkvlab.base.loadavg) is recorded: a noisy machine makes the tokens/s
figures unreliable (the other figures do not depend on it).

    python docs/results/retrofit/mla_llamacpp.py MLA_MODEL ORIGINAL --llama-bin DIR [--out FILE.json]

MLA_MODEL: a qkvlab MLA model folder (`retrofit ... --kv-latent R --rope-dim P`); ORIGINAL: the model it came
from (a .gguf such as SmolLM2's, or a model folder). OUT (default docs/results/retrofit/mla_llamacpp.json) is
refused when it exists.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from qkvlab.base.errors import UserError
from qkvlab.base.loadavg import LoadWatch
from qkvlab.convert.hf_deepseek import is_mla
from qkvlab.convert.llama_cpp import (
    COMPLETION,
    NEAR_TIE_STD,
    LlamaCppError,
    agrees,
    bench_command,
    bench_rows,
    compare,
    completion_command,
    divergence,
    kv_cache_sizes,
    qkvlab_greedy,
    run_completion,
    version,
)

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # the sibling script whose export and refusals this one reuses
import llamacpp_parity as parity  # noqa: E402

BENCH = "llama-bench"
PROMPTS = (
    "The capital of France is",
    "Once upon a time, there was a",
    "The main ingredients of bread are",
    "In 1969, the first person to walk on the Moon",
    "def fibonacci(n):",
)
DEFAULT_OUT = HERE / "mla_llamacpp.json"
TYPE_BYTES = {"f32": 4, "f16": 2, "bf16": 2}  # llama.cpp's cache types that store whole numbers


def kv_command(binary: Path, gguf: Path, context: int, threads: int | None) -> list[str]:
    """One token at `context` with llama.cpp's default cache types, its log verbose enough to print the cache size."""
    cmd = [str(binary), "-m", str(gguf), "-p", "Hello", "-n", "1", "-c", str(context), "-no-cnv", "--no-warmup"]
    return cmd + ["-lv", "4", "--simple-io"] + (["-t", str(threads)] if threads else [])


def expected_kv_mib(cfg, cells: int, cache_type: str) -> float | None:
    """What llama.cpp should allocate for `cells` tokens: layers x cells x the numbers its cache holds per token
    and layer (MLA: kv_lora_rank + rope dims, K only; else keys and values of every kv head) x their bytes."""
    per_token = cfg.kv_latent + cfg.rope_dim if is_mla(cfg) else 2 * cfg.n_kv_heads * cfg.head_dim
    size = TYPE_BYTES.get(cache_type)
    return None if size is None else cfg.n_layer * cells * per_token * size / 2**20


def greedy(binary: Path, gguf: Path, model, prompts, args, work: Path) -> list[dict]:
    """Per prompt: llama.cpp's and qkvlab's greedy ids from llama.cpp's prompt ids, compared."""
    out = []
    for k, prompt in enumerate(prompts):
        session = work / f"{gguf.stem}{k}.bin"
        cmd = completion_command(
            binary, gguf, prompt, args.new_tokens, session, context=args.context, seed=0, threads=args.threads
        )
        prompt_ids, theirs, _ = run_completion(cmd, session)
        ours, logits = qkvlab_greedy(model, prompt_ids, args.new_tokens)
        got = compare(ours, theirs)
        i = got["first_diff"]
        gap, rank = (None, None) if i is None else divergence(logits[i], ours[i], theirs[i])
        out.append(
            dict(prompt=prompt, prompt_ids=prompt_ids, qkvlab=ours, llama_cpp=theirs, **got)
            | dict(gap_at_first_diff=gap, rank_of_theirs=rank, agrees=agrees(got, gap, rank))
        )
        print(f"  {prompt!r}: {got['equal']} of {got['compared']} equal, agrees {out[-1]['agrees']}", flush=True)
    return out


def kv_size(binary: Path, gguf: Path, context: int, threads: int | None) -> dict:
    """llama.cpp's own printed KV-cache size (the sum of its caches' lines) at `context`."""
    got = subprocess.run(kv_command(binary, gguf, context, threads), capture_output=True, stdin=subprocess.DEVNULL)
    lines = kv_cache_sizes(got.stderr.decode("utf-8", "replace"))
    if got.returncode != 0 or not lines:
        raise LlamaCppError(f"{COMPLETION} printed no KV-cache size for {gguf.name} (exit {got.returncode})")
    return {"mib": round(sum(x["mib"] for x in lines), 2), "caches": lines}


def bench(binary: Path, gguf: Path, args) -> list[dict]:
    cmd = bench_command(
        binary, gguf, prompt=args.bench_prompt, gen=args.bench_gen, depths=args.bench_depths, reps=args.bench_reps,
        threads=args.threads,
    )  # fmt: skip
    got = subprocess.run(cmd, capture_output=True, stdin=subprocess.DEVNULL)
    if got.returncode != 0:
        raise LlamaCppError(f"{BENCH} exited {got.returncode}: {got.stderr.decode('utf-8', 'replace').strip()[-200:]}")
    return bench_rows(got.stdout.decode("utf-8", "replace"))


def tg_speed(rows: list[dict]) -> float | None:
    """Token generation's tokens/s at the first depth llama-bench ran."""
    tg = [r for r in rows if r["n_gen"] and not r["n_prompt"]]
    return None if not tg else tg[0]["avg_ts"]


def summary(version_: str, context: int, runs: dict, load: dict) -> dict:
    """The figures a reader needs first, from each model's run: {"original": ..., "mla": ...} each with its
    greedy list, kv size, expected kv size and bench rows."""
    orig, mla = runs["original"], runs["mla"]
    return {
        "llama_cpp_version": version_,
        "context": context,
        "kv_mib_original": orig["kv"]["mib"],
        "kv_mib_mla": mla["kv"]["mib"],
        "kv_ratio": round(mla["kv"]["mib"] / orig["kv"]["mib"], 4),
        "kv_expected_mib_original": orig["kv_expected_mib"],
        "kv_expected_mib_mla": mla["kv_expected_mib"],
        "greedy_equal": all(p["agrees"] for p in mla["greedy"]),
        "greedy_equal_original": all(p["agrees"] for p in orig["greedy"]),
        "greedy_tokens_equal": {k: [p["equal"] for p in r["greedy"]] for k, r in runs.items()},
        "greedy_rule": f"every token equal, or the first difference a near tie (llama.cpp took qkvlab's runner-up < {NEAR_TIE_STD} logit std below)",
        "tok_s_original": tg_speed(orig["bench"]),
        "tok_s_mla": tg_speed(mla["bench"]),
        "load": load,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mla", type=Path, help="a qkvlab MLA model folder")
    p.add_argument("original", type=Path, help="the model it came from: a .gguf or a model folder")
    p.add_argument("--llama-bin", type=Path, required=True, help="llama.cpp's bin/ (llama-completion, llama-bench)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="the JSON to write (a new file)")
    p.add_argument("--prompt", action="append", default=None, help=f"a prompt (repeatable; default the {len(PROMPTS)})")
    p.add_argument("-n", "--new-tokens", type=int, default=64)
    p.add_argument("--context", type=int, default=4096, help="llama.cpp's context for every run")
    p.add_argument("--gguf-vocab", type=Path, default=None, help="the GGUF with the tokenizer (convert's flag)")
    p.add_argument("--threads", type=int, default=None, help="torch and llama.cpp threads (default: their own)")
    p.add_argument("--bench-prompt", type=int, default=0)
    p.add_argument("--bench-gen", type=int, default=64)
    p.add_argument("--bench-depths", default="0,1024", help="llama-bench -d (cached tokens before the timed ones)")
    p.add_argument("--bench-reps", type=int, default=3)
    args = p.parse_args(argv)
    try:
        return run(args)
    except (parity.Refused, UserError, LlamaCppError) as e:
        print(f"mla_llamacpp: error: {e}", file=sys.stderr)
        return 2


def run(args) -> int:
    if args.out.exists():
        raise parity.Refused(f"{args.out} exists; choose a new --out")
    for path in (args.mla, args.original):
        if not path.exists():
            raise parity.Refused(f"{path}: no such file or folder")
    binary = parity.completion_binary(args.llama_bin)
    if not (args.llama_bin / BENCH).is_file():
        raise parity.Refused(f"--llama-bin {args.llama_bin}: no {BENCH} there")
    from qkvlab.convert.load import load_any  # startup: a refusal above reads no model

    models = {"original": load_any(args.original), "mla": load_any(args.mla)}
    if not is_mla(models["mla"].cfg):
        raise parity.Refused(f"{args.mla}: {models['mla'].cfg.scheme_label} is not MLA (--kv-latent R --rope-dim P)")
    if args.threads:
        torch.set_num_threads(args.threads)
    vocab = args.gguf_vocab or (args.original if args.original.suffix == ".gguf" else None)
    watch, runs = LoadWatch.start(), {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for name, loaded in models.items():
            gguf = work / f"{name}.gguf"
            parity.export_gguf(args.mla if name == "mla" else args.original, gguf, vocab, args.llama_bin)
            print(f"{name}: {loaded.cfg.scheme_label}", flush=True)
            model = loaded.model.float().eval()
            runs[name] = {"model": str(args.mla if name == "mla" else args.original), "scheme": loaded.cfg.scheme_label}
            runs[name]["greedy"] = greedy(binary, gguf, model, args.prompt or PROMPTS, args, work)
            runs[name]["kv"] = kv_size(binary, gguf, args.context, args.threads)
            first = runs[name]["kv"]["caches"][0]
            runs[name]["kv_expected_mib"] = expected_kv_mib(loaded.cfg, first["cells"], first["k_type"])
            runs[name]["bench"] = bench(args.llama_bin / BENCH, gguf, args)
            print(f"  KV {runs[name]['kv']['mib']} MiB at {args.context}; tg {tg_speed(runs[name]['bench'])} tok/s")
    watch.finish()
    report = summary(version(binary), args.context, runs, watch.to_dict())
    report |= {"new_tokens": args.new_tokens, "threads": args.threads, "runs": runs, "command": sys.argv}
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k not in ("runs", "load", "command")}, indent=1))
    print(f"{watch.summary()}\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
