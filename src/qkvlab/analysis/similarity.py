"""How alike are a model's query, key and value projections? (Paper B's diagnostic)

Definitions (the paper does not state its own; these are ours):

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

import torch

from qkvlab.convert.reparam import role_weights
from qkvlab.spec import ROLES

PAIRS = (("k", "v"), ("q", "k"), ("q", "v"))
# Paper B, trained Q-K-V language models (300M: d_model 1024).
PAPER_B_COS = {"k-v": 0.73, "q-k": 0.42, "q-v": 0.31}
PAPER_B_RANK = "687 / 702 of 1024 (roles not stated)"


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
def similarity(model, cfg) -> dict:
    """Per layer and mean: cosines of the Q/K/V projection pairs, effective ranks, rank90."""
    layers = []
    for i in range(cfg.n_layer):
        mats = {r: (None if wb is None else wb[0]) for r, wb in role_weights(model.trunk.layer(i), cfg.spec).items()}
        row = {"layer": i, "cos": {}, "shared": [], "erank": {}, "rank90": {}, "max_rank": {}}
        for a, b in PAIRS:
            key = f"{a}-{b}"
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

    def mean(get):
        vals = [v for v in map(get, layers) if v is not None]
        return sum(vals) / len(vals) if vals else None

    return {
        "scheme": cfg.spec.name,
        "n_layer": cfg.n_layer,
        "d_model": cfg.d_model,
        "layers": layers,
        "mean": {
            "cos": {f"{a}-{b}": mean(lambda r, k=f"{a}-{b}": r["cos"][k]) for a, b in PAIRS},
            "erank": {r: mean(lambda x, r=r: x["erank"][r]) for r in ROLES},
            "rank90": {r: mean(lambda x, r=r: x["rank90"][r]) for r in ROLES},
            "max_rank": layers[0]["max_rank"] if layers else {},
        },
        "paper_b": {"cos": PAPER_B_COS, "effective_rank": PAPER_B_RANK},
        "definitions": {
            "cos": "signed cosine of flattened (out, d_model) weights; GQA key/value heads repeated per query head",
            "erank": "Roy & Vetterli: exp(entropy of singular values / their sum)",
            "rank90": "smallest k with 90% of sum(s^2) in the top k singular values",
        },
    }


def format_report(rep: dict) -> str:
    def f(x, spec=".3f"):
        return "-" if x is None else format(x, spec)

    head = f"{'layer':>5}  {'cos K-V':>8} {'cos Q-K':>8} {'cos Q-V':>8}   {'erank Q':>8} {'erank K':>8} {'erank V':>8}   {'r90 Q':>6} {'r90 K':>6} {'r90 V':>6}"
    lines = [f"{rep['scheme']}, {rep['n_layer']} layers, d_model {rep['d_model']}", head]

    def row(label, r, rank_fmt):
        c, e, k = r["cos"], r["erank"], r["rank90"]
        return (
            f"{label:>5}  {f(c['k-v']):>8} {f(c['q-k']):>8} {f(c['q-v']):>8}   "
            f"{f(e['q'], '.1f'):>8} {f(e['k'], '.1f'):>8} {f(e['v'], '.1f'):>8}   "
            f"{f(k['q'], rank_fmt):>6} {f(k['k'], rank_fmt):>6} {f(k['v'], rank_fmt):>6}"
        )

    for r in rep["layers"]:
        lines.append(row(str(r["layer"]), r, "d"))
    lines.append(row("mean", rep["mean"], ".1f"))
    mr = rep["mean"]["max_rank"]
    lines.append(
        f"max rank (min of the matrix shape): Q {f(mr.get('q'), 'd')}, K {f(mr.get('k'), 'd')}, V {f(mr.get('v'), 'd')}"
    )
    pb = rep["paper_b"]["cos"]
    m = rep["mean"]["cos"]
    lines.append(
        f"Paper B (trained Q-K-V LMs): cos K-V {pb['k-v']:.2f} Q-K {pb['q-k']:.2f} Q-V {pb['q-v']:.2f}; "
        f"effective ranks {rep['paper_b']['effective_rank']}"
    )
    lines.append(
        f"measured (mean):             cos K-V {f(m['k-v'], '.2f')} Q-K {f(m['q-k'], '.2f')} Q-V {f(m['q-v'], '.2f')}"
    )
    return "\n".join(lines)
