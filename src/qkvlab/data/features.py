"""Image features for the set-anomaly task: what each set element is.

- resnet34: Paper B's reference input (the UvA tutorial Borji's notebook follows): the 512-d output
  of a frozen ImageNet-pretrained torchvision ResNet34 without its `fc`, on images resized to
  224x224 and normalised with ImageNet's mean/std. Needs torchvision (`pip install
  'qkvlab[resnet]'`, a build matching your torch) and a local weights file (torchvision's
  `resnet34-*.pth` or a safetensors copy); nothing is downloaded.
- encoder (the offline default, a deviation): a small CNN that qkvlab trains on the classes the sets
  do NOT use (the first half of the dataset's classes; the sets use the second half), then
  freezes, as the paper's ResNet34 was trained on other data (ImageNet) than its sets.
- pixels: the flattened image.

Features are cached as safetensors under <qkvlab cache>/features/<key>/, key = sha256 of the images
and of the extractor's settings (and weights file), so training or running an extractor happens once.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from qkvlab.base.errors import UserError
from qkvlab.base.files import atomic_dir, cache_dir

FEATURES = ("encoder", "pixels", "resnet34")
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
ENCODER_VERSION = 2  # bump when SmallCNN or its training changes: old caches are then not reused


# ---------------------------------------------------------------- the offline encoder
class SmallCNN(nn.Module):
    """Three 3x3 convolutions (16, 32, 64 channels; the first two with stride 2) with ReLU and a global
    mean pool: the 64-d feature, like ResNet's pooled output; `classifier` (Linear, like ResNet's fc)
    serves training only. (A Linear + ReLU layer after the pool made features that transfer worse to
    unseen classes: set-anomaly accuracy 0.67 against 0.94 with the pooled ones, digits, 200 steps.)"""

    def __init__(self, channels: int, num_classes: int):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(channels, 16, 3, stride=2, padding=1),
            nn.ReLU(),
            nn.Conv2d(16, 32, 3, stride=2, padding=1),
            nn.ReLU(),
            nn.Conv2d(32, 64, 3, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
        )
        self.classifier = nn.Linear(64, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.body(x))


def train_encoder(x: torch.Tensor, y: torch.Tensor, steps: int, seed: int = 0, batch_size: int = 128) -> SmallCNN:
    """A SmallCNN trained by Adam (lr 2e-3) with cross-entropy on images x (N, C, H, W) in [0, 1]
    with labels y in [0, K); returned frozen, in eval mode."""
    g = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):  # seeded init without touching the caller's RNG
        torch.manual_seed(seed)
        net = SmallCNN(x.shape[1], int(y.max()) + 1)
    opt = torch.optim.Adam(net.parameters(), lr=2e-3)
    mean, std = _channel_stats(x)
    for _ in range(steps):
        idx = torch.randint(len(y), (min(batch_size, len(y)),), generator=g)
        loss = F.cross_entropy(net((x[idx].float() - mean) / std), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
    net.register_buffer("mean", mean)
    net.register_buffer("std", std)
    return net.eval().requires_grad_(False)


def _channel_stats(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel mean and std (1, C, 1, 1) of up to 10,000 evenly spaced images."""
    xf = x[:: max(1, len(x) // 10_000)].float()
    return xf.mean((0, 2, 3), keepdim=True), xf.std((0, 2, 3), keepdim=True).clamp_min(1e-6)


@torch.no_grad()
def encoder_features(net: SmallCNN, x: torch.Tensor, batch_size: int = 1024) -> torch.Tensor:
    """(N, C, H, W) -> (N, 64) pooled features of a trained SmallCNN."""
    return torch.cat(
        [net.body((x[i : i + batch_size].float() - net.mean) / net.std) for i in range(0, len(x), batch_size)]
    )


# ---------------------------------------------------------------- the paper's ResNet34
def read_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """Weights from a .safetensors file or a torch.save'd state dict (read with weights_only=True:
    no code runs); a {'state_dict': ...} wrapper is unwrapped."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"weights={path}: no such file (a torchvision resnet34 .pth or .safetensors)")
    try:
        if path.suffix == ".safetensors":
            state = load_file(str(path))
        else:
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch/safetensors raise many types for a bad file
        raise UserError(f"weights={path}: not a readable state dict ({' '.join(str(e).split())[:200]})") from None
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
        state = state["state_dict"]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise UserError(f"weights={path}: expected a mapping of parameter names to tensors")
    return state


def resnet34(weights: str | Path) -> nn.Module:
    """torchvision's ResNet34 with the weights of `weights`, `fc` removed (512-d output), frozen."""
    if importlib.util.find_spec("torchvision") is None:
        raise UserError(
            "features=resnet34 needs torchvision: pip install 'qkvlab[resnet]' (a torchvision build that matches "
            "your torch; for CPU-only torch, the CPU build); or use features=encoder"
        )
    import torchvision  # optional: torchvision

    state = read_state_dict(weights)
    net = torchvision.models.resnet34(weights=None)
    missing, unexpected = net.load_state_dict(state, strict=False)
    if missing or unexpected:
        what = f"missing {missing[0]!r}" if missing else f"unexpected {unexpected[0]!r}"
        raise UserError(f"weights={weights}: not a torchvision resnet34 state dict ({what})")
    net.fc = nn.Identity()
    return net.eval().requires_grad_(False)


@torch.no_grad()
def resnet_features(net: nn.Module, x: torch.Tensor, batch_size: int = 128, size: int = 224) -> torch.Tensor:
    """(N, C, H, W) in [0, 1] -> (N, 512): resized to size x size (bilinear, rounded to 8-bit levels
    like the reference's PIL resize), ImageNet-normalised; grey images repeated to 3 channels."""
    device = next(net.parameters()).device
    mean = torch.tensor(IMAGENET_MEAN, device=device).view(1, 3, 1, 1)
    std = torch.tensor(IMAGENET_STD, device=device).view(1, 3, 1, 1)
    out = []
    for i in range(0, len(x), batch_size):
        b = x[i : i + batch_size].to(device, torch.float32)
        if b.shape[1] == 1:
            b = b.expand(-1, 3, -1, -1)
        b = F.interpolate(b, size=(size, size), mode="bilinear", align_corners=False)
        b = (b * 255).round().clamp(0, 255) / 255
        out.append(net((b - mean) / std).float().cpu())
    return torch.cat(out)


# ---------------------------------------------------------------- cache
def images_digest(*tensors: torch.Tensor) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(str((tuple(t.shape), str(t.dtype))).encode())
        h.update(t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def cached(settings: dict, compute) -> dict[str, torch.Tensor]:
    """compute() -> {name: tensor}, stored once under <qkvlab cache>/features/<sha256(settings)[:16]>/."""
    key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]
    folder = cache_dir() / "features" / key
    if (folder / "features.safetensors").is_file():
        return load_file(str(folder / "features.safetensors"))
    tensors = {k: v.contiguous() for k, v in compute().items()}
    with atomic_dir(folder) as tmp:
        save_file(tensors, str(tmp / "features.safetensors"))
        (tmp / "settings.json").write_text(json.dumps(settings, indent=2, sort_keys=True) + "\n")
    return tensors
