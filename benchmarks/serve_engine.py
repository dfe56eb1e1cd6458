"""The serve engine's figures, ratios measured in one run (random weights of one shape; default SmolLM2-135M's):

1. decode step, --streams x --context tokens: the engine's step reading its blocks in place, and
   gathering them (the fallback), vs `decode_step` on one contiguous KVCache; medians of --reps rounds,
   the three alternated in each round (the pool and the cache filled without a prefill: the step's
   cost does not depend on what the keys hold);
2. TTFT of a request whose --prefix-tokens prefix was served before, vs the first (prefix cache);
3. inter-token p99 of --decoders streams while a --long-prompt prompt is admitted under --budget, vs
   without it: medians of --rounds runs of each, alternated;
4. /health latency while a 4 MB prompt arrives (qkvlab serve on a tiny model, bytes tokenizer).

--attention measures one layer's decode attention alone at the same streams and context (the read
that 1 chooses between): SDPA over one contiguous cache, SDPA over the gathered rows, the compiled
in-place read (serve/paged_attention.py); --only picks which figures to run.

    python benchmarks/serve_engine.py               # SmolLM2-135M's shape (the lead runs it quiet)
    python benchmarks/serve_engine.py --tiny        # a tiny shape: a dry run in seconds
    python benchmarks/serve_engine.py --attention --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time

import torch
import torch.nn.functional as F

from qkvlab.base.loadavg import ScriptRun, add_options
from qkvlab.decode.steps import decode_step, new_cache
from qkvlab.model.config import ModelConfig
from qkvlab.model.transformer import GPT
from qkvlab.serve.engine import Engine
from qkvlab.serve.kv_cache_manager import blocks_for, default_block_size
from qkvlab.serve.paged_attention import read
from qkvlab.serve.request import Request

SMOLLM2 = dict(n_layer=30, n_head=9, kv_heads=3, d_model=576, vocab_size=49152, context=8192, attn="Q-K-V", pos="rope")
SMOLLM2.update(norm="rmsnorm", mlp="swiglu", mlp_hidden=1536)
TINY = dict(n_layer=2, n_head=4, kv_heads=2, d_model=32, vocab_size=300, context=256, attn="Q-K-V", pos="rope")


def median_ms(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def rounds(ways: dict, reps: int) -> dict[str, float]:
    """Each way once (a warm-up), then `reps` rounds of every way in turn -> median ms of each."""
    for fn in ways.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(reps):
        for name, fn in ways.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: 1e3 * statistics.median(t) for name, t in times.items()}


def filled_engine(model, streams: int, context: int, reps: int, block_size: int) -> Engine:
    """An engine running `streams` sequences whose first context - 1 tokens the pool holds (blocks
    taken, nothing computed): its next steps are decode steps at `context` tokens."""
    longest = context + 2 * reps + 8
    engine = Engine(
        model,
        rows=streams,
        context=longest,
        block_size=block_size,
        token_budget=streams * longest,
        prefix_caching=False,
    )
    for i in range(streams):
        engine.submit(
            Request(tuple((i + j) % 200 for j in range(context)), 10**6, stop_ids=frozenset()), lambda e: None
        )
    scheduler = engine.scheduler
    while scheduler.waiting:
        seq = scheduler.waiting.popleft()
        seq.table = engine.kv.take(blocks_for(context, engine.kv.block_size))
        seq.computed = context - 1
        scheduler.running.append(seq)
    return engine


@torch.inference_mode()
def decode_paged_vs_contiguous(model, streams: int, context: int, reps: int, block_size: int) -> dict:
    engine = filled_engine(model, streams, context, reps, block_size)
    engine.warm_up()  # the in-place read compiled (the model's layout reads in place)
    decoding = engine.choices

    def paged(how: str):
        def step():
            decoding.paged_read = how
            engine.step()

        return step

    cache = new_cache(model, streams, context + 2 * reps + 8)
    cache.begin(torch.zeros(streams, context, dtype=torch.long) + torch.arange(context), None)
    tokens, pos = torch.zeros(streams, dtype=torch.long), torch.full((streams,), context)
    tree = decoding.decoder(model, streams)  # the modules the engine's step calls
    ways = {"in_place": paged("in place"), "gather": paged("gather")}
    ways["contiguous"] = lambda: decode_step(tree, cache, tokens, pos).argmax(-1)
    ms = rounds(ways, reps)
    engine.stop()
    return {
        **{f"{k}_ms": round(v, 2) for k, v in ms.items()},
        "in_place/contiguous": round(ms["in_place"] / ms["contiguous"], 3),
        "gather/contiguous": round(ms["gather"] / ms["contiguous"], 3),
    }


@torch.inference_mode()
def attention_read(cfg: ModelConfig, streams: int, context: int, reps: int, block_size: int) -> dict:
    """One layer's decode attention, `streams` rows of `context` keys, as the engine reads them (its
    blocks scattered over the pool) and as one contiguous cache holds them."""
    hq, hk, hd = cfg.n_head, cfg.n_kv_heads, cfg.head_dim
    n = -(-context // block_size)
    pool_blocks = streams * n + 8
    k_pool, v_pool = torch.randn(2, pool_blocks * block_size, hk, hd).unbind(0)
    tables = torch.randperm(pool_blocks)[: streams * n].view(streams, n)  # blocks anywhere in the pool
    lengths = torch.full((streams,), context)
    cols = torch.arange(context)
    slots = (tables[:, cols // block_size] * block_size + cols % block_size).flatten()
    k_dense = k_pool[slots].view(streams, context, hk, hd).transpose(1, 2).contiguous()  # (B, hk, S, hd)
    v_dense = v_pool[slots].view(streams, context, hk, hd).transpose(1, 2).contiguous()
    q = torch.randn(streams, hk, hq // hk, hd)  # a group's queries as SDPA's rows, as attention.sdpa decodes
    scale = hd**-0.5

    def gathered():
        k = k_pool.index_select(0, slots).view(streams, context, hk, hd).transpose(1, 2)
        v = v_pool.index_select(0, slots).view(streams, context, hk, hd).transpose(1, 2)
        return F.scaled_dot_product_attention(q, k, v, scale=scale)

    ways = {
        "in_place": lambda: read(q, k_pool, v_pool, tables, lengths, scale, block_size),
        "gather": gathered,
        "contiguous": lambda: F.scaled_dot_product_attention(q, k_dense, v_dense, scale=scale),
    }
    err = (ways["in_place"]() - ways["contiguous"]()).abs().max().item()
    ms = rounds(ways, reps)
    return {
        **{f"{k}_ms": round(v, 2) for k, v in ms.items()},
        "in_place/contiguous": round(ms["in_place"] / ms["contiguous"], 3),
        "gather/contiguous": round(ms["gather"] / ms["contiguous"], 3),
        "max_abs_difference": err,
    }


def ttft_ms(engine: Engine, prompt: tuple[int, ...]) -> float:
    got = []
    t0 = time.perf_counter()
    seq = engine.submit(Request(prompt, 1), got.append)
    while not got:
        engine.step()
    engine.cancel(seq)
    while not engine.idle():
        engine.step()
    return 1e3 * (time.perf_counter() - t0)


@torch.inference_mode()
def prefix_ttft(model, prefix: int, block_size: int) -> dict:
    engine = Engine(model, rows=2, block_size=block_size, token_budget=prefix + 64)
    engine.warm_up()  # the paged read compiled before the clock starts, as `serve` does before listening
    base = tuple(j % 200 for j in range(prefix))
    first = ttft_ms(engine, base + (7, 8, 9))
    again = ttft_ms(engine, base + (10, 11, 12))
    engine.stop()
    return {"first_ms": first, "cached_ms": again, "ratio": again / first}


@torch.inference_mode()
def itl_p99(model, decoders: int, long_prompt: int, budget: int, steps: int, block_size: int, repeats: int) -> dict:
    def run(admit: bool) -> tuple[float, float | None]:
        engine = Engine(model, rows=decoders + 1, block_size=block_size, token_budget=budget)
        engine.warm_up()
        stamps: list[list[float]] = [[] for _ in range(decoders)]
        for i in range(decoders):
            engine.submit(Request((i + 1, 2, 3), 10**6), lambda e, i=i: stamps[i].append(time.perf_counter()))
        for _ in range(3):
            engine.step()
        first: list[float] = []  # when the admitted prompt's first token came
        t0 = time.perf_counter()
        if admit:
            engine.submit(
                Request(tuple(j % 200 for j in range(long_prompt)), 1), lambda e: first.append(time.perf_counter())
            )
        for _ in range(steps):
            engine.step()
        engine.stop()
        gaps = sorted(b - a for s in stamps for a, b in zip(s[3:], s[4:]))
        if not gaps:
            raise SystemExit(f"no inter-token gaps measured (tokens per stream: {[len(s) for s in stamps]})")
        return 1e3 * gaps[int(0.99 * (len(gaps) - 1))], (1e3 * (first[0] - t0) if first else None)

    quiet, busy, ttft = [], [], []
    for _ in range(repeats):  # alternated, so a slow spell of the machine falls on both
        quiet.append(run(False)[0])
        p99, first = run(True)
        busy.append(p99)
        ttft.append(first)
    without, admitting = statistics.median(quiet), statistics.median(busy)
    return {
        "without_ms": without,
        "admitting_ms": admitting,
        "ratio": admitting / without,
        "prompt_ttft_ms": statistics.median(ttft),
        "budget": budget,
        "rounds": {"without_ms": quiet, "admitting_ms": busy, "prompt_ttft_ms": ttft},
    }


def health_while_4mb(tmp: str) -> dict:
    import httpx  # optional: httpx (the serve extra)

    from qkvlab.model.folder import save_model
    from qkvlab.serve.server import ServeConfig, build, listen, load_served, make_server

    cfg = ModelConfig(**TINY).validate()
    save_model(f"{tmp}/tiny", GPT(cfg), cfg)
    cfg = ServeConfig(model=f"{tmp}/tiny", port=0, cache_memory="4MB", tokenizer="bytes", dtype="fp32")
    built = build(cfg, load_served(cfg))
    sock = listen("127.0.0.1", 0)
    server = make_server(built, sock, 5.0, log=lambda s: None)
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
    built.engine.start()
    while not server.started:
        time.sleep(0.01)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    with httpx.Client(base_url=url, timeout=60) as client:
        body = {"prompt": "x" * (4 * 2**20 - 100), "max_tokens": 1}
        t = threading.Thread(target=lambda: client.post("/v1/completions", json=body))
        t.start()
        lat = []
        while t.is_alive() or not lat:
            t0 = time.perf_counter()
            client.get("/health")
            lat.append(1e3 * (time.perf_counter() - t0))
    server.should_exit = True
    built.engine.stop()
    return {"health_max_ms": max(lat), "health_p50_ms": statistics.median(lat)}


FIGURES = ("decode", "prefix", "itl", "health")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="a tiny shape and short runs (a dry run)")
    p.add_argument("--attention", action="store_true", help="one layer's decode attention alone (the reads)")
    p.add_argument("--only", default=",".join(FIGURES), help=f"which of {', '.join(FIGURES)} (default: all)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--context", type=int, default=2000)
    p.add_argument("--prefix-tokens", type=int, default=1500)
    p.add_argument("--decoders", type=int, default=8)
    p.add_argument("--long-prompt", type=int, default=2000)
    p.add_argument("--budget", type=int, default=32, help="--max-num-batched-tokens of the ITL run")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3, help="ITL runs without and with the prompt, alternated (medians)")
    p.add_argument(
        "--block-size", type=int, default=default_block_size("cpu"), help="tokens per cache block (default: the CPU's)"
    )
    add_options(p)
    args = p.parse_args(argv)
    run = ScriptRun(args, "serve_engine")
    if args.threads:
        torch.set_num_threads(args.threads)
    shape = TINY if args.tiny else SMOLLM2
    if args.tiny:
        args.context, args.prefix_tokens, args.long_prompt, args.reps, args.rounds = 64, 48, 64, 3, 1
    torch.manual_seed(0)
    cfg = ModelConfig(**shape).validate()
    print(f"threads {torch.get_num_threads()}, {args.streams} streams x {args.context} tokens", flush=True)
    figures = {
        "threads": torch.get_num_threads(),
        "shape": "tiny" if args.tiny else "SmolLM2-135M",
        "block_size": args.block_size,
    }
    if args.attention:
        figures["attention"] = attention_read(cfg, args.streams, args.context, args.reps, args.block_size)
        print("one layer's decode attention:", figures["attention"], run.tag(), flush=True)
        return run.finish(figures)
    only = set(args.only.split(","))
    model = GPT(cfg).eval()
    if "decode" in only:
        figures["decode"] = decode_paged_vs_contiguous(model, args.streams, args.context, args.reps, args.block_size)
        print("decode step, paged vs contiguous:", figures["decode"], run.tag(), flush=True)
    if "prefix" in only:
        figures["prefix"] = prefix_ttft(model, args.prefix_tokens, args.block_size)
        print("TTFT, cached prefix vs first:", figures["prefix"], run.tag(), flush=True)
    if "itl" in only:
        steps = max(8, args.long_prompt // max(1, args.budget - args.decoders) + 4)  # the prompt's chunks and a few
        figures["itl"] = itl_p99(
            model, args.decoders, args.long_prompt, args.budget, steps, args.block_size, args.rounds
        )
        print("inter-token p99, admitting vs not:", figures["itl"], run.tag(), flush=True)
    if "health" in only:
        with tempfile.TemporaryDirectory() as tmp:
            figures["health"] = health_while_4mb(tmp)
            print("/health while a 4 MB prompt arrives:", figures["health"], run.tag(), flush=True)
    return run.finish(figures)


if __name__ == "__main__":
    raise SystemExit(main())
