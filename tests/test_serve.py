"""qkvlab serve: continuous batching on the paged cache is exact (every scheme family, in a full
mixed batch, and through preemption by recompute, greedy and seeded), capacity in tokens follows
the cache bytes (K=V twice Q-K-V), n shares a prefill, logprobs are the model's; and a real HTTP
client (httpx, and the openai package where installed) against a server on a free loopback port:
OpenAI/vLLM shapes, chat through a transformers tokenizer's template, streaming, tokenize,
metrics, queueing, bad input answered with 4xx and survived, disconnects, drain."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from qkvlab.base.errors import UserError  # noqa: E402
from qkvlab.base.units import byte_size  # noqa: E402
from qkvlab.cli import main  # noqa: E402
from qkvlab.decode.generate import generate  # noqa: E402
from qkvlab.decode.sampling import Sampling  # noqa: E402
from qkvlab.model.accounting import kv_cache_bytes_per_token  # noqa: E402
from qkvlab.model.config import ModelConfig  # noqa: E402
from qkvlab.model.folder import save_model  # noqa: E402
from qkvlab.model.transformer import GPT  # noqa: E402
from qkvlab.serve.decoding import runner_decoding  # noqa: E402
from qkvlab.serve.engine import Engine  # noqa: E402
from qkvlab.serve.kv_cache_manager import blocks_for, default_block_size  # noqa: E402
from qkvlab.serve.request import Event, Request  # noqa: E402
from qkvlab.serve.server import ServeConfig, build, listen, load_served, make_server, pool_blocks  # noqa: E402

VOCAB, CONTEXT = 300, 40
WAIT = 60.0  # seconds: a bound on waiting for the server, never a measurement
FAMILIES = [  # (scheme, positions, kv heads): every family of Paper A and B, GQA and MQA, rope and learned
    ("Q-K-V", "learned", None),
    ("Q-K-V", "rope", 2),
    ("Q-K=V", "rope", None),
    ("Q-K=V", "learned", 1),
    ("Q=K=V", "learned", None),
    ("Q=K-V", "rope", None),
    ("Id-K-V", "learned", 2),
    ("Id-K=V", "rope", 1),
    ("(Q-K=V)+", "rope", None),
    ("(Q-K-V)+", "learned", 2),
]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def tiny_model(scheme="Q-K=V", pos="rope", kv=None, context=CONTEXT, dtype=torch.float64, seed=0, **more) -> GPT:
    cfg = ModelConfig(
        attn=scheme, pos=pos, kv_heads=kv, n_layer=2, n_head=4, d_model=32, vocab_size=VOCAB, context=context, **more
    ).validate()
    torch.manual_seed(seed)
    model = GPT(cfg).eval()
    with torch.no_grad():  # weights far larger than GPT-2's init: peaked attention, diverse greedy tokens
        for name, p in model.named_parameters():
            if p.dim() >= 2 or "score_term" in name:
                p.normal_(0.0, 0.3)
    return model.to(dtype)


def run_mixed(engine: Engine, requests: list[Request], join_every: int = 2) -> tuple[dict[int, list], list[int]]:
    """Half the requests at once, the rest one every `join_every` steps; steps until idle ->
    events per request, and the active count after every step."""
    events: dict[int, list] = {i: [] for i in range(len(requests))}
    first = len(requests) // 2
    for i in range(first):
        engine.submit(requests[i], events[i].append)
    active, nxt, step = [], first, 0
    while nxt < len(requests) or not engine.idle():
        engine.step()
        step += 1
        active.append(engine.stats()["active"])
        if nxt < len(requests) and step % join_every == 0:
            engine.submit(requests[nxt], events[nxt].append)
            nxt += 1
        assert step < 1000
    return events, active


def tokens(events) -> list[int]:
    return [e.token for e in events if e.token is not None]


@pytest.mark.parametrize("scheme,pos,kv", FAMILIES)
def test_full_mixed_batch_gives_each_request_its_tokens_alone(scheme, pos, kv):
    model = tiny_model(scheme, pos, kv)
    rng = random.Random(7)
    requests = [
        Request(tuple(rng.randrange(VOCAB) for _ in range(rng.randint(1, CONTEXT))), rng.randint(1, 14))
        for _ in range(10)
    ]
    engine = Engine(model, rows=3)
    events, active = run_mixed(engine, requests)
    assert max(active) == 3 and engine.stats()["peak_active"] == 3  # the batch was full, and requests queued
    for req, ev in zip(requests, events.values()):
        alone = generate(model, [list(req.prompt)], req.max_tokens, Sampling(temperature=0.0))[0]
        assert tokens(ev) == alone
        assert ev[-1].finish == "length" and sum(e.finish is not None for e in ev) == 1
    assert len({len(r.prompt) for r in requests}) > 5  # neighbours of many lengths


def test_steps_of_at_most_16_tokens_call_the_layouts_tree_and_the_model_is_never_patched():
    """The decode layout as a value (DecodeChoices.decode_model's tree, built once): steps of at most
    LAYOUT_MAX_BATCH tokens (decode steps' rows, or a packed step's decodes and chunks) call the tree,
    larger ones the model, whose modules are never changed; each request's tokens are its own alone."""
    from qkvlab.decode.layout import LAYOUT_MAX_BATCH, PackedLinear

    model = tiny_model("Q-K-V", "rope", 2, dtype=torch.float32)
    modules = {name: (type(m), dict(vars(m))) for name, m in model.named_modules()}
    rows = LAYOUT_MAX_BATCH + 2
    engine = Engine(model, rows=rows)
    tree = engine.choices.tree
    assert isinstance(tree.lm_head, PackedLinear) and not isinstance(model.lm_head, PackedLinear)
    calls = []  # (called the tree, tokens the step computes): the first layer's MLP sees every token
    count = lambda x: x.shape[:-1].numel()  # noqa: E731
    tree.trunk.blocks[0].mlp.up.register_forward_hook(lambda m, args, out: calls.append((True, count(args[0]))))
    hook = model.trunk.blocks[0].mlp.up.register_forward_hook(lambda m, args, out: calls.append((False, count(args[0]))))  # fmt: skip
    requests = [Request((i + 4,) * (i + 2), 12) for i in range(rows)]
    events = {i: [] for i in range(rows)}
    engine.submit(requests[0], events[0].append)
    for _ in range(3):  # its prefill, then decode steps of one row
        engine.step()
    for i, r in enumerate(requests[1:], 1):
        engine.submit(r, events[i].append)
    while not engine.idle():
        engine.step()
    hook.remove()
    assert all(tree_called == (n <= LAYOUT_MAX_BATCH) for tree_called, n in calls), calls
    assert {n <= LAYOUT_MAX_BATCH for _, n in calls} == {True, False}  # both kinds of step ran
    assert {name: (type(m), dict(vars(m))) for name, m in model.named_modules()} == modules  # never patched
    for r, ev in zip(requests, events.values()):
        assert tokens(ev) == generate(model, [list(r.prompt)], r.max_tokens, Sampling(temperature=0.0))[0]


def test_a_compiled_engine_compiles_before_serving_and_gives_each_request_its_tokens_alone(monkeypatch):
    """compile="default": warm_up compiles the paged step, its in-place read traced into it, for its
    WARM_UP_SHAPES (dynamo with a counting eager backend stands in for inductor: two graphs, one sequence
    and two or more), on blocks it gives back; serving a mixed batch of every length then compiles
    nothing more, calls the layout's tree at every batch, and each request gets the tokens it gets
    alone. Eager, warm_up compiles the in-place read alone; an engine that gathers compiles nothing."""
    import qkvlab.decode.compiled as compiled
    from qkvlab.decode.steps import decode_step

    compiles = []

    def counting(gm, example_inputs):
        compiles.append(len(example_inputs))
        return gm.forward

    torch._dynamo.reset()
    step = torch.compile(decode_step, backend=counting, dynamic=True, fullgraph=True)
    monkeypatch.setitem(compiled._COMPILED, ("default", True, "cpu"), step)
    model = tiny_model("Q-K=V", "rope", dtype=torch.float32)
    engine = Engine(model, rows=3, choices=runner_decoding(model, compile="default", rows=3))
    assert engine.choices.paged_read == "in place" and engine.choices.decoder(model, 99) is engine.choices.tree
    assert engine.warm_up() > 0 and engine.kv.used == 0 and len(compiles) == 2
    rng = random.Random(5)
    requests = [
        Request(tuple(rng.randrange(VOCAB) for _ in range(rng.randint(1, CONTEXT // 2))), rng.randint(1, 12))
        for _ in range(7)
    ]
    events, active = run_mixed(engine, requests)
    assert len(compiles) == 2 and set(active) >= {1, 2, 3} and engine.choices.paged_read == "in place"
    for req, ev in zip(requests, events.values()):
        assert tokens(ev) == generate(model, [list(req.prompt)], req.max_tokens, Sampling(temperature=0.0))[0]
    engine.stop()
    eager = Engine(model, rows=2)
    assert eager.warm_up() > 0 and eager.choices.paged_read == "in place" and eager.kv.used == 0
    assert Engine(model, rows=2, choices=runner_decoding(model, paged_read="gather")).warm_up() == 0.0


def test_cancel_frees_the_blocks_at_the_next_step_and_neighbours_are_unchanged():
    model = tiny_model("Q-K=V", "rope", 1)
    prompts = [(1, 2, 3), tuple(range(5, 25)), (9,) * 7]
    engine = Engine(model, rows=3)
    events = {i: [] for i in range(3)}
    seqs = [engine.submit(Request(p, 20), events[i].append) for i, p in enumerate(prompts)]
    engine.step()
    engine.step()
    assert engine.stats()["active"] == 3
    held = engine.kv.used
    engine.cancel(seqs[0])
    engine.step()
    assert engine.stats()["active"] == 2 and events[0][-1].finish == "cancelled"
    assert seqs[0] not in engine.scheduler.running and not seqs[0].table and engine.kv.used < held
    while not engine.idle():
        engine.step()
    assert engine.kv.used == 0  # every block came back
    for i in (1, 2):
        assert tokens(events[i]) == generate(model, [list(prompts[i])], 20, Sampling(temperature=0.0))[0]


def test_queued_cancel_leaves_at_once_and_end_of_text_stops():
    model = tiny_model()
    alone = generate(model, [[4, 5, 6]], 12, Sampling(temperature=0.0))[0]
    eot = alone[3]
    engine = Engine(model, rows=1, eot_id=eot)
    a, b = [], []
    engine.submit(Request((4, 5, 6), 12), a.append)
    second = engine.submit(Request((7,), 12), b.append)
    engine.cancel(second)
    assert b == [Event(finish="cancelled")] and engine.stats()["queued"] == 1
    while not engine.idle():
        engine.step()
    assert tokens(a) == alone[: alone.index(eot)] and a[-1].finish == "stop"


def test_seeded_sampling_matches_generate():
    model = tiny_model()
    s = Sampling(temperature=0.9, top_k=20, top_p=0.9)
    engine = Engine(model, rows=2)
    got = []
    engine.submit(Request((3, 1, 4, 1, 5), 9, s, seed=11), got.append)
    engine.submit(Request((2, 7), 9), [].append)  # a greedy neighbour
    while not engine.idle():
        engine.step()
    assert tokens(got) == generate(model, [[3, 1, 4, 1, 5]], 9, s, seed=11)[0]


def test_capacity_in_tokens_follows_cache_bytes_per_token():
    tokens_held = {}
    for name, scheme, kv in [("Q-K-V", "Q-K-V", None), ("Q-K=V", "Q-K=V", None), ("MQA", "Id-K=V", 1)]:
        model = tiny_model(scheme, "rope", kv, dtype=torch.float32)
        per_token = kv_cache_bytes_per_token(model.cfg, "fp32")
        blocks = pool_blocks(byte_size("204800"), per_token, CONTEXT, 16)
        engine = Engine(model, blocks=blocks, block_size=16)
        assert engine.runner.store.bytes_allocated() == blocks * 16 * per_token  # allocated = analytic
        tokens_held[name] = engine.stats()["capacity_tokens"]
    # per token: layers x (K and V, or one shared tensor) x kv heads x head dim x 4 bytes; whole blocks of 16
    assert tokens_held == {"Q-K-V": 204800 // (2 * 2 * 32 * 4), "Q-K=V": 800, "MQA": 3200}
    assert tokens_held["Q-K=V"] == 2 * tokens_held["Q-K-V"]  # one tensor per block instead of two
    with pytest.raises(UserError, match="holds no sequence"):
        pool_blocks(999, 100, 10, 16)
    with pytest.raises(UserError, match="no sequence of"):
        Engine(tiny_model(), blocks=2, block_size=16)  # 32 tokens < the context of 40


@pytest.mark.parametrize("scheme,pos,kv", FAMILIES)
def test_preemption_by_recompute_loses_nothing_and_stays_exact(scheme, pos, kv):
    """A pool of exactly one context (3 blocks of 16 for 40 tokens) and eight requests that each
    grow past their first block: sequences are preempted and recomputed, every one still gets
    the tokens it gets alone, and seeded sampling too."""
    model = tiny_model(scheme, pos, kv)
    rng = random.Random(11)
    s = Sampling(temperature=0.8, top_k=30)
    requests = [
        Request(tuple(rng.randrange(VOCAB) for _ in range(rng.randint(1, 14))), rng.randint(10, 24)) for _ in range(6)
    ] + [Request((5, 4, 3), 20, s, seed=3), Request((8,), 25, s, seed=4)]
    engine = Engine(model, blocks=3, block_size=16)
    events, _ = run_mixed(engine, requests, join_every=1)
    assert engine.stats()["preemptions"] > 0 and engine.kv.used == 0
    for req, ev in zip(requests, events.values()):
        alone = generate(model, [list(req.prompt)], req.max_tokens, req.sampling, seed=req.seed)[0]
        assert tokens(ev) == alone and ev[-1].finish == "length"


def test_capacity_in_tokens_at_smollm2s_shape():
    """docs/serve.md's figures: 64 MB, fp32, SmolLM2-135M's shape (30 layers, 9 heads of 64, 3 KV heads)."""
    held = {}
    for name, attn, kv in [("Q-K-V", "Q-K-V", 3), ("Q-K=V", "Q-K=V", 3), ("MQA", "Q-K=V", 1)]:
        cfg = ModelConfig(
            attn=attn, kv_heads=kv, n_layer=30, n_head=9, d_model=576, vocab_size=VOCAB, context=2048
        ).validate()
        per_token = kv_cache_bytes_per_token(cfg, "fp32")
        held[name] = (per_token, *(pool_blocks(64_000_000, per_token, 512, bs) * bs for bs in (64, 16)))
    # tokens held at the CPU's 64-token blocks and at 16; a 200 + 64-token request holds 5 blocks of 64
    assert held == {"Q-K-V": (46_080, 1_344, 1_376), "Q-K=V": (23_040, 2_752, 2_768), "MQA": (7_680, 8_320, 8_320)}
    assert [held[name][1] // 64 // blocks_for(264, 64) for name in held] == [4, 8, 26]
    with pytest.raises(UserError, match="holds no sequence"):  # no whole 2,048-token Q-K-V context in 64 MB
        pool_blocks(64_000_000, 46_080, 2048, 16)
    assert pool_blocks(64_000_000, 23_040, 2048, 16) * 16 >= 2048  # as K=V it holds one


def test_at_one_cache_memory_k_eq_v_runs_twice_the_sequences():
    """Same bytes, same requests (two blocks each): Q-K=V's blocks hold one tensor, so twice as
    many of them fit, and twice as many sequences run at once; each still gets its tokens alone."""
    running = {}
    for scheme in ("Q-K-V", "Q-K=V"):
        model = tiny_model(scheme, "rope", None)
        blocks = pool_blocks(2 * 2 * 32 * 8 * 16 * 12, kv_cache_bytes_per_token(model.cfg, "fp64"), CONTEXT, 16)
        engine = Engine(model, blocks=blocks, block_size=16)
        events = {i: [] for i in range(12)}
        for i in range(12):
            engine.submit(Request((i + 1,) * 20, 4), events[i].append)  # 20 + 4 tokens: two blocks
        engine.step()
        running[scheme] = engine.stats()["active"]
        while not engine.idle():
            engine.step()
        assert all(
            tokens(events[i]) == generate(model, [[i + 1] * 20], 4, Sampling(temperature=0.0))[0] for i in range(12)
        )
    assert running == {"Q-K-V": 6, "Q-K=V": 12}


def test_a_short_request_holds_only_its_blocks():
    """The issue's example at toy scale: a pool of 4 whole contexts (40 tokens each, 12 blocks of
    16 = 3 per context... 4 x 3 = 12 blocks) runs 12 one-block requests at once, not 4."""
    model = tiny_model()
    engine = Engine(model, blocks=12, block_size=16)
    assert engine.stats()["capacity_sequences"] == 4 and engine.stats()["max_concurrency"] == 4.8
    for i in range(12):
        engine.submit(Request((i + 1, 2, 3), 5), [].append)  # 3 + 5 tokens: one block each
    engine.step()
    assert engine.stats()["active"] == 12 and engine.kv.used == 12


@pytest.mark.parametrize(
    "text,value", [("8MB", 8_000_000), ("2GiB", 2 * 2**30), ("1536", 1536), ("0.5kb", 500), (" 3 MiB", 3 * 2**20)]
)
def test_sizes_share_one_parser(text, value):
    assert byte_size(text) == value


@pytest.mark.parametrize("text", ["", "12XB", "-1MB", "0", "inf", "GB"])
def test_bad_sizes(text):
    with pytest.raises(UserError, match="cache.memory"):  # --cache-memory, or cache_memory='' from the checks
        ServeConfig(model="m", cache_memory=text).validate()


# ---- over HTTP --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("serve") / "tiny"
    model = tiny_model("Q-K=V", "rope", None, dtype=torch.float32)
    save_model(folder, model, model.cfg)
    return folder


class Running:
    """A built server on a free 127.0.0.1 port, in a thread; `engine_thread=False` leaves the
    stepping to the test (deterministic interleavings)."""

    def __init__(self, model_dir, engine_thread=True, **overrides):
        # fp32 and blocks of 16 pinned: the counts asserted below are theirs, whatever this machine's defaults
        settings = {"cache_memory": "40KB", "tokenizer": "bytes", "name": "tiny", "dtype": "fp32", "block_size": 16}
        settings.update(overrides)
        cfg = ServeConfig(model=str(model_dir), port=0, **settings)
        self.built = build(cfg, load_served(cfg))
        self.engine = self.built.engine
        self.sock = listen("127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = make_server(self.built, self.sock, drain_timeout=WAIT, log=lambda s: None)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.engine_thread = engine_thread

    def __enter__(self):
        if self.engine_thread:
            self.engine.start()
        self.thread.start()
        wait_for(lambda: self.server.started)
        self.client = httpx.Client(base_url=self.url, timeout=WAIT)
        return self

    def __exit__(self, *exc):
        self.client.close()
        self.server.should_exit = True
        self.thread.join(WAIT)
        if self.engine_thread:
            self.engine.stop()
        self.sock.close()
        assert not self.thread.is_alive()

    def post(self, body, **kw):
        return self.client.post("/v1/completions", json=body, **kw)


def wait_for(condition, what="condition"):
    end = time.monotonic() + WAIT
    while not condition():
        assert time.monotonic() < end, f"gave up waiting for {what}"
        time.sleep(0.01)


@pytest.fixture(scope="module")
def server(model_dir):
    with Running(model_dir) as s:
        yield s


def greedy(server, prompt, n):
    """What `qkvlab generate` gives alone (only ids the server's tokenizer has)."""
    limit = server.engine.vocab_limit
    return generate(server.engine.model, [prompt], n, Sampling(temperature=0.0), vocab_limit=limit)[0]


def test_health_models_and_a_greedy_completion(server):
    h = server.client.get("/health").json()
    per_token = 2 * 32 * 4  # Q-K=V caches one tensor: 2 layers x d_model x fp32
    assert h["status"] == "ok" and h["scheme"] == "Q-K=V" and h["cache_bytes_per_token"] == per_token
    assert h["capacity_tokens"] == 40_000 // (per_token * 16) * 16 == 144 and h["block_size"] == 16
    assert h["capacity_sequences"] == 144 // 48 == 3  # whole contexts: 3 blocks of 16 hold 40 tokens
    assert {"active", "queued"} <= set(h)
    assert server.client.get("/v1/models").json()["data"][0]["id"] == "tiny"
    r = server.post({"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 9, "temperature": 0})
    body = r.json()
    assert r.status_code == 200 and body["object"] == "text_completion"
    choice = body["choices"][0]
    assert choice["token_ids"] == greedy(server, [5, 6, 7], 9) and choice["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 9, "total_tokens": 12}


def test_without_block_size_the_pool_takes_the_devices_blocks(model_dir):
    """No --block-size: the device's default (64 tokens a block on the CPU, where the in-place read
    pays per block), in the pool, /health and the capacity; a block size asked for is kept."""
    assert default_block_size("cpu") == 64 and default_block_size("cuda") == 16
    assert Engine(tiny_model("Q-K=V", "rope", 1), rows=1).kv.block_size == 64
    with Running(model_dir, block_size=None) as s:
        h = s.client.get("/health").json()
        assert h["block_size"] == s.engine.kv.block_size == 64
        assert h["capacity_tokens"] == 40_000 // (2 * 32 * 4 * 64) * 64 == 128  # 2 blocks of 64
        assert h["capacity_sequences"] == 2  # one block holds a whole context of 40
        r = s.post({"prompt": [5, 6, 7], "max_tokens": 5, "temperature": 0})
        assert r.json()["choices"][0]["token_ids"] == greedy(s, [5, 6, 7], 5)


def test_a_kv_latent_model_is_served_with_its_latent_named_and_its_smaller_cache(tmp_path):
    """A latent of r numbers per token (retrofit --kv-latent) is what the pool's blocks hold: at one cache
    memory the server admits (2 * kv_heads * d_head) / r times the tokens of the plain layout, says the
    latent in /health, and answers greedy requests with generate's tokens."""
    plain = tiny_model("Q-K-V", "rope", 2, dtype=torch.float32)
    latent = tiny_model("Q-K-V", "rope", 2, dtype=torch.float32, kv_latent=8)
    for name, model in (("plain", plain), ("latent", latent)):
        save_model(tmp_path / name, model, model.cfg)
    with Running(tmp_path / "plain", cache_memory="64KB") as s:
        h_plain = s.client.get("/health").json()
    with Running(tmp_path / "latent", cache_memory="64KB") as s:
        h = s.client.get("/health").json()
        r = s.post({"prompt": [5, 6, 7], "max_tokens": 9, "temperature": 0}).json()
        assert r["choices"][0]["token_ids"] == greedy(s, [5, 6, 7], 9)
    assert h_plain["cache_bytes_per_token"] == 2 * (2 * 2 * 8) * 4  # 2 layers x K and V of 2 heads x 8 x fp32
    assert h["cache_bytes_per_token"] == 2 * 8 * 4 and h["scheme"] == "Q-K-V (kv_latent=8), kv heads 2"
    assert (h_plain["capacity_tokens"], h["capacity_tokens"]) == (64_000 // (256 * 16) * 16, 64_000 // (64 * 16) * 16)
    assert h["capacity_tokens"] >= 4 * h_plain["capacity_tokens"]  # 4x the tokens, blocks rounded down


def test_stream_is_the_completion_in_pieces(server):
    body = {"prompt": "Hello", "max_tokens": 12, "temperature": 0, "stream_options": {"include_usage": True}}
    whole = server.post(body).json()["choices"][0]
    chunks = []
    with server.client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                chunks.append(line[6:])
    assert chunks[-1] == "[DONE]"
    parts = [json.loads(c) for c in chunks[:-1]]
    assert "".join(p["choices"][0]["text"] for p in parts if p["choices"]) == whole["text"]
    assert [t for p in parts if p["choices"] for t in p["choices"][0]["token_ids"]] == whole["token_ids"]
    assert parts[-2]["choices"][0]["finish_reason"] == "length" and parts[-1]["usage"]["completion_tokens"] == 12


def test_a_sampling_failure_ends_only_its_own_request(server):
    body = {"prompt": [1, 2, 3], "max_tokens": 4, "temperature": 1e-300}  # logits / temperature overflow
    failed = server.post(body)
    assert failed.status_code == 500 and failed.json()["error"]["type"] == "server_error"
    assert server.post({"prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0}).status_code == 200


def test_stop_string_cuts_the_text(server):
    full = server.post({"prompt": "Hello", "max_tokens": 12, "temperature": 0}).json()["choices"][0]["text"]
    stop = full[4:6]
    cut = server.post({"prompt": "Hello", "max_tokens": 12, "temperature": 0, "stop": [stop, "\x00never"]}).json()
    assert cut["choices"][0]["text"] == full[: full.index(stop)] and cut["choices"][0]["finish_reason"] == "stop"


def test_more_requests_than_rows_queue_and_all_are_exact(server):
    rng = random.Random(3)
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randint(1, 30))] for _ in range(8)]
    results = [None] * len(prompts)

    def ask(i):
        results[i] = server.post({"prompt": prompts[i], "max_tokens": 10, "temperature": 0}).json()

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT)
    for p, r in zip(prompts, results):
        assert "choices" in r, r
        assert r["choices"][0]["token_ids"] == greedy(server, p, 10)
    h = server.client.get("/health").json()
    assert h["peak_blocks_used"] <= h["blocks"] == 9 and h["blocks_used"] == 0


BAD = [
    (b'{"prompt": "Hello", "max_tokens": 5', 400, "malformed JSON"),
    (b"not json at all", 400, "malformed JSON"),
    (b"[1, 2]", 400, "JSON object"),
    (b'{"max_tokens": 5}', 400, "prompt"),
    (b'{"prompt": "Hello", "max_tokens": -3}', 400, "max_tokens"),
    (b'{"prompt": "Hello", "max_tokens": 10000000000}', 400, "max_tokens"),
    (b'{"prompt": "Hello", "max_tokens": "5"}', 400, "max_tokens"),
    (b'{"prompt": "Hello", "max_tokens": true}', 400, "max_tokens"),
    (b'{"prompt": "Hello", "temperature": "hot"}', 400, "temperature"),
    (b'{"prompt": "Hello", "temperature": -1}', 400, "temperature"),
    (b'{"prompt": "Hello", "top_p": 0}', 400, "top_p"),
    (b'{"prompt": "Hello", "stream": "yes"}', 400, "stream"),
    (b'{"prompt": "Hello", "stop": 7}', 400, "stop"),
    (b'{"prompt": "Hello", "seed": 1.5}', 400, "seed"),
    (b'{"prompt": "Hello", "seed": 100000000000000000000000}', 400, "seed"),
    (b'{"prompt": "Hello", "seed": -3}', 400, "seed"),  # torch would take it as 2**64 - 3: one seed, one spelling
    (b'{"prompt": "Hello", "n": 0}', 400, "n"),
    (b'{"prompt": "Hello", "n": 1000}', 400, "n"),
    (b'{"prompt": "Hello", "temperature": 5}', 400, "temperature"),  # OpenAI's range is [0, 2]
    (b'{"prompt": "Hello", "logprobs": 21}', 400, "logprobs"),
    (b'{"prompt": "Hello", "logprobs": true}', 400, "logprobs"),
    (b'{"prompt": "Hello", "best_of": 3}', 400, "best_of"),
    (b'{"prompt": "Hello", "guided_json": {}}', 400, "unknown field 'guided_json'"),  # a vLLM extension not here
    (b'{"prompt": "Hello", "stop_token_ids": [999]}', 400, "vocabulary"),
    (b'{"prompt": [[1, 2], []]}', 400, "empty prompt"),
    (b'{"prompt": "Hello", "frobnicate": 1}', 400, "frobnicate"),
    (b'{"prompt": [1, 2, 300]}', 400, "vocabulary"),
    (b'{"prompt": [1, 2.5]}', 400, "prompt"),
    (b'{"prompt": ""}', 400, "empty prompt"),
    (b'{"prompt": []}', 400, "empty prompt"),
    (json.dumps({"prompt": list(range(CONTEXT + 1))}).encode(), 400, "longer than the model's context"),
    (b'{"prompt": "Hello", "model": "gpt-4"}', 404, "gpt-4"),
]


@pytest.mark.parametrize("body,status,needle", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_input_is_a_4xx_json_error_and_the_next_request_is_served(server, body, status, needle):
    r = server.client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == status and needle in r.json()["error"]["message"], r.text
    ok = server.post({"prompt": [1, 2, 3], "max_tokens": 2, "temperature": 0})
    assert ok.status_code == 200 and ok.json()["choices"][0]["token_ids"] == greedy(server, [1, 2, 3], 2)


def test_a_100_mb_body_is_refused_and_the_server_lives_on(server):
    big = b'{"prompt": "' + b"a" * (100 * 2**20) + b'"}'
    r = server.client.post("/v1/completions", content=big)
    assert r.status_code == 413 and "exceeds the limit" in r.json()["error"]["message"]
    chunked = server.client.post(
        "/v1/completions", content=iter([big[i : i + 2**20] for i in range(0, len(big), 2**20)])
    )
    assert chunked.status_code == 413
    assert server.post({"prompt": [4], "max_tokens": 1}).status_code == 200
    assert server.client.get("/nowhere").json()["error"]["message"] == "Not Found"


def test_text_prompt_without_a_tokenizer_is_refused(model_dir):
    with Running(model_dir, tokenizer=None) as s:
        r = s.post({"prompt": "Hello"})
        assert r.status_code == 400 and "list of token ids" in r.json()["error"]["message"]
        assert s.post({"prompt": [1, 2], "max_tokens": 3}).json()["choices"][0]["text"].count(" ") == 3


def test_a_disconnecting_stream_frees_its_row_at_the_next_step(model_dir):
    with Running(model_dir, engine_thread=False) as s:
        body = {"prompt": [1, 2, 3], "max_tokens": 30, "temperature": 0, "stream": True}
        with s.client.stream("POST", "/v1/completions", json=body) as r:
            wait_for(lambda: s.engine.stats()["queued"] == 1, "the request to queue")
            s.engine.step()
            assert s.engine.stats()["active"] == 1
            next(r.iter_lines())  # the first token arrived; now the client goes away
        wait_for(lambda: s.engine.scheduler.running[0].cancel_reason is not None, "the server to notice the disconnect")
        s.engine.step()
        assert s.engine.stats()["active"] == 0 and s.engine.stats()["requests_finished"] == 1


def test_a_client_that_gives_up_waiting_leaves_the_queue(model_dir):
    with Running(model_dir, engine_thread=False) as s:  # nothing steps: the request can only wait
        with pytest.raises(httpx.ReadTimeout):
            s.client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 3}, timeout=0.5)
        wait_for(lambda: s.engine.stats()["queued"] == 0, "the server to notice the disconnect")
        s.engine.step()
        assert s.engine.stats()["requests_finished"] == 0 and s.engine.stats()["tokens_generated"] == 0


def test_drain_finishes_running_requests_and_refuses_new_ones(model_dir):
    with Running(model_dir, engine_thread=False) as s:
        out = {}

        def ask():
            out["r"] = s.post({"prompt": [1, 2, 3], "max_tokens": 6, "temperature": 0})

        t = threading.Thread(target=ask)
        t.start()
        wait_for(lambda: s.engine.stats()["queued"] == 1, "the request to queue")
        s.engine.step()
        drain = s.server.begin_drain("test")  # what SIGTERM calls
        late = s.post({"prompt": [1], "max_tokens": 2})
        assert late.status_code == 503 and "shutting down" in late.json()["error"]["message"]
        assert s.client.get("/health").status_code == 503
        while not s.engine.idle():
            s.engine.step()
        t.join(WAIT)
        assert out["r"].json()["choices"][0]["token_ids"] == greedy(s, [1, 2, 3], 6)
        drain.join(WAIT)
        s.thread.join(WAIT)
        assert not s.thread.is_alive()  # the drain stopped the server


def test_sigterm_drains_a_real_server_process(model_dir, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "qkvlab", "serve", str(model_dir), "--port", "0", "--cache-memory", "40KB"]
    # the cache's size below is fp32's in blocks of 16, whatever this machine's defaults and timed decisions
    cmd += ["--dtype", "fp32", "--block-size", "16"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert "capacity 3 sequences" in line and "Q-K=V" in line and "http://127.0.0.1:" in line, line
        assert "KV cache size: 144 tokens" in line and "maximum concurrency 3.60x" in line, line  # 9 blocks of 16
        url = line.split()[2].removesuffix("/v1")
        with httpx.Client(base_url=url, timeout=WAIT) as client:
            assert client.get("/health").json()["capacity_sequences"] == 3
            body = {"prompt": [1, 2, 3], "max_tokens": CONTEXT - 3, "temperature": 0, "stream": True}
            with client.stream("POST", "/v1/completions", json=body) as r:
                lines = r.iter_lines()
                next(lines)
                proc.send_signal(signal.SIGTERM)
                rest = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
            assert rest[-1]["choices"][0]["finish_reason"] == "length"  # the running request finished
        assert proc.wait(WAIT) == 0
        assert "draining" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_auto_serves_in_the_dtype_the_probe_chose(model_dir, decode_probe_bf16):
    """--dtype auto on the CPU: weights and cache in the decode probe's dtype (timed at one row and at
    the rows served together, at most 16), its figures in /health; fp32 asks no probe."""
    calls = decode_probe_bf16
    lines = []
    cfg = ServeConfig(model=str(model_dir), cache_memory="40KB", tokenizer="bytes", device="cpu", max_batch=4)
    built = build(cfg, load_served(cfg), log=lines.append)
    assert calls == [(1, 4)] and built.dtype == "bf16" and built.dtype_probe.dtype == "bf16"
    assert next(built.engine.model.parameters()).dtype == torch.bfloat16
    assert built.served.cache_bytes_per_token == 2 * 32 * 2  # Q-K=V: 2 layers x d_model x bf16
    assert lines[0].startswith("qkvlab serve: dtype auto -> bf16: bf16 weights 2.00x"), lines
    assert lines[1:] == [] or "compiled the paged read" in lines[1]
    with Running(model_dir, device="cpu", dtype="auto") as s:  # no --max-batch: probed at 1 and 16 rows
        h = s.client.get("/health").json()
        assert h["dtype"] == "bf16" and h["dtype_probe"]["step"] == "decode" and h["dtype_probe"]["bf16_ms"] == 1.0
        assert h["decode_layouts"] is None and "(the default)" in h["decode_layout"]  # timed only for real models
        assert h["paged_read"] == "in place" and h["compiled"] is False
        r = s.post({"prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0})
        assert r.json()["choices"][0]["token_ids"] == greedy(s, [1, 2, 3], 4)
    assert calls[-1] == (1, 16)
    cfg = ServeConfig(model=str(model_dir), cache_memory="40KB", tokenizer="bytes", device="cpu", dtype="fp32")
    fp32 = build(cfg, load_served(cfg))
    assert len(calls) == 2 and fp32.dtype == "fp32" and fp32.dtype_probe is None
    assert next(fp32.engine.model.parameters()).dtype == torch.float32


def test_cli_refusals_are_one_line(model_dir, tmp_path, capsys):
    cases = [
        ([str(tmp_path / "missing")], "no such file or folder"),
        ([str(model_dir), "--cache-memory", "1KB"], "holds no sequence"),
        ([str(model_dir), "--cache-memory", "lots"], "--cache-memory"),
        ([str(model_dir), "--port", "70000"], "--port"),
        ([str(model_dir), "--max-batch", "0"], "--max-batch"),
        ([str(model_dir), "--chat-template", str(tmp_path / "none.jinja")], "--chat-template"),
        ([str(model_dir), "--max-model-len", str(CONTEXT + 1)], "exceeds the model's context"),
        ([str(model_dir), "--block-size", "0"], "--block-size"),
        ([str(model_dir), "--compile", "reduce-overhead"], "needs fixed shapes"),
        ([str(model_dir), "--compile", "fast"], "--compile"),
    ]
    for argv, needle in cases:
        assert main(["serve", *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert needle in err and len(err.splitlines()) == 1, err
    assert main(["serve", str(model_dir), "--print-config", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["cache_memory"] == "1GiB"


# ---- n, logprobs, echo, prompt lists (the engine, then HTTP) ------------------------------------
def test_n_choices_share_the_prompts_blocks_and_each_is_exact():
    """n choices are n sequences (vLLM's parallel sampling): the prompt's full blocks are computed once,
    by the first, and found in the prefix cache by the others, which compute only the tail."""
    model = tiny_model("Q-K=V", "rope", 1)
    prompt = tuple(range(3, 3 + 37))  # two full blocks of 16 and a tail of 5
    s = Sampling(temperature=0.9, top_k=20)
    engine = Engine(model, rows=4, block_size=16)
    scheduled = []  # the tokens each sequence computes at each step
    schedule = engine.scheduler.schedule
    engine.scheduler.schedule = lambda: [scheduled.append(w.count) or w for w in schedule()]
    events: list[Event] = []
    seqs = engine.submit_all(Request(prompt, 3, s, seed=5, n=3), events.append)
    engine.step()
    assert [q.index for q in seqs] == [0, 1, 2]
    stats = engine.stats()
    assert stats["prefix_cache_queries"] == 3 * 37 and stats["prefix_cache_hits"] == 2 * 2 * 16
    assert scheduled == [37, 5, 5]  # the prompt once, then two tails in the same step
    assert seqs[1].table[:2] == seqs[2].table[:2] == seqs[0].table[:2]  # its full blocks, shared
    while not engine.idle():
        engine.step()
    got = {i: [e.token for e in events if e.index == i and e.token is not None] for i in range(3)}
    for i in range(3):  # choice i is seeded seed + i: choice 0 is what n=1 gives
        assert got[i] == generate(model, [list(prompt)], 3, s, seed=5 + i)[0]
    assert len({tuple(v) for v in got.values()}) == 3


def test_logprobs_are_the_models_log_softmax_and_the_prompts_too():
    model = tiny_model("Q-K-V", "learned", 2)
    prompt = (7, 8, 9, 10)
    engine = Engine(model, rows=2, vocab_limit=256)
    events: list[Event] = []
    engine.submit(Request(prompt, 5, logprobs=3, prompt_logprobs=2), events.append)
    engine.submit(Request((1, 2), 4), [].append)  # a neighbour without logprobs
    while not engine.idle():
        engine.step()
    toks = [e.token for e in events if e.token is not None]
    assert toks == generate(model, [list(prompt)], 5, Sampling(temperature=0.0), vocab_limit=256)[0]
    full = torch.tensor([[*prompt, *toks]])
    with torch.no_grad():
        lp = model(full)[0][0, :, :256].log_softmax(-1)  # (T, 256): after each token
    for k, e in enumerate(e for e in events if e.token is not None):
        pos = len(prompt) - 1 + k
        assert abs(e.logprob - lp[pos, e.token].item()) < 1e-9
        assert [t for t, _ in e.top] == lp[pos].topk(3).indices.tolist() and e.top[0][0] == e.token  # greedy = top 1
    first = next(e for e in events if e.token is not None)
    assert first.prompt[0] == (None, None) and len(first.prompt) == len(prompt)
    for i in range(1, len(prompt)):
        assert abs(first.prompt[i][0] - lp[i - 1, prompt[i]].item()) < 1e-9 and len(first.prompt[i][1]) == 2


def test_max_model_len_bounds_sequences_and_generation_stays_exact():
    model = tiny_model()
    engine = Engine(model, rows=2, context=12, block_size=16)  # two whole 12-token sequences: one block of 16 each
    assert engine.kv.blocks == 2 and engine.stats()["capacity_tokens"] == 32
    with pytest.raises(UserError, match="longer than the model's context of 12"):
        engine.submit(Request(tuple(range(13)), 3), [].append)
    got: list[Event] = []
    engine.submit(Request(tuple(range(1, 10)), 20), got.append)  # 9 + 4 = 13: the context ends after 4
    while not engine.idle():
        engine.step()
    assert tokens(got) == generate(model, [list(range(1, 10))], 4, Sampling(temperature=0.0))[0]
    assert got[-1].finish == "length"
    with pytest.raises(UserError, match="max_model_len"):
        Engine(model, rows=1, context=CONTEXT + 1)


def test_n_echo_logprobs_and_prompt_lists_over_http(server):
    prompts = [[5, 6, 7], [40, 41]]
    r = server.post({"prompt": prompts, "n": 2, "max_tokens": 4, "temperature": 0, "logprobs": 2, "echo": True})
    body = r.json()
    assert r.status_code == 200 and [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 16, "total_tokens": 21}
    tok = server.built.served.tokenizer
    for c in body["choices"]:
        prompt = prompts[c["index"] // 2]
        assert c["token_ids"] == greedy(server, prompt, 4)
        assert c["text"] == tok.decode(prompt) + tok.decode(c["token_ids"])  # echo: the prompt, then the output
        lp = c["logprobs"]
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(prompt) + 4
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert all(len(t) <= 2 for t in lp["top_logprobs"][1:]) and lp["text_offset"][0] == 0
        gen = lp["token_logprobs"][len(prompt) :]
        assert all(x <= 0 for x in gen) and max(lp["top_logprobs"][-1].values()) == gen[-1]  # greedy: the top one
    stream = []
    body = {"prompt": [5, 6, 7], "n": 2, "max_tokens": 3, "temperature": 0, "stream": True, "logprobs": 1}
    with server.client.stream("POST", "/v1/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                stream.append(json.loads(line[6:]))
    for i in (0, 1):
        mine = [p["choices"][0] for p in stream if p["choices"][0]["index"] == i]
        assert [t for c in mine for t in c["token_ids"]] == greedy(server, [5, 6, 7], 3)
        assert [c["finish_reason"] for c in mine][-1] == "length"
        assert all(len(c["logprobs"]["tokens"]) == 1 for c in mine if c["token_ids"])


def test_models_by_id_and_metrics(server):
    assert server.client.get("/v1/models/tiny").json()["max_model_len"] == CONTEXT
    r = server.client.get("/v1/models/gpt-4")
    assert r.status_code == 404 and "gpt-4" in r.json()["error"]["message"]
    server.post({"prompt": [1, 2, 3], "max_tokens": 5, "temperature": 0})
    from prometheus_client.parser import text_string_to_metric_families

    r = server.client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    fams = {f.name: f for f in text_string_to_metric_families(r.text)}
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:time_to_first_token_seconds",
        "vllm:inter_token_latency_seconds",
        "vllm:time_per_output_token_seconds",
        "vllm:request_time_per_output_token_seconds",
        "vllm:e2e_request_latency_seconds",
        "vllm:num_preemptions",
        "vllm:generation_tokens",
    ):
        assert name in fams, name
    value = lambda fam, suffix: sum(s.value for s in fams[fam].samples if s.name == fam + suffix)  # noqa: E731
    h = server.client.get("/health").json()
    assert value("vllm:e2e_request_latency_seconds", "_count") == h["requests_finished"] >= 1
    assert value("vllm:num_preemptions", "_total") == h["preemptions"] and value("vllm:num_requests_running", "") == 0
    assert value("vllm:generation_tokens", "_total") == h["tokens_generated"]
    assert value("vllm:kv_cache_usage_perc", "") == 0  # every block back
    gauges = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")
    assert all([s.labels for s in fams[g].samples] == [{"model_name": "tiny"}] for g in gauges)  # read, not absent


def test_tokenize_detokenize_as_vllm(server):
    r = server.client.post("/tokenize", json={"prompt": "Hé", "return_token_strs": True}).json()
    assert r["tokens"] == list("Hé".encode()) and r["count"] == 3 and r["max_model_len"] == CONTEXT
    assert server.client.post("/detokenize", json={"tokens": r["tokens"]}).json() == {"prompt": "Hé"}
    bad = server.client.post("/detokenize", json={"tokens": [1, 5000]})
    assert bad.status_code == 400 and "vocabulary" in bad.json()["error"]["message"]
    no_chat = server.client.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]})
    assert no_chat.status_code == 400 and "chat template" in no_chat.json()["error"]["message"]
    r = server.client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and "chat template" in r.json()["error"]["message"]


def test_tokenizing_runs_off_the_event_loop(model_dir):
    with Running(model_dir) as s:
        tok = s.built.served.tokenizer
        fast = tok.encode

        def slow(text, add_special_tokens=True):  # a tokenizer busy for 3 s (holding no lock the loop needs)
            time.sleep(3.0)
            return fast(text, add_special_tokens)

        tok.encode = slow
        out = {}
        t = threading.Thread(target=lambda: out.update(r=s.post({"prompt": "x" * 3_900_000, "max_tokens": 1})))
        t.start()
        time.sleep(0.5)  # the big request is being tokenized
        t0 = time.monotonic()
        assert s.client.get("/health").status_code == 200
        assert time.monotonic() - t0 < 1.0  # answered while the tokenizer was busy
        t.join(WAIT)
        assert out["r"].status_code == 400 and "longer than the model's context" in out["r"].json()["error"]["message"]


def test_disconnecting_n_choices_frees_all_their_rows(model_dir):
    with Running(model_dir, engine_thread=False) as s:
        body = {"prompt": [1, 2, 3], "max_tokens": 30, "temperature": 0, "stream": True, "n": 3}
        with s.client.stream("POST", "/v1/completions", json=body) as r:
            wait_for(lambda: s.engine.stats()["queued"] == 3, "the request to queue")
            s.engine.step()
            assert s.engine.stats()["active"] == 3
            next(r.iter_lines())
        wait_for(lambda: all(q.cancel_reason is not None for q in s.engine.scheduler.running), "the disconnect")
        s.engine.step()
        assert s.engine.stats()["active"] == 0 and s.engine.stats()["requests_finished"] == 3


# ---- a model with a transformers tokenizer and a chat template ------------------------------------
CHAT_CONTEXT = 96  # a templated prompt is longer than the tiny models' context
CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def hf_tokenizer_files(folder):
    """A byte-level transformers tokenizer (3 special tokens + 256 bytes = 259 ids) with a ChatML
    template, written as `convert --from-hf` writes one into a qkvlab folder's tokenizer/."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=259, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(["hello world"], trainer=trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|im_start|>")
    hf.chat_template = CHATML
    hf.save_pretrained(folder)
    return hf


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    pytest.importorskip("transformers")
    folder = tmp_path_factory.mktemp("serve") / "chat"
    model = tiny_model("Q-K=V", "rope", None, CHAT_CONTEXT, torch.float32, norm="rmsnorm", mlp="swiglu")  # Llama's
    save_model(folder, model, model.cfg)
    hf_tokenizer_files(folder / "tokenizer")
    return folder


@pytest.fixture(scope="module")
def chat_server(chat_dir):
    with Running(chat_dir, tokenizer=None, name="chat", cache_memory="100KB") as s:
        yield s


def chat_ids(text: str) -> list[int]:
    return [int(t) for t in text]


def test_chat_renders_the_tokenizers_template_and_is_exact(chat_server):
    s = chat_server
    tok = s.built.served.tokenizer
    assert tok.stop_ids == {2} and s.client.get("/v1/models").json()["data"][0]["chat_template"] == CHATML
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi <|im_end|>"}]
    rendered = tok.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tok.tok(rendered, add_special_tokens=False)["input_ids"]
    assert ids.count(1) == 3 and ids.count(2) == 3  # <|im_start|> and <|im_end|> are single tokens, even in text
    t = s.client.post("/tokenize", json={"messages": messages}).json()
    assert t["tokens"] == ids
    body = {"messages": messages, "max_tokens": 8, "temperature": 0, "logprobs": True, "top_logprobs": 2}
    r = s.client.post("/v1/chat/completions", json=body).json()
    choice = r["choices"][0]
    alone = generate(s.engine.model, [ids], 8, Sampling(temperature=0.0), vocab_limit=259, eot_id=2)[0]
    assert r["object"] == "chat.completion" and choice["message"]["role"] == "assistant"
    assert choice["token_ids"] == alone and choice["message"]["content"] == tok.decode(alone)
    assert r["usage"]["prompt_tokens"] == len(ids)
    content = choice["logprobs"]["content"]
    assert len(content) == len(alone) and all(len(c["top_logprobs"]) == 2 for c in content)
    assert all(c["top_logprobs"][0]["token"] == c["token"] for c in content)  # greedy: the most probable
    pieces, usage = [], None
    with s.client.stream(
        "POST", "/v1/chat/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}}
    ) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                assert chunk["object"] == "chat.completion.chunk"
                if chunk["choices"]:
                    pieces.append(chunk["choices"][0])
                else:
                    usage = chunk["usage"]
    assert pieces[0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(p["delta"].get("content", "") for p in pieces) == choice["message"]["content"]
    assert pieces[-1]["finish_reason"] == choice["finish_reason"] and usage == r["usage"]


def test_chat_stops_at_the_end_of_turn_token(chat_server):
    s = chat_server
    messages = [{"role": "user", "content": "hello"}]
    free = s.client.post(
        "/v1/chat/completions", json={"messages": messages, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    ).json()["choices"][0]
    stop_at = free["token_ids"][3]  # a token the model does produce: made an end of turn for this request
    r = s.client.post(
        "/v1/chat/completions",
        json={"messages": messages, "max_tokens": 12, "temperature": 0, "stop_token_ids": [stop_at]},
    ).json()["choices"][0]
    assert r["token_ids"] == free["token_ids"][: free["token_ids"].index(stop_at)] and r["finish_reason"] == "stop"
    bad = s.client.post("/v1/chat/completions", json={"messages": [], "max_tokens": 2})
    assert bad.status_code == 400 and "messages" in bad.json()["error"]["message"]
    bad = s.client.post("/v1/chat/completions", json={"messages": [{"role": "robot", "content": "x"}]})
    assert bad.status_code == 400 and "role" in bad.json()["error"]["message"]
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    bad = s.client.post("/v1/chat/completions", json={"messages": image})
    assert bad.status_code == 400 and "text parts" in bad.json()["error"]["message"]
    bad = s.client.post("/v1/chat/completions", json={"messages": messages, "tools": [{"type": "function"}]})
    assert bad.status_code == 400 and "no tool calling" in bad.json()["error"]["message"]
    bad = s.client.post("/v1/chat/completions", json={"messages": messages, "temperature": 2.5})
    assert bad.status_code == 400 and "temperature" in bad.json()["error"]["message"]
    assert s.client.get("/health").json()["status"] == "ok"


def test_the_openai_client_chats_and_reads_logprobs(chat_server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=chat_server.url + "/v1", api_key="unused", max_retries=0)
    assert client.models.retrieve("chat").id == "chat"
    out = client.chat.completions.create(
        model="chat", messages=[{"role": "user", "content": "hi"}], max_tokens=6, temperature=0, logprobs=True,
        top_logprobs=3, n=2,
    )  # fmt: skip
    assert len(out.choices) == 2 and out.choices[0].message.content == out.choices[1].message.content
    assert len(out.choices[0].logprobs.content[0].top_logprobs) == 3
    text = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(
            model="chat", messages=[{"role": "user", "content": "hi"}], max_tokens=6, temperature=0, stream=True
        )
        if c.choices
    )
    assert text == out.choices[0].message.content
    comp = client.completions.create(model="chat", prompt=["ab", "cd"], max_tokens=3, temperature=0, logprobs=2)
    assert [c.index for c in comp.choices] == [0, 1] and len(comp.choices[0].logprobs.tokens) == 3
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="chat", prompt="ab", temperature=5)


def test_chat_template_option_gives_a_qkvlab_tokenizer_a_chat_endpoint(model_dir, tmp_path):
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }};{% endfor %}a:")
    with Running(model_dir, chat_template=str(template)) as s:  # the bytes tokenizer
        assert s.client.get("/v1/models/tiny").json()["chat_template"] == template.read_text()
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "temperature": 0}
        r = s.client.post("/v1/chat/completions", json=body).json()
        assert r["choices"][0]["token_ids"] == greedy(s, list(b"u:hi;a:"), 5)


def test_convert_carries_the_tokenizer_both_ways(chat_dir, tmp_path, capsys):
    """qkvlab folder (transformers tokenizer in tokenizer/) -> --to-hf llama (tokenizer files in OUT)
    -> serve the HF folder -> --from-hf back (tokenizer/ again): the template and ids survive."""
    from transformers import AutoTokenizer

    hf_out, back = tmp_path / "hf", tmp_path / "back"
    assert main(["convert", str(chat_dir), str(hf_out), "--to-hf", "llama"]) == 0
    tok = AutoTokenizer.from_pretrained(hf_out)
    assert tok.chat_template == CHATML and tok.eos_token == "<|im_end|>"
    assert main(["convert", "--from-hf", str(hf_out), str(back)]) == 0
    capsys.readouterr()
    from qkvlab.convert.load import load_any

    loaded = load_any(back)
    assert loaded.tokenizer.chat_template == CHATML and loaded.tokenizer_dir == back / "tokenizer"
    with Running(hf_out, tokenizer=None, name="hf", cache_memory="100KB") as s:  # an HF folder, served as it is
        r = s.client.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "temperature": 0},
        )
        ids = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
        ids = tok(ids, add_special_tokens=False)["input_ids"]
        model = load_any(chat_dir).model
        assert (
            r.json()["choices"][0]["token_ids"]
            == generate(model, [ids], 5, Sampling(temperature=0.0), vocab_limit=259, eot_id=2)[0]
        )
