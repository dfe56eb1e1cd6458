"""A qkvlab model as a GGUF file (F32) for llama.cpp, through the gguf package: a Llama-family model as
`llama`, a Multi-head Latent Attention model as `deepseek2`.

The weights come from the one transformers export of each: convert/hf.py's `to_hf(..., "llama")`, so a
per-layer K=V model is an ordinary Llama whose attn_v equals attn_k (the shared tensor is the value as it is
and the key after rotary, which is what llama.cpp's graph computes from two equal matrices; its cache then
holds both: the saving is qkvlab's cache's, not llama.cpp's), and convert/hf_deepseek.py's DeepSeek tensors
for MLA. Names, shapes and metadata follow llama.cpp's own converter (conversion/llama.py: q and k rows
permuted from the rotate_half layout to interleaved pairs; conversion/deepseek.py's DeepseekV2Model:
kv_b_proj split into attn_k_b, per head transposed to (kv_lora_rank, nope), and attn_v_b, the key/value
lengths of the absorbed form, expert counts) and what llama.cpp's loader reads (src/models/deepseek2.cpp:
`attention.q_lora_rank` is required unless the model has 26 or 27 layers, so 0 is written: no query LoRA).
llama.cpp's deepseek2 then caches kv_lora_rank + rope dims per token and layer, K only
(src/llama-kv-cache.cpp: no V tensor when the model is MLA). The tokenizer is a GGUF's: every `tokenizer.*`
field is copied from a GGUF (the one the model was imported or retrofitted from), since llama.cpp needs its
pre-tokenizer name and merges in GGUF form.
"""

from __future__ import annotations

from pathlib import Path

import torch

from qkvlab.base.errors import UserError
from qkvlab.base.files import atomic_path
from qkvlab.convert.hf import ADAPTERS, to_hf
from qkvlab.convert.hf_deepseek import DENSE_MOE, deepseek_tensors, is_mla, rotary_rows
from qkvlab.model.attention import LATENT_NORM_EPS
from qkvlab.model.config import ModelConfig
from qkvlab.model.transformer import GPT

_MLP_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_LAYER_NAMES = {  # HF name in a layer -> GGUF name, per architecture
    "llama": _MLP_NAMES
    | {
        "self_attn.q_proj.weight": "attn_q.weight",
        "self_attn.k_proj.weight": "attn_k.weight",
        "self_attn.v_proj.weight": "attn_v.weight",
    },
    "deepseek2": _MLP_NAMES
    | {
        "self_attn.q_proj.weight": "attn_q.weight",
        "self_attn.kv_a_proj_with_mqa.weight": "attn_kv_a_mqa.weight",
        "self_attn.kv_a_layernorm.weight": "attn_kv_a_norm.weight",
        "self_attn.kv_b_proj.weight": "attn_k_b.weight",  # and attn_v_b.weight (split_kv_b)
    },
}
_GLOBAL_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}


def gguf_arch(cfg: ModelConfig) -> str:
    return "deepseek2" if is_mla(cfg) else "llama"


