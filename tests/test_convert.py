"""Paper A's theorems as a converter, Hugging Face import/export, similarity diagnostics."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

from qkvlab.analysis.similarity import cosine, effective_rank, energy_rank, similarity
from qkvlab.base.errors import UserError
from qkvlab.cli import main
from qkvlab.convert import reparam
from qkvlab.convert.hf import from_hf, to_hf
from qkvlab.convert.reparam import check, convert, logit_diff, role_weights
from qkvlab.model.accounting import analytic_params, counted_params
from qkvlab.model.config import ModelConfig
from qkvlab.model.folder import load_model, save_model
from qkvlab.model.transformer import GPT

tf = pytest.importorskip("transformers")
tf.utils.logging.set_verbosity_error()
tf.utils.logging.disable_progress_bar()


def make(seed=0, zero_role_bias=None, **kw) -> tuple[GPT, ModelConfig]:
    """A float64 model with O(1) random weights and nonzero biases (so every term is exercised)."""
    base = dict(n_layer=2, n_head=4, d_model=32, vocab_size=41, context=20, norm="none")
    base.update(kw)
    cfg = ModelConfig(**base).validate()
    torch.manual_seed(seed)
    model = GPT(cfg).double().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") and "score_term" not in name:
                p.normal_(0, 0.2)
            elif "norm" in name:
                p.normal_(1, 0.1)
            elif p.dim() > 1:
                p.normal_(0, 1 / math.sqrt(p.shape[1]))
        for block in model.trunk.blocks:  # projections with singular values in [0.3, 1.5]: cond <= 5
            for w in block.attn.in_proj.weight.split(block.attn.proj_widths) if block.attn.in_proj is not None else ():
                u, _, vh = torch.linalg.svd(torch.randn_like(w), full_matrices=False)
                w.copy_(u @ torch.diag(torch.empty(vh.shape[0], dtype=w.dtype).uniform_(0.3, 1.5)) @ vh)
        if zero_role_bias:  # theorems (a), (c): the removed projection's bias must be zero
            for block in model.trunk.blocks:
                w, b = role_weights(block, cfg.spec)[zero_role_bias]
                if b is not None:
                    b.zero_()
    return model, cfg


def rel(ref, cand) -> float:
    return check(ref, cand, torch.float64)[1]


# ---- the three theorems, float64 --------------------------------------------------------------
THEOREMS = [
    # (a) skip around the MLP, one layer at a time: the global basis is that layer's W_Q
    (dict(n_layer=1, bias=True), "Id-K-V", None, "q"),
    (dict(n_layer=3, bias=False), "Id-K-V", 1, "q"),
    (dict(n_layer=3, n_head=2, d_model=24, bias=True, kv_heads=1), "Id-K-V", 2, "q"),
    (dict(n_layer=2, attn="(Q-K-V)+", pos="rope"), "(Id-K-V)+", 0, "q"),
    (dict(n_layer=2, bias=True), "Q-Id-V", 0, "k"),  # a key bias is row-constant in the scores: dropped
    # (b) no skip around the MLP: every layer with its own basis; biases carried exactly
    (dict(n_layer=3, mlp_skip=False, bias=True), "Id-K-V", None, None),
    (dict(n_layer=3, mlp_skip=False, bias=True, pos="rope", mlp="swiglu", kv_heads=2), "Id-K-V", None, None),
    (dict(n_layer=2, mlp_skip=False, bias=True, attn="Q-K=V", kv_heads=1, d_model=48, n_head=6), "Id-K=V", None, None),
    (dict(n_layer=3, mlp_skip=False, bias=True, pos="rope"), "Q-Id-V", None, None),  # key bias under rope: moved
    (dict(n_layer=2, mlp_skip=False, bias=True, pos="none", tie_embeddings=False), "Q-Id-V", None, None),
    (dict(n_layer=2, mlp_skip=False, bias=True), "Id-K-V", 1, None),  # one layer of (b)
    (dict(n_layer=2, mlp_skip=False, bias=True, pos="rope"), "Q-K-Id", None, None),  # W_V too: the same lemma
    (dict(n_layer=2, bias=True, attn="Q=K-V"), "Q=K-Id", 1, None),  # a value bias folds into out_proj
    # (c) one block shared by every layer: a single basis
    (dict(n_layer=3, share_layers=True, bias=True), "Id-K-V", None, "q"),
    (dict(n_layer=4, share_layers=True, mlp_skip=False, mlp="relu"), "Id-K-V", None, None),
]


@pytest.mark.parametrize("kw,target,layer,zero", THEOREMS)
def test_theorems_exact_float64(kw, target, layer, zero):
    model, cfg = make(zero_role_bias=zero, **kw)
    res = convert(model, cfg, target, layer=layer)
    assert rel(model, res.model) <= 1e-9
    assert res.cfg.scale == cfg.scale  # the identity scheme's default scale must not kick in
    assert res.cfg.hidden == cfg.hidden
    role = "qkv"[[t.strip("()+") for t in re.split("[-=]", target)].index("Id")]
    whole = layer is None or cfg.n_layer == 1
    if whole:
        assert res.cfg.spec.name == target and res.cfg.spec.is_identity(role)
        assert not res.cfg.tie_embeddings

        def n_attn(m):
            return sum(b.attn.in_proj.weight.numel() for b in m.trunk.blocks)

        assert n_attn(res.model) < n_attn(model)
    else:  # mixed layers: layer L alone gets the target scheme, its W (and bias) gone
        table = res.cfg.layer_table()
        assert [t[0] for t in table] == [target if i == layer else cfg.spec.name for i in range(cfg.n_layer)]
        assert res.model.trunk.blocks[layer].attn.spec.is_identity(role)
        width = role_width(cfg, role)
        removed = width * cfg.d_model + (width if cfg.bias else 0)
        assert counted_params(res.model).total == counted_params(model).total - removed + untied(model, res.model)
        assert analytic_params(res.cfg).total == counted_params(res.model).total


def test_query_value_sharing_converts_like_any_other():
    """Q=V-K (query and value share a projection): the converter reads the spec table, no per-scheme case."""
    model, cfg = make(n_layer=2, mlp_skip=False, bias=True, attn="Q=V-K")
    res = convert(model, cfg, "Q=V-Id")
    assert rel(model, res.model) <= 1e-9 and res.cfg.spec.name == "Q=V-Id" and res.cfg.spec.is_identity("k")
    with pytest.raises(UserError, match="shares its projection"):
        convert(model, cfg, "Id-K-V")  # W_Q is also W_V here


def role_width(cfg, role):
    return (cfg.n_head if role == "q" else cfg.n_kv_heads) * cfg.head_dim


def untied(before, after) -> int:
    """Parameters a conversion adds by untying the head (E A + c != W A^-T)."""
    was = before.lm_head.weight is before.tok_emb.weight
    return after.lm_head.weight.numel() if was and after.lm_head.weight is not after.tok_emb.weight else 0


def test_float32_within_1e4_and_cache_decode():
    model, cfg = make(n_layer=3, mlp_skip=False, bias=True, pos="rope", kv_heads=2)
    res = convert(model, cfg, "Id-K-V", dtype=torch.float32)
    assert res.model.tok_emb.weight.dtype == torch.float32
    assert check(model, res.model, torch.float32)[1] <= 1e-4
    # The converted model decodes with qkvlab's KV cache like the original.
    from qkvlab.model.cache import KVCache

    idx = torch.randint(0, cfg.vocab_size, (2, 9))
    m64 = convert(model, cfg, "Id-K-V").model
    cache = KVCache(m64.cfg, 2, 16, dtype=torch.float64)
    m64(idx[:, :5], cache=cache)
    step, _ = m64(idx[:, 5:], cache=cache)
    full, _ = model(idx)
    assert torch.allclose(step, full[:, 5:], rtol=0, atol=1e-9 * full.abs().max().item())


@pytest.mark.parametrize(
    "src,dst,kw",
    [
        ("Id-K-V", "Q-K-V", dict(bias=True, norm="layernorm")),
        ("Id-K=V", "Q-K=V", dict(kv_heads=2, norm="rmsnorm", pos="rope")),
        ("Q-Id-V", "Q-K-V", dict(bias=True, pos="rope", norm="layernorm")),
    ],
)
def test_reverse_inserts_identity_exactly(src, dst, kw):
    model, cfg = make(attn=src, **kw)
    res = convert(model, cfg, dst)
    assert res.cfg.spec.name == dst and res.cfg.scale == cfg.scale
    assert rel(model, res.model) <= 1e-14  # x @ I is exact; only the kernels' summation order differs


def test_round_trip_removal_then_insertion():
    model, cfg = make(n_layer=3, mlp_skip=False, bias=True)
    there = convert(model, cfg, "Id-K-V")
    back = convert(there.model, there.cfg, "Q-K-V")
    assert back.cfg.spec.name == "Q-K-V" and rel(model, back.model) <= 1e-9


# ---- refusals ------------------------------------------------------------------------------
REFUSALS = [
    (dict(norm="layernorm"), "Id-K-V", None, "norm=layernorm"),
    (dict(norm="rmsnorm", mlp_skip=False), "Id-K-V", None, "normalization"),
    (dict(n_layer=3), "Id-K-V", None, "mlp_skip=True"),
    (dict(bias=True), "Id-K-V", 0, "nonzero bias"),
    (dict(share_layers=True, mlp_skip=False, bias=True), "Id-K-V", None, "nonzero bias"),
    (dict(kv_heads=2), "Q-Id-V", 0, "GQA"),
    (dict(d_head=4), "Id-K-V", 0, "not square"),
    (dict(), "Q-K=V", None, "not a reparametrization"),
    (dict(attn="Q=K-V"), "Id-K-V", None, "not a reparametrization"),
    (dict(attn="Q-K=V"), "Q-Id-V", None, "not a reparametrization"),
    (dict(kv_heads=2), "Q-K-Id", 0, "GQA"),
    (dict(), "(Id-K-V)+", None, "2D score term"),
    (dict(attn="Id-K-V"), "Q-Id-V", None, "exactly one role"),
    (dict(n_layer=2), "Id-K-V", 2, "out of range"),
    (dict(share_layers=True), "Id-K-V", 0, "drop --layer"),
]


@pytest.mark.parametrize("kw,target,layer,match", REFUSALS)
def test_refusals_name_the_condition(kw, target, layer, match):
    model, cfg = make(**kw)
    with pytest.raises(UserError, match=re.escape(match)):
        convert(model, cfg, target, layer=layer)


def test_refuses_singular_and_ill_conditioned_printing_cond():
    model, cfg = make(n_layer=1)
    w, _ = role_weights(model.trunk.blocks[0], cfg.spec)["q"]
    with torch.no_grad():
        w[3] = w[5]  # rank deficient
    with pytest.raises(UserError, match=r"condition number \S+ > --max-cond"):
        convert(model, cfg, "Id-K-V")
    model, cfg = make(n_layer=1)
    cond = torch.linalg.cond(role_weights(model.trunk.blocks[0], cfg.spec)["q"][0]).item()
    with pytest.raises(UserError, match=f"condition number {cond:.3g}"):
        convert(model, cfg, "Id-K-V", max_cond=cond / 2)


# ---- CLI ------------------------------------------------------------------------------------
def run_cli(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_convert_exit_codes_and_last_line(tmp_path, capsys, monkeypatch):
    model, cfg = make(n_layer=2, mlp_skip=False, bias=True)
    save_model(tmp_path / "in", model, cfg)
    code, out, err = run_cli(capsys, "convert", tmp_path / "in", tmp_path / "out", "--to", "Id-K-V")
    assert code == 0, err
    last = out.strip().splitlines()[-1]
    assert re.fullmatch(r"max_rel_logit_diff=\S+", last) and float(last.split("=")[1]) <= 1e-9
    back, bcfg, body = load_model(tmp_path / "out")
    assert bcfg.spec.name == "Id-K-V" and back.tok_emb.weight.dtype == torch.float64
    assert rel(model, back) <= 1e-9 and body["conversion"]
    # float32 result
    code, out, _ = run_cli(capsys, "convert", tmp_path / "in", tmp_path / "o32", "--to", "Id-K-V", "--dtype", "float32")
    assert code == 0 and float(out.strip().splitlines()[-1].split("=")[1]) <= 1e-4
    # a refusal: exit 2, one line naming the reason, nothing written
    model, cfg = make(n_layer=2, norm="layernorm")
    save_model(tmp_path / "ln", model, cfg)
    code, out, err = run_cli(capsys, "convert", tmp_path / "ln", tmp_path / "x", "--to", "Id-K-V")
    assert code == 2 and "norm=layernorm" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "x").exists()
    # a failed check: exit 1, nothing written
    monkeypatch.setitem(reparam.TOLERANCE, torch.float64, 0.0)
    code, out, err = run_cli(capsys, "convert", tmp_path / "in", tmp_path / "y", "--to", "Id-K-V")
    assert code == 1 and "max_rel_logit_diff" in err and not (tmp_path / "y").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temp folders left


def test_cli_bad_input_one_line_nothing_written(tmp_path, capsys):
    model, cfg = make(n_layer=1)
    save_model(tmp_path / "ok", model, cfg)
    # weights that are a pickle
    (tmp_path / "pk").mkdir()
    (tmp_path / "pk" / "config.json").write_text((tmp_path / "ok" / "config.json").read_text())
    torch.save(model.state_dict(), tmp_path / "pk" / "model.safetensors")
    # mismatched shapes: the config says d_model 64
    (tmp_path / "shape").mkdir()
    body = json.loads((tmp_path / "ok" / "config.json").read_text())
    body["model"]["d_model"] = 64
    (tmp_path / "shape" / "config.json").write_text(json.dumps(body))
    (tmp_path / "shape" / "model.safetensors").write_bytes((tmp_path / "ok" / "model.safetensors").read_bytes())
    # another architecture: a transformers GPT-2 folder offered as a qkvlab model, a BERT config to --from-hf
    tf.GPT2LMHeadModel(tf.GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=30, n_positions=8)).save_pretrained(
        tmp_path / "gpt2"
    )
    (tmp_path / "bert").mkdir()
    (tmp_path / "bert" / "config.json").write_text(json.dumps({"model_type": "bert"}))
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    torch.save({}, tmp_path / "bin" / "pytorch_model.bin")
    cases = [
        (["convert", tmp_path / "missing", tmp_path / "o", "--to", "Id-K-V"], "no config.json"),
        (["convert", tmp_path / "pk", tmp_path / "o", "--to", "Id-K-V"], "a pickle"),
        (["convert", tmp_path / "shape", tmp_path / "o", "--to", "Id-K-V"], "shape"),
        (["convert", tmp_path / "gpt2", tmp_path / "o", "--to", "Id-K-V"], "not a qkvlab config"),
        (["convert", tmp_path / "bert", tmp_path / "o", "--from-hf"], "model_type 'bert'"),
        (["convert", tmp_path / "bin", tmp_path / "o", "--from-hf"], "pickle"),
        (["convert", tmp_path / "ok", tmp_path / "o", "--from-hf"], "a qkvlab model folder"),
        (["convert", tmp_path / "missing", tmp_path / "o", "--from-hf"], "no such file"),
        (["convert", tmp_path / "ok", tmp_path / "o"], "nothing to do"),
        (["convert", tmp_path / "ok", tmp_path / "o", "--to", "Q-X-V"], "not one of"),
        (["convert", tmp_path / "ok", tmp_path / "o", "--to-hf", "llama"], "norm=none"),
        (["similarity", tmp_path / "missing"], "no such file"),
        (["similarity", tmp_path / "pk"], "a pickle"),
    ]
    for argv, match in cases:
        code, out, err = run_cli(capsys, *argv)
        assert code == 2, (argv, err)
        assert match in err and len(err.strip().splitlines()) == 1, (argv, err)
        assert not (tmp_path / "o").exists()


# ---- Hugging Face import/export ---------------------------------------------------------------
def _perturb_norms(hf):
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "ln" in name or "norm" in name:
                p.normal_(1.0 if name.endswith("weight") else 0.0, 0.2)
    return hf.eval()


def test_gpt2_import_in_memory_and_from_folder(tmp_path, capsys):
    torch.manual_seed(0)
    hf = _perturb_norms(
        tf.GPT2LMHeadModel(
            tf.GPT2Config(vocab_size=67, n_positions=24, n_embd=48, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0)
        )
    )
    model, cfg = from_hf(hf)
    assert (cfg.mlp, cfg.norm, cfg.pos, cfg.bias, cfg.tie_embeddings) == (
        "gelu_tanh",
        "layernorm",
        "learned",
        True,
        True,
    )
    assert logit_diff(hf, model, 67, 24)[1] <= 1e-5
    hf.save_pretrained(tmp_path / "hf")
    code, out, err = run_cli(capsys, "convert", "--from-hf", tmp_path / "hf", tmp_path / "q")
    assert code == 0, err
    assert out.strip().splitlines()[-1].startswith("max_rel_logit_diff=")
    back, _, _ = load_model(tmp_path / "q")
    assert logit_diff(hf, back, 67, 24)[1] <= 1e-5


def test_llama_import_gqa_untied():
    torch.manual_seed(1)
    hf = _perturb_norms(
        tf.LlamaForCausalLM(
            tf.LlamaConfig(
                vocab_size=71,
                hidden_size=48,
                intermediate_size=96,
                num_hidden_layers=2,
                num_attention_heads=6,
                num_key_value_heads=2,
                head_dim=8,
                max_position_embeddings=32,
                tie_word_embeddings=False,
                rope_parameters={"rope_type": "default", "rope_theta": 500.0},
                bos_token_id=0,
                eos_token_id=0,
                pad_token_id=0,
            )
        )
    )
    model, cfg = from_hf(hf)
    assert (cfg.kv_heads, cfg.d_head, cfg.rope_theta, cfg.tie_embeddings) == (2, 8, 500.0, False)
    assert logit_diff(hf, model, 71, 32)[1] <= 1e-5


EXPORTS = [
    ("gpt2", dict(attn="Id-K=V", kv_heads=2, norm="layernorm", mlp="gelu_tanh", bias=False)),
    ("gpt2", dict(attn="Q=K-V", norm="layernorm", mlp="gelu", bias=True, tie_embeddings=False, share_layers=True)),
    ("llama", dict(attn="Q-K=V", kv_heads=2, norm="rmsnorm", pos="rope", mlp="swiglu")),
    ("llama", dict(attn="Id-K-V", norm="rmsnorm", pos="rope", mlp="swiglu", bias=True, tie_embeddings=False)),
    ("llama", dict(attn="Q=V-K", norm="rmsnorm", pos="rope", mlp="swiglu", bias=True)),
]


@pytest.mark.parametrize("fmt,kw", EXPORTS)
def test_export_loads_without_custom_code(tmp_path, capsys, fmt, kw):
    model, cfg = make(n_layer=2, **kw)
    model = model.float()
    save_model(tmp_path / "q", model, cfg)
    code, out, err = run_cli(capsys, "convert", tmp_path / "q", tmp_path / "hf", "--to-hf", fmt)
    assert code == 0, err
    assert (tmp_path / "hf" / "model.safetensors").exists() and not list((tmp_path / "hf").glob("*.py"))
    hf = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(hf).__name__ == {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM"}[fmt]
    assert logit_diff(model, hf, cfg.vocab_size, cfg.context)[1] <= 1e-5
    if cfg.spec.identity_role == "q":  # W_Q = (s sqrt(d_h)) I: 1/2 for Paper A's default scale
        q = (
            hf.model.layers[0].self_attn.q_proj.weight
            if fmt == "llama"
            else hf.transformer.h[0].attn.c_attn.weight[:, : cfg.d_model]
        )
        assert torch.allclose(q, 0.5 * torch.eye(cfg.d_model))
    if fmt == "llama":  # import back: the same logits again
        again, acfg = from_hf(hf)
        assert acfg.n_kv_heads == cfg.n_kv_heads and logit_diff(model, again, cfg.vocab_size, cfg.context)[1] <= 1e-5


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(attn="(Q=K-V)+", norm="layernorm"), "'+' schemes"),
        (dict(norm="layernorm", mlp_skip=False), "mlp_skip=False"),
        (dict(norm="rmsnorm", pos="learned", mlp="swiglu"), "pos=learned"),
    ],
)
def test_export_refusals(kw, match):
    model, cfg = make(**kw)
    fmt = "gpt2" if cfg.norm == "layernorm" else "llama"
    with pytest.raises(UserError, match=re.escape(match)):
        to_hf(model, cfg, fmt)


# ---- similarity -----------------------------------------------------------------------------
def test_similarity_definitions():
    eye = torch.eye(16)
    assert effective_rank(eye) == pytest.approx(16.0)
    assert effective_rank(torch.outer(torch.randn(16), torch.randn(8))) == pytest.approx(1.0, abs=1e-6)
    assert energy_rank(torch.diag(torch.tensor([3.0, 1.0, 0.1]))) == 2  # 9 / 10.01 < 0.9 <= 10 / 10.01
    a = torch.randn(8, 16)
    assert cosine(a, -a, 2, 4) == pytest.approx(-1.0)
    # GQA: a query whose heads equal the repeated kv heads has cosine 1 with the key
    k = torch.randn(2 * 4, 16)  # 2 kv heads of d_h 4
    q = k.view(2, 4, 16).repeat_interleave(2, 0).reshape(16, 16)
    assert cosine(q, k, 4, 4) == pytest.approx(1.0)
    assert cosine(q, k.view(2, 4, 16).flip(0).reshape(8, 16), 4, 4) < 0.9


def test_similarity_report_and_cli(tmp_path, capsys):
    model, cfg = make(attn="Q-K=V", kv_heads=2)
    rep = similarity(model, cfg)
    assert rep["mean"]["cos"]["k_v"] == pytest.approx(1.0) and rep["layers"][0]["shared"] == ["k_v"]
    assert rep["mean"]["max_rank"] == {"q": 32, "k": 16, "v": 16}
    model, cfg = make(attn="Id-K-V")
    save_model(tmp_path / "m", model.float(), cfg)
    code, out, err = run_cli(capsys, "similarity", tmp_path / "m", "--json")
    rep = json.loads(out)
    assert code == 0 and rep["mean"]["cos"]["q_k"] is None and abs(rep["mean"]["cos"]["k_v"]) < 0.5
    assert rep["paper_b"]["cka"] == {"k_v": 0.73, "q_k": 0.42, "q_v": 0.31} and rep["cka"] is None  # no tokenizer
    code, out, err = run_cli(capsys, "similarity", tmp_path / "m")
    assert code == 0 and "Paper B" in out and "mean" in out


# ---- one strict loader ------------------------------------------------------------------------
def test_the_loader_refuses_a_missing_tensor_by_name():
    """Every converter builds through io.build_model_from_state: a tensor the source lacks is refused
    by name, never left at its random initialisation."""
    from types import SimpleNamespace

    from qkvlab.model.folder import build_model_from_state

    model, cfg = make(n_layer=2)
    state = model.state_dict()
    del state["trunk.blocks.1.mlp.up.weight"]
    with pytest.raises(UserError, match=re.escape("missing trunk.blocks.1.mlp.up.weight")):
        build_model_from_state(GPT, cfg, state, "here")
    tied = {**model.state_dict(), "lm_head.weight": torch.zeros_like(model.lm_head.weight)}  # config ties it
    with pytest.raises(UserError, match="lm_head.weight differs from tok_emb.weight"):
        build_model_from_state(GPT, cfg, tied, "here")
    # an import whose checkpoint lacks one tensor
    hf = tf.GPT2LMHeadModel(tf.GPT2Config(n_embd=16, n_layer=2, n_head=2, vocab_size=30, n_positions=8))
    sd = {k: v for k, v in hf.state_dict().items() if k != "transformer.h.1.mlp.c_fc.weight"}
    with pytest.raises(UserError, match=re.escape("missing trunk.blocks.1.mlp.up.weight")):
        from_hf(SimpleNamespace(config=hf.config, state_dict=lambda: sd))
    # ... or holds one qkvlab has no place for
    sd = {**hf.state_dict(), "transformer.h.0.attn.extra.weight": torch.zeros(2)}
    with pytest.raises(UserError, match=re.escape("transformer.h.0.attn.extra.weight: qkvlab has no place")):
        from_hf(SimpleNamespace(config=hf.config, state_dict=lambda: sd))


def test_adapters_name_maps_are_inverse():
    from qkvlab.convert.hf import ADAPTERS, explicit_state

    for fmt, kw in (("gpt2", dict(norm="layernorm")), ("llama", dict(norm="rmsnorm", pos="rope", mlp="swiglu"))):
        model, cfg = make(n_layer=2, bias=True, **kw)
        a = ADAPTERS[fmt]
        st = explicit_state(model, cfg, cfg.n_head)
        back = a.from_hf(a.to_hf(st, (cfg.d_model,) * 3))
        assert set(back) == set(st) and all(torch.equal(back[k], st[k]) for k in st), fmt


def test_similarity_on_an_export_without_tokenizer_files(tmp_path, capsys):
    model, cfg = make(n_layer=1, norm="layernorm", mlp="gelu_tanh")
    save_model(tmp_path / "q", model.float(), cfg)
    assert run_cli(capsys, "convert", tmp_path / "q", tmp_path / "hf", "--to-hf", "gpt2")[0] == 0
    code, out, err = run_cli(capsys, "similarity", tmp_path / "hf")
    assert code == 0 and "no CKA" in err and "Paper B" in out
