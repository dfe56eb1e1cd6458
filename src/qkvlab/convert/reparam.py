"""Paper A's theorems as a tool: remove W_Q (or W_K, W_V) exactly by a change of basis, or insert it.

Math in row-vector form (the residual stream x is a row): a change of basis x' = x A + c of the
residual stream leaves every function of x unchanged when each reader and writer is adjusted:

    reader   nn.Linear y = x Wᵀ + b   ->  W' = W A⁻ᵀ,        b' = b - W' c
    writer   adds  o = y Wᵀ + b        ->  W' = Aᵀ W,         b' = Aᵀ b      (the skip carries c)
    writer   replaces the stream       ->  W' = Aᵀ W,         b' = Aᵀ b + c  (MLP without skip)
    embeddings                         ->  E' = E A + c (token), P' = P A (positions)
    unembedding (no bias)              ->  W' = W A⁻ᵀ, needs c = 0 where it reads the stream

With A = W_Q (math layout, d x d; in torch's layout the query rows of ``in_proj`` are W_Qᵀ) and
c = b_Q the new query projection is exactly x' itself: W_Q' = I, b_Q' = 0. The projections, rotary
(applied after them) and the "+" score term see the same q, k, v, so outputs are unchanged.

Where the stream keeps one basis: with a skip around the MLP every layer shares one (A, c), so
only one layer's W_Q can become the identity (theorem a) unless one block serves every layer
(theorem c). Without the MLP skip the MLP's output weights move the stream from layer l's basis
to layer l+1's, so every layer gets its own (theorem b) and the last layer writes in the original
basis. A normalization layer does not commute with a general A; it is refused.

Everything is computed in float64 and cast to the requested dtype at the end.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from qkvlab.base.errors import UserError
from qkvlab.model.config import ModelConfig
from qkvlab.model.folder import build_model_from_state
from qkvlab.model.spec import ROLES, ProjectionSpec, format_layers, parse_scheme
from qkvlab.model.transformer import GPT

ROLE_NAMES = {"q": "query", "k": "key", "v": "value"}
TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-4}
DEFAULT_MAX_COND = 1e6


class CheckFailed(Exception):
    """The converted model's logits differ from the original's by more than the tolerance."""


@dataclass
class Result:
    model: GPT
    cfg: ModelConfig
    notes: list[str] = field(default_factory=list)


# ---- the role table: which role changes ------------------------------------------------------
def role_change(src: ProjectionSpec, dst: ProjectionSpec) -> tuple[str, str]:
    """('remove', role) when dst is src with one unshared learned role made the identity;
    ('insert', role) for the reverse. Anything else is not a reparametrization."""
    why = f"{src.name} -> {dst.name} is not a reparametrization"
    if src.plus != dst.plus:
        raise UserError(f"{why}: the 2D score term cannot be added or removed exactly")
    changed = [r for r in ROLES if src.is_identity(r) != dst.is_identity(r)]
    if len(changed) != 1:
        raise UserError(
            f"{why}: exactly one role must switch between a learned projection and Id "
            "(a change of basis removes W_Q, W_K or W_V, e.g. Q-K-V -> Id-K-V, Q-K=V -> Id-K=V, or the reverse)"
        )
    role = changed[0]
    others = [r for r in ROLES if r != role]
    a, b = others
    if src.shared(a, b) != dst.shared(a, b):
        raise UserError(
            f"{why}: the sharing of {ROLE_NAMES[a]} and {ROLE_NAMES[b]} would change (sharing is not a change of basis)"
        )
    learned = src if dst.is_identity(role) else dst
    if learned.projections[learned.role_source(role)] != (role,):
        raise UserError(
            f"{why}: the {ROLE_NAMES[role]} shares its projection with another role, so making it Id "
            "would make that role the identity too"
        )
    return ("remove" if dst.is_identity(role) else "insert"), role


def _split_rows(weight, bias, widths) -> dict[int, tuple[torch.Tensor, torch.Tensor | None]]:
    """{source index: (weight rows (out, d), bias or None)} of a fused in_proj (weight None: no projection)."""
    if weight is None:
        return {}
    ws = weight.split(widths, dim=0)
    bs = bias.split(widths) if bias is not None else [None] * len(ws)
    return dict(enumerate(zip(ws, bs)))


def _by_role(parts: dict, spec: ProjectionSpec) -> dict[str, tuple[torch.Tensor, torch.Tensor | None] | None]:
    return {r: None if spec.is_identity(r) else parts[spec.role_source(r)] for r in ROLES}


def refuse_latent(attn) -> None:
    """Conversions read a projection per role; a latent layer (kv_latent) has none for its keys and values."""
    if attn.latent is not None:
        raise UserError(
            f"this model caches a key/value latent (kv_latent={attn.latent}): its keys and values have no "
            "projection of their own, which conversion, export, retrofit and similarity read"
        )


def split_in_proj(block, spec: ProjectionSpec) -> dict[int, tuple[torch.Tensor, torch.Tensor | None]]:
    """{source index: (weight rows (out, d), bias or None)} of one block's fused in_proj."""
    attn = block.attn
    refuse_latent(attn)
    if attn.in_proj is None:
        return {}
    return _split_rows(attn.in_proj.weight, attn.in_proj.bias, attn.proj_widths)


