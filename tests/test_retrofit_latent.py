"""retrofit/latent.py: the joint low-rank key/value fit's algebra in float64 (exact at full rank,
keys kept when they dominate), the factored layer's forward equal to the plain layer with its rows,
refinement that keeps the rank, and the refusals."""

from __future__ import annotations

import copy

import pytest
import torch

from qkvlab.base.errors import UserError
from qkvlab.retrofit.fit import attention_inputs, fit
from qkvlab.retrofit.latent import (
    FactoredKV,
    fit_latent_layer,
    latent_factors,
    latent_model,
    out_metric_root,
    role_rows,
)
from qkvlab.retrofit.refine import RefineOptions, output_error, targets
from test_retrofit import calib, model_with


def random_rows(n=16, d=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    wk, wv = torch.randn(n, d, generator=g, dtype=torch.float64), torch.randn(n, d, generator=g, dtype=torch.float64)
    x = torch.randn(400, d, generator=g, dtype=torch.float64) @ torch.randn(d, d, generator=g, dtype=torch.float64)
    m = torch.randn(n, n, generator=g, dtype=torch.float64)
    return wk, wv, x.T @ x / len(x), torch.linalg.cholesky(m @ m.T + torch.eye(n, dtype=torch.float64))


@pytest.mark.parametrize("alpha", [0.25, 1.0, 16.0])
def test_full_rank_factors_give_the_rows_back(alpha):
    wk, wv, gram, root = random_rows()
    w_c, w_uk, w_uv = latent_factors(wk, wv, gram, root, 2 * len(wk), alpha)
    assert torch.allclose(w_uk @ w_c, wk, atol=1e-10) and torch.allclose(w_uv @ w_c, wv, atol=1e-10)


def test_low_rank_factors_have_the_rank_and_keep_dominant_keys():
    wk, wv, gram, root = random_rows()
    n = len(wk)
    w_c, w_uk, w_uv = latent_factors(wk, wv, gram, root, n, 1e5)  # K=V's bytes, keys weighted far above values
    assert w_c.shape == (n, wk.shape[1]) and torch.linalg.matrix_rank(torch.cat([w_uk, w_uv]) @ w_c) == n
    assert (w_uk @ w_c - wk).abs().max() < 1e-6 * wk.abs().max()  # the keys kept, as K=V keeps them
    # the values are then the best map of the keys under out_proj's metric: a least-squares fit of V R from K
    target = root.T @ wv  # rows of V R; its least-squares map from K over inputs of second moment gram:
    coef = torch.linalg.solve(wk @ gram @ wk.T, wk @ gram @ target.T)  # (n, n), the normal equations
    assert (root.T @ w_uv @ w_c - coef.T @ wk).abs().max() < 1e-5 * target.abs().max()


def test_full_rank_layer_is_the_layer_and_factored_forward_is_the_plain_layer():
    model, cfg = model_with(n_layer=1, kv_heads=2)
    xs = attention_inputs(model, calib(2048, seed=3), 2048, 32)[0]
    attn, rot = model.trunk.blocks[0].attn, model.trunk.rotary
    width = 2 * attn.kv_heads * attn.head_dim
    same, info = fit_latent_layer(attn, xs, width, rot)
    assert (
        torch.allclose(same.materialized().in_proj.weight, attn.in_proj.weight, atol=1e-10)
        and info["error_fit"] < 1e-20
    )
    w = attn.in_proj.weight.detach()
    factored = FactoredKV(attn, *latent_factors(w[role_rows(attn, "k")], w[role_rows(attn, "v")],
                                                 torch.eye(cfg.d_model, dtype=torch.float64), out_metric_root(attn),
                                                 width // 2, 1.0))  # fmt: skip
    plain = factored.materialized()
    ys = targets(plain, xs[:3], rot)
    assert output_error(factored, xs[:3], ys, rot) < 1e-28  # the same forward, float64
    assert torch.linalg.matrix_rank(plain.in_proj.weight[role_rows(attn, "k").start :]) == width // 2


def test_latent_at_k_eq_v_bytes_beats_the_k_eq_v_fit_and_refinement_keeps_the_rank():
    """At K=V's bytes the latent contains K=V (module doc): on held windows its output error is below the
    K=V closed-form fit's; Adam steps on the factors lower it further and leave rows of that rank."""
    model, cfg = model_with(n_layer=2, kv_heads=2)
    toks = calib(4096, seed=3)
    xs = attention_inputs(model, toks, 4096, 32)
    kv = fit(model, cfg, toks, to="Q-K=V", block=32, inputs=xs)
    for i, block in enumerate(model.trunk.blocks):
        attn = block.attn
        r = attn.kv_heads * attn.head_dim
        _, closed = fit_latent_layer(attn, xs[i], r, model.trunk.rotary)
        assert closed["error_fit"] < kv.layers[i].error_fit
        new, info = fit_latent_layer(attn, xs[i], r, model.trunk.rotary, RefineOptions(steps=60, lr=3e-3))
        assert info["error_fit"] == pytest.approx(closed["error_fit"], rel=1e-12) and info["error"] < info["error_fit"]
        rows = new.materialized().in_proj.weight[role_rows(attn, "k").start :].detach()
        assert torch.linalg.matrix_rank(rows, rtol=1e-9) == r


def test_identity_query_layer_and_refusals():
    model, _ = model_with(n_layer=1, attn="Id-K-V")
    xs = attention_inputs(model, calib(1024), 1024, 32)[0]
    attn = model.trunk.blocks[0].attn
    new, _ = fit_latent_layer(attn, xs, 8, model.trunk.rotary)
    assert new.w_q is None and new.materialized().in_proj.weight.shape == attn.in_proj.weight.shape
    with pytest.raises(UserError, match=r"rank 0 must be in \[1, 64\]"):
        fit_latent_layer(attn, xs, 0, model.trunk.rotary)
    kv, _ = model_with(n_layer=1, attn="Q-K=V")
    with pytest.raises(UserError, match="separate key and value projections; this layer is Q-K=V"):
        fit_latent_layer(kv.trunk.blocks[0].attn, xs, 8, kv.trunk.rotary)
    biased, _ = model_with(n_layer=1, bias=True)
    with pytest.raises(UserError, match="without bias"):
        fit_latent_layer(biased.trunk.blocks[0].attn, xs, 8, biased.trunk.rotary)


@pytest.mark.parametrize("attn,kv", [("Q-K-V", 2), ("Id-K-V", None)])
def test_latent_model_caches_the_latent_and_computes_what_the_fitted_rows_do(attn, kv):
    """latent_model: the source with kv_latent = r, equal (float64) to the source with each layer's
    materialized rank-r rows and fitted out_proj; refused for mixed ranks."""
    model, cfg = model_with(n_layer=2, kv_heads=kv, attn=attn)
    xs = attention_inputs(model, calib(2048, seed=3), 2048, 32)
    layers = [fit_latent_layer(b.attn, x, 12, model.trunk.rotary, RefineOptions(steps=5))[0]
              for b, x in zip(model.trunk.blocks, xs)]  # fmt: skip
    latent, lcfg = latent_model(model, cfg, layers)
    assert lcfg.kv_latent == 12 and lcfg.replace(kv_latent=None) == cfg
    plain = copy.deepcopy(model)
    for block, f in zip(plain.trunk.blocks, layers):
        block.attn.load_state_dict(f.materialized().state_dict())
    ids = calib(3 * 20, seed=9).view(3, 20)
    assert torch.allclose(latent(ids)[0], plain(ids)[0], rtol=0, atol=1e-11)
    assert not torch.allclose(plain(ids)[0], model(ids)[0], atol=1e-3)  # the fit did change the model
    other = fit_latent_layer(model.trunk.blocks[1].attn, xs[1], 10, model.trunk.rotary)[0]
    with pytest.raises(UserError, match=r"one rank \(kv_latent is one setting\); got \[10, 12\]"):
        latent_model(model, cfg, [layers[0], other])
