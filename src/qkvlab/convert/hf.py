"""Hugging Face interop: import GPT2LMHeadModel / LlamaForCausalLM, export to them.

Import maps a transformers model's weights onto a qkvlab ``GPT`` of the same architecture:
GPT-2 (Conv1D weights are stored (in, out): transposed; ``gelu_new`` = our ``gelu_tanh``;
LayerNorm with bias; learned positions; tied head; scale 1/sqrt(d_h)) and Llama (RMSNorm, rotary
in the rotate_half layout = our ``Rotary``, SwiGLU = ``mlp.gate/up/down``, GQA, untied or tied
head). A GGUF file is read through transformers (``gguf_file=``); its dequantised weights are
cached as a safetensors checkpoint keyed by the file's sha256, so dequantisation runs once.

Export writes any qkvlab model a standard class can hold, with the reduced projections made
explicit: an identity role becomes W = (s * sqrt(d_h)) * I under the class's fixed 1/sqrt(d_h)
scale (s is qkvlab's score scale, folded into the query), shared roles become duplicated weights,
GQA becomes Llama's num_key_value_heads (GPT-2 has none: key/value heads are repeated). The memory
savings of the reduced schemes are lost in the export; they need qkvlab's own runtime.

Over 400 lines: two architectures (GPT-2, Llama) in both directions, each a flat weight map
that reads best in one place.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from qkvlab.config import ModelConfig
from qkvlab.convert.reparam import role_weights
from qkvlab.errors import UserError
from qkvlab.io import file_sha256, is_model_folder, read_json
from qkvlab.model import GPT
from qkvlab.spec import ROLES

GPT2_ACT = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu", "relu": "relu"}
GPT2_ACT_OUT = {"gelu_tanh": "gelu_new", "gelu": "gelu", "relu": "relu"}
FORMATS = ("gpt2", "llama")


def _transformers():
    try:
        import transformers
    except ImportError:
        raise UserError("Hugging Face interop needs transformers: pip install 'qkvlab[hf]'") from None
    return transformers


def quiet() -> None:
    """For the CLI: no progress bars or advisory warnings from transformers on our output."""
    tf = _transformers()
    tf.utils.logging.set_verbosity_error()
    tf.utils.logging.disable_progress_bar()


# ---- reading an HF checkpoint ---------------------------------------------------------------
def _cache_root() -> Path:
    from qkvlab.data.text import cache_dir

    return cache_dir() / "gguf"


def load_hf(path: str | Path, *, cache: bool = True):
    """A transformers causal LM from a folder (config.json + safetensors) or a .gguf file, fp32.

    Pickled weights (pytorch_model.bin) are refused: they can run code when loaded."""
    tf = _transformers()
    path = Path(path)
    if not path.exists():
        raise UserError(f"{path}: no such file or folder (expected a Hugging Face model folder or a .gguf file)")
    if path.is_file() and path.suffix == ".gguf":
        return _load_gguf(path, cache=cache)
    if path.is_file():
        raise UserError(
            f"{path}: a file; give the Hugging Face model folder (config.json + model.safetensors) or a .gguf file"
        )
    ggufs = sorted(path.glob("*.gguf"))
    if not (path / "config.json").exists():
        if len(ggufs) == 1:
            return _load_gguf(ggufs[0], cache=cache)
        raise UserError(
            f"{path}: no config.json (not a Hugging Face model folder); qkvlab model folders are read without --from-hf"
        )
    body = read_json(path / "config.json")
    if is_model_folder(path):
        raise UserError(f"{path}: a qkvlab model folder, not a Hugging Face one; drop --from-hf")
    kind = body.get("model_type")
    if kind not in FORMATS:
        raise UserError(f"{path}: model_type {kind!r} is not supported; qkvlab imports {', '.join(FORMATS)}")
    if not list(path.glob("*.safetensors")):
        pickles = [p.name for p in path.glob("*.bin")] + [p.name for p in path.glob("*.pt*")]
        what = (
            f"only {pickles[0]} (a pickle, which can run code when loaded)" if pickles else "no *.safetensors weights"
        )
        raise UserError(f"{path}: {what}; qkvlab reads Hugging Face weights only as safetensors")
    try:
        model = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, use_safetensors=True)
    except Exception as e:  # transformers raises many kinds; report one line
        raise UserError(f"{path}: transformers could not load it ({str(e).splitlines()[0][:200]})") from None
    return model.eval()


def gguf_cache_folder(file: str | Path) -> Path:
    """Where the dequantised copy of a GGUF lives: <qkvlab cache>/gguf/<sha256[:16]>/ (transformers
    layout: config.json, model.safetensors, tokenizer files)."""
    return _cache_root() / file_sha256(file)[:16]


def _load_gguf(file: Path, *, cache: bool):
    """Dequantise through transformers once; later calls read the cached safetensors copy."""
    tf = _transformers()
    folder = gguf_cache_folder(file)
    if cache and (folder / "config.json").exists():
        return tf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, use_safetensors=True).eval()
    try:
        model = tf.AutoModelForCausalLM.from_pretrained(file.parent, gguf_file=file.name, dtype=torch.float32)
    except ImportError as e:
        raise UserError(f"{file}: reading GGUF needs the gguf package ({e}); pip install 'qkvlab[hf]'") from None
    except Exception as e:
        raise UserError(f"{file}: transformers could not read this GGUF ({str(e).splitlines()[0][:200]})") from None
    if model.config.model_type not in FORMATS:
        raise UserError(
            f"{file}: model_type {model.config.model_type!r} is not supported; qkvlab imports {', '.join(FORMATS)}"
        )
    if not cache:
        return model.eval()
    # A GGUF-loaded model refuses save_pretrained; rebuild a plain one with the same weights.
    config = model.config
    for attr in ("quantization_config", "_pre_quantization_dtype"):
        if hasattr(config, attr):
            delattr(config, attr)
    plain = type(model)(config)
    plain.load_state_dict(model.state_dict())
    del model
    from qkvlab.io import atomic_dir

    with atomic_dir(folder) as tmp:
        plain.save_pretrained(tmp)
        try:
            tok = tf.AutoTokenizer.from_pretrained(file.parent, gguf_file=file.name)
            tok.save_pretrained(tmp)
        except Exception:  # the tokenizer is a convenience for generation; weights are what matter
            pass
        (tmp / "SOURCE").write_text(f"{file.name}\n")
    return tf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, use_safetensors=True).eval()


# ---- import ---------------------------------------------------------------------------------
def from_hf(hf_model) -> tuple[GPT, ModelConfig]:
    """qkvlab GPT (float32) with the weights of a GPT2LMHeadModel or LlamaForCausalLM."""
    kind = getattr(hf_model.config, "model_type", None)
    if kind == "gpt2":
        return _from_gpt2(hf_model)
    if kind == "llama":
        return _from_llama(hf_model)
    raise UserError(f"model_type {kind!r} is not supported; qkvlab imports {', '.join(FORMATS)}")


def _build(cfg: ModelConfig, st: dict[str, torch.Tensor]) -> tuple[GPT, ModelConfig]:
    model = GPT(cfg)
    expected = model.state_dict()
    for name, t in st.items():
        if name not in expected or tuple(t.shape) != tuple(expected[name].shape):
            raise UserError(
                f"weight {name}: shape {tuple(t.shape)} does not fit the config ({tuple(expected.get(name, torch.empty(0)).shape)})"
            )
    missing = [n for n in expected if n not in st and not (n == "lm_head.weight" and cfg.tie_embeddings)]
    for n in missing:  # biases the source lacks (e.g. Llama's MLP when only attention has them) are zero
        if n.endswith(".bias"):
            st[n] = torch.zeros_like(expected[n])
        else:
            raise UserError(f"the checkpoint has no weight for {n}")
    model.load_state_dict({k: v.float() for k, v in st.items()}, strict=False)
    return model.eval(), cfg


def _from_gpt2(hf) -> tuple[GPT, ModelConfig]:
    c = hf.config
    if c.activation_function not in GPT2_ACT:
        raise UserError(
            f"GPT-2 activation_function={c.activation_function!r} is not supported; allowed: {', '.join(GPT2_ACT)}"
        )
    if getattr(c, "scale_attn_by_inverse_layer_idx", False):
        raise UserError(
            "GPT-2 scale_attn_by_inverse_layer_idx=True: a per-layer score scale has no qkvlab config value"
        )
    if getattr(c, "add_cross_attention", False):
        raise UserError("GPT-2 add_cross_attention=True: cross-attention is not part of a decoder-only qkvlab model")
    d, nh = c.n_embd, c.n_head
    cfg = ModelConfig(
        attn="Q-K-V",
        n_layer=c.n_layer,
        n_head=nh,
        d_model=d,
        mlp=GPT2_ACT[c.activation_function],
        mlp_hidden=c.n_inner or 4 * d,
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
    sd = hf.state_dict()
    st = {
        "tok_emb.weight": sd["transformer.wte.weight"],
        "pos_emb.weight": sd["transformer.wpe.weight"],
        "trunk.norm.weight": sd["transformer.ln_f.weight"],
        "trunk.norm.bias": sd["transformer.ln_f.bias"],
    }
    if not cfg.tie_embeddings:
        st["lm_head.weight"] = sd["lm_head.weight"]
    for i in range(c.n_layer):
        h, p = f"transformer.h.{i}.", f"trunk.blocks.{i}."
        for ours, theirs in (("norm1", "ln_1"), ("norm2", "ln_2")):
            st[p + ours + ".weight"], st[p + ours + ".bias"] = sd[h + theirs + ".weight"], sd[h + theirs + ".bias"]
        # Conv1D stores (in, out): our Linear wants (out, in).
        for ours, theirs in (
            ("attn.in_proj", "attn.c_attn"),
            ("attn.out_proj", "attn.c_proj"),
            ("mlp.up", "mlp.c_fc"),
            ("mlp.down", "mlp.c_proj"),
        ):
            st[p + ours + ".weight"] = sd[h + theirs + ".weight"].T.contiguous()
            st[p + ours + ".bias"] = sd[h + theirs + ".bias"]
    return _build(cfg, st)


def _rope_theta(c) -> float:
    params = getattr(c, "rope_parameters", None) or {}
    kind = params.get("rope_type", "default")
    scaling = getattr(c, "rope_scaling", None)
    if kind != "default" or (
        isinstance(scaling, dict) and scaling.get("rope_type", scaling.get("type")) not in (None, "default")
    ):
        raise UserError(f"Llama rope_type={kind!r}: only the default rotary embedding maps onto qkvlab's pos=rope")
    return float(params.get("rope_theta", getattr(c, "rope_theta", 10000.0)))


def _from_llama(hf) -> tuple[GPT, ModelConfig]:
    c = hf.config
    if c.hidden_act != "silu":
        raise UserError(
            f"Llama hidden_act={c.hidden_act!r}: qkvlab's gated MLP is SwiGLU (silu); other gates have no config value"
        )
    nh = c.num_attention_heads
    hd = getattr(c, "head_dim", None) or c.hidden_size // nh
    bias = bool(getattr(c, "attention_bias", False) or getattr(c, "mlp_bias", False))
    cfg = ModelConfig(
        attn="Q-K-V",
        n_layer=c.num_hidden_layers,
        n_head=nh,
        d_model=c.hidden_size,
        d_head=hd,
        kv_heads=c.num_key_value_heads or nh,
        mlp="swiglu",
        mlp_hidden=c.intermediate_size,
        norm="rmsnorm",
        norm_eps=float(c.rms_norm_eps),
        pos="rope",
        rope_theta=_rope_theta(c),
        vocab_size=c.vocab_size,
        context=c.max_position_embeddings,
        bias=bias,
        dropout=0.0,
        tie_embeddings=bool(getattr(c, "tie_word_embeddings", False)),
    ).validate()
    sd = hf.state_dict()
    st = {"tok_emb.weight": sd["model.embed_tokens.weight"], "trunk.norm.weight": sd["model.norm.weight"]}
    if not cfg.tie_embeddings:
        st["lm_head.weight"] = sd["lm_head.weight"]
    for i in range(c.num_hidden_layers):
        h, p = f"model.layers.{i}.", f"trunk.blocks.{i}."
        st[p + "norm1.weight"] = sd[h + "input_layernorm.weight"]
        st[p + "norm2.weight"] = sd[h + "post_attention_layernorm.weight"]
        st[p + "attn.in_proj.weight"] = torch.cat([sd[h + f"self_attn.{r}_proj.weight"] for r in "qkv"], 0)
        if h + "self_attn.q_proj.bias" in sd:
            st[p + "attn.in_proj.bias"] = torch.cat([sd[h + f"self_attn.{r}_proj.bias"] for r in "qkv"], 0)
        for ours, theirs in (
            ("attn.out_proj", "self_attn.o_proj"),
            ("mlp.gate", "mlp.gate_proj"),
            ("mlp.up", "mlp.up_proj"),
            ("mlp.down", "mlp.down_proj"),
        ):
            st[p + ours + ".weight"] = sd[h + theirs + ".weight"]
            if h + theirs + ".bias" in sd:
                st[p + ours + ".bias"] = sd[h + theirs + ".bias"]
    return _build(cfg, st)


# ---- export ---------------------------------------------------------------------------------
def _check_exportable(cfg: ModelConfig, fmt: str) -> None:
    why = f"cannot export {cfg.scheme_label} to {fmt}"
    if any(lc.spec.plus for lc in cfg.layer_configs()):
        raise UserError(f"{why}: the '+' schemes' learned 2D score term has no place in a standard transformers class")
    if not cfg.mlp_skip:
        raise UserError(f"{why}: mlp_skip=False (no skip around the MLP) is not a standard block")
    if not cfg.causal:
        raise UserError(f"{why}: a bidirectional model is not a causal LM")
    if cfg.norm_position != "pre":
        raise UserError(f"{why}: norm_position={cfg.norm_position} (that class has pre-norm blocks)")
    need = {
        "gpt2": dict(norm=("layernorm",), pos=("learned", "none"), mlp=tuple(GPT2_ACT_OUT)),
        "llama": dict(norm=("rmsnorm",), pos=("rope",), mlp=("swiglu",)),
    }[fmt]
    for key, allowed in need.items():
        if getattr(cfg, key) not in allowed:
            raise UserError(f"{why}: {key}={getattr(cfg, key)} (that class needs {' or '.join(allowed)})")
    if fmt == "gpt2" and cfg.n_head * cfg.head_dim != cfg.d_model:
        raise UserError(
            f"{why}: GPT-2 needs n_head*d_head == d_model, got {cfg.n_head}*{cfg.head_dim} != {cfg.d_model}"
        )


def _explicit_roles(block, cfg: ModelConfig, dtype, device) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
    """Per role an explicit (weight, bias); the score scale folded into the query so the class's
    fixed 1/sqrt(d_h) reproduces it. cfg: the block's layer config."""
    out = {}
    for r, wb in role_weights(block, cfg.spec).items():
        if wb is None:
            out[r] = (torch.eye(cfg.d_model, dtype=dtype, device=device), None)
        else:
            out[r] = (wb[0].detach().to(dtype), None if wb[1] is None else wb[1].detach().to(dtype))
    factor = cfg.scale * math.sqrt(cfg.head_dim)
    w, b = out["q"]
    out["q"] = (w * factor, None if b is None else b * factor)
    return out


