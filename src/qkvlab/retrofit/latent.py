"""A joint low-rank key/value latent for a trained layer: the quality a cache of r numbers per token keeps.

The route of MHA2MLA and Palu (low-rank KV caches): a layer caches c = x W_c, r numbers per token,
instead of its keys and values (2 · kv_heads · head_dim numbers), and reads k = RoPE(c W_uk),
v = c W_uv. At r = kv_heads · head_dim it holds K=V's bytes; r is free, so one fit gives a curve over
the cache fraction r / (2 · kv_heads · head_dim). K=V is the special case W_c = W_k, W_uk = I, W_uv a
per-kv-head map, so at equal bytes the latent can only fit better; docs/results/retrofit measures by how much.

The fit (`latent_factors`), per layer, on calibration inputs x: the best rank-r approximation of the
stacked activations [α·K/s_K, V·R/s_V] (K before RoPE; s the RMS of each part; R the Cholesky factor of
out_proj's metric per kv group, Σ_h W_O,hᵀ W_O,h over the query heads h that read the group, so a value
direction costs what it moves the output by). W_c holds the top r principal directions of that stack,
and k and v are read back through their weights. α (how much the keys count against the values) is
chosen per layer from a grid by the attention-output error on held calibration windows
(`fit_latent_layer`); `FactoredKV` then lets the refinement (retrofit_refine.py) take Adam steps on
the factors themselves, so the rows stay of rank r.

`latent_model` then builds the real thing: the source model with `kv_latent = r`, whose cache holds
the latent (attention.py) and whose outputs equal those of the plain layers with the fitted rows. Its
decode step rebuilds every cached key before RoPE (r · kv_heads · head_dim multiply-adds per cached
token and layer), the price of keeping RoPE exact; MHA2MLA avoids it with partial RoPE, which changes
the model. Values are not rebuilt in a decode step (attention.py weights the latents, then lifts).
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
from torch.func import functional_call

from qkvlab.base.errors import UserError
from qkvlab.model.accounting import kv_cache_bytes_per_token
from qkvlab.model.config import ModelConfig
from qkvlab.model.folder import build_model_from_state
from qkvlab.model.transformer import GPT
from qkvlab.retrofit.fit import FitResult, LayerFit, attention_inputs
from qkvlab.retrofit.refine import RefineOptions, output_error, refine_layer, targets

ALPHAS = (0.25, 0.5, 1.0, 2.0, 4.0, 16.0)  # the keys' weight against the values, chosen per layer


def role_rows(attn, role: str) -> slice:
    """The rows of attn's fused in_proj that `role` ('q', 'k', 'v') reads."""
    index = attn.spec.role_source(role)
    start = sum(attn.proj_widths[:index])
    return slice(start, start + attn.proj_widths[index])


def check_layer(attn) -> None:
    spec = attn.spec
    if spec.is_identity("k") or spec.is_identity("v") or spec.shared("k", "v") or spec.plus:
        raise UserError(f"a latent fit reads learned, separate key and value projections; this layer is {spec.name}")
    if attn.in_proj.bias is not None:
        raise UserError("a latent fit reads projections without bias; this layer's in_proj has one")


