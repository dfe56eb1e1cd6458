"""Llama (LlamaForCausalLM) <-> qkvlab: RMSNorm, rotary in the rotate_half layout (= our Rotary),
SwiGLU = mlp.gate/up/down, GQA as num_key_value_heads, tied or untied head. q_proj, k_proj and
v_proj are qkvlab's one fused in_proj (Q-K-V rows in that order)."""

from __future__ import annotations

import math

from qkvlab.base.errors import UserError
from qkvlab.convert.hf_adapter import StateDictAdapter
from qkvlab.model.config import ModelConfig

_LAYER = "model.layers.{}."


class LlamaAdapter(StateDictAdapter):
    model_type = "llama"
    hf_class = "LlamaForCausalLM"
    from_hf_map = {
        "model.embed_tokens.weight": "tok_emb.weight",
        "model.norm.weight": "trunk.norm.weight",
        "lm_head.weight": "lm_head.weight",
        _LAYER + "input_layernorm.weight": "trunk.blocks.{}.norm1.weight",
        _LAYER + "post_attention_layernorm.weight": "trunk.blocks.{}.norm2.weight",
        **{
            f"{_LAYER}{hf}.{kind}": f"trunk.blocks.{{}}.{ours}.{kind}"
            for hf, ours in (
                ("self_attn.o_proj", "attn.out_proj"),
                ("mlp.gate_proj", "mlp.gate"),
                ("mlp.up_proj", "mlp.up"),
                ("mlp.down_proj", "mlp.down"),
            )
            for kind in ("weight", "bias")
        },
    }
    fused = {
        f"trunk.blocks.{{}}.attn.in_proj.{kind}": tuple(f"{_LAYER}self_attn.{r}_proj.{kind}" for r in "qkv")
        for kind in ("weight", "bias")
    }
    export_needs = {"norm": ("rmsnorm",), "pos": ("rope",), "mlp": ("swiglu",)}

    def model_config(self, c) -> ModelConfig:
        if c.hidden_act != "silu":
            raise UserError(
                f"Llama hidden_act={c.hidden_act!r}: qkvlab's gated MLP is SwiGLU (silu); other gates have no config value"
            )
        nh = c.num_attention_heads
        return ModelConfig(
            attn="Q-K-V",
            n_layer=c.num_hidden_layers,
            n_head=nh,
            d_model=c.hidden_size,
            d_head=getattr(c, "head_dim", None) or c.hidden_size // nh,
            kv_heads=c.num_key_value_heads or nh,
            mlp="swiglu",
            mlp_hidden=c.intermediate_size,
            norm="rmsnorm",
            norm_eps=float(c.rms_norm_eps),
            pos="rope",
            rope_theta=_rope_theta(c),
            vocab_size=c.vocab_size,
            context=c.max_position_embeddings,
            bias=bool(getattr(c, "attention_bias", False) or getattr(c, "mlp_bias", False)),
            dropout=0.0,
            tie_embeddings=bool(getattr(c, "tie_word_embeddings", False)),
        ).validate()

    def export_kv_heads(self, cfg: ModelConfig) -> int:
        # One num_key_value_heads for all layers: layers with fewer kv heads repeat theirs (exact: query
        # head h reads kv head h // (nh / kv) either way).
        return math.lcm(*(lc.n_kv_heads for lc in cfg.layer_configs()))

    def hf_config(self, tf, cfg: ModelConfig, kv_heads: int):
        return tf.LlamaConfig(
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.d_model,
            intermediate_size=cfg.hidden,
            num_hidden_layers=cfg.n_layer,
            num_attention_heads=cfg.n_head,
            num_key_value_heads=kv_heads,
            head_dim=cfg.head_dim,
            hidden_act="silu",
            max_position_embeddings=cfg.context,
            rms_norm_eps=cfg.norm_eps,
            tie_word_embeddings=cfg.tie_embeddings,
            rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
            attention_bias=cfg.bias,
            mlp_bias=cfg.bias,
            attention_dropout=0.0,
        )


def _rope_theta(c) -> float:
    params = getattr(c, "rope_parameters", None) or {}
    kind = params.get("rope_type", "default")
    scaling = getattr(c, "rope_scaling", None)
    if kind != "default" or (
        isinstance(scaling, dict) and scaling.get("rope_type", scaling.get("type")) not in (None, "default")
    ):
        raise UserError(f"Llama rope_type={kind!r}: only the default rotary embedding maps onto qkvlab's pos=rope")
    return float(params.get("rope_theta", getattr(c, "rope_theta", 10000.0)))