def split_kv_b(t: torch.Tensor, cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """kv_b_proj (n_head (nope + v), r) -> attn_k_b (n_head, r, nope), attn_v_b (n_head, v, r), as llama.cpp's
    converter splits it: the absorbed form multiplies the query by k_b and the attention output by v_b."""
    kv_b = t.view(cfg.n_head, 2 * cfg.head_dim, cfg.kv_latent)
    k_b, v_b = kv_b.split((cfg.head_dim, cfg.head_dim), dim=1)
    return k_b.transpose(1, 2).contiguous(), v_b.contiguous()


def hf_tensors(model: GPT, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The transformers export's tensors (float32): DeepSeek's for MLA, Llama's (q/k rows interleaved) else."""
    model = model.float()
    if is_mla(cfg):
        return deepseek_tensors(model, cfg)  # rotated rows already interleaved: DeepSeek's own layout
    out = {k: v.detach() for k, v in to_hf(model, cfg, "llama").state_dict().items()}
    kv = ADAPTERS["llama"].export_kv_heads(cfg)
    for name in out:
        if name.endswith("self_attn.q_proj.weight"):
            out[name] = rotary_rows(out[name], cfg.n_head)
        elif name.endswith("self_attn.k_proj.weight"):
            out[name] = rotary_rows(out[name], kv)
    return out


def gguf_tensors(model: GPT, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """GGUF name -> float32 tensor, from the transformers export of `model`."""
    arch, out = gguf_arch(cfg), {}
    for name, t in hf_tensors(model, cfg).items():
        t = t.detach().float().contiguous()
        if name in _GLOBAL_NAMES:
            out[_GLOBAL_NAMES[name]] = t
        elif name == "lm_head.weight":
            if not cfg.tie_embeddings:  # a tied head is llama.cpp's token_embd read twice
                out["output.weight"] = t
        elif name.startswith("model.layers."):
            i, rest = name[len("model.layers.") :].split(".", 1)
            if rest not in _LAYER_NAMES[arch]:
                raise UserError(f"GGUF export: no llama.cpp name for the tensor {name} (biases are not supported)")
            if rest == "self_attn.kv_b_proj.weight":
                out[f"blk.{i}.attn_k_b.weight"], out[f"blk.{i}.attn_v_b.weight"] = split_kv_b(t, cfg)
            else:
                out[f"blk.{i}.{_LAYER_NAMES[arch][rest]}"] = t
        else:
            raise UserError(f"GGUF export: no llama.cpp name for the tensor {name}")
    return out


def read_vocab(path: str | Path):
    """A GGUF reader of `path` that holds a tokenizer, or one line saying why not."""
    import gguf  # optional: gguf (the hf extra)

    try:
        reader = gguf.GGUFReader(Path(path))
    except Exception as e:  # a truncated or foreign file: gguf raises ValueError, struct errors, ...
        raise UserError(f"{path}: not a readable GGUF file ({str(e).splitlines()[0][:120]})") from None
    if "tokenizer.ggml.tokens" not in reader.fields:
        raise UserError(f"{path}: a GGUF without a tokenizer (no tokenizer.ggml.tokens)")
    return reader


def _llama_fields(w, cfg: ModelConfig) -> None:
    w.add_head_count_kv(ADAPTERS["llama"].export_kv_heads(cfg))
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.norm_eps)


def _deepseek2_fields(w, cfg: ModelConfig) -> None:
    """What conversion/deepseek.py writes from the DeepSeek export's config.json, and q_lora_rank = 0."""
    import gguf  # optional: gguf (the hf extra)

    r, p, hd = cfg.kv_latent, cfg.rope_dim, cfg.head_dim
    w.add_head_count_kv(1)  # the absorbed form is MQA: one cached row read by every head
    w.add_layer_norm_rms_eps(LATENT_NORM_EPS)  # = cfg.norm_eps (hf_deepseek.check_deepseek)
    w.add_leading_dense_block_count(cfg.n_layer)
    w.add_q_lora_rank(0)
    w.add_kv_lora_rank(r)
    w.add_key_length(r + p)  # the cached row, read as one MQA key ...
    w.add_value_length(r)  # ... whose latent part is the value
    w.add_key_length_mla(hd + p)  # the explicit form's head: its scale is (hd + p)^-1/2
    w.add_value_length_mla(hd)
    w.add_rope_dimension_count(p)
    w.add_expert_feed_forward_length(cfg.hidden)
    w.add_expert_count(DENSE_MOE["n_routed_experts"])
    w.add_expert_used_count(DENSE_MOE["num_experts_per_tok"])
    w.add_expert_group_count(DENSE_MOE["n_group"])
    w.add_expert_group_used_count(DENSE_MOE["topk_group"])
    w.add_expert_shared_count(DENSE_MOE["n_shared_experts"])
    w.add_expert_weights_scale(DENSE_MOE["routed_scaling_factor"])
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SOFTMAX)


def write_gguf(model: GPT, cfg: ModelConfig, path: str | Path, vocab_from: str | Path, name: str = "qkvlab") -> str:
    """`path` (written atomically): the model in F32 with the tokenizer fields of the GGUF `vocab_from`; the
    architecture written (llama or deepseek2)."""
    import gguf  # optional: gguf (the hf extra)

    if cfg.bias:
        raise UserError("GGUF export: a model with biases has no llama.cpp layout here (bias=False only)")
    reader = read_vocab(vocab_from)
    size = len(reader.fields["tokenizer.ggml.tokens"].data)
    if size != cfg.vocab_size:
        raise UserError(f"{vocab_from} has a vocabulary of {size}; the model's is {cfg.vocab_size} tokens")
    arch, tensors = gguf_arch(cfg), gguf_tensors(model, cfg)
    with atomic_path(path, needed=sum(t.numel() * 4 for t in tensors.values())) as tmp:
        w = gguf.GGUFWriter(str(tmp), arch)
        w.add_name(name)
        w.add_context_length(cfg.context)
        w.add_embedding_length(cfg.d_model)
        w.add_block_count(cfg.n_layer)
        w.add_feed_forward_length(cfg.hidden)
        w.add_head_count(cfg.n_head)
        w.add_rope_freq_base(cfg.rope_theta)
        (_deepseek2_fields if arch == "deepseek2" else _llama_fields)(w, cfg)
        w.add_vocab_size(cfg.vocab_size)
        w.add_file_type(gguf.LlamaFileType.ALL_F32)
        for field in reader.fields.values():
            if field.name.startswith("tokenizer."):
                sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
                w.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub)
        for key, t in tensors.items():
            w.add_tensor(key, t.numpy())
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    return arch
