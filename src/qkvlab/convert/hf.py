"""Hugging Face interop: import GPT2LMHeadModel / LlamaForCausalLM, export to them.

Import maps a transformers model's weights onto a qkvlab ``GPT`` of the same architecture through
that architecture's state-dict adapter (hf_gpt2.py, hf_llama.py: a name map each way, see
hf_adapter.py) and the one loader, qkvlab.model.folder.build_model_from_state (strict). A GGUF file is read through transformers (``gguf_file=``); its dequantised weights are
cached as a safetensors checkpoint keyed by the file's sha256, so dequantisation runs once.

Export writes any qkvlab model a standard class can hold, with the reduced projections made
explicit: an identity role becomes W = (s * sqrt(d_h)) * I under the class's fixed 1/sqrt(d_h)
scale (s is qkvlab's score scale, folded into the query), shared roles become duplicated weights,
GQA becomes Llama's num_key_value_heads (GPT-2 has none: key/value heads are repeated). The memory
savings of the reduced schemes are lost in the export; they need qkvlab's own runtime.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import torch

from qkvlab.base.errors import UserError
from qkvlab.base.files import atomic_dir, cache_dir, file_sha256
from qkvlab.base.model_files import check_folder, json_key, member, read_json
from qkvlab.convert.hf_adapter import StateDictAdapter
from qkvlab.convert.hf_gpt2 import GPT2Adapter
from qkvlab.convert.hf_llama import LlamaAdapter
from qkvlab.convert.reparam import role_weights
from qkvlab.model.config import ModelConfig
from qkvlab.model.folder import build_model_from_state, check_declared_size, is_model_folder, safetensors_keys
from qkvlab.model.limits import check_model
from qkvlab.model.spec import ROLES
from qkvlab.model.transformer import GPT

INDEX = "model.safetensors.index.json"
ADAPTERS: dict[str, StateDictAdapter] = {a.model_type: a for a in (GPT2Adapter(), LlamaAdapter())}
FORMATS = tuple(ADAPTERS)


def _transformers():
    try:
        import transformers  # optional: transformers
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
    return cache_dir() / "gguf"


def load_hf(path: str | Path, *, cache: bool = True):
    """A transformers causal LM from a folder (config.json + safetensors) or a .gguf file, fp32.

    Pickled weights (pytorch_model.bin) are refused: they can run code when loaded. The folder is read
    as data first (`check_hf_folder`): transformers then reads only files that resolve inside it, of
    bounded size, under a config whose model fits the weights it ships."""
    tf = _transformers()
    path = Path(path)
    if not path.exists():
        raise UserError(f"{path}: no such file or folder (expected a Hugging Face model folder or a .gguf file)")
    if path.is_file() and path.suffix == ".gguf":
        return _load_gguf(
            member(path.parent, path.name, "weights", within=Path(os.path.realpath(path)).parent), cache=cache
        )
    if path.is_file():
        raise UserError(
            f"{path}: a file; give the Hugging Face model folder (config.json + model.safetensors) or a .gguf file"
        )
    ggufs = sorted(path.glob("*.gguf"))
    if not os.path.lexists(path / "config.json"):
        if len(ggufs) == 1:
            return _load_gguf(member(path, ggufs[0].name, "weights"), cache=cache)
        raise UserError(
            f"{path}: no config.json (not a Hugging Face model folder); qkvlab model folders are read without --from-hf"
        )
    config = hf_config(path)
    try:
        model = tf.AutoModelForCausalLM.from_pretrained(
            path, config=config, dtype=torch.float32, use_safetensors=True, local_files_only=True
        )
    except Exception as e:  # transformers raises many kinds; report one line
        raise UserError(f"{path}: transformers could not load it ({str(e).splitlines()[0][:200]})") from None
    return model.eval()


def check_hf_folder(path: Path) -> tuple[dict[str, Any], list[Path]]:
    """A Hugging Face model folder read as data, before transformers reads it: config.json a JSON
    object naming a supported model_type and no custom code, the safetensors weights (model.safetensors,
    or the shards its index names) inside the folder with readable headers, every other entry inside
    the folder (qkvlab.base.model_files). -> (config.json's body, the weights files)."""
    body = read_json(path, "config.json")
    if is_model_folder(path):
        raise UserError(f"{path}: a qkvlab model folder, not a Hugging Face one; drop --from-hf")
    kind = json_key(body, "model_type", str, path / "config.json", default=None)
    if kind not in FORMATS:
        raise UserError(f"{path}: model_type {kind!r} is not supported; qkvlab imports {', '.join(FORMATS)}")
    if "auto_map" in body:
        raise UserError(
            f"{path / 'config.json'}: its auto_map names custom code; qkvlab runs no code from a model folder"
        )
    read_json(path, "generation_config.json", missing_ok=True)  # transformers reads it too: valid JSON or refused
    weights = _weights_files(path)
    check_folder(path, names=[w.name for w in weights])
    for file in weights:
        safetensors_keys(file)
    return body, weights


def _weights_files(path: Path) -> list[Path]:
    index = read_json(path, INDEX, "weights index", missing_ok=True)
    if index is not None:
        where = f"{path / INDEX}'s weight_map"
        shards = json_key(index, "weight_map", dict, path / INDEX)
        return [member(path, name, "weights", named_by=where) for name in sorted(set(shards.values()), key=str)]
    single = member(path, "model.safetensors", "weights", missing_ok=True)
    if single is not None:
        return [single]
    pickles = [p.name for p in path.glob("*.bin")] + [p.name for p in path.glob("*.pt*")]
    what = f"only {pickles[0]} (a pickle, which can run code when loaded)" if pickles else "no model.safetensors"
    raise UserError(f"{path}: {what}; qkvlab reads Hugging Face weights only as safetensors")


def hf_config(path: Path):
    """The transformers config of a checked folder (`check_hf_folder`), refused when the model it
    declares is larger than its weights files or than this machine's memory (before transformers
    builds it: a config.json saying 100,000 layers would take minutes and gigabytes to refuse later)."""
    tf = _transformers()
    _, weights = check_hf_folder(path)
    try:
        config = tf.AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    except Exception as e:  # transformers validates its fields with many kinds of errors
        raise UserError(f"{path / 'config.json'}: transformers refused it ({str(e).splitlines()[0][:200]})") from None
    cfg = imported_config(config, path / "config.json")
    stored = sum(w.stat().st_size for w in weights)
    check_declared_size(cfg, stored, path / "config.json", "its weights files")
    check_model(cfg, f"the model in {path}")
    return config


def imported_config(hf_config, where: str | Path) -> ModelConfig:
    """The qkvlab config of an HF config; a value the adapter cannot map is one line naming `where`."""
    a = adapter(getattr(hf_config, "model_type", None))
    try:
        return a.model_config(hf_config)
    except UserError as e:
        raise UserError(f"{where}: {e}") from None
    except (TypeError, ValueError, ArithmeticError, AttributeError, KeyError) as e:
        raise UserError(f"{where}: a value qkvlab cannot read ({type(e).__name__}: {str(e)[:160]})") from None


def gguf_cache_folder(file: str | Path) -> Path:
    """Where the dequantised copy of a GGUF lives: <qkvlab cache>/gguf/<sha256[:16]>/ (transformers
    layout: config.json, model.safetensors, tokenizer files)."""
    return _cache_root() / file_sha256(file)[:16]


def check_gguf(file: Path) -> None:
    """A GGUF file read as data before transformers dequantises it: readable by the gguf package, and
    the model its metadata declares no larger than the tensors it holds (a block_count of 100,000 over
    a few tensors is refused here, not built)."""
    try:
        import gguf  # optional: gguf (the hf extra)
    except ImportError as e:
        raise UserError(f"{file}: reading GGUF needs the gguf package ({e}); pip install 'qkvlab[hf]'") from None
    try:
        reader = gguf.GGUFReader(file)
        arch = _gguf_value(reader, "general.architecture")
        dims = [_gguf_value(reader, f"{arch}.{k}") for k in ("embedding_length", "block_count", "feed_forward_length")]
        elements = sum(int(t.n_elements) for t in reader.tensors)
    except Exception as e:  # a truncated or foreign file: gguf raises ValueError, struct and numpy errors, ...
        raise UserError(f"{file}: not a readable GGUF file ({str(e).splitlines()[0][:160]})") from None
    if all(isinstance(x, int) and not isinstance(x, bool) for x in dims):
        d, layers, ff = dims
        declared = layers * (d * d + 2 * d * ff)  # a lower bound for any block: its output projection, up and down
        if declared > elements:
            raise UserError(
                f"{file}: its metadata declare {layers:,} layers of width {d:,} (over {declared:,} parameters) "
                f"but it holds {elements:,}; the file is not a consistent model"
            )


def _gguf_value(reader, name: str):
    field = reader.fields.get(name)
    value = None if field is None else field.contents()
    return value.item() if hasattr(value, "item") else value  # numpy scalars as Python numbers


def _load_gguf(file: Path, *, cache: bool):
    """Dequantise through transformers once; later calls read the cached safetensors copy."""
    tf = _transformers()
    folder = gguf_cache_folder(file)
    if cache and (folder / "config.json").exists():  # this file's own copy (keyed by its sha256): checked then
        return tf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, use_safetensors=True).eval()
    check_gguf(file)
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
    with atomic_dir(folder) as tmp:
        plain.save_pretrained(tmp)
        try:
            tok = tf.AutoTokenizer.from_pretrained(file.parent, gguf_file=file.name)
            tok.save_pretrained(tmp)
        except Exception:  # the tokenizer is a convenience for generation; weights are what matter
            pass
        (tmp / "SOURCE").write_text(f"{file.name}\n")
    return tf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, use_safetensors=True).eval()