def to_hf(model: GPT, cfg: ModelConfig, fmt: str):
    """A transformers model (same dtype as `model`) computing the same logits."""
    tf = _transformers()
    if fmt not in FORMATS:
        raise UserError(f"--to-hf {fmt!r}: allowed {', '.join(FORMATS)}")
    _check_exportable(cfg, fmt)
    dtype, device = model.tok_emb.weight.dtype, model.tok_emb.weight.device  # every tensor made here goes there
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    nh, hd, d = cfg.n_head, cfg.head_dim, cfg.d_model
    # One num_key_value_heads for all layers: layers with fewer kv heads repeat theirs (exact: query
    # head h reads kv head h // (nh / kv) either way).
    kv = math.lcm(*(lc.n_kv_heads for lc in cfg.layer_configs()))
    st: dict[str, torch.Tensor] = {}

    def bias_or_zero(b, n):
        return b if b is not None else torch.zeros(n, dtype=dtype, device=device)

    if fmt == "gpt2":
        hf_cfg = tf.GPT2Config(
            vocab_size=cfg.vocab_size,
            n_positions=cfg.context,
            n_embd=d,
            n_layer=cfg.n_layer,
            n_head=nh,
            n_inner=cfg.hidden,
            activation_function=GPT2_ACT_OUT[cfg.mlp],
            layer_norm_epsilon=cfg.norm_eps,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            tie_word_embeddings=cfg.tie_embeddings,
            bos_token_id=None,
            eos_token_id=None,  # GPT-2's 50256 need not exist in this vocabulary
        )
        st["transformer.wte.weight"] = sd["tok_emb.weight"]
        st["transformer.wpe.weight"] = (
            sd["pos_emb.weight"] if cfg.pos == "learned" else torch.zeros(cfg.context, d, dtype=dtype, device=device)
        )
        st["transformer.ln_f.weight"] = sd["trunk.norm.weight"]
        st["transformer.ln_f.bias"] = bias_or_zero(sd.get("trunk.norm.bias"), d)
        for i in range(cfg.n_layer):
            blk, p, h = model.trunk.layer(i), f"trunk.blocks.{0 if cfg.share_layers else i}.", f"transformer.h.{i}."
            roles = _explicit_roles(blk, cfg.layer_config(i), dtype, device)
            ws, bs = [], []
            for r in ROLES:  # GPT-2 has no GQA: repeat each key/value head for its query heads
                w, b = roles[r]
                n_heads_r = w.shape[0] // hd
                if n_heads_r != nh:
                    rep = nh // n_heads_r
                    w = w.view(n_heads_r, hd, d).repeat_interleave(rep, 0).reshape(nh * hd, d)
                    b = None if b is None else b.view(n_heads_r, hd).repeat_interleave(rep, 0).reshape(-1)
                ws.append(w)
                bs.append(bias_or_zero(b, nh * hd))
            st[h + "attn.c_attn.weight"] = torch.cat(ws, 0).T.contiguous()
            st[h + "attn.c_attn.bias"] = torch.cat(bs, 0)
            for ours, theirs, n_out in (
                ("attn.out_proj", "attn.c_proj", d),
                ("mlp.up", "mlp.c_fc", cfg.hidden),
                ("mlp.down", "mlp.c_proj", d),
            ):
                st[h + theirs + ".weight"] = sd[p + ours + ".weight"].T.contiguous()
                st[h + theirs + ".bias"] = bias_or_zero(sd.get(p + ours + ".bias"), n_out)
            for ours, theirs in (("norm1", "ln_1"), ("norm2", "ln_2")):
                st[h + theirs + ".weight"] = sd[p + ours + ".weight"]
                st[h + theirs + ".bias"] = bias_or_zero(sd.get(p + ours + ".bias"), d)
        if not cfg.tie_embeddings:
            st["lm_head.weight"] = sd["lm_head.weight"]
        hf = tf.GPT2LMHeadModel(hf_cfg)
    else:
        hf_cfg = tf.LlamaConfig(
            vocab_size=cfg.vocab_size,
            hidden_size=d,
            intermediate_size=cfg.hidden,
            num_hidden_layers=cfg.n_layer,
            num_attention_heads=nh,
            num_key_value_heads=kv,
            head_dim=hd,
            hidden_act="silu",
            max_position_embeddings=cfg.context,
            rms_norm_eps=cfg.norm_eps,
            tie_word_embeddings=cfg.tie_embeddings,
            rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
            attention_bias=cfg.bias,
            mlp_bias=cfg.bias,
            attention_dropout=0.0,
        )
        st["model.embed_tokens.weight"] = sd["tok_emb.weight"]
        st["model.norm.weight"] = sd["trunk.norm.weight"]
        for i in range(cfg.n_layer):
            blk, p, h = model.trunk.layer(i), f"trunk.blocks.{0 if cfg.share_layers else i}.", f"model.layers.{i}."
            roles = _explicit_roles(blk, cfg.layer_config(i), dtype, device)
            for r in ROLES:
                w, b = roles[r]
                n_heads_r = w.shape[0] // hd
                if r != "q" and n_heads_r != kv:
                    w = w.view(n_heads_r, hd, d).repeat_interleave(kv // n_heads_r, 0).reshape(kv * hd, d)
                    b = None if b is None else b.view(n_heads_r, hd).repeat_interleave(kv // n_heads_r, 0).reshape(-1)
                st[h + f"self_attn.{r}_proj.weight"] = w.clone()  # K=V: two copies of one tensor
                if cfg.bias:
                    st[h + f"self_attn.{r}_proj.bias"] = bias_or_zero(b, w.shape[0]).clone()
            for ours, theirs in (
                ("attn.out_proj", "self_attn.o_proj"),
                ("mlp.gate", "mlp.gate_proj"),
                ("mlp.up", "mlp.up_proj"),
                ("mlp.down", "mlp.down_proj"),
            ):
                st[h + theirs + ".weight"] = sd[p + ours + ".weight"]
                if cfg.bias:
                    st[h + theirs + ".bias"] = sd[p + ours + ".bias"]
            st[h + "input_layernorm.weight"] = sd[p + "norm1.weight"]
            st[h + "post_attention_layernorm.weight"] = sd[p + "norm2.weight"]
        if not cfg.tie_embeddings:
            st["lm_head.weight"] = sd["lm_head.weight"]
        hf = tf.LlamaForCausalLM(hf_cfg)
    hf = hf.to(dtype)
    expected = set(hf.state_dict())
    if cfg.tie_embeddings:
        expected.discard("lm_head.weight")
    missing = expected - set(st)
    if missing:  # a mapping bug, not bad input
        raise RuntimeError(f"export to {fmt}: no value for {sorted(missing)[0]}")
    hf.load_state_dict({k: v.contiguous().clone() for k, v in st.items()}, strict=False)
    if cfg.tie_embeddings:
        hf.tie_weights()
    return hf.eval()


def save_hf(hf_model, folder: Path) -> None:
    """safetensors + config.json, loadable with AutoModelForCausalLM and no custom code."""
    hf_model.save_pretrained(folder, safe_serialization=True)
