"""Multi-head Latent Attention (kv_latent R + rope_dim P): the layer equals DeepSeek's equations written out
(float64, several shapes and head layouts); decoding in the absorbed form equals the full forward; the cache
holds R + P numbers per token and layer, as accounting says; what makes no sense is refused in one line."""

from __future__ import annotations

import math

import pytest
import torch

from qkvlab.base.errors import UserError
from qkvlab.model.accounting import analytic_params, counted_params, kv_cache_bytes_per_token, report
from qkvlab.model.attention import LATENT_NORM_EPS, Attention
from qkvlab.model.cache import KVCache
from qkvlab.model.config import ModelConfig
from qkvlab.model.transformer import GPT
from qkvlab.model.variants import parse_variant

VOCAB = 97
LAYOUTS = [  # (n_head, kv_heads, d_model, kv_latent, rope_dim)
    (4, 4, 64, 20, 8),
    (4, 2, 64, 12, 16),
    (6, 1, 48, 6, 2),
    (6, 3, 96, 40, 16),
]


def mla_config(n_head, kv, d, r, p, **kw) -> ModelConfig:
    shape = dict(n_layer=2, n_head=n_head, kv_heads=kv, d_model=d, kv_latent=r, rope_dim=p, vocab_size=VOCAB)
    shape |= dict(context=64, pos="rope", norm="rmsnorm", mlp="swiglu", rope_theta=500.0)
    return ModelConfig(**(shape | kw)).validate()


def mla_model(*layout, seed=0, **kw) -> GPT:
    torch.manual_seed(seed)
    model = GPT(mla_config(*layout, **kw)).to(torch.float64).eval()
    with torch.no_grad():  # a latent norm that is not all ones, so its weight is checked too
        for block in model.trunk.blocks:
            block.attn.kv_norm.weight.uniform_(0.5, 1.5)
    return model


def rotate(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """RoPE over the last dim of x (..., T, P) in the two-halves layout, positions pos (T,)."""
    half = x.shape[-1] // 2
    freq = theta ** (-torch.arange(half, dtype=torch.float64) / half)
    angle = pos.double()[:, None] * freq  # (T, P/2)
    cos, sin = angle.cos(), angle.sin()
    a, b = x[..., :half], x[..., half:]
    return torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)


def deepseek_layer(attn: Attention, x: torch.Tensor, theta: float) -> torch.Tensor:
    """DeepSeek-V2's attention written out head by head from the layer's weights: x (B, T, C) -> (B, T, C)."""
    B, T, _ = x.shape
    nh, kvh, hd, r, p = attn.n_head, attn.kv_heads, attn.head_dim, attn.latent, attn.rope_dim
    w = attn.in_proj.weight
    q = (x @ w[: nh * (hd + p)].T).view(B, T, nh, hd + p)
    c = x @ w[nh * (hd + p) : nh * (hd + p) + r].T  # (B, T, r)
    c = c / torch.sqrt((c**2).mean(-1, keepdim=True) + LATENT_NORM_EPS) * attn.kv_norm.weight
    pos = torch.arange(T)
    k_pe = rotate(x @ w[-p:].T, pos, theta)  # (B, T, p): one key for every head
    up = attn.kv_up.weight
    outs = []
    for h in range(nh):
        g = h // (nh // kvh)
        k = c @ up[g * hd : (g + 1) * hd].T  # (B, T, hd)
        v = c @ up[kvh * hd + g * hd : kvh * hd + (g + 1) * hd].T
        q_pe = rotate(q[:, :, h, hd:], pos, theta)
        s = (q[:, :, h, :hd] @ k.transpose(1, 2) + q_pe @ k_pe.transpose(1, 2)) / math.sqrt(hd + p)
        s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
        outs.append(s.softmax(-1) @ v)
    return torch.cat(outs, dim=-1) @ attn.out_proj.weight.T


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_layer_is_deepseeks_attention(layout):
    model = mla_model(*layout)
    attn = model.trunk.blocks[0].attn
    for b, t in [(1, 3), (2, 17), (3, 40)]:
        x = torch.randn(b, t, model.cfg.d_model, dtype=torch.float64, generator=torch.Generator().manual_seed(t))
        pos = torch.arange(t)[None].expand(b, t)
        ours = attn(x, q_pos=pos, rope=model.trunk.rotary.cos_sin(pos, x.dtype))
        assert torch.allclose(ours, deepseek_layer(attn, x, model.cfg.rope_theta), rtol=0, atol=1e-12)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_absorbed_form_equals_the_explicit_form(layout):
    """The absorbed step on rows of random content (not only rows a model wrote), with and without a mask."""
    attn = mla_model(*layout).trunk.blocks[0].attn
    nh, hd, r, p = attn.n_head, attn.head_dim, attn.latent, attn.rope_dim
    gen = torch.Generator().manual_seed(1)
    for b, t, s in [(1, 1, 9), (2, 1, 33), (3, 4, 50)]:
        q = torch.randn(b, nh, t, hd + p, dtype=torch.float64, generator=gen)
        rows = torch.randn(b, 1, s, r + p, dtype=torch.float64, generator=gen)
        mask = torch.rand(b, 1, t, s, generator=gen) < 0.7
        mask[..., 0] = True
        for m in (None, mask):
            absorbed = attn.absorbed(q[..., :hd], q[..., hd:], rows, m, 0.0)
            k, v = attn.expand_rows(rows)
            g = nh // attn.kv_heads
            k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
            explicit = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=m, scale=attn.scale)
            assert torch.allclose(absorbed, explicit, rtol=0, atol=1e-12)


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_cached_decoding_is_absorbed_and_equals_the_full_forward(layout, static, monkeypatch):
    model = mla_model(*layout)
    idx = torch.randint(0, VOCAB, (3, 24), generator=torch.Generator().manual_seed(2))
    full = model(idx)[0]
    cache = KVCache(model.cfg, 3, 32, dtype=torch.float64, static=static)
    out = [model(idx[:, :10], cache=cache)[0]]  # prefill: explicit keys and values
    monkeypatch.setattr(Attention, "expand_rows", lambda *a: pytest.fail("a decode step rebuilt keys"))
    for t in range(10, 24):
        out.append(model(idx[:, t : t + 1], cache=cache)[0])
    assert torch.allclose(torch.cat(out, 1), full, rtol=0, atol=1e-11)
    r, p = model.cfg.kv_latent, model.cfg.rope_dim
    assert [tuple(t.shape) for t in cache.layers[0].store.values()] == [(3, 1, 32, r + p)]