# ---- import ----------------------------------------------------------------------------------
def adapter(model_type: str | None) -> StateDictAdapter:
    if model_type not in ADAPTERS:
        raise UserError(f"model_type {model_type!r} is not supported; qkvlab imports {', '.join(FORMATS)}")
    return ADAPTERS[model_type]


def from_hf(hf_model) -> tuple[GPT, ModelConfig]:
    """qkvlab GPT (float32) with the weights of a GPT2LMHeadModel or LlamaForCausalLM."""
    a = adapter(getattr(hf_model.config, "model_type", None))
    cfg = a.model_config(hf_model.config)
    st = {k: v.float() for k, v in a.from_hf(hf_model.state_dict()).items()}
    with torch.device("meta"):  # biases the source lacks (e.g. Llama's MLP when only attention has them) are zero
        expected = GPT(cfg).state_dict()
    st.update({k: torch.zeros(t.shape) for k, t in expected.items() if k.endswith(".bias") and k not in st})
    return build_model_from_state(GPT, cfg, st, f"the {a.model_type} checkpoint").eval(), cfg


# ---- export ---------------------------------------------------------------------------------
def _check_exportable(cfg: ModelConfig, a: StateDictAdapter) -> None:
    why = f"cannot export {cfg.scheme_label} to {a.model_type}"
    if any(lc.spec.plus for lc in cfg.layer_configs()):
        raise UserError(f"{why}: the '+' schemes' learned 2D score term has no place in a standard transformers class")
    if not cfg.mlp_skip:
        raise UserError(f"{why}: mlp_skip=False (no skip around the MLP) is not a standard block")
    if not cfg.causal:
        raise UserError(f"{why}: a bidirectional model is not a causal LM")
    if cfg.norm_position != "pre":
        raise UserError(f"{why}: norm_position={cfg.norm_position} (that class has pre-norm blocks)")
    a.check_export(cfg, why)


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


