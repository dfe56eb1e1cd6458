"""How alike are a model's query, key and value projections? (Paper B's diagnostic)

- linear CKA of the projection OUTPUTS on real text, as Paper B's authors measure it (their later
  scripts `kv_similarity_analysis.py` / `kv_similarity_llm.py`): each role's output on N tokens is
  an (N, width) matrix (bias included, before rotary; an identity role's output is its input);
  with rows centred, CKA(X, Y) = ||Y^T X||_F^2 / (||X^T X||_F ||Y^T Y||_F); reported per layer
  and as the mean over layers. The widths may differ (GQA: Q is (N, n_head d_h), K and V are
  (N, kv_heads d_h)): CKA compares the two N x N similarity structures XX^T and YY^T, so no
  head repetition is needed. CKA is invariant to orthogonal maps and isotropic scaling of either
  side, which the weight cosine is not. Roles that share a projection have CKA 1.

Weight-space definitions (ours; the weight cosine is not what the paper's figures measure):

- cosine(A, B): of the flattened weight matrices, <A, B>_F / (|A|_F |B|_F), signed. Weights are
  taken in the layout (out, d_model): rows are head-major output features. With GQA a key/value
  projection has kv_heads*d_h rows against the query's n_head*d_h: each key/value head is
  repeated for the n_head/kv_heads query heads that read it (repeat_interleave, as attention
  does), so the cosine is the one between the per-query-head matrices the attention actually uses.
  Key vs value always have the same shape. Roles that share one projection have cosine 1 by
  construction; an identity role has no weight matrix and is reported as null.
- effective rank: Roy & Vetterli (2007), exp(H(p)) with p_i = s_i / sum(s) over the singular
  values s; a real number between 1 and min(out, d). Also reported: rank90, the smallest k whose
  top-k singular values hold 90% of the energy sum(s_i^2).

Caveat: q.k depends on W_Q W_Kᵀ only, so per-head (W_Q M, W_K M⁻ᵀ) give the same model with
different cosines; the figure describes the weights training arrived at, not the function.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qkvlab.base.settings import setting
from qkvlab.convert.reparam import role_weights
from qkvlab.model.spec import ROLES

PAIRS = (("k", "v"), ("q", "k"), ("q", "v"))
PAIR_KEYS = tuple(f"{a}_{b}" for a, b in PAIRS)  # "k_v", "q_k", "q_v"
# Paper B, trained Q-K-V language models (300M: d_model 1024): activation similarities (slides, poster);
# the authors' later scripts give, for their 300M Q-K-V model, weight cosine 0.0 and K-V CKA 0.70.
PAPER_B_CKA = {"k_v": 0.73, "q_k": 0.42, "q_v": 0.31}
PAPER_B_300M = {"cos_k_v": 0.0, "cka_k_v": 0.70}
PAPER_B_RANK = "687 / 702 of 1024 (roles not stated)"


@dataclass
class SimilarityConfig:
    """What `qkvlab similarity` reads: the model, and the text its activations are measured on."""

    model: str = setting(
        help="qkvlab model folder, Hugging Face folder, or .gguf file", positional=True, metavar="MODEL"
    )
    text: str | None = setting(
        None, help="UTF-8 text for the activation CKA (default: the default corpus)", metavar="FILE"
    )
    tokens: int = setting(1024, help="tokens of text to run", minimum=2)
    tokenizer: str | None = setting(None, help="tokenizer when a qkvlab folder records none", metavar="gpt2|bytes|DIR")
    json: bool = setting(False, help="print one JSON object")


def linear_cka(x: torch.Tensor, y: torch.Tensor) -> float:
    """x (N, p), y (N, q) -> linear CKA of the row-centred matrices, in float64."""
    x, y = x.double(), y.double()
    x, y = x - x.mean(0), y - y.mean(0)
    num = (y.T @ x).square().sum()
    den = (x.T @ x).norm() * (y.T @ y).norm()
    return float(num / den.clamp_min(1e-300))


@torch.no_grad()
def role_outputs(model, cfg, ids: torch.Tensor) -> list[dict[str, torch.Tensor]]:
    """Run model on ids (B, T); per layer {role: (B*T, width)} projection outputs, before rotary,
    bias included (an identity role's output is the attention input). Shared roles get one tensor."""
    captured: list[dict[str, torch.Tensor]] = []
    src = cfg.spec.source

    def hook(attn, args, kwargs):
        x = args[0]  # (B, T, C): the normalised attention input
        out = attn.project(x)  # {source: (B, h, T, hd)}
        flat = {s: t.transpose(1, 2).reshape(x.shape[0] * x.shape[1], -1) for s, t in out.items()}
        captured.append({r: flat[src[i]] for i, r in enumerate(ROLES)})

    attns = {id(model.trunk.layer(i).attn): model.trunk.layer(i).attn for i in range(cfg.n_layer)}
    handles = [a.register_forward_pre_hook(hook, with_kwargs=True) for a in attns.values()]
    try:
        model(ids)
    finally:
        for h in handles:
            h.remove()
    return captured


def activation_cka(model, cfg, ids: torch.Tensor) -> dict:
    """Per layer and mean linear CKA of the Q/K/V projection outputs on token ids (B, T)."""
    layers = []
    for outs in role_outputs(model, cfg, ids):
        layers.append({k: linear_cka(outs[a], outs[b]) for k, (a, b) in zip(PAIR_KEYS, PAIRS)})
    mean = {k: sum(r[k] for r in layers) / len(layers) for k in PAIR_KEYS}
    return {**mean, "layers": layers, "tokens": int(ids.numel())}


def _repeat_heads(w: torch.Tensor, n_head: int, head_dim: int) -> torch.Tensor:
    heads = w.shape[0] // head_dim
    if heads == n_head:
        return w
    return w.view(heads, head_dim, -1).repeat_interleave(n_head // heads, 0).reshape(n_head * head_dim, -1)


def cosine(a: torch.Tensor, b: torch.Tensor, n_head: int, head_dim: int) -> float:
    a, b = _repeat_heads(a.double(), n_head, head_dim), _repeat_heads(b.double(), n_head, head_dim)
    return float((a * b).sum() / (a.norm() * b.norm()).clamp_min(1e-300))


def effective_rank(w: torch.Tensor) -> float:
    s = torch.linalg.svdvals(w.double())
    p = s / s.sum()
    p = p[p > 0]
    return float(torch.exp(-(p * p.log()).sum()))


def energy_rank(w: torch.Tensor, fraction: float = 0.9) -> int:
    e = torch.linalg.svdvals(w.double()) ** 2
    return int((torch.cumsum(e, 0) / e.sum() < fraction).sum().item()) + 1


@torch.no_grad()
def similarity(model, cfg, ids: torch.Tensor | None = None) -> dict:
    """Per layer and mean: cosines of the Q/K/V projection pairs, effective ranks, rank90; with token
    ids (B, T), also the linear CKA of the projection outputs (`cka`: the layer means, per layer in
    `cka.layers` and in each layer row)."""
    layers = []
    for i in range(cfg.n_layer):
        mats = {r: (None if wb is None else wb[0]) for r, wb in role_weights(model.trunk.layer(i), cfg.spec).items()}
        row = {"layer": i, "cos": {}, "shared": [], "erank": {}, "rank90": {}, "max_rank": {}}
        for a, b in PAIRS:
            key = f"{a}_{b}"
            if mats[a] is None or mats[b] is None:
                row["cos"][key] = None
            else:
                row["cos"][key] = cosine(mats[a], mats[b], cfg.n_head, cfg.head_dim)
                if cfg.spec.shared(a, b):
                    row["shared"].append(key)
        for r in ROLES:
            w = mats[r]
            row["erank"][r] = None if w is None else effective_rank(w)
            row["rank90"][r] = None if w is None else energy_rank(w)
            row["max_rank"][r] = None if w is None else min(w.shape)
        layers.append(row)
    cka = None
    if ids is not None:
        cka = activation_cka(model, cfg, ids)
        for row, c in zip(layers, cka["layers"]):
            row["cka"] = c

    def mean(get):
        vals = [v for v in map(get, layers) if v is not None]
        return sum(vals) / len(vals) if vals else None

    return {
        "scheme": cfg.spec.name,
        "n_layer": cfg.n_layer,
        "d_model": cfg.d_model,
        "layers": layers,
        "mean": {
            "cos": {k: mean(lambda r, k=k: r["cos"][k]) for k in PAIR_KEYS},
            "erank": {r: mean(lambda x, r=r: x["erank"][r]) for r in ROLES},
            "rank90": {r: mean(lambda x, r=r: x["rank90"][r]) for r in ROLES},
            "max_rank": layers[0]["max_rank"] if layers else {},
        },
        "cka": cka,
        "paper_b": {"cka": PAPER_B_CKA, "authors_300m": PAPER_B_300M, "effective_rank": PAPER_B_RANK},
        "definitions": {
            "cka": "linear CKA of row-centred (N, width) projection outputs on real text, bias included, pre-rotary",
            "cos": "signed cosine of flattened (out, d_model) weights; GQA key/value heads repeated per query head",
            "erank": "Roy & Vetterli: exp(entropy of singular values / their sum)",
            "rank90": "smallest k with 90% of sum(s^2) in the top k singular values",
        },
    }


def format_report(rep: dict) -> str:
    def f(x, spec=".3f"):
        return "-" if x is None else format(x, spec)

    cka = rep.get("cka")
    head = f"{'layer':>5}  {'cos K-V':>8} {'cos Q-K':>8} {'cos Q-V':>8}   "
    if cka is not None:
        head += f"{'CKA K-V':>8} {'CKA Q-K':>8} {'CKA Q-V':>8}   "
    head += f"{'erank Q':>8} {'erank K':>8} {'erank V':>8}   {'r90 Q':>6} {'r90 K':>6} {'r90 V':>6}"
    lines = [f"{rep['scheme']}, {rep['n_layer']} layers, d_model {rep['d_model']}", head]

    def row(label, r, c_act, rank_fmt):
        c, e, k = r["cos"], r["erank"], r["rank90"]
        line = f"{label:>5}  {f(c['k_v']):>8} {f(c['q_k']):>8} {f(c['q_v']):>8}   "
        if c_act is not None:
            line += f"{f(c_act['k_v']):>8} {f(c_act['q_k']):>8} {f(c_act['q_v']):>8}   "
        return (
            line + f"{f(e['q'], '.1f'):>8} {f(e['k'], '.1f'):>8} {f(e['v'], '.1f'):>8}   "
            f"{f(k['q'], rank_fmt):>6} {f(k['k'], rank_fmt):>6} {f(k['v'], rank_fmt):>6}"
        )

    for r in rep["layers"]:
        lines.append(row(str(r["layer"]), r, r.get("cka"), "d"))
    lines.append(row("mean", rep["mean"], cka, ".1f"))
    mr = rep["mean"]["max_rank"]
    lines.append(
        f"max rank (min of the matrix shape): Q {f(mr.get('q'), 'd')}, K {f(mr.get('k'), 'd')}, V {f(mr.get('v'), 'd')}"
    )
    pb, p300 = rep["paper_b"]["cka"], rep["paper_b"]["authors_300m"]
    m = rep["mean"]["cos"]
    lines.append(
        f"Paper B (trained Q-K-V LMs, activation similarity): K-V {pb['k_v']:.2f} Q-K {pb['q_k']:.2f} "
        f"Q-V {pb['q_v']:.2f}; its authors' 300M: CKA K-V {p300['cka_k_v']:.2f}, weight cos K-V {p300['cos_k_v']:.1f}"
    )
    measured = f"measured (mean): weight cos K-V {f(m['k_v'], '.2f')} Q-K {f(m['q_k'], '.2f')} Q-V {f(m['q_v'], '.2f')}"
    if cka is not None:
        measured += (
            f"; CKA K-V {f(cka['k_v'], '.2f')} Q-K {f(cka['q_k'], '.2f')} Q-V {f(cka['q_v'], '.2f')} "
            f"on {cka['tokens']} tokens"
        )
    lines.append(measured)
    return "\n".join(lines)
