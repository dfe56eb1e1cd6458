"""Paired initialisation: every tensor is drawn from (seed, its name), so variants pair by construction.

Two models built at one seed start with identical embeddings, MLPs, norms, output projections and
heads wherever the tensors have the same name and shape, whatever their attention scheme. Each learned
attention projection takes the rows of the baseline's projection for the first role it serves, in
Q, K, V order: Q-K=V's shared key/value projection equals Q-K-V's key projection, Q=K-V's and
Q=K=V's shared projection equal its query projection, and a GQA/MQA projection is the first
kv_heads * head_dim rows of it. So a comparison at one seed differs only where the schemes differ.

Distributions are the models' own: GPT-2's N(0, init_std) with residual output projections scaled by
1/sqrt(2 n_layer) for transformer blocks and the decoder's embeddings; each other module's own
``reset_parameters`` (PyTorch's defaults, the "+" term's Xavier) under a generator seeded by name.
"""

from __future__ import annotations

import hashlib
import math

import torch
import torch.nn as nn

from qkvlab.model.config import ModelConfig

RESIDUAL_OUTPUTS = ("attn.out_proj.weight", "mlp.down.weight")


def draw_seed() -> int:
    """The model's init seed: one draw from torch's global generator (so `torch.manual_seed(s)` before
    building a model fixes it), taken before any module is built."""
    return int(torch.randint(0, 2**62, (), device="cpu"))


def name_seed(seed: int, name: str) -> int:
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def _normal(seed: int, name: str, shape: tuple[int, ...], std: float) -> torch.Tensor:
    gen = torch.Generator().manual_seed(name_seed(seed, name))
    return torch.randn(shape, generator=gen, dtype=torch.float64) * std


def _reset_by_name(model: nn.Module, seed: int) -> None:
    """Each module with its own parameters re-runs its default init under a generator seeded by name."""
    for name, module in model.named_modules():
        reset = getattr(module, "reset_parameters", None)
        if reset is None or not any(True for _ in module.parameters(recurse=False)):
            continue
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(name_seed(seed, name))
            reset()


def _projection_rows(attn: nn.Module, prefix: str, seed: int, std: float) -> torch.Tensor:
    """The fused in_proj weight: per learned projection, the rows of its first role's full-width draw."""
    d_model = attn.in_proj.in_features
    blocks = []
    projections = attn.spec.projections
    if attn.latent is not None:  # the query's projection, then the latent's own draw
        projections = [*(roles for roles in projections if "q" in roles), ("latent",)]
    for roles, width in zip(projections, attn.proj_widths):
        rows = width if roles == ("latent",) else max(width, attn.n_head * attn.head_dim)  # MLA's query is wider
        full = _normal(seed, f"{prefix}{roles[0]}_proj.weight", (rows, d_model), std)
        blocks.append(full[:width])
    return torch.cat(blocks)


@torch.no_grad()
def init_gpt2(model: nn.Module, cfg: ModelConfig, seed: int, prefix: str = "") -> None:
    """GPT-2 init of a trunk or decoder by name: matrices N(0, init_std), residual output projections
    scaled by 1/sqrt(2 n_layer), biases zero; attention projections role by role (module docstring)."""
    fused = {}
    for name, module in model.named_modules():
        if getattr(module, "in_proj", None) is not None and hasattr(module, "spec"):
            fused[f"{name}.in_proj.weight"] = module
    for name, p in model.named_parameters():
        full = prefix + name
        if p.is_meta or "score_term" in name:
            continue
        if name in fused:
            p.copy_(_projection_rows(fused[name], full[: -len("in_proj.weight")], seed, cfg.init_std))
        elif name.endswith("kv_up.weight"):  # keys and values at the scale a direct projection gives them
            normalised = getattr(model.get_submodule(name.rsplit(".", 2)[0]), "kv_norm", None) is not None
            std = cfg.init_std if normalised else p.shape[1] ** -0.5  # MLA's latent is a normalised input itself
            p.copy_(_normal(seed, full, tuple(p.shape), std))
        elif p.dim() >= 2:
            std = cfg.init_std / (math.sqrt(2 * cfg.n_layer) if name.endswith(RESIDUAL_OUTPUTS) else 1.0)
            p.copy_(_normal(seed, full, tuple(p.shape), std))
        elif name.endswith(".bias"):
            p.zero_()


@torch.no_grad()
def init_paired(model: nn.Module, cfg: ModelConfig, seed: int, gpt2_part: nn.Module | None = None) -> None:
    """Initialise `model` from (seed, names): every module's default init by name, then GPT-2's init on
    `gpt2_part` (the whole model when None). Does nothing to a model built on the meta device."""
    if any(p.is_meta for p in model.parameters()):
        return
    _reset_by_name(model, seed)
    part = model if gpt2_part is None else gpt2_part
    prefix = next((f"{n}." for n, m in model.named_modules() if m is part and n), "")
    init_gpt2(part, cfg, seed, prefix)
