"""Parameters, KV-cache bytes and FLOPs: analytic formulas from the spec, and counts from tensors.

The analytic side is what `qkvlab info` reports for configs too large to build; tests check it
against the real modules' tensors for many configs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from qkvlab.base.devices import DTYPE_BYTES, SHARDINGS, dtype_name
from qkvlab.model.positions import axis_encodings, plus_channels_pad
from qkvlab.model.spec import format_kv_heads

if TYPE_CHECKING:  # the formulas read a config's fields; config.py imports them (match_params)
    from qkvlab.model.config import ModelConfig


@dataclass(frozen=True)
class ParamCounts:
    total: int
    embedding: int  # token + position embeddings + an untied LM head
    attention: int  # every attention module (projections, output, score term)

    @property
    def non_embedding(self) -> int:
        return self.total - self.embedding


def _norm_params(cfg: ModelConfig) -> int:
    if cfg.norm == "layernorm":
        return cfg.d_model * (2 if cfg.bias else 1)
    return cfg.d_model if cfg.norm == "rmsnorm" else 0


def _attention_configs(cfg: ModelConfig) -> list[ModelConfig]:
    """Per-layer configs for attention figures only (the MLP width is left unresolved: resolving
    match_params itself counts parameters)."""
    if cfg.layers is None:
        return [cfg] * cfg.n_layer
    return [cfg.replace(attn=a, kv_heads=kv, layers=None, match_params=None) for a, kv in cfg.layer_table()]


def projection_width(cfg: ModelConfig) -> int:
    """Output width of the fused input projection (all distinct learned projections) of a one-scheme
    config (per-layer models: pass cfg.layer_config(i))."""
    spec = cfg.spec
    if cfg.kv_latent is not None:  # the query's projection (if learned) and the cached row (latent, MLA's key)
        p = cfg.rope_dim or 0
        return sum(cfg.n_head * (cfg.head_dim + p) for roles in spec.projections if "q" in roles) + cfg.kv_latent + p
    return sum(
        (cfg.n_head if spec.projection_is_query_shaped(i) else cfg.n_kv_heads) * cfg.head_dim
        for i in range(len(spec.projections))
    )


def latent_up_params(cfg: ModelConfig) -> int:
    """The weights that read keys and values back from a latent (kv_latent x 2 kv_heads d_head; 0 without)."""
    return 0 if cfg.kv_latent is None else cfg.kv_latent * 2 * cfg.n_kv_heads * cfg.head_dim


def attention_params(cfg: ModelConfig) -> int:
    """One layer's attention parameters (one-scheme config; per-layer models: cfg.layer_config(i))."""
    width, inner = projection_width(cfg), cfg.n_head * cfg.head_dim
    n = cfg.d_model * width + inner * cfg.d_model + latent_up_params(cfg)
    if cfg.rope_dim is not None:
        n += cfg.kv_latent  # MLA's latent norm
    if cfg.bias:
        n += width + cfg.d_model
    if cfg.spec.plus:
        n += cfg.plus_channels  # the Linear(m->1) weight; its bias cancels under softmax (positions.py)
    return n


def mlp_params(cfg: ModelConfig, hidden: int) -> int:
    mats = 3 if cfg.mlp == "swiglu" else 2
    n = mats * cfg.d_model * hidden
    if cfg.bias:
        n += (mats - 1) * hidden + cfg.d_model
    return n


def analytic_params(cfg: ModelConfig, hidden: int | None = None) -> ParamCounts:
    hidden = cfg.hidden if hidden is None else hidden
    n_blocks = 1 if cfg.share_layers else cfg.n_layer
    attention = sum(attention_params(lc) for lc in _attention_configs(cfg)[:n_blocks])
    blocks = n_blocks * (2 * _norm_params(cfg) + mlp_params(cfg, hidden)) + attention
    embedding = cfg.vocab_size * cfg.d_model
    if cfg.pos == "learned":
        embedding += cfg.context * cfg.d_model
    if not cfg.tie_embeddings:
        embedding += cfg.vocab_size * cfg.d_model
    final_norm = _norm_params(cfg) if cfg.norm_position == "pre" else 0  # post-norm blocks end normalised
    total = embedding + blocks + final_norm
    return ParamCounts(total=total, embedding=embedding, attention=attention)


