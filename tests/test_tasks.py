"""Encoder task families: synthetic lists, vision, set anomaly detection, segmentation."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from qkvlab.base.errors import UserError
from qkvlab.base.flag_values import parse_key_values
from qkvlab.data.images import FASHION_MNIST_DIR
from qkvlab.model.config import ModelConfig
from qkvlab.tasks import get_task, resolve_task_options
from qkvlab.tasks.arrays import EpochSampler
from qkvlab.tasks.synthetic import SyntheticOptions

SMALL = {  # one small task per family, fast to build
    "copy": dict(length=8, n_train=300, n_val=100, n_test=50),
    "digits": dict(),
    "anomaly": dict(n_train=300, n_val=100, n_test=50, features="pixels"),
    "segmentation": dict(n_train=200, n_val=60, n_test=30),
}
_CACHE: dict = {}


pytestmark = pytest.mark.usefixtures("one_thread")


def task(name: str):
    if name not in _CACHE:
        _CACHE[name] = get_task(name, **SMALL[name])
    return _CACHE[name]


def model_for(t, attn="Q-K-V", d=32, heads=2, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    return t.build_model(t.adapt_config(ModelConfig(attn=attn, d_model=d, n_layer=2, n_head=heads))).to(dtype)


# ------------------------------------------------------------------ batches


def test_epoch_sampler_walks_permutations():
    s = EpochSampler(25)
    rows = torch.cat([s(k, 10, seed=3) for k in range(10)])  # 100 rows = 4 epochs
    for e in range(4):
        assert sorted(rows[25 * e : 25 * (e + 1)].tolist()) == list(range(25))
    assert not torch.equal(rows[:25], rows[25:50])  # each epoch has its own order
    assert torch.equal(EpochSampler(25)(7, 10, seed=3), rows[70:80])  # pure in (seed, step)
    assert not torch.equal(EpochSampler(25)(7, 10, seed=4), rows[70:80])
    big = EpochSampler(5)(0, 12, seed=0)  # B > n: two whole epochs and the head of a third
    assert torch.equal(big[10:], EpochSampler(5).perm(0, 2)[:2])
    assert sorted(big[:10].tolist()) == sorted(list(range(5)) * 2)
    with pytest.raises(UserError):
        s(0, 4, seed=-1)


@pytest.mark.parametrize("name", list(SMALL))
def test_batch_deterministic_shapes_loss(name):
    t = task(name)
    x, y = t.batch(5, 16, seed=1)
    again = get_task(name, **SMALL[name]).batch(5, 16, seed=1)  # a fresh task: same data, same batch
    assert torch.equal(x, again[0]) and torch.equal(y, again[1])
    assert not torch.equal(y, t.batch(6, 16, seed=1)[1]) or not torch.equal(x, t.batch(6, 16, seed=1)[0])
    assert not torch.equal(x, t.batch(5, 16, seed=2)[0])
    assert x.shape[0] == y.shape[0] == 16 and y.dtype == torch.int64
    for attn in ("Q-K-V", "(Q=K=V)+"):
        m = model_for(t, attn)
        logits = m(x)
        assert logits.shape[:-1] == y.shape  # class axis last, the rest like the targets
        loss = t.loss(m, x, y)
        assert loss.ndim == 0 and torch.isfinite(loss)
        m.train()
        out = t.evaluate(m, batch_size=7, max_batches=3)
        assert m.training and "val_loss" in out and t.metric in out and np.isfinite(out["val_loss"])
    json.dumps(t.describe())


def test_shapes_per_family():
    assert task("copy").batch(0, 4, 0)[0].shape == (4, 8)
    assert model_for(task("copy"))(task("copy").batch(0, 4, 0)[0]).shape == (4, 8, 10)
    d = task("digits")
    assert d.batch(0, 4, 0)[0].shape == (4, 1, 8, 8) and d.patch == 2 and d.n_tokens == 17
    assert model_for(d)(d.batch(0, 4, 0)[0]).shape == (4, 10)
    a = task("anomaly")
    assert a.batch(0, 4, 0)[0].shape == (4, 10, 1, 8, 8) and model_for(a)(a.batch(0, 4, 0)[0]).shape == (4, 10)
    s = task("segmentation")
    assert s.batch(0, 4, 0)[0].shape == (4, 1, 16, 16) and s.batch(0, 4, 0)[1].shape == (4, 64)
    assert model_for(s)(s.batch(0, 4, 0)[0]).shape == (4, 64, 11)


def test_config_adaptation():
    base = ModelConfig(d_model=32, n_head=2, n_layer=2)
    c = task("copy").adapt_config(base)
    assert (c.vocab_size, c.context, c.causal, c.pos, c.plus_channels) == (10, 8, False, "learned", 10)
    assert task("digits").adapt_config(base).plus_channels == 50
    a = task("anomaly").adapt_config(base)
    assert (a.pos, a.context, a.causal) == ("none", 10, False)
    with pytest.raises(UserError, match="rope"):
        task("anomaly").adapt_config(base.replace(pos="rope"))
    keep = get_task("copy", length=4, n_train=10, plus_channels=None)
    assert keep.adapt_config(base.replace(plus_channels=6)).plus_channels == 6


def test_vision_standardised_and_mean_pool():
    d = task("digits")
    x = d.data["train"].x
    z = (x - d.mean) / d.std
    assert abs(float(z.mean())) < 1e-4 and abs(float(z.std()) - 1) < 1e-2
    t = get_task("digits", pool="mean", patch=4)
    assert t.n_tokens == 4 and t.adapt_config(ModelConfig()).context == 4
    assert model_for(t)(t.batch(0, 3, 0)[0]).shape == (3, 10)
    assert set(d.sizes) == {"train", "val", "test"} and d.sizes["train"] + d.sizes["val"] == 1438


def test_vision_cifar_binary_half_storage(tmp_path: Path):
    root = tmp_path / "cifar-10-batches-bin"
    root.mkdir()
    rng = np.random.default_rng(0)
    for name in [f"data_batch_{i}.bin" for i in range(1, 6)] + ["test_batch.bin"]:
        rec = np.concatenate([rng.integers(0, 10, (12, 1)), rng.integers(0, 256, (12, 3072))], 1)
        (root / name).write_bytes(rec.astype(np.uint8).tobytes())
    t = get_task("cifar10", root=str(tmp_path))
    assert t.data["train"].x.dtype == torch.float16 and t.patch == 8 and t.n_tokens == 17
    x, y = t.batch(0, 5, 0)
    assert x.dtype == torch.float32 and x.shape == (5, 3, 32, 32)
    assert torch.isfinite(t.loss(model_for(t), x, y))
    assert t.sizes == {"train": 54, "val": 6, "test": 12}


@pytest.mark.skipif(not Path(FASHION_MNIST_DIR).is_dir(), reason="dataset-fashion-mnist not installed")
def test_fashion_mnist_default_root():
    t = get_task("fashion-mnist", n_train=500)
    assert t.sizes == {"train": 500, "val": 6000, "test": 10000} and t.patch == 7 and t.n_tokens == 17


# ------------------------------------------------------------------ anomaly


def test_anomaly_odd_slot_uniform_and_odd():
    t = get_task("anomaly", n_train=2000, n_val=50, n_test=50, features="pixels")
    items, slot = t.sets["train"]
    counts = torch.bincount(slot, minlength=10)
    assert int(counts.min()) > 120 and int(counts.max()) < 280  # ~200 each: the slot is not fixed
    labels = t.labels["train"][items]  # (N, 10)
    odd = labels.gather(1, slot[:, None])[:, 0]
    others = labels.masked_fill(torch.nn.functional.one_hot(slot, 10).bool(), -1)
    major = others.max(1).values
    assert bool(((others == major[:, None]) | (others == -1)).all())  # 9 of one class
    assert bool((odd != major).all())


def test_anomaly_encoder_is_permutation_equivariant():
    t = task("anomaly")
    m = model_for(t, "Q=K-V", dtype=torch.float64)
    x = t.batch(0, 6, 0)[0].double()
    perm = torch.randperm(10)
    assert torch.allclose(m(x[:, perm]), m(x)[:, perm], atol=1e-12)
    mp = model_for(t, "(Q=K-V)+", dtype=torch.float64)  # the "+" term is a per-slot bias: not equivariant
    assert not torch.allclose(mp(x[:, perm]), mp(x)[:, perm], atol=1e-6)


# ------------------------------------------------------------------ segmentation


def test_segmentation_scores_against_pixels():
    s = task("segmentation")
    target = s.labels["val"]
    index = torch.arange(len(target))
    perfect = s.scores("val", target.clone(), target, index)
    assert perfect["miou"] == 1.0 and perfect["patch_accuracy"] == 1.0
    mask = s.data["val"].mask
    painted = target.view(-1, 8, 8).repeat_interleave(2, 1).repeat_interleave(2, 2)
    assert perfect["pixel_accuracy"] == pytest.approx(float((painted == mask).double().mean()))
    assert 0.5 < perfect["pixel_accuracy"] < 1.0  # majority labels lose thin strokes
    bg = s.scores("val", torch.zeros_like(target), target, index)
    assert bg["patch_accuracy"] == pytest.approx(float((target == 0).double().mean()))


# ------------------------------------------------------------------ learning


def _train(t, steps, lr=3e-3, batch_size=64, **kw):
    m = model_for(t, **kw)
    opt = torch.optim.AdamW(m.parameters(), lr=lr, weight_decay=0.0)
    for k in range(steps):
        loss = t.loss(m, *t.batch(k, batch_size, seed=0))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return m


@pytest.mark.parametrize("name", ["copy", "sub"])
def test_synthetic_learns(name):
    t = get_task(name, length=8, n_train=2000, n_val=300, n_test=300)
    m = _train(t, 40)
    assert t.evaluate(m, batch_size=512)["accuracy"] > 0.9  # chance 0.1
    scored = t.test(m, batch_size=512)
    assert scored["split"] == "test" and scored["n"] == 300 and scored["units"] == "list"
    assert scored["accuracy"] > 0.9 and 0 <= scored["se"] < 0.05


def test_digits_anomaly_segmentation_learn():
    d = task("digits")
    assert d.evaluate(_train(d, 150), batch_size=512)["accuracy"] > 0.5  # chance 0.1 (0.75-0.85 over init seeds)
    a = get_task("anomaly", n_train=2000, n_val=300, n_test=50, features="pixels")
    assert a.evaluate(_train(a, 40), batch_size=512)["accuracy"] > 0.3  # chance 0.1
    s = task("segmentation")
    target = s.labels["val"]
    background_only = s.scores("val", torch.zeros_like(target), target, torch.arange(len(target)))["miou"]
    prior = torch.bincount(s.labels["train"].flatten(), minlength=s.num_classes).double()
    prior = prior[prior > 0] / prior.sum()
    prior_entropy = float(-(prior * prior.log()).sum())  # loss of the best input-blind predictor
    out = s.evaluate(_train(s, 40, batch_size=32), batch_size=512)
    assert out["val_loss"] < 0.8 * prior_entropy and out["miou"] > background_only


# ------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    "name, options, match",
    [
        ("nope", {}, "unknown task"),
        ("copy", {"lenght": 8}, "unknown synthetic option 'lenght'"),
        ("copy", {"length": 0}, "length=0"),
        ("copy", {"length": "abc"}, "length='abc' must be an integer"),
        ("copy", {"length": 2.5}, "length=2.5 must be an integer"),
        ("digits", {"pool": "max"}, "pool='max'"),
        ("digits", {"patch": 3}, "patch=3 must divide"),
        ("digits", {"label": "fine"}, "cifar100 only"),
        ("mnist", {}, "needs root="),
        ("cifar10", {"root": "/nonexistent"}, "missing file"),
        ("anomaly", {"dataset": "svhn"}, "unknown image dataset 'svhn'"),
        ("segmentation", {"patch": 3}, "patch=3 must divide canvas=16"),
        ("segmentation", {"plus_channels": 3}, "plus_channels=3"),
    ],
)
def test_bad_options_are_one_line_user_errors(name, options, match):
    with pytest.raises(UserError, match=match) as err:
        get_task(name, **options)
    assert "\n" not in str(err.value)


def test_module_refuses_names_it_does_not_serve():
    from qkvlab.tasks import anomaly, segmentation, synthetic, vision

    for mod in (synthetic, vision, anomaly, segmentation):
        with pytest.raises(UserError, match="unknown"):
            mod.make_task("svhn")


def test_options_from_cli_strings():
    o = resolve_task_options("copy", parse_key_values(["length=64", "n_train=10", "plus_channels=none"]))
    assert isinstance(o, SyntheticOptions) and (o.length, o.n_train, o.plus_channels) == (64, 10, None)
    with pytest.raises(UserError, match="task 'copy': length=None must be an integer"):
        resolve_task_options("copy", {"length": None})
    with pytest.raises(UserError, match="no split 'train2'"):
        task("copy").evaluate(model_for(task("copy")), batch_size=8, split="train2")
