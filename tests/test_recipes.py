"""The papers' recipes exactly (issue 10): the '+' term's 2D encoding, post-norm blocks, fixed
sinusoidal input positions, MLP output heads, Paper A's lr horizon, the paper recipes as data."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from qkvlab.config import ModelConfig
from qkvlab.errors import UserError
from qkvlab.model import GPT, Encoder, TokenInput
from qkvlab.positions import ScoreTerm2D, encoding_2d
from qkvlab.train.config import train_preset
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
    """additive() = P[i, j] . w + b with P = encoding_2d, at arbitrary (cached) positions."""
    torch.manual_seed(0)
    term = ScoreTerm2D(m, 40, encoding).double()
    with torch.no_grad():
        term.bias.fill_(0.3)
    q_pos, k_pos = torch.randint(0, 40, (2, 7)), torch.randint(0, 40, (2, 11))
    P = encoding_2d(40, 40, m, encoding)
    want = P[q_pos[:, :, None], k_pos[:, None, :]] @ term.weight.detach() + 0.3  # (B, T, S)
    torch.testing.assert_close(term.additive(q_pos, k_pos, torch.float64)[:, 0], want, rtol=0, atol=1e-13)
    a, c = term.row_col_terms(q_pos, k_pos)
    torch.testing.assert_close(a[:, :, None] + c[:, None, :] + 0.3, want, rtol=0, atol=1e-13)


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
    torch.testing.assert_close(gpt.pos_table, inp.pos_table)  # one table for both model kinds
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
    cfg = train_preset("gpt2-124m")
    assert (cfg.max_steps, cfg.lr_decay_steps, cfg.decay_steps, cfg.warmup_steps) == (105_001, 600_000, 600_000, 2000)
    kw = dict(lr=cfg.lr, min_lr=cfg.final_lr, warmup=cfg.warmup_steps, total=cfg.decay_steps)
    last = lr_at(cfg.max_steps - 1, **kw)
    assert last == pytest.approx(5.6e-4, abs=0.05e-4)
    assert lr_at(600_000, **kw) == pytest.approx(6e-5)
    assert train_preset("tiny").decay_steps == train_preset("tiny").max_steps  # None: the horizon is max_steps
    with pytest.raises(UserError, match="lr_decay_steps"):
        train_preset("tiny", lr_decay_steps=0)
