"""Multi-head attention driven by a ProjectionSpec.

One code path for every scheme: the distinct learned projections are one fused Linear; each role
(query, key, value) is either a slice of that output or a view of the input (identity). Roles that
share a projection get the *same tensor*, so SDPA sees k is v for K=V and a KV cache stores it once.
With kv_latent = r the key and value projections are replaced by one latent of r numbers per token
(a slice of the fused output, what the cache holds) and `kv_up`, which reads both back from it.

With rope_dim = p as well, the layer is DeepSeek's Multi-head Latent Attention: the latent is normalised
(`kv_norm`, DeepSeek's kv_a_layernorm), a key of p numbers shared by every head carries RoPE beside it (the
cache row is [latent, rotated key]), each query head is [d_head numbers read against the latent's keys,
p rotated ones read against the shared key], and the latent's keys get no RoPE. Nothing in a cached row
then depends on the query's position, so a decode step attends in the absorbed form: W_uk folded into the
query, the row itself as the key, its latent part as the value, W_uv applied to the output. A latent
without RoPE in the model (learned positions) decodes the same way.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from qkvlab.model.config import ModelConfig
from qkvlab.model.positions import ScoreTerm2D, apply_rotary, plus_channels_pad
from qkvlab.model.spec import IDENTITY, LATENT

LATENT_NORM_EPS = 1e-6  # DeepSeek's kv_a_layernorm eps, fixed at 1e-6 by transformers: what an export's engines use
_SDPA_HAS_GQA = tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 5)  # SDPA enable_gqa= is new in 2.5


def dropout(p: float) -> nn.Module:
    """Dropout, or nothing at p = 0 (a no-op module still costs a call per layer when decoding)."""
    return nn.Dropout(p) if p > 0 else nn.Identity()


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.spec = cfg.spec
        self.n_head, self.kv_heads, self.head_dim = cfg.n_head, cfg.n_kv_heads, cfg.head_dim
        self.scale = cfg.scale
        self.causal = cfg.causal
        self.dropout = cfg.dropout
        # Heads per learned projection: query-feeding ones have n_head, key/value-only ones kv_heads.
        self.proj_heads = [
            self.n_head if self.spec.projection_is_query_shaped(i) else self.kv_heads
            for i in range(len(self.spec.projections))
        ]
        widths = [h * self.head_dim for h in self.proj_heads]
        self.latent, self.rope_dim = cfg.kv_latent, cfg.rope_dim or 0
        self.kv_up = self.kv_norm = None
        if self.latent is not None:  # the query's projection (if learned), then the cached row (config.py checked)
            query = [self.n_head * (self.head_dim + self.rope_dim) for roles in self.spec.projections if "q" in roles]
            widths = [*query, self.latent + self.rope_dim]  # a query head: [d_head, rope_dim]; a row: [latent, key]
            self.kv_up = nn.Linear(self.latent, 2 * self.kv_heads * self.head_dim, bias=False)  # rows: [W_uk; W_uv]
            if cfg.rope_dim is not None:
                self.kv_norm = nn.RMSNorm(self.latent, eps=cfg.latent_norm_eps)
        self.proj_widths = widths
        self.in_proj = nn.Linear(cfg.d_model, sum(widths), bias=cfg.bias) if widths else None
        self.out_proj = nn.Linear(self.n_head * self.head_dim, cfg.d_model, bias=cfg.bias)
        self.score_term = ScoreTerm2D(cfg.plus_channels, cfg.context, cfg.plus_encoding) if self.spec.plus else None
        self.resid_dropout = dropout(cfg.dropout)
        # With rotary and K=V (or a latent) the cache holds un-rotated tensors; keys rotate on read. MLA's rows
        # hold its shared key rotated and nothing else rotates: its rows are read as they are (absorbed).
        self.k_shared_with_v = self.spec.role_source("k") == self.spec.role_source("v")
        self.absorbs = self.latent is not None and (cfg.rope_dim is not None or cfg.pos != "rope")
        self.keys_rotate_on_read = self.k_shared_with_v or (self.latent is not None and not self.absorbs)
        # A cache layer that reads its storage in place (serve's paged decode step, cache.py) is handed the
        # new tensors and attends itself, for every layout but the "+" term's and a latent whose keys rotate
        # on read: those attend over what `update` returns.
        self.attends_in_place = self.score_term is None and (self.latent is None or self.absorbs)

    def project(self, x: torch.Tensor) -> dict[int, torch.Tensor]:
        """x (B, T, C) -> {source index: (B, heads, T, hd)} for every source a role reads ((B, 1, T, r + p) for a
        latent)."""
        B, T, _ = x.shape
        out: dict[int, torch.Tensor] = {}
        if self.latent is not None:
            h, row = self.in_proj(x), self.latent + self.rope_dim
            if not self.spec.is_identity("q"):
                q = h[..., :-row].view(B, T, self.n_head, self.head_dim + self.rope_dim).transpose(1, 2)
                out[self.spec.role_source("q")] = q  # (B, nh, T, hd + p)
            out[LATENT] = h[..., -row:][:, None]  # (B, 1, T, r + p): the latent, then MLA's key before RoPE
        elif self.in_proj is not None:
            # one view and one transpose for all projections, then split by heads: the same strided
            # views as per-projection view/transpose, in fewer ops (a decode step is op-bound)
            heads = self.in_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, sum heads, T, hd)
            out = dict(enumerate(heads.split(self.proj_heads, dim=1)))
        if self.spec.identity_role is not None:
            out[IDENTITY] = x.view(B, T, self.n_head, self.head_dim).transpose(1, 2)  # a view: no matmul
        return out

    def forward(
        self,
        x: torch.Tensor,
        *,
        q_pos: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
        rope_k: tuple[torch.Tensor, torch.Tensor] | None = None,
        cache=None,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x (B, T, C); q_pos (B, T) positions of x's tokens; rope: (cos, sin) at q_pos; rope_k: at the
        cached key positions (default: rope); cache: a LayerCache (cache.py) or None;
        mask: bool (B, 1, T, S), True = attend."""
        B, T, _ = x.shape
        src = self.spec.source
        new = self.project(x)
        if self.absorbs:
            y = self.attend_latent(new[src[0]], new[LATENT], rope, cache, mask)  # (B, nh, T, hd)
        else:
            q = new[src[0]]
            if rope is not None:
                q = apply_rotary(q, *rope)
                if not self.keys_rotate_on_read:
                    new[src[1]] = apply_rotary(new[src[1]], *rope)  # store keys rotated
            if cache is not None and cache.reads_in_place and self.attends_in_place:
                rotate = rope_k if rope is not None and self.keys_rotate_on_read else None
                stored = {s: new[s] for s in self.spec.cached_sources()}
                y = cache.attend(q, stored, src[1], src[2], self.scale, rotate)  # (B, nh, T, hd)
            else:
                y = self.attend_stored(q, new, q_pos, rope, rope_k, cache, mask)
        y = y.transpose(1, 2).reshape(B, T, self.n_head * self.head_dim)  # (B, T, nh*hd)
        return self.resid_dropout(self.out_proj(y))

    def attend_stored(self, q, new, q_pos, rope, rope_k, cache, mask) -> torch.Tensor:
        """q (B, nh, T, hd) rotated; new: the projected sources -> attention's output (B, nh, T, hd) over
        what the cache holds (`update`), or over `new` alone without a cache."""
        T, src = q.shape[2], self.spec.source
        lift = None
        if self.latent is not None:
            latent = new[LATENT] if cache is None else cache.update(LATENT, new[LATENT])  # (B, 1, S, r)
            k, v, lift = self.read_latent(latent, T)
        else:
            if cache is not None:
                stored = {s: cache.update(s, new[s]) for s in self.spec.cached_sources()}  # (B, h, S, hd)
            else:
                stored = new
            k, v = stored[src[1]], stored[src[2]]  # the same tensor when K=V
        if rope is not None and self.keys_rotate_on_read:
            k = apply_rotary(k, *(rope_k if rope_k is not None else rope))
        attn_mask, is_causal = mask, self.causal and mask is None and cache is None
        if self.score_term is not None:  # the "+" term inside the dot product: masks and kernels as without it
            k_pos = q_pos if cache is None else cache.key_positions()  # (B, S)
            q, k, v = ride_key_term(self.score_term, q, k, v, k_pos, self.scale)
        y = sdpa(q, k, v, attn_mask, is_causal, self.scale, self.dropout if self.training else 0.0)
        if lift is not None:
            y = lift(y)  # (B, nh, T, r) -> (B, nh, T, hd)
        if self.score_term is not None:
            y = y[..., : self.head_dim]  # drop the "+" term's padding channels
        return y

    def attend_latent(self, q: torch.Tensor, raw: torch.Tensor, rope, cache, mask) -> torch.Tensor:
        """A latent whose keys need no RoPE (MLA, or a model without RoPE): q (B, nh, T, hd + p) and the new rows
        (B, 1, T, r + p) as projected -> attention's output (B, nh, T, hd). Explicit keys and values when the
        queries are as many as the rows (prefill, training), the absorbed form when few queries read many rows."""
        T, hd, r = q.shape[2], self.head_dim, self.latent
        q_nope, q_pe = q[..., :hd], q[..., hd:]  # (B, nh, T, hd), (B, nh, T, p)
        if self.kv_norm is not None:  # the cached row: [norm(latent), RoPE(key)], as DeepSeek caches it
            latent, k_pe = raw.split((r, self.rope_dim), dim=-1)
            raw = torch.cat((self.kv_norm(latent), apply_rotary(k_pe, *rope)), dim=-1)
            q_pe = apply_rotary(q_pe, *rope)
        if cache is not None and cache.reads_in_place:  # the rows read where the cache holds them
            y = cache.attend(self.absorbed_query(q_nope, q_pe), {LATENT: raw}, LATENT, LATENT, self.scale, None, r)
            return self.lifted(y)
        rows = raw if cache is None else cache.update(LATENT, raw)  # (B, 1, S, r + p)
        attn_mask, is_causal = mask, self.causal and mask is None and cache is None
        dropout_p = self.dropout if self.training else 0.0
        if T * self.n_head < rows.shape[2] * self.kv_heads:
            return self.absorbed(q_nope, q_pe, rows, attn_mask, dropout_p)
        k, v = self.expand_rows(rows)
        return sdpa(torch.cat((q_nope, q_pe), dim=-1), k, v, attn_mask, is_causal, self.scale, dropout_p)

    def latent_maps(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_uk and W_uv per kv head: (kvh, hd, r) each."""
        n, shape = self.kv_heads * self.head_dim, (self.kv_heads, self.head_dim, self.latent)
        return self.kv_up.weight[:n].view(shape), self.kv_up.weight[n:].view(shape)

    def expand_rows(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """rows (B, 1, S, r + p) -> keys (B, kvh, S, hd + p): [W_uk c, shared rotated key], values (B, kvh, S, hd)."""
        B, _, S, _ = rows.shape
        kvh, hd, n = self.kv_heads, self.head_dim, self.kv_heads * self.head_dim
        latent = rows[:, 0, :, : self.latent]  # (B, S, r)
        k = F.linear(latent, self.kv_up.weight[:n]).view(B, S, kvh, hd).transpose(1, 2)
        v = F.linear(latent, self.kv_up.weight[n:]).view(B, S, kvh, hd).transpose(1, 2)
        if self.rope_dim:
            k = torch.cat((k, rows[..., self.latent :].expand(B, kvh, S, self.rope_dim)), dim=-1)
        return k, v

    def absorbed(self, q_nope, q_pe, rows, attn_mask, dropout_p) -> torch.Tensor:
        """q_nope (B, nh, T, hd), q_pe (B, nh, T, p) rotated, rows (B, 1, S, r + p) -> (B, nh, T, hd), exactly the
        explicit form: q·(W_uk c) = (W_ukᵀ q)·c, and Σ_j a_j W_uv c_j = W_uv Σ_j a_j c_j. Every query head reads
        the one row tensor (as MQA reads its one head), so a step reads r + p numbers per cached token."""
        q_abs = self.absorbed_query(q_nope, q_pe)  # (B, nh, T, r + p)
        # the whole row as the value, its first r outputs kept: a sliced value tensor (a row stride of r + p) takes
        # SDPA's CPU kernel off its fast path (one-token queries ride as one query per kv head: sdpa)
        y = sdpa(q_abs, rows, rows, attn_mask, False, self.scale, dropout_p)  # (B, nh, T, r + p)
        return self.lifted(y[..., : self.latent])

    def absorbed_query(self, q_nope: torch.Tensor, q_pe: torch.Tensor) -> torch.Tensor:
        """q_nope (B, nh, T, hd), q_pe (B, nh, T, p) -> the query read against whole rows: (B, nh, T, r + p)."""
        B, nh, T, hd = q_nope.shape
        kvh, group = self.kv_heads, self.n_head // self.kv_heads
        q_lat = torch.einsum("bgqtd,gdr->bgqtr", q_nope.reshape(B, kvh, group, T, hd), self.latent_maps()[0])
        return torch.cat((q_lat.reshape(B, nh, T, self.latent), q_pe), dim=-1)  # query heads by kv head

    def lifted(self, y: torch.Tensor) -> torch.Tensor:
        """Attention's output over the latents (B, nh, T, r) -> (B, nh, T, hd), through W_uv."""
        B, nh, T, _ = y.shape
        kvh, group = self.kv_heads, self.n_head // self.kv_heads
        y = y.reshape(B, kvh, group, T, self.latent)
        return torch.einsum("bgqtr,gdr->bgqtd", y, self.latent_maps()[1]).reshape(B, nh, T, self.head_dim)

    def read_latent(self, latent: torch.Tensor, queries: int):
        """latent (B, 1, S, r) -> keys (B, kvh, S, hd), un-rotated, and either the values (B, kvh, S, hd) and
        None, or, when few queries read many tokens (a decode step), the latent itself as the values and the
        map that lifts attention's output (B, nh, T, r) to (B, nh, T, hd): sum_j p_j (W_uv c_j) =
        W_uv (sum_j p_j c_j), exactly, without rebuilding every cached token's values."""
        B, _, S, r = latent.shape
        kvh, hd, n = self.kv_heads, self.head_dim, self.kv_heads * self.head_dim
        w_k, w_v = self.kv_up.weight[:n], self.kv_up.weight[n:]
        k = F.linear(latent[:, 0], w_k).view(B, S, kvh, hd).transpose(1, 2)
        if queries * self.n_head >= S * kvh:  # values for every token cost no more than lifting every query's
            return k, F.linear(latent[:, 0], w_v).view(B, S, kvh, hd).transpose(1, 2), None
        group, w_v = self.n_head // kvh, w_v.view(kvh, hd, r)

        def lift(y: torch.Tensor) -> torch.Tensor:
            y = y.view(B, kvh, group, -1, r)  # query heads in kv-head order, as GQA groups them
            return torch.einsum("bgqtr,gdr->bgqtd", y, w_v).reshape(B, self.n_head, -1, hd)

        return k, latent.expand(B, kvh, S, r), lift


def ride_key_term(term: ScoreTerm2D, q, k, v, k_pos: torch.Tensor, scale: float):
    """S * sum(w) + c(j) as one scaled dot product, exactly (see ScoreTerm2D for why a(i), b drop out):
    q' = [q * sum(w), 1/scale, 0...], k' = [k, c(j), 0...], v' = [v, 0...] (v padded because flash
    attention wants equal head dims; the output's extra channels are zeros, sliced off by the caller).
    New tensors: a cached or shared (K=V) k and v are never altered. q (B, h, T, hd); k, v (B, hk, S, hd)."""
    B, hq, T, hd = q.shape
    hk, S = k.shape[1], k.shape[2]
    pad = plus_channels_pad(hd)
    c = term.key_term(k_pos).to(k.dtype)  # (B, S)
    q = torch.cat((q * term.score_scale(), q.new_full((B, hq, T, 1), 1.0 / scale), q.new_zeros(B, hq, T, pad - 1)), -1)
    k = torch.cat((k, c[:, None, :, None].expand(B, hk, S, 1), k.new_zeros(B, hk, S, pad - 1)), -1)
    return q, k, F.pad(v, (0, pad))


def sdpa(q, k, v, attn_mask, is_causal, scale, dropout_p):
    """SDPA with GQA (kv heads shared by groups of query heads) and values narrower than the keys (MLA):
    q (B, hq, T, wk), k (B, hk, S, wk), v (B, hk, S, wv) -> (B, hq, T, wv)."""
    width = v.shape[-1]
    if width < k.shape[-1]:  # SDPA's CPU flash kernel takes keys and values of one width, else its math path
        v = F.pad(v, (0, k.shape[-1] - width))  # zeros: outputs that are dropped
        return sdpa(q, k, v, attn_mask, is_causal, scale, dropout_p)[..., :width]
    B, hq, T, hd = q.shape
    hk = k.shape[1]
    if hq != hk and T == 1 and not is_causal and (attn_mask is None or attn_mask.shape[1] == 1):
        # Decoding: a group's one-token queries become the rows of one query against their kv head,
        # so each kv head is read once per group (what GQA/MQA save), not repeated per query head.
        y = F.scaled_dot_product_attention(
            q.reshape(B, hk, hq // hk, hd), k, v, attn_mask=attn_mask, scale=scale, dropout_p=dropout_p
        )
        return y.reshape(B, hq, 1, y.shape[-1])
    if q.shape[1] != k.shape[1]:
        if _SDPA_HAS_GQA:
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale, dropout_p=dropout_p, enable_gqa=True
            )
        rep = q.shape[1] // k.shape[1]
        same = k is v
        k = k.repeat_interleave(rep, dim=1)
        v = k if same else v.repeat_interleave(rep, dim=1)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale, dropout_p=dropout_p
    )
