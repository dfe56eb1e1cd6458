"""A qkvlab model as a GGUF file (llama architecture, F32) for llama.cpp, through the gguf package.

The weights come from the one transformers export (convert/hf.py's `to_hf(..., "llama")`), so a
per-layer K=V model is an ordinary Llama whose attn_v equals attn_k: the shared tensor is the value
as it is and the key after rotary, which is what llama.cpp's graph computes from two equal
matrices (its cache then holds both; the saving is qkvlab's cache's, not llama.cpp's). GGUF's
names and its rotary row order follow llama.cpp's own convert_hf_to_gguf.py (q and k rows
permuted from the rotate_half layout to interleaved pairs). The tokenizer is a GGUF's: every
`tokenizer.*` field is copied from a GGUF (the one the model was imported or retrofitted from),
since llama.cpp needs its pre-tokenizer name and merges in GGUF form.
"""

from __future__ import annotations

from pathlib import Path

import torch

from qkvlab.base.errors import UserError
from qkvlab.base.files import atomic_path
from qkvlab.convert.hf import ADAPTERS, to_hf
from qkvlab.model.config import ModelConfig
from qkvlab.model.transformer import GPT

_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_GLOBAL_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}


def rotary_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """q/k rows from the rotate_half layout (two halves per head) to GGUF's interleaved pairs."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_tensors(model: GPT, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """GGUF name -> float32 tensor, from the transformers Llama export of `model`."""
    hf = to_hf(model.float(), cfg, "llama")
    kv = ADAPTERS["llama"].export_kv_heads(cfg)
    out: dict[str, torch.Tensor] = {}
    for name, t in hf.state_dict().items():
        t = t.detach().float().contiguous()
        if name in _GLOBAL_NAMES:
            out[_GLOBAL_NAMES[name]] = t
        elif name == "lm_head.weight":
            if not cfg.tie_embeddings:
                out["output.weight"] = t
        elif name.startswith("model.layers."):
            i, rest = name[len("model.layers.") :].split(".", 1)
            if rest not in _LAYER_NAMES:
                raise UserError(f"GGUF export: no llama.cpp name for the tensor {name} (biases are not supported)")
            if rest == "self_attn.q_proj.weight":
                t = rotary_rows(t, cfg.n_head)
            elif rest == "self_attn.k_proj.weight":
                t = rotary_rows(t, kv)
            out[f"blk.{i}.{_LAYER_NAMES[rest]}"] = t
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


def write_gguf(model: GPT, cfg: ModelConfig, path: str | Path, vocab_from: str | Path, name: str = "qkvlab") -> None:
    """`path` (written atomically): the model in F32 with the tokenizer fields of the GGUF `vocab_from`."""
    import gguf  # optional: gguf (the hf extra)

    if cfg.bias:
        raise UserError("GGUF export: a model with biases has no llama.cpp llama layout here (bias=False only)")
    reader = read_vocab(vocab_from)
    size = len(reader.fields["tokenizer.ggml.tokens"].data)
    if size != cfg.vocab_size:
        raise UserError(f"{vocab_from} has a vocabulary of {size}; the model's is {cfg.vocab_size} tokens")
    tensors = gguf_tensors(model, cfg)
    with atomic_path(path, needed=sum(t.numel() * 4 for t in tensors.values())) as tmp:
        w = gguf.GGUFWriter(str(tmp), "llama")
        w.add_name(name)
        w.add_context_length(cfg.context)
        w.add_embedding_length(cfg.d_model)
        w.add_block_count(cfg.n_layer)
        w.add_feed_forward_length(cfg.hidden)
        w.add_head_count(cfg.n_head)
        w.add_head_count_kv(ADAPTERS["llama"].export_kv_heads(cfg))
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
        w.add_rope_dimension_count(cfg.head_dim)
        w.add_rope_freq_base(cfg.rope_theta)
        w.add_layer_norm_rms_eps(cfg.norm_eps)
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
