"""retrofit/mla.py: a RoPE layer to Multi-head Latent Attention. In float64: the RoRoPE split is exact before RoPE
is dropped from the rest (the original scores are the shared key's plus the rest's, both rotated), the kept
frequencies are the original ones at the new base, a layer whose keys fit one head's worth converts exactly;
then the fit of a small model, and `qkvlab retrofit --kv-latent R --rope-dim P` end to end with its refusals."""

from __future__ import annotations

import json
import re

import pytest
import torch

from qkvlab.cli import main
from qkvlab.model.positions import Rotary, apply_rotary
from qkvlab.retrofit.fit import attention_inputs
from qkvlab.retrofit.latent import role_rows
from qkvlab.retrofit.mla import (
    fit_layer_at,
    fit_mla,
    kept_frequencies,
    mla_config,
    mla_rotary,
    plan_layer,
    rope_base,
    rope_directions,
    split_rope,
    strides,
)
from qkvlab.retrofit.refine import RefineOptions, output_error
from test_retrofit import calib, model_with, trained  # noqa: F401  (trained: the module fixture)


def rotated(x: torch.Tensor, pos: int, rotary: Rotary) -> torch.Tensor:
    cos, sin = rotary.cos_sin(torch.tensor([[pos]]), x.dtype)
    return apply_rotary(x[None, None, None], cos, sin)[0, 0, 0]


