"""The engine's rooms: chunked prefill, prefix caching (hits, sharing, LRU eviction), the paged read for
every scheme family (the key/value latent and MLA too; decode steps read their blocks in place, the
compiled read equal to SDPA over the gathered keys in float64), penalties; the HTTP edges (vLLM's length
rule, missing fields, chat content, usage, 413 answered, tokenizing off the event loop)."""

from __future__ import annotations

import random
import threading
import time
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from qkvlab.decode.generate import generate  # noqa: E402
from qkvlab.decode.sampling import Sampling  # noqa: E402
from qkvlab.model.positions import apply_rotary  # noqa: E402
from qkvlab.serve.decoding import runner_decoding  # noqa: E402
from qkvlab.serve.engine import Engine  # noqa: E402
from qkvlab.serve.kv_cache_manager import KVCacheManager  # noqa: E402
from qkvlab.serve.paged import PagedStep  # noqa: E402
from qkvlab.serve.paged_attention import decode_attention, read  # noqa: E402
from qkvlab.serve.request import Event, Request, Sequence  # noqa: E402
from qkvlab.serve.runner import ModelRunner  # noqa: E402
from qkvlab.serve.sampler import Sampler  # noqa: E402
from qkvlab.serve.scheduler import Work  # noqa: E402
from test_serve import CONTEXT, FAMILIES, VOCAB, Running, model_dir, one_thread, tiny_model, tokens  # noqa: E402, F401

GREEDY = Sampling(temperature=0.0)
MLA = {"kv_latent": 12, "rope_dim": 8, "norm": "rmsnorm", "mlp": "swiglu"}  # DeepSeek's layout, tiny
LAYOUTS = [(*f, {}) for f in FAMILIES] + [  # every family, the key/value latent (RoPE and learned), MLA
    ("Q-K-V", "rope", 2, {"kv_latent": 8}),
    ("Q-K-V", "learned", 2, {"kv_latent": 8}),
    ("Q-K-V", "rope", 2, MLA),
    ("Q-K-V", "rope", None, MLA),
]


def drive(engine: Engine, requests: list[Request], join_every: int = 3) -> dict[int, list[Event]]:
    events: dict[int, list] = {i: [] for i in range(len(requests))}
    nxt, step = 0, 0
    while nxt < len(requests) or not engine.idle():
        if nxt < len(requests) and step % join_every == 0:
            engine.submit(requests[nxt], events[nxt].append)
            nxt += 1
        engine.step()
        step += 1
        assert step < 2000
    return events


@pytest.mark.parametrize("scheme,pos,kv,more", LAYOUTS, ids=str)
def test_chunked_prefill_and_shared_prefixes_give_each_request_its_tokens_alone(scheme, pos, kv, more):
    """A budget of 7 tokens a step (prompts in chunks, beside decodes), prompts sharing prefixes of whole
    blocks (found in the prefix cache), every scheme family, the key/value latent and MLA: greedy tokens
    equal generate's alone, decode steps read their blocks in place wherever the layout allows (all but
    the "+" term and a latent whose keys rotate on read, which gather), and there steps with chunks run
    packed in one row."""
    model = tiny_model(scheme, pos, kv, **more)
    rng = random.Random(11)
    stem = tuple(rng.randrange(VOCAB) for _ in range(20))
    requests = [Request(stem[: rng.choice((8, 16, 20))] + tuple(rng.randrange(VOCAB) for _ in range(rng.randint(1, 12))), rng.randint(1, 8)) for _ in range(8)]  # fmt: skip
    engine = Engine(model, rows=3, block_size=4, token_budget=7)
    in_place = "+" not in scheme and not (more.get("kv_latent") and pos == "rope" and "rope_dim" not in more)
    assert engine.choices.paged_read == ("in place" if in_place else "gather")
    steps, packed = [], []
    decode_batch, run_packed = engine.runner.decode_batch, engine.runner.packed
    engine.runner.decode_batch = lambda segments: steps.append(decode_batch(segments)) or steps[-1]
    engine.runner.packed = lambda work, every: packed.append(len(work)) or run_packed(work, every)
    events = drive(engine, requests)
    assert steps and all(isinstance(b, PagedStep) == in_place for b in steps)
    assert bool(packed) == in_place and (not in_place or max(packed) > 1)  # chunks beside decodes, one row
    for req, ev in zip(requests, events.values()):
        assert tokens(ev) == generate(model, [list(req.prompt)], req.max_tokens, GREEDY)[0]
    stats = engine.stats()
    assert stats["prefix_cache_hits"] > 0 and stats["blocks_used"] == 0