def matched_mlp_hidden(cfg: ModelConfig) -> int:
    """MLP width that makes this model's parameter count equal to the same config with the
    reference scheme `cfg.match_params` (Paper A's identity_larger_mlp: 3456 at d=768)."""
    reference = cfg.replace(attn=cfg.match_params, match_params=None, layers=None)
    target = analytic_params(reference).total
    f0 = analytic_params(cfg, hidden=0).total
    slope = analytic_params(cfg, hidden=1).total - f0
    return round((target - f0) / slope)


def counted_params(model: nn.Module) -> ParamCounts:
    """The same counts from a real module's tensors (shared tensors counted once)."""
    seen: set[int] = set()
    total = embedding = attention = 0
    for name, p in model.named_parameters(remove_duplicate=True):
        if id(p) in seen:
            continue
        seen.add(id(p))
        n = p.numel()
        total += n
        if name.startswith(("tok_emb.", "pos_emb.", "lm_head.")):
            embedding += n
        elif ".attn." in name:
            attention += n
    return ParamCounts(total=total, embedding=embedding, attention=attention)


def kv_cache_bytes_per_token(cfg: ModelConfig, dtype: str = "bf16") -> int:
    """Distinct key/value tensors per layer x kv heads x head dim x bytes (every layer caches,
    shared weights or not), summed over layers (per-layer schemes and kv heads)."""
    per_element = DTYPE_BYTES[dtype_name(dtype)]
    return sum(h * w * per_element for lc in _attention_configs(cfg) for h, w in lc.cached_tensors().values())


def flops_per_token(cfg: ModelConfig, context: int | None = None) -> int:
    """Training FLOPs per token, forward + backward (3x forward), at `context` tokens.

    Forward: 2 per weight of every matmul (fused projection, output, MLP, LM head; the identity
    role costs nothing) + 4 * n_head * d_head * T per layer for scores and the weighted sum over
    T keys (PaLM's convention: full T, not the causal average)."""
    T = cfg.context if context is None else context
    inner = cfg.n_head * cfg.head_dim
    mlp_mats = 3 if cfg.mlp == "swiglu" else 2
    per_layer = inner * cfg.d_model + mlp_mats * cfg.d_model * cfg.hidden
    projections = sum(cfg.d_model * projection_width(lc) + latent_up_params(lc) for lc in _attention_configs(cfg))
    matmul_weights = cfg.n_layer * per_layer + projections + cfg.vocab_size * cfg.d_model
    forward = 2 * matmul_weights + cfg.n_layer * 2 * cfg.n_head * (2 * cfg.head_dim + (cfg.rope_dim or 0)) * T
    return 3 * forward


def report(cfg: ModelConfig, *, dtype: str = "bf16", context: int | None = None) -> dict:
    """Everything `qkvlab info` prints, as one JSON-able dict. `context`: tokens in the KV-cache
    figure (default the model's context); FLOPs are at the model's context."""
    T = cfg.context if context is None else context
    counts = analytic_params(cfg)
    per_token = kv_cache_bytes_per_token(cfg, dtype)
    return {
        "scheme": cfg.spec.name,
        "layers": None
        if cfg.layers is None
        else [f"{lc.spec.name}/{format_kv_heads(lc.n_kv_heads, lc.n_head)}" for lc in _attention_configs(cfg)],
        "n_layer": cfg.n_layer,
        "n_head": cfg.n_head,
        "kv_heads": cfg.n_kv_heads,
        "kv_latent": cfg.kv_latent,
        "rope_dim": cfg.rope_dim,
        "d_model": cfg.d_model,
        "d_head": cfg.head_dim,
        "mlp_hidden": cfg.hidden,
        "attn_scale": cfg.scale,
        "params_total": counts.total,
        "params_non_embedding": counts.non_embedding,
        "params_attention": counts.attention,
        "params_embedding": counts.embedding,
        "dtype": dtype,
        "context": T,
        "kv_cache_bytes_per_token": per_token,
        "kv_cache_bytes": per_token * T,
        "flops_per_token": flops_per_token(cfg),
    }


# ---- training memory per GPU -----------------------------------------------------------------
def _attention_plus_pad(cfg: ModelConfig) -> int:
    return plus_channels_pad(cfg.head_dim) if cfg.spec.plus else 0