@pytest.mark.parametrize("hd,p,kvh,nh", [(16, 16, 2, 4), (16, 8, 2, 4), (32, 8, 4, 4), (16, 4, 1, 4)])
def test_split_is_exact_before_rope_is_dropped(hd, p, kvh, nh):
    """q_h·R k_g = q_pe,h·R' k_pe + q_h·R k_nope,g for every stride: the rotation across kv heads is exact and the
    new base gives the kept frequencies exactly (R: the original RoPE over hd, R': MLA's over p at base')."""
    g = torch.Generator().manual_seed(hd + p + kvh)
    d = 24
    wq, wk = (
        torch.randn(nh * hd, d, generator=g, dtype=torch.float64),
        torch.randn(kvh * hd, d, generator=g, dtype=torch.float64),
    )
    x = torch.randn(300, d, generator=g, dtype=torch.float64)
    dirs = rope_directions(wq, wk, x.T @ x / len(x), nh, kvh, hd)
    assert torch.allclose(dirs.norm(dim=1), torch.ones(hd // 2, dtype=torch.float64))
    full = Rotary(hd, 64, 1000.0)
    for m in strides(hd, p):
        rows = split_rope(wq, wk, dirs, kept_frequencies(hd, p, m), nh, kvh, hd)
        short = Rotary(p, 64, rope_base(1000.0, hd, p, m))
        xq, xk = x[0], x[1]
        for h in range(nh):
            grp = h // (nh // kvh)
            for a, b in [(0, 0), (5, 2), (40, 9)]:
                orig = rotated(wq[h * hd : (h + 1) * hd] @ xq, a, full) @ rotated(
                    wk[grp * hd : (grp + 1) * hd] @ xk, b, full
                )
                q_nope, q_pe = rows.query[h, :hd] @ xq, rows.query[h, hd:] @ xq
                k_nope = rows.k_nope[grp * hd : (grp + 1) * hd] @ xk
                split = rotated(q_pe, a, short) @ rotated(rows.k_pe @ xk, b, short)
                split = split + rotated(q_nope, a, full) @ rotated(k_nope, b, full)
                assert torch.isclose(orig, split, rtol=0, atol=1e-10)


def test_kept_frequencies_are_the_originals():
    full = Rotary(64, 8, 100000.0)
    for p in (64, 32, 16, 8):
        for m in strides(64, p):
            kept = kept_frequencies(64, p, m)
            short = Rotary(p, 8, rope_base(100000.0, 64, p, m))
            assert torch.allclose(short.cos[:, : p // 2], full.cos[:, kept], rtol=0, atol=1e-13)
    assert strides(64, 64) == [1] and strides(64, 32) == [1, 2] and strides(64, 16) == [1, 2, 3, 4]


def test_keys_of_one_head_worth_convert_exactly():
    """Keys whose pairs are proportional across kv heads at every frequency: RoRoPE keeps all of them rotated,
    nothing loses RoPE, and a latent as wide as the values (no norm) gives the original layer's output."""
    model, cfg = model_with(n_layer=1, n_head=4, kv_heads=2, d_model=32)
    attn, hd = model.trunk.blocks[0].attn, cfg.head_dim
    with torch.no_grad():
        w = attn.in_proj.weight
        k = w[role_rows(attn, "k")].view(2, hd, -1)
        s = torch.linspace(0.5, 2.0, hd // 2, dtype=torch.float64)
        k[1] = k[0] * torch.cat((s, s))[:, None]  # one scale per frequency pair: rank one across kv heads
    xs = attention_inputs(model, calib(2048, seed=3), 2048, 32)[0]
    plan = plan_layer(attn, xs, model.trunk.rotary)
    mcfg = mla_config(cfg, 2 * hd, hd, 1)  # the latent holds every value: rank kvh * hd
    layer = fit_layer_at(attn, plan, mcfg, 1, 1.0, norm=False)
    rows = split_rope(*(w.detach()[role_rows(attn, r)] for r in "qk"), plan.dirs, list(range(hd // 2)), 4, 2, hd)
    assert rows.k_nope.abs().max() < 1e-12
    assert output_error(layer, plan.check, plan.y_check, mla_rotary(mcfg, model.trunk.rotary)) < 1e-20


def test_fit_of_a_small_model_refines_and_builds_a_valid_mla_model():
    model, cfg = model_with(n_layer=2, n_head=4, kv_heads=2, d_model=32)
    toks = calib(4096, seed=3)
    lines = []
    res = fit_mla(model, cfg, toks, rank=12, rope_dim=4, refine=RefineOptions(steps=30, lr=1e-3, inputs="original"),
                  calib_tokens=4096, block=32, say=lines.append)  # fmt: skip
    new = res.cfg
    assert (new.kv_latent, new.rope_dim, new.norm_eps) == (12, 4, 1e-6)
    assert any(new.rope_theta == pytest.approx(rope_base(cfg.rope_theta, 8, 4, m)) for m in strides(8, 4))
    assert sum(line.startswith("RoPE on frequencies") for line in lines) == len(strides(8, 4))
    assert all(lf.error <= lf.error_fit for lf in res.layers) and all(0 < lf.r2 <= 1 for lf in res.layers)
    x = toks[:30][None]
    assert torch.isfinite(res.model(x)[0]).all()


def test_retrofit_to_mla_end_to_end_and_its_refusals(trained, capsys):  # noqa: F811
    from qkvlab.model.cache import KVCache
    from qkvlab.model.folder import load_model

    out = trained / "rf_mla"
    argv = ["retrofit", str(trained / "teacher"), str(out), "--data", str(trained / "plays.txt"), "--quiet"]
    argv += ["--steps", "20", "--batch-size", "8", "--lr", "2e-3", "--eval-every", "20", "--refine-steps", "10"]
    argv += ["--calib-tokens", "1024", "--eval-tokens", "2048", "--to", "Q-K-V"]
    for bad, needle in [
        (["--rope-dim", "8"], "--rope-dim 8 needs --kv-latent R"),
        (["--kv-latent", "24", "--rope-dim", "7"], "rope_dim=7 must be an even number"),
        (["--kv-latent", "24", "--rope-dim", "32"], "rope_dim=32 must be an even number from 2 to d_head=16"),
        (["--kv-latent", "120", "--rope-dim", "8"], "no saving"),
    ]:
        assert main(argv + bad) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and re.search(needle, err), err
        assert not out.exists() or not any(out.iterdir())
    assert main([a for a in argv if a != "--quiet"] + ["--kv-latent", "24", "--rope-dim", "8"]) == 0
    said = capsys.readouterr().out
    phases = ["loading", "loaded Q-K-V", "text:", "original: held-out ppl", "RoPE on frequencies", "fitted 2 of 2"]
    phases += ["of the original's ppl", "uptrained (20 steps)"]
    places = [said.find(p) for p in phases]
    assert -1 not in places and places == sorted(places), said  # every phase said, in order, each with its time
    report = json.loads((out / "retrofit.json").read_text())
    assert report["cache_ratio"] == 0.25  # (24 + 8) / (2 x 4 heads x 16)
    for key in ("ratio_fit", "ratio_uptrained"):
        est, lo, hi = report[key]
        assert lo <= est <= hi and report["heldout_windows"] == 2048 // 32
    model, cfg, _ = load_model(out)
    assert (cfg.kv_latent, cfg.rope_dim) == (24, 8)
    cache = KVCache(cfg, 1, 8)
    model(torch.tensor([[1, 2, 3]]), cache=cache)
    assert {tuple(t.shape) for layer in cache.layers for t in layer.store.values()} == {(1, 1, 8, 32)}
    assert main(argv + ["--kv-latent", "16", "--rope-dim", "8", "--resume"]) == 2
    assert "fitted with --kv-latent 24, not --kv-latent 16" in capsys.readouterr().err


def test_an_mla_fit_refuses_a_model_without_rope(capsys):
    from qkvlab.base.errors import UserError
    from qkvlab.retrofit.mla import check_source

    _, cfg = model_with(pos="learned")
    with pytest.raises(UserError, match="no RoPE to keep apart"):
        check_source(cfg, 8, 4)