def role_weights(block, spec: ProjectionSpec) -> dict[str, tuple[torch.Tensor, torch.Tensor | None] | None]:
    """{role: (weight, bias) or None for an identity role}."""
    return _by_role(split_in_proj(block, spec), spec)


def _state_roles(
    st: dict[str, torch.Tensor], i: int, attn
) -> dict[str, tuple[torch.Tensor, torch.Tensor | None] | None]:
    """`role_weights` of block i read from a state dict (attn: that block's module, for the widths)."""
    refuse_latent(attn)
    p = f"trunk.blocks.{i}.attn.in_proj."
    return _by_role(_split_rows(st.get(p + "weight"), st.get(p + "bias"), attn.proj_widths), attn.spec)


def _fuse(dst: ProjectionSpec, rows: dict[str, tuple[torch.Tensor, torch.Tensor | None]]):
    """Weight and bias of the fused in_proj for dst, from per-role (weight, bias)."""
    ws, bs = [], []
    for roles in dst.projections:
        w, b = rows[roles[0]]
        ws.append(w)
        bs.append(b)
    weight = torch.cat(ws, 0) if ws else None
    bias = torch.cat(bs, 0) if ws and bs[0] is not None else None
    return weight, bias


# ---- the conversion --------------------------------------------------------------------------
def convert(
    model: GPT,
    cfg: ModelConfig,
    target: str,
    *,
    layer: int | None = None,
    max_cond: float = DEFAULT_MAX_COND,
    dtype: torch.dtype = torch.float64,
) -> Result:
    """Return an equivalent model of scheme `target` (or, with `layer` in a model whose other layers
    keep the role, the same scheme with that layer's W_Q exactly the identity)."""
    dst = parse_scheme(target)
    if layer is not None and not 0 <= layer < cfg.n_layer:
        raise UserError(f"--layer {layer} is out of range; this model has layers 0..{cfg.n_layer - 1}")
    # Each converted layer's own scheme must reach dst by one role switch (one-scheme models: all alike).
    specs = [lc.spec for lc in cfg.layer_configs()]
    changes = {role_change(specs[i], dst) for i in ([layer] if layer is not None else range(cfg.n_layer))}
    if len(changes) > 1:
        raise UserError(f"-> {dst.name}: the layers' schemes need different role changes; convert them with --layer")
    (kind, role) = changes.pop()
    scales = {lc.scale for lc in cfg.layer_configs()}
    if len(scales) > 1:
        raise UserError(
            "the layers' default score scales differ (identity and learned query/key layers); set attn_scale to "
            "convert, since the result pins one attn_scale for every layer"
        )
    m = _float64_copy(model)
    if kind == "insert":
        if layer is not None:
            raise UserError("--layer applies to removing a projection; inserting one is done in every layer")
        out_cfg = _target_cfg(cfg, dst, untie=False, table=[(dst.name, kv) for _, kv in cfg.layer_table()])
        return _rebuild(
            m.state_dict(),
            out_cfg,
            _insert_rows(m, cfg, dst, role),
            dtype,
            [f"inserted an explicit {ROLE_NAMES[role]} projection W = I in every layer"],
        )
    return _remove(m, cfg, dst, role, layer, max_cond, dtype)