def _key_channels(cfg: ModelConfig) -> int:
    """Channels of the "+" term's column (key position) part."""
    return axis_encodings(torch.arange(1), cfg.plus_channels, cfg.plus_encoding)[1].shape[1]


def activation_elements_per_token(cfg: ModelConfig) -> dict[str, int]:
    """Elements autograd keeps per token for the backward pass, per layer and outside the layers,
    with flash-style attention (no (T, T) tensor: q, k, v, output and log-sum-exp) and eager norms
    (RMSNorm also keeps its normalised input). Tested against the tensors autograd saves on the CPU.
    Dropout masks are not counted."""
    d, nh, hd, kv = cfg.d_model, cfg.n_head, cfg.head_dim, cfg.n_kv_heads
    norm = {"layernorm": d + 2, "rmsnorm": 2 * d + 1}.get(cfg.norm, 0)  # input (+ normalised) + statistics
    layer = 2 * norm + 2 * d  # the two norms and the two matmul inputs after them
    layer += projection_width(cfg)  # the fused projection's output (q, k, v are views of it)
    pad = _attention_plus_pad(cfg)
    if pad:  # "+" (attention.ride_key_term): q kept for the scale, q', k', v' and the output widened
        layer += (nh * hd if cfg.pos == "rope" else 0) + (2 * nh + 2 * kv) * (hd + pad) + nh * hd
        layer += _key_channels(cfg)  # the key positions' sinusoids
    else:  # rotated query and keys are new tensors; the output doubles as out_proj's input
        layer += ((nh + kv) * hd if cfg.pos == "rope" else 0) + nh * hd
    layer += nh  # log-sum-exp
    layer += (4 if cfg.mlp == "swiglu" else 2) * cfg.hidden
    outside = norm + d  # final norm, the head's input
    return {"per_layer": layer, "outside": outside, "logits": cfg.vocab_size}


def memory_estimate(
    cfg: ModelConfig,
    *,
    micro_batch: int,
    world: int = 1,
    sharding: str = "ddp",
    dtype: str = "bf16",
    accum_steps: int = 1,
) -> dict[str, int]:
    """Bytes per GPU of a training step at `micro_batch` sequences of cfg.context tokens per rank.

    Parameters and AdamW's two moments are fp32. ddp: everything replicated, plus DDP's gradient
    buckets (a second fp32 copy of the gradients). fsdp: parameters, gradients and moments sharded
    over `world` (gradients only without accumulation: with accum_steps > 1 the micro-batches run
    with gradient sync off, and FSDP2 then keeps every unit's full fp32 gradients on every rank), plus the units all-gathered at once in the compute dtype (the root and two blocks:
    the one computing and the one prefetched), and one block's fp32 gradients being reduced.
    Activations: `activation_elements_per_token` x tokens x the compute dtype's bytes (fp32
    log-sum-exp and norm statistics counted at that size too). Logits: the fp32 log-softmax autograd
    keeps, its fp32 gradient and the logits' gradient in the compute dtype, at the peak of backward.
    Not counted: the CUDA context and allocator fragmentation (add ~1-2 GB), torch.compile workspaces."""
    if sharding not in SHARDINGS:
        raise ValueError(f"sharding {sharding!r}: use one of {SHARDINGS}")
    n = analytic_params(cfg).total
    c = DTYPE_BYTES[dtype_name(dtype)]
    block = 2 * _norm_params(cfg) + attention_params(cfg) + mlp_params(cfg, cfg.hidden)  # one FSDP unit
    root = n - (1 if cfg.share_layers else cfg.n_layer) * block  # embeddings, head, final norm
    shard = 1 if sharding == "ddp" else world
    params = 4 * -(-n // shard)
    grads = 4 * (n if accum_steps > 1 else -(-n // shard))
    optimizer = 8 * -(-n // shard)
    comm = 4 * n if sharding == "ddp" else c * (root + 2 * block) + 4 * block
    tokens = micro_batch * cfg.context
    per = activation_elements_per_token(cfg)
    activations = tokens * (cfg.n_layer * per["per_layer"] + per["outside"]) * c
    logits = tokens * per["logits"] * (4 + 4 + c)
    parts = dict(
        params=params, grads=grads, optimizer=optimizer, comm_buffers=comm, activations=activations, logits=logits
    )
    return {**parts, "total": sum(parts.values())}
