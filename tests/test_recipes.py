"""The papers' recipes exactly (issue 10): the '+' term's 2D encoding, post-norm blocks, fixed
sinusoidal input positions, MLP output heads, Paper A's lr horizon, the paper recipes as data."""

from __future__ import annotations

import math
import random
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch

from qkvlab.analysis import paper_claims as pc
from qkvlab.analysis import paper_figures as pf
from qkvlab.analysis import rules
from qkvlab.analysis.verdicts import REPRODUCED, check_claims
from qkvlab.base.config_file import read_config_file
from qkvlab.base.errors import UserError
from qkvlab.base.settings import load
from qkvlab.compare import CompareConfig, plan
from qkvlab.compare.recipes import CACHE_FRACTIONS, CACHE_ROUTES, LM_CACHE_RECIPE
from qkvlab.model.accounting import kv_cache_bytes_per_token
from qkvlab.model.config import ModelConfig
from qkvlab.model.positions import ScoreTerm2D, encoding_2d
from qkvlab.model.transformer import GPT, Encoder, TokenInput
from qkvlab.train.config import TrainConfig
from qkvlab.train.optim import lr_at


# ---- the "+" term's encoding ----------------------------------------------------------------
def reference_encoding_2d(rows: int, cols: int, m: int) -> np.ndarray:
    """PositionalEncoding2D(m) written out from its definition, one entry at a time: c = 2*ceil(m/4),
    f_k = 10000^(-2k/c); channel 2k / 2k+1 = sin / cos(i f_k), channel c+2k / c+2k+1 the same of j;
    the first m channels."""
    c = 2 * math.ceil(m / 4)
    out = np.zeros((rows, cols, 2 * c))
    for i in range(rows):
        for j in range(cols):
            for k in range(c // 2):
                f = 10000.0 ** (-2.0 * k / c)
                out[i, j, 2 * k], out[i, j, 2 * k + 1] = math.sin(i * f), math.cos(i * f)
                out[i, j, c + 2 * k], out[i, j, c + 2 * k + 1] = math.sin(j * f), math.cos(j * f)
    return out[:, :, :m]


@pytest.mark.parametrize("m", [10, 50])
@pytest.mark.parametrize("T", [16, 64, 128])
def test_encoding_2d_matches_the_original_formula(m, T):
    got = encoding_2d(T, T, m)
    assert got.shape == (T, T, m) and got.dtype == torch.float64
    np.testing.assert_allclose(got.numpy(), reference_encoding_2d(T, T, m), rtol=0, atol=1e-12)


def test_encoding_2d_channel_split_and_rectangles():
    # m = 10: 6 row channels (depend on i only), 4 column channels (j only); frequencies 1, 10000^(-1/3), ...
    p = encoding_2d(5, 7, 10)
    assert p.shape == (5, 7, 10)
    assert torch.equal(p[:, :1, :6].expand(5, 7, 6), p[:, :, :6]) and torch.equal(
        p[:1, :, 6:].expand(5, 7, 4), p[:, :, 6:]
    )
    assert p[0, 3, 8].item() == pytest.approx(math.sin(3 * 10000 ** (-1 / 3)), abs=1e-15)
    np.testing.assert_allclose(encoding_2d(9, 4, 50).numpy(), reference_encoding_2d(9, 4, 50), rtol=0, atol=1e-12)
    halves = encoding_2d(6, 6, 10, "halves")  # the Brainchip reconstruction: 5 + 5, frequencies over 5
    assert halves[2, 3, 5].item() == pytest.approx(math.sin(3.0), abs=1e-15)
    assert halves[2, 3, 7].item() == pytest.approx(math.sin(3 * 10000 ** (-2 / 5)), abs=1e-15)


@pytest.mark.parametrize("encoding", ["original", "halves"])
@pytest.mark.parametrize("m", [10, 50])
def test_score_term_is_linear_map_of_encoding(encoding, m):
    """a(i) + c(j) = P[i, j] . w with P = encoding_2d, at arbitrary (cached) positions (the Linear's
    bias cancels under softmax and is not a parameter: positions.ScoreTerm2D)."""
    torch.manual_seed(0)
    term = ScoreTerm2D(m, 40, encoding).double()
    q_pos, k_pos = torch.randint(0, 40, (2, 7)), torch.randint(0, 40, (2, 11))
    P = encoding_2d(40, 40, m, encoding)
    want = P[q_pos[:, :, None], k_pos[:, None, :]] @ term.weight.detach()  # (B, T, S)
    a, c = term.row_col_terms(q_pos, k_pos)
    torch.testing.assert_close(a[:, :, None] + c[:, None, :], want, rtol=0, atol=1e-13)
    torch.testing.assert_close(term.key_term(k_pos), c, rtol=0, atol=0)


def test_plus_encoding_is_a_model_option():
    cfg = ModelConfig(attn="(Q=K-V)+", n_layer=1, n_head=2, d_model=16, vocab_size=20, context=12)
    assert GPT(cfg).trunk.blocks[0].attn.score_term.n_row == 6
    assert GPT(cfg.replace(plus_encoding="halves")).trunk.blocks[0].attn.score_term.n_row == 5
    with pytest.raises(UserError, match="plus_encoding='quarters'"):
        cfg.replace(plus_encoding="quarters").validate()


# ---- post-norm blocks, sinusoidal input positions, MLP heads ----------------------------------
def test_post_norm_block_formula():
    torch.manual_seed(1)
    cfg = ModelConfig(n_layer=1, n_head=2, d_model=16, vocab_size=20, context=8, norm_position="post", causal=False)
    model = GPT(cfg).double()
    blk = model.trunk.blocks[0]
    x = torch.randn(2, 8, 16, dtype=torch.float64)
    pos = torch.arange(8)[None]
    h = blk.norm1(x + blk.attn(x, q_pos=pos))
    want = blk.norm2(h + blk.mlp(h))
    torch.testing.assert_close(blk(x, q_pos=pos), want, rtol=0, atol=0)
    assert isinstance(model.trunk.norm, torch.nn.Identity)  # post-norm blocks end normalised
    from qkvlab.model.accounting import analytic_params, counted_params

    assert analytic_params(cfg) == counted_params(model) and analytic_params(
        cfg.replace(norm_position="pre")
    ).total == (counted_params(model).total + 16)
    with pytest.raises(UserError, match="norm_position=post"):
        cfg.replace(mlp_skip=False).validate()


def test_sinusoidal_input_positions():
    cfg = ModelConfig(n_layer=1, n_head=2, d_model=6, vocab_size=10, context=5, pos="sinusoidal", causal=False)
    inp = TokenInput(cfg).double()
    ids = torch.tensor([[1, 2, 3, 4]])
    got = inp(ids) - inp.emb(ids)
    for t in range(4):
        for k in range(3):
            f = 10000.0 ** (-2 * k / 6)
            assert got[0, t, 2 * k].item() == pytest.approx(math.sin(t * f), abs=1e-7)
            assert got[0, t, 2 * k + 1].item() == pytest.approx(math.cos(t * f), abs=1e-7)
    assert not any("pos" in name for name, _ in inp.named_parameters())  # fixed, not learned
    torch.manual_seed(3)
    gpt = GPT(cfg.replace(causal=True)).double()
    plain = GPT(cfg.replace(causal=True, pos="none")).double()
    plain.load_state_dict(gpt.state_dict())
    torch.testing.assert_close(gpt.pos_fixed.table, inp.pos_fixed.table)  # one table for both model kinds
    x = torch.randint(0, 10, (1, 5))
    assert not torch.allclose(gpt(x)[0], plain(x)[0])


def test_mlp_heads():
    torch.manual_seed(2)
    base = ModelConfig(n_layer=1, n_head=2, d_model=8, vocab_size=10, context=4, mlp="relu", causal=False)
    lin = Encoder(base, TokenInput(base), head="token", n_out=10)
    assert isinstance(lin.head, torch.nn.Linear)
    mlp = Encoder(base.replace(head="norm_mlp"), TokenInput(base), head="token", n_out=10)
    kinds = [type(m).__name__ for m in mlp.head]
    assert kinds == ["Linear", "LayerNorm", "ReLU", "Identity", "Linear"]
    vit = Encoder(base.replace(head="mlp", mlp="gelu", dropout=0.1), TokenInput(base), head="class", n_out=3)
    assert [type(m).__name__ for m in vit.head] == ["Linear", "GELU", "Dropout", "Linear"]
    assert vit(torch.randint(0, 10, (2, 4))).shape == (2, 3)
    with pytest.raises(UserError, match="head='mlp'"):
        GPT(base.replace(head="mlp", causal=True))


# ---- Paper A's schedule -------------------------------------------------------------------------
def test_gpt2_lr_horizon():
    cfg = TrainConfig.from_dict({"preset": "gpt2-124m"})
    assert (cfg.max_steps, cfg.lr_decay_steps, cfg.decay_steps, cfg.warmup_steps) == (105_001, 600_000, 600_000, 2000)
    kw = dict(lr=cfg.lr, min_lr=cfg.final_lr, warmup=cfg.warmup_steps, total=cfg.decay_steps)
    last = lr_at(cfg.max_steps - 1, **kw)
    assert last == pytest.approx(5.6e-4, abs=0.05e-4)
    assert lr_at(600_000, **kw) == pytest.approx(6e-5)
    assert (
        TrainConfig.from_dict({"preset": "tiny"}).decay_steps == TrainConfig.from_dict({"preset": "tiny"}).max_steps
    )  # None: the horizon is max_steps
    with pytest.raises(UserError, match="lr_decay_steps"):
        TrainConfig.from_dict({"preset": "tiny", "lr_decay_steps": 0})


# ---- similarity as Paper B measures it: linear CKA of projection outputs ----------------------
def numpy_cka(x: np.ndarray, y: np.ndarray) -> float:
    x, y = x - x.mean(0), y - y.mean(0)
    return float(np.linalg.norm(y.T @ x) ** 2 / (np.linalg.norm(x.T @ x) * np.linalg.norm(y.T @ y)))


@pytest.mark.parametrize("shape", [(50, 8, 8), (200, 24, 8), (64, 16, 40)])
def test_linear_cka_properties(shape):
    from qkvlab.analysis.similarity import linear_cka

    n, p, q = shape
    g = torch.Generator().manual_seed(n + p + q)
    x = torch.randn(n, p, generator=g, dtype=torch.float64)
    y = x[:, :1].repeat(1, q) * 0.5 + torch.randn(n, q, generator=g, dtype=torch.float64)
    want = numpy_cka(x.numpy(), y.numpy())
    assert linear_cka(x, y) == pytest.approx(want, rel=1e-12) and 0 < want < 1
    assert linear_cka(x, x) == pytest.approx(1.0, rel=1e-12)
    assert linear_cka(x, y) == pytest.approx(linear_cka(y, x), rel=1e-12)
    rot, _ = torch.linalg.qr(torch.randn(q, q, generator=g, dtype=torch.float64))  # orthogonal
    shifted = 3.7 * y @ rot + torch.randn(q, generator=g, dtype=torch.float64)  # + isotropic scale, offset
    assert linear_cka(x, shifted) == pytest.approx(want, rel=1e-10)
    stretch = y * torch.linspace(0.1, 3, q, dtype=torch.float64)  # not invariant to anisotropic scaling
    assert abs(linear_cka(x, stretch) - want) > 1e-3


def test_activation_cka_of_a_model():
    """Outputs are taken before rotary with the bias; shared roles give 1; GQA widths differ."""
    from qkvlab.analysis.similarity import activation_cka, role_outputs, similarity

    torch.manual_seed(4)
    cfg = ModelConfig(n_layer=2, n_head=4, kv_heads=2, d_model=32, vocab_size=50, context=16, pos="rope", bias=True)
    model = GPT(cfg).double().eval()
    ids = torch.randint(0, 50, (3, 16))
    outs = role_outputs(model, cfg, ids)
    attn = model.trunk.blocks[1].attn
    pos = torch.arange(16)[None]
    h = model.trunk.blocks[0](model.tok_emb(ids), q_pos=pos, rope=model.trunk.rotary.cos_sin(pos, torch.float64))
    x = model.trunk.blocks[1].norm1(h)
    q, k, v = attn.in_proj(x).detach().split(attn.proj_widths, dim=-1)  # the fused projection, bias included
    for role, want in zip("qkv", (q, k, v)):
        torch.testing.assert_close(outs[1][role], want.reshape(48, -1), rtol=0, atol=1e-12)
    assert outs[1]["q"].shape == (48, 32) and outs[1]["k"].shape == (48, 16)
    c = activation_cka(model, cfg, ids)
    assert c["layers"][1]["k_v"] == pytest.approx(numpy_cka(k.reshape(48, -1).numpy(), v.reshape(48, -1).numpy()))
    assert c["tokens"] == 48 and c["k_v"] == pytest.approx((c["layers"][0]["k_v"] + c["layers"][1]["k_v"]) / 2)
    shared = GPT(cfg.replace(attn="Q-K=V")).double().eval()
    rep = similarity(shared, shared.cfg, ids)
    assert rep["cka"]["k_v"] == pytest.approx(1.0, abs=1e-12) and rep["cka"]["q_k"] < 1
    ident = GPT(cfg.replace(attn="Id-K-V", kv_heads=None, pos="learned")).double().eval()
    assert 0 < similarity(ident, ident.cfg, ids)["cka"]["q_k"] < 1  # the identity query is the input


def test_similarity_cli_cka(tmp_path, capsys):
    from qkvlab.cli import main
    from qkvlab.model.folder import save_model

    torch.manual_seed(5)
    cfg = ModelConfig(n_layer=2, n_head=2, d_model=16, vocab_size=256, context=32)
    save_model(tmp_path / "m", GPT(cfg), cfg)
    text = tmp_path / "t.txt"
    text.write_text("Call me Ishmael. Some years ago, never mind how long precisely, I went to sea. " * 4)
    assert (
        main(
            [
                "similarity",
                str(tmp_path / "m"),
                "--text",
                str(text),
                "--tokens",
                "100",
                "--tokenizer",
                "bytes",
                "--json",
            ]
        )
        == 0
    )
    import json

    rep = json.loads(capsys.readouterr().out)
    assert rep["cka"]["tokens"] == 96 and set(rep["cka"]) >= {"k_v", "q_k", "q_v", "layers"}  # 3 rows of 32
    assert len(rep["cka"]["layers"]) == 2 and all(0 < rep["cka"][k] <= 1 for k in ("k_v", "q_k", "q_v"))
    assert main(["similarity", str(tmp_path / "m"), "--text", str(text), "--tokens", "1", "--tokenizer", "bytes"]) == 2
    assert "--tokens: 1 must be >= 2" in capsys.readouterr().err


# ---- the paper recipes as data ------------------------------------------------------------------
def test_synthetic_paper_recipe_builds_a_config():
    from qkvlab.tasks.synthetic import paper_recipe

    over = paper_recipe("reverse", {"d_model": 64})
    cfg = TrainConfig.from_dict({"preset": "tiny", "task": "reverse", "task_options": {"length": 16}, **over})
    m = cfg.model
    assert (m.norm_position, m.pos, m.mlp, m.hidden, m.dropout, m.head) == (
        "post",
        "sinusoidal",
        "relu",
        128,
        0.1,
        "norm_mlp",
    )
    assert (cfg.max_steps, cfg.batch_size, cfg.lr, cfg.final_lr, cfg.warmup_steps) == (780, 128, 1e-3, 0.0, 5)
    assert (cfg.weight_decay, cfg.grad_clip, cfg.betas) == (0.0, 5.0, (0.9, 0.999))
    assert paper_recipe("sort", {"d_model": 256, "n_train": 1000})["max_steps"] == 2 * 7


def test_vision_paper_recipe_and_grid():
    from qkvlab.tasks.vision import DEFAULT_PATCH, PAPER_GRID, paper_recipe

    over = paper_recipe("cifar10", {"d_model": 256, "lr": 1e-4})
    cfg = TrainConfig.from_dict({"preset": "tiny", "task": "digits", **over})
    assert (cfg.model.hidden, cfg.model.head, cfg.model.norm_position, cfg.model.mlp) == (256, "mlp", "pre", "gelu")
    assert cfg.model.scale == pytest.approx(1 / 16)  # d_model^-1/2, not d_head^-1/2
    assert (cfg.max_steps, cfg.batch_size, cfg.lr, cfg.final_lr, cfg.weight_decay) == (40 * 351, 128, 1e-4, 1e-4, 0.01)
    assert paper_recipe("mnist", {"d_model": 64, "lr": 1e-3})["max_steps"] == 20 * 270  # 20 epochs of 54k
    with pytest.raises(UserError, match="n_train"):  # a dataset without a known training-set size
        paper_recipe("tinyimagenet", {"d_model": 64, "lr": 1e-3})
    assert paper_recipe("tinyimagenet", {"d_model": 64, "lr": 1e-3, "n_train": 12_800})["max_steps"] == 50 * 100
    from qkvlab.tasks import anomaly

    a = TrainConfig.from_dict({"preset": "tiny", **anomaly.paper_recipe(), "task": "anomaly", "task_options": {}})
    assert (a.max_steps, a.batch_size, a.lr, a.warmup_steps, a.grad_clip) == (100 * 703, 64, 5e-4, 100, 2.0)
    assert (a.model.d_model, a.model.hidden, a.model.norm_position, a.model.head) == (256, 512, "post", "norm_mlp")
    # the grid's patches: 4 and the image's own (None -> DEFAULT_PATCH: 7 on 28 px, 8 on 32 px)
    assert PAPER_GRID["patch"] == (4, None) and (DEFAULT_PATCH[28], DEFAULT_PATCH[32]) == (7, 8)
    for side in (28, 32):
        assert all(side % (p or DEFAULT_PATCH[side]) == 0 for p in PAPER_GRID["patch"])


# ---- set-anomaly inputs -------------------------------------------------------------------------
@pytest.fixture
def feature_cache(isolated_cache):
    return isolated_cache / "features"


def test_anomaly_encoder_features_are_disjoint_frozen_and_cached(feature_cache, monkeypatch):
    from qkvlab.data import features as F
    from qkvlab.tasks import get_task

    kw = dict(n_train=200, n_val=40, n_test=40, encoder_steps=20)
    t = get_task("anomaly", **kw)  # digits: the encoder learns classes 0-4, the sets use 5-9
    assert t.features == 64 and t.batch(0, 3, 0)[0].shape == (3, 10, 64)
    assert all(set(t.labels[s].unique().tolist()) == {5, 6, 7, 8, 9} for s in ("train", "val", "test"))
    assert len(list(feature_cache.iterdir())) == 1
    net = F.train_encoder(*_encoder_data(t), 20)  # the same training, run again: the same features
    torch.testing.assert_close(F.encoder_features(net, t.images["test"].x), _all_test_features(feature_cache))
    calls = []
    monkeypatch.setattr(F, "train_encoder", lambda *a, **k: calls.append(1))
    again = get_task("anomaly", **kw)  # read from the cache: no training
    assert not calls and torch.equal(again.batch(0, 3, 0)[0], t.batch(0, 3, 0)[0])
    x = t.rows("train", torch.arange(len(t.sets["train"][1])))[0]
    assert abs(float(x.mean())) < 0.1  # standardised with the training split's statistics


def _encoder_data(t):
    tr = t.images["train"]
    own = (tr.y < 5).nonzero().flatten()
    return tr.x[own], tr.y[own]


def _all_test_features(folder):
    from safetensors.torch import load_file

    (key,) = list(folder.iterdir())
    return load_file(str(key / "features.safetensors"))["test"]


def test_anomaly_feature_options_refused():
    from qkvlab.tasks import get_task

    for options, match in [
        ({"features": "hog"}, "features='hog'"),
        ({"features": "resnet34"}, "weights goes with features=resnet34"),
        ({"weights": "/x.pth"}, "weights goes with features=resnet34"),
        ({"features": "resnet34", "weights": "/nonexistent.pth"}, "no such file"),
        ({"encoder_steps": 0}, "encoder_steps=0"),
    ]:
        with pytest.raises(UserError, match=match):
            get_task("anomaly", **options)


def test_read_state_dict_formats(tmp_path):
    from safetensors.torch import save_file

    from qkvlab.data.features import read_state_dict

    state = {"conv1.weight": torch.randn(4, 3, 3, 3), "fc.bias": torch.zeros(2)}
    save_file(state, str(tmp_path / "w.safetensors"))
    torch.save(state, tmp_path / "w.pth")
    torch.save({"state_dict": state}, tmp_path / "wrapped.pth")
    for name in ("w.safetensors", "w.pth", "wrapped.pth"):
        got = read_state_dict(tmp_path / name)
        assert got.keys() == state.keys() and all(torch.equal(got[k], state[k]) for k in state)
    (tmp_path / "bad.pth").write_bytes(b"not a checkpoint")
    with pytest.raises(UserError, match="not a readable state dict"):
        read_state_dict(tmp_path / "bad.pth")


def write_fake_cifar100(root, n_train=60, n_test=30):
    """CIFAR-100 binary records: coarse label, fine label, 3072 pixel bytes."""
    folder = root / "cifar-100-binary"
    folder.mkdir(parents=True)
    g = np.random.default_rng(0)
    for split, n in (("train", n_train), ("test", n_test)):
        rec = np.zeros((n, 3074), np.uint8)
        rec[:, 1] = np.arange(n) % 4  # 4 fine classes
        rec[:, 0] = rec[:, 1] // 2
        rec[:, 2:] = g.integers(0, 256, (n, 3072))
        (folder / f"{split}.bin").write_bytes(rec.tobytes())
    return folder


def test_anomaly_resnet34_features_exact(tmp_path, feature_cache):
    """The paper's input path on files the test writes: a random-weights torchvision resnet34 and a
    tiny fake CIFAR-100. The features must equal torchvision's resnet34 (fc removed) on the 224-px,
    ImageNet-normalised images."""
    tv = pytest.importorskip("torchvision")
    import torch.nn.functional as tF

    from qkvlab.data.features import IMAGENET_MEAN, IMAGENET_STD
    from qkvlab.tasks import get_task

    torch.manual_seed(0)
    ref = tv.models.resnet34(weights=None).eval()
    torch.save(ref.state_dict(), tmp_path / "resnet34.pth")
    root = write_fake_cifar100(tmp_path)
    t = get_task(
        "anomaly",
        dataset="cifar100",
        root=str(root),
        features="resnet34",
        weights=str(tmp_path / "resnet34.pth"),
        n_train=20,
        n_val=5,
        n_test=5,
        val_fraction=0.2,
        set_size=4,
    )
    assert t.features == 512
    img = t.images["test"].x[:2].float()
    b = tF.interpolate(img, size=(224, 224), mode="bilinear", align_corners=False)
    b = ((b * 255).round() / 255 - torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1)) / torch.tensor(IMAGENET_STD).view(
        1, 3, 1, 1
    )
    ref.fc = torch.nn.Identity()
    with torch.no_grad():
        want = ref(b)
    torch.testing.assert_close(t.elements["test"][:2], want, rtol=1e-4, atol=1e-4)
    torch.save({"conv1.weight": torch.zeros(1)}, tmp_path / "other.pth")
    with pytest.raises(UserError, match="not a torchvision resnet34"):
        get_task(
            "anomaly", dataset="cifar100", root=str(root), features="resnet34", weights=str(tmp_path / "other.pth")
        )


