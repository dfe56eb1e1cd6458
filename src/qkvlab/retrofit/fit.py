"""The retrofit's fit: keep the keys, fit the values, fold the fit into the output projection.

Per converted layer (any selection of layers; the result is a per-layer model, docs/schemes.md):

- keys are kept exactly when the kv heads stay (so rotary stays exact); with fewer kv heads each
  group of key heads is mean-pooled, as the GQA paper (Ainslie et al. 2023) does;
- the new value tensor is the (pooled) key for K=V, else the mean-pooled values; every source
  value head g is then fitted from it by least squares on calibration activations of real text,
  V_g ≈ V'_G M_g (+ c_g when out_proj has a bias), and M_g is folded into the output projection
  columns of the query heads that read g: W_O,h ← W_O,h M_gᵀ (b_O += W_O,h c_g). With
  pool="mean" and separate values the GQA paper's plain mean is kept (M = I).
  R² = 1 - SSE/SST of that fit is the layer's fit quality (reported);
- then each converted layer is refined against the original layer's attention output
  (retrofit_refine.py), and its relative output error on held calibration windows is the layer's
  cost: with a cache budget the layers with the lowest error are converted first until the KV
  cache is at most that fraction of the original's;
- with refine inputs="converted", the chosen layers are then refined again in order, each on the
  inputs it reads in the converted model (retrofit_refine.refine_in_sequence).

start="mean" instead starts the shared tensor from the average of the key and value projections
(Paper B's authors' best start for their distillation); the keys are then no longer exact and the
refinement has to repair them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from qkvlab.base.errors import UserError
from qkvlab.convert.reparam import role_weights
from qkvlab.model.accounting import kv_cache_bytes_per_token
from qkvlab.model.config import ModelConfig
from qkvlab.model.folder import build_model_from_state
from qkvlab.model.spec import format_layers, parse_scheme, select_layers
from qkvlab.model.transformer import GPT
from qkvlab.retrofit.refine import RefineOptions, refine_in_sequence, refine_layer

TARGETS = ("Q-K-V", "Q-K=V")  # what a fit can reach: a learned query and key; values shared or not
POOLS = ("fit", "mean")
STARTS = ("keys", "mean")  # the shared K=V tensor starts as the keys, or as the mean of keys and values


# ---- the fit ----------------------------------------------------------------------------------------
@dataclass
class LayerFit:
    layer: int
    r2: float  # of the source values from the new value tensor (1.0: nothing fitted)
    cache_bytes_before: int  # per token, bf16
    cache_bytes_after: int
    error_fit: float = 0.0  # relative attention-output error on held calibration windows, after the fit
    error: float = 0.0  # the same after refinement (= error_fit without it): the layer's cost
    # refine inputs="converted": the error on the inputs the layer reads in the converted model, after that pass
    error_in_model: float | None = None


def calibration_windows(tokens: torch.Tensor, n_tokens: int, block: int, seed: int = 0) -> torch.Tensor:
    """n_tokens // block windows (n, block) at distinct random window positions over all of tokens
    (seeded): the corpus's whole range, not its first document."""
    n_win = max(1, (len(tokens) - 1) // block)
    n = max(1, min(n_tokens // block, n_win))
    starts = torch.randperm(n_win, generator=torch.Generator().manual_seed(seed))[:n].sort().values * block
    return torch.stack([tokens[s : s + block] for s in starts.tolist()])


@torch.no_grad()
def attention_inputs(model: GPT, tokens: torch.Tensor, n_tokens: int, block: int, seed: int = 0) -> list[torch.Tensor]:
    """Each layer's attention input (after norm1) on calibration windows of tokens: (n, block, d)
    per layer, in the model's dtype, on the CPU."""
    x = calibration_windows(tokens, n_tokens, block, seed)
    captured: list[list[torch.Tensor]] = [[] for _ in model.trunk.blocks]
    hooks = [
        blk.attn.register_forward_pre_hook(lambda m, args, i=i: captured[i].append(args[0].detach().cpu()))
        for i, blk in enumerate(model.trunk.blocks)
    ]
    try:
        model.eval()
        p = next(model.parameters())
        for row in x.split(4):
            model(row.to(p.device))
    finally:
        for h in hooks:
            h.remove()
    return [torch.cat(c) for c in captured]


def _heads(w: torch.Tensor, b: torch.Tensor | None, heads: int, hd: int):
    return w.view(heads, hd, -1), None if b is None else b.view(heads, hd)


def _pool(w: torch.Tensor, b: torch.Tensor | None, r: int):
    """Mean of each group of r consecutive heads: (h, hd, d) -> (h / r, hd, d)."""
    h = w.shape[0]
    wp = w.view(h // r, r, *w.shape[1:]).mean(1)
    return wp, None if b is None else b.view(h // r, r, -1).mean(1)


def _fittable_roles(block, dst_kv: int) -> dict:
    """The layer's role weights, refused unless it has learned, separate query and key projections and
    `dst_kv` divides its key/value heads."""
    spec, src_kv = block.attn.spec, block.attn.kv_heads
    roles = role_weights(block, spec)
    if any(roles[r] is None for r in ("q", "k", "v")) or spec.plus or spec.shared("q", "k"):
        raise UserError(
            f"retrofit reads a layer with learned, separate query and key projections (Q-K-V, Q-K=V); this one is "
            f"{spec.name}"
        )
    if src_kv % dst_kv:
        raise UserError(f"kv_heads={dst_kv} must divide the layer's {src_kv} kv heads (heads are pooled, never split)")
    return roles


def fit_layer(block, x: torch.Tensor, dst_scheme: str, dst_kv: int, pool: str, ridge: float = 1e-10, start="keys"):
    """New fused in_proj rows, out_proj (weight, bias) and R² for one block; x: its (N, d) inputs."""
    attn = block.attn
    nh, hd, src_kv = attn.n_head, attn.head_dim, attn.kv_heads
    roles = _fittable_roles(block, dst_kv)
    r = src_kv // dst_kv
    f64 = lambda t: None if t is None else t.detach().double()  # noqa: E731
    wq, bq = map(f64, roles["q"])
    wk, bk = _heads(f64(roles["k"][0]), f64(roles["k"][1]), src_kv, hd)
    wv, bv = _heads(f64(roles["v"][0]), f64(roles["v"][1]), src_kv, hd)
    wk2, bk2 = _pool(wk, bk, r)  # keys: exact when r == 1
    shared = parse_scheme(dst_scheme).shared("k", "v")
    if shared and start == "mean":  # one tensor halfway between the keys and the values
        wv_p, bv_p = _pool(wv, bv, r)
        wk2, bk2 = (wk2 + wv_p) / 2, None if bk2 is None else (bk2 + bv_p) / 2
    wv2, bv2 = (wk2, bk2) if shared else _pool(wv, bv, r)

    def act(w, b):  # (N, heads, hd)
        out = torch.einsum("nd,hed->nhe", x, w)
        return out if b is None else out + b

    v_src, v_new = act(wv, bv), act(wv2, bv2)
    W_O = attn.out_proj.weight.detach().double().clone()  # (d, nh*hd)
    b_O = None if attn.out_proj.bias is None else attn.out_proj.bias.detach().double().clone()
    fit = shared or pool == "fit"
    sse = sst = 0.0
    maps = []
    for g in range(src_kv):
        target = v_src[:, g]  # (N, hd)
        sst += float(((target - target.mean(0)) ** 2).sum())
        if not fit:
            maps.append((torch.eye(hd, dtype=torch.float64), None))
            sse += float(((target - v_new[:, g // r]) ** 2).sum())
            continue
        A = v_new[:, g // r]
        if b_O is not None:  # an intercept can be folded into the output bias
            A = torch.cat([A, torch.ones(len(A), 1, dtype=A.dtype)], 1)
        gram = A.T @ A
        gram += ridge * gram.diagonal().mean() * torch.eye(len(gram), dtype=gram.dtype)
        sol = torch.linalg.solve(gram, A.T @ target)  # (hd [+1], hd)
        sse += float(((A @ sol - target) ** 2).sum())
        maps.append((sol[:hd], sol[hd] if b_O is not None else None))
    per_kv = nh // src_kv
    old = W_O.clone()
    for h in range(nh):
        M, c = maps[h // per_kv]
        cols = slice(h * hd, (h + 1) * hd)
        W_O[:, cols] = old[:, cols] @ M.T
        if c is not None:
            b_O += old[:, cols] @ c
    flat = lambda w, b: (w.reshape(-1, w.shape[-1]), None if b is None else b.reshape(-1))  # noqa: E731
    rows = {"q": (wq, bq), "k": flat(wk2, bk2), "v": flat(wv2, bv2)}
    r2 = 1.0 - sse / sst if sst > 0 else 1.0
    return rows, (W_O, b_O), r2


@dataclass
class FitResult:
    model: GPT
    cfg: ModelConfig
    layers: list[LayerFit] = field(default_factory=list)  # every candidate layer, converted or not
    converted: list[int] = field(default_factory=list)


def check_target(to: str, pool: str = "fit", cache_budget: float | None = None, start: str = "keys") -> str:
    """The target scheme's name; what needs no model is refused before one is loaded."""
    dst = parse_scheme(to)
    if dst.name not in TARGETS:
        raise UserError(
            f"--to {to}: retrofit fits {' or '.join(TARGETS)} (with --kv-heads for GQA/MQA); an identity projection "
            "is removed exactly by `qkvlab convert`, a shared query/key has no fit that keeps the keys"
        )
    if pool not in POOLS:
        raise UserError(f"pool={pool!r} is not allowed; use one of {', '.join(POOLS)}")
    if cache_budget is not None and not 0 < cache_budget <= 1:
        raise UserError(f"--cache-budget {cache_budget} must be a fraction in (0, 1]")
    if start not in STARTS:
        raise UserError(f"start={start!r} is not allowed; use one of {', '.join(STARTS)}")
    return dst.name


def candidate_layers(cfg: ModelConfig, layers: str | None, kv_heads: int | None, to: str) -> list[int]:
    """The layers a fit may convert; what does not fit this model, or would change none of its
    layers (already `to` with those key/value heads), is refused before any work."""
    if kv_heads is not None and (kv_heads <= 0 or cfg.n_head % kv_heads):
        raise UserError(f"--kv-heads {kv_heads} must divide n_head={cfg.n_head}")
    if cfg.share_layers:
        raise UserError("share_layers=True: one block serves every layer, so layers cannot be retrofitted one by one")
    chosen = select_layers(layers, cfg.n_layer) if layers else list(range(cfg.n_layer))
    dst = parse_scheme(to).name
    unchanged = [
        (lc.spec.name, lc.n_kv_heads) == (dst, kv_heads or lc.n_kv_heads) for lc in map(cfg.layer_config, chosen)
    ]
    if all(unchanged):
        raise UserError(
            f"--to {to}: the chosen layers are {dst} with those key/value heads already; nothing to retrofit "
            "(give another --to, or --kv-heads for GQA/MQA)"
        )
    return chosen


def fit(
    model: GPT,
    cfg: ModelConfig,
    calib: torch.Tensor,
    *,
    to: str = "Q-K=V",
    kv_heads: int | None = None,
    layers: str | None = None,
    cache_budget: float | None = None,
    pool: str = "fit",
    start: str = "keys",
    refine: RefineOptions | None = None,
    calib_tokens: int = 2048,
    block: int | None = None,
    seed: int = 0,
    inputs: list[torch.Tensor] | None = None,
    say: Callable[[str], None] | None = None,
) -> FitResult:
    """The retrofitted model (in the source's dtype) and per-layer fit quality; see the module doc.
    refine: the refinement's options (None: none, the closed-form fit alone); inputs: the layers'
    calibration inputs from `attention_inputs` (computed here when None)."""
    dst = check_target(to, pool, cache_budget, start)
    candidates = candidate_layers(cfg, layers, kv_heads, dst)
    block = block or min(cfg.context, 256)
    xs = inputs if inputs is not None else attention_inputs(model, calib, calib_tokens, block, seed)
    fits: dict[int, tuple] = {}
    for i in candidates:
        kv = kv_heads or cfg.layer_config(i).n_kv_heads
        fits[i] = fit_layer(model.trunk.blocks[i], xs[i].flatten(0, 1).double(), dst, kv, pool, start=start) + (kv,)
    # every candidate converted: the model each layer is refined and costed in (layers are independent)
    table = list(cfg.layer_table())
    for i in candidates:
        table[i] = (dst, fits[i][3])
    trial = build_model_from_state(GPT, _config(cfg, table), _fitted_state(model, table, fits, candidates), "the fit")
    refine = refine or RefineOptions(steps=0)
    report: list[LayerFit] = []
    for i in candidates:
        lc = cfg.layer_config(i)
        after = cfg.replace(attn=dst, kv_heads=fits[i][3], layers=None, match_params=None, n_layer=1)
        before = lc.replace(n_layer=1, layers=None, match_params=None)
        e_fit, e = refine_layer(
            trial.trunk.blocks[i].attn, model.trunk.blocks[i].attn, xs[i], model.trunk.rotary, refine
        )
        report.append(
            LayerFit(i, fits[i][2], kv_cache_bytes_per_token(before), kv_cache_bytes_per_token(after), e_fit, e)
        )
        if say:
            say(f"layer {i}: R^2 {fits[i][2]:.4f}, output error {e_fit:.4f} -> {e:.4f} after {refine.steps} steps")
    chosen = candidates
    if cache_budget is not None:
        chosen = _within_budget(cfg, report, cache_budget, f"{dst}{'' if kv_heads is None else f'/{kv_heads}'}")
    new, out_cfg = with_layers(model, cfg, trial, trial.cfg, chosen)
    if refine.inputs == "converted" and refine.steps > 0:
        windows = calibration_windows(calib, calib_tokens, block, seed)  # the windows xs were read from
        _refine_converted(new, model, chosen, windows, xs, refine, report, say)
    return FitResult(new, out_cfg, report, chosen)


def _refine_converted(new, model, chosen, windows, xs, refine, report: list[LayerFit], say) -> None:
    """Refine the chosen layers in sequence, each on the converted model's own inputs; the report's
    `error_in_model` is then what each layer errs inside that model."""
    in_sequence = refine_in_sequence(new, model, chosen, windows, xs, refine)
    for lf in report:
        if lf.layer in in_sequence:
            lf.error_in_model = in_sequence[lf.layer][1]
            if say:
                say(
                    f"layer {lf.layer}: in the converted model, output error {in_sequence[lf.layer][0]:.4f} -> "
                    f"{lf.error_in_model:.4f}"
                )


def with_layers(model: GPT, cfg: ModelConfig, fitted: GPT, fitted_cfg: ModelConfig, layers: list[int]):
    """The original model with the given layers taken from `fitted` (their scheme, kv heads and
    attention weights): the retrofit at any subset of the layers one fit converted."""
    table = list(cfg.layer_table())
    fitted_table = list(fitted_cfg.layer_table())
    for i in layers:
        table[i] = fitted_table[i]
    out_cfg = _config(cfg, table)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}  # the result shares no tensor
    dtype = next(model.parameters()).dtype
    taken = tuple(f"trunk.blocks.{i}.attn." for i in layers)
    for k, v in fitted.state_dict().items():
        if k.startswith(taken):
            state[k] = v.detach().to(dtype, copy=True)
    return build_model_from_state(GPT, out_cfg, state, "the fitted model").eval(), out_cfg


def _config(cfg: ModelConfig, table: list[tuple[str, int]]) -> ModelConfig:
    """cfg with each layer's (scheme, kv heads) from table: one scheme, or a per-layer model."""
    uniform = len(set(table)) == 1
    return cfg.replace(
        attn=table[0][0] if uniform else cfg.attn,
        kv_heads=table[0][1] if uniform else cfg.kv_heads,
        layers=None if uniform else format_layers(tuple(table), (cfg.attn, cfg.kv_heads)),
        attn_scale=cfg.scale,
        mlp_hidden=cfg.hidden,
        match_params=None,
    ).validate()


def _within_budget(cfg: ModelConfig, report: list[LayerFit], budget: float, target: str) -> list[int]:
    """The layers with the lowest output error whose conversion brings the KV cache to at most
    `budget` of it."""
    total = kv_cache_bytes_per_token(cfg)
    goal = budget * total
    chosen, now = [], total
    for lf in sorted(report, key=lambda f: (f.error, f.layer)):  # cheapest layers first
        if now <= goal + 1e-9:
            break
        if lf.cache_bytes_after < lf.cache_bytes_before:
            chosen.append(lf.layer)
            now -= lf.cache_bytes_before - lf.cache_bytes_after
    if now > goal + 1e-9:
        raise UserError(
            f"--cache-budget {budget}: converting every candidate layer to {target} leaves {now / total:.3f} of "
            "the cache; allow more layers or fewer kv heads"
        )
    return sorted(chosen)


def _fitted_state(model: GPT, table, fits: dict[int, tuple], chosen: list[int]) -> dict[str, torch.Tensor]:
    """model's state (its dtype, on the CPU) with each chosen layer's fitted in_proj rows and out_proj."""
    dtype = next(model.parameters()).dtype
    st = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for i in chosen:
        rows, (w_o, b_o), _, _ = fits[i]
        p = f"trunk.blocks.{i}.attn."
        projections = parse_scheme(table[i][0]).projections
        st[p + "in_proj.weight"] = torch.cat([rows[roles[0]][0] for roles in projections], 0)
        if p + "in_proj.bias" in st:
            st[p + "in_proj.bias"] = torch.cat([rows[roles[0]][1] for roles in projections], 0)
        st[p + "out_proj.weight"] = w_o
        if b_o is not None:
            st[p + "out_proj.bias"] = b_o
    return {k: v.to("cpu", dtype) for k, v in st.items()}
