"""Spec parsing, attention equivalences, causality, the '+' term, accounting, one-line errors."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import SCHEMES
from qkvlab.base.errors import UserError
from qkvlab.model.accounting import analytic_params, counted_params, kv_cache_bytes_per_token, report
from qkvlab.model.cache import KVCache
from qkvlab.model.config import ModelConfig, preset
from qkvlab.model.spec import IDENTITY, KNOWN_SCHEMES, parse_scheme
from qkvlab.model.transformer import GPT, Encoder, PatchInput, SetInput, TokenInput


def cfg64(**kw) -> ModelConfig:
    base = dict(n_layer=2, n_head=4, d_model=32, vocab_size=50, context=24, bias=True)
    base.update(kw)
    return ModelConfig(**base).validate()


# ---- spec -----------------------------------------------------------------------------------
@pytest.mark.parametrize("text", list(KNOWN_SCHEMES) + ["Q=K-V+", "q-k=v", "ID-K-V"])
def test_parse_roundtrip(text):
    spec = parse_scheme(text)
    assert parse_scheme(spec.name) == spec


def test_parse_tables():
    assert parse_scheme("Q-K-V").source == (0, 1, 2)
    assert parse_scheme("Id-K=V").source == (IDENTITY, 0, 0)
    assert parse_scheme("Q=K=V").projections == (("q", "k", "v"),)
    assert parse_scheme("(Q=K-V)+").plus and parse_scheme("Q=K-V+").name == "(Q=K-V)+"
    assert parse_scheme("Q-K=V").cached_sources() == (1,)
    assert parse_scheme("Q-Id-V").cached_sources() == (IDENTITY, 1)


BAD_CONFIGS = [
    (dict(attn="Q-K"), "three roles"),
    (dict(attn="Q-V-K"), "order Q, K, V"),
    (dict(attn="Id-Id-V"), "at most one"),
    (dict(attn="Id=K-V"), "cannot be shared"),
    (dict(attn="Q-X-V"), "not one of"),
    (dict(attn="((Q-K-V)+"), "malformed"),
    (dict(attn=""), "empty"),
    (dict(kv_heads=3), "must divide"),
    (dict(attn="Q=K-V", kv_heads=2), "kv_heads must equal"),
    (dict(attn="Q-Id-V", kv_heads=2), "kv_heads must be"),
    (dict(attn="Id-K-V", d_head=4), "n_head*d_head == d_model"),
    (dict(norm="batchnorm"), "norm='batchnorm'"),
    (dict(pos="alibi"), "pos='alibi'"),
    (dict(d_model=30), "not divisible"),
    (dict(pos="rope", d_head=3, attn="Q-K-V"), "even d_head"),
    (dict(attn="(Q-K-V)+", plus_channels=3), "plus_channels"),
    (dict(dropout=1.5), "dropout"),
    (dict(attn_scale=-1.0), "attn_scale"),
    (dict(match_params="Q-Q-V"), "position 2"),
]


@pytest.mark.parametrize("changes,needle", BAD_CONFIGS)
def test_bad_configs_one_line(changes, needle):
    with pytest.raises(UserError) as e:
        cfg64(**changes)
    msg = str(e.value)
    assert needle in msg and "\n" not in msg


def test_unknown_preset_and_key():
    with pytest.raises(UserError, match="unknown preset 'gpt5'"):
        preset("gpt5")
    with pytest.raises(UserError, match="unknown model setting 'nlayer'"):
        ModelConfig.from_dict({"nlayer": 3})


# ---- equivalences ---------------------------------------------------------------------------
def copy_shared(dst: GPT, src: GPT) -> None:
    """Copy every weight except attention input projections (embeddings, MLPs, norms, outputs)."""
    state = {k: v for k, v in src.state_dict().items() if ".attn.in_proj." not in k and "score_term" not in k}
    dst.load_state_dict(state, strict=False)


def split_proj(model: GPT, layer: int):
    attn = model.trunk.blocks[layer].attn
    ws = attn.in_proj.weight.split(attn.proj_widths, 0)
    bs = attn.in_proj.bias.split(attn.proj_widths, 0) if attn.in_proj.bias is not None else [None] * len(ws)
    return attn, list(ws), list(bs)


SHAPES = [
    dict(n_layer=1, n_head=2, d_model=16),
    dict(n_layer=3, n_head=4, d_model=32),
    dict(n_layer=2, n_head=8, d_model=64),
]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("pos", ["learned", "rope", "none"])
def test_identity_query_equals_full_with_wq_identity(shape, pos):
    torch.manual_seed(0)
    full = GPT(cfg64(attn="Q-K-V", pos=pos, attn_scale=0.3, **shape)).double()
    ident = GPT(cfg64(attn="Id-K-V", pos=pos, attn_scale=0.3, **shape)).double()
    copy_shared(ident, full)
    with torch.no_grad():
        for i in range(shape["n_layer"]):
            a, ws, bs = split_proj(full, i)
            ws[0].copy_(torch.eye(ws[0].shape[0], dtype=ws[0].dtype))
            bs[0].zero_()
            b, ws2, bs2 = split_proj(ident, i)
            ws2[0].copy_(ws[1]), ws2[1].copy_(ws[2]), bs2[0].copy_(bs[1]), bs2[1].copy_(bs[2])
    x = torch.randint(0, 50, (3, 17))
    torch.testing.assert_close(ident(x)[0], full(x)[0], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("kv_heads", [None, 1])
def test_kv_shared_equals_full_with_tied_wv(shape, kv_heads):
    torch.manual_seed(1)
    full = GPT(cfg64(attn="Q-K-V", kv_heads=kv_heads, **shape)).double()
    tied = GPT(cfg64(attn="Q-K=V", kv_heads=kv_heads, **shape)).double()
    copy_shared(tied, full)
    with torch.no_grad():
        for i in range(shape["n_layer"]):
            _, ws, bs = split_proj(full, i)
            ws[2].copy_(ws[1]), bs[2].copy_(bs[1])  # W_V := W_K
            _, ws2, bs2 = split_proj(tied, i)
            ws2[0].copy_(ws[0]), ws2[1].copy_(ws[1]), bs2[0].copy_(bs[0]), bs2[1].copy_(bs[1])
    x = torch.randint(0, 50, (2, 20))
    torch.testing.assert_close(tied(x)[0], full(x)[0], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("shape", SHAPES)
def test_qkv_all_shared_equals_full_tied(shape):
    torch.manual_seed(2)
    full = GPT(cfg64(attn="Q-K-V", pos="rope", **shape)).double()
    one = GPT(cfg64(attn="Q=K=V", pos="rope", **shape)).double()
    copy_shared(one, full)
    with torch.no_grad():
        for i in range(shape["n_layer"]):
            _, ws, bs = split_proj(full, i)
            for j in (1, 2):
                ws[j].copy_(ws[0]), bs[j].copy_(bs[0])
            _, ws2, bs2 = split_proj(one, i)
            ws2[0].copy_(ws[0]), bs2[0].copy_(bs[0])
    x = torch.randint(0, 50, (2, 11))
    torch.testing.assert_close(one(x)[0], full(x)[0], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("scheme", ["Q-K-V", "Q-K=V", "Id-K=V"])
def test_gqa_with_all_heads_equals_mha(scheme):
    torch.manual_seed(3)
    mha = GPT(cfg64(attn=scheme)).double()
    gqa = GPT(cfg64(attn=scheme, kv_heads=4)).double()
    gqa.load_state_dict(mha.state_dict())
    x = torch.randint(0, 50, (2, 9))
    torch.testing.assert_close(gqa(x)[0], mha(x)[0], rtol=0, atol=0)


def test_gqa_matches_explicit_head_repeat():
    """GQA-2 equals MHA whose K/V heads are the GQA heads repeated per group."""
    torch.manual_seed(4)
    gqa = GPT(cfg64(attn="Q-K-V", kv_heads=2)).double()
    mha = GPT(cfg64(attn="Q-K-V")).double()
    copy_shared(mha, gqa)
    hd = 8
    with torch.no_grad():
        for i in range(2):
            _, ws, bs = split_proj(gqa, i)
            _, wm, bm = split_proj(mha, i)
            wm[0].copy_(ws[0]), bm[0].copy_(bs[0])
            for j in (1, 2):
                wm[j].copy_(ws[j].view(2, hd, -1).repeat_interleave(2, 0).reshape(32, -1))
                bm[j].copy_(bs[j].view(2, hd).repeat_interleave(2, 0).reshape(32))
    x = torch.randint(0, 50, (2, 13))
    torch.testing.assert_close(gqa(x)[0], mha(x)[0], rtol=1e-12, atol=1e-12)


def test_kv_shared_hands_same_tensor():
    cfg = cfg64(attn="Q-K=V")
    attn = GPT(cfg).trunk.blocks[0].attn
    out = attn.project(torch.randn(2, 5, 32))
    src = attn.spec.source
    assert out[src[1]] is out[src[2]]
    ident = GPT(cfg64(attn="Id-K-V")).trunk.blocks[0].attn
    x = torch.randn(2, 5, 32)
    q = ident.project(x)[IDENTITY]
    assert q.data_ptr() == x.data_ptr()  # a view of the input: no matmul, no copy


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("pos", ["learned", "rope"])
def test_causality(scheme, pos):
    torch.manual_seed(5)
    model = GPT(cfg64(attn=scheme, pos=pos, kv_heads=2 if scheme in ("Q-K=V", "Id-K=V") else None)).double()
    x = torch.randint(0, 50, (2, 16))
    y = x.clone()
    y[:, 9:] = torch.randint(0, 50, (2, 7))
    torch.testing.assert_close(model(x)[0][:, :9], model(y)[0][:, :9], rtol=0, atol=1e-13)
    assert not torch.allclose(model(x)[0][:, 9:], model(y)[0][:, 9:])


@pytest.mark.parametrize("scheme", ["Q=K-V", "Q=K=V", "Q-K-V"])
def test_plus_term_at_neutral_weights_is_plain(scheme):
    torch.manual_seed(6)
    plain = GPT(cfg64(attn=scheme)).double()
    plus = GPT(cfg64(attn=f"({scheme})+")).double()
    plus.load_state_dict(plain.state_dict(), strict=False)
    x = torch.randint(0, 50, (3, 15))
    with torch.no_grad():
        for blk in plus.trunk.blocks:
            # w = e_0: sum(w) = 1 and P . w = sin(i), a function of the query row alone, which
            # softmax cancels (so does the Linear's bias, hence no such parameter). So the scores are
            # the plain scheme's.
            blk.attn.score_term.weight.zero_()
            blk.attn.score_term.weight[0] = 1.0
    torch.testing.assert_close(plus(x)[0], plain(x)[0], rtol=1e-12, atol=1e-12)
    with torch.no_grad():
        for blk in plus.trunk.blocks:
            blk.attn.score_term.weight[-1] = 0.7  # a column (key-position) term changes the output
    assert not torch.allclose(plus(x)[0], plain(x)[0])


def test_plus_term_breaks_symmetry_but_stays_causal():
    torch.manual_seed(7)
    model = GPT(cfg64(attn="(Q=K=V)+", pos="none")).double()
    x = torch.randint(0, 50, (1, 12))
    y = x.clone()
    y[0, 6:] = (y[0, 6:] + 1) % 50
    torch.testing.assert_close(model(x)[0][:, :6], model(y)[0][:, :6], rtol=0, atol=1e-13)


# ---- cache vs full forward (issue 6 extends this) -------------------------------------------
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("pos", ["learned", "rope", "none"])
def test_cached_decoding_matches_full_forward(scheme, pos):
    torch.manual_seed(8)
    kv = 2 if scheme in ("Q-K-V", "Q-K=V", "Id-K=V", "(Q-K=V)+") else None
    cfg = cfg64(attn=scheme, pos=pos, kv_heads=kv)
    model = GPT(cfg).double().eval()
    x = torch.randint(0, 50, (2, 14))
    full = model(x)[0]
    cache = KVCache(cfg, batch_size=2, max_len=20, dtype=torch.float64)
    out = [model(x[:, :5], cache=cache)[0]]
    for t in range(5, 14):
        out.append(model(x[:, t : t + 1], cache=cache)[0])
    torch.testing.assert_close(torch.cat(out, 1), full, rtol=1e-11, atol=1e-11)
    assert cache.bytes_allocated() == kv_cache_bytes_per_token(cfg, "fp32") * 2 * 2 * 20


# ---- encoder ---------------------------------------------------------------------------------
def test_encoder_heads_and_set_permutation_equivariance():
    torch.manual_seed(9)
    cfg = cfg64(attn="Q=K=V", pos="none")
    enc = Encoder(cfg, SetInput(cfg, features=12), head="element").double()
    x = torch.randn(3, 10, 12, dtype=torch.float64)
    perm = torch.randperm(10)
    torch.testing.assert_close(enc(x)[:, perm], enc(x[:, perm]), rtol=1e-12, atol=1e-12)
    vit = Encoder(cfg, PatchInput(cfg, channels=1, image_size=8, patch=4), head="class", n_out=10)
    assert vit(torch.rand(2, 1, 8, 8)).shape == (2, 10)
    tok = Encoder(cfg64(), TokenInput(cfg64()), head="token", n_out=10)
    assert tok(torch.randint(0, 50, (2, 16))).shape == (2, 16, 10)


# ---- accounting -------------------------------------------------------------------------------
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize(
    "extra",
    [
        dict(),
        dict(bias=False, norm="rmsnorm"),
        dict(share_layers=True, norm="none"),
        dict(mlp="swiglu", tie_embeddings=False, pos="rope"),
        dict(match_params="Q-K-V", kv_heads=2),
    ],
)
def test_analytic_params_match_tensors(scheme, extra):
    try:
        cfg = cfg64(attn=scheme, **extra)
    except UserError:
        pytest.skip("this scheme refuses kv_heads < n_head by design")
    assert counted_params(GPT(cfg)) == analytic_params(cfg)


def test_paper_figures():
    def r(p, **kw):
        return report(preset(p, **kw), dtype="bf16", context=32768)

    assert round(r("gpt2-124m")["params_non_embedding"] / 1e6, 2) == 84.95
    assert round(r("gpt2-124m", attn="Id-K-V")["params_non_embedding"] / 1e6, 2) == 77.88
    matched = preset("gpt2-124m", attn="Id-K-V", match_params="Q-K-V")
    assert (
        matched.hidden == 3456
        and round(r("gpt2-124m", attn="Id-K-V", match_params="Q-K-V")["params_non_embedding"] / 1e6, 2) == 84.95
    )
    assert round(r("paperB-300m")["params_total"] / 1e6, 1) == 305.5
    assert round(r("paperB-300m", attn="Q-K=V")["params_total"] / 1e6, 1) == 284.5
    assert round(r("paperB-300m")["params_attention"] / 1e6, 2) == 83.97
    for two in ("Q-K=V", "Q=K-V", "Id-K-V"):
        assert round(r("paperB-300m", attn=two)["params_attention"] / 1e6, 2) == 62.98
    assert round(r("paperB-300m", attn="Q=K=V")["params_attention"] / 1e6, 2) == 41.98
    base = r("paperB-1.2b")["kv_cache_bytes"]
    assert round(base / 1e9, 1) == 5.9
    assert r("paperB-1.2b", attn="Q-K=V", kv_heads=1)["kv_cache_bytes"] * 64 == base
    assert r("paperB-300m", attn="Q-K=V", kv_heads=4)["kv_cache_bytes"] * 8 == r("paperB-300m")["kv_cache_bytes"]


def test_flops_identity_saves_query_matmul():
    a = report(preset("gpt2-124m"))["flops_per_token"]
    b = report(preset("gpt2-124m", attn="Id-K-V"))["flops_per_token"]
    assert a - b == 3 * 2 * 12 * 768 * 768


def test_default_scales():
    assert preset("gpt2-124m").scale == pytest.approx(1 / 8)
    assert preset("gpt2-124m", attn="Id-K-V").scale == pytest.approx(1 / 16)
    assert preset("gpt2-124m", attn="Id-K-V", attn_scale=0.5).scale == 0.5
    assert math.isclose(preset("tiny", attn="Q-Id-V").scale, 1 / (2 * 4))
