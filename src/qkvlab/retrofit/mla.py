"""A trained RoPE layer to Multi-head Latent Attention: DeepSeek's cache of [latent, one shared RoPE key].

MLA caches r + p numbers per token (model/attention.py): a normalised latent c read back into every kv
head's keys and values with no RoPE, and one key of p numbers shared by every head that carries RoPE.
A Llama-family layer rotates every key dimension, in kv_heads separate heads, so three things have to give:

1. **RoPE on one head's worth of dimensions** (TransMLA's RoRoPE). RoPE rotates dimensions i and i + hd/2 of
   every kv head by the same angle, so any orthogonal mix U_i of the kv heads' pairs at frequency i commutes
   with it: k'_i = U_i k_i and q'_i = U_i q_i give the same scores, exactly (each query head reads its own
   group g, so its query is the kv-heads vector with q_h at g and zeros elsewhere). The first row u_i of U_i
   is chosen so that the mixed component k'_0 = Σ_g u_i[g] k_{g,i} carries the most of what the queries read
   (`rope_directions`); it stays rotated and becomes the shared key k_pe, and each query head gets
   q_pe = u_i[g(h)] q_{h,i}. The rest, k_g - u_i[g] k'_0, loses RoPE: with q_h itself as the query, this is
   the lossy step, and only the part of the keys outside k'_0 pays it. With p < head_dim only p/2
   frequencies keep RoPE; they are every m-th from the fastest (`strides`), so that DeepSeek's inv_freq
   (base^(-2k/p), k = 0..p/2-1) is exactly the original's at base' = base^(m p / hd): no new frequency.
2. **The latent**: the un-rotated keys and the values of every kv head as one rank-r stack
   (retrofit/latent.py's `latent_factors`: values weighted by what out_proj reads, keys by α).
3. **The latent norm** (kv_a_layernorm) divides c by its own RMS per token: a fitted layer's tokens differ in
   that RMS by orders of magnitude (attention sinks), and dividing it out wrecks the layer (relative output
   errors of 10-40 on SmolLM2's later layers). So the norm is kept linear: each layer's latent is scaled so
   that its largest mean square on the calibration text is 1, and the norm's eps (`LINEAR_LATENT_EPS`) is
   far above that, so norm(c) = γ c / sqrt(mean(c²) + eps) is γ / sqrt(eps) times c to within
   mean(c²) / (2 eps) per token; γ is set from calibration (`calibrated_norm`). An export keeps this exactly
   by scaling the latent's rows by sqrt(1e-6 / eps), the eps the engines use (convert/hf_deepseek.py).

The softmax scale is folded into the query (DeepSeek's is (hd + p)^-1/2), and the main norms take the latent
norm's eps (1e-6), since the engines apply one eps to both: a model that transformers, vLLM and llama.cpp
compute alike. `fit_mla` fits every layer (the stride model-wide: base' is one setting), refines each
against the original layer's output (retrofit/refine.py) and builds the MLA model.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn as nn

from qkvlab.base.errors import UserError
from qkvlab.model.accounting import kv_cache_bytes_per_token
from qkvlab.model.attention import LATENT_NORM_EPS, Attention
from qkvlab.model.config import ModelConfig
from qkvlab.model.folder import build_model_from_state
from qkvlab.model.positions import Rotary
from qkvlab.model.transformer import GPT
from qkvlab.retrofit.fit import FitResult, LayerFit, attention_inputs
from qkvlab.retrofit.latent import (
    ALPHAS,
    calibration_split,
    latent_factors,
    out_metric_root,
    query_metric_root,
    role_rows,
)
from qkvlab.retrofit.refine import RefineOptions, output_error, refine_layer, targets

LINEAR_LATENT_EPS = 1e4  # the latent norm's eps: a calibration token's latent (mean square <= 1) moves < 5e-5


# ---- RoPE on one head's worth: the rotation across kv heads -------------------------------------------
def strides(head_dim: int, rope_dim: int) -> list[int]:
    """Every m for which frequencies 0, m, 2m, ... (rope_dim / 2 of them) exist in a head of head_dim."""
    half, kept = head_dim // 2, rope_dim // 2
    return [m for m in range(1, half + 1) if m * (kept - 1) < half]


def kept_frequencies(head_dim: int, rope_dim: int, stride: int) -> list[int]:
    return [stride * k for k in range(rope_dim // 2)]


def rope_base(theta: float, head_dim: int, rope_dim: int, stride: int) -> float:
    """The base whose rope_dim-wide RoPE has exactly the original's frequencies at `kept_frequencies`:
    theta^(-2 m k / hd) = base'^(-2k / p) for base' = theta^(m p / hd)."""
    return theta ** (stride * rope_dim / head_dim)


def pair_rows(wk: torch.Tensor, kv_heads: int, head_dim: int, i: int) -> torch.Tensor:
    """The key rows of frequency i in every kv head: (kvh, 2, d), dimensions i and i + hd/2 (RoPE's halves)."""
    w = wk.view(kv_heads, head_dim, -1)
    return torch.stack((w[:, i], w[:, i + head_dim // 2]), dim=1)


def rope_directions(wq, wk, gram, n_head: int, kv_heads: int, head_dim: int) -> torch.Tensor:
    """u_i for every frequency, (hd/2, kvh) unit rows: the mix of kv heads whose key stays rotated. It
    maximises the query-weighted key energy it keeps, J(u) = 2 uᵀWCu - (uᵀWu)(uᵀCu), with C the kv heads'
    key covariance at frequency i and W the query energy per kv head (uᵀCu, the plain PCA, when every kv head's
    queries weigh alike). float64 in and out."""
    group, out = n_head // kv_heads, []
    q_energy = torch.einsum("od,de,oe->o", wq, gram, wq).view(kv_heads, group, head_dim).sum(1)  # (kvh, hd)
    for i in range(head_dim // 2):
        a = pair_rows(wk, kv_heads, head_dim, i)  # (kvh, 2, d)
        c = torch.einsum("gpd,de,hpe->gh", a, gram, a)  # (kvh, kvh)
        w = torch.diag(q_energy[:, i] + q_energy[:, i + head_dim // 2])
        out.append(_best_direction(c, w))
    return torch.stack(out)


def _best_direction(c: torch.Tensor, w: torch.Tensor, steps: int = 200) -> torch.Tensor:
    """argmax over unit u of 2 uᵀWCu - (uᵀWu)(uᵀCu): projected gradient ascent from the best eigenvector of C
    or of WC's symmetric part (a tiny problem: kvh numbers), stopped when a step no longer gains."""
    if c.shape[0] == 1:
        return torch.ones(1, dtype=c.dtype)
    score = lambda u: float(2 * u @ w @ c @ u - (u @ w @ u) * (u @ c @ u))  # noqa: E731
    starts = [*torch.linalg.eigh(c).eigenvectors.T, *torch.linalg.eigh(w @ c + c @ w).eigenvectors.T]
    u = max(starts, key=score)
    step = 1 / (4 * (float(torch.linalg.matrix_norm(w @ c, 2)) or 1.0))
    for _ in range(steps):
        grad = 2 * (w @ c + c @ w) @ u - 2 * (u @ c @ u) * (w @ u) - 2 * (u @ w @ u) * (c @ u)
        v = u + step * grad
        v = v / v.norm()
        if score(v) <= score(u):
            break
        u = v
    return u / u.norm()


@dataclasses.dataclass
class SplitRows:
    """One layer's rows after RoRoPE (float64): the query (nh, hd + p, d) as MLA reads it, [q_h, u q_h at the
    kept frequencies]; the keys without RoPE (kvh * hd, d) and the shared rotated key (p, d)."""

    query: torch.Tensor
    k_nope: torch.Tensor
    k_pe: torch.Tensor


def split_rope(wq, wk, dirs: torch.Tensor, kept: list[int], n_head: int, kv_heads: int, head_dim: int) -> SplitRows:
    """The rotated component of every kept frequency moved to the shared key (module doc, step 1)."""
    half, group, p = head_dim // 2, n_head // kv_heads, 2 * len(kept)
    d = wk.shape[1]
    k_pe, k_nope = torch.zeros(p, d, dtype=wk.dtype), wk.clone().view(kv_heads, head_dim, d)
    q = wq.view(n_head, head_dim, d)
    q_pe = torch.zeros(n_head, p, d, dtype=wq.dtype)
    for k, i in enumerate(kept):
        u = dirs[i]  # (kvh,)
        for j, dim in enumerate((i, i + half)):  # RoPE's two halves: key dims k and k + p/2
            shared = torch.einsum("g,gd->d", u, k_nope[:, dim])
            k_pe[k + j * p // 2] = shared
            k_nope[:, dim] -= u[:, None] * shared
            q_pe[:, k + j * p // 2] = u.repeat_interleave(group)[:, None] * q[:, dim]
    return SplitRows(torch.cat((q, q_pe), dim=1), k_nope.view(kv_heads * head_dim, d), k_pe)


# ---- the latent norm ----------------------------------------------------------------------------------
def unit_latent(w_c, w_uk, w_uv, x: torch.Tensor):
    """The same factors with the latent scaled so that its largest mean square over calibration inputs x (N, d)
    is 1 (the keys and values read back unchanged)."""
    scale = float(((x.double() @ w_c.T) ** 2).mean(-1).max()) ** 0.5 or 1.0
    return w_c / scale, w_uk * scale, w_uv * scale


def calibrated_norm(w_c: torch.Tensor, x: torch.Tensor, eps: float) -> torch.Tensor:
    """The norm weight γ (r,) with γ ⊙ c / rms(c) closest to c in least squares over calibration inputs x (N, d),
    dimension by dimension: γ_j = E[c_j² / rms] / E[c_j² / rms²], rms = sqrt(mean(c²) + eps)."""
    c = x.double() @ w_c.T  # (N, r)
    rms = torch.sqrt((c**2).mean(-1, keepdim=True) + eps)
    return (c**2 / rms).sum(0) / (c**2 / rms**2).sum(0).clamp_min(1e-300)


# ---- one layer ----------------------------------------------------------------------------------------
def mla_config(cfg: ModelConfig, rank: int, rope_dim: int, stride: int) -> ModelConfig:
    """cfg as MLA: the latent, the shared key, the base that keeps the original frequencies, one eps for every
    norm (not validated: the fit's own steps build layers of every rank)."""
    base = rope_base(cfg.rope_theta, cfg.head_dim, rope_dim, stride)
    return cfg.replace(
        kv_latent=rank,
        rope_dim=rope_dim,
        rope_theta=base,
        norm_eps=LATENT_NORM_EPS,
        latent_norm_eps=LINEAR_LATENT_EPS,
        attn_scale=None,
    )


def build_layer(attn, mla_cfg: ModelConfig, rows: SplitRows, w_c, w_uk, w_uv, gamma) -> Attention:
    """An MLA attention layer from fitted parts (gamma None: no latent norm, for measuring steps apart). The
    query is scaled so that MLA's (hd + p)^-1/2 computes the original's scale."""
    layer = Attention(mla_cfg).to(torch.float64)
    fold = attn.scale / layer.scale
    with torch.no_grad():
        layer.in_proj.weight.copy_(torch.cat((fold * rows.query.flatten(0, 1), w_c, rows.k_pe)))
        layer.kv_up.weight.copy_(torch.cat((w_uk, w_uv)))
        layer.out_proj.weight.copy_(attn.out_proj.weight.double())
        if gamma is None:
            layer.kv_norm = nn.Identity()
        else:
            layer.kv_norm.weight.copy_(gamma)
    return layer.to(attn.out_proj.weight.dtype).eval()


@dataclasses.dataclass
class LayerPlan:
    """What one layer's fit reads: its inputs' second moment, held windows and the original's outputs there."""

    gram: torch.Tensor
    fit_x: torch.Tensor  # (N, d) calibration inputs (the norm's weight)
    check: torch.Tensor  # (n, T, d) held windows
    y_check: torch.Tensor
    dirs: torch.Tensor  # (hd/2, kvh) RoRoPE's directions


def plan_layer(attn, xs: torch.Tensor, rotary) -> LayerPlan:
    flat, gram, check = calibration_split(xs)
    w = attn.in_proj.weight.detach().double()
    wq, wk = w[role_rows(attn, "q")], w[role_rows(attn, "k")]
    dirs = rope_directions(wq, wk, gram, attn.n_head, attn.kv_heads, attn.head_dim)
    return LayerPlan(gram, flat, check, targets(attn, check, rotary), dirs)


def fit_layer_at(attn, plan: LayerPlan, mla_cfg: ModelConfig, stride: int, alpha: float, *, norm: bool = True):
    """The MLA layer for one (stride, alpha) from the closed form (norm=False: no latent norm, for measuring the
    steps apart)."""
    w = attn.in_proj.weight.detach().double()
    wq, wk, wv = (w[role_rows(attn, r)] for r in "qkv")
    kept = kept_frequencies(attn.head_dim, mla_cfg.rope_dim, stride)
    rows = split_rope(wq, wk, plan.dirs, kept, attn.n_head, attn.kv_heads, attn.head_dim)
    roots = out_metric_root(attn), query_metric_root(attn, plan.gram)
    factors = latent_factors(rows.k_nope, wv, plan.gram, roots[0], mla_cfg.kv_latent, alpha, key_root=roots[1])
    w_c, w_uk, w_uv = unit_latent(*factors, plan.fit_x)
    gamma = calibrated_norm(w_c, plan.fit_x, mla_cfg.latent_norm_eps) if norm else None
    return build_layer(attn, mla_cfg, rows, w_c, w_uk, w_uv, gamma)


def mla_rotary(mla_cfg: ModelConfig, like: Rotary) -> Rotary:
    return Rotary(mla_cfg.rope_dim, like.max_positions, mla_cfg.rope_theta).to(like.cos.device)


def best_alpha(attn, plan: LayerPlan, mla_cfg: ModelConfig, stride: int, rotary: Rotary):
    """(error, alpha, layer) with the lowest attention-output error on the held windows over ALPHAS."""
    best = None
    for alpha in ALPHAS:
        layer = fit_layer_at(attn, plan, mla_cfg, stride, alpha)
        err = output_error(layer, plan.check, plan.y_check, rotary)
        if best is None or err < best[0]:
            best = (err, alpha, layer)
    return best


# ---- the model ----------------------------------------------------------------------------------------
def check_source(cfg: ModelConfig, rank: int, rope_dim: int) -> None:
    """What an MLA fit needs of the source, refused in one line before any text is read."""
    flags = f"--kv-latent {rank} --rope-dim {rope_dim}"
    if cfg.pos != "rope":
        raise UserError(f"{flags}: the source has pos={cfg.pos}, no RoPE to keep apart; use --kv-latent alone")
    if cfg.layers is not None or cfg.share_layers:
        raise UserError(f"{flags}: the source has per-layer schemes or shared layers; MLA fits one-scheme models")
    if cfg.bias:
        raise UserError(f"{flags}: an MLA fit reads projections without bias; this model has biases")
    mla_config(cfg, rank, rope_dim, 1).validate()  # separate learned K and V, R + P below theirs, P even and <= hd


@torch.no_grad()
def choose_stride(model: GPT, cfg: ModelConfig, plans: list[LayerPlan], rank: int, rope_dim: int, say) -> int:
    """The stride with the lowest summed output error over the layers (model-wide: base' is one setting)."""
    options = strides(cfg.head_dim, rope_dim)
    if len(options) == 1:
        return options[0]
    totals = {}
    for m in options:
        mcfg = mla_config(cfg, rank, rope_dim, m)
        rot = mla_rotary(mcfg, model.trunk.rotary)
        totals[m] = sum(best_alpha(b.attn, p, mcfg, m, rot)[0] for b, p in zip(model.trunk.blocks, plans))
        say(f"RoPE on frequencies 0, {m}, {2 * m}, ...: summed output error {totals[m]:.4f}")
    return min(totals, key=totals.get)


def fit_mla(model: GPT, cfg: ModelConfig, calib: torch.Tensor, *, rank: int, rope_dim: int,
            refine: RefineOptions | None, calib_tokens: int, block: int, seed: int = 0, say=None) -> FitResult:  # fmt: skip
    """Every layer of model to MLA with a latent of `rank` and a shared RoPE key of `rope_dim` (module doc),
    refined on the original's inputs; the MLA model and one LayerFit per layer (r2: the stride's share
    of the weighted key energy kept rotated)."""
    say = say or (lambda *a, **k: None)
    check_source(cfg, rank, rope_dim)
    device = next(model.parameters()).device
    xs = [x.to(device) for x in attention_inputs(model, calib, calib_tokens, block, seed)]
    plans = [plan_layer(b.attn, x, model.trunk.rotary) for b, x in zip(model.trunk.blocks, xs)]
    stride = choose_stride(model, cfg, plans, rank, rope_dim, say)
    mcfg = mla_config(cfg, rank, rope_dim, stride)
    rotary = mla_rotary(mcfg, model.trunk.rotary)
    one = cfg.replace(n_layer=1)
    before, after = kv_cache_bytes_per_token(one), kv_cache_bytes_per_token(mcfg.replace(n_layer=1))
    layers, report = [], []
    for i, (b, x, plan) in enumerate(zip(model.trunk.blocks, xs, plans)):
        err, alpha, layer = best_alpha(b.attn, plan, mcfg, stride, rotary)
        error = err
        if refine is not None and refine.steps > 0:
            _, error = refine_layer(layer, b.attn, x, model.trunk.rotary, refine, new_rotary=rotary)
        layers.append(layer)
        report.append(LayerFit(i, rope_energy(plan, b.attn, stride, rope_dim), before, after, err, error))
        say(f"layer {i}: MLA alpha {alpha}, output error {err:.4f} -> {error:.4f}")
    new = mla_model(model, mcfg, layers)
    return FitResult(new, new.cfg, report, list(range(cfg.n_layer)))


@torch.no_grad()
def mla_model(model: GPT, mla_cfg: ModelConfig, layers: list[Attention]) -> GPT:
    """model with every layer's attention replaced by the fitted MLA layers, the rest copied (its norms at the
    latent norm's eps)."""
    out_cfg = mla_cfg.validate()
    dtype = next(model.parameters()).dtype
    state = {k: v.detach().clone() for k, v in model.state_dict().items() if ".attn." not in k}
    for i, layer in enumerate(layers):
        for name, t in layer.state_dict().items():
            state[f"trunk.blocks.{i}.attn.{name}"] = t.detach().to(dtype)
    return build_model_from_state(GPT, out_cfg, state, "the MLA model").eval()


def rope_energy(plan: LayerPlan, attn, stride: int, rope_dim: int) -> float:
    """The share of the query-weighted key energy the kept rotated components carry (reported)."""
    w = attn.in_proj.weight.detach().double()
    wk = w[role_rows(attn, "k")]
    total = float(torch.einsum("od,de,oe->", wk, plan.gram, wk))
    kept = kept_frequencies(attn.head_dim, rope_dim, stride)
    rows = split_rope(w[role_rows(attn, "q")], wk, plan.dirs, kept, attn.n_head, attn.kv_heads, attn.head_dim)
    return float(torch.einsum("od,de,oe->", rows.k_pe, plan.gram, rows.k_pe)) / total if total else math.nan