def out_metric_root(attn) -> torch.Tensor:
    """R (kv·hd, kv·hd), block-diagonal per kv group, float64: R Rᵀ = Σ_h W_O,hᵀ W_O,h over the heads h
    reading the group."""
    nh, kv, hd = attn.n_head, attn.kv_heads, attn.head_dim
    w_o = attn.out_proj.weight.detach().double().view(-1, nh, hd)  # (d, nh, hd)
    blocks = []
    for g in range(kv):
        heads = w_o[:, g * (nh // kv) : (g + 1) * (nh // kv)]  # (d, nh/kv, hd)
        m = torch.einsum("dhe,dhf->ef", heads, heads)
        blocks.append(torch.linalg.cholesky(m + 1e-9 * m.diagonal().mean() * torch.eye(hd, dtype=m.dtype)))
    return torch.block_diag(*blocks)


def calibration_split(xs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A layer's calibration windows xs (n, T, d) -> the fitted tokens (N, d) in float64, their second moment
    XᵀX / N (d, d), and the held windows (the last n // 8, which no closed form reads; all of xs for one window)."""
    n_check = max(1, len(xs) // 8) if len(xs) > 1 else 0
    fit_x, check = (xs[:-n_check], xs[-n_check:]) if n_check else (xs, xs)
    flat = fit_x.flatten(0, 1).double()
    return flat, flat.T @ flat / len(flat), check


def query_metric_root(attn, gram: torch.Tensor) -> torch.Tensor:
    """L (kv·hd, kv·hd), block-diagonal per kv group, float64: L Lᵀ = Σ_h W_Q,h G W_Q,hᵀ over the query heads h
    reading the group (G: the inputs' second moment), so that |Lᵀ Δk|² is the mean square a key error moves
    those heads' scores by (before RoPE)."""
    nh, kv, hd = attn.n_head, attn.kv_heads, attn.head_dim
    w_q = attn.in_proj.weight.detach().double()[role_rows(attn, "q")].view(nh, hd, -1)  # (nh, hd, d)
    blocks = []
    for g in range(kv):
        heads = w_q[g * (nh // kv) : (g + 1) * (nh // kv)]  # (nh/kv, hd, d)
        m = torch.einsum("hed,df,hgf->eg", heads, gram, heads)
        blocks.append(torch.linalg.cholesky(m + 1e-9 * m.diagonal().mean() * torch.eye(hd, dtype=m.dtype)))
    return torch.block_diag(*blocks)


def latent_factors(
    wk, wv, gram, root, rank: int, alpha: float, key_root: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(W_c (r, d), W_uk (n, r), W_uv (n, r)) for key and value rows wk, wv (n, d) over inputs whose second
    moment is gram = XᵀX / N (d, d): the top `rank` principal directions of [α·Lᵀ K/s_K, Rᵀ V/s_V] (module
    doc; L = key_root, the identity unless given: query_metric_root weighs a key direction by what the queries
    read of it). float64 in, float64 out; at rank 2n, W_uk W_c = wk and W_uv W_c = wv."""
    rms = lambda w: float(torch.einsum("od,de,oe->", w, gram, w) / len(w)) ** 0.5  # noqa: E731
    key_root = torch.eye(len(wk), dtype=wk.dtype) if key_root is None else key_root
    s_k, s_v = rms(key_root.T @ wk), rms(root.T @ wv)
    keys = alpha * key_root.T @ wk / s_k if s_k > 1e-12 * s_v else torch.zeros_like(wk)  # rounding-size keys: none
    stacked = torch.cat([keys, root.T @ wv / s_v])  # (2n, d): rows of the weighted stack
    _, vecs = torch.linalg.eigh(stacked @ gram @ stacked.T)
    top = vecs[:, -rank:]  # (2n, r), the largest eigenvalues last
    n = len(wk)
    w_uk = torch.linalg.solve(key_root.T, top[:n]) * s_k / alpha
    return top.T @ stacked, w_uk, torch.linalg.solve(root.T, top[n:]) * s_v


class FactoredKV(nn.Module):
    """An attention layer whose key and value rows are W_uk W_c and W_uv W_c: the same forward as the
    layer with those rows, with the factors (and the query rows and out_proj) as its parameters."""

    def __init__(self, attn, w_c: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor):
        super().__init__()
        self.inner = copy.deepcopy(attn)
        self.inner.in_proj.weight.requires_grad_(False)
        dtype = self.inner.in_proj.weight.dtype
        self.w_c, self.w_uk, self.w_uv = (nn.Parameter(w.to(dtype)) for w in (w_c, w_uk, w_uv))
        self.q = role_rows(attn, "q") if not attn.spec.is_identity("q") else None
        self.w_q = None if self.q is None else nn.Parameter(self.inner.in_proj.weight[self.q].detach().clone())

    def in_proj_weight(self) -> torch.Tensor:
        w = self.inner.in_proj.weight.detach().clone()
        if self.q is not None:
            w[self.q] = self.w_q
        w[role_rows(self.inner, "k")] = self.w_uk @ self.w_c
        w[role_rows(self.inner, "v")] = self.w_uv @ self.w_c
        return w

    def forward(self, x: torch.Tensor, **kwargs) -> torch.Tensor:
        return functional_call(self.inner, {"in_proj.weight": self.in_proj_weight()}, (x,), kwargs)

    @torch.no_grad()
    def materialized(self) -> nn.Module:
        """The plain attention layer with these rows (rank r) and out_proj."""
        attn = copy.deepcopy(self.inner)
        attn.in_proj.weight.copy_(self.in_proj_weight())
        attn.in_proj.weight.requires_grad_(False)
        return attn


@torch.no_grad()
def fit_latent_layer(attn, xs: torch.Tensor, rank: int, rotary, refine: RefineOptions | None = None):
    """attn's layer with key and value rows of rank `rank` (a FactoredKV; attn is left as it is), and
    {alpha, error_fit, error}: the chosen α and the relative output error on the held windows (the last
    len(xs) // 8 of xs (n, T, d), which the closed form never reads) after the closed form and after
    `refine` (None: no steps)."""
    check_layer(attn)
    width = 2 * attn.kv_heads * attn.head_dim
    if not 0 < rank <= width:
        raise UserError(f"rank {rank} must be in [1, {width}] (2 · kv_heads · head_dim)")
    flat, gram, check = calibration_split(xs)
    w = attn.in_proj.weight.detach().double()
    wk, wv = w[role_rows(attn, "k")], w[role_rows(attn, "v")]
    root = out_metric_root(attn)
    y_check = targets(attn, check, rotary)
    best = None
    for alpha in ALPHAS:
        factors = latent_factors(wk, wv, gram, root, rank, alpha)
        trial = FactoredKV(attn, *factors)
        err = output_error(trial, check, y_check, rotary)
        if best is None or err < best[0]:
            # the share of the weighted stack's energy the latent keeps (each part's is len(wk) · its weight²)
            kept = float(torch.einsum("rd,de,re->", factors[0], gram, factors[0])) / (len(wk) * (alpha**2 + 1))
            best = (err, alpha, trial, kept)
    error_fit, alpha, factored, kept = best
    error = error_fit
    if refine is not None and refine.steps > 0:
        _, error = refine_layer(factored, attn, xs, rotary, refine)
    return factored, {"alpha": alpha, "kept": kept, "error_fit": error_fit, "error": error}


def check_source(cfg: ModelConfig, rank: int) -> None:
    """What a latent fit of every layer needs of the source, refused in one line before any text is read."""
    if cfg.layers is not None or cfg.share_layers:
        raise UserError(
            f"--kv-latent {rank}: the source has per-layer schemes or shared layers; a latent fits one-scheme models"
        )
    cfg.replace(kv_latent=rank).validate()  # separate learned K and V, a rank below theirs
    if cfg.bias:
        raise UserError(f"--kv-latent {rank}: a latent fit reads projections without bias; this model has biases")


def fit_latent(model: GPT, cfg: ModelConfig, calib: torch.Tensor, *, rank: int, refine: RefineOptions | None,
               calib_tokens: int, block: int, seed: int = 0, say=None) -> FitResult:  # fmt: skip
    """Every layer of model fitted to a latent of `rank` (fit_latent_layer, refined on the original's inputs),
    as `qkvlab retrofit --kv-latent` reports a fit: the latent model and one LayerFit per layer (r2: the
    share of the weighted key/value energy the latent keeps)."""
    check_source(cfg, rank)
    xs = attention_inputs(model, calib, calib_tokens, block, seed)
    one = cfg.replace(n_layer=1)
    before, after = kv_cache_bytes_per_token(one), kv_cache_bytes_per_token(one.replace(kv_latent=rank))
    layers, report = [], []
    for i, (b, x) in enumerate(zip(model.trunk.blocks, xs)):
        factored, info = fit_latent_layer(
            b.attn, x.to(next(model.parameters()).device), rank, model.trunk.rotary, refine
        )
        layers.append(factored)
        report.append(LayerFit(i, info["kept"], before, after, info["error_fit"], info["error"]))
        if say:
            say(f"layer {i}: latent keeps {info['kept']:.4f} of K/V (alpha {info['alpha']}), output error "
                f"{info['error_fit']:.4f} -> {info['error']:.4f}")  # fmt: skip
    new, new_cfg = latent_model(model, cfg, layers)
    return FitResult(new, new_cfg, report, list(range(cfg.n_layer)))


@torch.no_grad()
def latent_model(model: GPT, cfg: ModelConfig, layers: list[FactoredKV]) -> tuple[GPT, ModelConfig]:
    """model with every layer's keys and values read back from a cached latent (kv_latent = the factors'
    rank): in_proj = [query rows; W_c], kv_up = [W_uk; W_uv], out_proj as fitted, the rest copied."""
    if cfg.layers is not None or cfg.share_layers or len(layers) != cfg.n_layer:
        raise UserError("a latent model is built from one fitted layer per layer of a one-scheme model")
    ranks = {f.w_c.shape[0] for f in layers}
    if len(ranks) != 1:
        raise UserError(f"every layer's latent must have one rank (kv_latent is one setting); got {sorted(ranks)}")
    out_cfg = cfg.replace(kv_latent=ranks.pop()).validate()
    dtype = next(model.parameters()).dtype
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for i, f in enumerate(layers):
        p = f"trunk.blocks.{i}.attn."
        state[p + "in_proj.weight"] = torch.cat([*([] if f.w_q is None else [f.w_q]), f.w_c]).to(dtype)
        state[p + "kv_up.weight"] = torch.cat([f.w_uk, f.w_uv]).to(dtype)
        state[p + "out_proj.weight"] = f.inner.out_proj.weight.detach().to(dtype)
    return build_model_from_state(GPT, out_cfg, state, "the latent model").eval(), out_cfg
