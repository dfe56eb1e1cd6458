"""Paired initialisation (qkvlab/model/init.py): variants built at one seed share every tensor they can."""

import functools
import itertools

import pytest
import torch

from qkvlab.compare.recipes import DEFAULT_LM_VARIANTS
from qkvlab.model.config import ModelConfig
from qkvlab.model.spec import IDENTITY, ROLES
from qkvlab.model.transformer import GPT
from qkvlab.model.variants import parse_variants


@functools.cache
def build(variant: str, seed: int = 0) -> GPT:
    v = parse_variants(variant)[0]
    base = ModelConfig(n_layer=2, n_head=4, d_model=32, vocab_size=64, context=16)
    torch.manual_seed(seed)
    return GPT(v.apply(base))


def role_rows(model: GPT, layer: int) -> dict[str, torch.Tensor]:
    """Each learned role's rows of the fused projection (a kv-only projection: its kv heads)."""
    attn = model.trunk.blocks[layer].attn
    parts = attn.in_proj.weight.split(attn.proj_widths)
    return {r: parts[attn.spec.role_source(r)] for r in ROLES if attn.spec.role_source(r) != IDENTITY}


@pytest.mark.parametrize("a, b", list(itertools.combinations(DEFAULT_LM_VARIANTS, 2)))
def test_default_variants_pair(a, b):
    ma, mb = build(a), build(b)
    sa, sb = ma.state_dict(), mb.state_dict()
    shared = [k for k in sa if k in sb and sa[k].shape == sb[k].shape and "in_proj" not in k]
    assert shared, "no tensor in common"
    for k in shared:
        assert torch.equal(sa[k], sb[k]), f"{a} vs {b}: {k} differs"
    # a learned role reads the rows of the baseline's projection for the first role it serves
    for layer in range(2):
        ra, rb = role_rows(ma, layer), role_rows(mb, layer)
        for m, rows in ((ma, ra), (mb, rb)):
            spec = m.trunk.blocks[layer].attn.spec
            for role, w in rows.items():
                first = spec.projections[spec.role_source(role)][0]
                ref = role_rows(build("Q-K-V"), layer)[first]
                assert torch.equal(w, ref[: w.shape[0]]), f"{m.cfg.attn} {role} is not Q-K-V's {first}"


def test_seeds_differ_and_repeat():
    assert torch.equal(build("Q-K=V", 3).tok_emb.weight, build("Q-K=V", 3).tok_emb.weight)
    assert not torch.equal(build("Q-K=V", 3).tok_emb.weight, build("Q-K=V", 4).tok_emb.weight)
