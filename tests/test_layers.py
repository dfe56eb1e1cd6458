"""Per-layer schemes (ModelConfig.layers): the notation, accounting against real modules and the
allocated cache, cached decoding against the full forward, convert --layer, HF export."""

from __future__ import annotations

import pytest
import torch

from qkvlab.base.errors import UserError
from qkvlab.convert.reparam import check, convert
from qkvlab.model.accounting import analytic_params, counted_params, flops_per_token, kv_cache_bytes_per_token
from qkvlab.model.cache import KVCache
from qkvlab.model.config import ModelConfig
from qkvlab.model.spec import KNOWN_SCHEMES, format_kv_heads, format_layers, parse_kv_heads, parse_layers, parse_scheme
from qkvlab.model.transformer import GPT
from qkvlab.model.variants import parse_variant


def cfg(**kw) -> ModelConfig:
    base = dict(n_layer=4, n_head=4, d_model=32, vocab_size=50, context=24)
    base.update(kw)
    return ModelConfig(**base).validate()


# ---- notation ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "text,expected",
    [
        ("Q-K=V@every2", ["Q-K-V", "Q-K=V", "Q-K-V", "Q-K=V"]),
        ("Q-K=V@0,-1", ["Q-K=V", "Q-K-V", "Q-K-V", "Q-K=V"]),
        ("Q-K=V@-2:", ["Q-K-V", "Q-K-V", "Q-K=V", "Q-K=V"]),
        ("Q-K=V@::3; Id-K-V@0", ["Id-K-V", "Q-K-V", "Q-K-V", "Q-K=V"]),  # later overrides win
        ("q-k=v|Q-K-V|Q-K=V|Q-K-V", ["Q-K=V", "Q-K-V", "Q-K=V", "Q-K-V"]),
    ],
)
def test_layer_patterns(text, expected):
    table = parse_layers(text, n_layer=4, n_head=4, attn="Q-K-V", kv_heads=None)
    assert [s for s, _ in table] == expected
    assert parse_layers(format_layers(table), n_layer=4, n_head=4, attn="Q-K-V", kv_heads=None) == table
    short = format_layers(table, ("Q-K-V", None))  # overrides of the base, e.g. "Q-K=V@1,3"
    assert "@" in short and parse_layers(short, n_layer=4, n_head=4, attn="Q-K-V", kv_heads=None) == table


def test_kv_heads_per_layer():
    table = parse_layers("/MQA@-1; Q-K=V/2@0; /MHA@1", n_layer=4, n_head=4, attn="Q-K-V", kv_heads=2)
    assert table == (("Q-K=V", 2), ("Q-K-V", 4), ("Q-K-V", 2), ("Q-K-V", 1))


@pytest.mark.parametrize(
    "changes,needle",
    [
        (dict(layers="Q-K=V@4"), "layer 4 is out of range"),
        (dict(layers="Q-K=V|Q-K-V"), "lists 2 layers"),
        (dict(layers="Q-K=V@"), "must be ENTRY@SEL"),
        (dict(layers="Q-K=V@x"), "selection 'x'"),
        (dict(layers="Q-K=V/0@1"), "kv heads '0'"),
        (dict(layers="Q-X=V@1"), "not one of"),
        (dict(layers="Q-K=V/3@1"), "layer 1: kv_heads=3 must divide"),
        (dict(layers="Q=K-V/2@1"), "layer 1: Q=K-V"),
        (dict(layers="Q-K=V@1", share_layers=True), "share_layers"),
        (dict(layers="Q-K=V@1|Q-K-V"), "mixes"),
        (dict(layers="Q-K=V@4:"), "names no layer"),
        (dict(layers="Q-K=V@5:"), "reaches past the model's 4 layers"),
        (dict(layers="Q-K=V@-5:"), "reaches past the model's 4 layers"),
        (dict(layers=" "), "empty"),
    ],
)
def test_bad_layer_patterns_one_line(changes, needle):
    with pytest.raises(UserError) as e:
        cfg(**changes)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_one_scheme_config_unchanged():
    c = cfg(attn="Q-K=V", kv_heads=2)
    assert c.layer_config(3) is c and "layers" in c.to_dict() and c.layers is None
    old = {k: v for k, v in c.to_dict().items() if k != "layers"}  # a config.json written before the field
    assert ModelConfig.from_dict(old) == c


# ---- accounting equals the real modules and the allocated cache --------------------------------
MIXED = [
    dict(layers="Q-K=V@every2"),
    dict(layers="Q-K=V/MQA@-2:; Id-K-V@0", kv_heads=2, bias=True),
    dict(layers="Q-K=V|Q-K-V/1|(Q=K-V)+|Id-K=V/2", pos="rope"),
    dict(layers="Q-Id-V@1; Q-K=V/2@2,3", pos="rope", mlp="swiglu", tie_embeddings=False),
    dict(layers="Q-K=V/1@0", attn="Id-K-V", match_params="Q-K-V"),
]


