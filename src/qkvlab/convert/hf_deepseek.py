"""Multi-head Latent Attention out of qkvlab: a DeepseekV3ForCausalLM that stock transformers loads and that
vLLM and llama.cpp's converter read as DeepSeek's MLA, computing what qkvlab computes (export only).

qkvlab's MLA layer (model/attention.py: `--kv-latent R --rope-dim P`) is DeepSeek-V2/V3's attention without
the query LoRA. Its weights go under DeepSeek's names, changed where an engine needs it:

- `q_lora_rank` null: `q_proj` is qkvlab's query rows, each head [d_head "nope" rows, P rotated rows].
- `kv_a_proj_with_mqa` projects the cached row [latent (R); shared RoPE key (P)]; `kv_a_layernorm` is kv_norm.
- `kv_b_proj` holds [W_uk; W_uv] per *query* head: DeepSeek's classes give every query head its own
  (num_key_value_heads = n_head), so a GQA/MQA latent's kv-head maps are repeated for the query heads that
  read them (exact: query head h reads kv head h // (n_head / kv_heads) either way).
- RoPE rows interleaved (`rope_interleave` true): DeepSeek's checkpoints rotate pairs (2i, 2i + 1), qkvlab
  rotates (i, i + P/2) (rotate_half). The P rotated rows of each q_proj head and of kv_a_proj_with_mqa are
  permuted alike (`rotary_rows`), which leaves every score unchanged. vLLM (is_neox_style=False) and
  llama.cpp's deepseek2 (LLAMA_ROPE_TYPE_NORM) read that layout as it is.
- DeepSeek's softmax scale is always (d_head + P)^-1/2; any other qkvlab `attn_scale` is folded into q_proj.
- Every layer dense (`first_k_dense_replace` = n_layer: DeepSeek's dense MLP is SiLU-gated, qkvlab's swiglu);
  the MoE fields the converters and vLLM read say "no routed experts" (`DENSE_MOE`).
- `lm_head.weight` written and `tie_word_embeddings` false even for a tied model: vLLM's
  DeepseekV2ForCausalLM never ties its head.
- `rms_norm_eps` 1e-6: transformers fixes kv_a_layernorm's eps at 1e-6 and applies rms_norm_eps to the other
  norms, vLLM and llama.cpp apply rms_norm_eps to all of them; the three compute alike only when the
  model's norm_eps is 1e-6, so another norm_eps is refused. The latent norm's own eps (`latent_norm_eps`,
  a retrofit's is far above the latent's mean square, so that the norm is a fixed scale) is exported
  exactly: an RMSNorm of a c with eps E equals one of (a c) with eps a² E, so the latent's rows of
  kv_a_proj_with_mqa are scaled by a = sqrt(1e-6 / E).
"""

from __future__ import annotations

import math

import torch

from qkvlab.base.errors import UserError
from qkvlab.convert.hf_adapter import StateDictAdapter
from qkvlab.model.attention import LATENT_NORM_EPS
from qkvlab.model.config import ModelConfig
from qkvlab.model.transformer import GPT

DEEPSEEK = "deepseek"  # the --to-hf name of DeepseekV3ForCausalLM
_LAYER = "model.layers.{}."
# "No routed experts", each value one that its reader accepts with every layer dense: vLLM builds its
# expert-weight map from n_routed_experts (an integer, never null), llama.cpp asserts used <= count and
# groups < count (or all zero) and requires the shared-expert count and expert width, and
# routed_scaling_factor 1.0 keeps vLLM's fp16 rescaling of every layer's output (1 / factor) a no-op.
DENSE_MOE = dict(
    n_routed_experts=0,
    num_experts_per_tok=0,
    n_shared_experts=0,
    n_group=0,
    topk_group=0,
    routed_scaling_factor=1.0,
    norm_topk_prob=False,
    scoring_func="softmax",
    topk_method="greedy",
)


def rotary_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of `heads` rotated heads from qkvlab's rotate_half layout (two halves per head) to interleaved
    pairs (x_i, x_{i + n/2}) side by side: GGUF's llama layout and DeepSeek's checkpoints."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def is_mla(cfg: ModelConfig) -> bool:
    return cfg.kv_latent is not None and cfg.rope_dim is not None