def test_anomaly_resnet34_needs_torchvision(tmp_path, feature_cache):
    import importlib.util

    if importlib.util.find_spec("torchvision") is not None:
        pytest.skip("torchvision is installed")
    from qkvlab.tasks import get_task

    (tmp_path / "w.pth").write_bytes(b"")
    root = write_fake_cifar100(tmp_path)
    with pytest.raises(UserError, match=r"torchvision: pip install 'qkvlab\[resnet\]'"):
        get_task(
            "anomaly",
            dataset="cifar100",
            root=str(root),
            features="resnet34",
            weights=str(tmp_path / "w.pth"),
            n_train=20,
            n_val=5,
            n_test=5,
            set_size=4,
        )


def test_new_options_save_and_load(tmp_path):
    """Computed tables (fixed positions, the '+' term's row/column sinusoids) are rebuilt on loading."""
    from qkvlab.model.folder import load_model, save_model

    torch.manual_seed(9)
    cfg = ModelConfig(
        attn="(Q=K-V)+",
        n_layer=2,
        n_head=2,
        d_model=16,
        vocab_size=20,
        context=12,
        pos="sinusoidal",
        norm_position="post",
        plus_encoding="original",
    )
    model = GPT(cfg).eval()
    save_model(tmp_path / "m", model, cfg)
    loaded, cfg2, _ = load_model(tmp_path / "m")
    assert cfg2 == cfg
    x = torch.randint(0, 20, (2, 12))
    torch.testing.assert_close(loaded(x)[0], model(x)[0], rtol=0, atol=0)