@pytest.mark.parametrize("kw", MIXED)
def test_info_equals_modules_and_cache(kw):
    c = cfg(**kw)
    model = GPT(c)
    assert analytic_params(c) == counted_params(model)
    cache = KVCache(c, 3, 7, dtype=torch.bfloat16)
    assert kv_cache_bytes_per_token(c, "bf16") * 3 * 7 == cache.bytes_allocated()
    # each layer's cache holds that layer's kv heads and distinct tensors
    for lc, layer in zip(c.layer_configs(), cache.layers):
        store = layer.store
        assert len(store) == len(lc.spec.cached_sources())
        assert all(t.shape[1] == lc.n_kv_heads for t in store.values())
    assert flops_per_token(c) > 0


def test_per_layer_saves_what_it_should():
    base, mixed = cfg(), cfg(layers="Q-K=V@every2")
    d = base.d_model
    assert analytic_params(base).total - analytic_params(mixed).total == 2 * d * d
    assert kv_cache_bytes_per_token(mixed) * 4 == kv_cache_bytes_per_token(base) * 3


# ---- cached decoding equals the full forward -----------------------------------------------------
@pytest.mark.parametrize("kw", MIXED)
@pytest.mark.parametrize("prefill,static", [(1, False), (5, False), (5, True)])
def test_cached_decode_equals_forward_float64(kw, prefill, static):
    from qkvlab.decode.steps import decode_step

    c = cfg(**kw)
    torch.manual_seed(0)
    model = GPT(c).double().eval()
    idx = torch.randint(0, c.vocab_size, (2, 11))
    with torch.no_grad():
        full, _ = model(idx)
        cache = KVCache(c, 2, 11, dtype=torch.float64, static=static)
        outs = [model(idx[:, :prefill], cache=cache)[0]]
        for t in range(prefill, 11):
            if static:  # the static-shape decode step (fixed-size cache reads, mask from the slots)
                outs.append(decode_step(model, cache, idx[:, t], torch.full((2,), t))[:, None])
            else:
                outs.append(model(idx[:, t : t + 1], cache=cache)[0])
    assert (torch.cat(outs, 1) - full).abs().max().item() <= 1e-12


# ---- convert --layer really removes the projection ----------------------------------------------
@pytest.mark.parametrize("tied,skip", [(False, True), (True, True), (False, False)])
def test_convert_layer_removes_wq(tied, skip):
    c = cfg(norm="none", n_layer=3, tie_embeddings=tied, mlp_skip=skip)
    torch.manual_seed(1)
    model = GPT(c).double().eval()
    with torch.no_grad():  # O(1) weights, projections with singular values in [0.5, 1.5] (cond <= 3)
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, p.shape[1] ** -0.5)
        for block in model.trunk.blocks:
            for w in block.attn.in_proj.weight.split(block.attn.proj_widths):
                u, _, vh = torch.linalg.svd(torch.randn_like(w), full_matrices=False)
                w.copy_(u @ torch.diag(torch.empty(vh.shape[0], dtype=w.dtype).uniform_(0.5, 1.5)) @ vh)
    res = convert(model, c, "Id-K-V", layer=1)
    assert res.cfg.layers is not None and res.cfg.layer_config(1).spec.name == "Id-K-V"
    assert check(model, res.model, torch.float64)[1] <= 1e-9
    before, after = counted_params(model), counted_params(res.model)
    assert before.attention - after.attention == c.d_model**2
    if not tied:
        assert before.total - after.total == c.d_model**2
    if skip:  # theorem (a): one basis for the whole stream, layer 1's identity query fixes it
        with pytest.raises(UserError, match="layer 1 already has an identity role"):
            convert(res.model, res.cfg, "Id-K-V", layer=2)
        return
    # theorem (b): every layer has its own basis, so a second layer converts too
    res2 = convert(res.model, res.cfg, "Id-K-V", layer=2)
    assert [lc.spec.name for lc in res2.cfg.layer_configs()] == ["Q-K-V", "Id-K-V", "Id-K-V"]
    assert counted_params(res.model).attention - counted_params(res2.model).attention == c.d_model**2
    assert check(model, res2.model, torch.float64)[1] <= 1e-9
    with pytest.raises(UserError, match="different role changes|exactly one role"):
        convert(res2.model, res2.cfg, "Q-K-V")


