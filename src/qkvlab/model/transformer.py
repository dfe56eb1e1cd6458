"""Transformer blocks, the decoder-only GPT and a bidirectional encoder with pluggable inputs/heads."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from qkvlab.base.errors import UserError
from qkvlab.model.attention import Attention, dropout
from qkvlab.model.cache import KVCache
from qkvlab.model.config import ModelConfig
from qkvlab.model.init import draw_seed, init_paired
from qkvlab.model.positions import Rotary, SinusoidalPositions


def make_norm(cfg: ModelConfig) -> nn.Module:
    if cfg.norm == "layernorm":
        return nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps, bias=cfg.bias)
    if cfg.norm == "rmsnorm":
        return nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
    return nn.Identity()


def activation(kind: str) -> nn.Module:
    """The MLP's nonlinearity as a module (SwiGLU's gate uses SiLU)."""
    return {"relu": nn.ReLU(), "gelu": nn.GELU(), "gelu_tanh": nn.GELU(approximate="tanh"), "swiglu": nn.SiLU()}[kind]


def fixed_positions(cfg: ModelConfig, n: int) -> SinusoidalPositions | None:
    """Fixed sinusoidal input positions for [0, n) when pos=sinusoidal, else None."""
    return SinusoidalPositions(n, cfg.d_model) if cfg.pos == "sinusoidal" else None


# PyTorch runs an exact GELU on a CPU float32 tensor through oneDNN, whose fixed cost per call
# dominates small tensors; ATen's own kernel is faster up to ~64k elements (a decode step's
# (B, 1, 4d) at batch <= 16) and oneDNN beyond (benchmarks/gelu_kernels.py).
# The two agree to ~1e-6 (different erf approximations); float64 never takes the oneDNN path.
GELU_ATEN_MAX = 1 << 16


def gelu(x: torch.Tensor) -> torch.Tensor:
    """Exact GELU on the faster CPU kernel for x's size (see GELU_ATEN_MAX)."""
    mkldnn = torch.backends.mkldnn
    if x.numel() > GELU_ATEN_MAX or x.device.type != "cpu" or not mkldnn.enabled or torch.compiler.is_compiling():
        return F.gelu(x)
    # process-wide for the one call: both kernels are exact GELU (mkldnn.flags() would also reset
    # three other flags and costs more a call than this whole function)
    mkldnn.enabled = False
    try:
        return F.gelu(x)
    finally:
        mkldnn.enabled = True


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h = cfg.hidden
        self.kind = cfg.mlp
        if cfg.mlp == "swiglu":
            self.gate = nn.Linear(cfg.d_model, h, bias=cfg.bias)
        self.up = nn.Linear(cfg.d_model, h, bias=cfg.bias)
        self.down = nn.Linear(h, cfg.d_model, bias=cfg.bias)
        self.dropout = dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "swiglu":
            h = F.silu(self.gate(x)) * self.up(x)
        elif self.kind == "relu":
            h = F.relu(self.up(x))
        elif self.kind == "gelu":
            h = gelu(self.up(x))
        else:  # gelu_tanh: ATen's kernel at every size
            h = F.gelu(self.up(x), approximate="tanh")
        return self.dropout(self.down(h))