def test_left_padded_batch_decodes_each_row_as_alone():
    model = mla_model(4, 2, 64, 12, 16)
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13]]
    pad = torch.tensor([prompts[0], [0, 0, 0, *prompts[1]]])
    token_mask = torch.tensor([[True] * 6, [False] * 3 + [True] * 3])
    positions = (token_mask.cumsum(1) - 1).clamp(min=0)
    cache = KVCache(model.cfg, 2, 16, dtype=torch.float64)
    logits = model(pad, cache=cache, positions=positions, token_mask=token_mask)[0][:, -1]
    steps = [logits]
    for tok in ([1, 2], [3, 4]):
        steps.append(model(torch.tensor(tok)[:, None], cache=cache)[0][:, -1])
    for row, prompt in enumerate(prompts):
        alone = model(torch.tensor([prompt + [[1, 2][row], [3, 4][row]]]))[0][0, -3:]
        assert torch.allclose(torch.stack([s[row] for s in steps]), alone, rtol=0, atol=1e-11)


def test_accounting_counts_mla():
    for layout in LAYOUTS:
        cfg = mla_config(*layout)
        n_head, kv, d, r, p = layout
        model = GPT(cfg)
        assert counted_params(model) == analytic_params(cfg)
        assert kv_cache_bytes_per_token(cfg, "fp32") == cfg.n_layer * (r + p) * 4
        cache = KVCache(cfg, 2, 10)
        assert cache.bytes_allocated() == 2 * 10 * kv_cache_bytes_per_token(cfg, "fp32")
        assert report(cfg)["rope_dim"] == p
        hd = d // n_head
        assert model.trunk.blocks[0].attn.in_proj.weight.shape == (n_head * (hd + p) + r + p, d)
        assert model.trunk.rotary.cos.shape[-1] == p  # only the rope part rotates
    assert mla_config(4, 4, 64, 20, 8).scale == (16 + 8) ** -0.5  # DeepSeek's scale over the q·k width


def test_a_training_step_reaches_every_weight():
    model = GPT(mla_config(4, 2, 64, 12, 16))
    idx = torch.randint(0, VOCAB, (2, 20))
    _, loss = model(idx, idx)
    loss.backward()
    attn = model.trunk.blocks[0].attn
    for p in (attn.in_proj.weight, attn.kv_up.weight, attn.kv_norm.weight, attn.out_proj.weight):
        assert p.grad is not None and p.grad.abs().sum() > 0


def test_variant_notation():
    v = parse_variant("Q-K-V/GQA-2/latent=12/rope=16")
    assert (v.latent, v.rope, v.name) == (12, 16, "Q-K-V/GQA-2/latent=12/rope=16")
    cfg = v.apply(ModelConfig(n_layer=1, n_head=4, d_model=64, pos="rope"))
    assert (cfg.kv_latent, cfg.rope_dim) == (12, 16)
    with pytest.raises(UserError, match="give latent=R too"):
        parse_variant("Q-K-V/rope=16")
    with pytest.raises(UserError, match="rope=0"):
        parse_variant("Q-K-V/latent=8/rope=0")


@pytest.mark.parametrize(
    "kw,needle",
    [
        (dict(rope_dim=7), "even number from 2 to d_head=16"),
        (dict(rope_dim=18), "even number from 2 to d_head=16"),
        (dict(pos="learned"), "without RoPE"),
        (dict(kv_latent=None), "needs kv_latent"),
        (dict(kv_latent=60, rope_dim=8, kv_heads=2), "no saving"),
        (dict(attn="Id-K-V"), "identity query"),
        (dict(attn="Q-K=V"), "separate learned key and value"),
    ],
)
def test_refusals_are_one_line(kw, needle):
    with pytest.raises(UserError, match=needle) as e:
        mla_config(4, 4, 64, 20, 8, **kw)
    assert "\n" not in str(e.value)