class DeepseekAdapter(StateDictAdapter):
    """DeepSeek's names for an MLA model's tensors once `mla_state` has made them DeepSeek's values."""

    model_type = "deepseek_v3"
    hf_class = "DeepseekV3ForCausalLM"
    from_hf_map = {
        "model.embed_tokens.weight": "tok_emb.weight",
        "model.norm.weight": "trunk.norm.weight",
        "lm_head.weight": "lm_head.weight",
        **{
            _LAYER + hf: "trunk.blocks.{}." + ours
            for hf, ours in (
                ("input_layernorm.weight", "norm1.weight"),
                ("post_attention_layernorm.weight", "norm2.weight"),
                ("self_attn.kv_a_layernorm.weight", "attn.kv_norm.weight"),
                ("self_attn.kv_b_proj.weight", "attn.kv_up.weight"),  # rows per query head (mla_state)
                ("self_attn.o_proj.weight", "attn.out_proj.weight"),
                ("mlp.gate_proj.weight", "mlp.gate.weight"),
                ("mlp.up_proj.weight", "mlp.up.weight"),
                ("mlp.down_proj.weight", "mlp.down.weight"),
            )
        },
    }
    fused = {
        "trunk.blocks.{}.attn.in_proj.weight": (
            _LAYER + "self_attn.q_proj.weight",
            _LAYER + "self_attn.kv_a_proj_with_mqa.weight",
        )
    }
    export_needs = {"norm": ("rmsnorm",), "pos": ("rope",), "mlp": ("swiglu",)}


ADAPTER = DeepseekAdapter()


def check_target(cfg: ModelConfig, target: str) -> None:
    """One line, before any work, for an export whose format cannot hold `cfg`'s cache. target: an --to-hf
    class (gpt2, llama, deepseek) or "gguf" (llama for keys and values, deepseek2 for MLA)."""
    if target == DEEPSEEK or (target == "gguf" and is_mla(cfg)):
        check_deepseek(cfg, "--to-gguf (deepseek2)" if target == "gguf" else f"--to-hf {DEEPSEEK}")
    elif cfg.kv_latent is not None:
        where = "--to-gguf (llama)" if target == "gguf" else f"--to-hf {target}"
        raise UserError(
            f"{where}: cannot export {cfg.scheme_label}: that format caches keys and values per head, this model a "
            + (
                f"latent (Multi-head Latent Attention): use --to-hf {DEEPSEEK} or --to-gguf (deepseek2)"
                if is_mla(cfg)
                else "latent whose keys get RoPE after the up-projection, which no engine caches (MLA, retrofit with "
                "--rope-dim P, does)"
            )
        )


def check_deepseek(cfg: ModelConfig, what: str = f"--to-hf {DEEPSEEK}") -> None:
    """One line for what DeepSeek's layout cannot hold (before any work)."""
    why = f"{what}: cannot export {cfg.scheme_label}"
    if cfg.kv_latent is None:
        raise UserError(
            f"{why}: DeepseekV3ForCausalLM caches Multi-head Latent Attention's latent; this model caches keys and "
            "values (export it with --to-hf llama, or retrofit it with --kv-latent R --rope-dim P)"
        )
    if cfg.rope_dim is None:
        raise UserError(
            f"{why}: a latent without --rope-dim rotates its keys after the up-projection, which DeepSeek's "
            "layout (and every engine) cannot cache; MLA needs --rope-dim P (its decoupled RoPE key)"
        )
    ADAPTER.check_export(cfg, why)
    if cfg.bias:
        raise UserError(f"{why}: bias=True (DeepSeek's q_proj, kv_b_proj and MLP have no biases)")
    if cfg.norm_eps != LATENT_NORM_EPS:
        raise UserError(
            f"{why}: norm_eps={cfg.norm_eps:g}; transformers fixes kv_a_layernorm's eps at {LATENT_NORM_EPS:g} while "
            f"vLLM and llama.cpp apply rms_norm_eps to it, so only norm_eps={LATENT_NORM_EPS:g} computes alike in all three"
        )
    if not cfg.mlp_skip or not cfg.causal or cfg.norm_position != "pre":
        raise UserError(f"{why}: DeepSeek's blocks are causal, pre-norm, with a skip around the MLP")


def _query_and_row(attn, cfg: ModelConfig) -> torch.Tensor:
    """in_proj's rows as DeepSeek's [q_proj; kv_a_proj_with_mqa]: the score scale folded into the query, the
    latent norm's eps into the latent's rows, the rotated rows interleaved."""
    nh, hd, p, r = cfg.n_head, cfg.head_dim, cfg.rope_dim, cfg.kv_latent
    w = attn.in_proj.weight.detach()
    q = w[: nh * (hd + p)].view(nh, hd + p, -1)  # each head: [hd nope rows, p rope rows]
    if cfg.attn_scale is not None:  # DeepSeek scores with (hd + p)^-1/2
        q = q * (cfg.attn_scale * math.sqrt(hd + p))
    q_pe = rotary_rows(q[:, hd:].reshape(nh * p, -1), nh).view(nh, p, -1)
    row = w[nh * (hd + p) :]  # [latent (r); shared key (p)]
    latent = row[:r]
    if cfg.latent_norm_eps != LATENT_NORM_EPS:  # norm(a c; a² E) = norm(c; E): the engines' eps, the model's norm
        latent = latent * math.sqrt(LATENT_NORM_EPS / cfg.latent_norm_eps)
    return torch.cat((torch.cat((q[:, :hd], q_pe), 1).reshape(nh * (hd + p), -1), latent, rotary_rows(row[r:], 1)))