def _remove(m: GPT, cfg: ModelConfig, dst: ProjectionSpec, role: str, layer: int | None, max_cond: float, dtype):
    name = f"W_{role.upper()}"
    d = _check_removable(m, cfg, role, layer)
    n = cfg.n_layer
    todo = list(range(len(m.trunk.blocks))) if cfg.share_layers else ([layer] if layer is not None else list(range(n)))
    if role == "v" and cfg.bias:
        _fold_value_bias(m, todo)
    theta, notes = _bases(m, cfg, role, todo, max_cond)
    eye, zero = torch.eye(d, dtype=torch.float64), torch.zeros(d, dtype=torch.float64)
    # Basis (A, c) of the stream entering each block, and of the stream the unembedding reads.
    if cfg.mlp_skip or cfg.share_layers:
        basis, final = [theta[todo[0]]] * n, theta[todo[0]]
    else:
        basis, final = [theta.get(l, (eye, zero)) for l in range(n)], (eye, zero)
    st = _change_basis({k: v.clone() for k, v in m.state_dict().items()}, cfg, len(m.trunk.blocks), basis, final)
    # The removed role's rows are now exactly I (and its bias 0): drop them in the converted layers.
    table = list(cfg.layer_table())
    for i in theta if not cfg.share_layers else range(n):
        table[i] = (dst.name, table[i][1])
    fused = []
    for i, block in enumerate(m.trunk.blocks):
        rows = _state_roles(st, i, block.attn)
        if i in theta:
            w, b = rows[role]
            rows[role] = (eye.clone(), None if b is None else torch.zeros_like(b))
        fused.append(_fuse(parse_scheme(table[i][0]), rows))
    out_cfg = _target_cfg(cfg, dst, untie=True, table=table)
    if cfg.share_layers or len(todo) == n:  # every layer ends with the identity role
        notes.append(f"{name} removed in every layer: scheme {cfg.scheme_label} -> {out_cfg.scheme_label}")
    else:
        notes.append(  # W is square (`_check_removable`)
            f"layer {todo[0]}'s {name} removed: layers={out_cfg.layers!r} ({d * d} fewer parameters in that layer)"
        )
    return _rebuild(st, out_cfg, fused, dtype, notes)


def _check_removable(m: GPT, cfg: ModelConfig, role: str, layer: int | None) -> int:
    """Refuse, in one line, a model whose W_role no change of basis removes exactly; -> d_model."""
    name = f"W_{role.upper()}"
    if cfg.norm != "none":
        raise UserError(
            f"norm={cfg.norm}: a normalization layer does not commute with a general change of basis, so "
            f"{name} cannot be removed exactly (the theorems need norm=none; otherwise {name} = Id is reachable only by training)"
        )
    if cfg.pos == "sinusoidal":
        raise UserError(
            f"pos=sinusoidal: fixed input positions cannot follow the residual stream's change of basis, so {name} "
            "cannot be removed exactly (use pos learned, rope or none)"
        )
    kv = min(lc.n_kv_heads for lc in cfg.layer_configs())
    d, width = cfg.d_model, (cfg.n_head if role == "q" else kv) * cfg.head_dim
    if role != "q" and kv != cfg.n_head:
        raise UserError(
            f"an identity {ROLE_NAMES[role]} needs kv_heads == n_head; this model has GQA (kv_heads={kv}, "
            f"n_head={cfg.n_head}), so {name} is {width}x{d}, not square"
        )
    if width != d:
        raise UserError(
            f"{name} is {width}x{d}, not square (n_head*d_head must equal d_model={d}); no change of basis makes it Id"
        )
    if cfg.share_layers and layer is not None:
        raise UserError(
            "--layer: with share_layers every layer uses one block, so all layers are converted together; drop --layer"
        )
    if layer is None and cfg.n_layer > 1 and cfg.mlp_skip and not cfg.share_layers:
        raise UserError(
            "mlp_skip=True: with a skip around the MLP every layer shares one basis of the residual stream, so only one "
            f"layer's {name} can be removed exactly; pass --layer L (theorem a), or use a model without the MLP skip "
            "(theorem b) or with shared layers (theorem c)"
        )
    if cfg.mlp_skip and not cfg.share_layers:
        fixed = [i for i, b in enumerate(m.trunk.blocks) if b.attn.spec.identity_role is not None and i != layer]
        if fixed:
            raise UserError(
                f"layer {fixed[0]} already has an identity role, which reads the residual stream as it is; with a skip "
                f"around the MLP one change of basis serves every layer, so no other layer's {name} can be removed exactly"
            )
    return d