# ---- quality per cache byte, from scratch (compare/recipes.py LM_CACHE_RECIPE) ------------------------
CACHE_RECIPE_FILE = Path(__file__).resolve().parents[1] / "docs" / "results" / "lm-cache" / "recipe.yaml"


def cache_plan(tmp_path):
    return plan(load(CompareConfig, CACHE_RECIPE_FILE, out=str(tmp_path / "out"), jobs=1, threads=1))


def test_cache_recipe_file_is_the_recipe():
    """The file the documented command reads holds the recipe's settings, nothing else."""
    assert read_config_file(CACHE_RECIPE_FILE) == LM_CACHE_RECIPE


def test_cache_recipe_plans_every_route_at_exact_budgets(tmp_path):
    """Q-K-V and each route at 50% and 25% of its KV-cache bytes per token, exactly (qkvlab's accounting):
    MLA with DeepSeek-V2's rotated width d_head / 2 and the rest of the budget in the latent; every run
    Llama-like (RoPE, RMSNorm, SwiGLU at 8/3 d), on one recipe, 5 seeds each."""
    p = cache_plan(tmp_path)
    by_variant = {}
    for r in p.runs:
        by_variant.setdefault(r.variant.name, []).append(r)
    assert list(by_variant) == ["Q-K-V", *(route[i] for i in range(2) for route in CACHE_ROUTES.values())]
    assert all(sorted(r.seed for r in rs) == list(range(5)) for rs in by_variant.values())
    base = by_variant["Q-K-V"][0].cfg.model
    full = kv_cache_bytes_per_token(base)
    assert full == 2 * base.n_layer * base.n_head * base.head_dim * 2  # K and V, bf16
    for route, variants in CACHE_ROUTES.items():
        for fraction, name in zip(CACHE_FRACTIONS, variants):
            m = by_variant[name][0].cfg.model
            assert Fraction(kv_cache_bytes_per_token(m), full) == Fraction(fraction), name
            if route == "MLA":
                assert m.rope_dim == base.head_dim // 2
                assert m.kv_latent + m.rope_dim == fraction * 2 * base.n_head * base.head_dim
    for r in p.runs:
        m, c = r.cfg.model, r.cfg
        assert (m.pos, m.norm, m.mlp, m.mlp_hidden) == ("rope", "rmsnorm", "swiglu", 172)
        assert (m.d_model, m.n_layer, m.n_head, m.context) == (base.d_model, 2, 4, 128)
        assert (c.max_steps, c.batch_size, c.lr, c.dtype) == (900, 16, 2e-3, "fp32")
    assert round(8 / 3 * base.d_model / 4) * 4 == 172