class Block(nn.Module):
    """Pre-norm block x + attn(norm(x)), x + mlp(norm(x)). Without the MLP skip it computes
    mlp(norm(x + attn(norm(x)))) (Paper A). Post-norm: norm(x + attn(x)), norm(x + mlp(x)) (Borji)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.norm1, self.attn = make_norm(cfg), Attention(cfg)
        self.norm2, self.mlp = make_norm(cfg), MLP(cfg)
        self.mlp_skip = cfg.mlp_skip
        self.post_norm = cfg.norm_position == "post"

    def forward(self, x: torch.Tensor, **attn_kwargs) -> torch.Tensor:
        if self.post_norm:
            x = self.norm1(x + self.attn(x, **attn_kwargs))
            return self.norm2(x + self.mlp(x))
        x = x + self.attn(self.norm1(x), **attn_kwargs)
        h = self.mlp(self.norm2(x))
        return x + h if self.mlp_skip else h


class Trunk(nn.Module):
    """n_layer blocks (or one block applied n_layer times) and a final norm (none after post-norm blocks)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.blocks = nn.ModuleList(Block(cfg.layer_config(i)) for i in range(1 if cfg.share_layers else cfg.n_layer))
        self.norm = make_norm(cfg) if cfg.norm_position == "pre" else nn.Identity()
        rotated = cfg.head_dim if cfg.rope_dim is None else cfg.rope_dim  # MLA rotates only its rope_dim numbers
        self.rotary = Rotary(rotated, cfg.context, cfg.rope_theta) if cfg.pos == "rope" else None
        # K=V (and a latent) caches un-rotated tensors: keys rotate on read, at their positions.
        self.rope_on_read = self.rotary is not None and any(b.attn.keys_rotate_on_read for b in self.blocks)

    def layer(self, i: int) -> Block:
        return self.blocks[0 if self.cfg.share_layers else i]

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache | None = None,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x (B, T, C); positions (B, T) or (1, T)."""
        rope = rope_k = None
        if self.rotary is not None:
            rope = self.rotary.cos_sin(positions, x.dtype)
            if cache is not None and self.rope_on_read:
                rope_k = self.rotary.cos_sin(cache.key_positions(), x.dtype)
        for i in range(self.cfg.n_layer):
            x = self.layer(i)(
                x,
                q_pos=positions,
                rope=rope,
                rope_k=rope_k,
                cache=None if cache is None else cache.layer(i),
                mask=mask,
            )
        return self.norm(x)


class GPT(nn.Module):
    """Decoder-only language model."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        init_seed = draw_seed()  # before any module is built: variants at one seed pair (init.py)
        cfg.validate()
        if cfg.head != "linear":
            raise UserError(f"head={cfg.head!r} is an encoder's output head; a language model's head is linear")
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.context, cfg.d_model) if cfg.pos == "learned" else None
        self.pos_fixed = fixed_positions(cfg, cfg.context)
        self.drop = dropout(cfg.dropout)
        self.trunk = Trunk(cfg)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        init_paired(self, cfg, init_seed)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight

    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        *,
        cache: KVCache | None = None,
        positions: torch.Tensor | None = None,
        token_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """idx (B, T) -> logits (B, T, vocab), loss. With a cache, idx are the next tokens after
        those already cached; positions default to continuing each sequence."""
        x = self.hidden(idx, cache=cache, positions=positions, token_mask=token_mask)
        logits = self.lm_head(x)  # (B, T, vocab)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1)
        return logits, loss

    def hidden(
        self,
        idx: torch.Tensor,
        *,
        cache: KVCache | None = None,
        positions: torch.Tensor | None = None,
        token_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """What the head reads: idx (B, T) -> (B, T, C), the trunk's normed output (a caller that needs
        the logits of a few positions applies lm_head to those alone)."""
        B, T = idx.shape
        if token_mask is not None and cache is None:
            raise ValueError("token_mask (padding) is supported with a KVCache only")
        if positions is None:
            if cache is not None:
                positions = cache.next_positions(T)
            elif T > self.cfg.context:
                raise ValueError(f"{T} positions exceed the context of {self.cfg.context}")
            else:
                positions = torch.arange(T, device=idx.device)[None].expand(B, T)
        mask = cache.begin(positions, token_mask) if cache is not None else None
        return self.trunk(self.embed(idx, positions), positions, cache, mask)

    def embed(self, idx: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """idx (B, T) -> the residual stream the first block reads (B, T, C)."""
        x = self.tok_emb(idx)  # (B, T, C)
        if self.pos_emb is not None:
            x = x + self.pos_emb(positions)
        elif self.pos_fixed is not None:
            x = x + self.pos_fixed(positions)
        return self.drop(x)


# ---- encoder ----------------------------------------------------------------------------------
class TokenInput(nn.Module):
    """Token ids (B, N) -> (B, N, C), plus learned or fixed sinusoidal absolute positions (per cfg.pos)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Parameter(torch.zeros(1, cfg.context, cfg.d_model)) if cfg.pos == "learned" else None
        self.pos_fixed = fixed_positions(cfg, cfg.context)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        if self.pos_fixed is not None:
            return h + self.pos_fixed(torch.arange(x.shape[1], device=x.device))
        return h if self.pos is None else h + self.pos[:, : x.shape[1]]


class PatchInput(nn.Module):
    """Images (B, C, H, W) -> patch tokens (B, 1 + N, d) with a class token (or (B, N, d))."""

    def __init__(self, cfg: ModelConfig, channels: int, image_size: int, patch: int, cls_token: bool = True):
        super().__init__()

        if image_size % patch:
            raise UserError(f"patch={patch} must divide image_size={image_size}")
        self.proj = nn.Conv2d(channels, cfg.d_model, kernel_size=patch, stride=patch)
        n = (image_size // patch) ** 2 + int(cls_token)
        self.cls = nn.Parameter(torch.zeros(1, 1, cfg.d_model)) if cls_token else None
        self.pos = nn.Parameter(torch.zeros(1, n, cfg.d_model)) if cfg.pos == "learned" else None
        self.pos_fixed = fixed_positions(cfg, n)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x).flatten(2).transpose(1, 2)  # (B, N, d)
        if self.cls is not None:
            h = torch.cat([self.cls.expand(h.shape[0], -1, -1), h], dim=1)
        if self.pos_fixed is not None:
            return h + self.pos_fixed(torch.arange(h.shape[1], device=h.device))
        return h if self.pos is None else h + self.pos


class SetInput(nn.Module):
    """Set elements (B, N, *feature_shape) -> (B, N, d); no positions (permutation-equivariant)."""

    def __init__(self, cfg: ModelConfig, features: int):
        super().__init__()
        self.proj = nn.Linear(features, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x.flatten(2))


HEADS = ("token", "class", "element")


def output_head(cfg: ModelConfig, n_out: int) -> nn.Module:
    """cfg.head: linear; mlp = Linear(d, d), activation, dropout, Linear(d, n_out) (Borji's ViT head,
    whose width is the MLP's = d in its grid); norm_mlp adds a norm after the first Linear (Borji's
    synthetic encoder: Linear, LayerNorm, ReLU, Dropout, Linear). The activation is cfg.mlp's."""
    if cfg.head == "linear":
        return nn.Linear(cfg.d_model, n_out)
    norm = [make_norm(cfg)] if cfg.head == "norm_mlp" else []
    d = cfg.d_model
    return nn.Sequential(nn.Linear(d, d), *norm, activation(cfg.mlp), dropout(cfg.dropout), nn.Linear(d, n_out))


class Encoder(nn.Module):
    """Bidirectional encoder: inputs -> trunk -> head.

    head: "token" (B, N, n_out) per position; "class" (B, n_out) from the class token or the mean;
    "element" (B, N) one logit per set element.
    """

    def __init__(self, cfg: ModelConfig, inputs: nn.Module, head: str, n_out: int = 1, pool: str = "cls"):
        super().__init__()

        init_seed = draw_seed()
        if head not in HEADS:
            raise UserError(f"head={head!r} is not allowed; use one of {', '.join(HEADS)}")
        cfg = cfg.replace(causal=False)
        cfg.validate()
        self.cfg, self.head_kind, self.pool = cfg, head, pool
        self.inputs = inputs
        self.trunk = Trunk(cfg)
        self.head = output_head(cfg, 1 if head == "element" else n_out)
        init_paired(self, cfg, init_seed, gpt2_part=self.trunk)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inputs(x)  # (B, N, d)
        positions = torch.arange(h.shape[1], device=h.device)[None]
        h = self.trunk(h, positions)
        if self.head_kind == "class":
            cls_token = getattr(self.inputs, "cls", None) is not None and self.pool == "cls"
            return self.head(h[:, 0] if cls_token else h.mean(dim=1))
        out = self.head(h)
        return out.squeeze(-1) if self.head_kind == "element" else out