@torch.no_grad()
def _fold_value_bias(m: GPT, todo: list[int]) -> None:
    """A value bias reaches the output as A·1·b_v = b_v (attention rows sum to 1): out_proj's bias takes it."""
    for l in todo:
        blk = m.trunk.blocks[l]
        _, b_v = role_weights(blk, blk.attn.spec)["v"]
        blk.attn.out_proj.bias += blk.attn.out_proj.weight @ b_v


def _bases(m: GPT, cfg: ModelConfig, role: str, todo: list[int], max_cond: float):
    """-> ({layer: (A, c)} with A = W_role (math layout) and x' = x A + c, notes). Refuses an
    ill-conditioned W, and a bias the change of basis cannot carry."""
    name = f"W_{role.upper()}"
    # A key bias adds q_i . b_k to row i of the scores: constant along the row, so softmax ignores it,
    # unless rotary turns it into q_i R_(j-i) b_k. Then (and always for a query bias) it moves into c.
    # A value bias was folded into out_proj (`_fold_value_bias`).
    drop_bias = (role == "k" and cfg.pos != "rope") or role == "v"
    zero = torch.zeros(cfg.d_model, dtype=torch.float64)
    theta: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    notes = []
    for l in todo:
        w, b = role_weights(m.trunk.blocks[l], m.trunk.blocks[l].attn.spec)[role]
        cond = torch.linalg.cond(w).item()
        if not math.isfinite(cond) or cond > max_cond:
            raise UserError(
                f"layer {l}: {name} has condition number {cond:.3g} > --max-cond {max_cond:.3g} "
                "(singular or nearly so); inverting it would not give an equivalent model"
            )
        notes.append(f"layer {l}: cond({name}) = {cond:.4g}")
        c = b.detach().clone() if (b is not None and not drop_bias) else zero
        theta[l] = (w.detach().T.clone(), c)
    if (cfg.mlp_skip or cfg.share_layers) and any(c.abs().max() > 0 for _, c in theta.values()):
        raise UserError(
            f"{name} has a nonzero bias: removing it shifts the residual stream by that bias, and with "
            f"{'shared layers' if cfg.share_layers else 'a skip around the MLP'} the shift reaches the unembedding, which has "
            "no bias; exact removal needs a bias-free (or zero-bias) projection"
        )
    return theta, notes


def _change_basis(st: dict[str, torch.Tensor], cfg: ModelConfig, n_blocks: int, basis, final):
    """Every reader and writer of the residual stream rewritten for block i's basis[i] = (A, c) and the
    unembedding's `final` (the table in the module doc). st is changed in place and returned."""
    n = cfg.n_layer
    A0, c0 = basis[0]
    st["tok_emb.weight"] = st["tok_emb.weight"] @ A0 + c0
    if "pos_emb.weight" in st:
        st["pos_emb.weight"] = st["pos_emb.weight"] @ A0
    st["lm_head.weight"] = st["lm_head.weight"] @ torch.linalg.inv(final[0]).T  # untied from here
    for i in range(n_blocks):
        A, c = basis[i]
        A_next, c_next = basis[i] if cfg.mlp_skip else (basis[i + 1] if i + 1 < n else final)
        if cfg.share_layers:
            A_next, c_next = A, c
        p = f"trunk.blocks.{i}."
        Ainv_T = torch.linalg.inv(A).T
        for lin in ("attn.in_proj", "mlp.up", "mlp.gate"):
            if p + lin + ".weight" in st:
                W = st[p + lin + ".weight"] @ Ainv_T
                st[p + lin + ".weight"] = W
                if p + lin + ".bias" in st:
                    st[p + lin + ".bias"] = st[p + lin + ".bias"] - W @ c
        st[p + "attn.out_proj.weight"] = A.T @ st[p + "attn.out_proj.weight"]
        if p + "attn.out_proj.bias" in st:
            st[p + "attn.out_proj.bias"] = A.T @ st[p + "attn.out_proj.bias"]
        st[p + "mlp.down.weight"] = A_next.T @ st[p + "mlp.down.weight"]
        if p + "mlp.down.bias" in st:
            add = torch.zeros_like(c) if cfg.mlp_skip else c_next
            st[p + "mlp.down.bias"] = A_next.T @ st[p + "mlp.down.bias"] + add
    return st


