"""Load test of an OpenAI-compatible server in vLLM's `bench serve` terms: does a smaller KV cache serve more?

Three ways to say what is measured (one of them per command):

- default: random models of one shape, one per --variants entry (Q-K-V, Q-K=V, Id-K=V/MQA), written to
  a temp folder and each served by `qkvlab serve` at the same --cache-memory (by default room for
  --qkv-sequences sequences of Q-K-V, so the cache limits Q-K-V); prompts are random token ids;
- `--serve LABEL=PATH` (repeatable): `qkvlab serve` started on each model (a qkvlab folder, a Hugging
  Face folder or a .gguf) at the one --cache-memory you give, so schemes are compared at one cache
  memory; prompts are real text (below);
- `--endpoint http://127.0.0.1:PORT/v1 [--model NAME]`: a server someone else started (llama.cpp's,
  vLLM's, ...), measured as it is; nothing is started; prompts are real text.

Every started server listens on 127.0.0.1 (a fresh one per run) and is stopped with SIGTERM; an
--endpoint must be on 127.0.0.1: nothing else is ever contacted.

The workload. Prompt and output lengths (tokens) are drawn once per --seed from capped lognormals
(--prompt-len / --new-tokens `median=M,sigma=S,min=A,max=B`; a plain number is a fixed length), so
most requests are much shorter than the context; the same requests go to every scheme and rate. The
parameters and the realised mean/p50/p99 are printed and recorded. Arrivals are Poisson at each of
--rates requests/s (`inf`: all at once), at most --clients in flight (vLLM's --max-concurrency).
Requests are streamed /v1/completions, greedy, `ignore_eos` (so each output has its drawn length),
`stream_options.include_usage`. Text prompts are slices of the Shakespeare plays packaged with
qkvlab, cut in the model's own tokens: the first CORPUS_CHARS characters go once through the
server's /tokenize, each request takes a seeded slice of the drawn length and sends its
/detokenize text (the server re-tokenizes it, so its prompt_tokens may differ by a special token;
both counts are recorded). With --prompts ids the prompt is random token ids below --vocab-size.

The metrics, with vLLM's meanings (vllm/benchmarks/serve.py, lib/endpoint_request_func.py):

- TTFT: send -> first streamed chunk that carries a token;
- E2EL: send -> last such chunk;
- TPOT: per request, (E2EL - TTFT) / (output tokens - 1), over requests with more than one token;
- ITL: every gap between consecutive token-carrying chunks, pooled over requests. As vLLM's client
  does, a chunk is one ITL entry whatever number of tokens it carries (the gap is not spread over
  them); the token counts per chunk are in results.json, so a spread ITL can be re-derived;
- output tokens: the server's usage.completion_tokens (include_usage), else the chunks' token_ids,
  else one per token-carrying chunk; a chunk carries tokens if its token_ids are non-empty or, with
  no token_ids, if it has text or no finish_reason (a finish-only chunk is not a token);
- request throughput and output token throughput: over the run's duration, first send -> the last
  request ended (vLLM: benchmark start -> all requests done);
- goodput: requests/s meeting every bound of --slo (seconds; vLLM's --goodput takes ms), a request
  of one token counting TPOT 0 (as vLLM);
- each latency as mean, p50, p90, p99 (numpy's linear percentiles, as vLLM).

Also per run: the server's peak concurrent sequences and capacity where it says (qkvlab's /health);
the 1-minute load average at the run's start and end; for the whole measurement qkvlab.base.loadavg's
record and verdict ("not measured quiet" when noisy; with --endpoint the server is not this script's
child, so its CPU would count as "others": that rule is left out and the record says so).

Bounded: one untimed warm-up request, then at most --requests per run; a run stops sending at
--time-limit seconds and cancels what is still running at --time-limit. Output: OUT/results.md
(tables per scheme and rate), OUT/results.json (every figure and every request's raw timings) and
OUT/serve_load.png (throughput against p50/p99 TTFT and TPOT, one line per scheme).

    python benchmarks/serve_load.py --out /tmp/load --rates 1,2,4,inf               # random variants
    python benchmarks/serve_load.py --out /tmp/load --serve original=x.gguf --serve kv=runs/kv \\
        --cache-memory 64MB --max-model-len 1024                                      # real models
    python benchmarks/serve_load.py --out /tmp/load --endpoint http://127.0.0.1:8080/v1  # someone's server
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import numpy as np

from qkvlab.base.errors import UserError
from qkvlab.base.files import atomic_file, atomic_write, json_text, labelled_path
from qkvlab.base.flag_values import positive_int
from qkvlab.base.loadavg import LoadWatch, describe, load1, verdict
from qkvlab.base.units import byte_size
from qkvlab.data.text import load_shakespeare
from qkvlab.model.accounting import kv_cache_bytes_per_token
from qkvlab.model.config import ModelConfig
from qkvlab.model.folder import save_model
from qkvlab.model.variants import parse_variants

START_TIMEOUT = 300.0  # seconds a server may take to print its start-up line (a GGUF is dequantized first)
CORPUS_CHARS = 200_000  # characters of Shakespeare tokenized once for text prompts (under any body limit)
TEXT_MARGIN = 8  # tokens a re-tokenized text prompt may gain (BOS, merges at the cut) when checking the context
LATENCIES = ("ttft", "tpot", "itl", "e2el")
STATS = ("mean", "p50", "p90", "p99")
LOOPBACK = "127.0.0.1"


# ---- the workload -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Lengths:
    """A capped lognormal of token counts: median and sigma of the lognormal, clipped to [low, high]."""

    median: float
    sigma: float
    low: int
    high: int

    def describe(self) -> str:
        if self.sigma == 0:
            return f"{self.draw_one(0.0)} (fixed)"
        return f"lognormal median {self.median:g}, sigma {self.sigma:g}, clipped to [{self.low}, {self.high}]"

    def draw_one(self, normal: float) -> int:
        return int(min(self.high, max(self.low, round(self.median * math.exp(self.sigma * normal)))))


def parse_lengths(text: str) -> Lengths:
    """'64' (fixed) or 'median=64,sigma=1.0,min=4,max=512' (min defaults to 1, max to 8 x median)."""
    if text.strip().isdigit():
        n = positive_int(text)
        return Lengths(n, 0.0, n, n)
    try:
        fields = {k.strip(): float(v) for k, v in (part.split("=") for part in text.split(","))}
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give N or median=M,sigma=S[,min=A][,max=B]") from None
    unknown = set(fields) - {"median", "sigma", "min", "max"}
    if unknown or "median" not in fields:
        raise argparse.ArgumentTypeError(f"{text!r}: give N or median=M,sigma=S[,min=A][,max=B]")
    median, sigma = fields["median"], fields.get("sigma", 0.0)
    low, high = int(fields.get("min", 1)), int(fields.get("max", 8 * median))
    if not (median >= 1 and 0 <= sigma < 10 and 1 <= low <= median <= high):
        raise argparse.ArgumentTypeError(f"{text!r}: need 1 <= min <= median <= max and 0 <= sigma < 10")
    return Lengths(median, sigma, low, high)


def draw_lengths(dist: Lengths, count: int, rng: np.random.Generator) -> list[int]:
    return [dist.draw_one(z) for z in rng.standard_normal(count)]


def length_summary(values: list[int]) -> dict:
    """The realised distribution: mean, p50, p99, min, max (what was actually drawn, not the parameters)."""
    return {
        "mean": float(np.mean(values)),
        **{k: stat(values)[k] for k in ("p50", "p99")},
        "min": min(values),
        "max": max(values),
    }


def arrival_offsets(count: int, rate: float, rng: random.Random) -> list[float]:
    """Seconds after the start at which each request is sent: a Poisson process at `rate` (the first
    at 0, exponential gaps after), or all at 0 for rate inf."""
    if math.isinf(rate):
        return [0.0] * count
    offsets, t = [], 0.0
    for _ in range(count):
        offsets.append(t)
        t += rng.expovariate(rate)
    return offsets


# ---- the metrics (plain timestamps in, vLLM's figures out) ----------------------------------------
def stat(values) -> dict:
    """mean, p50, p90, p99 (numpy's linear interpolation, as vLLM); None for each when there are none."""
    if len(values) == 0:
        return dict.fromkeys(STATS)
    a = np.asarray(values, dtype=float)
    return {"mean": float(a.mean()), **{f"p{q}": float(np.percentile(a, q)) for q in (50, 90, 99)}}


def chunk_tokens(chunk: dict) -> int:
    """Tokens one streamed completion chunk carries: its token_ids where the server sends them, else
    one for a chunk with text or without a finish_reason; 0 for a usage-only or finish-only chunk."""
    choices = chunk.get("choices") or []
    if not choices:
        return 0
    choice = choices[0]
    if choice.get("token_ids") is not None:
        return len(choice["token_ids"])
    return int(bool(choice.get("text")) or choice.get("finish_reason") is None)


def request_latencies(sent: float, chunk_times: list[float], output_tokens: int) -> dict:
    """One request's TTFT, E2EL, TPOT (None below two tokens) and ITLs (one per gap between chunks)."""
    ttft, e2el = chunk_times[0] - sent, chunk_times[-1] - sent
    tpot = (e2el - ttft) / (output_tokens - 1) if output_tokens > 1 else None
    return {"ttft": ttft, "e2el": e2el, "tpot": tpot, "itl": list(np.diff(chunk_times))}


def output_token_count(record: dict) -> int:
    """usage.completion_tokens where the server reported it, else the tokens the chunks carried."""
    usage = record.get("usage") or {}
    if usage.get("completion_tokens") is not None:
        return int(usage["completion_tokens"])
    return sum(n for _, n in record["chunks"])


def succeeded(record: dict) -> bool:
    return record.get("error") is None and bool(record["chunks"])


def meets(lat: dict, slo: dict[str, float]) -> bool:
    """Every stated bound met (TPOT of a one-token request counts 0, as vLLM)."""
    values = {**lat, "tpot": lat["tpot"] or 0.0}
    return all(values[name] <= bound for name, bound in slo.items())


def run_metrics(records: list[dict], duration: float, slo: dict[str, float]) -> dict:
    """vLLM's figures for one run: records are {'sent': t, 'chunks': [(t, tokens), ...], 'usage': {...},
    'error': None or text}, all times in seconds on one clock; duration: the run's seconds."""
    done = [r for r in records if succeeded(r)]
    tokens = [output_token_count(r) for r in done]
    lats = [request_latencies(r["sent"], [t for t, _ in r["chunks"]], n) for r, n in zip(done, tokens)]
    per = {
        "ttft": [x["ttft"] for x in lats],
        "tpot": [x["tpot"] for x in lats if x["tpot"] is not None],
        "itl": [gap for x in lats for gap in x["itl"]],
        "e2el": [x["e2el"] for x in lats],
    }
    good = sum(meets(x, slo) for x in lats) if slo else None
    rate = (lambda n: n / duration) if duration > 0 else (lambda n: None)
    return {
        "completed": len(done),
        "failed": len(records) - len(done),
        "output_tokens": sum(tokens),
        "duration_s": duration,
        "request_throughput": rate(len(done)),
        "output_throughput": rate(sum(tokens)),
        "good_requests": good,
        "request_goodput": None if good is None else rate(good),
        **{f"{name}_s": stat(values) for name, values in per.items()},
    }


def parse_slo(text: str) -> dict[str, float]:
    """'ttft=2.0,tpot=0.2,e2el=30' (seconds) -> {'ttft': 2.0, ...}; '' or 'none' -> no SLO."""
    if text.strip().lower() in ("", "none"):
        return {}
    try:
        slo = {k.strip(): float(v) for k, v in (part.split("=") for part in text.split(","))}
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give e.g. ttft=2.0,tpot=0.2,e2el=30 (seconds)") from None
    if set(slo) - {"ttft", "tpot", "e2el"} or not all(0 < v < math.inf for v in slo.values()):
        raise argparse.ArgumentTypeError(f"{text!r}: bounds are ttft, tpot and e2el, positive seconds")
    return slo


def slo_text(slo: dict[str, float]) -> str:
    return ", ".join(f"{k.upper()} ≤ {v:g} s" for k, v in slo.items()) or "no SLO"


def parse_rates(text: str) -> tuple[float, ...]:
    try:
        rates = tuple(float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give comma-separated requests/s, e.g. 1,2,4,inf") from None
    if not all(r > 0 and not math.isnan(r) for r in rates):
        raise argparse.ArgumentTypeError(f"{text!r}: rates must be positive (inf: all at once)")
    return rates


def rate_label(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


# ---- what is measured ---------------------------------------------------------------------------
@dataclass
class Target:
    """One scheme: a model `qkvlab serve` is started on per run (path), or a running endpoint (url)."""

    label: str
    path: Path | None = None
    url: str | None = None
    cache_bytes_per_token: int | None = None


def parse_serve(text: str) -> tuple[str, str]:
    label, path = labelled_path(text)
    if not label and path == text:
        label = Path(text).name.removesuffix(".gguf")
    if not label or not path:
        raise argparse.ArgumentTypeError(f"{text!r}: give LABEL=PATH (or PATH)")
    return label, path


def loopback_root(endpoint: str) -> str:
    """http://127.0.0.1:PORT/v1 -> http://127.0.0.1:PORT; anything not on 127.0.0.1 is refused."""
    url = httpx.URL(endpoint)
    if url.scheme != "http" or url.host != LOOPBACK or url.port is None:
        raise UserError(f"--endpoint {endpoint}: give http://{LOOPBACK}:PORT/v1 (only {LOOPBACK} is contacted)")
    return f"http://{LOOPBACK}:{url.port}"


def write_models(args, folder: Path) -> list[Target]:
    """One random model per variant, identical shape (the default mode)."""
    import torch  # the default mode alone builds models

    from qkvlab.model.transformer import GPT

    base = ModelConfig(
        n_layer=args.n_layer, n_head=args.n_head, d_model=args.d_model, vocab_size=args.vocab_size, context=args.context
    )
    out = []
    for v in parse_variants(args.variants):
        cfg = v.apply(base).validate()
        torch.manual_seed(0)
        path = save_model(folder / v.slug, GPT(cfg), cfg)
        out.append(Target(v.name, path=path, cache_bytes_per_token=kv_cache_bytes_per_token(cfg, "fp32")))
    return out


class Server:
    """`qkvlab serve` as a subprocess on 127.0.0.1 and a free port; stopped with SIGTERM."""

    def __init__(self, model: Path, args, cache_bytes: int):
        env = {**os.environ, **({"OMP_NUM_THREADS": str(args.server_threads)} if args.server_threads else {})}
        cmd = [sys.executable, "-m", "qkvlab", "serve", str(model), "--host", LOOPBACK, "--port", "0"]
        cmd += ["--cache-memory", str(cache_bytes), "--dtype", args.dtype, "--device", args.device]
        if args.max_model_len:
            cmd += ["--max-model-len", str(args.max_model_len)]
        if args.block_size:
            cmd += ["--block-size", str(args.block_size)]
        if args.tokenizer:
            cmd += ["--tokenizer", args.tokenizer]
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.line = self._first_line()
        if "http://" not in self.line:
            self.stop()
            raise UserError(f"qkvlab serve {model} did not start: {self.line or self.proc.stderr.read()[-500:]}")
        self.url = self.line.split()[2].removesuffix("/v1")

    def _first_line(self) -> str:
        end = time.monotonic() + START_TIMEOUT
        while time.monotonic() < end and self.proc.poll() is None:
            line = self.proc.stdout.readline()
            if line:
                return line.strip()
        return ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


# ---- the client ---------------------------------------------------------------------------------
def client_for(url: str, args) -> httpx.AsyncClient:
    # trust_env=False: no proxy from the environment ever sees a loopback request
    limits = httpx.Limits(max_connections=args.clients + 4)
    return httpx.AsyncClient(base_url=url, timeout=args.time_limit + 60, limits=limits, trust_env=False)


def first_model(root: str) -> str | None:
    """The first of the server's /v1/models (None if it has none): the name requests carry and an
    --endpoint's label, where --model does not say."""
    try:
        return httpx.get(f"{root}/v1/models", timeout=30, trust_env=False).json()["data"][0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError):
        return None


async def tokenize(client: httpx.AsyncClient, text: str) -> list[int]:
    """Token ids of `text` without special tokens: vLLM's and qkvlab's /tokenize, else llama.cpp's."""
    for body in ({"prompt": text, "add_special_tokens": False}, {"content": text, "add_special": False}):
        r = await client.post("/tokenize", json=body)
        if r.status_code == 200 and r.json().get("tokens"):  # llama.cpp answers [] to vLLM's shape
            return [t if isinstance(t, int) else t["id"] for t in r.json()["tokens"]]
    raise UserError(f"{client.base_url}/tokenize answered {r.status_code}: text prompts need it (or --prompts ids)")


async def detokenize(client: httpx.AsyncClient, ids: list[int]) -> str:
    r = await client.post("/detokenize", json={"tokens": ids})
    body = r.json() if r.status_code == 200 else {}
    text = body.get("prompt", body.get("content"))  # vLLM's and qkvlab's key, llama.cpp's
    if not isinstance(text, str):
        raise UserError(f"{client.base_url}/detokenize answered {r.status_code}: text prompts need it")
    return text


async def text_prompts(client: httpx.AsyncClient, lengths: list[int], seed: int) -> list[str]:
    """Slices of the packaged Shakespeare, each of its drawn length in the server's own tokens."""
    corpus = "\n".join(d.text for d in load_shakespeare())[:CORPUS_CHARS]
    ids = await tokenize(client, corpus)
    if len(ids) <= max(lengths):
        raise UserError(f"{len(ids)} corpus tokens cannot hold a prompt of {max(lengths)}")
    rng = random.Random(seed)
    starts = [rng.randrange(len(ids) - n) for n in lengths]
    return [await detokenize(client, ids[s : s + n]) for s, n in zip(starts, lengths)]


def id_prompts(lengths: list[int], vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


def request_body(prompt, max_tokens: int, model: str | None, ignore_eos: bool) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    body["stream_options"] = {"include_usage": True}
    if ignore_eos:
        body["ignore_eos"] = True  # vLLM's, llama.cpp's and qkvlab's: every output has its drawn length
    return body if model is None else {"model": model, **body}


async def one_request(client: httpx.AsyncClient, sem: asyncio.Semaphore, body: dict, record: dict) -> None:
    """Stream one completion into `record`: send time, (arrival time, tokens) per token-carrying chunk,
    usage, and an error (HTTP status, an error event, a transport error, or cancelled at the limit)."""
    async with sem:
        record["sent"] = time.perf_counter()  # after the semaphore, as vLLM: client queueing is not TTFT
        try:
            async with client.stream("POST", "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    record["error"] = f"HTTP {r.status_code}: {(await r.aread())[:300].decode(errors='replace')}"
                    return
                async for line in r.aiter_lines():
                    now = time.perf_counter()
                    data = line.removeprefix("data:").strip() if line.startswith("data:") else ""
                    if not data or data == "[DONE]":
                        continue
                    chunk = json.loads(data)
                    if chunk.get("error"):
                        record["error"] = str(chunk["error"])[:300]
                    if n := chunk_tokens(chunk):
                        record["chunks"].append((now, n))
                    if chunk.get("usage"):
                        record["usage"] = chunk["usage"]
        except asyncio.CancelledError:
            record["error"] = "cancelled at --time-limit"
            raise
        except (httpx.HTTPError, json.JSONDecodeError) as e:
            record["error"] = f"{type(e).__name__}: {e}"[:300]
        finally:
            record["ended"] = time.perf_counter()


async def offered_load(client: httpx.AsyncClient, bodies: list[dict], args, rate: float, seed: int) -> dict:
    """Poisson arrivals at `rate`; bounded by --requests and --time-limit -> records and metrics."""
    offsets = arrival_offsets(len(bodies), rate, random.Random(seed))
    sem = asyncio.Semaphore(args.clients)
    records, tasks = [], []
    t0 = time.perf_counter()
    for offset, body in zip(offsets, bodies):
        if offset > args.time_limit:
            break
        await asyncio.sleep(max(0.0, t0 + offset - time.perf_counter()))
        record = {"sent": None, "chunks": [], "usage": None, "error": None, "ended": None}
        records.append(record)
        tasks.append(asyncio.create_task(one_request(client, sem, body, record)))
    left = max(1.0, args.time_limit - (time.perf_counter() - t0))
    _, pending = await asyncio.wait(tasks, timeout=left)
    for t in pending:
        t.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    for r in records:  # never sent (waiting on --clients when the limit came)
        if r["sent"] is None:
            r.update(sent=t0, error=r["error"] or "not sent before --time-limit")
    end = max((r["ended"] or t0 for r in records), default=t0)
    return {"t0": t0, "records": records, "metrics": run_metrics(records, end - t0, args.slo)}


async def server_health(client: httpx.AsyncClient) -> dict:
    """qkvlab's /health (peak and capacity in sequences); {} where the server has none."""
    try:
        r = await client.get("/health")
        return r.json() if r.status_code == 200 else {}
    except (httpx.HTTPError, ValueError):
        return {}


async def measure(url: str, args, workload: dict, rate: float, prompts_cache: dict, label: str) -> dict:
    """One run against the server at `url`: prompts (once per scheme), a warm-up request, the load."""
    async with client_for(url, args) as client:
        model = args.model or first_model(url)  # as vLLM's bench: the server's first model
        if label not in prompts_cache:
            lengths = workload["prompt_tokens"]
            prompts_cache[label] = (
                id_prompts(lengths, args.vocab_size, args.seed)
                if args.prompts == "ids"
                else await text_prompts(client, lengths, args.seed)
            )
        prompts = prompts_cache[label]
        bodies = [request_body(p, n, model, args.ignore_eos) for p, n in zip(prompts, workload["output_tokens"])]
        warm_body = {k: v for k, v in bodies[0].items() if k not in ("stream", "stream_options")}
        warm = await client.post("/v1/completions", json={**warm_body, "max_tokens": 2})  # untimed: lazy set-up
        if warm.status_code != 200:
            raise UserError(f"{url}: the warm-up request got {warm.status_code}: {warm.text[:300]}")
        run = await offered_load(client, bodies, args, rate, args.seed)
        run["health"] = await server_health(client)
        run["model"] = model
    return run


# ---- runs ---------------------------------------------------------------------------------------
def draw_workload(args) -> dict:
    rng = np.random.default_rng(args.seed)
    prompt, output = (
        draw_lengths(args.prompt_len, args.requests, rng),
        draw_lengths(args.new_tokens, args.requests, rng),
    )
    return {
        "prompt_tokens": prompt,
        "output_tokens": output,
        "prompt_distribution": {**asdict(args.prompt_len), "text": args.prompt_len.describe()},
        "output_distribution": {**asdict(args.new_tokens), "text": args.new_tokens.describe()},
        "prompt_realised": length_summary(prompt),
        "output_realised": length_summary(output),
        "prompts": prompt_kind(args),
    }


def prompt_kind(args) -> str:
    if args.prompts == "ids":
        return f"random token ids below {args.vocab_size}"
    return (
        f"text: slices of the packaged Shakespeare (first {CORPUS_CHARS:,} characters) of the drawn length in the "
        "server's tokens (/tokenize, /detokenize)"
    )


def raw_requests(run: dict, workload: dict) -> list[dict]:
    """Every request's timings relative to the run's start (seconds): sent, chunk arrivals, end."""
    t0 = run["t0"]
    out = []
    for i, r in enumerate(run["records"]):
        out.append(
            {
                "index": i,
                "prompt_tokens_drawn": workload["prompt_tokens"][i],
                "max_tokens": workload["output_tokens"][i],
                "usage": r["usage"],
                "error": r["error"],
                "sent_s": r["sent"] - t0,
                "ended_s": None if r["ended"] is None else r["ended"] - t0,
                "chunk_s": [t - t0 for t, _ in r["chunks"]],
                "chunk_tokens": [n for _, n in r["chunks"]],
            }
        )
    return out


def one_run(target: Target, args, workload: dict, rate: float, cache_bytes: int | None, prompts: dict, log) -> dict:
    server = Server(target.path, args, cache_bytes) if target.path is not None else None
    try:
        url = server.url if server else target.url
        log(f"{target.label} at {rate_label(rate)} req/s: {server.line if server else url}")
        load_start = load_average()
        run = asyncio.run(measure(url, args, workload, rate, prompts, target.label))
    finally:
        if server:
            server.stop()
    health = run["health"]
    row = {
        "label": target.label,
        "rate": rate_label(rate),
        "offered_rps": None if math.isinf(rate) else rate,
        "model": run["model"],
        "requests_sent": len(run["records"]),
        **run["metrics"],
        # an --endpoint's peak is over its whole life, not this run's: left out
        "peak_sequences": health.get("peak_active") if server else None,
        "capacity_sequences": health.get("capacity_sequences"),  # whole --max-model-len contexts
        "capacity_tokens": health.get("capacity_tokens"),  # short requests share these: the peak can exceed the above
        "cache_bytes_per_token": health.get("cache_bytes_per_token", target.cache_bytes_per_token),
        "load_start": load_start,
        "load_end": load_average(),
    }
    log(f"  {fmt_row(row)}")
    return {**row, "requests": raw_requests(run, workload)}


def run_all(args, targets: list[Target], workload: dict, cache_bytes: int | None, log) -> list[dict]:
    rows = []
    for target in targets:
        prompts: dict = {}  # one set per scheme: its tokenizer cuts the text
        for rate in args.rates:
            rows.append(one_run(target, args, workload, rate, cache_bytes, prompts, log))
    return rows


def load_average() -> float | None:
    """The 1-minute load average now, rounded (qkvlab.base.loadavg.load1)."""
    now = load1()
    return None if now is None else round(now, 2)


# ---- reporting ----------------------------------------------------------------------------------
def fmt(x, spec=".1f", scale=1) -> str:
    return "-" if x is None else format(x * scale, spec)


def ms(stats: dict, keys=STATS) -> str:
    return " / ".join(fmt(stats[k], ".1f", 1e3) for k in keys)


def fmt_row(r: dict) -> str:
    return (
        f"{r['completed']}/{r['requests_sent']} done, {fmt(r['request_throughput'], '.2f')} req/s, "
        f"{fmt(r['output_throughput'], '.0f')} tok/s, goodput {fmt(r['request_goodput'], '.2f')} req/s, "
        f"TTFT p50/p99 {ms(r['ttft_s'], ('p50', 'p99'))} ms, TPOT p50/p99 {ms(r['tpot_s'], ('p50', 'p99'))} ms, "
        f"peak {r['peak_sequences']}/{r['capacity_sequences']}, load {r['load_start']}->{r['load_end']}"
    )


def scheme_table(rows: list[dict]) -> list[str]:
    head = [
        "offered req/s",
        "done/sent",
        "req/s",
        "out tok/s",
        "goodput req/s",
        "peak seqs (capacity: contexts, tokens)",
    ]
    head += [f"{m.upper()} ms mean / p50 / p90 / p99" for m in LATENCIES] + ["load start→end"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [
            r["rate"],
            f"{r['completed']}/{r['requests_sent']}",
            fmt(r["request_throughput"], ".2f"),
            fmt(r["output_throughput"], ".0f"),
            fmt(r["request_goodput"], ".2f"),
            f"{fmt(r['peak_sequences'], '')} ({fmt(r['capacity_sequences'], ',')}, {fmt(r['capacity_tokens'], ',')})",
            *(ms(r[f"{m}_s"]) for m in LATENCIES),
            f"{r['load_start']}→{r['load_end']}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def workload_text(workload: dict, args, cache_bytes: int | None) -> str:
    p, o = workload["prompt_realised"], workload["output_realised"]
    return (
        f"Requests: {args.requests} per run, the same for every scheme and rate (seed {args.seed}); prompt tokens "
        f"{workload['prompt_distribution']['text']} (realised mean {p['mean']:.1f}, p50 {p['p50']:g}, p99 "
        f"{p['p99']:g}); output tokens {workload['output_distribution']['text']} (realised mean {o['mean']:.1f}, "
        f"p50 {o['p50']:g}, p99 {o['p99']:g}); prompts: {workload['prompts']}. Greedy, streamed, "
        f"{'ignore_eos, ' if args.ignore_eos else ''}Poisson arrivals, at most {args.clients} in flight, "
        f"{args.time_limit:g} s per run; one untimed warm-up request per run. "
        + (f"Cache memory {cache_bytes:,} bytes for every server." if cache_bytes else "")
        + "\n\nTTFT, TPOT, ITL and E2EL as vLLM's `bench serve` (ITL: one entry per token-carrying chunk); "
        f"goodput: requests/s meeting {slo_text(args.slo)}.\n"
    )


def markdown(rows: list[dict], args, workload: dict, cache_bytes: int | None, meta: dict) -> str:
    out = [f"# Load test in vLLM's terms\n\n`{meta['command']}`\n", workload_text(workload, args, cache_bytes)]
    out.append(f"{meta['cpus']} CPUs; {meta['wall_s']} s in all. Machine during the run: {meta['load_text']}.\n")
    for label in dict.fromkeys(r["label"] for r in rows):
        out.append(f"## {label}\n")
        out.append("\n".join(scheme_table([r for r in rows if r["label"] == label])) + "\n")
    return "\n".join(out)


def plot(rows: list[dict], path: Path) -> None:
    """Output throughput against p50 and p99 TTFT and TPOT: one line per scheme, one point per rate."""
    import matplotlib  # startup: only when the results are written

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("ttft_s", "p50"), ("ttft_s", "p99"), ("tpot_s", "p50"), ("tpot_s", "p99")]
    fig, axes = plt.subplots(2, 2, figsize=(10, 8))
    for ax, (metric, q) in zip(axes.flat, panels):
        for label in dict.fromkeys(r["label"] for r in rows):
            mine = [r for r in rows if r["label"] == label and r[metric][q] is not None]
            x = [r["output_throughput"] or 0 for r in mine]
            ax.plot(x, [1e3 * r[metric][q] for r in mine], marker="o", label=label)
            for r, xi in zip(mine, x):
                ax.annotate(r["rate"], (xi, 1e3 * r[metric][q]), fontsize=7, textcoords="offset points", xytext=(3, 3))
        name = metric.removesuffix("_s").upper()
        ax.set(xlabel="output throughput (tokens/s)", ylabel=f"{q} {name} (ms)", title=f"{q} {name} vs throughput")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("one line per scheme; points labelled with the offered requests/s")
    fig.tight_layout()
    with atomic_file(path, "wb") as f:
        fig.savefig(f, format="png", dpi=120)
    plt.close(fig)


# ---- command line -------------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="output folder (results.md, results.json, serve_load.png)")
    p.add_argument("--overwrite", action="store_true", help="replace the files of an earlier run in --out")
    what = p.add_argument_group("what is measured (default: random --variants models)")
    what.add_argument("--serve", action="append", type=parse_serve, metavar="LABEL=PATH", help="start qkvlab serve")
    what.add_argument("--endpoint", help=f"a running OpenAI-compatible server, http://{LOOPBACK}:PORT/v1")
    what.add_argument("--model", help="model name sent in requests (default: the server's first /v1/models)")
    what.add_argument("--label", help="the --endpoint's name in the tables (default: its model name)")
    what.add_argument("--variants", default="Q-K-V,Q-K=V,Id-K=V/MQA", help="comma-separated variants (default mode)")
    shape = p.add_argument_group("the random models' shape (default mode)")
    shape.add_argument("--n-layer", type=positive_int, default=4)
    shape.add_argument("--n-head", type=positive_int, default=8)
    shape.add_argument("--d-model", type=positive_int, default=256)
    shape.add_argument("--vocab-size", type=positive_int, default=2048, help="also the range of --prompts ids")
    shape.add_argument("--context", type=positive_int, default=256)
    load = p.add_argument_group("the load")
    load.add_argument("--prompt-len", type=parse_lengths, default=parse_lengths("median=32,sigma=1.0,min=4,max=128"))
    load.add_argument("--new-tokens", type=parse_lengths, default=parse_lengths("median=48,sigma=0.7,min=2,max=120"))
    load.add_argument("--prompts", choices=("text", "ids"), help="default: ids for random models, text otherwise")
    load.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True)
    load.add_argument("--rates", type=parse_rates, default=(1.0, 2.0, 4.0, math.inf), help="requests/s; inf: at once")
    load.add_argument("--requests", type=positive_int, default=96, help="requests per run")
    load.add_argument("--clients", type=positive_int, default=64, help="most requests in flight at once")
    load.add_argument("--time-limit", type=float, default=60.0, help="seconds per run before it stops")
    load.add_argument("--slo", type=parse_slo, default=parse_slo("ttft=2.0,tpot=0.2"), help="goodput bounds, seconds")
    load.add_argument("--seed", type=int, default=0)
    srv = p.add_argument_group("started servers (default mode and --serve)")
    srv.add_argument("--cache-memory", metavar="SIZE", help="every server's --cache-memory (needed with --serve)")
    srv.add_argument("--qkv-sequences", type=positive_int, default=4, help="default mode: room for this many Q-K-V")
    srv.add_argument("--max-model-len", type=positive_int, help="the servers' --max-model-len")
    srv.add_argument("--block-size", type=positive_int, help="the servers' --block-size (default: serve's)")
    srv.add_argument("--tokenizer", help="the servers' --tokenizer (gpt2, bytes or a folder)")
    srv.add_argument("--device", default="cpu", help="the servers' --device (default cpu)")
    srv.add_argument("--dtype", default="fp32", help="the servers' --dtype (default fp32)")
    srv.add_argument("--server-threads", type=positive_int, default=None, help="OMP_NUM_THREADS of the servers")
    args = p.parse_args(argv)
    check_args(p, args)
    return args


def check_args(p: argparse.ArgumentParser, args) -> None:
    if args.serve and args.endpoint:
        p.error("give --serve or --endpoint, not both")
    if args.serve and not args.cache_memory:
        p.error("--serve needs --cache-memory: every scheme is measured at one cache memory")
    if not 0 < args.time_limit < math.inf:
        p.error("--time-limit must be positive seconds")
    args.prompts = args.prompts or ("ids" if not (args.serve or args.endpoint) else "text")
    longest = args.prompt_len.high + args.new_tokens.high + (TEXT_MARGIN if args.prompts == "text" else 0)
    context = args.max_model_len or (None if (args.serve or args.endpoint) else args.context)
    if context and longest > context + 1:
        p.error(f"the longest request ({longest} tokens with the margin) must fit the context {context}")


def targets_of(args, tmp: Path) -> tuple[list[Target], int | None]:
    """The schemes and the one cache memory of their servers (None for an --endpoint)."""
    cache = byte_size(args.cache_memory, "--cache-memory") if args.cache_memory else None
    if args.endpoint:
        root = loopback_root(args.endpoint)
        return [Target(args.label or args.model or first_model(root) or "endpoint", url=root)], None
    if args.serve:
        return [Target(label, path=Path(path)) for label, path in args.serve], cache
    models = write_models(args, tmp)
    per_token = {t.label: t.cache_bytes_per_token for t in models}
    qkv = per_token.get("Q-K-V", max(per_token.values()))
    return models, cache or args.qkv_sequences * qkv * args.context


def load_record(watch: LoadWatch, endpoint: bool) -> tuple[dict, str, bool]:
    """(record, one line, noisy?): qkvlab.base.loadavg's verdict; with --endpoint the server's CPU is
    another process's, so the 'others' rule is left out (the record keeps the figure)."""
    record = watch.to_dict()
    if endpoint:
        noisy, reasons = verdict(watch.cores, watch.load_before, None, watch.steal)
        record.update(noisy=noisy, noisy_reasons=reasons, note="--endpoint: others' CPU includes the server")
    text = describe(record) + ("; others' CPU includes the server under test" if endpoint else "")
    return record, text + ("; not measured quiet" if record["noisy"] else ""), record["noisy"]


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    if out.exists() and any(out.iterdir()) and not args.overwrite:
        raise SystemExit(f"serve_load: {out} is not empty; pass --overwrite to replace its results")
    log = lambda s: print(s, file=sys.stderr, flush=True)
    watch = LoadWatch.start()  # started servers are waited-for children: their CPU is ours, not "others"
    log(f"machine before the run: {watch.before_summary()}")
    workload = draw_workload(args)
    log(workload_text(workload, args, None).split("\n")[0])
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="qkvlab-serve-load-") as tmp:
        targets, cache_bytes = targets_of(args, Path(tmp))
        rows = run_all(args, targets, workload, cache_bytes, log)
    load, load_text, noisy = load_record(watch.finish(), bool(args.endpoint))
    command = "python benchmarks/serve_load.py " + " ".join(sys.argv[1:] if argv is None else argv)
    meta = {"command": command, "cpus": os.cpu_count(), "wall_s": round(time.perf_counter() - t0, 1)}
    meta.update(load=load, load_text=load_text, measured_quiet=not noisy, slo_s=args.slo, cache_bytes=cache_bytes)
    out.mkdir(parents=True, exist_ok=True)
    md = markdown(rows, args, workload, cache_bytes, meta)
    workload_json = {k: v for k, v in workload.items() if k not in ("prompt_tokens", "output_tokens")}
    atomic_write(out / "results.md", md)
    atomic_write(out / "results.json", json_text({**meta, "workload": workload_json, "rows": rows}, indent=2))
    plot(rows, out / "serve_load.png")
    print(md)
    if noisy:
        print(f"not measured quiet: {load_text}")
    log(f"wrote {out / 'results.md'}, results.json, serve_load.png")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except UserError as e:
        print(f"serve_load: error: {e}", file=sys.stderr)
        sys.exit(2)