def test_cache_recipe_dry_run(tmp_path, capsys):
    from qkvlab import cli

    out = tmp_path / "out"
    assert cli.main(["compare", "--config", str(CACHE_RECIPE_FILE), "--out", str(out), "--dry-run"]) in (0, None)
    text = capsys.readouterr().out
    assert f"compare plan: 45 runs into {out}: tasks lm;" in text and "seeds 5" in text
    assert "per run: 900 steps x 16 examples, lr 0.002, model d64 L2 h4" in text
    assert not out.exists()


def test_cache_claims_are_registered_before_the_run():
    """Version 6 brought them (its changelog says before the run that trains their variants); each names
    only variants the recipe trains, so none is left "not tested"; margins from Paper B's figures."""
    assert rules.change(6).fingerprint and "before the first run that trains them" in rules.change(6).data_before
    assert all(c.since == 6 for c in pc.CACHE_CLAIMS) and set(pc.CACHE_CLAIMS) <= set(pc.LM_CLAIMS)
    trained = set(LM_CACHE_RECIPE["variants"].split(","))
    assert all(set(c.variants) <= trained for c in pc.CACHE_CLAIMS)
    gqa, kv = pf.PAPER_B_LM_PPL_CHANGE["Q-K-V/GQA-4"], pf.PAPER_B_LM_PPL_CHANGE["Q-K=V"]
    half, bound = pc.SESOI_FRACTION, pc.BOUND_FACTOR
    expected = {
        "cache-mla-beats-mha-50": half * gqa,
        "cache-mla-beats-mha-25": half * gqa,
        "cache-mha-gqa-mqa-order": half * gqa,
        "cache-mla-beats-kv-50": half * kv,
        "cache-mla-beats-kv-25": half * kv,
        "cache-gqa-beats-kv-50": half * 100 * ((1 + kv / 100) / (1 + gqa / 100) - 1),
        "cache-mla-cost-50": bound * kv,
        "cache-mla-cost-25": bound * gqa,
    }
    assert {c.id: c.margin for c in pc.CACHE_CLAIMS} == pytest.approx(expected, abs=0.006)


