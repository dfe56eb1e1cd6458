"""GPT-2 (GPT2LMHeadModel) <-> qkvlab: LayerNorm with bias, learned positions, gelu_new = our
gelu_tanh, tied head, score scale 1/sqrt(d_h). Conv1D stores its weights (in, out): transposed.
GPT-2 has no GQA: export repeats each key/value head for the query heads that read it."""

from __future__ import annotations

from qkvlab.base.errors import UserError
from qkvlab.convert.hf_adapter import StateDictAdapter
from qkvlab.model.config import ModelConfig

ACT = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu", "relu": "relu"}
ACT_OUT = {"gelu_tanh": "gelu_new", "gelu": "gelu", "relu": "relu"}


class GPT2Adapter(StateDictAdapter):
    model_type = "gpt2"
    hf_class = "GPT2LMHeadModel"
    from_hf_map = {
        "transformer.wte.weight": "tok_emb.weight",
        "transformer.wpe.weight": "pos_emb.weight",
        "transformer.ln_f.weight": "trunk.norm.weight",
        "transformer.ln_f.bias": "trunk.norm.bias",
        "lm_head.weight": "lm_head.weight",
        **{
            f"transformer.h.{{}}.{hf}.{kind}": f"trunk.blocks.{{}}.{ours}.{kind}"
            for hf, ours in (
                ("ln_1", "norm1"),
                ("ln_2", "norm2"),
                ("attn.c_attn", "attn.in_proj"),  # query, key, value rows in that order, as qkvlab's Q-K-V
                ("attn.c_proj", "attn.out_proj"),
                ("mlp.c_fc", "mlp.up"),
                ("mlp.c_proj", "mlp.down"),
            )
            for kind in ("weight", "bias")
        },
    }
    transposed = frozenset(
        f"transformer.h.{{}}.{m}.weight" for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
    )
    zero_when_missing = frozenset({"transformer.wpe.weight"})  # pos=none: positions that add nothing
    export_needs = {"norm": ("layernorm",), "pos": ("learned", "none"), "mlp": tuple(ACT_OUT)}

    def model_config(self, c) -> ModelConfig:
        if c.activation_function not in ACT:
            raise UserError(
                f"GPT-2 activation_function={c.activation_function!r} is not supported; allowed: {', '.join(ACT)}"
            )
        if getattr(c, "scale_attn_by_inverse_layer_idx", False):
            raise UserError(
                "GPT-2 scale_attn_by_inverse_layer_idx=True: a per-layer score scale has no qkvlab config value"
            )
        if getattr(c, "add_cross_attention", False):
            raise UserError(
                "GPT-2 add_cross_attention=True: cross-attention is not part of a decoder-only qkvlab model"
            )
        return ModelConfig(
            attn="Q-K-V",
            n_layer=c.n_layer,
            n_head=c.n_head,
            d_model=c.n_embd,
            mlp=ACT[c.activation_function],
            mlp_hidden=c.n_inner or 4 * c.n_embd,
            norm="layernorm",
            norm_eps=c.layer_norm_epsilon,
            pos="learned",
            vocab_size=c.vocab_size,
            context=c.n_positions,
            bias=True,
            dropout=0.0,
            tie_embeddings=bool(getattr(c, "tie_word_embeddings", True)),
            attn_scale=None if c.scale_attn_weights else 1.0,
        ).validate()

    def check_export(self, cfg: ModelConfig, why: str) -> None:
        super().check_export(cfg, why)
        if cfg.n_head * cfg.head_dim != cfg.d_model:
            raise UserError(
                f"{why}: GPT-2 needs n_head*d_head == d_model, got {cfg.n_head}*{cfg.head_dim} != {cfg.d_model}"
            )

    def hf_config(self, tf, cfg: ModelConfig, kv_heads: int):
        return tf.GPT2Config(
            vocab_size=cfg.vocab_size,
            n_positions=cfg.context,
            n_embd=cfg.d_model,
            n_layer=cfg.n_layer,
            n_head=cfg.n_head,
            n_inner=cfg.hidden,
            activation_function=ACT_OUT[cfg.mlp],
            layer_norm_epsilon=cfg.norm_eps,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            tie_word_embeddings=cfg.tie_embeddings,
            bos_token_id=None,
            eos_token_id=None,  # GPT-2's 50256 need not exist in this vocabulary
        )