# ---- Hugging Face export --------------------------------------------------------------------------
@pytest.mark.parametrize(
    "fmt,kw",
    [
        ("llama", dict(layers="Q-K=V@every2; /1@0", kv_heads=2, norm="rmsnorm", pos="rope", mlp="swiglu")),
        ("gpt2", dict(layers="Q-K=V/2@1; Id-K-V@2", bias=True)),
    ],
)
def test_hf_export_per_layer(fmt, kw):
    tf = pytest.importorskip("transformers")
    tf.utils.logging.set_verbosity_error()
    from qkvlab.convert.hf import to_hf
    from qkvlab.convert.reparam import logit_diff

    c = cfg(**kw)
    torch.manual_seed(2)
    model = GPT(c).double().eval()
    hf = to_hf(model, c, fmt)
    tol = 1e-6 if fmt == "llama" else 1e-9  # transformers computes Llama's rotary tables in float32
    assert logit_diff(model, hf, c.vocab_size, c.context)[1] <= tol
    if fmt == "llama":
        assert hf.config.num_key_value_heads == 2  # the MQA layer's head repeated


# ---- one kv-heads notation for variants and per-layer entries -----------------------------------
@pytest.mark.parametrize(
    "text,n_head,kv",
    [("MQA", 4, 1), ("mqa", None, 1), ("GQA-2", 4, 2), ("gqa2", 4, 2), ("2", 4, 2), ("MHA", 4, 4), ("MHA", None, None)],
)
def test_kv_heads_forms(text, n_head, kv):
    assert parse_kv_heads(text, n_head) == kv
    if kv is not None:
        assert parse_kv_heads(format_kv_heads(kv, n_head), n_head) == kv


@pytest.mark.parametrize("text", ["0", "GQA-0", "XQA", "GQA", "-2", "2.5", ""])
def test_kv_heads_refused_naming_the_forms(text):
    with pytest.raises(UserError, match="MQA, GQA-g, MHA or a count"):
        parse_kv_heads(text, 4)


@pytest.mark.parametrize("scheme", list(KNOWN_SCHEMES))
@pytest.mark.parametrize("kv", [None, 1, 2, 4])
def test_variant_and_layer_spell_kv_heads_alike(scheme, kv):
    """Variants and per-layer entries write kv heads the same way, and each reads the other's."""
    layer = format_layers(((scheme, kv),))  # a one-layer '|' list is one ENTRY
    variant = parse_variant(layer)
    assert (variant.scheme, variant.kv_heads) == (parse_scheme(scheme).name, kv)
    assert variant.name == layer == format_layers(((variant.scheme, variant.kv_heads),))
    assert parse_layers(variant.name, n_layer=1, n_head=4, attn="Q-K-V", kv_heads=None) == ((variant.scheme, kv),)
    if kv is not None:  # the older per-layer form (a bare count) is read by both
        old = f"{scheme}/{kv}"
        assert parse_variant(old) == variant
        assert parse_layers(old, n_layer=1, n_head=4, attn="Q-K-V", kv_heads=None) == ((variant.scheme, kv),)


@pytest.mark.parametrize("kw", MIXED)
def test_layer_notation_round_trips(kw):
    c = cfg(**kw)
    table = c.layer_table()
    for base in (None, (c.attn, c.kv_heads)):
        text = format_layers(table, base) if table != ((c.attn, c.kv_heads),) * c.n_layer else None
        if text is not None:
            assert "/1" not in text and "/2" not in text  # written canonically: /MQA, /GQA-2
            assert parse_layers(text, n_layer=c.n_layer, n_head=c.n_head, attn=c.attn, kv_heads=c.kv_heads) == table


def test_gelu_takes_the_faster_cpu_kernel_and_stays_exact_gelu():
    """qkvlab.model.transformer.gelu: ATen's kernel up to GELU_ATEN_MAX elements (oneDNN's costs ~20 us a call),
    oneDNN's beyond; both are exact GELU (float32 within 2e-6, float64 identical), the oneDNN switch
    is restored after every call, and a user's own disabling of it is left alone."""
    import torch.nn.functional as F

    from qkvlab.model.transformer import GELU_ATEN_MAX, gelu

    for n in (7, 1536, GELU_ATEN_MAX, GELU_ATEN_MAX + 1):
        x = torch.randn(n, generator=torch.Generator().manual_seed(n)) * 4
        torch.testing.assert_close(gelu(x), F.gelu(x), rtol=0, atol=2e-6)
        assert torch.equal(gelu(x.double()), F.gelu(x.double()))
        assert torch.backends.mkldnn.enabled
    small = torch.randn(64)
    torch.backends.mkldnn.enabled = False
    try:
        assert torch.equal(gelu(small), F.gelu(small)) and not torch.backends.mkldnn.enabled
    finally:
        torch.backends.mkldnn.enabled = True
    x = torch.randn(3, 5, requires_grad=True)
    gelu(x).sum().backward()  # differentiable like F.gelu
    y = x.detach().clone().requires_grad_()
    F.gelu(y).sum().backward()
    torch.testing.assert_close(x.grad, y.grad, rtol=0, atol=2e-6)