def _repeat_heads(w: torch.Tensor, b: torch.Tensor | None, hd: int, heads: int):
    """Each of w's heads repeated for the `heads` it must become (GQA -> fewer-kv or no-GQA classes)."""
    have = w.shape[0] // hd
    if have == heads:
        return w, b
    rep = heads // have
    w = w.view(have, hd, -1).repeat_interleave(rep, 0).reshape(heads * hd, -1)
    return w, None if b is None else b.view(have, hd).repeat_interleave(rep, 0).reshape(-1)


def explicit_state(model: GPT, cfg: ModelConfig, kv_heads: int) -> dict[str, torch.Tensor]:
    """model's state as a plain Q-K-V model of kv_heads key/value heads would hold it: every layer
    its own block (shared layers repeated), each in_proj the explicit query, key and value rows
    (identity roles as matrices, shared roles duplicated, kv heads repeated)."""
    dtype, device = model.tok_emb.weight.dtype, model.tok_emb.weight.device
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    st = {k: v for k, v in sd.items() if not k.startswith("trunk.blocks.")}
    for i in range(cfg.n_layer):
        src, dst = f"trunk.blocks.{0 if cfg.share_layers else i}.", f"trunk.blocks.{i}."
        st.update({dst + k[len(src) :]: v for k, v in sd.items() if k.startswith(src) and ".in_proj." not in k})
        roles = _explicit_roles(model.trunk.layer(i), cfg.layer_config(i), dtype, device)
        rows = {r: _repeat_heads(*roles[r], cfg.head_dim, cfg.n_head if r == "q" else kv_heads) for r in ROLES}
        st[dst + "attn.in_proj.weight"] = torch.cat([rows[r][0] for r in ROLES], 0)
        if any(b is not None for _, b in rows.values()):
            zeros = lambda w: torch.zeros(w.shape[0], dtype=dtype, device=device)  # noqa: E731
            st[dst + "attn.in_proj.bias"] = torch.cat([zeros(w) if b is None else b for w, b in rows.values()], 0)
    return st


def to_hf(model: GPT, cfg: ModelConfig, fmt: str):
    """A transformers model (same dtype as `model`) computing the same logits."""
    tf = _transformers()
    if fmt not in FORMATS:
        raise UserError(f"--to-hf {fmt!r}: allowed {', '.join(FORMATS)}")
    a = ADAPTERS[fmt]
    _check_exportable(cfg, a)
    kv = a.export_kv_heads(cfg)
    st = a.to_hf(explicit_state(model, cfg, kv), (cfg.n_head * cfg.head_dim, *[kv * cfg.head_dim] * 2))
    hf = getattr(tf, a.hf_class)(a.hf_config(tf, cfg, kv)).to(model.tok_emb.weight.dtype)
    st = a.complete(st, hf.state_dict(), model.tok_emb.weight.device)
    hf.load_state_dict({k: v.contiguous() for k, v in st.items()}, strict=True)
    if cfg.tie_embeddings:
        hf.tie_weights()
    return hf.eval()


def save_hf(hf_model, folder: Path) -> None:
    """safetensors + config.json, loadable with AutoModelForCausalLM and no custom code."""
    hf_model.save_pretrained(folder, safe_serialization=True)
