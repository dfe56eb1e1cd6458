"""Load test of `qkvlab serve` with a real HTTP client: does a smaller KV cache serve more?

For each variant (default Q-K-V, Q-K=V, Id-K=V/MQA: random models of one shape, written to a temp
folder) and each offered load (requests/s), it starts `qkvlab serve` on 127.0.0.1 with the same
--cache-memory (by default room for --qkv-sequences sequences of Q-K-V, so the cache limits Q-K-V),
sends --requests streaming requests with Poisson arrivals from up to --clients concurrent clients
(httpx), and records per run:

- throughput: completion tokens / seconds from the first request sent to the last token received;
- TTFT: seconds from sending a request to its first token (p50, p99);
- per-token latency: a request's seconds from its first to its last token / (tokens - 1), the
  time per output token of each request (p50, p99 over requests);
- peak concurrent sequences: the server's own count (/health peak_active);
- the 1-minute load average at the run's start and end; for the whole measurement, qkvlab.loadavg's
  record (load before, CPU that other processes took, steal) and its quiet/noisy verdict.

Everything is bounded: a run stops sending at --time-limit seconds and then cancels what is left;
each server is stopped with SIGTERM. Output: OUT/results.md (a table), OUT/results.json and
OUT/serve_load.png (throughput and p99 per-token latency against offered load).

    python benchmarks/serve_load.py --out docs/results/serve                     # the measurement
    python benchmarks/serve_load.py --out /tmp/smoke --rates 4 --requests 6 --new-tokens 4 \\
        --context 64 --d-model 64 --n-layer 2 --vocab-size 256                   # a smoke test
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from qkvlab.accounting import kv_cache_bytes_per_token
from qkvlab.config import ModelConfig
from qkvlab.errors import UserError
from qkvlab.files import atomic_file, atomic_write, json_text
from qkvlab.io import save_model
from qkvlab.loadavg import LoadWatch, load1
from qkvlab.settings import float_list, positive_int
from qkvlab.units import byte_size
from qkvlab.variants import parse_variants

START_TIMEOUT = 120.0  # seconds a server may take to print its start-up line


def load_average() -> float | None:
    """The 1-minute load average now, rounded (qkvlab.loadavg.load1)."""
    now = load1()
    return None if now is None else round(now, 2)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


def write_models(args, folder: Path) -> list[tuple[str, Path, int]]:
    """One random model per variant, identical shape -> (variant, folder, KV-cache bytes per token)."""
    import torch

    from qkvlab.model import GPT

    base = ModelConfig(
        n_layer=args.n_layer, n_head=args.n_head, d_model=args.d_model, vocab_size=args.vocab_size, context=args.context
    )
    out = []
    for v in parse_variants(args.variants):
        cfg = v.apply(base).validate()
        torch.manual_seed(0)
        path = save_model(folder / v.slug, GPT(cfg), cfg)
        out.append((v.name, path, kv_cache_bytes_per_token(cfg, "fp32")))
    return out


class Server:
    """`qkvlab serve` as a subprocess on 127.0.0.1 and a free port."""

    def __init__(self, model: Path, cache_bytes: int, threads: int | None):
        env = {**os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {})}
        cmd = [sys.executable, "-m", "qkvlab", "serve", str(model), "--host", "127.0.0.1", "--port", "0"]
        cmd += ["--cache-memory", str(cache_bytes), "--dtype", "fp32", "--device", "cpu"]
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.line = self._first_line()
        if "http://" not in self.line:
            self.stop()
            raise UserError(f"qkvlab serve did not start: {self.line or self.proc.stderr.read()[-500:]}")
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


async def one_request(client, sem, body, record) -> None:
    async with sem:
        sent = time.perf_counter()
        stamps = []
        async with client.stream("POST", "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    if chunk.get("choices") and chunk["choices"][0]["token_ids"]:
                        stamps.append(time.perf_counter())
        record.append((sent, stamps))


async def offered_load(url: str, args, rate: float, seed: int) -> dict:
    """Poisson arrivals at `rate` requests/s; bounded by --requests and --time-limit."""
    rng = random.Random(seed)
    record: list = []
    sem = asyncio.Semaphore(args.clients)
    limits = httpx.Limits(max_connections=args.clients + 2)
    async with httpx.AsyncClient(base_url=url, timeout=args.time_limit + 60, limits=limits) as client:
        tasks, t0 = [], time.perf_counter()
        for _ in range(args.requests):
            prompt = [rng.randrange(args.vocab_size) for _ in range(args.prompt_len)]
            body = {"prompt": prompt, "max_tokens": args.new_tokens, "temperature": 0, "stream": True}
            tasks.append(asyncio.create_task(one_request(client, sem, body, record)))
            await asyncio.sleep(rng.expovariate(rate))
            if time.perf_counter() - t0 > args.time_limit:
                break
        left = max(1.0, args.time_limit - (time.perf_counter() - t0))
        done, pending = await asyncio.wait(tasks, timeout=left)
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        health = (await client.get("/health")).json()
    return summarize(record, t0, len(tasks), len(pending), health)


def summarize(record, t0: float, sent: int, cancelled: int, health: dict) -> dict:
    stamps = [s for _, s in record if s]
    ttft = [s[0] - sent_at for sent_at, s in record if s]
    per_token = [(s[-1] - s[0]) / (len(s) - 1) for s in stamps if len(s) > 1]
    tokens = sum(len(s) for s in stamps)
    end = max((s[-1] for s in stamps), default=t0)
    return {
        "requests_sent": sent,
        "requests_done": len(record),
        "requests_cancelled": cancelled,
        "tokens": tokens,
        "seconds": round(end - t0, 3),
        "tokens_per_s": tokens / (end - t0) if end > t0 else None,
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p99_s": percentile(ttft, 99),
        "token_latency_p50_s": percentile(per_token, 50),
        "token_latency_p99_s": percentile(per_token, 99),
        "peak_sequences": health["peak_active"],
        "capacity_sequences": health["capacity_sequences"],
    }


def run_all(args, models, cache_bytes: int, log) -> list[dict]:
    rows = []
    for name, path, per_token in models:
        for rate in args.rates:
            server = Server(path, cache_bytes, args.server_threads)
            try:
                log(f"{name} at {rate:g} req/s: {server.line}")
                load_start = load_average()
                result = asyncio.run(offered_load(server.url, args, rate, args.seed))
                row = {"variant": name, "offered_rps": rate, "cache_bytes_per_token": per_token, **result}
                rows.append({**row, "load_start": load_start, "load_end": load_average()})
                log(f"  {fmt_row(rows[-1])}")
            finally:
                server.stop()
    return rows


def fmt(x, spec=".1f", scale=1.0) -> str:
    return "-" if x is None else format(x * scale, spec)


def fmt_row(r: dict) -> str:
    return (
        f"{r['tokens_per_s'] and round(r['tokens_per_s'])} tok/s, peak {r['peak_sequences']}/"
        f"{r['capacity_sequences']}, ttft p99 {fmt(r['ttft_p99_s'], '.0f', 1e3)} ms, "
        f"token p99 {fmt(r['token_latency_p99_s'], '.1f', 1e3)} ms, load {r['load_start']}->{r['load_end']}"
    )


def table(rows: list[dict], args, cache_bytes: int) -> str:
    head = [
        "variant",
        "offered req/s",
        "capacity",
        "peak seqs",
        "done/sent",
        "tok/s",
        "TTFT p50 ms",
        "TTFT p99 ms",
        "token p50 ms",
        "token p99 ms",
        "load start→end",
    ]
    lines = [
        f"Shape: {args.n_layer} layers, {args.n_head} heads, d {args.d_model}, vocab {args.vocab_size}, context "
        f"{args.context}, fp32 on cpu; cache memory {cache_bytes:,} bytes; prompt {args.prompt_len} + "
        f"{args.new_tokens} tokens, greedy, streamed; {args.requests} requests per run from up to {args.clients} "
        f"clients, Poisson arrivals (seed {args.seed}).",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for r in rows:
        cells = [
            r["variant"],
            f"{r['offered_rps']:g}",
            str(r["capacity_sequences"]),
            str(r["peak_sequences"]),
            f"{r['requests_done']}/{r['requests_sent']}",
            fmt(r["tokens_per_s"], ".0f"),
            fmt(r["ttft_p50_s"], ".0f", 1e3),
            fmt(r["ttft_p99_s"], ".0f", 1e3),
            fmt(r["token_latency_p50_s"], ".1f", 1e3),
            fmt(r["token_latency_p99_s"], ".1f", 1e3),
            f"{r['load_start']}→{r['load_end']}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for name in dict.fromkeys(r["variant"] for r in rows):
        mine = [r for r in rows if r["variant"] == name]
        x = [r["offered_rps"] for r in mine]
        a.plot(x, [r["tokens_per_s"] or 0 for r in mine], marker="o", label=name)
        b.plot(x, [1e3 * (r["token_latency_p99_s"] or 0) for r in mine], marker="o", label=name)
    a.set(xlabel="offered load (requests/s)", ylabel="throughput (tokens/s)", title="throughput")
    b.set(xlabel="offered load (requests/s)", ylabel="p99 per-token latency (ms)", title="p99 latency")
    for ax in (a, b):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    with atomic_file(path, "wb") as f:
        fig.savefig(f, format="png", dpi=120)
    plt.close(fig)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="output folder (results.md, results.json, serve_load.png)")
    p.add_argument("--overwrite", action="store_true", help="replace the files of an earlier run in --out")
    p.add_argument("--variants", default="Q-K-V,Q-K=V,Id-K=V/MQA", help="comma-separated variants")
    p.add_argument("--n-layer", type=positive_int, default=4)
    p.add_argument("--n-head", type=positive_int, default=8)
    p.add_argument("--d-model", type=positive_int, default=256)
    p.add_argument("--vocab-size", type=positive_int, default=2048)
    p.add_argument("--context", type=positive_int, default=256)
    p.add_argument("--prompt-len", type=positive_int, default=32)
    p.add_argument("--new-tokens", type=positive_int, default=64)
    p.add_argument("--rates", type=float_list, default=(4.0, 8.0, 16.0, 32.0, 64.0), help="offered loads, requests/s")
    p.add_argument("--requests", type=positive_int, default=96, help="requests per run")
    p.add_argument("--clients", type=positive_int, default=64, help="most requests in flight at once")
    p.add_argument("--time-limit", type=float, default=60.0, help="seconds per run before it stops sending")
    p.add_argument(
        "--cache-memory", default=None, metavar="SIZE", help="the servers' --cache-memory (default: --qkv-sequences)"
    )
    p.add_argument(
        "--qkv-sequences", type=positive_int, default=4, help="default cache memory: room for this many Q-K-V"
    )
    p.add_argument("--server-threads", type=positive_int, default=None, help="OMP_NUM_THREADS of the servers")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    for name in ("n_layer", "n_head", "d_model", "vocab_size", "context", "prompt_len", "new_tokens", "requests"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.clients < 1 or args.qkv_sequences < 1 or not 0 < args.time_limit < float("inf"):
        p.error("--clients, --qkv-sequences and --time-limit must be positive")
    if args.prompt_len + args.new_tokens > args.context + 1:
        p.error(f"--prompt-len + --new-tokens must fit --context {args.context}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    if out.exists() and any(out.iterdir()) and not args.overwrite:
        raise SystemExit(f"serve_load: {out} is not empty; pass --overwrite to replace its results")
    log = lambda s: print(s, file=sys.stderr, flush=True)
    watch = LoadWatch.start()  # the servers are waited-for children: their CPU is ours, not "others"
    log(f"machine before the run: {watch.before_summary()}")
    load_start, t0 = None if watch.load_before is None else round(watch.load_before, 2), time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="qkvlab-serve-load-") as tmp:
        models = write_models(args, Path(tmp))
        per_token = dict((n, b) for n, _, b in models)
        qkv = per_token.get("Q-K-V", max(per_token.values()))
        cache_bytes = byte_size(args.cache_memory, "--cache-memory") if args.cache_memory else None
        cache_bytes = cache_bytes or args.qkv_sequences * qkv * args.context
        rows = run_all(args, models, cache_bytes, log)
    out.mkdir(parents=True, exist_ok=True)
    md = table(rows, args, cache_bytes)
    command = "python benchmarks/serve_load.py " + " ".join(sys.argv[1:] if argv is None else argv)
    meta = {
        "command": command,
        "cpus": os.cpu_count(),
        "load_start": load_start,
        "load_end": load_average(),
        "wall_s": round(time.perf_counter() - t0, 1),
        "load": watch.finish().to_dict(),
    }
    head = f"# qkvlab serve under load\n\n`{command}`\n\n{meta['cpus']} CPUs; load average {load_start} at the start, "
    head += (
        f"{meta['load_end']} at the end; {meta['wall_s']} s in all.\n\nMachine during the run: {watch.summary()}.\n\n"
    )
    atomic_write(out / "results.md", head + md)
    atomic_write(out / "results.json", json_text({**meta, "cache_bytes": cache_bytes, "rows": rows}, indent=2))
    plot(rows, out / "serve_load.png")
    print(md)
    log(f"wrote {out / 'results.md'}, results.json, serve_load.png")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except UserError as e:
        print(f"serve_load: error: {e}", file=sys.stderr)
        sys.exit(2)
