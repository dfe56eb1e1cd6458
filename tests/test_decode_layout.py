"""The decode layouts (qkvlab.decode.layout) and the choices that carry them (qkvlab.decode.choices): the
packed products equal F.linear's, the decode-time tree shares the model's parameters and leaves the
model as it was, the default follows the batch, and a real model's layout is timed (fake timings here)
and cached."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from conftest import FakeClock, fake_timer
from qkvlab.base.measured import DECISIONS_FILE
from qkvlab.decode import layout as layout_module
from qkvlab.decode.choices import config_shapes, decode_choices, model_choices
from qkvlab.decode.generate import generate
from qkvlab.decode.layout import (
    LAYOUT_MAX_BATCH,
    LAYOUT_ROWS_MAX_BATCH,
    LAYOUTS,
    PackedLinear,
    PackedProduct,
    layout_ways,
    linear_shapes,
    packed_model,
)
from qkvlab.decode.sampling import Sampling
from qkvlab.model.config import ModelConfig
from qkvlab.model.transformer import GPT


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def make_model(dtype=torch.float32, seed=0, **kw) -> GPT:
    base = dict(attn="Q-K=V", pos="learned", n_layer=2, n_head=4, d_model=32, vocab_size=50, context=24, bias=True)
    torch.manual_seed(seed)
    model = GPT(ModelConfig(**{**base, **kw}).validate()).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.3)
    return model.to(dtype)


def state(model: nn.Module) -> dict:
    """Every module's attributes and every parameter's identity, address and values."""
    modules = {n: (m, dict(vars(m))) for n, m in model.named_modules()}
    params = {n: (p, p.data_ptr(), p.detach().clone()) for n, p in model.named_parameters()}
    return {"modules": modules, "params": params}


def same_state(model: nn.Module, before: dict) -> bool:
    now = state(model)
    params = all(
        p is q and ptr == qtr and torch.equal(v, w)
        for (p, ptr, v), (q, qtr, w) in zip(now["params"].values(), before["params"].values())
    )
    return now["modules"] == before["modules"] and params and now["params"].keys() == before["params"].keys()


@pytest.mark.parametrize("parts", [1, 2, 3, 4])
@pytest.mark.parametrize("lead", [(1,), (3,), (2, 1), (1, 4), (5,)], ids=str)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("order", ["rows", "columns"])
def test_packed_product_equals_the_linear(parts, lead, bias, order):
    """fp64, random weights and inputs: both block orders, every split (3 does not divide 8 outputs:
    one block) and 1-5 rows (5 > max_rows: the Linear's own product) give F.linear's values to 1e-12."""
    torch.manual_seed(parts)
    lin = nn.Linear(6, 8, bias=bias).double()
    x = torch.randn(*lead, 6, dtype=torch.float64)
    product = PackedProduct(lin, parts, max_rows=4, order=order)
    assert product.parts == (parts if 8 % parts == 0 else 1)
    got = product(x)
    assert got.shape == (*lead, 8)
    torch.testing.assert_close(got, F.linear(x, lin.weight, lin.bias), rtol=0, atol=1e-12)
    # laid out row by row: a last dimension of stride 1 is what SDPA's CPU flash kernel takes (the
    # heads of q, k and v are views of this output)
    assert got.is_contiguous()
    with pytest.raises(ValueError, match="order='diagonal'"):
        PackedProduct(lin, parts, order="diagonal")


@pytest.mark.parametrize("layout", ["rows", "columns", "kmajor"])
@pytest.mark.parametrize("tie", [True, False])
def test_the_decode_tree_shares_the_parameters_and_leaves_the_model_as_it_was(layout, tie):
    """A new tree the caller asked for: every Linear a PackedLinear holding the model's own weight and
    bias, everything else the model's own modules; the model's modules, parameters and values are
    untouched, and the tree computes the model's logits (fp64: to 1e-12) at up to LAYOUT_MAX_BATCH rows."""
    model = make_model(torch.float64, tie_embeddings=tie)
    before = state(model)
    tree = packed_model(model, layout, 2)
    assert tree is not model and same_state(model, before)
    linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    packed = dict(tree.named_modules())
    assert all(isinstance(packed[n], PackedLinear) and packed[n].weight is m.weight for n, m in linears.items())
    assert all(packed[n].bias is m.bias for n, m in linears.items())
    assert not any(isinstance(m, nn.Linear) for m in tree.modules())
    no_linear = [n for n, m in model.named_modules() if not any(isinstance(c, nn.Linear) for c in m.modules())]
    assert "tok_emb" in no_linear and all(packed[n] is model.get_submodule(n) for n in no_linear)  # shared as is
    assert [p for p in tree.parameters()] == [p for p in model.parameters()]  # the very same Parameters
    assert tree.lm_head.weight is (model.tok_emb.weight if tie else model.lm_head.weight)
    orders = {(m.product.order, m.product.parts) for m in tree.modules() if isinstance(m, PackedLinear)}
    assert orders == ({("columns", 1)} if layout == "kmajor" else {(layout, 2)})
    x = torch.randint(0, 50, (2, 5))  # 10 rows: the blocks' product
    with torch.no_grad():
        torch.testing.assert_close(tree(x)[0], model(x)[0], rtol=0, atol=1e-12)
    assert packed_model(model, "stored", 2) is model
    assert same_state(model, before)


def test_the_default_layout_follows_the_batch_and_applies_to_cpu_fp32_and_fp64_only():
    model = make_model()
    for batch, order in ((1, "rows"), (LAYOUT_ROWS_MAX_BATCH, "rows"), (LAYOUT_ROWS_MAX_BATCH + 1, "columns")):
        choices = model_choices(model, batch)
        assert (choices.dtype, choices.layout, choices.layout_source) == ("fp32", order, "the default")
        tree = choices.decode_model(model)
        assert {m.product.order for m in tree.modules() if isinstance(m, PackedLinear)} == {order}
    big = model_choices(model, LAYOUT_MAX_BATCH + 1)
    assert big.layout == "stored" and big.decode_model(model) is model  # above 16 rows: as stored
    assert model_choices(model, 2).decode_model(model, rows=LAYOUT_MAX_BATCH + 1) is model
    bf16 = make_model(torch.bfloat16)
    choices = model_choices(bf16, 1)
    assert (choices.dtype, choices.layout) == ("bf16", "stored") and choices.decode_model(bf16) is bf16
    cuda = decode_choices(model.cfg, device="cuda", dtype="fp32", batch=1)
    assert cuda.layout == "stored"
    assert config_shapes(model.cfg) == linear_shapes(model)  # shapes from the config, on the meta device
    assert "layout rows x 1 for 1 rows (the default)" in model_choices(model, 1).describe()


def test_a_real_models_layout_is_timed_cached_and_decodes_to_the_same_tokens(monkeypatch, tmp_path):
    """Past LAYOUT_PROBE_MIN_BYTES of weights the layout is timed (here: fake timings that make each
    layout win in turn), its record in the choices, cached for the next decode; whatever wins, the
    tokens are the model's and the model is untouched."""
    monkeypatch.setattr(layout_module, "LAYOUT_PROBE_MIN_BYTES", 0)
    monkeypatch.setattr(layout_module, "LAYOUT_PROBE_BYTES", 1 << 14)
    model = make_model(torch.float64)
    before = state(model)
    want = generate(
        model, [[1, 2, 3], [4, 5]], 6, Sampling(temperature=0.0), choices=model_choices(model, 2, layout="stored")
    )
    clock = FakeClock()
    for winner in ("rows", "stored", "columns", "kmajor"):
        seconds = {o: 0.001 if o == winner else 0.002 for o in LAYOUTS}
        monkeypatch.setattr(layout_module, "layout_ways", lambda *a, s=seconds: clock.ways(**s))
        cache = tmp_path / winner / DECISIONS_FILE
        choices = decode_choices(model.cfg, dtype="fp64", batch=2, parts=2, shapes=linear_shapes(model),
                                 timer=fake_timer(clock), cache=cache)  # fmt: skip
        record = choices.layout_decision
        assert (choices.layout, choices.layout_source, record.source) == (winner, "timed", "measured now")
        assert record.key.startswith("layout-float64-cpu-r2-p2-") and record.default == "rows"
        assert set(record.ms) == set(LAYOUTS) and "timed, measured now" in choices.describe()
        assert generate(model, [[1, 2, 3], [4, 5]], 6, Sampling(temperature=0.0), choices=choices) == want
        again = decode_choices(model.cfg, dtype="fp64", batch=2, parts=2, shapes=linear_shapes(model),
                               timer=fake_timer(clock), cache=cache)  # fmt: skip
        assert (again.layout, again.layout_decision.source) == (winner, "cached")
        assert again.record()["layout_decision"]["key"] == record.key
    assert same_state(model, before)


def test_the_real_layout_ways_compute_the_products_each_way():
    ways = layout_ways([(8, 6), (4, 8)], "fp32", 2, 2)
    assert list(ways) == list(LAYOUTS)
    for way in ways.values():
        way()  # each runs; their times are measured.alternate's business