def test_cache_claims_get_their_words():
    """On losses shaped as the claims say (MLA best, then MHA, GQA, MQA, the K=V routes last) every cache
    claim is reproduced; with MLA 3% worse than MHA both MLA-over-MHA claims are contradicted."""
    rng = random.Random(0)
    level = {s: 4.0 + rng.gauss(0, 0.05) for s in range(5)}
    offsets = {"Q-K-V": 0.0, "Q-K-V/GQA-2": 0.01, "Q-K-V/MQA": 0.02, "Q-K=V": 0.05, "Q-K=V/GQA-2": 0.06}
    offsets |= {"Q-K-V/latent=56/rope=8": -0.01, "Q-K-V/latent=24/rope=8": -0.005}

    def words(offs):
        vals = {"lm": {v: {s: level[s] + o + rng.gauss(0, 0.001) for s in level} for v, o in offs.items()}}
        return {v.claim.id: v.word for v in check_claims(vals, {"lm": False}, {"lm": "val_loss"}, pc.CACHE_CLAIMS)}

    assert set(words(offsets).values()) == {REPRODUCED}
    worse = words(offsets | {"Q-K-V/latent=56/rope=8": 0.03, "Q-K-V/latent=24/rope=8": 0.03})
    assert worse["cache-mla-beats-mha-50"] == worse["cache-mla-beats-mha-25"] == "contradicted"


def test_a_latents_cache_fraction_is_against_q_k_v():
    """results.md's "KV vs Q-K-V" and ppl_vs_cache.png: a latent (MLA's too) against Q-K-V's K and V."""
    from qkvlab.analysis.results import Row
    from qkvlab.model.variants import parse_variant

    base = ModelConfig(n_layer=2, n_head=4, d_model=64, pos="rope")
    for name, fraction in (("Q-K-V/latent=56/rope=8", 0.5), ("Q-K-V/latent=32", 0.25), ("Q-K=V/GQA-2", 0.25)):
        row = Row("lm", name, "val_loss", False, [0], 1, parse_variant(name).apply(base), [4.0], [4.0], None, 900)
        assert row.kv_fraction == fraction