def _insert_rows(m: GPT, cfg: ModelConfig, dst: ProjectionSpec, role: str):
    fused = []
    for block in m.trunk.blocks:
        rows = role_weights(block, block.attn.spec)
        bias = cfg.bias
        rows[role] = (
            torch.eye(cfg.d_model, dtype=torch.float64),
            torch.zeros(cfg.d_model, dtype=torch.float64) if bias else None,
        )
        fused.append(_fuse(dst, rows))
    return fused


def _target_cfg(cfg: ModelConfig, dst: ProjectionSpec, *, untie: bool, table=None) -> ModelConfig:
    """Same architecture, new scheme (or, with `table`, these per-layer (scheme, kv_heads)); the score
    scale and MLP width pinned to the source's (an identity role changes their defaults)."""
    attn, kv, layers = dst.name, cfg.kv_heads, cfg.layers
    if table is not None and len(set(table)) == 1:
        (attn, kv), layers = table[0], None
    elif table is not None:
        attn, kv, layers = cfg.attn, cfg.kv_heads, format_layers(tuple(table), (cfg.attn, cfg.kv_heads))
    out = cfg.replace(
        attn=attn,
        kv_heads=kv,
        layers=layers,
        attn_scale=cfg.scale,
        mlp_hidden=cfg.hidden,
        match_params=None,
        tie_embeddings=cfg.tie_embeddings and not untie,
    )
    return out.validate()


def _float64_copy(model: GPT) -> GPT:
    state = {k: v.detach().to(torch.float64) for k, v in model.state_dict().items()}
    return build_model_from_state(GPT, model.cfg, state, "the model").eval()


def _rebuild(st: dict[str, torch.Tensor], out_cfg: ModelConfig, fused, dtype, notes) -> Result:
    """A GPT(out_cfg) holding st's weights with each block's in_proj replaced by `fused`."""
    st = {k: v for k, v in st.items() if not k.endswith(("attn.in_proj.weight", "attn.in_proj.bias"))}
    for i, (w, b) in enumerate(fused):
        if w is not None:
            st[f"trunk.blocks.{i}.attn.in_proj.weight"] = w
            if b is not None:
                st[f"trunk.blocks.{i}.attn.in_proj.bias"] = b
    out = build_model_from_state(GPT, out_cfg, st, f"the converted {out_cfg.scheme_label} model")
    return Result(out.to(dtype).eval(), out_cfg, notes)


# ---- the equivalence check -------------------------------------------------------------------
@torch.no_grad()
def logit_diff(
    ref: torch.nn.Module,
    cand: torch.nn.Module,
    vocab: int,
    context: int,
    *,
    seed: int = 0,
    batch: int = 2,
    length: int = 32,
    cand_logits=None,
) -> tuple[float, float]:
    """Max abs and relative (max|Δ| / max|ref|) logit difference on random token ids."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, vocab, (batch, min(length, context)), generator=g)
    a = _logits(ref, idx).double()
    b = (_logits(cand, idx) if cand_logits is None else cand_logits(idx)).double()
    diff = (a - b).abs().max().item()
    return diff, diff / max(a.abs().max().item(), 1e-300)


def _logits(model, idx):
    out = model(idx)
    return out[0] if isinstance(out, tuple) else out.logits


def check(ref: GPT, cand: GPT, dtype: torch.dtype, what: str = "conversion") -> tuple[float, float]:
    """Compare on random inputs (reference in float64); raise CheckFailed above the tolerance."""
    ref64 = _float64_copy(ref)
    abs_d, rel_d = logit_diff(ref64, cand, ref.cfg.vocab_size, ref.cfg.context)
    tol = TOLERANCE[dtype]
    if not rel_d <= tol:
        raise CheckFailed(
            f"{what} is not equivalent in {str(dtype).replace('torch.', '')}: max_rel_logit_diff={rel_d:.3g} > {tol:g} "
            "(ill-conditioned weights? try --dtype float64 or a lower --max-cond); nothing written"
        )
    return abs_d, rel_d