def _per_query_head(attn, cfg: ModelConfig) -> torch.Tensor:
    """kv_up (2 kvh hd, r) as kv_b_proj (nh (hd + hd), r): [W_uk[g]; W_uv[g]] for query head h, g = h // group."""
    w_uk, w_uv = (m.detach() for m in attn.latent_maps())  # (kvh, hd, r) each
    g = torch.arange(cfg.n_head) // (cfg.n_head // cfg.n_kv_heads)
    return torch.cat((w_uk[g], w_uv[g]), 1).reshape(cfg.n_head * 2 * cfg.head_dim, cfg.kv_latent)


def mla_state(model: GPT, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """model's state (qkvlab names) with DeepSeek's values: every layer its own block, in_proj and kv_up as
    above, and the head written out (vLLM reads lm_head.weight even where qkvlab ties it)."""
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    st = {k: v for k, v in sd.items() if not k.startswith("trunk.blocks.")}
    st["lm_head.weight"] = sd["tok_emb.weight"] if cfg.tie_embeddings else sd["lm_head.weight"]
    for i in range(cfg.n_layer):
        src, dst = f"trunk.blocks.{0 if cfg.share_layers else i}.", f"trunk.blocks.{i}."
        st.update({dst + k[len(src) :]: v for k, v in sd.items() if k.startswith(src)})
        attn = model.trunk.layer(i).attn
        st[dst + "attn.in_proj.weight"] = _query_and_row(attn, cfg)
        st[dst + "attn.kv_up.weight"] = _per_query_head(attn, cfg)
    return st


def deepseek_tensors(model: GPT, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """DeepSeek's tensor name -> tensor (model's dtype), every one DeepseekV3ForCausalLM holds."""
    check_deepseek(cfg)
    widths = (cfg.n_head * (cfg.head_dim + cfg.rope_dim), cfg.kv_latent + cfg.rope_dim)
    return {k: v.contiguous() for k, v in ADAPTER.to_hf(mla_state(model, cfg), widths).items()}


def deepseek_config(cfg: ModelConfig) -> dict:
    """DeepseekV3Config's arguments for `cfg` (the mapping config.json records)."""
    hd, p = cfg.head_dim, cfg.rope_dim
    return dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.d_model,
        intermediate_size=cfg.hidden,
        moe_intermediate_size=cfg.hidden,  # llama.cpp's converter writes it as the (unused) expert width
        num_hidden_layers=cfg.n_layer,
        first_k_dense_replace=cfg.n_layer,
        num_attention_heads=cfg.n_head,
        num_key_value_heads=cfg.n_head,
        q_lora_rank=None,
        kv_lora_rank=cfg.kv_latent,
        qk_nope_head_dim=hd,
        qk_rope_head_dim=p,
        v_head_dim=hd,
        hidden_act="silu",
        max_position_embeddings=cfg.context,
        rms_norm_eps=LATENT_NORM_EPS,
        rope_parameters={"rope_type": "default", "rope_theta": float(cfg.rope_theta)},
        rope_interleave=True,
        tie_word_embeddings=False,
        attention_bias=False,
        attention_dropout=0.0,
        num_mtp_layers=0,  # no multi-token-prediction layer after the last one
        bos_token_id=None,  # the tokenizer's generation_config.json says (convert copies it beside)
        eos_token_id=None,
        **DENSE_MOE,
    )


def to_deepseek(model: GPT, cfg: ModelConfig):
    """A transformers DeepseekV3ForCausalLM (model's dtype) computing the same logits as `model`."""
    try:
        import transformers  # optional: transformers
    except ImportError:
        raise UserError("Hugging Face interop needs transformers: pip install 'qkvlab[hf]'") from None
    tensors = deepseek_tensors(model, cfg)
    hf = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**deepseek_config(cfg)))
    hf = hf.to(model.tok_emb.weight.dtype)
    tensors = ADAPTER.complete(tensors, hf.state_dict(), model.tok_emb.weight.device)
    hf.load_state_dict(tensors, strict=True)
    return hf.eval()