def gathered_attention(q, k_pool, v_pool, tables, lengths, scale, block_size, rope=None, v_width=None):
    """The same attention over each row's keys and values gathered into dense tensors, through SDPA."""
    out = []
    for b in range(q.shape[0]):
        cols = torch.arange(int(lengths[b]))
        slots = tables[b][cols // block_size] * block_size + cols % block_size
        k, v = k_pool[slots].transpose(0, 1)[None], v_pool[slots].transpose(0, 1)[None]  # (1, hk, S, w)
        if rope is not None:
            k = apply_rotary(k, rope[0][cols], rope[1][cols])
        v = v if v_width is None else v[..., :v_width]
        out.append(torch.nn.functional.scaled_dot_product_attention(q[b : b + 1], k, v, scale=scale))
    return torch.cat(out)  # (B, hk, g, wv): a group's queries as SDPA's query rows


@pytest.mark.parametrize("rows,hk,g,width,rotate,v_width", [(1, 2, 2, 8, False, None), (5, 1, 4, 8, True, None), (3, 3, 1, 12, True, None), (4, 1, 6, 20, False, 12), (2, 4, 2, 6, False, None)])  # fmt: skip
def test_the_compiled_read_equals_sdpa_over_the_gathered_keys(rows, hk, g, width, rotate, v_width):
    """The in-place read (compiled, as served) against SDPA over each row's keys gathered, in float64:
    random pools and tables of several shapes, lengths anywhere in their last block (a row of one key
    too), keys rotated on read at their positions, MLA's values as the rows' first numbers."""
    gen = torch.Generator().manual_seed(rows * 7 + hk)
    bs, blocks = 4, 40
    k_pool = torch.randn(blocks * bs, hk, width, generator=gen, dtype=torch.float64)
    v_pool = k_pool if v_width is not None or rotate else torch.randn(blocks * bs, hk, width, generator=gen, dtype=torch.float64)  # fmt: skip
    n = 1 + rows
    tables = torch.stack([torch.randperm(blocks, generator=gen)[:n] for _ in range(rows)])
    lengths = torch.randint(1, n * bs + 1, (rows,), generator=gen)
    lengths[0] = 1
    q = torch.randn(rows, hk, g, width, generator=gen, dtype=torch.float64)
    rope = None
    if rotate:
        angles = torch.arange(n * bs, dtype=torch.float64)[:, None] * torch.rand(width // 2, generator=gen, dtype=torch.float64)  # fmt: skip
        rope = (torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin())
    want = gathered_attention(q, k_pool, v_pool, tables, lengths, 0.3, bs, rope, v_width)
    with torch.inference_mode():
        got = read(q, k_pool, v_pool, tables, lengths, 0.3, bs, *(rope or (None, None)), v_width)
        k_blocks, v_blocks = k_pool.view(blocks, bs, hk, width), v_pool.view(blocks, bs, hk, width)
        eager = decode_attention(q, k_blocks, v_blocks, tables, lengths, 0.3, *(rope or (None, None)), v_width)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    torch.testing.assert_close(eager, want, rtol=0, atol=1e-12)


def test_one_compiled_read_serves_every_block_size_and_pool():
    """The block size, the pool's blocks and the query's strides are not baked into the compiled read: after
    the first call, pools of other block sizes and lengths (blocks of one slot too) and a query that is a
    strided view (as a packed step's decodes pass it) compile nothing new, and each read equals SDPA over
    the gathered keys, in float64."""
    gen = torch.Generator().manual_seed(11)
    hk, g, width = 2, 3, 10  # a shape no other test compiles
    graphs = []
    for bs, blocks, rows, strided in ((4, 30, 3, False), (16, 12, 2, True), (1, 90, 4, False), (64, 3, 1, True)):
        with torch.inference_mode():  # as the engine calls it: every tensor an inference tensor
            k_pool, v_pool = torch.randn(2, blocks * bs, hk, width, generator=gen, dtype=torch.float64).unbind(0)
            n = blocks // rows
            tables = torch.randperm(blocks, generator=gen)[: rows * n].view(rows, n)
            lengths = torch.randint(1, n * bs + 1, (rows,), generator=gen)
            q = torch.randn(rows, hk, g, width, generator=gen, dtype=torch.float64)
            if strided:  # the same values laid out heads-first, as a packed row's projections leave them
                q = q.permute(1, 2, 0, 3).contiguous().permute(2, 0, 1, 3)
            want = gathered_attention(q, k_pool, v_pool, tables, lengths, 0.3, bs)
            got = read(q, k_pool, v_pool, tables, lengths, 0.3, bs)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
        graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    assert graphs[1:] == graphs[:1] * 3, graphs


@pytest.mark.parametrize("scheme,pos,kv,more", [x for x in LAYOUTS if "+" not in x[0] and not (x[3].get("kv_latent") and x[1] == "rope" and "rope_dim" not in x[3])], ids=str)  # fmt: skip
def test_a_packed_step_of_decodes_and_chunks_equals_the_forward_without_a_cache(scheme, pos, kv, more):
    """One row of a decode and two prefill chunks (one continuing a cached prefix, one new), in float64:
    every token's logits equal the model's on each sequence alone, without a cache, to 1e-10."""
    model = tiny_model(scheme, pos, kv, **more)
    runner = ModelRunner(model, blocks=12, block_size=4, choices=runner_decoding(model))
    rng = random.Random(3)
    seqs = [SimpleNamespace(tokens=[rng.randrange(VOCAB) for _ in range(n)], table=t) for n, t in ((10, [0, 1, 2]), (13, [3, 4, 5, 6]), (4, [7, 8]))]  # fmt: skip
    with torch.inference_mode():
        runner.execute([Work(seqs[0], 0, 9), Work(seqs[1], 0, 5)], set())  # the cached parts
        _, every = runner.execute([Work(seqs[0], 9, 1), Work(seqs[1], 5, 8), Work(seqs[2], 0, 4)], {0, 1, 2})
        for i, (seq, start) in enumerate(zip(seqs, (9, 5, 0))):
            alone = model(torch.tensor([seq.tokens]))[0][0, start:]
            torch.testing.assert_close(every[i], alone, rtol=0, atol=1e-10)


def test_a_long_prompt_is_prefilled_in_chunks_while_a_stream_keeps_decoding():
    model = tiny_model("Q-K-V", "rope", 2, context=96)
    engine = Engine(model, rows=2, token_budget=9)
    streaming, long = [], []
    engine.submit(Request((1, 2, 3), 40), streaming.append)
    engine.step()
    engine.submit(Request(tuple(range(5, 85)), 3), long.append)
    steps = 0
    while not long:
        before = len(streaming)
        engine.step()
        steps += 1
        assert len(streaming) == before + 1  # a token every step while the 80-token prompt is prefilled
    assert steps == 10  # 80 tokens, 8 a step beside the decode
    while not engine.idle():
        engine.step()
    assert tokens(long) == generate(model, [list(range(5, 85))], 3, GREEDY)[0]
    assert tokens(streaming) == generate(model, [[1, 2, 3]], 40, GREEDY)[0]


def test_prefix_blocks_are_shared_by_count_and_evicted_least_recently_freed_first():
    kv = KVCacheManager(blocks=4, block_size=2)
    a = Sequence(0, Request((1, 2, 3, 4, 5), 1), 0, print, 1, frozenset(), "cpu")
    keys = a.block_keys(2)
    assert len(keys) == 2 and kv.lookup(keys, 5) == []
    a.table = kv.take(3)
    kv.register(a.table, keys, 0)
    b = Sequence(1, Request((1, 2, 3, 4, 9), 1), 0, print, 1, frozenset(), "cpu")
    hits = kv.lookup(b.block_keys(2), 5)
    assert hits == a.table[:2]  # both full blocks: tokens 1-4
    kv.share(hits)
    assert kv.refs[hits[0]] == 2
    held = list(a.table)
    kv.release(a.table)
    assert kv.used == 2 and kv.lookup(keys, 5) == held[:2]  # b still holds them
    kv.release(hits)
    assert kv.used == 0 and kv.lookup(keys, 5) == held[:2]  # free, still cached
    kv.take(3)  # least recently freed first: the never-used block, the tail, then the last full block
    assert kv.lookup(keys, 5) == held[:1]
    c = Sequence(2, Request((1, 2), 1), 0, print, 1, frozenset(), "cpu")
    assert kv.lookup(c.block_keys(2), 2) == []  # one token is always computed


def test_penalties_are_subtracted_from_the_produced_tokens_logits():
    seq = Sequence(0, Request((1,), 3, presence_penalty=0.5, frequency_penalty=0.25), 0, print, 3, frozenset(), "cpu")
    seq.counts = {3: 2, 5: 1}
    logits = torch.zeros(1, 8, dtype=torch.float64)
    out = Sampler.penalize(logits, seq)
    assert out[0, 3] == -(0.5 + 0.5) and out[0, 5] == -(0.5 + 0.25) and out[0, 0] == 0 and logits.abs().sum() == 0


# ---- HTTP edges ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(model_dir):  # noqa: F811
    with Running(model_dir) as s:
        yield s


def test_prompt_and_max_tokens_past_the_context_are_refused_naming_both(server):
    r = server.post({"prompt": [1, 2, 3], "max_tokens": CONTEXT - 2})
    msg = r.json()["error"]["message"]
    assert r.status_code == 400 and f"{CONTEXT - 2}" in msg and f"{CONTEXT}" in msg and "3 input tokens" in msg
    assert server.post({"prompt": [1, 2, 3], "max_tokens": CONTEXT - 3}).status_code == 200


def test_missing_fields_are_named(server):
    r = server.client.post("/v1/completions", json={"max_tokens": 3})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("missing field 'prompt'")


def test_usage_counts_the_stop_token_as_vllm_does(server):
    free = server.post({"prompt": [1, 2, 3], "max_tokens": 8, "temperature": 0}).json()["choices"][0]["token_ids"]
    stop = free[2]
    r = server.post({"prompt": [1, 2, 3], "max_tokens": 8, "temperature": 0, "stop_token_ids": [stop]}).json()
    assert r["choices"][0]["token_ids"] == free[: free.index(stop)]
    assert r["usage"]["completion_tokens"] == free.index(stop) + 1  # the stop token counted


def test_a_body_over_the_limit_gets_its_413(server):
    big = b'{"prompt": "' + b"a" * (5 * 2**20) + b'"}'
    r = server.client.post("/v1/completions", content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413 and "exceeds the limit" in r.json()["error"]["message"]


def test_a_4_mb_prompt_is_refused_before_tokenizing_and_health_answers_meanwhile(server):
    out = {}
    prompt = "x" * (4 * 2**20 - 100)
    t = threading.Thread(target=lambda: out.update(r=server.post({"prompt": prompt, "max_tokens": 1})))
    t0 = time.monotonic()
    t.start()
    while t.is_alive():
        h0 = time.monotonic()
        assert server.client.get("/health").status_code == 200
        assert time.monotonic() - h0 < 1.0
    assert out["r"].status_code == 400 and "characters is longer" in out["r"].json()["error"]["message"]
    assert time.monotonic() - t0 < 30


def bpe_tokenizer():
    from qkvlab.data.tokenizer import BPETokenizer
    from qkvlab.serve.tokens import serve_tokenizer

    return serve_tokenizer(BPETokenizer.train(["hello world, the quick brown fox"] * 50, 300))


def hf_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from qkvlab.serve.tokens import serve_tokenizer

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["hello world, the quick brown fox"] * 50, trainer=trainer)
    return serve_tokenizer(PreTrainedTokenizerFast(tokenizer_object=tok))


@pytest.mark.parametrize("kind", ["qkvlab-bpe", "transformers"])
def test_tokenizing_4_mb_releases_the_gil(kind):
    """The encode the app calls on its worker thread lets another thread run meanwhile (the event
    loop's): the longest pause a ticking thread sees is far below the encode's own time."""
    pytest.importorskip("tokenizers")
    pytest.importorskip("transformers")
    tok = bpe_tokenizer() if kind == "qkvlab-bpe" else hf_tokenizer()
    text = "hello world, the quick brown fox " * (4 * 2**20 // 33)
    done, gaps = threading.Event(), []

    def tick():
        last = time.monotonic()
        while not done.is_set():
            time.sleep(0.005)
            now = time.monotonic()
            gaps.append(now - last)
            last = now

    ticker = threading.Thread(target=tick)
    ticker.start()
    t0 = time.monotonic()
    ids = tok.encode(text)
    took = time.monotonic() - t0
    done.set()
    ticker.join()
    assert len(ids) > 10_000 and max(gaps) < 1.0, (took, max(gaps))
    assert tok.max_chars_per_token >= max(len(tok.decode([i]).encode()) for i in set(ids[:1000]))
