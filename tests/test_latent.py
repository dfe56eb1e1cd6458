"""kv_latent: keys and values read back from one cached latent. The layer is exactly the plain layer with
low-rank key and value rows (float64, several shapes); the cache holds only the latent, as accounting
says; cached decoding (dynamic, static, paged with preemption) equals the full forward and `generate`
alone; what cannot read a latent refuses in one line."""

from __future__ import annotations

import random

import pytest
import torch

from qkvlab.base.errors import UserError
from qkvlab.convert.reparam import role_weights
from qkvlab.decode.generate import generate
from qkvlab.decode.sampling import Sampling
from qkvlab.model.accounting import analytic_params, counted_params, kv_cache_bytes_per_token, report
from qkvlab.model.cache import KVCache
from qkvlab.model.config import ModelConfig
from qkvlab.model.transformer import GPT
from qkvlab.serve.engine import Engine
from qkvlab.serve.request import Request
from test_serve import VOCAB, run_mixed, tiny_model, tokens

SHAPES = [  # (scheme, positions, kv heads, latent)
    ("Q-K-V", "rope", 2, 8),
    ("Q-K-V", "learned", None, 24),
    ("Id-K-V", "rope", 1, 5),
    ("Id-K-V", "learned", 2, 16),
]


def latent_model(scheme, pos, kv, r, seed=0) -> GPT:
    return tiny_model(scheme, pos, kv, seed=seed, kv_latent=r)


def plain_twin(model: GPT) -> GPT:
    """The same model without a latent: in_proj = [query rows; W_uk W_c; W_uv W_c], every other weight copied."""
    cfg = model.cfg.replace(kv_latent=None).validate()
    twin = GPT(cfg).to(torch.float64).eval()
    state = dict(model.state_dict())
    for i, block in enumerate(model.trunk.blocks):
        a, p = block.attn, f"trunk.blocks.{i}.attn."
        w, up = state.pop(p + "in_proj.weight"), state.pop(p + "kv_up.weight")
        q, c = w[: -a.latent], w[-a.latent :]
        n = a.kv_heads * a.head_dim
        state[p + "in_proj.weight"] = torch.cat([q, up[:n] @ c, up[n:] @ c])
    twin.load_state_dict(state)
    return twin


@pytest.mark.parametrize("scheme,pos,kv,r", SHAPES)
def test_latent_layer_is_the_plain_layer_with_low_rank_rows(scheme, pos, kv, r):
    model = latent_model(scheme, pos, kv, r)
    twin = plain_twin(model)
    for b, t in [(1, 5), (3, 17), (2, 40)]:
        x = torch.randint(0, VOCAB, (b, t), generator=torch.Generator().manual_seed(t))
        assert torch.allclose(model(x)[0], twin(x)[0], rtol=0, atol=1e-11)
    k_rows = role_weights(twin.trunk.blocks[0], twin.cfg.spec)["k"][0]
    assert torch.linalg.matrix_rank(k_rows) <= r


@pytest.mark.parametrize("scheme,pos,kv,r", SHAPES)
@pytest.mark.parametrize("static", [False, True])
def test_cached_decoding_equals_the_full_forward_and_holds_only_the_latent(scheme, pos, kv, r, static):
    model = latent_model(scheme, pos, kv, r)
    cfg = model.cfg
    x = torch.randint(0, VOCAB, (2, 19), generator=torch.Generator().manual_seed(1))
    full = model(x)[0]
    cache = KVCache(cfg, 2, 24, dtype=torch.float64, static=static)
    steps = [model(x[:, :11], cache=cache)[0]] + [model(x[:, t : t + 1], cache=cache)[0] for t in range(11, 19)]
    assert torch.allclose(torch.cat(steps, 1), full, rtol=0, atol=1e-11)
    assert all(tuple(t.shape) == (2, 1, 24, r) for layer in cache.layers for t in layer.store.values())
    assert cache.bytes_allocated() == kv_cache_bytes_per_token(cfg, "fp64") * 2 * 24 == 2 * r * 8 * 2 * 24


def test_accounting_counts_the_latent():
    cfg = ModelConfig(attn="Q-K-V", n_layer=3, n_head=4, d_model=32, kv_heads=2, kv_latent=12).validate()
    assert analytic_params(cfg) == counted_params(GPT(cfg))
    plain = cfg.replace(kv_latent=None)
    assert kv_cache_bytes_per_token(cfg) * 32 == kv_cache_bytes_per_token(plain) * 12  # 12 of 2 * 2 * 8 numbers
    # attention: d x (query + r) + r x (2 kv_heads d_head) + out, per layer
    per_layer = 32 * (32 + 12) + 12 * 32 + 32 * 32
    assert analytic_params(cfg).attention == 3 * per_layer
    assert report(cfg)["kv_latent"] == 12 and report(plain)["kv_latent"] is None


@pytest.mark.parametrize("scheme,pos,kv,r", SHAPES[:3])
def test_paged_serving_with_preemption_gives_each_request_its_tokens_alone(scheme, pos, kv, r):
    model = latent_model(scheme, pos, kv, r)
    rng = random.Random(11)
    requests = [
        Request(tuple(rng.randrange(VOCAB) for _ in range(rng.randint(1, 14))), rng.randint(10, 24)) for _ in range(6)
    ]
    engine = Engine(model, blocks=3, block_size=16)
    events, _ = run_mixed(engine, requests, join_every=1)
    assert engine.stats()["preemptions"] > 0 and engine.kv.used == 0
    assert all(tuple(t.shape[1:]) == (1, r) for layer in engine.runner.store.layers for t in layer.values())
    for req, ev in zip(requests, events.values()):
        assert tokens(ev) == generate(model, [list(req.prompt)], req.max_tokens, Sampling(temperature=0.0))[0]


@pytest.mark.parametrize(
    "kw,needle",
    [
        (dict(attn="Q-K=V"), "kv_latent=8 with Q-K=V: a latent replaces separate learned key and value projections"),
        (dict(attn="Q=V-K"), "kv_latent=8 with Q=V-K"),
        (dict(attn="Id-K=V"), "kv_latent=8 with Id-K=V"),
        (dict(attn="(Q-K-V)+"), r"kv_latent=8 with \(Q-K-V\)\+"),
        (dict(layers="Q-K=V@0"), "a latent is one setting for every layer"),
        (dict(kv_heads=2, kv_latent=32), r"kv_latent=32 must be below 2 \* kv_heads \* d_head = 32"),
        (dict(kv_latent=0), "kv_latent"),
    ],
)
def test_refusals_are_one_line(kw, needle):
    base = dict(attn="Q-K-V", n_layer=2, n_head=4, d_model=32, kv_latent=8)
    with pytest.raises(UserError, match=needle):
        ModelConfig(**{**base, **kw}).validate()


def test_conversions_refuse_a_latent_model():
    model = latent_model("Q-K-V", "rope", 2, 8)
    with pytest.raises(UserError, match=r"caches a key/value latent \(kv_latent=8\)"):
        role_weights(model.trunk.blocks[0], model.cfg.spec)
